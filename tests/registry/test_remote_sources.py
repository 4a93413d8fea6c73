"""Remote adapter sources against real servers: moto's S3 server and an HTTPS server signed by a
test CA, with the registry service on a real nats-server.

Every refusal is one typed error, stores nothing (no record, no object under the tenant's
prefix) and is audited as a registry rejection of the pushing tenant."""

import argparse
import asyncio
import hashlib
import ipaddress
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats.js.errors
import pytest
import torch
from nats.aio.client import Client as NATS
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from lorafleet.cli import adapter_cmd, keys_cmd, source_cmd
from services.registry.intake import BaseModelIdentity
from services.registry.remote_fetch import system_resolve
from services.registry.service import run
from services.registry.source_uri import check_addresses, covers, parse_source
from services.worker.adapter_verify import fetch_verified
from shared import signing, subjects
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.bus import connect, request
from shared.config import RegistrySettings, RemoteSourceSettings
from shared.errors import (
    IntegrityError,
    InvalidRequest,
    LorafleetError,
    ModelNotFound,
    NotFound,
    RemoteSourceDisabled,
    SourceAddressRefused,
    SourceFetchFailed,
    SourceFileRefused,
    SourceNotAllowed,
    SourceNotApproved,
    SourceRedirectRefused,
    SourceTimeout,
    SourceTooLarge,
)
from shared.schemas import (
    AdapterRecord,
    AdapterRecordsReply,
    AddSourceRequest,
    ApproveSourceRequest,
    AuditEnvelope,
    GetAdapterRequest,
    ListSourcesRequest,
    PromoteRequest,
    RegisterRequest,
    RemoveSourceRequest,
    ResolveReply,
    ResolveRequest,
    ServiceHeartbeat,
    SourcesReply,
    TrustedKeysReply,
    TrustKeyRequest,
)
from shared.signing import KeyPair
from tests.helpers.remote_sources import HttpsServer, MotoS3, Route, SourceCA, aws_env, make_ca

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


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    root = tmp_path_factory.mktemp("remote")
    ca = make_ca(root / "ca")
    with aws_env():
        running = Servers(MotoS3(), HttpsServer(ca), ca, HttpsServer(make_ca(root / "other-ca")))
        try:
            yield running
        finally:
            running.s3.stop()
            running.https.stop()
            running.stranger.stop()


async def resolve(host: str, port: int) -> list[str]:
    """Test names first (models.test is the HTTPS server, internal.test a private address), then DNS."""
    if host in HOSTS:
        return [HOSTS[host]]
    return await system_resolve(host, port)


async def start_registry(
    nats_url: str, base_dir: Path, remote: RemoteSourceSettings
) -> tuple[asyncio.Event, asyncio.Task]:
    settings = RegistrySettings(
        nats_url=nats_url,
        model_dir=str(base_dir),
        instance_id="reg-remote",
        heartbeat_interval_s=0.1,
        max_rank=16,
        remote=remote,
    )
    nc = await connect(nats_url, "registry-remote-wait")
    beats = await nc.subscribe(subjects.service_heartbeat("registry"))
    stop = asyncio.Event()
    service = asyncio.create_task(run(settings, stop, resolve))
    beat = ServiceHeartbeat.model_validate_json((await beats.next_msg(timeout=30)).data)
    assert (beat.service, beat.ready) == ("registry", True)
    await nc.close()
    return stop, service


@pytest.fixture
async def remote_registry(nats_url: str, base_dir: Path, servers: Servers) -> AsyncIterator[NATS]:
    remote = RemoteSourceSettings(
        s3_enabled=True,
        https_enabled=True,
        ca_file=str(servers.ca.ca_file),
        s3_endpoint_url=servers.s3.endpoint,
        timeout_s=TIMEOUT_S,
        max_file_bytes=MAX_FILE,
        max_total_bytes=MAX_TOTAL,
        max_files=MAX_FILES,
    )
    stop, service = await start_registry(nats_url, base_dir, remote)
    nc = await connect(nats_url, "remote-test")
    yield nc
    stop.set()
    await service
    await nc.drain()


@dataclass
class Push:
    """One tenant's signed push of ``files`` (as published) from a remote URI."""

    nc: NATS
    base: BaseModelIdentity
    keys: KeyPair
    signer: str
    tenant: str

    def request(self, adapter_id: str, uri: str, files: Files, version: int = 1) -> RegisterRequest:
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


@pytest.fixture
async def push(remote_registry: NATS, base: BaseModelIdentity, signer_keys: KeyPair) -> Push:
    """A fresh tenant with a trusted signer, so no test sees another's allow-list entries."""
    tenant, signer = unique("t"), unique("release")
    trust = TrustKeyRequest(signer=signer, public_key=signer_keys.public_b64, tenants=[tenant], actor="test")
    await call(remote_registry, "trust_key", trust, TrustedKeysReply)
    return Push(remote_registry, base, signer_keys, signer, tenant)


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


# ---- canonical URIs and the address check, no server ------------------------------------------


@pytest.mark.parametrize(
    "uri, canonical",
    [
        ("s3://models/acme/sum", "s3://models/acme/sum/"),
        ("S3://models/acme/sum/", "s3://models/acme/sum/"),
        ("https://Hub.Example:8443/a/b/", "https://hub.example:8443/a/b/"),
        ("https://hub.example", "https://hub.example/"),
    ],
)
def test_source_uris_have_one_canonical_form(uri: str, canonical: str) -> None:
    assert parse_source(uri).uri == canonical


@pytest.mark.parametrize(
    "uri, error",
    [
        ("http://hub.example/a/", InvalidRequest),
        ("file:///etc/", InvalidRequest),
        ("org/model-lora", InvalidRequest),
        ("https://hub.example/a/../b/", InvalidRequest),
        ("https://hub.example/a/%2e%2e/b/", InvalidRequest),
        ("https://hub.example/a//b/", InvalidRequest),
        ("https://user:pw@hub.example/a/", InvalidRequest),
        ("https://hub.example/a/?x=1", InvalidRequest),
        ("s3://Bad_Bucket/a/", InvalidRequest),
        ("s3://models/acme/adapter_model.bin", SourceFileRefused),
        ("https://hub.example/acme/pytorch_model.pt", SourceFileRefused),
        ("s3://models/acme/adapter_model.safetensors", SourceFileRefused),
    ],
)
def test_ambiguous_or_file_naming_uris_are_refused(uri: str, error: type[LorafleetError]) -> None:
    with pytest.raises(error) as refused:
        parse_source(uri)
    assert type(refused.value) is error


def test_a_prefix_covers_only_its_own_directories() -> None:
    prefix = parse_source("https://models.internal/acme/")
    assert covers(prefix, parse_source("https://models.internal/acme/sum/"))
    assert not covers(prefix, parse_source("https://models.internal.evil/acme/sum/"))
    assert not covers(prefix, parse_source("https://models.internal/acme-other/sum/"))
    assert not covers(prefix, parse_source("https://models.internal:8443/acme/sum/"))


@pytest.mark.parametrize(
    "address", ["127.0.0.1", "10.0.0.7", "172.16.3.4", "192.168.1.1", "169.254.169.254", "100.64.0.1", "::1", "fe80::1",
                "fd00::1", "::ffff:10.0.0.1", "::ffff:127.0.0.1"],
)  # fmt: skip
def test_internal_addresses_are_refused_unless_the_entry_allows_private(address: str) -> None:
    with pytest.raises(SourceAddressRefused, match="internal address"):
        check_addresses("h", [address], allow_private=False)
    check_addresses("h", [address], allow_private=True)


def test_unspecified_and_multicast_are_refused_even_with_allow_private() -> None:
    for address in ("0.0.0.0", "::", "224.0.0.1"):
        with pytest.raises(SourceAddressRefused):
            check_addresses("h", [address], allow_private=True)
    check_addresses("h", ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"], allow_private=False)
    with pytest.raises(SourceAddressRefused):  # one internal answer among public ones is enough
        check_addresses("h", ["93.184.216.34", "10.0.0.1"], allow_private=False)
    assert ipaddress.ip_address("93.184.216.34").is_global


# ---- allowed and signed -> registered, stored under the tenant, served -----------------------


async def test_a_signed_s3_adapter_is_registered_under_the_tenants_prefix_and_verifies(
    push: Push, servers: Servers, adapter_files: Files
) -> None:
    adapter_id, key = unique("s3-sum"), f"{push.tenant}/sum/"
    servers.s3.put_dir("models", key, adapter_files)
    await allow(push.nc, f"s3://models/{push.tenant}/", [push.tenant])
    changes = await push.nc.subscribe(subjects.audit("registry_change", push.tenant))
    record = await push.register(adapter_id, f"s3://models/{key}", adapter_files)

    assert record.storage_uri == f"nats-os://{subjects.ADAPTER_STORE_BUCKET}/tenants/{push.tenant}/{adapter_id}/1"
    assert record.origin is not None and record.origin.uri == f"s3://models/{key}"
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert record.origin.etags[name] == servers.s3.client.head_object(Bucket="models", Key=key + name)["ETag"]
        assert record.files[name] == sha256(adapter_files[name])
    change = AuditEnvelope.model_validate_json((await changes.next_msg(timeout=10)).data).body
    assert (change.action, change.reason) == ("registered", f"fetched from s3://models/{key}")
    # the worker's own fetch reads the tenant-prefixed copy and verifies it against the signature
    keys = {push.signer: push.keys.public_b64}
    served = await fetch_verified(push.nc.jetstream(), record, push.base.fingerprint, keys)
    assert served == adapter_files
    await call(push.nc, "promote", PromoteRequest(adapter_id=adapter_id, version=1, traffic_percent=100, actor="t"))
    resolved = await call(
        push.nc, "resolve", ResolveRequest(tenant_id=push.tenant, model=adapter_id, request_key="k"), ResolveReply
    )
    assert resolved.adapter is not None and resolved.adapter.storage_uri == record.storage_uri


async def test_a_signed_https_adapter_is_fetched_from_the_pinned_address_through_allowed_redirects(
    push: Push, servers: Servers, adapter_files: Files
) -> None:
    """models.test exists only in the registry's resolver: the connection goes to the address it
    checked, while TLS verifies the certificate for the name against the test CA."""
    adapter_id, path = unique("https-sum"), f"/{push.tenant}/sum/"
    base = servers.https.url("models.test")
    servers.https.routes[path + CONFIG_FILE] = Route(adapter_files[CONFIG_FILE], etag='"cfg-1"')
    servers.https.routes[path + WEIGHTS_FILE] = Route(status=302, location=f"{base}/{push.tenant}/blobs/weights-1")
    servers.https.routes[f"/{push.tenant}/blobs/weights-1"] = Route(adapter_files[WEIGHTS_FILE], etag='"w-1"')
    await allow(push.nc, f"{base}/{push.tenant}/", [push.tenant])
    record = await push.register(adapter_id, base + path, adapter_files)
    assert record.origin is not None and record.origin.etags == {CONFIG_FILE: '"cfg-1"', WEIGHTS_FILE: '"w-1"'}
    assert record.checksum == sha256(adapter_files[WEIGHTS_FILE])
    assert record.storage_uri.endswith(f"/tenants/{push.tenant}/{adapter_id}/1")


# ---- permission: allow-list, tenant binding, approval, the switch ----------------------------


async def test_a_uri_on_no_allow_list_entry_is_refused(push: Push, servers: Servers, adapter_files: Files) -> None:
    key = f"{push.tenant}/unlisted/"
    servers.s3.put_dir("models", key, adapter_files)
    await allow(push.nc, f"s3://models/{push.tenant}/listed/", [push.tenant])
    error = await push.refused(unique("unlisted"), f"s3://models/{key}", adapter_files, SourceNotAllowed)
    assert f"not on the registry's source allow-list for tenant {push.tenant}" in error.message


async def test_a_prefix_allowed_for_another_tenant_only_is_refused_the_same_way(
    push: Push, servers: Servers, adapter_files: Files
) -> None:
    other, key = unique("other"), f"{push.tenant}/theirs/"
    servers.s3.put_dir("models", key, adapter_files)
    await allow(push.nc, f"s3://models/{push.tenant}/theirs/", [other])
    error = await push.refused(unique("theirs"), f"s3://models/{key}", adapter_files, SourceNotAllowed)
    assert other not in error.message  # nothing says that someone else may use it


async def test_an_approval_entry_refuses_until_the_uri_is_approved(
    push: Push, servers: Servers, adapter_files: Files
) -> None:
    key = f"{push.tenant}/gated/"
    servers.s3.put_dir("models", key, adapter_files)
    await allow(push.nc, f"s3://models/{push.tenant}/", [push.tenant], approval=True)
    await push.refused(unique("gated"), f"s3://models/{key}", adapter_files, SourceNotApproved)
    admins = await push.nc.subscribe(subjects.audit("admin", push.tenant))
    approved = await call(
        push.nc, "source_approve", ApproveSourceRequest(uri=f"s3://models/{key}", actor="op"), SourcesReply
    )
    assert [a.uri for a in approved.approvals if a.uri.startswith(f"s3://models/{push.tenant}/")] == [
        f"s3://models/{key}"
    ]
    audit = AuditEnvelope.model_validate_json((await admins.next_msg(timeout=10)).data).body
    assert (audit.action, audit.actor, audit.detail["uri"]) == ("source_approved", "op", f"s3://models/{key}")
    record = await push.register(unique("gated"), f"s3://models/{key}", adapter_files)
    assert record.origin is not None


async def test_source_ops_are_audited_and_refuse_what_they_cannot_do(push: Push) -> None:
    prefix, other = f"s3://models/{push.tenant}/ops/", unique("other")
    admins = {t: await push.nc.subscribe(subjects.audit("admin", t)) for t in (push.tenant, other)}
    await allow(push.nc, prefix, [push.tenant, other])
    for tenant in (push.tenant, other):
        audit = AuditEnvelope.model_validate_json((await admins[tenant].next_msg(timeout=10)).data).body
        assert (audit.action, audit.target, audit.detail["tenants"]) == (
            "source_added",
            prefix,
            sorted([push.tenant, other]),
        )
    listed = await call(push.nc, "sources", ListSourcesRequest(), SourcesReply)
    assert [s.tenants for s in listed.sources if s.prefix == prefix] == [sorted([push.tenant, other])]
    with pytest.raises(InvalidRequest, match="canonical form"):
        await allow(push.nc, f"https://Models.test/{push.tenant}/ops/", [push.tenant])
    with pytest.raises(NotFound):  # approval applies only under an entry that asks for it
        await call(push.nc, "source_approve", ApproveSourceRequest(uri=prefix + "sum/", actor="op"), SourcesReply)
    removed = await call(push.nc, "source_remove", RemoveSourceRequest(prefix=prefix, actor="op"), SourcesReply)
    assert prefix not in [s.prefix for s in removed.sources]
    audit = AuditEnvelope.model_validate_json((await admins[other].next_msg(timeout=10)).data).body
    assert audit.action == "source_removed"
    with pytest.raises(NotFound):
        await call(push.nc, "source_remove", RemoveSourceRequest(prefix=prefix, actor="op"), SourcesReply)


async def test_remote_sources_are_off_by_default(registry: NATS, base: BaseModelIdentity, signer_keys: KeyPair) -> None:
    tenant = unique("t")
    await call(
        registry, "source_add", AddSourceRequest(prefix="s3://models/", tenants=[tenant], actor="op"), SourcesReply
    )
    push = Push(registry, base, signer_keys, "nobody", tenant)
    for uri in ("s3://models/acme/sum/", "https://hub.example/acme/sum/"):
        error = await push.refused(unique("off"), uri, {CONFIG_FILE: b"{}", WEIGHTS_FILE: b""}, RemoteSourceDisabled)
        assert "_ENABLED is off" in error.message


# ---- limits ------------------------------------------------------------------------------------


async def test_a_redirect_off_the_allow_list_is_refused(push: Push, servers: Servers, adapter_files: Files) -> None:
    base, path = servers.https.url("models.test"), f"/{push.tenant}/redir/"
    servers.https.routes[path + CONFIG_FILE] = Route(status=302, location=f"{servers.https.url('localhost')}/elsewhere")
    await allow(push.nc, f"{base}/{push.tenant}/", [push.tenant])
    error = await push.refused(unique("redir"), base + path, adapter_files, SourceRedirectRefused)
    assert "outside tenant" in error.message
    assert servers.https.hits["/elsewhere"] == 0


async def test_a_redirect_loop_stops_at_the_redirect_limit(push: Push, servers: Servers, adapter_files: Files) -> None:
    base, path = servers.https.url("models.test"), f"/{push.tenant}/loop/"
    servers.https.routes[path + CONFIG_FILE] = Route(status=302, location=base + path + CONFIG_FILE)
    await allow(push.nc, f"{base}/{push.tenant}/", [push.tenant])
    error = await push.refused(unique("loop"), base + path, adapter_files, SourceRedirectRefused)
    assert "more than 3 redirects" in error.message


@pytest.mark.parametrize("case", ["s3-file", "https-file", "https-file-unsized", "https-total"])
async def test_oversize_sources_are_refused(push: Push, servers: Servers, adapter_files: Files, case: str) -> None:
    big = {CONFIG_FILE: adapter_files[CONFIG_FILE], WEIGHTS_FILE: b"\0" * (MAX_FILE + 1)}
    if case == "s3-file":
        servers.s3.put_dir("models", f"{push.tenant}/big/", big)
        await allow(push.nc, f"s3://models/{push.tenant}/", [push.tenant])
        uri = f"s3://models/{push.tenant}/big/"
    else:
        base, path = servers.https.url("models.test"), f"/{push.tenant}/{case}/"
        if case == "https-total":  # each file under its cap, both together over the total
            big = {CONFIG_FILE: b" " * (MAX_TOTAL - MAX_FILE + 1000), WEIGHTS_FILE: b"\0" * (MAX_FILE - 10)}
        for name, data in big.items():
            servers.https.routes[path + name] = Route(data, unsized=case == "https-file-unsized")
        await allow(push.nc, f"{base}/{push.tenant}/", [push.tenant])
        uri = base + path
    error = await push.refused(unique("big"), uri, big, SourceTooLarge)
    assert (
        "total limit" if case == "https-total" else "per-file limit" if "https" in case else "-byte limit"
    ) in error.message


async def test_a_slow_drip_is_cut_at_the_time_limit(push: Push, servers: Servers, adapter_files: Files) -> None:
    base, path = servers.https.url("models.test"), f"/{push.tenant}/drip/"
    servers.https.routes[path + CONFIG_FILE] = Route(adapter_files[CONFIG_FILE], drip_s=0.05)  # ~50 s in all
    await allow(push.nc, f"{base}/{push.tenant}/", [push.tenant])
    started = time.monotonic()
    error = await push.refused(unique("drip"), base + path, adapter_files, SourceTimeout)
    assert f"within {TIMEOUT_S} s" in error.message
    assert time.monotonic() - started < TIMEOUT_S + 20  # cut at the limit, not at the drip's end


@pytest.mark.parametrize("host", ["internal.test", "localhost"])
async def test_a_host_resolving_to_an_internal_address_is_refused(
    push: Push, servers: Servers, adapter_files: Files, host: str
) -> None:
    base, path = servers.https.url(host), f"/{push.tenant}/ssrf/"
    servers.https.routes[path + CONFIG_FILE] = Route(adapter_files[CONFIG_FILE])
    await allow(push.nc, f"{base}/{push.tenant}/", [push.tenant], private=False)
    error = await push.refused(unique("ssrf"), base + path, adapter_files, SourceAddressRefused)
    assert HOSTS.get(host, "127.0.0.1") in error.message
    assert servers.https.hits[path + CONFIG_FILE] == 0  # refused before any connection


async def test_a_certificate_from_an_untrusted_ca_is_refused(
    push: Push, servers: Servers, adapter_files: Files
) -> None:
    base, path = servers.stranger.url("models.test"), f"/{push.tenant}/mitm/"
    servers.stranger.routes[path + CONFIG_FILE] = Route(adapter_files[CONFIG_FILE])
    await allow(push.nc, f"{base}/{push.tenant}/", [push.tenant])
    error = await push.refused(unique("mitm"), base + path, adapter_files, SourceFetchFailed)
    assert "CERTIFICATE_VERIFY_FAILED" in error.message


# ---- content: the same admission as an upload -------------------------------------------------


async def test_bytes_tampered_after_signing_are_refused(push: Push, servers: Servers, adapter_files: Files) -> None:
    key = f"{push.tenant}/tampered/"
    servers.s3.put_dir("models", key, tampered(adapter_files))
    await allow(push.nc, f"s3://models/{push.tenant}/", [push.tenant])
    error = await push.refused(unique("tampered"), f"s3://models/{key}", adapter_files, IntegrityError)
    assert "signature" in error.message


@pytest.mark.parametrize("case", ["names-a-pickle", "pickle-beside", "pickle-as-weights", "extra-file", "too-many"])
async def test_pickles_and_extra_files_are_refused(
    push: Push, servers: Servers, adapter_files: Files, case: str, pickle_bytes: bytes
) -> None:
    key = f"{push.tenant}/{case}/"
    layout = {
        "names-a-pickle": {"adapter_model.bin": pickle_bytes, CONFIG_FILE: adapter_files[CONFIG_FILE]},
        "pickle-beside": {**adapter_files, "adapter_model.bin": pickle_bytes},
        "pickle-as-weights": {**adapter_files, WEIGHTS_FILE: pickle_bytes},
        "extra-file": {**adapter_files, "README.md": b"# hi"},
        "too-many": {**adapter_files, "a/x": b"1", "a/y": b"2", "a/z": b"3"},
    }[case]
    servers.s3.put_dir("models", key, layout)
    await allow(push.nc, f"s3://models/{push.tenant}/", [push.tenant])
    uri = f"s3://models/{key}" + ("adapter_model.bin" if case == "names-a-pickle" else "")
    expected = IntegrityError if case == "pickle-as-weights" else SourceFileRefused
    error = await push.refused(unique("pkl"), uri, adapter_files, expected)
    message = {
        "names-a-pickle": "names a file",
        "pickle-beside": "holds 'adapter_model.bin'",
        "pickle-as-weights": "header length",
        "extra-file": "holds 'README.md'",
        "too-many": f"lists more than {MAX_FILES} objects",
    }[case]
    assert message in error.message


@pytest.fixture
def pickle_bytes() -> bytes:
    return b"\x80\x04\x95\x1a\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94\x8c\x06system\x94\x93\x94\x8c\x02id\x94\x85\x94R\x94."


# ---- cache isolation ----------------------------------------------------------------------------


async def test_each_tenant_gets_its_own_fetch_and_copy_of_the_same_uri(
    push: Push, servers: Servers, adapter_files: Files, base: BaseModelIdentity, signer_keys: KeyPair
) -> None:
    """Tenant B naming the URI tenant A registered from never gets A's bytes: the registry fetches
    again (B sees what the URI holds now), stores B's copy under B's prefix, and A's adapter stays
    A's alone."""
    other = unique("b")
    trust = TrustKeyRequest(signer=unique("b-release"), public_key=signer_keys.public_b64, tenants=[other], actor="t")
    await call(push.nc, "trust_key", trust, TrustedKeysReply)
    second = Push(push.nc, base, signer_keys, trust.signer, other)
    key, shared_prefix = f"shared-{push.tenant}/sum/", f"s3://models/shared-{push.tenant}/"
    await allow(push.nc, shared_prefix, [push.tenant, other])
    servers.s3.put_dir("models", key, adapter_files)
    first_id, second_id = unique("a-sum"), unique("b-sum")
    first = await push.register(first_id, f"s3://models/{key}", adapter_files)

    updated = tampered(adapter_files)  # the URI now holds another adapter, signed by B's publisher
    servers.s3.put_dir("models", key, updated)
    record = await second.register(second_id, f"s3://models/{key}", updated)
    assert record.checksum == sha256(updated[WEIGHTS_FILE]) != first.checksum
    assert f"/tenants/{other}/" in record.storage_uri and f"/tenants/{push.tenant}/" in first.storage_uri
    names = await stored_names(push.nc)
    assert f"tenants/{push.tenant}/{first_id}/1/{WEIGHTS_FILE}" in names
    assert f"tenants/{other}/{second_id}/1/{WEIGHTS_FILE}" in names
    keys = {push.signer: push.keys.public_b64}
    assert (await fetch_verified(push.nc.jetstream(), first, push.base.fingerprint, keys)) == adapter_files
    await call(push.nc, "promote", PromoteRequest(adapter_id=first_id, version=1, traffic_percent=100, actor="t"))
    with pytest.raises(ModelNotFound):
        await call(push.nc, "resolve", ResolveRequest(tenant_id=other, model=first_id, request_key="k"), ResolveReply)


# ---- the CLI ------------------------------------------------------------------------------------


async def test_the_cli_allow_lists_a_prefix_and_pushes_a_signed_remote_adapter(
    remote_registry: NATS, servers: Servers, nats_url: str, peft_adapter_dir: Path, base_dir: Path,
    adapter_files: Files, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    tenant, url = unique("cli"), ["--nats-url", nats_url]
    parser = argparse.ArgumentParser(prog="lorafleet")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (adapter_cmd, keys_cmd, source_cmd):
        module.register(sub)

    async def lorafleet(*argv: str) -> tuple[int, str]:
        args = parser.parse_args(list(argv))
        code = await asyncio.to_thread(args.func, args)
        return code, capsys.readouterr().out

    prefix, key = f"s3://models/{tenant}/", f"{tenant}/sum/"
    servers.s3.put_dir("models", key, adapter_files)
    code, out = await lorafleet("source", "add", prefix, "--tenant", tenant, "--allow-private", *url)
    assert code == 0 and f"{prefix}" in out and f"tenants={tenant} allow-private" in out
    signer = unique("cli-signer")
    await lorafleet("keys", "gen", signer, "--out", str(tmp_path))
    await lorafleet("keys", "trust", signer, str(tmp_path / f"{signer}.pub"), "--tenant", tenant, *url)

    def push(adapter_id: str) -> list[str]:
        return ["adapter", "push", str(peft_adapter_dir), "--source-uri", f"s3://models/{key}", "--id", adapter_id,
                "--tenant", tenant, "--task", "summarization", "--sign-key", str(tmp_path / f"{signer}.key"),
                "--base-model-dir", str(base_dir), "--json", *url]  # fmt: skip

    code, out = await lorafleet(*push(unique("cli-sum")))
    assert code == 0, out
    (record,) = json.loads(out)
    assert record["origin"]["uri"] == f"s3://models/{key}" and f"/tenants/{tenant}/" in record["storage_uri"]
    code, out = await lorafleet("source", "remove", prefix, *url)
    assert code == 0 and prefix not in out
    code, out = await lorafleet(*push(unique("cli-sum")))
    assert code == 1 and "error (source_not_allowed)" in out
    code, out = await lorafleet("source", "add", "s3://models/no-slash", "--tenant", tenant, *url)
    assert code == 1 and "error (invalid_request)" in out
