-- The clean-up of an acquire call that failed with its outcome unknown: removes the lock if
-- that call took it (a late attempt applied after the caller was told the call failed).
-- KEYS[1] = lock key, KEYS[2] = attempt key; ARGV[1] = owner id, ARGV[2] = the call's id, or
-- "" when the owner id was the call's own (no other call can hold the lock under it, and the
-- call recorded no attempt).
-- Returns 1 removed, 0 no lock, -1 the lock is another owner's or another call's (left alone).
local held = redis.call('GET', KEYS[1])
if not held then return 0 end
local owner = string.match(held, '^(.*):%d+$')
if owner ~= ARGV[1] then return -1 end
if ARGV[2] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[2] then return -1 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
