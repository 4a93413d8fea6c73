"""Redis with requirepass: the password reaches the client from the URL or a password file,
and heat keys live under the configured prefix."""

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.exceptions import AuthenticationError, ResponseError

from lorafleet.cli.infra import free_port, redis_server_binary, wait_port
from services.scheduler.heat import Heat
from services.scheduler.redis_guard import RedisGuard
from shared.config import CommonSettings
from shared.redis_conn import connect_redis

PASSWORD = "s3cret-redis"


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--requirepass",
            PASSWORD,
            "--dir",
            str(tmp_path_factory.mktemp("redis")),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_port(port, 15, proc)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


async def test_password_from_url_or_file(redis_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    anonymous = connect_redis(f"redis://127.0.0.1:{redis_port}/0")
    with pytest.raises((AuthenticationError, ResponseError)):
        await anonymous.ping()
    await anonymous.aclose()
    in_url = connect_redis(f"redis://:{PASSWORD}@127.0.0.1:{redis_port}/0", password="ignored")
    assert await in_url.ping()
    await in_url.aclose()
    (tmp_path / "redis.pw").write_text(PASSWORD + "\n")
    monkeypatch.setenv("LF_REDIS_PASSWORD_FILE", str(tmp_path / "redis.pw"))
    settings = CommonSettings(redis_url=f"redis://127.0.0.1:{redis_port}/0", redis_key_prefix="tenantA:")
    client = connect_redis(settings.redis_url, password=settings.redis_password())
    guard = RedisGuard()
    heat = Heat(client, guard, settings.redis_key_prefix, half_life_s=60)
    await heat.bump("a@1")
    assert guard.healthy and await client.zscore("tenantA:heat:count", "a@1") == 1.0
    assert (await heat.decay())["a@1"] > 0 and await client.zscore("tenantA:heat", "a@1") > 0
    await client.aclose()
