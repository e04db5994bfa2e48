-- acquire.lua: grant up to `count` calls, each a concurrency lease plus every limit's cost, in
-- one step; grants are booked one after another, so later ones may carry a longer wait.
-- KEYS[1] bucket hash, KEYS[2] leases zset (holder -> expiry ms), KEYS[3] aimd hash,
-- KEYS[4] released list (see finish.lua): emptied when no lease is left, its entries stale
-- args: holder (id prefix; grant k holds `<holder>:<k>`), count, lease_ttl_ms, max_concurrent
--   (0 = none), max_wait_ms, limits: [{name, cap, rate (per ms), cost (per call)}]
-- Returns {waits: [ms per grant], shift} when at least one call was granted (sleep its wait,
-- then call the backend), else {waits: [], wait_ms, reason}: reason 'lease' (none free; wait_ms
-- is a poll hint), or the limit (or 'paused') that would make the first call wait > max wait.
-- A granted call is booked at its start time (now + wait) in every limit, so a level may go
-- below zero: later requests wait behind that debt, which serves them in reservation order and
-- lets a cost above capacity through after (cost - level) / rate.
local POLL_MS = 25
local KEEP_MS = 10000  -- keep the bucket (its `shift`) this long after the latest booked start
local bucket, leases = KEYS[1], KEYS[2]
local now = now_ms()

redis.call('ZREMRANGEBYSCORE', leases, '-inf', num(now))
local max_conc = args.max_concurrent
if max_conc > 0 then
  max_conc = math.min(max_conc, tonumber(redis.call('HGET', KEYS[3], 'limit')) or max_conc)
end
local h = read_hash(bucket)
local limits = load_limits(h, now)
local paused = math.max(0, (tonumber(h.paused_until) or now) - now)
local held = max_conc > 0 and redis.call('ZCARD', leases) or 0
local waits, members, refusal, latest = {}, {}, nil, 0
for k = 1, args.count do
  if max_conc > 0 and held + k - 1 >= max_conc then
    if k == 1 then  -- a poll hint: when the first lease lapses at the latest
      local first = redis.call('ZRANGE', leases, 0, 0, 'WITHSCORES')
      local lapse = first[2] and tonumber(first[2]) - now or POLL_MS
      refusal = {wait_ms = math.max(1, math.min(POLL_MS, lapse)), reason = 'lease'}
    end
    break
  end
  -- a pause already lowered every level; `paused` covers a backend with no rate limit at all
  local wait, reason = paused, paused > 0 and 'paused' or ''
  for _, l in ipairs(limits) do
    local need = (l.cost - l.level) / l.rate
    if need > wait then wait, reason = need, l.name end
  end
  if wait > args.max_wait_ms then
    refusal = {wait_ms = wait, reason = reason}
    break
  end
  for _, l in ipairs(limits) do
    -- the level at the start, capped at capacity (or at the cost, so a cost above capacity passes)
    l.level = math.min(math.max(l.cap, l.cost), l.level + wait * l.rate) - l.cost
    -- rebase on `now` so the next grant of this call sees the same clock
    l.level = l.level - wait * l.rate
    l.ts = now
  end
  members[#members + 1] = num(now + wait + args.lease_ttl_ms)
  members[#members + 1] = args.holder .. ':' .. k
  waits[k], latest = wait, math.max(latest, wait)
end

if max_conc > 0 and held + #waits >= max_conc then redis.call('DEL', KEYS[4]) end
if #waits == 0 then
  return cjson.encode({waits = {}, wait_ms = refusal.wait_ms, reason = refusal.reason})
end
redis.call('ZADD', leases, unpack(members))
for _, l in ipairs(limits) do
  -- store the debt as a level at the latest start, as a single booking would
  l.level, l.ts = l.level + latest * l.rate, now + latest
end
local set = {}
if latest > 0 then
  set.keep_until = num(math.max(tonumber(h.keep_until) or 0, now + latest + KEEP_MS))
end
save_limits(bucket, h, limits, now, set)
expire_leases(leases, now)
return cjson.encode({waits = waits, shift = tonumber(h.shift) or 0})
