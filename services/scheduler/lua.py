"""The Redis Lua scripts of admission (atomic, on Redis server time ``TIME``)."""

ADMIT = """\
-- Admit one request atomically, on Redis server time.
-- KEYS: requests/min bucket, tokens/min bucket, concurrency leases (zset request id -> expiry),
--       and optionally the request's dispatched marker (set once a worker took it)
-- ARGV: rpm, tpm, max_concurrent (0 = no limit), token cost, request id, lease seconds
-- Returns {1, charged tokens}, {0, limit name, retry after seconds}, or {2} when the request was
-- dispatched before (a redelivery: nothing is charged). One round trip for both checks.
if KEYS[4] and redis.call('EXISTS', KEYS[4]) == 1 then return {2} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost, rid, lease = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])

local function level(key, cap)
  local v = redis.call('HMGET', key, 'tokens', 'ts')
  if not v[1] then return cap end
  return math.min(cap, tonumber(v[1]) + (now - tonumber(v[2])) * cap / 60)
end

local requests, tokens = 0, 0
if rpm > 0 then
  requests = level(KEYS[1], rpm)
  if requests < 1 then return {0, 'requests_per_min', tostring((1 - requests) * 60 / rpm)} end
end
if tpm > 0 then
  cost = math.min(cost, tpm)
  tokens = level(KEYS[2], tpm)
  if tokens < cost then return {0, 'tokens_per_min', tostring((cost - tokens) * 60 / tpm)} end
end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= conc and not redis.call('ZSCORE', KEYS[3], rid) then
    return {0, 'max_concurrent', '1'}
  end
  redis.call('ZADD', KEYS[3], now + lease, rid)
  redis.call('EXPIRE', KEYS[3], math.ceil(lease * 2))
end
if rpm > 0 then
  redis.call('HSET', KEYS[1], 'tokens', tostring(requests - 1), 'ts', tostring(now))
  redis.call('EXPIRE', KEYS[1], 120)
end
if tpm > 0 then
  redis.call('HSET', KEYS[2], 'tokens', tostring(tokens - cost), 'ts', tostring(now))
  redis.call('EXPIRE', KEYS[2], 120)
end
return {1, tostring(cost)}
"""

RELEASE = """\
-- Free a request's concurrency lease and refund unused tokens, or (refund < 0) renew the lease.
-- KEYS: tokens/min bucket, concurrency leases.  ARGV: refund tokens, tpm, request id, lease seconds
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local refund, tpm, rid = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
if refund < 0 then
  redis.call('ZADD', KEYS[2], 'XX', now + tonumber(ARGV[4]), rid)
  return 0
end
redis.call('ZREM', KEYS[2], rid)
if refund > 0 and tpm > 0 then
  local v = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  if v[1] then
    local level = math.min(tpm, tonumber(v[1]) + (now - tonumber(v[2])) * tpm / 60 + refund)
    redis.call('HSET', KEYS[1], 'tokens', tostring(level), 'ts', tostring(now))
  end
end
return 1
"""
