-- share.lua: may a job publish more chunks on one queue's priority level? (trainer/shares.py)
-- KEYS[1] active zset (job -> last seen, ms), KEYS[2] queued hash (job -> samples waiting),
-- KEYS[3] weights hash (job -> weight)
-- ARGV: job, weight, idle_ms, stale_ms, depth (samples all jobs may keep waiting), keep_s,
--   then the sizes of the job's held chunks in the order it would publish them
-- The job's share of `depth` is depth * weight / (the weights of the active jobs). Chunks are
-- granted, in order, while the job's samples waiting plus half the next chunk stay within its
-- share (so that on average it keeps its share waiting), and always one when it has none
-- waiting (a share smaller than a chunk still moves). What is granted is booked at once, so
-- that two processes of one job cannot both use its share. Another job is active while it was
-- seen within idle_ms or still has samples waiting; one not seen for stale_ms is forgotten
-- whatever its count says (its process is gone; lost messages may have left the count high).
-- Returns the number of chunks granted.
local job, weight = ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, job)
redis.call('HSET', KEYS[3], job, ARGV[2])
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]), 'WITHSCORES')
for i = 1, #old, 2 do
  local other, seen = old[i], tonumber(old[i + 1])
  local waiting = tonumber(redis.call('HGET', KEYS[2], other) or '0')
  if other ~= job and (waiting <= 0 or seen <= now - tonumber(ARGV[4])) then
    redis.call('ZREM', KEYS[1], other)
    redis.call('HDEL', KEYS[2], other)
  end
end
local total = 0
for _, other in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  total = total + (tonumber(redis.call('HGET', KEYS[3], other)) or 1)
end
local share = tonumber(ARGV[5]) * weight / total
local waiting = math.max(0, tonumber(redis.call('HGET', KEYS[2], job) or '0'))
local granted, n = 0, 0
for i = 7, #ARGV do
  local size = tonumber(ARGV[i])
  if waiting + granted > 0 and waiting + granted + size / 2 > share then break end
  granted = granted + size
  n = n + 1
end
redis.call('HSET', KEYS[2], job, waiting + granted)
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[6]) end
return n
