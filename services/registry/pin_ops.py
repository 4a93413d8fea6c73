"""Adapter pins: the registry ops behind ``lf.registry.pin``, ``unpin`` and ``pins``.

A pin is durable state in the KV bucket ``lf_pins`` (one ``PinRecord`` per adapter, worker scope
and version); every worker watches the bucket and keeps what it names resident. A change is written
there first, then recorded on the AUDIT stream (``AdminAudit`` ``adapter_pinned`` /
``adapter_unpinned`` under the adapter's owner). The bucket is re-read at every change, so two
registry replicas never work from a stale copy.

Pins never exceed a worker's slots: of each rank class, pins may hold every slot but one (so the
class's unpinned adapters still load), and a tenant's pins no more of a class than its GPU slot
quota (its ``TenantQuota.max_gpu_adapter_slots``, else the platform default's), so pinning cannot
lift that quota. A pin that
would pass either on a live worker it names, counted from the workers' heartbeats, is refused with
``PinsExceedSlots``; a worker that joins later with fewer slots holds the pins up to its cap and
reports the rest (``pins_refused``).
"""

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Literal

from shared import subjects
from shared.catalog.records import Catalog, pinned_versions
from shared.errors import Conflict, NotFound, PinsExceedSlots
from shared.schemas import AdminAudit, ListPinsRequest, PinRecord, PinRequest, PinsReply, WorkerHeartbeat
from shared.undecodable import decoded

Load = Callable[[], Awaitable[dict[str, bytes]]]
Put = Callable[[str, bytes], Awaitable[None]]
Delete = Callable[[str], Awaitable[None]]
Audit = Callable[[AdminAudit], Awaitable[None]]
SlotQuota = Callable[[str], int | None]  # tenant -> its GPU slot quota per rank class (None: no limit)
PinAction = Literal["adapter_pinned", "adapter_unpinned"]


class FleetSlots:
    """Each live worker's slots per rank class, from its heartbeats."""

    def __init__(self, liveness_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._timeout_s = liveness_timeout_s
        self._clock = clock
        self._seen: dict[str, tuple[float, dict[int, int]]] = {}  # worker -> (last beat, rank class -> slots)

    def on_heartbeat(self, beat: WorkerHeartbeat) -> None:
        self._seen[beat.worker_id] = (self._clock(), {int(rank): used[1] for rank, used in beat.slots.items()})

    def live(self) -> dict[str, dict[int, int]]:
        now = self._clock()
        return {worker: slots for worker, (seen, slots) in self._seen.items() if now - seen <= self._timeout_s}


def class_of(rank: int, slots: dict[int, int]) -> int | None:
    """The smallest rank class >= rank, or None when no class holds it."""
    return min((c for c in slots if rank <= c), default=None)


class Pins:
    def __init__(self, catalog: Catalog, fleet: FleetSlots, load: Load, put: Put, delete: Delete, audit: Audit,
                 slot_quota: SlotQuota = lambda _: None):  # fmt: skip
        self._catalog = catalog
        self._fleet = fleet
        self._slot_quota = slot_quota
        self._load, self._put, self._delete, self._audit = load, put, delete, audit
        self._lock = asyncio.Lock()

    async def pin(self, req: PinRequest) -> PinsReply:
        async with self._lock:
            owner = self._owner(req)
            if req.version is not None:
                self._pinnable(req.adapter_id, req.version)
            pin = PinRecord(adapter_id=req.adapter_id, tenant_id=owner, version=req.version, worker_id=req.worker_id,
                            actor=req.actor)  # fmt: skip
            current = await self._current()
            if pin.key not in current:
                self._check_slots([*current.values(), pin])
                await self._put(pin.key, pin.model_dump_json().encode())
                current[pin.key] = pin
                await self._record("adapter_pinned", pin, req.actor)
        return self._reply(current.values(), req.adapter_id)

    async def unpin(self, req: PinRequest) -> PinsReply:
        async with self._lock:
            owner = self._owner(req)
            pin = PinRecord(adapter_id=req.adapter_id, tenant_id=owner, version=req.version, worker_id=req.worker_id,
                            actor=req.actor)  # fmt: skip
            current = await self._current()
            if pin.key not in current:
                raise NotFound(f"adapter '{req.adapter_id}' has no such pin ({_scope(pin)})", param="adapter_id")
            await self._delete(pin.key)
            del current[pin.key]
            await self._record("adapter_unpinned", pin, req.actor)
        return self._reply(current.values(), req.adapter_id)

    async def list_pins(self, req: ListPinsRequest) -> PinsReply:
        pins = [p for p in (await self._current()).values() if req.tenant_id in (None, p.tenant_id)]
        return self._reply(pins, req.adapter_id)

    def _owner(self, req: PinRequest) -> str:
        """The adapter's owner; another tenant's adapter is the same 404 as a missing one."""
        owner = self._catalog.owner(req.adapter_id)
        if owner is None or req.tenant_id not in (None, owner):
            raise NotFound(
                f"adapter '{req.adapter_id}' does not exist or you do not have access to it", param="adapter_id"
            )
        return owner

    def _pinnable(self, adapter_id: str, version: int) -> None:
        record = self._catalog.get(adapter_id, version)
        if record is None:
            raise NotFound(f"adapter '{adapter_id}' has no version {version}", param="version")
        if record.status in ("retired", "revoked"):
            raise Conflict(f"{adapter_id} version {version} is {record.status}: it is never served", param="version")

    def _check_slots(self, pins: list[PinRecord]) -> None:
        """Refuse when, on some live worker, the pins of one rank class would hold every one of its slots."""
        for worker, slots in sorted(self._fleet.live().items()):
            by_class: dict[int, set[str]] = {}
            by_tenant: dict[tuple[str, int], set[str]] = {}
            for pin in pins:
                if not pin.applies_to(worker):
                    continue
                for record in pinned_versions(pin, self._catalog):
                    rank_class = class_of(record.rank, slots)
                    if rank_class is not None:
                        key = f"{record.adapter_id}@{record.version}"
                        by_class.setdefault(rank_class, set()).add(key)
                        by_tenant.setdefault((record.tenant_id, rank_class), set()).add(key)
            for (tenant, rank_class), keys in sorted(by_tenant.items()):
                quota = self._slot_quota(tenant)
                if quota and len(keys) > quota:
                    raise PinsExceedSlots(
                        f"tenant {tenant} may hold {quota} rank-{rank_class} slots of a worker: this would pin "
                        f"{len(keys)} on worker {worker}",
                        param="adapter_id",
                    )
            for rank_class, keys in sorted(by_class.items()):
                if len(keys) > slots[rank_class] - 1:
                    raise PinsExceedSlots(
                        f"worker {worker} has {slots[rank_class]} rank-{rank_class} slots: pins may hold "
                        f"{slots[rank_class] - 1} of them (one stays for unpinned adapters), this would pin "
                        f"{len(keys)}",
                        param="adapter_id",
                    )

    async def _current(self) -> dict[str, PinRecord]:
        return dict(decoded((await self._load()).items(), PinRecord.model_validate_json, subjects.REGISTRY_PINS_BUCKET))

    async def _record(self, action: PinAction, pin: PinRecord, actor: str) -> None:
        detail = {"version": pin.version, "worker_id": pin.worker_id}
        await self._audit(
            AdminAudit(actor=actor, tenant_id=pin.tenant_id, action=action, target=pin.adapter_id, detail=detail)
        )

    @staticmethod
    def _reply(pins: Iterable[PinRecord], adapter_id: str | None) -> PinsReply:
        chosen = [p for p in pins if adapter_id in (None, p.adapter_id)]
        return PinsReply(pins=sorted(chosen, key=lambda p: p.key))


def _scope(pin: PinRecord) -> str:
    version = "the served version" if pin.version is None else f"version {pin.version}"
    return f"{version} on {'every worker' if pin.worker_id is None else f'worker {pin.worker_id}'}"
