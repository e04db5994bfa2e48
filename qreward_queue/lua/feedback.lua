-- feedback.lua: apply what a backend answered: header sync, a 429 pause, the AIMD controller.
-- KEYS[1] bucket hash, KEYS[2] aimd hash (limit, ok, cut_at), KEYS[3] recent-429 counter
-- ARGV[1] event: 'ok' | '429' | 'timeout' | '' (none), ARGV[2] max_concurrent (0 = no AIMD),
-- ARGV[3] AIMD cooldown ms, ARGV[4] pause ms (0 = none),
-- ARGV[5] n limits, then per limit: name, capacity, refill rate per ms, and from the headers
--   (each '' when absent): remaining, limit as a rate per ms, reset ms
-- Returns the adaptive concurrency limit (-1 without max_concurrent).
local HRATE_KEEP_MS = 600000   -- a learned lower rate outlives an idle bucket by 10 minutes
local AIMD_IDLE_MS = 600000    -- an idle controller forgets its state after 10 minutes
local RECENT_429_S = 60
local bucket, event = KEYS[1], ARGV[1]
local now = now_ms()
local keep = tonumber(redis.call('HGET', bucket, 'keep_until')) or 0

-- A header limit below the configured rate becomes the rate (and scales the capacity) until a
-- header says otherwise.
for k = 0, tonumber(ARGV[5]) - 1 do
  local j = 6 + k * 6
  local hrate = tonumber(ARGV[j + 4])
  if hrate and hrate < tonumber(ARGV[j + 2]) then
    redis.call('HSET', bucket, ARGV[j] .. ':hrate', num(hrate))
    keep = math.max(keep, now + HRATE_KEEP_MS)
  elseif hrate then
    redis.call('HDEL', bucket, ARGV[j] .. ':hrate')
  end
end

-- A pause only extends the current one (a burst of 429s pauses once): it moves the whole
-- schedule, debt included, back by the extension and drops any burst; `shift` sums the moves
-- so that requests booked earlier and still sleeping move with it (see checkpoint.lua).
local until_ms = now + tonumber(ARGV[4])
local paused_until = tonumber(redis.call('HGET', bucket, 'paused_until')) or now
local extend = math.max(0, until_ms - math.max(now, paused_until))
local limits = load_limits(bucket, 5, 6, now)
for _, l in ipairs(limits) do
  local remaining, reset = tonumber(ARGV[l.j + 3]), tonumber(ARGV[l.j + 5])
  if remaining then l.level = math.min(l.level, remaining) end
  if reset then
    redis.call('HSET', bucket, l.name .. ':reset_at', num(now + reset))
    keep = math.max(keep, now + reset)
  end
  if extend > 0 then l.level = math.min(l.level, 0) - extend * l.rate end
end
if extend > 0 then
  redis.call('HINCRBYFLOAT', bucket, 'shift', num(extend))
  redis.call('HSET', bucket, 'paused_until', num(until_ms))
  keep = math.max(keep, until_ms)
end
if keep > 0 then redis.call('HSET', bucket, 'keep_until', num(keep)) end
save_limits(bucket, limits, now)

if event == '429' and redis.call('INCR', KEYS[3]) == 1 then
  redis.call('EXPIRE', KEYS[3], RECENT_429_S)
end
local max_conc = tonumber(ARGV[2])
if max_conc <= 0 then return -1 end
local a = redis.call('HMGET', KEYS[2], 'limit', 'ok', 'cut_at')
local limit = math.min(max_conc, tonumber(a[1]) or max_conc)
local ok = tonumber(a[2]) or 0
if event == 'ok' then
  -- additive increase: +1 after `limit` successes
  ok = ok + 1
  if ok >= limit then limit, ok = math.min(max_conc, limit + 1), 0 end
elseif event == '429' or event == 'timeout' then
  -- multiplicative decrease, once per cooldown so one burst of failures halves only once
  local cut_at = tonumber(a[3])
  if not cut_at or now >= cut_at + tonumber(ARGV[3]) then
    limit, ok = math.max(1, math.floor(limit / 2)), 0
    redis.call('HSET', KEYS[2], 'cut_at', num(now))
  end
else
  return limit
end
redis.call('HSET', KEYS[2], 'limit', limit, 'ok', ok)
redis.call('PEXPIRE', KEYS[2], AIMD_IDLE_MS)
return limit
