"""Reply subjects and consumer settings of a direct-NATS tenant and of the SIEM (issue 47).

nats-server checks the subject a client publishes on against its permissions, never the reply subject
it names. While tenants shared the platform's account, a tenant's submission with its reply set to a
platform subject had JetStream's acknowledgement published there: into another tenant's work queue, a
KV bucket, the signed audit heads. Now each outside account imports only its own subjects, and
nats-server routes the reply of every service import back to the importing account. Each publish a
tenant or the SIEM may make that gets an answer is sent with its reply set to each platform subject it
could name, and none of them may see the answer; then the consequences the review found, one test
each, against the running stack."""

import json
import time
import uuid
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import KeyNotFoundError

from lorafleet.cli.nats_permissions import AUDIT_READER
from shared import subjects
from tests.helpers.bus import settled
from tests.hostile.conftest import AUDITOR, MODEL, WORKER, HostileStack

TENANT, VICTIM = "direct", "other"
FETCH = json.dumps({"batch": 1, "no_wait": True}).encode()  # answered at once: a record, or "404 no messages"


def _targets() -> list:
    buckets = (
        subjects.REGISTRY_RECORDS_BUCKET,
        subjects.REGISTRY_SIGNERS_BUCKET,
        subjects.REGISTRY_TENANTS_BUCKET,
        subjects.REGISTRY_SOURCES_BUCKET,
        subjects.REGISTRY_RELEASES_BUCKET,
        subjects.REGISTRY_PINS_BUCKET,
    )
    named = {
        "victims-queue": subjects.infer_submit(VICTIM),
        "victims-queue-gateway": subjects.infer_submit(VICTIM, subjects.VIA_GATEWAY),
        "victims-queue-preview": subjects.infer_submit(VICTIM, subjects.VIA_PREVIEW),
        "own-queue-as-gateway": subjects.infer_submit(TENANT, subjects.VIA_GATEWAY),
        "own-queue-as-preview": subjects.infer_submit(TENANT, subjects.VIA_PREVIEW),
        **{f"kv-{b}": f"$KV.{b}.hostile" for b in buckets},
        "object-store-meta": f"$O.{subjects.ADAPTER_STORE_BUCKET}.M.aG9zdGlsZQ==",
        "uploads-chunk": f"$O.{subjects.ADAPTER_UPLOADS_BUCKET}.C.hostile",
        "audit-heads": subjects.auditor_head(AUDITOR),
        "victims-audit": subjects.audit("completion", VICTIM),
        "own-audit": subjects.audit("rejection", TENANT),
        "adapter-event": subjects.adapter_event(f"{VICTIM}-secret"),
        "delete-audit-stream": "$JS.API.STREAM.DELETE.AUDIT",
        "purge-work-queue": "$JS.API.STREAM.PURGE.INFER",
        "delete-scheduler-consumer": "$JS.API.CONSUMER.DELETE.INFER.scheduler",
        "delete-records-bucket": f"$JS.API.STREAM.DELETE.KV_{subjects.REGISTRY_RECORDS_BUCKET}",
        "worker-heartbeat": subjects.WORKER_HEARTBEAT,
        "worker-dispatch": subjects.worker_dispatch(WORKER),
        "worker-control": subjects.worker_control(WORKER),
        "registry-tenant-create": subjects.registry("tenant_create"),
        "registry-promote": subjects.registry("promote"),
        "scheduler-cancel": subjects.SCHEDULER_CANCEL,
        "catalog-sync": subjects.GATEWAY_CATALOG_SYNC,
        "service-heartbeat": subjects.service_heartbeat("scheduler"),
        "supervisor-status": subjects.SUPERVISOR_STATUS,
        "auditor-query": subjects.AUDITOR_QUERY,
        "gateway-inbox": "_INBOX.hostile",
        "victims-inbox": f"{subjects.tenant_inbox(VICTIM)}.hostile",
        "worker-inbox": f"{subjects.worker_inbox(WORKER)}.hostile",
        "siem-inbox": f"{subjects.AUDIT_READER_INBOX}.hostile",
    }
    return [pytest.param(subject, id=name) for name, subject in named.items()]


TARGETS = _targets()
SURFACES = {  # each publish an outside client may make that gets an answer: (who, subject, body)
    "tenant-submit": (TENANT, subjects.infer_submit(TENANT), b"{}"),
    "tenant-replay-fetch": (TENANT, f"$JS.API.CONSUMER.MSG.NEXT.AUDIT.{subjects.tenant_audit_consumer(TENANT)}", FETCH),
    "siem-replay-fetch": (AUDIT_READER, f"$JS.API.CONSUMER.MSG.NEXT.AUDIT.{AUDIT_READER}", FETCH),
}


async def connect_siem(hostile: HostileStack) -> NATS:
    return await nats.connect(
        hostile.nats.url,
        user=AUDIT_READER,
        password=hostile.auth.creds.users[AUDIT_READER],
        inbox_prefix=subjects.AUDIT_READER_INBOX,
        allow_reconnect=False,
    )


async def connect_as(hostile: HostileStack, who: str) -> NATS:
    return await (connect_siem(hostile) if who == AUDIT_READER else hostile.connect_tenant(who))


def answered_by_jetstream(msg: Msg) -> bool:
    """A JetStream answer: a publish acknowledgement, a fetch's status, or a record a fetch delivered."""
    if msg.reply.startswith("$JS.ACK.") or (msg.headers or {}).get("Status"):
        return True
    try:
        body = json.loads(msg.data)
    except ValueError:
        return False
    return isinstance(body, dict) and "stream" in body and "seq" in body


@pytest.fixture
async def tenant(hostile: HostileStack) -> AsyncIterator[NATS]:
    client = await hostile.connect_tenant(TENANT)
    yield client
    await client.close()


# -- every reply subject, every surface ----------------------------------------------------------


@pytest.mark.parametrize("surface", list(SURFACES))
@pytest.mark.parametrize("target", TARGETS)
async def test_no_answer_reaches_a_platform_subject_named_as_the_reply(
    hostile: HostileStack, nc: NATS, surface: str, target: str
):
    who, subject, body = SURFACES[surface]
    seen: list[Msg] = []

    async def spy(msg: Msg) -> None:
        if answered_by_jetstream(msg):
            seen.append(msg)

    sub = await nc.subscribe(target, cb=spy)
    await settled(nc)
    client = await connect_as(hostile, who)
    try:
        own = await client.subscribe(client.new_inbox())  # a fetched record keeps its own subject: no request()
        await client.publish(subject, body, reply=target)
        # the same publish, answered on the client's own inbox: by then the first was answered too
        await client.publish(subject, body, reply=own.subject)
        answer = await own.next_msg(timeout=10)
        assert answer.data or answer.headers, "the surface answers its own client"
    finally:
        await client.close()
    await settled(nc)
    await sub.unsubscribe()
    assert seen == []


# -- what the redirections did before ------------------------------------------------------------


async def test_acknowledgements_aimed_at_another_tenants_queue_add_nothing_to_it(
    hostile: HostileStack, nc: NATS, tenant: NATS
):
    """A 10 s flood filled the victim's backlog to its cap (the victim got 429s) and wrote thousands
    of rejection records under the victim."""
    js = nc.jetstream()
    before = (await js.stream_info(subjects.INFER_STREAM)).state.last_seq
    flood = 200
    for _ in range(flood):
        await tenant.publish(subjects.infer_submit(TENANT), b"{}", reply=subjects.infer_submit(VICTIM, "gateway"))
    await tenant.jetstream().publish(subjects.infer_submit(TENANT), b"{}")  # the barrier
    assert (await js.stream_info(subjects.INFER_STREAM)).state.last_seq - before == flood + 1  # its own only
    async with hostile.client(hostile.keys.other) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


async def test_an_acknowledgement_aimed_at_a_kv_bucket_writes_nothing_and_the_registry_restarts(
    hostile: HostileStack, nc: NATS, tenant: NATS
):
    """One such write made ``ReleasesKV.load`` raise: the registry exited at every start."""
    js = nc.jetstream()
    stream = f"KV_{subjects.REGISTRY_RELEASES_BUCKET}"
    before = (await js.stream_info(stream)).state.last_seq
    key = f"hostile-{uuid.uuid4().hex[:8]}"
    await tenant.publish(subjects.infer_submit(TENANT), b"{}", reply=f"$KV.{subjects.REGISTRY_RELEASES_BUCKET}.{key}")
    await tenant.jetstream().publish(subjects.infer_submit(TENANT), b"{}")
    assert (await js.stream_info(stream)).state.last_seq == before
    with pytest.raises(KeyNotFoundError):
        await (await js.key_value(subjects.REGISTRY_RELEASES_BUCKET)).get(key)
    await hostile.restart("registry")
    await hostile.assert_alive()


async def test_an_acknowledgement_aimed_at_the_audit_heads_stores_nothing_and_the_auditor_restarts(
    hostile: HostileStack, nc: NATS, tenant: NATS
):
    """Junk there stays for good (the stream denies deletes): full verification failed, the auditor
    could not start again, and /v1/feedback answered 503."""
    js = nc.jetstream()
    before = (await js.stream_info(subjects.AUDIT_HEADS_STREAM)).state.last_seq
    await tenant.publish(subjects.infer_submit(TENANT), b"{}", reply=subjects.auditor_head(AUDITOR))
    await tenant.jetstream().publish(subjects.infer_submit(TENANT), b"{}")
    assert (await js.stream_info(subjects.AUDIT_HEADS_STREAM)).state.last_seq == before
    await hostile.restart("auditor")
    async with hostile.client(hostile.keys.platform) as client:
        r = await client.get("/readyz")
    assert r.status_code == 200, r.text


# -- consumers: the platform makes them, no outside client configures one --------------------------


async def test_a_tenant_configures_no_consumer_and_its_replay_consumer_delivers_nowhere(
    hostile: HostileStack, nc: NATS, tenant: NATS
):
    """Before, a tenant made its own ``audit-<tenant>`` with any delivery subject: its records were
    pushed onto ``lf.worker.heartbeat`` (14,284 messages decoded by gateway and scheduler)."""
    name = subjects.tenant_audit_consumer(TENANT)
    pushed = ConsumerConfig(
        name=name,
        durable_name=name,
        deliver_subject=subjects.WORKER_HEARTBEAT,
        filter_subject=subjects.audit_of_tenant(TENANT),
        deliver_policy=DeliverPolicy.ALL,
    )
    request = json.dumps({"stream_name": subjects.AUDIT_STREAM, "config": pushed.as_dict()}).encode()
    create = f"$JS.API.CONSUMER.CREATE.{subjects.AUDIT_STREAM}.{name}.{subjects.audit_of_tenant(TENANT)}"
    with pytest.raises(nats.errors.Error):  # refused: no answer reaches the tenant
        await tenant.request(create, request, timeout=1)
    config = (await nc.jetstream().consumer_info(subjects.AUDIT_STREAM, name)).config
    assert (config.deliver_subject, config.filter_subject) == (None, subjects.audit_of_tenant(TENANT))

    since = time.time()  # and the platform's consumer replays this tenant's own records to it
    invalid = b'{"request_id": 5, "tenant_id": 1, "reply_to": 2}'  # refused, and audited under the tenant
    await tenant.jetstream().publish(subjects.infer_submit(TENANT), invalid)
    await hostile.wait_audit("rejection", TENANT, since, service="scheduler")
    replay = await tenant.jetstream().pull_subscribe_bind(durable=name, stream=subjects.AUDIT_STREAM)
    records = await replay.fetch(batch=1000, timeout=5)
    assert records and all(m.subject.rsplit(".", 1)[1] == TENANT for m in records)  # its own records only
    for msg in records:
        await msg.ack()


async def test_the_siem_configures_no_consumer(hostile: HostileStack, nc: NATS):
    """Before, the audit-reader made ordered (push) consumers with any delivery subject."""
    siem = await connect_siem(hostile)
    try:
        ordered = ConsumerConfig(deliver_subject=subjects.WORKER_HEARTBEAT, deliver_policy=DeliverPolicy.ALL)
        request = json.dumps({"stream_name": subjects.AUDIT_STREAM, "config": ordered.as_dict()}).encode()
        with pytest.raises(nats.errors.Error):
            await siem.request(f"$JS.API.CONSUMER.CREATE.{subjects.AUDIT_STREAM}", request, timeout=1)
    finally:
        await siem.close()
    js = nc.jetstream()
    consumers = await js.consumers_info(subjects.AUDIT_STREAM)
    assert [c.name for c in consumers if c.config.deliver_subject == subjects.WORKER_HEARTBEAT] == []
