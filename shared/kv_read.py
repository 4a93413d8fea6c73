"""One-shot reads of a KV bucket's current values, exact under concurrent delivery.

nats-py's KV watcher marks the end of the initial values (``None``) when its consumer reports no
pending message and nothing has been received yet. The server counts a message it has already sent
as not pending, so a value still on the wire is not yet received: the marker then comes first and a
one-shot read that stops at it misses values that are in the bucket (seen in CI: a rollout status
read just after the rollout was written came back empty). A pull consumer delivers nothing before
its first fetch, so its pending count, read at creation, is exact: the read ends when a fetched
message reports none left.
"""

import contextlib
from dataclasses import dataclass

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

FETCH_BATCH = 256
FETCH_TIMEOUT_S = 5.0
INACTIVE_S = 30.0  # the server removes the consumer if this read dies before deleting it


@dataclass(frozen=True, slots=True)
class KvValue:
    key: str
    value: bytes
    revision: int


async def read_latest(kv: KeyValue, keys: str = ">") -> list[KvValue]:
    """The newest value of every live key ``keys`` matches (a KV key pattern), in stream order;
    deleted and purged keys are left out."""
    # nats-py's KeyValue keeps its context, stream and subject prefix private; a read needs all three
    js, stream, prefix = kv._js, kv._stream, kv._pre
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=INACTIVE_S,
        mem_storage=True,
        num_replicas=1,
    )
    sub = await js.pull_subscribe(prefix + keys, stream=stream, config=config)
    found: dict[str, KvValue] = {}
    try:
        pending = (await sub.consumer_info()).num_pending or 0
        while pending > 0:
            for msg in await sub.fetch(min(pending, FETCH_BATCH), timeout=FETCH_TIMEOUT_S):
                meta = msg.metadata
                pending = meta.num_pending or 0
                key = msg.subject[len(prefix) :]
                if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
                    found.pop(key, None)
                    continue
                found[key] = KvValue(key, msg.data, meta.sequence.stream)
    finally:
        with contextlib.suppress(NotFoundError):
            await js.delete_consumer(stream, config.name or "")
        await sub.unsubscribe()
    return sorted(found.values(), key=lambda v: v.revision)
