"""Ed25519 manifest signatures: a valid signature verifies, every forgery is refused."""

import pytest

from shared import signing
from shared.errors import IntegrityError

FILES = {"adapter_model.safetensors": "a" * 64, "adapter_config.json": "b" * 64}


def manifest(**override: object) -> bytes:
    fields: dict = {
        "files": FILES, "adapter_id": "summarize", "version": 3, "tenant_id": "acme",
        "base_model_fingerprint": "f" * 64, **override,
    }  # fmt: skip
    return signing.manifest_bytes(**fields)


def test_manifest_is_canonical_and_order_independent() -> None:
    reordered = manifest(files=dict(reversed(list(FILES.items()))))
    assert reordered == manifest()
    assert manifest().startswith(b'{"adapter_id":"summarize","base_model_fingerprint":"ffff')


def test_signature_verifies_for_the_trusted_signer() -> None:
    keys = signing.generate_keypair()
    signature = signing.sign(manifest(), signing.load_private_key(keys.private_pem))
    signing.verify(manifest(), signature, "release", {"release": keys.public_b64})


@pytest.mark.parametrize(
    "changed",
    [{"version": 4}, {"tenant_id": "globex"}, {"adapter_id": "other"}, {"base_model_fingerprint": "e" * 64},
     {"files": {**FILES, "adapter_model.safetensors": "c" * 64}}],
)  # fmt: skip
def test_signature_over_another_manifest_is_refused(changed: dict) -> None:
    keys = signing.generate_keypair()
    signature = signing.sign(manifest(), signing.load_private_key(keys.private_pem))
    with pytest.raises(IntegrityError, match="signature does not match the manifest"):
        signing.verify(manifest(**changed), signature, "release", {"release": keys.public_b64})


def test_signature_by_an_untrusted_key_is_refused() -> None:
    trusted, forger = signing.generate_keypair(), signing.generate_keypair()
    forged = signing.sign(manifest(), signing.load_private_key(forger.private_pem))
    with pytest.raises(IntegrityError, match="signature does not match"):
        signing.verify(manifest(), forged, "release", {"release": trusted.public_b64})
    with pytest.raises(IntegrityError, match="'mallory' is not a trusted signer"):
        signing.verify(manifest(), forged, "mallory", {"release": trusted.public_b64})


def test_garbage_signature_is_refused() -> None:
    keys = signing.generate_keypair()
    with pytest.raises(IntegrityError, match="not valid base64"):
        signing.verify(manifest(), "!!!", "release", {"release": keys.public_b64})
