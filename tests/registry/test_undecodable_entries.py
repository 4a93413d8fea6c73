"""A registry starts, and answers, over entries in its buckets that do not decode: each is skipped and
counted (``undecodable_messages_total``). Before issue 47 one JetStream acknowledgement a tenant had
redirected into ``lf_releases`` (``{"stream": ..., "seq": ...}``) made the registry exit at every start."""

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from prometheus_client import REGISTRY

from services.registry.service import run
from services.registry.settings import RegistrySettings
from shared import subjects
from shared.bus import connect, request
from shared.schemas import (
    AdapterRecordsReply,
    ListAdaptersRequest,
    ListKeysRequest,
    ListPinsRequest,
    ListSourcesRequest,
    ListTenantsRequest,
    PinsReply,
    ReleaseStatusReply,
    ReleaseStatusRequest,
    ServiceHeartbeat,
    SourcesReply,
    TenantsReply,
    TrustedKeysReply,
)

ACK = b'{"stream": "INFER", "seq": 7}'  # what JetStream answers a publish with
JUNK = {  # bucket -> keys that hold something no registry wrote
    subjects.REGISTRY_RELEASES_BUCKET: {"junk": ACK},
    subjects.REGISTRY_TENANTS_BUCKET: {"tenant.junk": ACK, "key.junk": b"\xff\xfe"},
    subjects.REGISTRY_SOURCES_BUCKET: {"source.junk": ACK, "approval.junk": b"[]"},
    subjects.REGISTRY_PINS_BUCKET: {"junk.fleet.served": ACK},
    subjects.REGISTRY_RECORDS_BUCKET: {"junk.1": ACK},
    subjects.REGISTRY_SIGNERS_BUCKET: {"junk": b'{"signer": 5}'},
}


def skipped(bucket: str) -> float:
    return REGISTRY.get_sample_value("undecodable_messages_total", {"source": bucket}) or 0.0


async def run_registry(
    nats_url: str, base_dir: Path, tmp_path: Path, **settings_: object
) -> tuple[asyncio.Event, asyncio.Task]:
    """Start the registry in this process (``settings_`` over the test's); return once it is ready."""
    settings = RegistrySettings(
        nats_url=nats_url,
        model_dir=str(base_dir),
        instance_id="reg-undecodable",
        heartbeat_interval_s=0.1,
        trusted_source_dirs=(str(tmp_path),),
        **settings_,  # type: ignore[arg-type]
    )
    nc = await connect(nats_url, "registry-beats")
    try:
        beats = await nc.subscribe(subjects.service_heartbeat("registry"))
        stop = asyncio.Event()
        service = asyncio.create_task(run(settings, stop))
        while True:
            beat_msg = asyncio.ensure_future(beats.next_msg(timeout=60))
            await asyncio.wait({service, beat_msg}, return_when=asyncio.FIRST_COMPLETED)
            assert not service.done(), f"the registry stopped: {service.exception()!r}"
            beat = ServiceHeartbeat.model_validate_json(beat_msg.result().data)
            if beat.instance_id == settings.instance_id and beat.ready:
                return stop, service
    finally:
        await nc.close()


@pytest.fixture
async def admin(own_nats) -> AsyncIterator[NATS]:
    nc = await connect(own_nats.url, "junk-writer")
    yield nc
    await nc.close()


async def test_a_registry_starts_and_answers_over_entries_it_cannot_decode(own_nats, admin, base_dir, tmp_path):
    stop, service = await run_registry(own_nats.url, base_dir, tmp_path)  # makes its buckets
    stop.set()
    await service
    js = admin.jetstream()
    for bucket, entries in JUNK.items():
        kv = await js.key_value(bucket)
        for key, value in entries.items():
            await kv.put(key, value)
    before = {bucket: skipped(bucket) for bucket in JUNK}

    stop, service = await run_registry(own_nats.url, base_dir, tmp_path)
    try:
        answers = [
            (ReleaseStatusRequest(), ReleaseStatusReply, "release_status"),
            (ListTenantsRequest(), TenantsReply, "tenants"),
            (ListSourcesRequest(), SourcesReply, "sources"),
            (ListPinsRequest(), PinsReply, "pins"),
            (ListAdaptersRequest(), AdapterRecordsReply, "adapters"),
            (ListKeysRequest(), TrustedKeysReply, "keys"),
        ]
        for message, reply_type, op in answers:
            reply = await request(admin, subjects.registry(op), message, reply_type, 10)
            assert not any(getattr(reply, field) for field in reply_type.model_fields), (op, reply)
    finally:
        stop.set()
        await service
    assert {bucket: skipped(bucket) - before[bucket] >= 1 for bucket in JUNK} == dict.fromkeys(JUNK, True)
