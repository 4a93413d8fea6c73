"""The API key format and its salted hash, shared by the registry (issues keys) and the gateway (checks them).

A key reads ``lf-<key_id>-<secret>``: ``key_id`` (16 hex) names the stored record, ``secret``
(256 random bits, URL-safe base64) is never stored; the record keeps ``sha256(salt || secret)``.
A fast hash is enough because the secret is uniformly random, not a password: nothing smaller
than a 2**256 search recovers it, and the gateway checks every request in microseconds.
"""

import hashlib
import hmac
import re
import secrets

from shared.schemas import ApiKeyRecord, ApiScope

_KEY = re.compile(r"^lf-([0-9a-f]{16})-([A-Za-z0-9_-]{43})$")


def _digest(salt: str, secret: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt) + secret.encode()).hexdigest()


def new_key(tenant_id: str, scopes: list[ApiScope]) -> tuple[str, ApiKeyRecord]:
    """A fresh bearer key and the record to store for it."""
    key_id, secret, salt = secrets.token_hex(8), secrets.token_urlsafe(32), secrets.token_hex(16)
    record = ApiKeyRecord(
        key_id=key_id, tenant_id=tenant_id, scopes=scopes, salt=salt, secret_sha256=_digest(salt, secret)
    )
    return f"lf-{key_id}-{secret}", record


def parse_key(key: str) -> tuple[str, str] | None:
    """(key_id, secret) of a well-formed key, else None."""
    match = _KEY.match(key)
    return (match.group(1), match.group(2)) if match else None


def matches(record: ApiKeyRecord, secret: str) -> bool:
    """Whether ``secret`` is the one the record was made for (constant-time compare)."""
    return hmac.compare_digest(record.secret_sha256, _digest(record.salt, secret))
