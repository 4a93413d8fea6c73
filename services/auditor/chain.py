"""The sha256 hash chain: each record's hash covers its body and the previous record's hash."""

import hashlib

GENESIS = "0" * 64


def link(prev_hash: str, seq: int, body: str) -> str:
    return hashlib.sha256(f"{prev_hash}|{seq}|{body}".encode()).hexdigest()
