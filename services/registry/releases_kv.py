"""Rollouts in the ``lf_releases`` KV bucket; every write is a compare-and-set on the revision
read, so two registry replicas never both advance one rollout."""

from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from services.registry.kv import open_bucket
from shared import subjects
from shared.kv_read import read_latest
from shared.schemas import ReleaseState
from shared.undecodable import decoded


@dataclass(frozen=True, slots=True)
class Stored:
    state: ReleaseState
    revision: int | None  # None: not stored yet


class LostRace(Exception):
    """The record changed since it was read: another replica wrote it."""


class ReleasesKV:
    def __init__(self, bucket: KeyValue) -> None:
        self._bucket = bucket

    @classmethod
    async def open(cls, js: JetStreamContext) -> "ReleasesKV":
        return cls(await open_bucket(js, subjects.REGISTRY_RELEASES_BUCKET))

    async def load(self) -> dict[str, Stored]:
        """Every rollout by adapter id, with the revision to write it back against; an entry that does
        not decode is skipped and counted."""
        entries = [((v.key, v.revision), v.value) for v in await read_latest(self._bucket)]
        parsed = decoded(entries, ReleaseState.model_validate_json, subjects.REGISTRY_RELEASES_BUCKET)
        return {key: Stored(state, revision) for (key, revision), state in parsed}

    async def write(self, state: ReleaseState, revision: int | None) -> int:
        """Store ``state`` if the record is still at ``revision`` (None: if there is none yet)."""
        value = state.model_dump_json().encode()
        try:
            if revision is None:
                return await self._bucket.create(state.adapter_id, value)
            return await self._bucket.update(state.adapter_id, value, last=revision)
        except KeyWrongLastSequenceError as e:
            raise LostRace(state.adapter_id) from e
