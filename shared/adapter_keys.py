"""Names two services agree on outside NATS subjects: the adapter version key and the Redis keys.

An adapter version is named ``<adapter_id>@<version>`` everywhere it is a string: the scheduler's
heat counters, the workers' cache keys and heartbeats, prefetch directives and the dashboard.
"""

from dataclasses import dataclass

from shared.errors import InvalidRequest


def adapter_key(adapter_id: str, version: int) -> str:
    """The key of one adapter version: ``adapter_key("sql", 3) == "sql@3"``."""
    return f"{adapter_id}@{version}"


def parse_adapter_key(key: str) -> tuple[str, int]:
    """``(adapter_id, version)`` of an :func:`adapter_key`; InvalidRequest for anything else."""
    adapter_id, _, version = key.rpartition("@")
    if not adapter_id or not version.isdigit():
        raise InvalidRequest(f"adapter key {key!r} is not <adapter_id>@<version>")
    return adapter_id, int(version)


def adapter_of_key(key: str) -> str:
    """The adapter id of an :func:`adapter_key` (the whole string if it holds no version)."""
    adapter_id, sep, _ = key.rpartition("@")
    return adapter_id if sep else key


@dataclass(frozen=True, slots=True)
class HeatKeys:
    """The Redis keys of the fleet's adapter heat under one key prefix.

    ``rates`` is the zset the workers' cache policy reads (adapter key -> decayed requests/s);
    ``counts`` holds the decayed counts the schedulers add into, ``decayed_at`` the last decay time.
    """

    counts: str
    rates: str
    decayed_at: str

    @classmethod
    def under(cls, prefix: str) -> "HeatKeys":
        return cls(counts=f"{prefix}heat:count", rates=f"{prefix}heat", decayed_at=f"{prefix}heat:at")
