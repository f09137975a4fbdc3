-- Extend a lock's TTL only if this lease still holds it.
-- KEYS[1] = lock key; ARGV[1] = "<owner>:<token>", ARGV[2] = new TTL in milliseconds
-- KEYS[2] (optional) = fence counter, ARGV[3] = the idle expiry in milliseconds: the counter
-- then lives at least that long past the new TTL (never shortened), so it does not expire
-- under a lease that keeps extending.
-- Returns 1 extended, 0 the lock had expired, -1 another lease holds it.
local held = redis.call('GET', KEYS[1])
if not held then return 0 end
if held == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if KEYS[2] then
    local want = tonumber(ARGV[3]) + tonumber(ARGV[2])
    if redis.call('PTTL', KEYS[2]) < want then
      redis.call('PEXPIRE', KEYS[2], want)
    end
  end
  return 1
end
return -1
