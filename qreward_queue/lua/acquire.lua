-- acquire.lua: take a concurrency lease and every limit's cost in one step, or take nothing.
-- KEYS[1] bucket hash, KEYS[2] leases zset (holder -> expiry ms), KEYS[3] aimd hash
-- ARGV[1] holder id, ARGV[2] lease ttl ms, ARGV[3] max_concurrent (0 = none), ARGV[4] max wait ms,
-- ARGV[5] n limits, then per limit: name, capacity, refill rate per ms, cost of this request
-- Returns {granted 1|0, wait ms, reason, the bucket's pause `shift`} (numbers as strings):
--   granted: sleep `wait`, then call the backend (reason: what set the wait, a limit or 'paused');
--   refused, reason 'lease': no lease free, `wait` is a poll hint;
--   refused, other reason: the call could start only after `wait` > max wait.
-- A granted request is booked at its start time (now + wait) in every limit, so a level may go
-- below zero: later requests wait behind that debt, which serves them in reservation order and
-- lets a cost above capacity through after (cost - level) / rate.
local POLL_MS = 25
local KEEP_MS = 10000  -- keep the bucket (its `shift`) this long after the latest booked start
local bucket, leases = KEYS[1], KEYS[2]
local now = now_ms()

redis.call('ZREMRANGEBYSCORE', leases, '-inf', num(now))
local max_conc = tonumber(ARGV[3])
if max_conc > 0 then
  max_conc = math.min(max_conc, tonumber(redis.call('HGET', KEYS[3], 'limit')) or max_conc)
  if redis.call('ZCARD', leases) >= max_conc then
    local first = redis.call('ZRANGE', leases, 0, 0, 'WITHSCORES')
    return {0, num(math.max(1, math.min(POLL_MS, tonumber(first[2]) - now))), 'lease', '0'}
  end
end

local limits = load_limits(bucket, 5, 4, now)
-- a pause already lowered every level; this covers a backend with no rate limit at all
local wait = math.max(0, (tonumber(redis.call('HGET', bucket, 'paused_until')) or now) - now)
local reason = wait > 0 and 'paused' or ''
for _, l in ipairs(limits) do
  l.cost = tonumber(ARGV[l.j + 3])
  local need = (l.cost - l.level) / l.rate
  if need > wait then wait, reason = need, l.name end
end
if wait > tonumber(ARGV[4]) then
  return {0, num(wait), reason, '0'}
end

for _, l in ipairs(limits) do
  -- the level at the start, capped at capacity (or at the cost, so a cost above capacity passes)
  l.level = math.min(math.max(l.cap, l.cost), l.level + wait * l.rate) - l.cost
  l.ts = now + wait
end
if wait > 0 then
  local keep = tonumber(redis.call('HGET', bucket, 'keep_until')) or 0
  redis.call('HSET', bucket, 'keep_until', num(math.max(keep, now + wait + KEEP_MS)))
end
save_limits(bucket, limits, now)
redis.call('ZADD', leases, num(now + wait + tonumber(ARGV[2])), ARGV[1])
local last = redis.call('ZRANGE', leases, -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', leases, math.ceil(tonumber(last[2]) - now) + 1000)
return {1, num(wait), reason, redis.call('HGET', bucket, 'shift') or '0'}
