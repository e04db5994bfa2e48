-- finish.lua: everything after one or more calls, in one round trip: reconcile the booked
-- token estimates, apply what the backend answered (header sync, a 429 pause, the AIMD
-- controller) and release the calls' leases.
-- KEYS[1] bucket hash, KEYS[2] leases zset, KEYS[3] aimd hash, KEYS[4] recent-429 counter,
-- KEYS[5] released list (one entry per lease released under max_concurrent: wakes a waiter)
-- args: calls: [{holder, event, told: {<limit name>: {refund (booked minus used; < 0 charges
--   an overrun), remaining, limit_rate (per ms), reset_ms}}}] in the order they ended (the
--   header fields are absent when a reply did not carry them); an event is
--   'ok' | 'exhausted' (a 429, rate used up) | 'congested' (a 429 with rate left: too many in
--   flight) | '429' (a 429 saying neither) | 'timeout' | '';
--   limits: [{name, cap, rate}], max_concurrent (0 = no AIMD), aimd_cooldown_ms,
--   pause_ms (0 = none), bounded (what a reply said beyond qrq's bounds, '' when nothing),
--   corroborate, claim_window_ms (when a lower limit told by replies is believed; see below)
-- Returns {limit}: the adaptive concurrency limit (-1 without max_concurrent).
local HRATE_KEEP_MS = 600000   -- a learned lower rate outlives an idle bucket by 10 minutes
local AIMD_IDLE_MS = 600000    -- an idle controller forgets its state after 10 minutes
local PROBE_SLOWDOWN = 16      -- near the last cut, growth takes this many times longer
local NEAR_CEILING = 0.9       -- "near": within one call of this share of the last cut
local NEAR_CUT = 0.75          -- a failure at this share of the last cut or more cuts gently
local GENTLE_CUT = 0.1        -- a gentle cut takes this share (at least one call) off
local FORGET_ABOVE = 1.25      -- climbing this far above the last cut forgets it
local RECENT_429_S = 60
local TIMEOUT_WINDOW = 100         -- the timeout share is a decayed mean over about this many calls
local TIMEOUT_MIN_CALLS = 20       -- ... and says nothing before this many
local CONGESTED_TIMEOUT_SHARE = 0.05  -- timeouts on this share of recent calls are congestion
local RELEASED_KEEP_MS = 1000  -- an unclaimed release is stale by then: acquire polls anyway
local BOUNDED_KEEP_MS = 600000
local bucket = KEYS[1]
local now = now_ms()
local h = read_hash(bucket)
local keep = tonumber(h.keep_until) or 0
local set = {}

local holders = {}
for _, c in ipairs(args.calls) do holders[#holders + 1] = c.holder end
if #holders > 0 then
  local released = redis.call('ZREM', KEYS[2], unpack(holders))
  if released > 0 and args.max_concurrent > 0 then
    -- callers waiting for a lease block on this list (limiter.py `_await_release`)
    local ones = {}
    for k = 1, math.min(released, args.max_concurrent) do ones[k] = 1 end
    redis.call('LPUSH', KEYS[5], unpack(ones))
    redis.call('LTRIM', KEYS[5], 0, args.max_concurrent - 1)
    redis.call('PEXPIRE', KEYS[5], RELEASED_KEEP_MS)
  end
end

-- A header limit below the configured rate is a claim, not yet the rate: one reply's word cannot
-- throttle a backend. It is believed (becomes the rate and scales the capacity) once
-- args.corroborate replies in a run said so (a run ends args.claim_window_ms after its
-- latest claim), or
-- at once when the reply saying so is a 429; the rate believed is the most generous of the
-- run's claims, and every later claim of the run confirms it. Unconfirmed, it relaxes back
-- towards the configured rate (lib.lua `learned_rate`). A reply telling a limit at or above
-- the configured one ends the run and the belief.
local function put(field, value)
  set[field], h[field] = value, value
end
for _, c in ipairs(args.calls) do
  for _, l in ipairs(args.limits or {}) do
    local told, n = c.told and c.told[l.name] or {}, l.name
    if told.limit_rate and told.limit_rate < l.rate then
      local count, best = tonumber(h[n .. ':claims']) or 0, tonumber(h[n .. ':claim_max']) or 0
      if now - (tonumber(h[n .. ':claim_at']) or 0) > args.claim_window_ms then count, best = 0, 0 end
      count, best = count + 1, math.max(best, told.limit_rate)
      put(n .. ':claims', count)
      put(n .. ':claim_max', num(best))
      put(n .. ':claim_at', num(now))
      local by_429 = c.event == 'exhausted' or c.event == '429'
      if count >= args.corroborate or by_429 then
        put(n .. ':hrate', num(best))
        put(n .. ':hrate_at', num(now))
        put(n .. ':hwhy', by_429 and '429' or 'replies')
      end
      keep = math.max(keep, now + HRATE_KEEP_MS)
    elseif told.limit_rate and (h[n .. ':hrate'] or h[n .. ':claims']) then
      local fields = {'hrate', 'hrate_at', 'hwhy', 'claims', 'claim_max', 'claim_at'}
      for i, f in ipairs(fields) do
        fields[i] = n .. ':' .. f
        h[fields[i]], set[fields[i]] = nil, nil
      end
      redis.call('HDEL', bucket, unpack(fields))
    end
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
  for _, c in ipairs(args.calls) do
    local told = c.told and c.told[l.name] or {}
    if told.refund and told.refund ~= 0 then l.level = math.min(l.cap, l.level + told.refund) end
    if told.remaining then l.level = math.min(l.level, told.remaining) end
    if told.reset_ms then
      set[l.name .. ':reset_at'] = num(now + told.reset_ms)
      keep = math.max(keep, now + told.reset_ms)
    end
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

local refused = 0
for _, c in ipairs(args.calls) do
  if c.event == '429' or c.event == 'exhausted' or c.event == 'congested' then
    refused = refused + 1
  end
end
if refused > 0 and redis.call('INCRBY', KEYS[4], refused) == refused then
  redis.call('EXPIRE', KEYS[4], RECENT_429_S)
end
local max_conc = args.max_concurrent
if max_conc <= 0 then return cjson.encode({limit = -1}) end
local a = redis.call('HMGET', KEYS[3], 'limit', 'ok', 'cut_at', 'ceiling', 'calls', 'timeouts')
local limit = math.min(max_conc, tonumber(a[1]) or max_conc)
local ok, cut_at, ceiling = tonumber(a[2]) or 0, tonumber(a[3]), tonumber(a[4])
local calls, timeouts = tonumber(a[5]) or 0, tonumber(a[6]) or 0
local changed, why = false, nil
for _, c in ipairs(args.calls) do
  local cooling = cut_at and now < cut_at + args.aimd_cooldown_ms
  if c.event == 'ok' or c.event == 'timeout' then
    -- the share of recent calls that timed out: a decayed mean over about TIMEOUT_WINDOW calls
    calls = calls * (1 - 1 / TIMEOUT_WINDOW) + 1
    timeouts = timeouts * (1 - 1 / TIMEOUT_WINDOW) + (c.event == 'timeout' and 1 or 0)
    changed = true
  end
  -- congestion: a 429 (with requests left, or saying nothing), or timeouts once they are a
  -- share of recent calls that a steady fault rate does not reach (they grow with load); a
  -- rare timeout, like a 500, is a fault to retry and cuts nothing
  local share = timeouts / math.max(calls, 1)
  local congested = c.event == 'congested' or c.event == '429' or (c.event == 'timeout'
    and calls >= TIMEOUT_MIN_CALLS and share >= CONGESTED_TIMEOUT_SHARE)
  if c.event == 'ok' and not cooling then
    -- additive increase, none while cooling down from a cut: +1 after `limit` successes;
    -- near the level of the last cut (`ceiling`) only after PROBE_SLOWDOWN times as many, so
    -- a server's real limit is probed gently; well above it the ceiling is forgotten (the
    -- server's limit came back) and growth is fast again
    ok = ok + 1
    local near = ceiling and limit >= NEAR_CEILING * ceiling - 1
    if ok >= (near and PROBE_SLOWDOWN or 1) * limit then limit, ok = math.min(max_conc, limit + 1), 0 end
    if ceiling and limit > FORGET_ABOVE * ceiling then ceiling = false end
  elseif congested then
    -- multiplicative decrease, once per cooldown so one burst of failures cuts only once: by
    -- half, or gently (GENTLE_CUT) when the limit had climbed back near the last cut
    ok, changed = 0, true
    if not cooling then
      local near = ceiling and limit >= NEAR_CUT * ceiling
      local cut = near and limit - math.max(1, math.floor(limit * GENTLE_CUT)) or math.floor(limit / 2)
      why = string.format('cut %d -> %d: %s', limit, math.max(1, cut),
        c.event == 'timeout' and string.format('timeouts on %.0f%% of recent calls', 100 * share)
        or c.event == 'congested' and 'a 429 with requests and tokens left (too many in flight)'
        or 'a 429 that said no more')
      cut_at, ceiling, limit = now, limit, math.max(1, cut)
    end
  elseif c.event == 'timeout' then
    why = string.format('kept %d: timeouts on %.1f%% of recent calls are faults, not congestion',
      limit, 100 * share)
  end
end
if changed then
  local f = {'limit', limit, 'ok', ok, 'calls', num(calls), 'timeouts', num(timeouts)}
  if why then f[#f + 1], f[#f + 2] = 'why', why end
  if cut_at then f[#f + 1], f[#f + 2] = 'cut_at', num(cut_at) end
  if ceiling then f[#f + 1], f[#f + 2] = 'ceiling', ceiling
  elseif a[4] then redis.call('HDEL', KEYS[3], 'ceiling') end
  redis.call('HSET', KEYS[3], unpack(f))
  redis.call('PEXPIRE', KEYS[3], AIMD_IDLE_MS)
end
return cjson.encode({limit = limit})
