-- Re-issue the token of a lock this lease holds, after raising the counter to a floor.
-- Used when acquire found a fresh counter (data lost) and Postgres knows a higher mark.
-- KEYS[1] = lock key, KEYS[2] = fence counter
-- ARGV[1] = "<owner>:<old token>", ARGV[2] = owner, ARGV[3] = floor
-- Returns the new token (decimal text), or 0 if the lease no longer holds the lock.
local function less(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local cur = redis.call('GET', KEYS[2]) or '0'
if less(cur, ARGV[3]) then redis.call('SET', KEYS[2], ARGV[3]) end
redis.call('INCR', KEYS[2])
local token = redis.call('GET', KEYS[2])
redis.call('SET', KEYS[1], ARGV[2] .. ':' .. token, 'KEEPTTL')
return token
