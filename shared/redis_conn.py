"""Redis connection with short timeouts, so no request path ever hangs on Redis; through Redis
Sentinel when sentinels are configured, so the client follows the master across a failover."""

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel
from redis.connection import parse_url

from shared.config import CommonSettings


def connect_redis(
    url: str,
    timeout_s: float = 0.5,
    password: str | None = None,
    sentinels: list[tuple[str, int]] | None = None,
    master: str = "lorafleet",
) -> aioredis.Redis:
    """``password`` is used when ``url`` carries none (``redis://:pass@host:port/0`` wins).

    With ``sentinels``, the client asks them for the address of ``master`` on every new connection,
    and a connection to a demoted or dead master fails (a ``ConnectionError``) instead of writing to
    a replica: the next call reconnects to whichever server the sentinels promoted. ``url`` then gives
    only the db number and the password, which the sentinels share."""
    if not sentinels:
        return aioredis.Redis.from_url(
            url,
            password=password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            health_check_interval=10,
            decode_responses=True,
        )
    parsed = parse_url(url)  # type: ignore[no-untyped-call]  # the same parse as Redis.from_url
    secret = parsed.get("password") or password
    username = parsed.get("username")
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]  # untyped before redis-py 8.2
        sentinels,
        sentinel_kwargs={
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "password": secret,
            "username": username,
        },
    )
    client: aioredis.Redis = sentinel.master_for(
        master,
        db=parsed.get("db", 0),
        password=secret,
        username=username,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=10,
        decode_responses=True,
    )
    return client


def redis_from(settings: CommonSettings, timeout_s: float = 0.5) -> aioredis.Redis:
    """The Redis client a service's settings describe: the plain URL, or the master its sentinels name."""
    return connect_redis(
        settings.redis_url,
        timeout_s,
        settings.redis_password(),
        settings.sentinel_addresses(),
        settings.redis_sentinel_master,
    )
