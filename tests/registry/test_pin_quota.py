"""Pins are held to a tenant's GPU slot quota whether its own record sets one or the platform's
default applies (issue 47: with the default, 26 pins of one tenant took 26 of a worker's 27 rank-8
slots; the quota was checked only when the tenant record set one)."""

import asyncio
import time

import pytest

from services.registry.kv import RecordsKV
from services.registry.tenants import Tenants
from shared import subjects
from shared.bus import connect, encode, request
from shared.config import DefaultQuota
from shared.errors import PinsExceedSlots
from shared.schemas import (
    AdapterRecordsReply,
    CreateTenantRequest,
    ListAdaptersRequest,
    PinRequest,
    PinsReply,
    TenantQuota,
    TenantRecord,
    TenantsReply,
    WorkerHeartbeat,
)
from tests.helpers.records import make_record
from tests.registry.test_undecodable_entries import run_registry

DEFAULT_SLOTS = 2


def test_a_tenants_slot_quota_is_its_own_else_the_platforms():
    def tenants(**quota: int | None) -> Tenants:
        record = TenantRecord(tenant_id="t", quota=TenantQuota(**quota))
        return Tenants({"tenant.t": record.model_dump_json().encode()}, None, None)  # type: ignore[arg-type]

    assert tenants().slot_quota("t", default=16) == 16
    assert tenants(max_gpu_adapter_slots=4).slot_quota("t", default=16) == 4
    assert tenants(max_gpu_adapter_slots=0).slot_quota("t", default=16) is None  # its own: no limit
    assert tenants().slot_quota("t", default=0) is None
    assert tenants().slot_quota("unknown", default=16) == 16


async def test_a_tenant_without_its_own_quota_pins_no_more_than_the_platform_default(own_nats, base_dir, tmp_path):
    quota = DefaultQuota(max_gpu_adapter_slots=DEFAULT_SLOTS)
    stop, service = await run_registry(own_nats.url, base_dir, tmp_path, default_quota=quota)
    nc = await connect(own_nats.url, "pin-quota")
    try:
        await request(
            nc, subjects.registry("tenant_create"), CreateTenantRequest(tenant_id="t", actor="op"), TenantsReply, 10
        )
        kv = await RecordsKV.open(nc.jetstream())
        for i in range(DEFAULT_SLOTS + 1):
            await kv.put_record(make_record(f"pin{i}", 1, "t", status="production", traffic_percent=100, rank=8))
        listed, deadline = ListAdaptersRequest(tenant_id="t"), time.monotonic() + 10
        while (
            len((await request(nc, subjects.registry("adapters"), listed, AdapterRecordsReply, 10)).records)
            <= DEFAULT_SLOTS
        ):
            assert time.monotonic() < deadline, "the registry's catalog never followed the bucket"
            await asyncio.sleep(0.05)
        beat = WorkerHeartbeat(
            worker_id="w1", base_model="tiny-llama", ready=True, running=0, waiting=0, max_running=4,
            kv_blocks_free=1, kv_blocks_total=1, slots={"8": [0, 27]},
        )  # fmt: skip
        await nc.publish(subjects.WORKER_HEARTBEAT, encode(beat))
        await nc.flush()

        async def pin(i: int) -> PinsReply:
            message = PinRequest(adapter_id=f"pin{i}", tenant_id="t", actor="apikey:k1")
            return await request(nc, subjects.registry("pin"), message, PinsReply, 10)

        for i in range(DEFAULT_SLOTS):
            await pin(i)
        with pytest.raises(PinsExceedSlots, match=f"tenant t may hold {DEFAULT_SLOTS} rank-8 slots of a worker"):
            await pin(DEFAULT_SLOTS)
    finally:
        await nc.close()
        stop.set()
        await service
