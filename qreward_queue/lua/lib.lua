-- lib.lua: helpers shared by the bucket scripts; limiter.py prepends this file to each of them.
-- Defines locals only (no KEYS/ARGV of its own, returns nothing).
--
-- A limit's state in the bucket hash is one line: `<name>:level` at time `<name>:ts` (server ms);
-- the level at time t is min(cap, level + (t - ts) * rate). `ts` may lie in the future: acquire
-- books a request at its start time, so a level below zero is debt that later requests wait behind.
-- Other fields: `<name>:cap`/`<name>:rate` (configured, for status), `<name>:hrate` (a lower rate
-- per ms learned from x-ratelimit-limit-* headers), `<name>:reset_at`, `paused_until`, `shift`
-- (total ms that pauses moved the schedule), `keep_until` (the hash lives at least until then).

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end

local function num(x)
  return string.format('%.17g', x)
end

-- Parse ARGV[i] = n, then n groups of `width` values starting with name, capacity, rate per ms;
-- return the limits with their effective capacity and rate and their level refilled to `now`.
local function load_limits(bucket, i, width, now)
  local limits = {}
  for k = 0, tonumber(ARGV[i]) - 1 do
    local j = i + 1 + k * width
    local l = {name = ARGV[j], cfg_cap = tonumber(ARGV[j + 1]), cfg_rate = tonumber(ARGV[j + 2]), j = j}
    local s = redis.call('HMGET', bucket, l.name .. ':level', l.name .. ':ts', l.name .. ':hrate')
    local scale = math.min(1, (tonumber(s[3]) or l.cfg_rate) / l.cfg_rate)
    l.cap, l.rate = l.cfg_cap * scale, l.cfg_rate * scale
    local level, ts = tonumber(s[1]), tonumber(s[2])
    l.level = level and math.min(l.cap, level + (now - ts) * l.rate) or l.cap
    limits[#limits + 1] = l
  end
  return limits
end

-- Write every limit's level at l.ts (default now), then expire the hash once every level would be
-- full again, but not before `keep_until`.
local function save_limits(bucket, limits, now)
  local ttl = (tonumber(redis.call('HGET', bucket, 'keep_until')) or now) - now
  for _, l in ipairs(limits) do
    local ts = l.ts or now
    redis.call('HSET', bucket, l.name .. ':level', num(l.level), l.name .. ':ts', num(ts),
      l.name .. ':cap', num(l.cfg_cap), l.name .. ':rate', num(l.cfg_rate))
    ttl = math.max(ttl, ts - now + (l.cap - l.level) / l.rate)
  end
  redis.call('PEXPIRE', bucket, math.ceil(math.max(0, ttl)) + 1000)
end
