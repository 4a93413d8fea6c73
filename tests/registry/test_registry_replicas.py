"""Two registry replicas on one NATS: they serve the ops as a queue group, each follows the records,
signers and tenants buckets (never memory alone), and every write is a compare-and-set, so pushes
of one adapter racing through both get distinct, increasing versions with their own files, none lost,
and a stale plan is refused whole."""

import asyncio
import base64
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from transformers import AutoConfig

from lorafleet.cli.adapter_cmd import push_adapter
from lorafleet.cli.infra import Server
from services.registry.kv import RecordsKV, StaleRecords
from services.registry.push_admission import BaseModelIdentity
from services.registry.service import run
from services.registry.settings import RegistrySettings
from services.worker.adapter_source import StoreLoader
from services.worker.adapter_verify import fetch_verified
from services.worker.lora import LoraConfig, ModelShapes
from shared import signing, subjects
from shared.bus import connect, drain_or_close, request
from shared.catalog.records import record_key
from shared.catalog.view import follow_catalog
from shared.errors import Conflict, ServiceUnavailable
from shared.schemas import (
    AdapterRecord,
    AdapterRecordsReply,
    ApiKeyCreatedReply,
    CreateApiKeyRequest,
    CreateTenantRequest,
    ListAdaptersRequest,
    ListTenantsRequest,
    PromoteRequest,
    RegisterRequest,
    ServiceHeartbeat,
    TenantsReply,
    TrustedKeysReply,
    TrustKeyRequest,
)
from shared.signing import KeyPair
from tests.helpers.records import make_record

ID = "replicated"
PUSHES = 8


@pytest.fixture
async def replicas(own_nats: Server, base_dir: Path, tmp_path: Path) -> AsyncIterator[NATS]:
    """Two running registry replicas on a NATS of their own, and a client connection."""
    nats_url = own_nats.url
    nc = await connect(nats_url, "replicas-test")
    beats = await nc.subscribe(subjects.service_heartbeat("registry"))
    stop = asyncio.Event()
    services = []
    for instance in ("reg-a", "reg-b"):
        settings = RegistrySettings(
            nats_url=nats_url,
            model_dir=str(base_dir),
            instance_id=instance,
            heartbeat_interval_s=0.1,
            max_rank=16,
            trusted_source_dirs=(str(tmp_path),),
            dev_mode=True,  # unsigned pushes too: the registry then picks the version itself
        )
        services.append(asyncio.create_task(run(settings, stop)))
    ready: set[str] = set()
    while ready != {"reg-a", "reg-b"}:
        beat = ServiceHeartbeat.model_validate_json((await beats.next_msg(timeout=60)).data)
        if beat.ready:
            ready.add(beat.instance_id)
    await beats.unsubscribe()
    yield nc
    stop.set()
    await asyncio.gather(*services)
    await drain_or_close(nc)  # NATS may be back from a test that stopped it, its client still reconnecting


async def answers(nc: NATS, op: str, message, reply_type, times: int = 12) -> list:
    """The same question asked ``times`` times: the queue group spreads them over both replicas."""
    return [await request(nc, subjects.registry(op), message, reply_type, 10.0) for _ in range(times)]


async def push_signed(nc: NATS, adapter_dir: Path, **push) -> AdapterRecord:
    """A signed push names its version; one another push took first is refused (409), and the client
    signs the next one, as the CLI's user would."""
    while True:
        try:
            return await push_adapter(nc, adapter_dir, **push)
        except Conflict:
            continue


async def test_signed_pushes_racing_through_both_replicas_get_distinct_increasing_versions_with_their_own_files(
    replicas: NATS, variant, base: BaseModelIdentity, signer_keys: KeyPair, tmp_path: Path
) -> None:
    nc = replicas
    trust = TrustKeyRequest(signer="release", public_key=signer_keys.public_b64, tenants=["acme"], actor="t")
    await request(nc, subjects.registry("trust_key"), trust, TrustedKeysReply, 10.0)
    key_file = tmp_path / "release.key"
    key_file.write_bytes(signer_keys.private_pem)
    # the other replica follows the signers bucket: a push through either is verified against the key
    push = {"adapter_id": ID, "tenant_id": "acme", "task_type": "t", "base_fingerprint": base.fingerprint,
            "sign_key": key_file}  # fmt: skip
    pushed = await asyncio.gather(*(push_signed(nc, distinct(variant, tmp_path, i), **push) for i in range(PUSHES)))
    assert sorted(r.version for r in pushed) == list(range(1, PUSHES + 1))  # none twice, none lost
    assert len({r.storage_uri for r in pushed}) == PUSHES  # each version's files under its own prefix
    for record in pushed:  # no push wrote over another's files
        await fetch_verified(nc.jetstream(), record, base.fingerprint, {"release": signer_keys.public_b64})
    await same_on_every_replica(nc, pushed)

    # a promotion through one replica is what the other plans its next change from
    for version in (PUSHES, 1):
        promote = PromoteRequest(
            adapter_id=ID, version=version, traffic_percent=100, actor="t", skip_eval=True, reason="seed"
        )
        await request(nc, subjects.registry("promote"), promote, AdapterRecordsReply, 10.0)
    for reply in await answers(nc, "adapters", ListAdaptersRequest(tenant_id="acme"), AdapterRecordsReply):
        production = [r.version for r in reply.records if r.status == "production"]
        assert production == [1], [(r.version, r.status) for r in reply.records]


def distinct(variant, root: Path, i: int) -> Path:
    """The adapter with one weight scaled by its own factor: a push of other content than the rest."""

    def scale(tensors: dict) -> None:
        name = sorted(tensors)[0]
        tensors[name] = tensors[name] * (1.0 + (i + 1) / 64)

    directory = root / f"variant-{i}"
    directory.mkdir()
    for name, data in variant(tensors=scale).items():
        (directory / name).write_bytes(data)
    return directory


async def test_unsigned_registrations_racing_through_both_replicas_are_numbered_by_the_registry(
    replicas: NATS, adapter_files: dict[str, bytes], base: BaseModelIdentity
) -> None:
    nc = replicas
    inline = {name: base64.b64encode(data).decode() for name, data in adapter_files.items()}
    req = RegisterRequest(adapter_id="numbered", tenant_id="acme", task_type="t", inline_files=inline, actor="t")
    replies = await asyncio.gather(
        *(request(nc, subjects.registry("register"), req, AdapterRecordsReply, 30.0) for _ in range(PUSHES))
    )
    pushed = [r.records[0] for r in replies]
    assert sorted(r.version for r in pushed) == list(range(1, PUSHES + 1))  # every one acknowledged, each once
    for record in pushed:
        await fetch_verified(nc.jetstream(), record, base.fingerprint, {}, require_signature=False)
    await same_on_every_replica(nc, pushed, "numbered")


async def same_on_every_replica(nc: NATS, pushed: list[AdapterRecord], adapter_id: str = ID) -> None:
    """Every answer, from either replica, holds every version as stored in KV."""
    stored = await RecordsKV.open(nc.jetstream())
    expected = sorted((r.version, r.storage_uri) for r in pushed)
    assert sorted((r.version, r.storage_uri) for r, _ in await stored.load_adapter(adapter_id)) == expected
    for reply in await answers(nc, "adapters", ListAdaptersRequest(tenant_id="acme"), AdapterRecordsReply):
        assert sorted((r.version, r.storage_uri) for r in reply.records if r.adapter_id == adapter_id) == expected


async def test_what_one_replica_wrote_the_other_answers_at_once(replicas: NATS) -> None:
    """Read your writes across replicas: a tenant created through one (the queue group picks) and its
    key asked for right after, through either, always finds it; every listing holds every tenant
    made before it was asked. No waiting for the other replica's watch."""
    nc = replicas
    for i in range(20):
        tenant = f"t-new-{i}"
        await request(nc, subjects.registry("tenant_create"), CreateTenantRequest(tenant_id=tenant, actor="t"),
                      TenantsReply, 10.0)  # fmt: skip
        key = await request(nc, subjects.registry("api_key_create"), CreateApiKeyRequest(tenant_id=tenant, actor="t"),
                            ApiKeyCreatedReply, 10.0)  # fmt: skip
        assert key.info.tenant_id == tenant
        listed = await answers(nc, "tenants", ListTenantsRequest(), TenantsReply, times=2)
        assert all(tenant in {t.tenant_id for t in reply.tenants} for reply in listed)


async def test_a_batch_planned_from_a_stale_revision_is_refused_whole(own_nats: Server) -> None:
    nc = await connect(own_nats.url, "cas-test")
    try:
        kv = await RecordsKV.open(nc.jetstream())
        v1 = make_record("cas", 1, "acme", status="production", traffic_percent=100)
        (first,) = await kv.commit([(v1, 0)])
        v2 = make_record("cas", 2, "acme")
        with pytest.raises(StaleRecords):  # v1 is not new any more
            await kv.commit([(v2, 0), (v1.model_copy(update={"status": "retired"}), 0)])
        assert [r.version for r, _ in await kv.load_adapter("cas")] == [1]  # v2 of that batch was not written
        retired = v1.model_copy(update={"status": "retired"})
        written = await kv.commit([(v2, 0), (retired, first)])
        stored = {r.version: (r.status, rev) for r, rev in await kv.load_adapter("cas")}
        assert stored == {1: ("retired", written[1]), 2: (v2.status, written[0])}
        with pytest.raises(StaleRecords):  # the revision v1 had before is stale now
            await kv.commit([(v1, first)])
        bucket = await nc.jetstream().key_value(subjects.REGISTRY_RECORDS_BUCKET)
        assert (await bucket.get(record_key("cas", 1))).revision == written[1]
    finally:
        await nc.drain()


async def test_a_retried_signed_push_is_answered_with_the_stored_record(
    replicas: NATS, adapter_files: dict[str, bytes], base: BaseModelIdentity, signer_keys: KeyPair
) -> None:
    """A client whose answer was lost sends the same signed push again: whichever replica gets it
    answers the version stored the first time, and stores nothing more."""
    nc = replicas
    trust = TrustKeyRequest(signer="release", public_key=signer_keys.public_b64, tenants=["acme"], actor="t")
    await request(nc, subjects.registry("trust_key"), trust, TrustedKeysReply, 10.0)
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in adapter_files.items()}
    manifest = signing.manifest_bytes(digests, "retried", 1, "acme", base.fingerprint)
    signature = signing.sign(manifest, signing.load_private_key(signer_keys.private_pem))
    inline = {name: base64.b64encode(data).decode() for name, data in adapter_files.items()}
    req = RegisterRequest(adapter_id="retried", tenant_id="acme", task_type="t", version=1, inline_files=inline,
                          signature=signature, signer="release", actor="t")  # fmt: skip
    first = (await request(nc, subjects.registry("register"), req, AdapterRecordsReply, 30.0)).records[0]
    again = [r.records[0] for r in await answers(nc, "register", req, AdapterRecordsReply, times=6)]
    assert all(r == first for r in again)
    stored = await RecordsKV.open(nc.jetstream())
    assert [r for r, _ in await stored.load_adapter("retried")] == [first]
    other = req.model_copy(
        update={"signature": signing.sign(manifest + b"x", signing.load_private_key(signer_keys.private_pem))}
    )
    with pytest.raises(Conflict):  # the same version with other content is still a taken version
        await request(nc, subjects.registry("register"), other, AdapterRecordsReply, 30.0)


async def test_a_retried_push_with_its_push_key_is_answered_with_the_stored_version_signed_or_not(
    replicas: NATS, adapter_files: dict[str, bytes]
) -> None:
    """An unsigned push has no signature to recognise it by: its push key does. Retries of one key
    (with or without the version it named) get the one stored version back from either replica; the
    same key with other files is refused; another key is another push."""
    nc = replicas
    inline = {name: base64.b64encode(data).decode() for name, data in adapter_files.items()}
    req = RegisterRequest(adapter_id="keyed", tenant_id="acme", task_type="t", inline_files=inline,
                          push_key="push-1", actor="t")  # fmt: skip
    first = (await request(nc, subjects.registry("register"), req, AdapterRecordsReply, 30.0)).records[0]
    assert (first.version, first.push_key) == (1, "push-1")
    again = [r.records[0] for r in await answers(nc, "register", req, AdapterRecordsReply, times=6)]
    named = req.model_copy(update={"version": 1})  # the CLI's form: it names the version it planned
    again += [r.records[0] for r in await answers(nc, "register", named, AdapterRecordsReply, times=4)]
    assert all(r == first for r in again)
    stored = await RecordsKV.open(nc.jetstream())
    assert [r for r, _ in await stored.load_adapter("keyed")] == [first]

    changed = dict(adapter_files)
    changed["adapter_config.json"] = adapter_files["adapter_config.json"].replace(b"{", b'{"revision": "x", ', 1)
    other_files = {name: base64.b64encode(data).decode() for name, data in changed.items()}
    with pytest.raises(Conflict, match="new push needs a new key"):
        await request(nc, subjects.registry("register"), req.model_copy(update={"inline_files": other_files}),
                      AdapterRecordsReply, 30.0)  # fmt: skip
    second = await request(
        nc, subjects.registry("register"), req.model_copy(update={"push_key": "push-2"}), AdapterRecordsReply, 30.0
    )
    assert second.records[0].version == 2
    assert [r.version for r, _ in await stored.load_adapter("keyed")] == [1, 2]


async def test_a_cold_load_rides_out_nats_being_away_and_is_refused_typed_when_it_stays_away(
    own_nats: Server, replicas: NATS, adapter_files: dict[str, bytes], base_dir: Path
) -> None:
    """A worker's cold load reads KV and the object store with short tries: NATS gone for a few
    seconds (a node restarting, a cluster electing leaders) delays the load, it does not fail it;
    NATS gone for longer than the loader's bound is a typed 503, not a bare timeout."""
    nc = replicas
    inline = {name: base64.b64encode(data).decode() for name, data in adapter_files.items()}
    req = RegisterRequest(adapter_id="cold", tenant_id="acme", task_type="t", inline_files=inline, actor="t")
    record = (await request(nc, subjects.registry("register"), req, AdapterRecordsReply, 30.0)).records[0]
    shapes = ModelShapes.from_hf_config(AutoConfig.from_pretrained(base_dir))
    worker = await connect(own_nats.url, "cold-load-test")
    followed = await follow_catalog(worker, 5.0, signers=True)  # the worker's catalog view
    try:
        loop = asyncio.get_running_loop()
        loader = StoreLoader(worker, followed.view, loop, base_fingerprint=record.base_model_fingerprint, shapes=shapes,
                             lora=LoraConfig(rank_classes=(16,)), require_signature=False, timeout_s=20.0)  # fmt: skip
        own_nats.stop()
        load = asyncio.ensure_future(asyncio.to_thread(loader.files, f"cold@{record.version}"))
        await asyncio.sleep(3.0)
        assert not load.done()
        own_nats.start()
        loaded = await asyncio.wait_for(load, 30)
        assert loaded.digest == record.digest and loaded.files == adapter_files

        short = StoreLoader(worker, followed.view, loop, base_fingerprint=record.base_model_fingerprint, shapes=shapes,
                            lora=LoraConfig(rank_classes=(16,)), require_signature=False, timeout_s=2.0)  # fmt: skip
        own_nats.stop()
        try:
            started = time.monotonic()
            with pytest.raises(ServiceUnavailable, match="did not answer within 2 s"):
                await asyncio.to_thread(short.files, f"cold@{record.version}")
            assert time.monotonic() - started < 5.0
        finally:
            own_nats.start()
    finally:
        followed.stop()
        await drain_or_close(worker)
