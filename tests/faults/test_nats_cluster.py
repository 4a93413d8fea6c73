"""The platform on a 3-node NATS cluster (three nats-server processes, routes between them, JetStream
on each) with every stream, KV bucket and object store at replicas 3. Killing the node that leads the
INFER stream, or one that leads nothing of it, under steady load: every request is served whole or
refused with a typed error within its bound, none runs twice, and the fleet serves again after."""

import asyncio
import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest

from bench.tiny_model import make_tiny_model
from lorafleet.cli.infra import Server, cluster_url, free_port, start_nats_cluster, start_redis, wait_jetstream
from lorafleet.cli.stack import Stack, wait_ready
from shared import subjects
from shared.bus import STREAM_NAMES
from tests.faults.conftest import ADAPTER, KEYS, REQUEST_TIMEOUT_S, SERVICES, WORKERS, make_adapter, release
from tests.faults.observe import audited, completions, readyz
from tests.faults.traffic import chat, check_served_or_refused, gateway, steady
from tests.scheduler.conftest import MODEL, wait_workers

pytestmark = pytest.mark.timeout(600)  # the first test also pays for starting the cluster and the stack
MAX_TOKENS = 24
REPLICATED = (
    *STREAM_NAMES,
    f"KV_{subjects.REGISTRY_RECORDS_BUCKET}",
    f"KV_{subjects.REGISTRY_TENANTS_BUCKET}",
    f"OBJ_{subjects.ADAPTER_STORE_BUCKET}",
)


@dataclass
class ClusterFleet:
    stack: Stack
    nodes: list[Server]
    redis: Server
    gateway_url: str
    db_path: Path

    @property
    def nats_url(self) -> str:
        return cluster_url(self.nodes)

    def ready(self, timeout_s: float = 90) -> None:
        asyncio.run(wait_ready(self.nats_url, self.stack, SERVICES, timeout_s))
        asyncio.run(wait_workers(self.nats_url, set(WORKERS), timeout_s))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFleet]:
    root = tmp_path_factory.mktemp("cluster")
    model_dir = make_tiny_model(root / MODEL)
    nodes = start_nats_cluster([free_port() for _ in range(3)], root / "nats", root)
    redis = start_redis(free_port(), root / "redis")
    port = free_port()
    env = {
        "LF_NATS_URL": cluster_url(nodes),
        "LF_JETSTREAM_REPLICAS": "3",
        "LF_REDIS_URL": redis.url,
        "LF_PORT": str(port),
        "LF_API_KEYS": json.dumps(KEYS),
        "LF_MODEL_DIR": str(model_dir),
        "LF_DEV_MODE": "true",
        "LF_REQUIRE_SIGNATURE": "false",
        "LF_DB_PATH": str(root / "audit.sqlite3"),
        "LF_LIVENESS_TIMEOUT_S": "5",
        "LF_ACCEPT_TIMEOUT_S": "10",
        "LF_NO_WORKER_GRACE_S": "8",
        "LF_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
        "LF_CAPACITY_HEADROOM": "0",
        "LF_ENGINE__MAX_NUM_SEQS": "4",
        "LF_ENGINE__NUM_THREADS": "1",
        "LF_ENGINE__KV_CACHE_BYTES": str(8 * 2**20),
        "LF_METRICS_PORT": "-1",
    }
    stack = Stack(env, root / "logs")
    fleet = ClusterFleet(stack, nodes, redis, f"http://127.0.0.1:{port}", root / "audit.sqlite3")
    try:
        asyncio.run(wait_jetstream(fleet.nats_url, 60))
        for name in SERVICES:
            stack.start(name)
        for worker in WORKERS:
            stack.start("worker", {"LF_WORKER_ID": worker}, key=worker)
        fleet.ready(180)
        asyncio.run(release(nodes[0].url, model_dir, make_adapter(model_dir, root / ADAPTER, 7), ADAPTER))
        yield fleet
    finally:
        stack.stop_all()
        redis.stop()
        for node in nodes:
            node.stop()


async def placements(url: str) -> dict[str, tuple[str | None, int, list[str]]]:
    """Stream -> (leader, replicas, peers) as the cluster reports it."""
    nc = await nats.connect(url.split(","))
    try:
        js = nc.jetstream()
        out = {}
        for name in REPLICATED:
            info = await js.stream_info(name)
            assert info.cluster is not None, name
            out[name] = (info.cluster.leader, info.config.num_replicas, [p.name for p in info.cluster.replicas or []])
        return out
    finally:
        await nc.close()


def test_every_stream_bucket_and_object_store_has_three_replicas(cluster):
    placed = asyncio.run(placements(cluster.nats_url))
    for name, (leader, replicas, peers) in placed.items():
        assert replicas == 3 and leader is not None and len(peers) == 2, (name, leader, peers)
        assert {leader, *peers} == {node.name for node in cluster.nodes}, (name, leader, peers)


def _kill_under_load(cluster: ClusterFleet, victim: Server) -> list:
    async def run() -> list:
        async with gateway(cluster.gateway_url) as client:
            load = asyncio.create_task(steady(client, 48, 0.25, MAX_TOKENS))
            await asyncio.sleep(2.0)  # several in flight, more arriving
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait()
            return await load

    return asyncio.run(run())


def _back_at_full_capacity(cluster: ClusterFleet, victim: Server) -> None:
    victim.start()  # the node rejoins with its store and catches up
    cluster.ready(90)

    async def served_after() -> None:
        await readyz(cluster.gateway_url, 200, 60)
        async with gateway(cluster.gateway_url) as client:
            after = await asyncio.gather(*(chat(client, key, MODEL, max_tokens=8) for key in KEYS for _ in range(4)))
        assert all(o.whole(8) for o in after), [o.describe() for o in after]

    asyncio.run(served_after())
    placed = asyncio.run(placements(cluster.nats_url))
    assert all(len(peers) == 2 for _, _, peers in placed.values()), placed


def _check(cluster: ClusterFleet, outcomes: list) -> None:
    check_served_or_refused(outcomes)
    assert all(o.whole(MAX_TOKENS) for o in outcomes if o.served), [o.describe() for o in outcomes]
    assert sum(o.served for o in outcomes) >= len(outcomes) // 2, [o.describe() for o in outcomes]
    counts = asyncio.run(audited(cluster.db_path, {o.request_id for o in outcomes if o.served}, 30))
    assert max(counts.values()) == 1, {rid: n for rid, n in counts.items() if n > 1}
    assert max(completions(cluster.db_path).values()) == 1


@pytest.mark.parametrize("which", ["infer_leader", "not_infer_leader"])
def test_killing_a_nats_node_under_load_loses_and_repeats_nothing(cluster, which):
    leader = asyncio.run(placements(cluster.nats_url))[subjects.INFER_STREAM][0]
    victim = next(n for n in cluster.nodes if (n.name == leader) == (which == "infer_leader"))
    outcomes = _kill_under_load(cluster, victim)
    _check(cluster, outcomes)
    if which == "infer_leader":  # the stream moved to a surviving node
        assert asyncio.run(placements(cluster.nats_url))[subjects.INFER_STREAM][0] != victim.name
    _back_at_full_capacity(cluster, victim)
