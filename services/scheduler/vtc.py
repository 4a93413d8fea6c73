"""The fair queue's virtual token counters, shared by every scheduler of the fleet through Redis, so a
tenant's fair share holds across instances: what one scheduler served a tenant counts at all.

One hash (``<prefix>vtc``: tenant -> counter) holds the counters, a sorted set (``<prefix>vtc-active``:
tenant -> when a scheduler last reported it backlogged) says who is backlogged anywhere, and
``<prefix>vtc-floor`` the lowest active counter last seen. Each scheduler hands off, every
``period_s``, in one round trip (a Lua script, atomic): what it charged since (HINCRBYFLOAT), the
tenants it holds requests of, and those that became backlogged here. A tenant that became backlogged
and is backlogged at no scheduler is lifted to the lowest active counter (the VTC rule: idling earns
no credit); one still backlogged at another scheduler keeps its counter. The script answers the
shared counters of the tenants this scheduler queues, which its queue adopts.

So the admission hot path never waits on Redis: the queue orders by counters at most one period (plus
a round trip) behind the other schedulers' charges, and by its own charges at once. While Redis does
not answer, the queue runs on its local counters, and the charges made meanwhile are handed off,
added to the shared counters, at the first hand-off that reaches Redis again."""

import asyncio

from redis.asyncio import Redis

from services.scheduler.fairness import FairQueue
from services.scheduler.redis_guard import RedisGuard

ACTIVE_PERIODS = 5  # a backlog report holds this many hand-off periods (a missed one or two is no idling)
QUIET_PERIODS = 10  # a quiet scheduler reads the floor once in this many periods, not every period

# KEYS: counters hash, active zset, floor string
# ARGV: seconds a backlog report holds, then counts and lists: backlogged here, lifted here, charged
#       (tenant, amount pairs), wanted (tenants whose counters to answer)
# Returns {floor, counter of each wanted tenant} as strings.
HAND_OFF = """\
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local i = 1
local function list()
  local n = tonumber(ARGV[i + 1]); local out = {}
  for j = 1, n do out[j] = ARGV[i + 1 + j] end
  i = i + 1 + n
  return out
end
local hold = tonumber(ARGV[1])
local backlogged, lifted, charged, wanted = list(), list(), list(), list()
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - hold)
local function counters(tenants)  -- HMGET in chunks (unpack has a stack limit)
  local out = {}
  for s = 1, #tenants, 1000 do
    local part = redis.call('HMGET', KEYS[1], unpack(tenants, s, math.min(s + 999, #tenants)))
    for j = 1, #part do out[#out + 1] = part[j] or '0' end
  end
  return out
end
local function lowest()
  local low = nil
  for _, v in ipairs(counters(redis.call('ZRANGE', KEYS[2], 0, -1))) do
    v = tonumber(v)
    if low == nil or v < low then low = v end
  end
  return low
end
local floor = lowest() or tonumber(redis.call('GET', KEYS[3]) or '0')
for _, tenant in ipairs(lifted) do
  if not redis.call('ZSCORE', KEYS[2], tenant) then
    local v = tonumber(redis.call('HGET', KEYS[1], tenant) or '0')
    if v < floor then redis.call('HSET', KEYS[1], tenant, tostring(floor)) end
  end
end
for j = 1, #charged, 2 do redis.call('HINCRBYFLOAT', KEYS[1], charged[j], charged[j + 1]) end
for _, tenant in ipairs(backlogged) do redis.call('ZADD', KEYS[2], now, tenant) end
local low = lowest()
if low then floor = low; redis.call('SET', KEYS[3], tostring(low)) end
local out = counters(wanted)
table.insert(out, 1, tostring(floor))
return out
"""


class SharedCounters:
    def __init__(self, redis: Redis, guard: RedisGuard, key_prefix: str, queue: FairQueue, period_s: float):
        self._guard = guard
        self._queue = queue
        self.period_s = period_s
        self._keys = [f"{key_prefix}vtc", f"{key_prefix}vtc-active", f"{key_prefix}vtc-floor"]
        self._script = redis.register_script(HAND_OFF)

    async def hand_off(self) -> bool:
        """Hand this scheduler's charges and backlog to the shared counters and adopt them; False
        (the changes kept for the next hand-off, the queue on its local counters) if Redis did not answer."""
        queue = self._queue
        charged, lifted = queue.take_changes()
        backlogged = queue.backlogged()
        wanted = sorted(set(backlogged) | lifted | charged.keys())
        args: list[str | float] = [self.period_s * ACTIVE_PERIODS]
        for names in (backlogged, sorted(lifted)):
            args += [len(names), *names]
        args.append(2 * len(charged))
        for tenant, cost in charged.items():
            args += [tenant, repr(cost)]
        args += [len(wanted), *wanted]
        ok, answer = await self._guard.call("vtc", lambda: self._script(keys=self._keys, args=args))
        if not ok or answer is None:
            queue.give_back_changes(charged, lifted)
            return False
        floor, *values = (float(v) for v in answer)
        queue.adopt(dict(zip(wanted, values, strict=True)), floor)
        return True

    async def run(self) -> None:
        """Hand off every period until cancelled; while this scheduler is quiet (nothing queued or
        charged), once in ``QUIET_PERIODS``: only the floor would change, which a tenant lifted here
        corrects at the next hand-off, a period later (an idle scheduler leaves Redis alone)."""
        skipped = 0
        while True:
            await asyncio.sleep(self.period_s)
            if self._queue.quiet() and skipped < QUIET_PERIODS - 1:
                skipped += 1
                continue
            skipped = 0
            await self.hand_off()
