-- Raise a fence counter to at least ARGV[1]; never lowers it. Used after a Redis failover
-- lost increments, with the floor taken from Postgres's high-water mark.
-- KEYS[1] = fence counter; ARGV[1] = floor (non-negative decimal, no leading zeros)
-- Returns the counter's value afterwards (decimal text, exact). A counter that expires idle
-- (RedisIssuer::with_idle_expiry) keeps its expiry (KEEPTTL); one created here has none
-- until the next acquire gives it one.
local function less(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local cur = redis.call('GET', KEYS[1])
if (not cur) or string.sub(cur, 1, 1) == '-' or less(cur, ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL')
  return ARGV[1]
end
return cur
