"""Skip and count what a bucket or stream holds that cannot be decoded: one bad entry (an older schema,
a bug, a write by someone who should not have made it) must not stop a service that reads them all,
nor keep it from starting again."""

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import structlog

from shared import metrics

log = structlog.get_logger("undecodable")
T = TypeVar("T")
K = TypeVar("K")


def skip(source: str, key: str, error: Exception) -> None:
    """Count (``undecodable_messages_total{source}``) and log one entry of ``source`` (a bucket or
    stream name) that was not decoded."""
    metrics.UNDECODABLE.labels(source).inc()
    log.warning("undecodable_skipped", source=source, key=key, error=f"{type(error).__name__}: {str(error)[:300]}")


def decoded(entries: Iterable[tuple[K, bytes]], parse: Callable[[bytes], T], source: str) -> Iterator[tuple[K, T]]:
    """``(key, parse(value))`` for each entry that parses; the others are skipped and counted. ``parse``
    signals a value it cannot decode with ValueError (pydantic's ValidationError is one)."""
    for key, value in entries:
        try:
            yield key, parse(value)
        except ValueError as e:
            skip(source, str(key), e)
