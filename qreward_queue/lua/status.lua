-- status.lua: a read-only snapshot of one backend, levels refilled to the server's now.
-- KEYS[1] bucket hash, KEYS[2] leases zset, KEYS[3] aimd hash, KEYS[4] recent-429 counter
-- ARGV[1] n limits, then per limit: name, capacity, refill rate per ms (as configured)
-- Returns {leases in use, adaptive limit or '', recent 429s, paused for ms, then per limit:
--   name, level, effective capacity, effective rate per ms, configured rate per ms,
--   reset in ms or ''} (strings).
local now = now_ms()
local bucket = KEYS[1]
local paused_until = tonumber(redis.call('HGET', bucket, 'paused_until')) or now
local out = {
  tostring(redis.call('ZCOUNT', KEYS[2], '(' .. num(now), '+inf')),
  redis.call('HGET', KEYS[3], 'limit') or '',
  redis.call('GET', KEYS[4]) or '0',
  num(math.max(0, paused_until - now)),
}
for _, l in ipairs(load_limits(bucket, 1, 3, now)) do
  local reset_at = tonumber(redis.call('HGET', bucket, l.name .. ':reset_at'))
  local reset = reset_at and num(math.max(0, reset_at - now)) or ''
  for _, v in ipairs({l.name, num(l.level), num(l.cap), num(l.rate), num(l.cfg_rate), reset}) do
    out[#out + 1] = v
  end
end
return out
