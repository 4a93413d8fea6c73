"""Remote fetches bounded in number and in spooled bytes, and cancelled when their caller gives up
(issue 47, MEDIUM): a push over a bound is refused at once with a Retry-After, a fetch that would
pass a spool quota is stopped, and a fetch nobody waits for any more is cut and its spool deleted."""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from pydantic import ValidationError

from services.registry.settings import RemoteSourceSettings
from shared import subjects
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.bus import connect, encode, request
from shared.errors import (
    FetchCapacityFull,
    SourceFetchesBusy,
    SourceTimeout,
    SpoolFull,
    TenantSpoolFull,
    UpstreamTimeout,
)
from shared.schemas import AdapterRecord, AdapterRecordsReply, ServiceHeartbeat, TrustedKeysReply, TrustKeyRequest
from tests.helpers.remote_sources import Route
from tests.registry.remote.support import Files, Push, Servers, allow, call, start_registry, unique

HELD = 38_000  # bytes of a held source's weights: under the file cap, sent in a burst, then one byte per 50 ms
TENANT_SPOOL = 40_000
SPOOL = 50_000
TIMEOUT_S = 30.0  # the registry's own fetch limit: far past every wait here, so it never ends a fetch
SYNC_S = 4.0  # how long a commit holds the registry's lock for a gateway that never confirms it


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    directory = tmp_path / "spool"
    directory.mkdir()
    return directory


@pytest.fixture
async def remote_registry(nats_url: str, base_dir: Path, servers: Servers, spool: Path) -> AsyncIterator[NATS]:
    """conftest's ``push`` runs against this registry: three fetches at once, two per tenant, small spools."""
    remote = RemoteSourceSettings(
        s3_enabled=True,
        https_enabled=True,
        ca_file=str(servers.ca.ca_file),
        s3_endpoint_url=servers.s3.endpoint,
        timeout_s=TIMEOUT_S,
        max_file_bytes=39_000,
        max_total_bytes=TENANT_SPOOL,
        max_fetches=3,
        max_tenant_fetches=2,
        tenant_spool_bytes=TENANT_SPOOL,
        spool_bytes=SPOOL,
        spool_dir=str(spool),
    )
    stop, service = await start_registry(nats_url, base_dir, remote, gateway_sync_timeout_s=SYNC_S)
    nc = await connect(nats_url, "remote-bounds-test")
    yield nc
    stop.set()
    await service
    await nc.close()


async def another_tenant(push: Push) -> Push:
    tenant, signer = unique("t"), unique("release")
    trust = TrustKeyRequest(signer=signer, public_key=push.keys.public_b64, tenants=[tenant], actor="test")
    await call(push.nc, "trust_key", trust, TrustedKeysReply)
    return Push(push.nc, push.base, push.keys, signer, tenant)


async def held_source(push: Push, servers: Servers, files: Files, burst: int) -> str:
    """An HTTPS source whose weights stop after ``burst`` bytes and then drip for minutes."""
    base, path = servers.https.url("models.test"), f"/{push.tenant}/{unique('held')}/"
    servers.https.routes[path + CONFIG_FILE] = Route(files[CONFIG_FILE])
    servers.https.routes[path + WEIGHTS_FILE] = Route(b"\0" * HELD, burst=burst, drip_s=0.05)
    await allow(push.nc, f"{base}/{push.tenant}/", [push.tenant])
    return base + path


async def good_source(push: Push, servers: Servers, files: Files) -> str:
    key = f"{push.tenant}/{unique('good')}/"
    servers.s3.put_dir("models", key, files)
    await allow(push.nc, f"s3://models/{key}", [push.tenant])
    return f"s3://models/{key}"


def hold(push: Push, uri: str, files: Files, wait_s: float) -> asyncio.Task[AdapterRecordsReply]:
    """A push of ``uri`` whose caller waits ``wait_s`` for the answer (the registry's cut comes first)."""
    message = push.request(unique("held"), uri, files, wait_s=wait_s)
    return asyncio.create_task(request(push.nc, subjects.registry("register"), message, AdapterRecordsReply, 30))


def spooled(spool: Path, name: str = "*") -> list[int]:
    """The sizes of the files the registry spools now (one may be deleted while this looks)."""
    sizes = []
    for path in spool.rglob(name):
        with contextlib.suppress(FileNotFoundError):
            if path.is_file():
                sizes.append(path.stat().st_size)
    return sizes


def spool_dirs(spool: Path) -> int:
    return len(list(spool.iterdir()))


def spool_empty(spool: Path) -> bool:
    return spool_dirs(spool) == 0


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> float:
    """Seconds it took ``condition`` to hold; fails the test past ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "condition never held"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def test_pushes_over_the_tenant_or_registry_fetch_bound_are_refused_at_once_with_retry_after(
    push: Push, servers: Servers, adapter_files: Files, spool: Path
) -> None:
    other = await another_tenant(push)
    held = [
        hold(push, await held_source(push, servers, adapter_files, 100), adapter_files, 5.0),
        hold(push, await held_source(push, servers, adapter_files, 100), adapter_files, 5.0),
        hold(other, await held_source(other, servers, adapter_files, 100), adapter_files, 5.0),
    ]
    await until(lambda: len([n for n in spooled(spool, WEIGHTS_FILE) if n >= 100]) == 3)
    good = await good_source(push, servers, adapter_files)
    started = time.monotonic()
    busy = await push.refused(unique("busy"), good, adapter_files, SourceFetchesBusy)
    assert busy.status == 429 and busy.retry_after_s is not None and 1 <= busy.retry_after_s <= 5
    assert "LF_REMOTE__MAX_TENANT_FETCHES" in busy.message
    third = await another_tenant(push)
    full = await third.refused(unique("full"), await good_source(third, servers, adapter_files), adapter_files,
                               FetchCapacityFull)  # fmt: skip
    assert full.status == 503 and full.retry_after_s is not None and 1 <= full.retry_after_s <= 5
    assert time.monotonic() - started < 5  # refused at once, not queued behind the held fetches
    for task in held:  # each cut at its caller's wait, its spool deleted
        with pytest.raises(SourceTimeout, match=r"within 5\.0 s"):
            await task
    assert spool_empty(spool)
    record: AdapterRecord = await push.register(unique("after"), good, adapter_files)  # the bounds are free again
    assert record.tenant_id == push.tenant


async def test_a_fetch_that_would_pass_a_spool_quota_is_stopped_and_its_spool_deleted(
    push: Push, servers: Servers, adapter_files: Files, spool: Path
) -> None:
    size = sum(len(data) for data in adapter_files.values())
    assert 10_000 < size < SPOOL - 30_000 - len(adapter_files[CONFIG_FILE])  # the premise of the sums below
    held = [hold(push, await held_source(push, servers, adapter_files, 30_000), adapter_files, 6.0)]
    await until(lambda: sum(spooled(spool)) >= 30_000)
    # the tenant's second fetch would put its spool past TENANT_SPOOL: stopped while it streams
    busy = await push.refused(unique("tspool"), await good_source(push, servers, adapter_files), adapter_files,
                              TenantSpoolFull)  # fmt: skip
    assert busy.status == 507 and busy.retry_after_s is not None and "LF_REMOTE__TENANT_SPOOL_BYTES" in busy.message
    other, third = await another_tenant(push), await another_tenant(push)
    held.append(hold(other, await held_source(other, servers, adapter_files, SPOOL - 30_000 - size), adapter_files, 6))
    await until(lambda: sum(spooled(spool)) >= SPOOL - size)
    # a third tenant, far under its own quota, would put the registry's spool past SPOOL
    full = await third.refused(unique("spool"), await good_source(third, servers, adapter_files), adapter_files,
                               SpoolFull)  # fmt: skip
    assert full.status == 507 and "LF_REMOTE__SPOOL_BYTES" in full.message
    assert sum(spooled(spool)) < SPOOL  # the refused fetches' bytes are gone; the held ones' remain
    for task in held:
        with pytest.raises(SourceTimeout):
            await task
    assert spool_empty(spool)


async def test_a_push_whose_caller_gives_up_is_cancelled_and_its_spool_deleted_at_once(
    push: Push, servers: Servers, adapter_files: Files, spool: Path
) -> None:
    wait_s = 2.0
    messages = [
        push.request(unique("gives-up"), await held_source(push, servers, adapter_files, 5_000), adapter_files,
                     wait_s=wait_s)
        for _ in range(2)
    ]  # fmt: skip
    calls = [request(push.nc, subjects.registry("register"), m, AdapterRecordsReply, wait_s) for m in messages]
    gave_up = asyncio.gather(*calls, return_exceptions=True)
    await until(lambda: sum(spooled(spool)) >= 10_000)  # both fetching: the tenant is at its bound
    outcomes = await gave_up
    assert all(isinstance(o, UpstreamTimeout | SourceTimeout) for o in outcomes), outcomes
    freed_s = await until(lambda: spool_empty(spool), timeout_s=2.0)
    print(f"spool deleted {freed_s:.3f} s after the caller gave up")
    record = await push.register(unique("next"), await good_source(push, servers, adapter_files), adapter_files)
    assert record.tenant_id == push.tenant  # the tenant's fetch bound was released too


async def test_a_fetched_push_whose_caller_stops_waiting_for_admission_gives_its_spool_back(
    push: Push, servers: Servers, adapter_files: Files, spool: Path
) -> None:
    # a gateway that never confirms a catalog write: each commit holds the registry's lock SYNC_S
    silent = ServiceHeartbeat(service="gateway", instance_id=unique("silent"), ready=True)

    async def beat() -> None:
        while True:
            await push.nc.publish(subjects.service_heartbeat("gateway"), encode(silent))
            await asyncio.sleep(0.5)

    beating = asyncio.create_task(beat())
    syncs = await push.nc.subscribe(subjects.GATEWAY_CATALOG_SYNC)
    try:
        await asyncio.sleep(1.0)  # the registry has seen the gateway
        first = asyncio.create_task(push.register(unique("first"), await good_source(push, servers, adapter_files),
                                                  adapter_files))  # fmt: skip
        await syncs.next_msg(timeout=10)  # the first push's commit now holds the lock
        started = time.monotonic()
        with pytest.raises(SourceTimeout, match="before the registry could admit it"):
            second = push.request(unique("second"), await good_source(push, servers, adapter_files), adapter_files,
                                  wait_s=1.5)  # fmt: skip
            await request(push.nc, subjects.registry("register"), second, AdapterRecordsReply, 30)
        assert time.monotonic() - started < SYNC_S - 1  # dropped at its caller's wait, not after the lock
        assert spool_dirs(spool) == 1  # the first push's spool only: the second's is gone
        assert (await first).tenant_id == push.tenant  # the push its caller still waits for goes on
    finally:
        beating.cancel()
        await syncs.unsubscribe()


def test_one_fetch_must_fit_each_spool_quota() -> None:
    with pytest.raises(ValidationError, match="max_total_bytes <= tenant_spool_bytes <= spool_bytes"):
        RemoteSourceSettings(max_total_bytes=2_000_000, tenant_spool_bytes=1_000_000)
    with pytest.raises(ValidationError, match="max_total_bytes <= tenant_spool_bytes <= spool_bytes"):
        RemoteSourceSettings(tenant_spool_bytes=2 * 1024**3, spool_bytes=1024**3)
    with pytest.raises(ValidationError, match="max_tenant_fetches <= max_fetches"):
        RemoteSourceSettings(max_fetches=2, max_tenant_fetches=3)
    defaults = RemoteSourceSettings()
    assert (defaults.max_fetches, defaults.max_tenant_fetches) == (8, 2)
    assert defaults.max_total_bytes <= defaults.tenant_spool_bytes <= defaults.spool_bytes
