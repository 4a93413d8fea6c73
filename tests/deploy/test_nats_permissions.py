"""The generated NATS permission model against a real nats-server: each user can do what its
service does, through the same code paths, and is refused what it must not do."""

import asyncio
import datetime

import nats
import nats.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from lorafleet.cli.nats_permissions import AUDIT_READER
from services.registry.kv import RecordsKV, open_bucket
from services.registry.releases_kv import ReleasesKV
from services.registry.stores import open_object_store
from services.worker.adapter_verify import fetch_adapter_files
from shared import signing, subjects
from shared.adapter_format import ADAPTER_FILES
from shared.bus import follow
from shared.kv_follow import follow_bucket
from shared.schemas import PinRecord, ReleaseState, SignerRecord
from tests.helpers.bus import settled

JS_TIMEOUT = 1.0


async def expect_js_refused(client, call, subject: str) -> None:
    """A JetStream call on a refused subject: no answer (or an error) and a reported violation."""
    with pytest.raises((nats.errors.TimeoutError, nats.errors.Error, TimeoutError)):
        await call
    assert await client.refused("Publish", subject)


async def test_wrong_password_is_refused(auth_server) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(
            auth_server.server.url,
            user="worker",
            password="wrong",
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=2,
        )


async def test_registry_owns_its_buckets_and_workers_only_read_them(connect_as) -> None:
    registry = await connect_as("registry")
    rjs = registry.nc.jetstream(timeout=5)
    kv = await RecordsKV.open(rjs)
    signer = SignerRecord(signer="ops", public_key=signing.generate_keypair().public_b64, tenants=["acme"])
    await kv.put_signer(signer)
    store = await open_object_store(rjs, subjects.ADAPTER_STORE_BUCKET)
    for name in ADAPTER_FILES:
        await store.put(f"tiny/1/{name}", name.encode())
    await rjs.publish(subjects.adapter_event("tiny"), b"{}")
    assert registry.errors == []
    # the release controller: its rollouts bucket, and the live completion records from a time on
    releases = await ReleasesKV.open(rjs)
    await releases.write(ReleaseState(adapter_id="tiny", tenant_id="acme", version=2, steps=[100], actor="t"), None)
    assert list(await releases.load()) == ["tiny"]
    pins = await open_bucket(rjs, subjects.REGISTRY_PINS_BUCKET)  # pins, checked against the workers' heartbeats
    pin = PinRecord(adapter_id="tiny", tenant_id="acme", actor="t")
    await pins.put(pin.key, pin.model_dump_json().encode())
    await registry.nc.subscribe(subjects.WORKER_HEARTBEAT)
    await settled(registry.nc)
    await rjs.subscribe(
        subjects.AUDIT_COMPLETION_ALL,
        stream=subjects.AUDIT_STREAM,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.BY_START_TIME,
        config=ConsumerConfig(opt_start_time=datetime.datetime.now(tz=datetime.UTC)),
    )
    assert registry.errors == []

    worker = await connect_as("worker-w1")
    wjs = worker.nc.jetstream(timeout=JS_TIMEOUT)
    files = await fetch_adapter_files(wjs, f"nats-os://{subjects.ADAPTER_STORE_BUCKET}/tiny/1")
    assert files == {name: name.encode() for name in ADAPTER_FILES}
    signers = await wjs.key_value(subjects.REGISTRY_SIGNERS_BUCKET)
    assert SignerRecord.model_validate_json((await signers.get("ops")).value or b"") == signer
    records = await wjs.key_value(subjects.REGISTRY_RECORDS_BUCKET)
    await expect_js_refused(worker, records.put("tiny.1", b"{}"), f"$KV.{subjects.REGISTRY_RECORDS_BUCKET}.tiny.1")
    followed: list[tuple[str, bytes | None]] = []
    watch = asyncio.create_task(
        follow_bucket(worker.nc, subjects.REGISTRY_PINS_BUCKET, lambda k, v, _: followed.append((k, v)), lambda: None)
    )
    for _ in range(200):  # the worker follows the pins as its PinFollower does
        if followed:
            break
        await asyncio.sleep(0.025)
    watch.cancel()
    assert followed == [(pin.key, pin.model_dump_json().encode())]
    worker_pins = await wjs.key_value(subjects.REGISTRY_PINS_BUCKET)
    await expect_js_refused(worker, worker_pins.put(pin.key, b"{}"), f"$KV.{subjects.REGISTRY_PINS_BUCKET}.{pin.key}")
    worker_store = await wjs.object_store(subjects.ADAPTER_STORE_BUCKET)
    with pytest.raises((nats.errors.TimeoutError, nats.errors.Error, TimeoutError)):
        await worker_store.put("tiny/2/x", b"evil")
    chunk_prefix = f'publish to "$O.{subjects.ADAPTER_STORE_BUCKET}.C.'.lower()  # nats-py lowercases errors
    assert any(chunk_prefix in e for e in worker.errors)
    assert await worker.publish_refused(subjects.adapter_event("x"))


@pytest.mark.parametrize("user", ["gateway", "worker-w1", "scheduler", "auditor"])
async def test_only_the_registry_publishes_adapter_events(connect_as, user: str) -> None:
    client = await connect_as(user)
    assert await client.publish_refused(subjects.adapter_event("x"))


@pytest.mark.parametrize(
    ("user", "publisher", "stream", "followed", "subject"),
    [
        (
            "scheduler",
            "gateway",
            subjects.AUDIT_STREAM,
            subjects.AUDIT_COMPLETION_ALL,
            subjects.audit("completion", "a"),
        ),
        (
            "worker-w1",
            "registry",
            subjects.ADAPTER_EVENTS_STREAM,
            subjects.ADAPTER_EVENTS_ALL,
            subjects.adapter_event("tiny"),
        ),
    ],
)
async def test_the_scheduler_follows_completions_and_workers_follow_adapter_events(
    connect_as, user: str, publisher: str, stream: str, followed: str, subject: str
) -> None:
    client = await connect_as(user)
    received: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_message(msg) -> None:
        received.put_nowait(msg.data)

    await follow(client.nc.jetstream(timeout=5), stream, followed, on_message)
    await (await connect_as(publisher)).nc.jetstream(timeout=5).publish(subject, b"{}")
    assert await asyncio.wait_for(received.get(), 5) == b"{}"
    assert client.errors == []


async def test_gateway_submits_requests_and_the_scheduler_consumes_them(connect_as) -> None:
    gateway = await connect_as("gateway")
    ack = await gateway.nc.jetstream(timeout=5).publish(subjects.infer_submit("acme", subjects.VIA_GATEWAY), b"{}")
    assert ack.stream == subjects.INFER_STREAM
    scheduler = await connect_as("scheduler")
    psub = await scheduler.nc.jetstream(timeout=5).pull_subscribe(
        subjects.INFER_SUBMIT_ALL,
        durable="scheduler",
        stream=subjects.INFER_STREAM,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_deliver=5),
    )
    msgs = await psub.fetch(batch=16, timeout=5)
    assert any(m.subject == subjects.infer_submit("acme", subjects.VIA_GATEWAY) for m in msgs)
    for msg in msgs:
        await msg.ack_sync(timeout=5)
    assert scheduler.errors == [] and gateway.errors == []
    assert await scheduler.publish_refused(subjects.infer_submit("acme"))
    assert await gateway.publish_refused(subjects.worker_dispatch("w1"))


async def test_request_reply_between_scheduler_worker_and_registry(connect_as) -> None:
    worker = await connect_as("worker-w1")

    async def answer(msg) -> None:
        await msg.respond(b"accepted")

    await worker.nc.subscribe(subjects.worker_dispatch("w1"), cb=answer)
    await settled(worker.nc)
    scheduler = await connect_as("scheduler")
    assert (await scheduler.nc.request(subjects.worker_dispatch("w1"), b"{}", timeout=2)).data == b"accepted"
    assert await scheduler.publish_refused(subjects.registry("register"))
    assert await worker.subscribe_refused("lf.registry.resolve")


async def test_a_worker_reads_only_its_own_dispatches_and_never_a_reply_stream(connect_as) -> None:
    w1 = await connect_as("worker-w1")
    for foreign in (
        subjects.worker_dispatch("w2"),
        subjects.worker_control("w2"),
        "lf.worker.*.dispatch",
        "lf.worker.>",
        "_INBOX.>",
        "_INBOX_acme.>",
        f"{subjects.worker_inbox('w2')}.>",
        subjects.INFER_SUBMIT_ALL,
    ):
        assert await w1.subscribe_refused(foreign), foreign

    w2 = await connect_as("worker-w2")
    dispatched: asyncio.Queue[bytes] = asyncio.Queue()

    async def accept(msg) -> None:
        dispatched.put_nowait(msg.data)
        await msg.respond(b"accepted")

    await w2.nc.subscribe(subjects.worker_dispatch("w2"), cb=accept)
    await w2.nc.subscribe(subjects.worker_control("w2"))
    await settled(w2.nc)
    scheduler = await connect_as("scheduler")
    assert (await scheduler.nc.request(subjects.worker_dispatch("w2"), b"prompt", timeout=2)).data == b"accepted"
    assert await dispatched.get() == b"prompt"

    gateway = await connect_as("gateway")
    inbox = gateway.nc.new_inbox()
    tokens = await gateway.nc.subscribe(inbox)
    await settled(gateway.nc)
    await w2.nc.publish(inbox, b"token")  # streaming a reply: publish, never subscribe
    await settled(w2.nc)  # the server has it (a refused publish would be an error by now)
    assert (await tokens.next_msg(timeout=10)).data == b"token"
    assert w2.errors == [] and scheduler.errors == []


async def test_auditor_only_reads(connect_as) -> None:
    gateway = await connect_as("gateway")
    await gateway.nc.jetstream(timeout=5).publish(subjects.audit("completion", "acme"), b"{}")
    auditor = await connect_as("auditor")
    psub = await auditor.nc.jetstream(timeout=5).pull_subscribe(
        subjects.AUDIT_ALL, durable="auditor", stream=subjects.AUDIT_STREAM
    )
    msgs = await psub.fetch(batch=1, timeout=5)
    await msgs[0].ack_sync(timeout=5)
    assert auditor.errors == []
    assert await auditor.publish_refused(subjects.infer_submit("acme"))
    assert await auditor.publish_refused(subjects.audit("completion", "acme"))
    ajs = auditor.nc.jetstream(timeout=JS_TIMEOUT)
    await expect_js_refused(
        auditor, ajs.delete_stream(subjects.AUDIT_STREAM), f"$JS.API.STREAM.DELETE.{subjects.AUDIT_STREAM}"
    )


async def test_services_cannot_create_or_delete_shared_streams(connect_as) -> None:
    worker = await connect_as("worker-w1")
    wjs = worker.nc.jetstream(timeout=JS_TIMEOUT)
    await expect_js_refused(
        worker, wjs.purge_stream(subjects.INFER_STREAM), f"$JS.API.STREAM.PURGE.{subjects.INFER_STREAM}"
    )
    await expect_js_refused(worker, wjs.add_stream(name="EVIL", subjects=["evil.>"]), "$JS.API.STREAM.CREATE.EVIL")


async def test_tenant_users_are_confined_to_their_tenant(connect_as) -> None:
    acme = await connect_as("tenant-acme", inbox_prefix="_INBOX_acme")
    ack = await acme.nc.jetstream(timeout=5).publish(subjects.infer_submit("acme"), b"{}")
    assert ack.stream == subjects.INFER_STREAM and acme.errors == []
    assert await acme.publish_refused(subjects.infer_submit("globex"))
    for via in (subjects.VIA_GATEWAY, subjects.VIA_PREVIEW):  # the origin the scheduler trusts is nats-server's
        assert await acme.publish_refused(subjects.infer_submit("acme", via))
    assert await acme.subscribe_refused("_INBOX_globex.>")
    assert await acme.subscribe_refused("_INBOX.>")
    assert await acme.publish_refused(subjects.registry("resolve"))

    worker = await connect_as("worker-w1")
    inbox = "_INBOX_acme.reply1"
    received = asyncio.get_running_loop().create_future()

    async def on_reply(msg) -> None:
        if not received.done():
            received.set_result(msg.data)

    await acme.nc.subscribe(inbox, cb=on_reply)
    await settled(acme.nc)
    await worker.nc.publish(inbox, b"token")
    assert await asyncio.wait_for(received, 10) == b"token"


async def test_gateway_mirrors_the_catalog_and_answers_the_registrys_sync(connect_as) -> None:
    from shared.catalog.barrier import CatalogBarrier
    from shared.catalog.view import follow_catalog
    from shared.schemas import ServiceHeartbeat
    from tests.helpers.records import make_record

    registry = await connect_as("registry")
    kv = await RecordsKV.open(registry.nc.jetstream(timeout=5))
    gateway = await connect_as("gateway")
    followed = await follow_catalog(gateway.nc, 2.0, barrier=("gateway", "gw1"))
    try:
        await settled(gateway.nc)
        revision = await kv.put_record(make_record("perm-sum", 1, "acme"))
        sync = CatalogBarrier(registry.nc, liveness_timeout_s=5, timeout_s=3)
        sync.on_heartbeat(ServiceHeartbeat(service="gateway", instance_id="gw1", ready=True))
        assert await sync.wait(revision) == set()  # confirmed through the permission set
        assert followed.view.catalog.get("perm-sum", 1) is not None
        assert registry.errors == [] and gateway.errors == []
    finally:
        followed.stop()
    assert await gateway.publish_refused(subjects.GATEWAY_CATALOG_SYNC)
    worker = await connect_as("worker-w1")
    assert await worker.publish_refused(subjects.GATEWAY_CATALOG_SYNC)


async def test_schedulers_and_workers_answer_the_registrys_sync_through_their_permission_sets(connect_as) -> None:
    from shared.catalog.barrier import CatalogBarrier
    from shared.catalog.view import follow_catalog
    from shared.schemas import ServiceHeartbeat
    from tests.helpers.records import make_record

    registry = await connect_as("registry")
    kv = await RecordsKV.open(registry.nc.jetstream(timeout=5))
    sync = CatalogBarrier(registry.nc, liveness_timeout_s=5, timeout_s=3)
    followed, peers = [], []
    for service, user, instance in (("scheduler", "scheduler", "s1"), ("worker", "worker-w1", "w1")):
        peer = await connect_as(user)
        # a worker's view follows the signers too (its cold loads verify signatures from it)
        view = await follow_catalog(peer.nc, 2.0, barrier=(service, instance), signers=service == "worker")
        await settled(peer.nc)
        sync.on_heartbeat(ServiceHeartbeat(service=service, instance_id=instance, ready=True))
        followed.append(view)
        peers.append(peer)
    auditor = await connect_as("auditor")  # its view is the cross-check's records (no barrier to answer)
    followed.append(await follow_catalog(auditor.nc, 2.0))
    peers.append(auditor)
    try:
        revision = await kv.put_record(make_record("perm-sync", 1, "acme"))
        assert await sync.wait(revision) == set()  # both confirmed through their permission sets
        for view, peer in zip(followed, peers, strict=True):
            assert await view.view.caught_up(revision, 5)
            assert await view.view.record(peer.nc.jetstream(timeout=5), "perm-sync", 1) is not None
        signers = await registry.nc.jetstream(timeout=5).key_value(subjects.REGISTRY_SIGNERS_BUCKET)
        await signers.put(
            "perm-signer", b"AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="
        )  # a bare key, as stored before tenant binding
        trusted = await followed[1].view.signers(peers[1].nc.jetstream(timeout=5), 5)  # the worker's, after a barrier
        assert trusted["perm-signer"] == ["AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="]
        assert registry.errors == [] and all(p.errors == [] for p in peers)
    finally:
        for view in followed:
            view.stop()


async def publish_audit_records(connect_as, tenants: tuple[str, ...]) -> None:
    """One completion record per tenant on the AUDIT stream, as the workers publish them."""
    worker = await connect_as("worker-w1")
    js = worker.nc.jetstream(timeout=5)
    for tenant in tenants:
        await js.publish(subjects.audit("completion", tenant), f'{{"tenant": "{tenant}"}}'.encode())


async def test_a_tenant_follows_only_its_own_audit_records_live_and_replayed(connect_as) -> None:
    acme = await connect_as("tenant-acme", inbox_prefix=subjects.tenant_inbox("acme"))
    live = await acme.nc.subscribe(subjects.audit_of_tenant("acme"))
    await settled(acme.nc)
    await publish_audit_records(connect_as, ("globex", "acme", "globex", "acme"))
    assert [(await live.next_msg(timeout=5)).subject for _ in range(2)] == [subjects.audit("completion", "acme")] * 2

    replay = await acme.nc.jetstream(timeout=5).pull_subscribe_bind(
        durable=subjects.tenant_audit_consumer("acme"), stream=subjects.AUDIT_STREAM
    )
    msgs = await replay.fetch(batch=100, timeout=2)
    assert msgs and {m.subject for m in msgs} == {subjects.audit("completion", "acme")}
    for msg in msgs:
        await msg.ack_sync(timeout=5)
    assert acme.errors == []

    assert await acme.subscribe_refused(subjects.audit("completion", "globex"))
    assert await acme.subscribe_refused(subjects.AUDIT_ALL)
    ajs = acme.nc.jetstream(timeout=JS_TIMEOUT)
    wide = ConsumerConfig(name=subjects.tenant_audit_consumer("acme"), filter_subject=subjects.AUDIT_ALL)
    await expect_js_refused(
        acme,
        ajs.add_consumer(subjects.AUDIT_STREAM, wide),
        f"$JS.API.CONSUMER.CREATE.AUDIT.audit-acme.{subjects.AUDIT_ALL}",
    )
    foreign = ConsumerConfig(name=subjects.tenant_audit_consumer("globex"), filter_subject="lf.audit.*.globex")
    await expect_js_refused(
        acme,
        ajs.add_consumer(subjects.AUDIT_STREAM, foreign),
        "$JS.API.CONSUMER.CREATE.AUDIT.audit-globex.lf.audit.*.globex",
    )
    await expect_js_refused(
        acme, ajs.get_msg(subjects.AUDIT_STREAM, seq=1), f"$JS.API.STREAM.MSG.GET.{subjects.AUDIT_STREAM}"
    )
    await expect_js_refused(acme, ajs.stream_info(subjects.AUDIT_STREAM), "$JS.API.STREAM.INFO.AUDIT")


async def test_the_audit_reader_reads_every_audit_subject_and_publishes_nothing(connect_as) -> None:
    reader = await connect_as(AUDIT_READER, inbox_prefix=subjects.AUDIT_READER_INBOX)
    live = await reader.nc.subscribe(subjects.AUDIT_ALL)
    await settled(reader.nc)
    await publish_audit_records(connect_as, ("acme", "globex"))
    got = {(await live.next_msg(timeout=5)).subject for _ in range(2)}
    assert got == {subjects.audit("completion", "acme"), subjects.audit("completion", "globex")}
    rjs = reader.nc.jetstream(timeout=5)
    replay = await rjs.pull_subscribe_bind(durable=AUDIT_READER, stream=subjects.AUDIT_STREAM)
    msgs = await replay.fetch(batch=100, timeout=2)
    assert {m.subject for m in msgs} >= got
    await msgs[0].ack_sync(timeout=5)
    assert reader.errors == []

    for subject in (
        subjects.audit("completion", "acme"),
        subjects.infer_submit("acme"),
        subjects.worker_dispatch("w1"),
        subjects.registry("resolve"),
        subjects.SCHEDULER_CANCEL,
        subjects.WORKER_HEARTBEAT,
        "_INBOX.x",
        "_INBOX_acme.x",
        f"$KV.{subjects.REGISTRY_TENANTS_BUCKET}.x",
        "anything.at.all",
    ):
        assert await reader.publish_refused(subject), subject
    rjs = reader.nc.jetstream(timeout=JS_TIMEOUT)
    await expect_js_refused(reader, rjs.purge_stream(subjects.AUDIT_STREAM), "$JS.API.STREAM.PURGE.AUDIT")
    await expect_js_refused(reader, rjs.delete_stream(subjects.AUDIT_STREAM), "$JS.API.STREAM.DELETE.AUDIT")
    await expect_js_refused(reader, rjs.delete_msg(subjects.AUDIT_STREAM, 1), "$JS.API.STREAM.MSG.DELETE.AUDIT")
    await expect_js_refused(
        reader, rjs.delete_consumer(subjects.AUDIT_STREAM, "auditor"), "$JS.API.CONSUMER.DELETE.AUDIT.auditor"
    )
    assert await reader.subscribe_refused("_INBOX.>")
    assert await reader.subscribe_refused(subjects.INFER_SUBMIT_ALL)
