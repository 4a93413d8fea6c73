"""Remote adapter sources against real servers: moto's S3 server and an HTTPS server signed by a
test CA, with the registry service on a real nats-server: what is allowed and signed is registered
under the tenant and served; the allow-list, tenant binding, approval and the on/off switch; each
tenant's own copy of one URI; the CLI.

Every refusal is one typed error, stores nothing (no record, no object under the tenant's
prefix) and is audited as a registry rejection of the pushing tenant."""

import argparse
import asyncio
import json
import re
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from lorafleet.cli import adapter_cmd, keys_cmd, source_cmd
from services.registry.push_admission import BaseModelIdentity
from services.worker.adapter_verify import fetch_verified
from shared import subjects
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.errors import (
    InvalidRequest,
    ModelNotFound,
    NotFound,
    RemoteSourceDisabled,
    SourceNotAllowed,
    SourceNotApproved,
)
from shared.schemas import (
    AddSourceRequest,
    ApproveSourceRequest,
    AuditEnvelope,
    ListSourcesRequest,
    PromoteRequest,
    RemoveSourceRequest,
    ResolveReply,
    ResolveRequest,
    SourcesReply,
    TrustedKeysReply,
    TrustKeyRequest,
)
from shared.signing import KeyPair
from tests.helpers.remote_sources import Route
from tests.registry.remote.support import (
    Files,
    Push,
    Servers,
    allow,
    call,
    sha256,
    stored_names,
    tampered,
    unique,
)

# ---- allowed and signed -> registered, stored under the tenant, served -----------------------


async def test_a_signed_s3_adapter_is_registered_under_the_tenants_prefix_and_verifies(
    push: Push, servers: Servers, adapter_files: Files
) -> None:
    adapter_id, key = unique("s3-sum"), f"{push.tenant}/sum/"
    servers.s3.put_dir("models", key, adapter_files)
    await allow(push.nc, f"s3://models/{push.tenant}/", [push.tenant])
    changes = await push.nc.subscribe(subjects.audit("registry_change", push.tenant))
    record = await push.register(adapter_id, f"s3://models/{key}", adapter_files)

    # v1 under the tenant's prefix, in the push's own leaf (1.<attempt token>)
    prefix = f"nats-os://{subjects.ADAPTER_STORE_BUCKET}/tenants/{push.tenant}/{adapter_id}/1."
    assert record.storage_uri.startswith(prefix) and re.fullmatch(r"[0-9a-f]{12}", record.storage_uri[len(prefix) :])
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
    assert record.digest == sha256(adapter_files[WEIGHTS_FILE])
    assert re.search(f"/tenants/{push.tenant}/{adapter_id}/1\\.[0-9a-f]{{12}}$", record.storage_uri)


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


async def test_an_approved_uri_redirecting_to_an_unapproved_one_is_refused_until_that_is_approved(
    push: Push, servers: Servers, adapter_files: Files
) -> None:
    """Before issue 47 the redirect target was fetched and stored, and the record named the approved
    origin: approving one URL approved whatever it answered with."""
    base = servers.https.url("models.test")
    path, elsewhere = f"/{push.tenant}/approved/", f"/{push.tenant}/unapproved/"
    servers.https.routes[path + CONFIG_FILE] = Route(adapter_files[CONFIG_FILE])
    servers.https.routes[path + WEIGHTS_FILE] = Route(status=302, location=f"{base}{elsewhere}{WEIGHTS_FILE}")
    servers.https.routes[elsewhere + WEIGHTS_FILE] = Route(adapter_files[WEIGHTS_FILE])
    await allow(push.nc, f"{base}/{push.tenant}/", [push.tenant], approval=True)
    await call(push.nc, "source_approve", ApproveSourceRequest(uri=base + path, actor="op"), SourcesReply)
    before = await stored_names(push.nc)
    error = await push.refused(unique("redirected"), base + path, adapter_files, SourceNotApproved)
    assert f"redirect to {base}{elsewhere} needs an operator's approval" in error.message
    assert servers.https.hits[elsewhere + WEIGHTS_FILE] == 0 and await stored_names(push.nc) == before
    await call(push.nc, "source_approve", ApproveSourceRequest(uri=base + elsewhere, actor="op"), SourcesReply)
    assert (await push.register(unique("redirected"), base + path, adapter_files)).origin is not None


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
    assert record.digest == sha256(updated[WEIGHTS_FILE]) != first.digest
    assert f"/tenants/{other}/" in record.storage_uri and f"/tenants/{push.tenant}/" in first.storage_uri
    names = await stored_names(push.nc)
    leaves = {re.sub(r"/1\.[0-9a-f]{12}/", "/1/", n) for n in names}  # each push's own leaf under v1
    assert f"tenants/{push.tenant}/{first_id}/1/{WEIGHTS_FILE}" in leaves
    assert f"tenants/{other}/{second_id}/1/{WEIGHTS_FILE}" in leaves
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
