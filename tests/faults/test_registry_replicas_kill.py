"""One of two registry replicas killed (kill -9) during a burst of pushes and promotions: every push
a client had acknowledged is stored with its own version (none lost, none given twice), the
survivor answers everything after, its catalog equals the records bucket, and the gateway resolves
the promoted version."""

import asyncio
import time
from pathlib import Path

import nats
import pytest

from lorafleet.cli import adapter_cmd
from lorafleet.cli.adapter_cmd import push_adapter
from shared import subjects
from shared.bus import request
from shared.errors import Conflict, ServiceUnavailable, UpstreamTimeout
from shared.fingerprint import fingerprint_model_dir
from shared.kv_read import read_latest
from shared.schemas import AdapterRecord, AdapterRecordsReply, ListAdaptersRequest, PromoteRequest, ServiceHeartbeat
from tests.faults.conftest import make_adapter
from tests.faults.traffic import chat, gateway

pytestmark = pytest.mark.timeout(300)
ID = "burst-adapter"
CLIENTS, PUSHES = 4, 3
RETRIABLE = (Conflict, ServiceUnavailable, UpstreamTimeout)  # a taken version; a replica gone mid-request


async def pushes(
    nc: nats.NATS, directory: Path, fingerprint: str, acked: list[AdapterRecord], underway: asyncio.Event
) -> int:
    """``PUSHES`` acknowledged pushes, each retried until one is; then a promotion of the last. The
    number of retries."""
    retries = 0
    for _ in range(PUSHES):
        while True:
            try:
                record = await push_adapter(
                    nc, directory, adapter_id=ID, tenant_id="demo", task_type="chat", base_fingerprint=fingerprint
                )
            except RETRIABLE:
                retries += 1
                await asyncio.sleep(0.1)
                continue
            acked.append(record)
            if len(acked) >= 2:
                underway.set()
            break
    while True:
        try:
            promote = PromoteRequest(
                adapter_id=ID, version=acked[-1].version, traffic_percent=100, actor="t", skip_eval=True, reason="seed"
            )
            await request(nc, subjects.registry("promote"), promote, AdapterRecordsReply, 10.0)
            return retries
        except (ServiceUnavailable, UpstreamTimeout):
            retries += 1
            await asyncio.sleep(0.1)
        except Conflict:  # another client promoted a later version meanwhile, or this one already is
            return retries


def test_killing_one_of_two_registries_during_pushes_loses_and_repeats_no_version(fleet, tmp_path, monkeypatch):
    # a push the killed replica had taken is never answered: its client gives up at the CLI's request
    # timeout (30 s) and sends it again; here after 10 s (a slow push sent again is stored once: its push key)
    monkeypatch.setattr(adapter_cmd, "TIMEOUT_S", 10.0)
    directory = make_adapter(fleet.model_dir, tmp_path / "burst", seed=21)
    fleet.stack.start("registry", {"LF_INSTANCE_ID": "registry-b"}, key="registry-b")
    asyncio.run(instance_ready(fleet.nats.url, "registry-b", 60))
    try:
        acked, retries = asyncio.run(burst(fleet, directory))
    finally:
        fleet.stack.stop("registry-b")
        asyncio.run(asyncio.to_thread(fleet.start, "registry"))
    print(f"registry replica killed: {len(acked)} pushes acknowledged, {retries} requests retried")
    versions = [r.version for r in acked]
    assert len(versions) == CLIENTS * PUSHES and len(set(versions)) == len(versions), sorted(versions)
    stored, answered = asyncio.run(state(fleet.nats.url))
    assert {r.version: r.storage_uri for r in acked}.items() <= stored.items()  # every acknowledged push is stored
    assert answered == stored  # the registry's catalog equals the records bucket


async def instance_ready(nats_url: str, instance: str, timeout_s: float) -> None:
    """Until the registry ``instance`` publishes a ready heartbeat."""
    nc = await nats.connect(nats_url)
    try:
        beats = await nc.subscribe(subjects.service_heartbeat("registry"))
        deadline = time.monotonic() + timeout_s
        while True:
            beat = ServiceHeartbeat.model_validate_json(
                (await beats.next_msg(timeout=deadline - time.monotonic())).data
            )
            if beat.instance_id == instance and beat.ready:
                return
    finally:
        await nc.close()


async def burst(fleet, directory: Path) -> tuple[list[AdapterRecord], int]:
    fingerprint = fingerprint_model_dir(fleet.model_dir)
    acked: list[AdapterRecord] = []
    connections = [await nats.connect(fleet.nats.url) for _ in range(CLIENTS)]
    try:
        underway = asyncio.Event()
        clients = [asyncio.create_task(pushes(nc, directory, fingerprint, acked, underway)) for nc in connections]
        await asyncio.wait([asyncio.create_task(underway.wait()), *clients], return_when=asyncio.FIRST_COMPLETED)
        fleet.stack.kill("registry")  # the first replica, mid-burst
        retries = sum(await asyncio.gather(*clients))
        # the survivor serves the promoted version to the gateway
        async with gateway(fleet.gateway_url) as client:
            served = await chat(client, "key-demo", ID, max_tokens=8)
        assert served.whole(8), served.describe()
        return acked, retries
    finally:
        for nc in connections:
            await nc.close()


async def state(nats_url: str) -> tuple[dict[int, str], dict[int, str]]:
    """The adapter's versions in the records bucket, and as the registry answers them."""
    nc = await nats.connect(nats_url)
    try:
        bucket = await nc.jetstream().key_value(subjects.REGISTRY_RECORDS_BUCKET)
        stored = {}
        for entry in await read_latest(bucket, f"{ID}.>"):
            record = AdapterRecord.model_validate_json(entry.value)
            stored[record.version] = record.storage_uri
        reply = await request(
            nc, subjects.registry("adapters"), ListAdaptersRequest(tenant_id="demo"), AdapterRecordsReply, 10.0
        )
        return stored, {r.version: r.storage_uri for r in reply.records if r.adapter_id == ID}
    finally:
        await nc.close()
