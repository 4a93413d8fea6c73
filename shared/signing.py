"""Ed25519 adapter signatures over a canonical manifest (format: docs/adapter-signing.md)."""

import base64
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.errors import IntegrityError, InvalidRequest

MANIFEST_VERSION = 1


def canonical_json(value: object) -> bytes:
    """Byte-stable JSON: sorted keys, no whitespace, ASCII only. The input of every digest."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


@dataclass(frozen=True, slots=True)
class KeyPair:
    private_pem: bytes
    public_b64: str  # raw 32-byte Ed25519 public key, base64


def generate_keypair() -> KeyPair:
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return KeyPair(private_pem=pem, public_b64=public_key_b64(key))


def public_key_b64(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def load_private_key(pem: bytes) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise InvalidRequest("the signing key is not an Ed25519 private key")
    return key


def load_public_key(public_b64: str) -> Ed25519PublicKey:
    try:
        return Ed25519PublicKey.from_public_bytes(base64.b64decode(public_b64, validate=True))
    except ValueError as e:
        raise InvalidRequest(f"not a base64 raw Ed25519 public key: {e}") from None


def manifest_bytes(
    files: Mapping[str, str], adapter_id: str, version: int, tenant_id: str, base_model_fingerprint: str
) -> bytes:
    """The signed statement: every file name -> sha256 plus the record's identity fields."""
    return canonical_json(
        {
            "manifest_version": MANIFEST_VERSION,
            "adapter_id": adapter_id,
            "version": version,
            "tenant_id": tenant_id,
            "base_model_fingerprint": base_model_fingerprint,
            "files": dict(sorted(files.items())),
        }
    )


def manifest_digest(manifest: bytes) -> str:
    return hashlib.sha256(manifest).hexdigest()


def sign(manifest: bytes, key: Ed25519PrivateKey) -> str:
    """Base64 Ed25519 signature of the manifest bytes."""
    return base64.b64encode(key.sign(manifest)).decode()


def verify(manifest: bytes, signature_b64: str, signer: str, trusted: Mapping[str, str | Sequence[str]]) -> None:
    """Raise IntegrityError unless ``signer`` is trusted and one of its keys signed exactly ``manifest``.

    ``trusted`` maps signer name -> base64 raw public key, or the list of them (a rotated signer's
    current and earlier keys), as registry data."""
    keys = trusted.get(signer)
    if keys is None:
        raise IntegrityError(f"signer {signer!r} is not a trusted signer")
    try:
        signature = base64.b64decode(signature_b64, validate=True)
    except ValueError:
        raise IntegrityError("the signature is not valid base64") from None
    for public_b64 in [keys] if isinstance(keys, str) else keys:
        try:
            load_public_key(public_b64).verify(signature, manifest)
            return
        except InvalidSignature:
            continue
    raise IntegrityError(f"signature does not match the manifest for signer {signer!r}")
