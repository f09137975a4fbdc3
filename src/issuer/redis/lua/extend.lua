-- Extend a lock's TTL only if this lease still holds it.
-- KEYS[1] = lock key; ARGV[1] = "<owner>:<token>", ARGV[2] = new TTL in milliseconds
-- Returns 1 extended, 0 the lock had expired, -1 another lease holds it.
local held = redis.call('GET', KEYS[1])
if not held then return 0 end
if held == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return -1
