"""Redis connection with short timeouts, so no request path ever hangs on Redis."""

import redis.asyncio as aioredis


def connect_redis(url: str, timeout_s: float = 0.5, password: str | None = None) -> aioredis.Redis:
    """``password`` is used when ``url`` carries none (``redis://:pass@host:port/0`` wins)."""
    return aioredis.Redis.from_url(
        url,
        password=password,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=10,
        decode_responses=True,
    )
