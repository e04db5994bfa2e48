-- checkpoint.lua: called by a granted holder after sleeping its wait, just before the backend call.
-- A pause (429) ordered while it slept moved the whole schedule back, so the holder must wait
-- that much longer too; its lease is renewed to cover that wait plus a full ttl.
-- KEYS[1] bucket hash, KEYS[2] leases zset
-- ARGV[1] holder id, ARGV[2] lease ttl ms, ARGV[3] the bucket's `shift` the holder last saw
-- Returns {shift now, extra wait ms} as strings (extra wait 0 = go).
local now = now_ms()
local shift = tonumber(redis.call('HGET', KEYS[1], 'shift')) or 0
local extra = math.max(0, shift - tonumber(ARGV[3]))
redis.call('ZADD', KEYS[2], num(now + extra + tonumber(ARGV[2])), ARGV[1])
local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[2], math.ceil(tonumber(last[2]) - now) + 1000)
return {num(shift), num(extra)}
