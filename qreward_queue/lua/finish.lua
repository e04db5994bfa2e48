-- finish.lua: everything after a call, in one round trip: reconcile the booked token estimate,
-- apply what the backend answered (header sync, a 429 pause, the AIMD controller) and release
-- the call's lease. Also used without a lease for plain feedback and pauses.
-- KEYS[1] bucket hash, KEYS[2] leases zset, KEYS[3] aimd hash, KEYS[4] recent-429 counter
-- args: holders (leases to release), event ('ok' | 'exhausted' (a 429, rate used up) |
--   'congested' (a 429 with rate left: too many in flight) | '429' (a 429 saying neither) |
--   'timeout' | ''), max_concurrent
--   (0 = no AIMD), aimd_cooldown_ms, pause_ms (0 = none), limits: [{name, cap, rate, refund
--   (booked minus used; < 0 charges an overrun), remaining, limit_rate (per ms), reset_ms}]
--   (the header fields are absent when the reply did not carry them), bounded (what the
--   reply said beyond qrq's bounds, '' when nothing)
-- Returns {limit}: the adaptive concurrency limit (-1 without max_concurrent).
local HRATE_KEEP_MS = 600000   -- a learned lower rate outlives an idle bucket by 10 minutes
local AIMD_IDLE_MS = 600000    -- an idle controller forgets its state after 10 minutes
local PROBE_SLOWDOWN = 16      -- near the last cut, growth takes this many times longer
local NEAR_CEILING = 0.9       -- "near": within one call of this share of the last cut
local NEAR_CUT = 0.75          -- a failure at this share of the last cut or more cuts gently
local GENTLE_CUT = 0.1        -- a gentle cut takes this share (at least one call) off
local FORGET_ABOVE = 1.25      -- climbing this far above the last cut forgets it
local RECENT_429_S = 60
local BOUNDED_KEEP_MS = 600000
local bucket, event = KEYS[1], args.event
local now = now_ms()
local h = read_hash(bucket)
local keep = tonumber(h.keep_until) or 0
local set = {}

if args.holders and #args.holders > 0 then
  redis.call('ZREM', KEYS[2], unpack(args.holders))
end

-- A header limit below the configured rate becomes the rate (and scales the capacity) until a
-- header says otherwise.
for _, l in ipairs(args.limits or {}) do
  if l.limit_rate and l.limit_rate < l.rate then
    set[l.name .. ':hrate'] = num(l.limit_rate)
    h[l.name .. ':hrate'] = set[l.name .. ':hrate']
    keep = math.max(keep, now + HRATE_KEEP_MS)
  elseif l.limit_rate and h[l.name .. ':hrate'] then
    redis.call('HDEL', bucket, l.name .. ':hrate')
    h[l.name .. ':hrate'] = nil
  end
end

-- A pause only extends the current one (a burst of 429s pauses once): it moves the whole
-- schedule, debt included, back by the extension and drops any burst; `shift` sums the moves
-- so that requests booked earlier and still sleeping move with it (see checkpoint.lua).
local until_ms = now + (args.pause_ms or 0)
local paused_until = tonumber(h.paused_until) or now
local extend = math.max(0, until_ms - math.max(now, paused_until))
local limits = load_limits(h, now)
for _, l in ipairs(limits) do
  if l.refund and l.refund ~= 0 then l.level = math.min(l.cap, l.level + l.refund) end
  if l.remaining then l.level = math.min(l.level, l.remaining) end
  if l.reset_ms then
    set[l.name .. ':reset_at'] = num(now + l.reset_ms)
    keep = math.max(keep, now + l.reset_ms)
  end
  if extend > 0 then l.level = math.min(l.level, 0) - extend * l.rate end
end
if extend > 0 then
  set.shift = num((tonumber(h.shift) or 0) + extend)
  set.paused_until = num(until_ms)
  keep = math.max(keep, until_ms)
end
if args.bounded ~= '' then
  -- what the last out-of-bounds reply said, shown by `qrq status` for BOUNDED_KEEP_MS
  set.bounded, set.bounded_until = args.bounded, num(now + BOUNDED_KEEP_MS)
end
if keep > 0 then set.keep_until = num(keep) end
save_limits(bucket, h, limits, now, set)

if (event == '429' or event == 'exhausted' or event == 'congested')
    and redis.call('INCR', KEYS[4]) == 1 then
  redis.call('EXPIRE', KEYS[4], RECENT_429_S)
end
local max_conc = args.max_concurrent
if max_conc <= 0 then return cjson.encode({limit = -1}) end
local a = redis.call('HMGET', KEYS[3], 'limit', 'ok', 'cut_at', 'ceiling')
local limit = math.min(max_conc, tonumber(a[1]) or max_conc)
local ok, ceiling, cut_at = tonumber(a[2]) or 0, tonumber(a[4]), tonumber(a[3])
local cooling = cut_at and now < cut_at + args.aimd_cooldown_ms
if event == 'ok' then
  -- additive increase, none while cooling down from a cut: +1 after `limit` successes; near
  -- the level of the last cut (`ceiling`) only after PROBE_SLOWDOWN times as many, so a
  -- server's real limit is probed gently; well above it the ceiling is forgotten (the
  -- server's limit came back) and growth is fast again
  if cooling then return cjson.encode({limit = limit}) end
  ok = ok + 1
  local near = ceiling and limit >= NEAR_CEILING * ceiling - 1
  if ok >= (near and PROBE_SLOWDOWN or 1) * limit then limit, ok = math.min(max_conc, limit + 1), 0 end
  if ceiling and limit > FORGET_ABOVE * ceiling then
    redis.call('HDEL', KEYS[3], 'ceiling')
  end
elseif event == 'congested' or event == 'timeout' or event == '429' then
  -- multiplicative decrease, once per cooldown so one burst of failures cuts only once: by
  -- half, or gently (GENTLE_CUT) when the limit had climbed back near the last cut
  ok = 0
  if not cooling then
    local near = ceiling and limit >= NEAR_CUT * ceiling
    local cut = near and limit - math.max(1, math.floor(limit * GENTLE_CUT)) or math.floor(limit / 2)
    redis.call('HSET', KEYS[3], 'cut_at', num(now), 'ceiling', limit)
    limit = math.max(1, cut)
  end
else
  return cjson.encode({limit = limit})
end
redis.call('HSET', KEYS[3], 'limit', limit, 'ok', ok)
redis.call('PEXPIRE', KEYS[3], AIMD_IDLE_MS)
return cjson.encode({limit = limit})
