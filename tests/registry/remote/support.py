"""Shared by the remote-source tests: moto's S3 server and HTTPS servers signed by a test CA,
the registry service with remote sources on, and a tenant's signed push from a URI."""

import asyncio
import hashlib
import uuid
from dataclasses import dataclass
from pathlib import Path

import nats.js.errors
import pytest
import torch
from nats.aio.client import Client as NATS
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from services.registry.push_admission import BaseModelIdentity
from services.registry.remote_fetch import system_resolve
from services.registry.service import run
from services.registry.settings import RegistrySettings, RemoteSourceSettings
from shared import signing, subjects
from shared.adapter_format import WEIGHTS_FILE
from shared.bus import connect, request
from shared.errors import (
    LorafleetError,
)
from shared.schemas import (
    AdapterRecord,
    AdapterRecordsReply,
    AddSourceRequest,
    AuditEnvelope,
    GetAdapterRequest,
    RegisterRequest,
    ServiceHeartbeat,
    SourcesReply,
)
from shared.signing import KeyPair
from tests.helpers.remote_sources import HttpsServer, MotoS3, SourceCA

Files = dict[str, bytes]
TIMEOUT_S = 2.0  # the fetch's time limit in these tests
MAX_FILE = 40_000  # the tiny adapter's weights are ~15 kB
MAX_TOTAL = 60_000
MAX_FILES = 4  # listed objects: room for one stray file, so its name is what refuses it
HOSTS = {"models.test": "127.0.0.1", "internal.test": "10.0.0.7"}  # names only this registry's resolver knows


@dataclass
class Servers:
    s3: MotoS3
    https: HttpsServer
    ca: SourceCA
    stranger: HttpsServer  # a certificate from a CA the registry does not trust


async def resolve(host: str, port: int) -> list[str]:
    """Test names first (models.test is the HTTPS server, internal.test a private address), then DNS."""
    if host in HOSTS:
        return [HOSTS[host]]
    return await system_resolve(host, port)


async def start_registry(
    nats_url: str,
    base_dir: Path,
    remote: RemoteSourceSettings,
    fleet_rank_classes: tuple[int, ...] = (8, 16, 32, 64),
    gateway_sync_timeout_s: float = 1.0,
) -> tuple[asyncio.Event, asyncio.Task]:
    settings = RegistrySettings(
        nats_url=nats_url,
        model_dir=str(base_dir),
        instance_id="reg-remote",
        heartbeat_interval_s=0.1,
        max_rank=16,
        remote=remote,
        fleet_rank_classes=fleet_rank_classes,
        gateway_sync_timeout_s=gateway_sync_timeout_s,
    )
    nc = await connect(nats_url, "registry-remote-wait")
    beats = await nc.subscribe(subjects.service_heartbeat("registry"))
    stop = asyncio.Event()
    service = asyncio.create_task(run(settings, stop, resolve))
    beat = ServiceHeartbeat.model_validate_json((await beats.next_msg(timeout=30)).data)
    assert (beat.service, beat.ready) == ("registry", True)
    await nc.close()
    return stop, service


@dataclass
class Push:
    """One tenant's signed push of ``files`` (as published) from a remote URI."""

    nc: NATS
    base: BaseModelIdentity
    keys: KeyPair
    signer: str
    tenant: str

    def request(
        self, adapter_id: str, uri: str, files: Files, version: int = 1, wait_s: float | None = None
    ) -> RegisterRequest:
        digests = {name: sha256(data) for name, data in files.items()}
        manifest = signing.manifest_bytes(digests, adapter_id, version, self.tenant, self.base.fingerprint)
        return RegisterRequest(
            adapter_id=adapter_id,
            tenant_id=self.tenant,
            task_type="summarization",
            version=version,
            source_uri=uri,
            signature=signing.sign(manifest, signing.load_private_key(self.keys.private_pem)),
            signer=self.signer,
            wait_s=wait_s,
            actor="test",
        )

    async def register(self, adapter_id: str, uri: str, files: Files) -> AdapterRecord:
        reply = await call(self.nc, "register", self.request(adapter_id, uri, files))
        return reply.records[0]

    async def refused(self, adapter_id: str, uri: str, files: Files, error: type[LorafleetError]) -> LorafleetError:
        """The push's typed refusal, after checking it stored nothing and was audited."""
        audits = await self.nc.subscribe(subjects.audit("rejection", self.tenant))
        with pytest.raises(error) as refused:
            await call(self.nc, "register", self.request(adapter_id, uri, files))
        assert type(refused.value) is error
        assert (await call(self.nc, "get", GetAdapterRequest(adapter_id=adapter_id))).records == []
        assert [n for n in await stored_names(self.nc) if f"/{adapter_id}/" in n] == []
        audit = AuditEnvelope.model_validate_json((await audits.next_msg(timeout=10)).data).body
        await audits.unsubscribe()
        assert (audit.kind, audit.code, audit.request_id) == ("rejection", error.code, f"register.{adapter_id}")
        return refused.value


async def call(nc: NATS, op: str, message, reply_type=AdapterRecordsReply):
    return await request(nc, subjects.registry(op), message, reply_type, 30.0)


async def stored_names(nc: NATS) -> list[str]:
    try:
        store = await nc.jetstream().object_store(subjects.ADAPTER_STORE_BUCKET)
        return sorted(o.name for o in await store.list(ignore_deletes=True))
    except nats.js.errors.NotFoundError:
        return []


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def allow(nc: NATS, prefix: str, tenants: list[str], *, private: bool = True, approval: bool = False) -> None:
    message = AddSourceRequest(
        prefix=prefix, tenants=tenants, allow_private=private, require_approval=approval, actor="op"
    )
    await call(nc, "source_add", message, SourcesReply)


def tampered(files: Files) -> Files:
    """The same adapter with one weight changed: still a valid adapter, no longer the signed one."""
    tensors = load_tensors(files[WEIGHTS_FILE])
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + torch.ones_like(tensors[name])
    return {**files, WEIGHTS_FILE: save_tensors(tensors)}
