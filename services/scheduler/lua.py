"""The Redis Lua scripts of admission (atomic, on Redis server time ``TIME``)."""

# A tokens/min bucket may go below zero: a request costing more than the bucket holds is admitted
# once the bucket is full and charged in full, the rest carried as debt that the refill pays off
# before the tenant is admitted again. The key lives until the bucket would be full again.
_BUCKET = """\
local function level(key, cap)
  local v = redis.call('HMGET', key, 'tokens', 'ts')
  if not v[1] then return cap end
  return math.min(cap, tonumber(v[1]) + (now - tonumber(v[2])) * cap / 60)
end

local function store(key, tokens, cap)
  redis.call('HSET', key, 'tokens', tostring(tokens), 'ts', tostring(now))
  redis.call('EXPIRE', key, math.ceil((cap - tokens) * 60 / cap) + 60)
end
"""

ADMIT = (
    """\
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
"""
    + _BUCKET
    + """
local requests, tokens = 0, 0
if rpm > 0 then
  requests = level(KEYS[1], rpm)
  if requests < 1 then return {0, 'requests_per_min', tostring((1 - requests) * 60 / rpm)} end
end
if tpm > 0 then
  local need = math.min(cost, tpm)  -- more than a minute's worth needs a full bucket, then owes the rest
  tokens = level(KEYS[2], tpm)
  if tokens < need then return {0, 'tokens_per_min', tostring((need - tokens) * 60 / tpm)} end
end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= conc and not redis.call('ZSCORE', KEYS[3], rid) then
    return {0, 'max_concurrent', '1'}
  end
  redis.call('ZADD', KEYS[3], now + lease, rid)
  redis.call('EXPIRE', KEYS[3], math.ceil(lease * 2))
end
if rpm > 0 then store(KEYS[1], requests - 1, rpm) end
if tpm > 0 then store(KEYS[2], tokens - cost, tpm) end
return {1, tostring(cost)}
"""
)

RELEASE = (
    """\
-- End a request: free its concurrency lease and settle its tokens (delta > 0 gives back what it did
-- not use, delta < 0 charges what it used beyond its charge); or renew the lease.
-- KEYS: tokens/min bucket, concurrency leases.  ARGV: 'release' or 'renew', token delta, tpm,
-- request id, lease seconds
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local delta, tpm, rid = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
"""
    + _BUCKET
    + """
if ARGV[1] == 'renew' then
  redis.call('ZADD', KEYS[2], 'XX', now + tonumber(ARGV[5]), rid)
  return 0
end
redis.call('ZREM', KEYS[2], rid)
if delta ~= 0 and tpm > 0 then store(KEYS[1], math.min(tpm, level(KEYS[1], tpm) + delta), tpm) end
return 1
"""
)
