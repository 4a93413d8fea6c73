"""The registry service over a real nats-server with JetStream: push -> promote -> rollout ->
rollback -> revoke, with events on ADAPTER_EVENTS, audit records, and the worker's fetch."""

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client as NATS
from pydantic import BaseModel

from lorafleet.cli.adapter_cmd import push_adapter
from services.registry.push_admission import BaseModelIdentity
from services.worker.adapter_verify import fetch_verified
from shared import subjects
from shared.adapter_format import WEIGHTS_FILE
from shared.bus import request
from shared.catalog.view import follow_catalog
from shared.errors import (
    AdapterRevoked,
    IntegrityError,
    InvalidMessage,
    InvalidRequest,
    ModelNotFound,
    RemoteSourceDisabled,
)
from shared.schemas import (
    AdapterEvent,
    AdapterRecordsReply,
    AuditEnvelope,
    GetAdapterRequest,
    PromoteRequest,
    RegisterRequest,
    ResolveReply,
    ResolveRequest,
    RevokeRequest,
    RollbackRequest,
    RolloutRequest,
    TrustedKeysReply,
    TrustKeyRequest,
)  # fmt: skip
from shared.signing import KeyPair

ID = "svc-summarize"


M = TypeVar("M", bound=BaseModel)


async def call(
    nc: NATS,
    op: str,
    message: BaseModel,
    reply_type: type[M] = AdapterRecordsReply,  # type: ignore[assignment]
) -> M:
    return await request(nc, subjects.registry(op), message, reply_type, 10.0)


async def resolve_version(nc: NATS, key: str = "k") -> int:
    reply = await call(nc, "resolve", ResolveRequest(tenant_id="acme", model=ID, request_key=key), ResolveReply)
    assert reply.adapter is not None
    return reply.adapter.version


async def stream_messages(nc: NATS, subject: str) -> list[bytes]:
    """Every message a JetStream stream holds on ``subject``, in order."""
    sub = await nc.jetstream().subscribe(subject, ordered_consumer=True)
    seen = []
    try:
        while True:
            seen.append((await sub.next_msg(timeout=0.5)).data)
    except nats.errors.TimeoutError:
        return seen
    finally:
        await sub.unsubscribe()


async def object_names(nc: NATS, bucket: str) -> list[str]:
    store = await nc.jetstream().object_store(bucket)
    try:
        return sorted(o.name for o in await store.list(ignore_deletes=True))
    except nats.js.errors.NotFoundError:
        return []


async def test_lifecycle_over_nats(
    registry: NATS, peft_adapter_dir: Path, base: BaseModelIdentity, signer_keys: KeyPair, tmp_path: Path
) -> None:
    nc = registry
    keys = await call(nc, "trust_key", TrustKeyRequest(signer="release", public_key=signer_keys.public_b64,
                                                       tenants=["acme"], actor="test"), TrustedKeysReply)  # fmt: skip
    assert keys.keys["release"] == signer_keys.public_b64
    key_file = tmp_path / "release.key"
    key_file.write_bytes(signer_keys.private_pem)
    push = {"adapter_id": ID, "tenant_id": "acme", "task_type": "summarization",
            "base_fingerprint": base.fingerprint, "sign_key": key_file, "who": "test"}  # fmt: skip
    v1 = await push_adapter(nc, peft_adapter_dir, **push)
    v2 = await push_adapter(nc, peft_adapter_dir, **push)
    assert (v1.version, v2.version, v1.status, v1.signer) == (1, 2, "staging", "release")
    assert await object_names(nc, subjects.ADAPTER_UPLOADS_BUCKET) == []  # consumed uploads are deleted
    stored = await object_names(nc, subjects.ADAPTER_STORE_BUCKET)
    assert [n.split("/")[1].split(".")[0] for n in stored if n.startswith(f"{ID}/") and n.endswith(WEIGHTS_FILE)] == [
        "1",
        "2",
    ]

    await call(nc, "promote", PromoteRequest(adapter_id=ID, version=1, traffic_percent=100, actor="test"))
    await call(nc, "promote", PromoteRequest(adapter_id=ID, version=2, traffic_percent=10, actor="test"))
    split = [await resolve_version(nc, f"key-{i}") for i in range(400)]
    assert 0.04 < split.count(2) / len(split) < 0.18
    await call(nc, "rollout", RolloutRequest(adapter_id=ID, traffic_percent=100, actor="test"))
    assert await resolve_version(nc) == 2
    await call(nc, "rollback", RollbackRequest(adapter_id=ID, actor="test"))
    assert await resolve_version(nc) == 1

    followed = await follow_catalog(nc, 5.0, signers=True)  # as a worker reads the registry's state
    try:
        record = await followed.view.record(nc.jetstream(timeout=5), ID, 1)
        trusted = await followed.view.signers(nc.jetstream(timeout=5), 5)
    finally:
        followed.stop()
    assert trusted["release"] == [signer_keys.public_b64]
    files = await fetch_verified(nc.jetstream(), record, base.fingerprint, trusted)
    assert json.loads(files["adapter_config.json"])["r"] == 8

    await call(nc, "revoke", RevokeRequest(adapter_id=ID, actor="test"))
    with pytest.raises(AdapterRevoked):
        await resolve_version(nc)
    events = [AdapterEvent.model_validate_json(m) for m in await stream_messages(nc, subjects.adapter_event(ID))]
    assert [(e.kind, e.version, e.status) for e in events] == [
        ("registered", 1, "staging"), ("registered", 2, "staging"), ("promoted", 1, "production"),
        ("promoted", 2, "canary"), ("retired", 1, "retired"), ("rollout", 2, "production"),
        ("rolled_back", 2, "retired"), ("rolled_back", 1, "production"), ("revoked", 1, "revoked"),
        ("revoked", 2, "revoked"),
    ]  # fmt: skip
    audit_subject = subjects.audit("registry_change", "acme")
    audits = [AuditEnvelope.model_validate_json(m).body for m in await stream_messages(nc, audit_subject)]
    mine = [(a.action, a.version, a.before, a.after, a.actor) for a in audits if getattr(a, "adapter_id", None) == ID]
    assert mine[6] == ("rolled_back", 2, "production", "retired", "test") and len(mine) == len(events)


async def test_refusals_store_nothing_and_bad_messages_get_typed_errors(
    registry: NATS, variant: Callable, tmp_path: Path
) -> None:
    nc = registry
    cases = [
        (variant(tensors=lambda t: t[next(iter(t))].fill_(float("nan"))), IntegrityError, "contains NaN or Inf"),
        ({**variant(), "adapter_model.bin": b"\x80\x04K\x01."}, InvalidRequest, "'adapter_model.bin' is refused"),
        ({**variant(), "../../etc/passwd": b"x"}, InvalidRequest, "path components are not allowed"),
        (variant(config={"use_dora": True}), InvalidRequest, "DoRA"),
        (variant(config={"auto_map": {"AutoModel": "x.Y"}}), InvalidRequest, "remote code"),
        (variant(config={"r": 64}), InvalidRequest, "rank 64 exceeds the admitted maximum 16"),
    ]
    for files, error, text in cases:
        inline = {name: base64.b64encode(data).decode() for name, data in files.items()}
        req = RegisterRequest(adapter_id="svc-nan", tenant_id="acme", task_type="t", inline_files=inline, actor="t")
        with pytest.raises(error, match=text):
            await call(nc, "register", req)
    uploads = await nc.jetstream().object_store(subjects.ADAPTER_UPLOADS_BUCKET)
    for name, data in variant().items():
        await uploads.put(f"unsigned01/{name}", data)
    req = RegisterRequest(adapter_id="svc-nan", tenant_id="acme", task_type="t", upload_id="unsigned01", actor="test")
    with pytest.raises(IntegrityError, match="unsigned"):
        await call(nc, "register", req)
    remote = (
        ("https://hub.example/evil", RemoteSourceDisabled, "LF_REMOTE__HTTPS_ENABLED is off"),  # off by default
        ("http://hub.example/evil", InvalidRequest, "a remote source is s3://bucket/prefix/ or https://"),
        ("file:///etc", InvalidRequest, "outside every trusted"),
    )
    for uri, error, text in remote:
        req = RegisterRequest(adapter_id="svc-nan", tenant_id="acme", task_type="t", source_uri=uri, actor="test")
        with pytest.raises(error, match=text):
            await call(nc, "register", req)
    assert (await call(nc, "get", GetAdapterRequest(adapter_id="svc-nan"))).records == []
    assert not [n for n in await object_names(nc, subjects.ADAPTER_STORE_BUCKET) if n.startswith("svc-nan/")]

    reply = await nc.request(subjects.registry("resolve"), b'{"tenant_id": "acme", "model": 7}', timeout=5)
    assert reply.headers and reply.headers["Lf-Error"] == InvalidMessage.code
    reply = await nc.request(subjects.registry("promote"), b"\xff not json", timeout=5)
    assert reply.headers and reply.headers["Lf-Error"] == InvalidMessage.code
    with pytest.raises(ModelNotFound, match="does not exist or you do not have access"):
        await call(nc, "resolve", ResolveRequest(tenant_id="acme", model="svc-nan", request_key="k"), ResolveReply)


async def test_tampered_store_object_is_refused_by_the_worker(
    registry: NATS, peft_adapter_dir: Path, base: BaseModelIdentity, signer_keys: KeyPair, tmp_path: Path
) -> None:
    nc = registry
    await call(nc, "trust_key", TrustKeyRequest(signer="release", public_key=signer_keys.public_b64,
                                              tenants=["acme"], actor="t"),
               TrustedKeysReply)  # fmt: skip
    key_file = tmp_path / "release.key"
    key_file.write_bytes(signer_keys.private_pem)
    record = await push_adapter(nc, peft_adapter_dir, adapter_id="svc-tamper", tenant_id="acme", task_type="t",
                                base_fingerprint=base.fingerprint, sign_key=key_file)  # fmt: skip
    store = await nc.jetstream().object_store(subjects.ADAPTER_STORE_BUCKET)
    weights = bytearray((peft_adapter_dir / WEIGHTS_FILE).read_bytes())
    weights[-4:] = b"\x00\x00\x80\x7f"  # one value becomes +Inf after admission
    prefix = record.storage_uri.removeprefix(f"nats-os://{subjects.ADAPTER_STORE_BUCKET}/")
    assert prefix.startswith(f"svc-tamper/{record.version}.")  # the version, then the push's own token
    await store.put(f"{prefix}/{WEIGHTS_FILE}", bytes(weights))
    with pytest.raises(IntegrityError, match="does not match"):
        await fetch_verified(nc.jetstream(), record, base.fingerprint, {"release": signer_keys.public_b64})
