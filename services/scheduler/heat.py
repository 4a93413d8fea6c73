"""Per-adapter request heat shared through Redis: decayed counts, published as rates.

``HeatKeys.counts`` holds decayed request counts; every decay tick a Lua script multiplies
them by 2^(-dt/half_life) on Redis time and rewrites ``HeatKeys.rates`` as rates (requests/s),
the zset the workers' cache policy reads. Several schedulers add into the same counts. While
Redis is away the same decayed rates are kept in-process (``shared.decay.DecayedRate``, as the workers' heat policy keeps them)."""

import time

from redis.asyncio import Redis

from services.scheduler.redis_guard import RedisGuard
from shared.adapter_keys import HeatKeys
from shared.decay import DecayedRate

DECAY = """\
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local half_life, floor = tonumber(ARGV[1]), tonumber(ARGV[2])
local last = tonumber(redis.call('GET', KEYS[3]) or now)
local factor = math.pow(2, -math.max(0, now - last) / half_life)
local rate = math.log(2) / half_life
local counts = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
redis.call('DEL', KEYS[2])
local out = {}
for i = 1, #counts, 2 do
  local c = tonumber(counts[i + 1]) * factor
  if c < floor then
    redis.call('ZREM', KEYS[1], counts[i])
  else
    redis.call('ZADD', KEYS[1], c, counts[i])
    redis.call('ZADD', KEYS[2], c * rate, counts[i])
    out[#out + 1] = counts[i]
    out[#out + 1] = tostring(c * rate)
  end
end
redis.call('SET', KEYS[3], tostring(now))
return out
"""


class Heat:
    def __init__(self, redis: Redis, guard: RedisGuard, key_prefix: str, half_life_s: float, floor: float = 1e-3):
        self._redis = redis
        self._guard = guard
        self.half_life_s = half_life_s
        self.floor = floor
        keys = HeatKeys.under(key_prefix)
        self._keys = [keys.counts, keys.rates, keys.decayed_at]  # KEYS[1..3] of DECAY
        self._decay = redis.register_script(DECAY)
        self.local = DecayedRate(half_life_s, floor)

    async def bump(self, key: str) -> None:
        """One request placed for adapter ``key``. Between decays a bump counts whole; the next decay
        ages it from the previous tick, a bias of at most one decay interval."""
        self.local.bump(key, time.monotonic())
        await self._guard.call("heat", lambda: self._redis.zincrby(self._keys[0], 1.0, key))

    async def decay(self) -> dict[str, float]:
        """Age every count to now and republish the rates; the fleet's rates (local ones without Redis)."""
        ok, flat = await self._guard.call(
            "heat", lambda: self._decay(keys=self._keys, args=[self.half_life_s, self.floor])
        )
        if not ok:
            now = time.monotonic()
            self.local.prune(now)
            return self.local.snapshot(now)
        assert flat is not None, "the script answers a list when Redis is up"
        return {flat[i]: float(flat[i + 1]) for i in range(0, len(flat), 2)}
