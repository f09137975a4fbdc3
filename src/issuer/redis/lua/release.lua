-- Release a lock only if this lease still holds it. The counter is never touched.
-- KEYS[1] = lock key; ARGV[1] = "<owner>:<token>"
-- Returns 1 released, 0 the lock had expired (nobody holds it), -1 another lease holds it.
local held = redis.call('GET', KEYS[1])
if not held then return 0 end
if held == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return -1
