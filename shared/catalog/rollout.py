"""Deterministic traffic split between an adapter's production and canary versions: a 2-arm
experiment [canary, production] on the one weighted split (``shared.catalog.experiments.assign``)."""

from shared.catalog.experiments import BUCKETS, assign, bucket
from shared.schemas import AdapterRecord

__all__ = ["BUCKETS", "bucket", "choose", "in_canary", "split_key"]


def split_key(tenant_id: str, request_key: str) -> str:
    """What a request is split by: its tenant and its client's key (the OpenAI ``user``, else the
    request id), so that the keys one tenant chooses never decide another tenant's version."""
    return f"{tenant_id}\x00{request_key}"


def in_canary(adapter_id: str, request_key: str, traffic_percent: float) -> bool:
    """The canary holds the first ``round(percent * 100)`` of the adapter's 10000 buckets."""
    canary = round(traffic_percent * BUCKETS / 100)
    return assign([canary, BUCKETS - canary], adapter_id, request_key) == 0


def choose(production: AdapterRecord | None, canary: AdapterRecord | None, request_key: str) -> AdapterRecord | None:
    """The version this request key gets: the canary for its traffic share, production otherwise.

    A canary with no production version beside it serves all traffic: there is nothing to
    split against, and refusing the rest would turn a first rollout into an outage."""
    if canary is None:
        return production
    if production is None or in_canary(canary.adapter_id, request_key, canary.traffic_percent):
        return canary
    return production
