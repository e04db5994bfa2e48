-- status.lua: a read-only snapshot of one backend, levels refilled to the server's now.
-- KEYS[1] bucket hash, KEYS[2] leases zset, KEYS[3] aimd hash, KEYS[4] recent-429 counter
-- args: limits: [{name, cap, rate}] (as configured)
-- Returns {leases, adaptive_limit (absent when unset), adaptive_why (the controller's last move
--   or non-move and why, absent when none), recent_429s, paused_ms, limits: [{name,
--   level, cap, rate, cfg_rate, reset_ms (absent when unknown), told_rate/told_age_ms/told_by
--   (a believed lower limit, see finish.lua), claims/claim_rate/claim_age_ms (the run of replies
--   telling one)}]} (rates per ms).
local now = now_ms()
local h = read_hash(KEYS[1])
local paused_until = tonumber(h.paused_until) or now
local out = {
  leases = redis.call('ZCOUNT', KEYS[2], '(' .. num(now), '+inf'),
  adaptive_limit = tonumber(redis.call('HGET', KEYS[3], 'limit')),
  adaptive_why = redis.call('HGET', KEYS[3], 'why') or nil,
  recent_429s = tonumber(redis.call('GET', KEYS[4]) or '0'),
  paused_ms = math.max(0, paused_until - now),
  bounded = (tonumber(h.bounded_until) or 0) > now and h.bounded or nil,
  limits = {},
}
local function age(field)
  local at = tonumber(h[field])
  return at and math.max(0, now - at) or nil
end
for _, l in ipairs(load_limits(h, now)) do
  local n = l.name
  local reset_at = tonumber(h[n .. ':reset_at'])
  out.limits[#out.limits + 1] = {name = n, level = l.level, cap = l.cap, rate = l.rate,
    cfg_rate = l.cfg_rate, reset_ms = reset_at and math.max(0, reset_at - now) or nil,
    told_rate = tonumber(h[n .. ':hrate']), told_age_ms = age(n .. ':hrate_at'),
    told_by = h[n .. ':hwhy'], claims = tonumber(h[n .. ':claims']),
    claim_rate = tonumber(h[n .. ':claim_max']), claim_age_ms = age(n .. ':claim_at')}
end
return cjson.encode(out)
