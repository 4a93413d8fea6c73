"""Worker-side verification: the bytes fetched must be exactly the signed, admitted adapter."""

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

from services.registry.fleet_ranks import RankClasses
from services.registry.push_admission import BaseModelIdentity, IntakePolicy, admit
from services.worker.adapter_verify import fetch_adapter_files, verify_adapter
from shared import signing
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE, file_digests
from shared.catalog.records import Catalog
from shared.errors import IntegrityError, InvalidRequest
from shared.eval_set import EVAL_SET_FILE
from shared.schemas import AdapterRecord, RegisterRequest, SignerRecord
from shared.signing import KeyPair

Files = dict[str, bytes]


@pytest.fixture
def signed_record(
    adapter_files: Files, base: BaseModelIdentity, policy: IntakePolicy, signer_keys: KeyPair
) -> AdapterRecord:
    """The record the registry admits for the peft adapter, signed by the trusted key."""
    unsigned = IntakePolicy(limits=policy.limits, dev_mode=True)
    req = RegisterRequest(adapter_id="summarize", tenant_id="acme", task_type="t", inline_files={}, actor="a")
    fleet = RankClasses((8, 16, 32, 64), "test")
    digests = file_digests(adapter_files)
    draft = admit(
        Catalog(), req, adapter_files, base, unsigned, {}, "file:///nowhere", digests=digests, fleet=fleet
    ).after
    manifest = signing.manifest_bytes(draft.files, "summarize", 1, "acme", base.fingerprint)
    signature = signing.sign(manifest, signing.load_private_key(signer_keys.private_pem))
    return draft.model_copy(update={"signature": signature, "signer": "release"})


def test_untouched_adapter_verifies(
    signed_record: AdapterRecord, adapter_files: Files, base: BaseModelIdentity, signer_keys: KeyPair
) -> None:
    verify_adapter(signed_record, adapter_files, base.fingerprint, {"release": signer_keys.public_b64})


EVAL_SET = b'{"meta": {"threshold": 0.5}}\n{"prompt": "2+2=", "expected": "4"}\n'


def test_an_eval_set_pushed_with_the_adapter_is_signed_with_it_and_never_served(
    adapter_files: Files, base: BaseModelIdentity, policy: IntakePolicy, signer_keys: KeyPair
) -> None:
    """The worker fetches the two served files; the eval set's digest enters the manifest as recorded,
    so a record whose eval set digest was swapped no longer matches the signature."""
    pushed = {**adapter_files, EVAL_SET_FILE: EVAL_SET}
    digests = file_digests(pushed)
    manifest = signing.manifest_bytes(digests, "summarize", 1, "acme", base.fingerprint)
    signature = signing.sign(manifest, signing.load_private_key(signer_keys.private_pem))
    req = RegisterRequest(
        adapter_id="summarize", tenant_id="acme", task_type="t", inline_files={}, signature=signature,
        signer="release", actor="a",
    )  # fmt: skip
    signer = SignerRecord(signer="release", public_key=signer_keys.public_b64, tenants=["acme"])
    fleet = RankClasses((8, 16, 32, 64), "test")
    record = admit(
        Catalog(), req, pushed, base, policy, {"release": signer}, "file:///nowhere", digests=digests, fleet=fleet
    ).after
    assert record.eval_set_digest == hashlib.sha256(EVAL_SET).hexdigest() == record.files[EVAL_SET_FILE]
    trusted = {"release": signer_keys.public_b64}
    verify_adapter(record, adapter_files, base.fingerprint, trusted)  # the served files only
    swapped = record.model_copy(update={"files": {**record.files, EVAL_SET_FILE: "f" * 64}})
    with pytest.raises(IntegrityError, match="manifest digest does not match"):
        verify_adapter(swapped, adapter_files, base.fingerprint, trusted)
    with pytest.raises(InvalidRequest, match=r"eval\.jsonl:3: an item needs exactly one of prompt or messages"):
        admit(
            Catalog(), req, {**pushed, EVAL_SET_FILE: EVAL_SET + b'{"expected": "no prompt"}\n'}, base, policy,
            {"release": signer}, "file:///nowhere", digests=digests, fleet=fleet,
        )  # fmt: skip


def test_tampered_weights_are_refused(
    signed_record: AdapterRecord, adapter_files: Files, base: BaseModelIdentity, signer_keys: KeyPair
) -> None:
    weights = bytearray(adapter_files[WEIGHTS_FILE])
    weights[-1] ^= 0x01  # one bit of one tensor value, as a corrupted or swapped store object would
    files = {**adapter_files, WEIGHTS_FILE: bytes(weights)}
    with pytest.raises(IntegrityError, match=r"adapter_model\.safetensors sha256 .* does not match"):
        verify_adapter(signed_record, files, base.fingerprint, {"release": signer_keys.public_b64})


def test_tampered_record_is_refused(
    signed_record: AdapterRecord, variant: Callable, base: BaseModelIdentity, signer_keys: KeyPair
) -> None:
    """An attacker who can rewrite both the store and the record still cannot forge the signature."""
    files = variant(config={"lora_alpha": 64})
    digests = {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}
    manifest = signing.manifest_bytes(digests, "summarize", 1, "acme", base.fingerprint)
    record = signed_record.model_copy(
        update={
            "files": digests,
            "digest": digests[WEIGHTS_FILE],
            "manifest_digest": signing.manifest_digest(manifest),
        }
    )
    with pytest.raises(IntegrityError, match="signature does not match the manifest"):
        verify_adapter(record, files, base.fingerprint, {"release": signer_keys.public_b64})


def test_other_base_model_and_unsigned_and_untrusted_are_refused(
    signed_record: AdapterRecord, adapter_files: Files, base: BaseModelIdentity, signer_keys: KeyPair
) -> None:
    trusted = {"release": signer_keys.public_b64}
    with pytest.raises(IntegrityError, match="was built for base model"):
        verify_adapter(signed_record, adapter_files, "e" * 64, trusted)
    unsigned = signed_record.model_copy(update={"signature": None, "signer": None})
    with pytest.raises(IntegrityError, match="is unsigned"):
        verify_adapter(unsigned, adapter_files, base.fingerprint, trusted)
    verify_adapter(unsigned, adapter_files, base.fingerprint, trusted, require_signature=False)
    with pytest.raises(IntegrityError, match="not a trusted signer"):
        verify_adapter(signed_record, adapter_files, base.fingerprint, {})


async def test_fetch_from_a_trusted_directory(adapter_files: Files, tmp_path: Path) -> None:
    for name, data in adapter_files.items():
        (tmp_path / name).write_bytes(data)
    assert await fetch_adapter_files(None, tmp_path.as_uri()) == adapter_files  # type: ignore[arg-type]
    (tmp_path / CONFIG_FILE).unlink()
    (tmp_path / CONFIG_FILE).symlink_to(tmp_path / WEIGHTS_FILE)
    with pytest.raises(IntegrityError, match="not a regular file"):
        await fetch_adapter_files(None, tmp_path.as_uri())  # type: ignore[arg-type]
    with pytest.raises(IntegrityError, match="not a trusted store"):
        await fetch_adapter_files(None, "https://example.com/adapter")  # type: ignore[arg-type]
