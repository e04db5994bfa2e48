-- settle.lua: adjust limits' levels after the fact, e.g. reconcile TPM with a call's real usage.
-- KEYS[1] bucket hash
-- ARGV[1] n limits, then per limit: name, capacity, refill rate per ms, delta
--   (delta > 0 refunds an over-estimate, delta < 0 charges an overrun; debt is allowed)
-- Returns the new levels, in ARGV order, as strings.
local now = now_ms()
local limits = load_limits(KEYS[1], 1, 4, now)
local levels = {}
for i, l in ipairs(limits) do
  l.level = math.min(l.cap, l.level + tonumber(ARGV[l.j + 3]))
  levels[i] = num(l.level)
end
save_limits(KEYS[1], limits, now)
return levels
