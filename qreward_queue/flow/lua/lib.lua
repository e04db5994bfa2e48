-- lib.lua: helpers shared by the limiter scripts; limiter.py prepends this file to each of them.
-- Defines locals only. Every script takes one JSON object in ARGV[1] (named fields, decoded
-- with cjson) and returns one JSON object.
--
-- A limit's state in the bucket hash is one line: `<name>:level` at time `<name>:ts` (server ms);
-- the level at time t is min(cap, level + (t - ts) * rate). `ts` may lie in the future: acquire
-- books a request at its start time, so a level below zero is debt that later requests wait behind.
-- Other fields: `<name>:cap`/`<name>:rate` (configured, for status), `<name>:hrate` (a lower rate
-- per ms learned from x-ratelimit-limit-* headers, believed at `<name>:hrate_at` because of
-- `<name>:hwhy`; see finish.lua), `<name>:claims`/`claim_max`/`claim_at` (the run of replies
-- telling a lower limit), `<name>:reset_at`, `paused_until`, `shift` (total ms that pauses moved
-- the schedule), `keep_until` (the hash lives at least until then).

local args = cjson.decode(ARGV[1])
local RELAX_MS = args.relax_ms or 60000  -- a learned rate doubles back this often, unconfirmed

-- The learned rate of limit `name` at `now`: what replies told, relaxed back towards the
-- configured rate (doubling every RELAX_MS since last confirmed); nil when none was believed.
local function learned_rate(h, name, now)
  local told = tonumber(h[name .. ':hrate'])
  if not told then return nil end
  local since = math.max(0, now - (tonumber(h[name .. ':hrate_at']) or now))
  return told * 2 ^ (since / RELAX_MS)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end

local function num(x)
  return string.format('%.17g', x)
end

-- The bucket hash as a Lua table (one HGETALL: every script reads it once, writes it once).
local function read_hash(key)
  local flat, h = redis.call('HGETALL', key), {}
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
  return h
end

-- The configured limits (args.limits: {name, cap, rate per ms, ...}) with their effective
-- capacity and rate and their level refilled to `now`, from the bucket table `h`. Other fields
-- of each entry are kept.
local function load_limits(h, now)
  local limits = {}
  for _, l in ipairs(args.limits or {}) do
    l.cfg_cap, l.cfg_rate = l.cap, l.rate
    local scale = math.min(1, (learned_rate(h, l.name, now) or l.cfg_rate) / l.cfg_rate)
    l.cap, l.rate = l.cfg_cap * scale, l.cfg_rate * scale
    local level, ts = tonumber(h[l.name .. ':level']), tonumber(h[l.name .. ':ts'])
    l.level = level and math.min(l.cap, level + (now - ts) * l.rate) or l.cap
    limits[#limits + 1] = l
  end
  return limits
end

-- Write every limit's level at l.ts (default now) and the fields in `set` in one HSET, then
-- expire the hash once every level would be full again, but not before `keep_until`.
local function save_limits(bucket, h, limits, now, set)
  local keep = tonumber(set.keep_until or h.keep_until) or now
  local ttl, fields = keep - now, {}
  for _, l in ipairs(limits) do
    local ts = l.ts or now
    set[l.name .. ':level'], set[l.name .. ':ts'] = num(l.level), num(ts)
    set[l.name .. ':cap'], set[l.name .. ':rate'] = num(l.cfg_cap), num(l.cfg_rate)
    ttl = math.max(ttl, ts - now + (l.cap - l.level) / l.rate)
  end
  for k, v in pairs(set) do
    fields[#fields + 1] = k
    fields[#fields + 1] = v
  end
  if #fields > 0 then redis.call('HSET', bucket, unpack(fields)) end
  redis.call('PEXPIRE', bucket, math.ceil(math.max(0, ttl)) + 1000)
end

-- Renew the leases zset's own expiry so it outlives its latest lease.
local function expire_leases(leases, now)
  local last = redis.call('ZRANGE', leases, -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIRE', leases, math.ceil(tonumber(last[2]) - now) + 1000)
  end
end
