"""Read-your-writes through the gateways' catalog views: once a registry write returns, the gateway
serves the new state from its mirror (no registry round trip); a gateway that never confirms
delays writes by the bound only."""

import asyncio
import time
import uuid

from shared import metrics, subjects
from shared.bus import request
from shared.catalog.view import CatalogView, follow_catalog
from shared.heartbeat import publish_heartbeats
from shared.schemas import AdapterRecordsReply, PromoteRequest, RollbackRequest
from tests.gateway.adapters import make_adapter, push, release


def _count(counter, *labels) -> float:
    return (counter.labels(*labels) if labels else counter)._value.get()


async def _served_version(client, model: str) -> str:
    r = await client.post(
        "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status_code == 200, r.text
    return r.headers["x-lorafleet-version"]


async def test_a_write_is_in_the_mirror_when_it_returns(gateway, tmp_path):
    _tenant, key = await gateway.tenant(scopes=("admin", "inference"))
    adapter_id = f"sync-{uuid.uuid4().hex[:6]}"
    mirror = gateway.catalog
    async with gateway.client(key) as client:
        await release(client, make_adapter(tmp_path / "v1", seed=1), adapter_id)  # through the admin API
        assert mirror.catalog.get(adapter_id, 1).status == "production"
        assert await _served_version(client, adapter_id) == "1"
        r = await push(client, make_adapter(tmp_path / "v2", seed=2), adapter_id)
        assert r.status_code == 201, r.text

        # writes straight to the registry (CLI, release tooling): the very next request sees each one
        await request(
            gateway.nc,
            subjects.registry("promote"),
            PromoteRequest(adapter_id=adapter_id, version=2, traffic_percent=100, actor="test"),
            AdapterRecordsReply,
            10,
        )
        assert mirror.catalog.get(adapter_id, 2).status == "production"
        from_mirror = _count(metrics.GATEWAY_RESOLVES, "mirror")
        assert await _served_version(client, adapter_id) == "2"
        assert _count(metrics.GATEWAY_RESOLVES, "mirror") == from_mirror + 1

        await request(
            gateway.nc,
            subjects.registry("rollback"),
            RollbackRequest(adapter_id=adapter_id, actor="test"),
            AdapterRecordsReply,
            10,
        )
        assert mirror.catalog.get(adapter_id, 1).status == "production"
        assert await _served_version(client, adapter_id) == "1"


async def test_a_gateway_that_never_confirms_delays_writes_by_the_bound_only(gateway, tmp_path):
    _, key = await gateway.tenant(scopes=("admin", "inference"))
    adapter_id = f"ghost-{uuid.uuid4().hex[:6]}"
    # a live gateway (it heartbeats) that does not answer catalog.sync
    ghost = asyncio.create_task(publish_heartbeats(gateway.nc, "gateway", "ghost-gw", 0.2, lambda: (True, "")))
    try:
        await asyncio.sleep(0.5)
        timeouts = _count(metrics.GATEWAY_SYNC_TIMEOUTS)
        async with gateway.client(key) as client:
            # answered within the gateway's own 2 s registry bound: the registry gave up on the
            # ghost after its 1 s sync bound, and the write stands
            r = await push(client, make_adapter(tmp_path / "v1", seed=3), adapter_id)
            assert r.status_code == 201, r.text
        assert _count(metrics.GATEWAY_SYNC_TIMEOUTS) == timeouts + 1
        assert gateway.catalog.catalog.get(adapter_id, 1) is not None  # the real gateway confirmed it
    finally:
        ghost.cancel()


class SlowMirror(CatalogView):
    """A mirror whose watch delivers every entry 300 ms late."""

    def __init__(self) -> None:
        super().__init__()
        self.ready = asyncio.Event()  # set with ``loaded``

    def mark_loaded(self) -> None:
        super().mark_loaded()
        self.ready.set()

    def apply(self, key: str, value: bytes | None, revision: int) -> None:
        asyncio.get_running_loop().call_later(0.3, super().apply, key, value, revision)


async def test_a_write_waits_for_a_slow_mirror(gateway, tmp_path):
    _, key = await gateway.tenant(scopes=("admin", "inference"))
    adapter_id = f"slow-{uuid.uuid4().hex[:6]}"
    slow = SlowMirror()
    followed = await follow_catalog(gateway.nc, 2.0, barrier=("gateway", "slow-gw"), view=slow)
    beats = asyncio.create_task(publish_heartbeats(gateway.nc, "gateway", "slow-gw", 0.2, lambda: (True, "")))
    try:
        await slow.ready.wait()
        await asyncio.sleep(0.3)  # the registry has seen this gateway's heartbeat
        async with gateway.client(key) as client:
            started = time.monotonic()
            r = await push(client, make_adapter(tmp_path / "v1", seed=4), adapter_id)
            assert r.status_code == 201, r.text
            assert time.monotonic() - started >= 0.3
        assert slow.catalog.get(adapter_id, 1) is not None  # held until the slow mirror had it
    finally:
        beats.cancel()
        followed.stop()
