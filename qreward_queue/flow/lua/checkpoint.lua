-- checkpoint.lua: called by a granted holder after sleeping its wait, just before the backend call.
-- A pause (429) ordered while it slept moved the whole schedule back, so the holder must wait
-- that much longer too; its lease is renewed to cover that wait plus a full ttl.
-- KEYS[1] bucket hash, KEYS[2] leases zset
-- args: holder, lease_ttl_ms, seen_shift (the bucket's `shift` the holder last saw)
-- Returns {shift, extra_ms} (extra_ms 0 = go).
local now = now_ms()
local shift = tonumber(redis.call('HGET', KEYS[1], 'shift')) or 0
-- under 1 ms is no move: the shift a holder saw came back through JSON (14 significant
-- digits), so it may differ from the stored one in its last digits
local extra = shift - args.seen_shift
if extra < 1 then extra = 0 end
redis.call('ZADD', KEYS[2], num(now + extra + args.lease_ttl_ms), args.holder)
expire_leases(KEYS[2], now)
return cjson.encode({shift = shift, extra_ms = extra})
