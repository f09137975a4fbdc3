-- Re-issue the token of a lock this lease holds, after raising the counter to a floor.
-- Used when acquire found a fresh counter (data lost, or a counter that expired idle) and
-- Postgres knows a higher mark.
-- KEYS[1] = lock key, KEYS[2] = fence counter
-- ARGV[1] = "<owner>:<old token>", ARGV[2] = owner, ARGV[3] = floor, ARGV[4] = the token
-- limit (pgfence::MAX_TOKEN), ARGV[5] = old token (decimals without leading zeros)
-- Returns the new token (decimal text), or 0 if the lease no longer holds the lock, or -1
-- when the new token would pass the limit: the acquire is then undone (the lock deleted, and
-- the counter the acquire created deleted again unless it has issued another token since),
-- so it changes nothing.
local function less(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local cur = redis.call('GET', KEYS[2]) or '0'
local top = cur
if less(cur, ARGV[3]) then top = ARGV[3] end
if not less(top, ARGV[4]) then
  redis.call('DEL', KEYS[1])
  if cur == ARGV[5] then redis.call('DEL', KEYS[2]) end
  return -1
end
-- KEEPTTL: a counter that expires idle keeps the expiry the acquire gave it.
if less(cur, ARGV[3]) then redis.call('SET', KEYS[2], ARGV[3], 'KEEPTTL') end
redis.call('INCR', KEYS[2])
local token = redis.call('GET', KEYS[2])
redis.call('SET', KEYS[1], ARGV[2] .. ':' .. token, 'KEEPTTL')
return token
