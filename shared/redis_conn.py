"""Redis connection with short timeouts, so no request path ever hangs on Redis."""

import redis.asyncio as aioredis


def connect_redis(url: str, timeout_s: float = 0.5) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=10,
        decode_responses=True,
    )
