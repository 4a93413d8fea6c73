"""Deterministic traffic split between an adapter's production and canary versions."""

import hashlib

from shared.schemas import AdapterRecord

BUCKETS = 10_000


def bucket(adapter_id: str, request_key: str) -> int:
    """Stable bucket in [0, 10000) of a request key, independent per adapter."""
    digest = hashlib.sha256(f"{adapter_id}\x00{request_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def split_key(tenant_id: str, request_key: str) -> str:
    """What a request is split by: its tenant and its client's key (the OpenAI ``user``, else the
    request id), so that the keys one tenant chooses never decide another tenant's version."""
    return f"{tenant_id}\x00{request_key}"


def in_canary(adapter_id: str, request_key: str, traffic_percent: float) -> bool:
    return bucket(adapter_id, request_key) < round(traffic_percent * BUCKETS / 100)


def choose(production: AdapterRecord | None, canary: AdapterRecord | None, request_key: str) -> AdapterRecord | None:
    """The version this request key gets: the canary for its traffic share, production otherwise.

    A canary with no production version beside it serves all traffic: there is nothing to
    split against, and refusing the rest would turn a first rollout into an outage."""
    if canary is None:
        return production
    if production is None or in_canary(canary.adapter_id, request_key, canary.traffic_percent):
        return canary
    return production
