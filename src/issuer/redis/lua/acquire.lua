-- Acquire a lock and its fence token in one atomic step.
-- KEYS[1] = lock key, KEYS[2] = fence counter (same hash tag, so same cluster slot)
-- ARGV[1] = owner id, ARGV[2] = TTL in milliseconds, ARGV[3] = the token limit
-- (pgfence::MAX_TOKEN in decimal; 549755813887 when not given)
-- KEYS[3] (optional) = the attempt key, ARGV[4] = the id of the acquire call: 16 hex digits,
-- increasing within a process. It records which call of the owner holds the lock, so that a
-- failed call's clean-up (abandon.lua) removes the lock only if that call took it.
-- Not given when the owner id is the call's own (`acquire` makes one up per call): no other
-- call can present it, so the owner id alone names the call.
-- ARGV[5] (optional) = the idle expiry in milliseconds (RedisIssuer::with_idle_expiry), "0"
-- or absent for none: the counter then expires that long after the lease's TTL, unless a
-- later acquire or extend pushes it further. It is never shortened here (a fencing domain's
-- counter serves several locks).
-- Lock value: "<owner>:<token>".
-- Returns {1, token, fresh} when granted. `token` is the counter's exact decimal text (Lua
-- numbers are doubles); `fresh` is 1 when the counter did not exist before (new resource, a
-- counter that expired idle, or a Redis that lost its data). Returns {0, pttl} when another owner holds the lock: a
-- two-element reply starting with 0 is never a token. Returns {-1, counter} when the counter
-- is already at (or past) the token limit: nothing was changed.
local function stamp(adopting)
  if not KEYS[3] then return end
  if adopting then
    -- The lock is the owner's already: only a later call of the owner takes it over (the late
    -- bytes of an earlier, failed call must not).
    local by = redis.call('GET', KEYS[3])
    if by and by >= ARGV[4] then
      redis.call('PEXPIRE', KEYS[3], ARGV[2])
      return
    end
  end
  redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[2])
end
local function keep_counter()
  local idle = tonumber(ARGV[5] or '0')
  if idle and idle > 0 then
    local want = idle + tonumber(ARGV[2])
    -- PTTL is -1 for a counter without expiry (made before idle expiry was on): it gets one.
    if redis.call('PTTL', KEYS[2]) < want then
      redis.call('PEXPIRE', KEYS[2], want)
    end
  end
end
local held = redis.call('GET', KEYS[1])
if held then
  local owner, token = string.match(held, '^(.*):(%d+)$')
  if owner == ARGV[1] then
    -- The same owner retrying (its first reply was lost): same token, not a new one.
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    stamp(true)
    keep_counter()
    return {1, token, 0}
  end
  return {0, redis.call('PTTL', KEYS[1])}
end
-- Validate the counter before changing anything: a refused acquire leaves no trace.
local before = redis.call('GET', KEYS[2])
local fresh = 0
if not before then
  fresh = 1
elseif not string.match(before, '^%d+$') then
  return redis.error_reply('pgfence: fence counter is not a non-negative integer: ' .. string.sub(before, 1, 40))
elseif tonumber(before) >= tonumber(ARGV[3] or '549755813887') then
  -- The next token would pass the limit: refuse before INCR and SET. A double holds every
  -- integer up to 2^53 exactly, so the comparison is exact around the limit (2^39 - 1), and a
  -- longer counter only compares larger.
  return {-1, before}
end
-- INCR refuses to overflow i64 without changing the value.
local incr = redis.pcall('INCR', KEYS[2])
if type(incr) == 'table' and incr.err then
  return redis.error_reply('pgfence: fence counter unusable: ' .. incr.err)
end
local token = redis.call('GET', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. token, 'PX', ARGV[2])
stamp(false)
keep_counter()
return {1, token, fresh}
