"""The generated NATS permission model against a real nats-server: each user can do what its
service does, through the same code paths, and is refused what it must not do."""

import asyncio

import nats
import nats.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from services.registry.kv import RecordsKV
from services.registry.stores import open_object_store
from services.worker.adapter_verify import fetch_adapter_files
from shared import subjects
from shared.adapter_format import ADAPTER_FILES
from shared.bus import follow

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
    await kv.put_signer("ops", "a2V5")
    store = await open_object_store(rjs, subjects.ADAPTER_STORE_BUCKET)
    for name in ADAPTER_FILES:
        await store.put(f"tiny/1/{name}", name.encode())
    await rjs.publish(subjects.adapter_event("tiny"), b"{}")
    assert registry.errors == []

    worker = await connect_as("worker")
    wjs = worker.nc.jetstream(timeout=JS_TIMEOUT)
    files = await fetch_adapter_files(wjs, f"nats-os://{subjects.ADAPTER_STORE_BUCKET}/tiny/1")
    assert files == {name: name.encode() for name in ADAPTER_FILES}
    signers = await wjs.key_value(subjects.REGISTRY_SIGNERS_BUCKET)
    assert (await signers.get("ops")).value == b"a2V5"
    records = await wjs.key_value(subjects.REGISTRY_RECORDS_BUCKET)
    await expect_js_refused(worker, records.put("tiny.1", b"{}"), f"$KV.{subjects.REGISTRY_RECORDS_BUCKET}.tiny.1")
    worker_store = await wjs.object_store(subjects.ADAPTER_STORE_BUCKET)
    with pytest.raises((nats.errors.TimeoutError, nats.errors.Error, TimeoutError)):
        await worker_store.put("tiny/2/x", b"evil")
    chunk_prefix = f'publish to "$O.{subjects.ADAPTER_STORE_BUCKET}.C.'.lower()  # nats-py lowercases errors
    assert any(chunk_prefix in e for e in worker.errors)
    assert await worker.publish_refused(subjects.adapter_event("x"))


@pytest.mark.parametrize("user", ["gateway", "worker", "scheduler", "auditor"])
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
            "worker",
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
    worker = await connect_as("worker")

    async def answer(msg) -> None:
        await msg.respond(b"accepted")

    await worker.nc.subscribe(subjects.worker_dispatch("w1"), cb=answer)
    await worker.nc.flush()
    scheduler = await connect_as("scheduler")
    assert (await scheduler.nc.request(subjects.worker_dispatch("w1"), b"{}", timeout=2)).data == b"accepted"
    assert await scheduler.publish_refused(subjects.registry("register"))
    assert await worker.subscribe_refused("lf.registry.resolve")


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
    worker = await connect_as("worker")
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

    worker = await connect_as("worker")
    inbox = "_INBOX_acme.reply1"
    received = asyncio.get_running_loop().create_future()

    async def on_reply(msg) -> None:
        if not received.done():
            received.set_result(msg.data)

    await acme.nc.subscribe(inbox, cb=on_reply)
    await acme.nc.flush()
    await worker.nc.publish(inbox, b"token")
    assert await asyncio.wait_for(received, 2) == b"token"


async def test_gateway_mirrors_the_catalog_and_answers_the_registrys_sync(connect_as) -> None:
    from services.gateway.catalog_follow import start_resolver
    from services.registry.gateway_sync import GatewaySync
    from shared.schemas import ServiceHeartbeat
    from tests.helpers.records import make_record

    registry = await connect_as("registry")
    kv = await RecordsKV.open(registry.nc.jetstream(timeout=5))
    gateway = await connect_as("gateway")
    resolver, watch = await start_resolver(gateway.nc, "gw1", 2.0)
    try:
        await gateway.nc.flush()
        revision = await kv.put_record(make_record("perm-sum", 1, "acme"))
        sync = GatewaySync(registry.nc, liveness_timeout_s=5, timeout_s=3)
        sync.on_heartbeat(ServiceHeartbeat(service="gateway", instance_id="gw1", ready=True))
        assert await sync.wait(revision) == set()  # confirmed through the permission set
        assert resolver.mirror.catalog.get("perm-sum", 1) is not None
        assert registry.errors == [] and gateway.errors == []
    finally:
        watch.cancel()
    assert await gateway.publish_refused(subjects.GATEWAY_CATALOG_SYNC)
    worker = await connect_as("worker")
    assert await worker.publish_refused(subjects.GATEWAY_CATALOG_SYNC)
