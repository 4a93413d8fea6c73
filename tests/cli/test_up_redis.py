"""``lorafleet up --cluster``'s Redis: a master, its replica and three sentinels, each supervised, and
the environment that points the services at the master through the sentinels."""

from pathlib import Path

import pytest

from lorafleet.cli.infra import free_port, wait_sentinels
from lorafleet.cli.up import start_redis_set
from shared.config import CommonSettings
from shared.redis_conn import redis_from


async def test_the_cluster_profile_starts_a_replica_and_three_sentinels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "logs").mkdir()
    servers, env = start_redis_set(True, free_port(), free_port(), tmp_path)
    try:
        master, _replica, *sentinels = servers
        assert [s.name for s in servers] == ["redis", "redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"]
        assert all((tmp_path / "logs" / f"{s.name}.log").is_file() for s in servers)
        assert wait_sentinels(sentinels, "lorafleet", 1, 60) == ("127.0.0.1", master.port)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        client = redis_from(CommonSettings())
        try:
            await client.set("lf:probe", "1")
            assert await client.info("server") and (await client.info("replication"))["role"] == "master"
        finally:
            await client.aclose()
    finally:
        for server in reversed(servers):
            server.stop()


def test_the_single_node_profile_starts_redis_alone(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    servers, env = start_redis_set(False, free_port(), free_port(), tmp_path)
    try:
        assert [s.name for s in servers] == ["redis"] and env == {"LF_REDIS_URL": servers[0].url}
    finally:
        servers[0].stop()
