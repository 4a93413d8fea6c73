"""Admission of a new version: signature, identity and version rules on top of the file checks."""

from collections.abc import Callable
from typing import Any

import pytest

from services.registry import push_admission as intake
from services.registry.fleet_ranks import RankClasses
from services.registry.push_admission import BaseModelIdentity, IntakePolicy
from shared import signing
from shared.adapter_format import file_digests
from shared.catalog.records import Catalog, Change
from shared.errors import Conflict, IntegrityError, SignerNotAuthorized
from shared.schemas import AdapterRecord, RegisterRequest, SignerRecord
from shared.signing import KeyPair

URI = "nats-os://lf_adapter_store/summarize/1"
FLEET = RankClasses((8, 16, 32, 64), "test")
Files = dict[str, bytes]


def admit(catalog: Catalog, req: RegisterRequest, files: Files, *args: Any, **kwargs: Any) -> Change:
    """``intake.admit`` given the files' digests as the registry hashes them, once per push."""
    return intake.admit(catalog, req, files, *args, digests=file_digests(files), **kwargs)


@pytest.fixture
def sign_request(base: BaseModelIdentity, policy: IntakePolicy) -> Callable[..., RegisterRequest]:
    """A register request signed by ``keys`` over ``files`` for the identity in ``fields``."""

    def make(files: Files, keys: KeyPair, fingerprint: str | None = None, **fields: object) -> RegisterRequest:
        values: dict = {"adapter_id": "summarize", "tenant_id": "acme", "task_type": "summarization",
                        "version": 1, "inline_files": {}, "actor": "cli:alice", **fields}  # fmt: skip
        digests = file_digests(files)
        manifest = signing.manifest_bytes(
            digests, values["adapter_id"], values["version"], values["tenant_id"], fingerprint or base.fingerprint
        )
        signature = signing.sign(manifest, signing.load_private_key(keys.private_pem))
        return RegisterRequest(signature=signature, signer="release", **values)

    return make


def release(keys: KeyPair, *tenants: str, **fields: object) -> dict[str, SignerRecord]:
    """The registry's signer "release", bound to ``tenants`` (acme when none are named)."""
    record = SignerRecord(signer="release", public_key=keys.public_b64, tenants=list(tenants or ["acme"]), **fields)
    return {"release": record}


def test_signed_adapter_becomes_a_staging_record(
    adapter_files: Files, base: BaseModelIdentity, policy: IntakePolicy, signer_keys: KeyPair, sign_request: Callable
) -> None:
    req = sign_request(adapter_files, signer_keys, aliases=["sum"])
    change = admit(Catalog(), req, adapter_files, base, policy, release(signer_keys), URI, fleet=FLEET)
    record = change.after
    assert (change.kind, change.before, record.status, record.version) == ("registered", None, "staging", 1)
    assert (record.rank, record.alpha, record.signer, record.aliases) == (8, 16.0, "release", ["sum"])
    assert record.base_model_fingerprint == base.fingerprint and record.storage_uri == URI


def test_unsigned_adapter_is_refused_unless_dev_mode(
    adapter_files: Files, base: BaseModelIdentity, policy: IntakePolicy
) -> None:
    req = RegisterRequest(adapter_id="summarize", tenant_id="acme", task_type="t", inline_files={}, actor="a")
    with pytest.raises(IntegrityError, match="the adapter is unsigned"):
        admit(Catalog(), req, adapter_files, base, policy, {}, URI, fleet=FLEET)
    dev = IntakePolicy(limits=policy.limits, dev_mode=True)
    assert admit(Catalog(), req, adapter_files, base, dev, {}, URI, fleet=FLEET).after.signature is None


def test_forged_signatures_are_refused(
    adapter_files: Files, variant: Callable, base: BaseModelIdentity, policy: IntakePolicy,
    signer_keys: KeyPair, sign_request: Callable,
) -> None:  # fmt: skip
    trusted = release(signer_keys)
    forger = signing.generate_keypair()
    cases = [
        (sign_request(adapter_files, forger), adapter_files),  # someone else's key under the trusted name
        (sign_request(adapter_files, signer_keys, version=2), adapter_files),  # signed for another version
        (sign_request(adapter_files, signer_keys, tenant_id="globex"), adapter_files),
        (sign_request(adapter_files, signer_keys, fingerprint="e" * 64), adapter_files),  # another base model
        (sign_request(adapter_files, signer_keys), variant(config={"lora_alpha": 32})),  # files swapped after signing
    ]
    for req, files in cases:
        req = req.model_copy(update={"version": 1, "tenant_id": "acme"})
        with pytest.raises(IntegrityError, match="signature does not match the manifest"):
            admit(Catalog(), req, files, base, policy, trusted, URI, fleet=FLEET)


def test_identity_rules(
    adapter_files: Files, base: BaseModelIdentity, policy: IntakePolicy, signer_keys: KeyPair,
    sign_request: Callable, make_record: Callable[..., AdapterRecord],
) -> None:  # fmt: skip
    trusted = release(signer_keys)
    catalog = Catalog([make_record("summarize", 1, "acme"), make_record("other", 1, "acme", aliases=["qa"])])
    with pytest.raises(Conflict, match="versions are immutable"):
        admit(catalog, sign_request(adapter_files, signer_keys), adapter_files, base, policy, trusted, URI, fleet=FLEET)
    with pytest.raises(Conflict, match="is not available"):
        req = sign_request(adapter_files, signer_keys, tenant_id="globex", version=2)
        admit(catalog, req, adapter_files, base, policy, trusted, URI, fleet=FLEET)
    with pytest.raises(Conflict, match="alias 'qa' already names another adapter"):
        req = sign_request(adapter_files, signer_keys, version=2, aliases=["qa"])
        admit(catalog, req, adapter_files, base, policy, trusted, URI, fleet=FLEET)
    req = sign_request(adapter_files, signer_keys, version=2)
    assert admit(catalog, req, adapter_files, base, policy, trusted, URI, fleet=FLEET).after.version == 2


def test_a_signer_signs_only_for_the_tenants_it_is_bound_to(
    adapter_files: Files, base: BaseModelIdentity, policy: IntakePolicy, signer_keys: KeyPair, sign_request: Callable
) -> None:
    req = sign_request(adapter_files, signer_keys, tenant_id="globex")  # a valid signature, for another tenant
    with pytest.raises(SignerNotAuthorized, match="may not sign adapters of tenant globex") as refused:
        admit(Catalog(), req, adapter_files, base, policy, release(signer_keys, "acme"), URI, fleet=FLEET)
    assert (refused.value.status, refused.value.code) == (403, "signer_not_authorized")
    assert admit(Catalog(), req, adapter_files, base, policy, release(signer_keys, "acme", "globex"), URI, fleet=FLEET)


def test_an_untrusted_or_rotated_out_key_signs_no_new_push(
    adapter_files: Files, base: BaseModelIdentity, policy: IntakePolicy, signer_keys: KeyPair, sign_request: Callable
) -> None:
    req = sign_request(adapter_files, signer_keys)
    with pytest.raises(IntegrityError, match="'release' is not a trusted signer"):
        admit(Catalog(), req, adapter_files, base, policy, release(signer_keys, trusted=False), URI, fleet=FLEET)
    new = signing.generate_keypair()
    rotated = release(new, retired_keys=[signer_keys.public_b64])
    with pytest.raises(IntegrityError, match="signature does not match"):
        admit(Catalog(), req, adapter_files, base, policy, rotated, URI, fleet=FLEET)
    assert admit(Catalog(), sign_request(adapter_files, new), adapter_files, base, policy, rotated, URI, fleet=FLEET)
