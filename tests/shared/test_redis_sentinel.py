"""Redis through Sentinel: the sentinel settings are validated, and a client built from them follows
the master that the sentinels promote when the old one dies (real redis-server processes, the
sentinels being the same binary in sentinel mode)."""

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from lorafleet.cli.infra import (
    SentinelTiming,
    Server,
    free_port,
    sentinel_addresses,
    start_redis,
    start_sentinels,
    wait_sentinels,
)
from services.scheduler.heat import Heat
from services.scheduler.redis_guard import RedisGuard
from shared.config import CommonSettings, load_settings
from shared.redis_conn import redis_from

PASSWORD = "s3cret-sentinel"
MASTER = "lf-test"
TIMING = SentinelTiming(down_after_ms=1000, failover_timeout_ms=3000, quorum=2)
# a failover ends within down-after + one failover-timeout (a failed first election is retried after it)
FAILOVER_BOUND_S = (TIMING.down_after_ms + 2 * TIMING.failover_timeout_ms) / 1000 + 5


@pytest.mark.parametrize(
    "value", ["127.0.0.1", "127.0.0.1:", ":26379", "host:port", "127.0.0.1:0", "127.0.0.1:70000", "a:1,b"]
)
def test_a_bad_sentinel_address_ends_start_up_naming_the_variable(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LF_REDIS_SENTINELS", value)
    with pytest.raises(SystemExit, match=r"LF_REDIS_SENTINELS: .*host:port"):
        load_settings(CommonSettings)


def test_sentinel_addresses_parse_and_an_unset_list_means_plain_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CommonSettings().sentinel_addresses() == []
    monkeypatch.setenv("LF_REDIS_SENTINELS", " 127.0.0.1:26379, redis-s2:26380 ,[::1]:26381")
    monkeypatch.setenv("LF_REDIS_SENTINEL_MASTER", "main-1")
    settings = load_settings(CommonSettings)
    assert settings.sentinel_addresses() == [("127.0.0.1", 26379), ("redis-s2", 26380), ("::1", 26381)]
    assert settings.redis_sentinel_master == "main-1"
    monkeypatch.setenv("LF_REDIS_SENTINEL_MASTER", "bad name")
    with pytest.raises(SystemExit, match="LF_REDIS_SENTINEL_MASTER"):
        load_settings(CommonSettings)


@dataclass
class Replicated:
    master: Server
    replica: Server
    sentinels: list[Server]


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[Replicated]:
    master = start_redis(free_port(), tmp_path / "master", password=PASSWORD)
    replica = start_redis(free_port(), tmp_path / "replica", password=PASSWORD, replicaof=master)
    sentinels = start_sentinels(
        [free_port() for _ in range(3)], master, tmp_path / "sentinels", tmp_path, MASTER, TIMING, PASSWORD
    )
    try:
        assert wait_sentinels(sentinels, MASTER, 1, 60, PASSWORD) == ("127.0.0.1", master.port)
        yield Replicated(master, replica, sentinels)
    finally:
        for server in (*sentinels, replica, master):
            server.stop()


def _role(server: Server) -> str:
    with redis.Redis(port=server.port, password=PASSWORD, socket_timeout=2) as r:
        return r.info("replication")["role"]


async def test_the_client_follows_the_master_sentinel_promotes(
    replicated: Replicated, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "redis.pw").write_text(PASSWORD + "\n")
    monkeypatch.setenv("LF_REDIS_PASSWORD_FILE", str(tmp_path / "redis.pw"))
    monkeypatch.setenv("LF_REDIS_SENTINELS", sentinel_addresses(replicated.sentinels))
    monkeypatch.setenv("LF_REDIS_SENTINEL_MASTER", MASTER)
    monkeypatch.setenv("LF_REDIS_URL", "redis://127.0.0.1:1/0")  # only the db counts: the sentinels give the host
    settings = load_settings(CommonSettings)
    client = redis_from(settings)
    guard = RedisGuard(retry_s=0.2)
    heat = Heat(client, guard, "t:", half_life_s=60)
    try:
        await heat.bump("before@1")
        assert guard.healthy and await client.zscore("t:heat:count", "before@1") == 1.0
        replicated.master.proc.kill()
        replicated.master.proc.wait()
        killed = time.monotonic()
        while time.monotonic() - killed < FAILOVER_BOUND_S:
            await heat.bump("after@1")  # fails over to the local fallback until a master answers again
            if guard.healthy and await client.zscore("t:heat:count", "after@1") is not None:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"the client found no master {FAILOVER_BOUND_S:.0f}s after the old one died")
        assert _role(replicated.replica) == "master"
        with redis.Redis(port=replicated.replica.port, password=PASSWORD, decode_responses=True) as promoted:
            assert promoted.zscore("t:heat:count", "after@1") is not None
            assert promoted.zscore("t:heat:count", "before@1") == 1.0  # replicated before the kill
    finally:
        await client.aclose()


async def test_the_client_refuses_to_write_to_a_demoted_master(replicated: Replicated) -> None:
    """A restarted old master rejoins as a replica; the client never writes there, it moves on."""
    client = redis_from(
        CommonSettings(
            redis_sentinels=sentinel_addresses(replicated.sentinels),
            redis_sentinel_master=MASTER,
            redis_url=f"redis://:{PASSWORD}@127.0.0.1:1/0",
        )
    )
    try:
        await client.set("k", "v1")
        with redis.Redis(port=replicated.sentinels[0].port, password=PASSWORD) as s:
            s.execute_command("SENTINEL", "FAILOVER", MASTER)  # a planned switch: the old master is demoted
        deadline = time.monotonic() + FAILOVER_BOUND_S
        while _role(replicated.master) != "slave" or _role(replicated.replica) != "master":
            assert time.monotonic() < deadline, "sentinel never switched the master"
            await asyncio.sleep(0.1)
        while True:
            try:
                await client.set("k", "v2")
                break
            except redis.exceptions.ConnectionError:  # the old connection learns the master moved
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
        with redis.Redis(port=replicated.replica.port, password=PASSWORD, decode_responses=True) as promoted:
            assert promoted.get("k") == "v2"
    finally:
        await client.aclose()
