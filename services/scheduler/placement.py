"""The fleet as the scheduler sees it (heartbeats plus its own dispatches since), and which worker
takes a request: adapter residency (GPU > CPU tier > load), then load (weighed by the request's SLO
class), then KV headroom. A worker whose
engine cannot serve the adapter's rank or modules (its heartbeat's capability) never takes it.

Rank pools: a worker may declare rank classes it serves as a pool (``WorkerHeartbeat.rank_pool``). An
adapter whose rank class on some live worker is in that worker's pool is *pooled*: it goes to an
unsaturated worker of its pool, and spills to the others only while every pool worker is saturated
(running+waiting >= max_running). Every other request keeps off pool workers while a worker outside
any pool has room."""

import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.adapter_keys import adapter_key
from shared.request_ref import RequestRef
from shared.schemas import InferRequest, WorkerHeartbeat
from shared.slot_size import class_of

# residency cost in units of load (running+waiting over max_running): an adapter already in a GPU
# slot is worth a whole worker's load; a saturated worker ranks after every unsaturated one
TIER_COST = {"gpu": 0.0, "cpu": 0.5, "free_slot": 0.75, "miss": 1.0}
# how much a worker's load counts against residency, by SLO class: an interactive request goes to a less
# loaded worker even at the cost of copying its adapter from a CPU tier (its first token comes sooner),
# a batch one stays with the worker holding its adapter even when that one is busier (throughput, and
# no eviction of others' adapters for it)
LOAD_WEIGHT = {"interactive": 2.0, "standard": 1.0, "batch": 0.5}
HOME_WEIGHT = 0.5  # an adapter held nowhere goes to its rendezvous-hash home unless that worker is busier
RECENT_S = 5.0  # a worker we just sent an adapter to is treated as holding it until heartbeats show it
# a worker's role for one request: in the pool of the request's rank class, outside every pool, or
# in a pool of other classes
OWN_POOL, NO_POOL, OTHER_POOL = 0, 1, 2


def adapter_key_of(request: InferRequest) -> str | None:
    return adapter_key(request.adapter.adapter_id, request.adapter.version) if request.adapter else None


def _spread(key: str | None, worker_id: str) -> float:
    """A stable pseudo-random number in [0, 1) per (adapter, worker): each adapter's ranking of the
    workers, so misses of one adapter keep landing on the same worker and the fleet's slots
    partition the long tail instead of all caching the same adapters."""
    return zlib.crc32(f"{key}|{worker_id}".encode()) / 2**32


def _classes(beat: WorkerHeartbeat) -> frozenset[int]:
    return frozenset(int(r) for r in beat.slots) | frozenset(beat.rank_pool)


@dataclass(slots=True)
class WorkerView:
    beat: WorkerHeartbeat
    seen_at: float
    sent: dict[RequestRef, float] = field(default_factory=dict)  # request -> wall time, dispatched since the heartbeat
    # this scheduler's requests the heartbeat counts as running that have ended since (-> when they ended)
    ended_since: dict[RequestRef, float] = field(default_factory=dict)
    inflight: int = 0  # this scheduler's accepted requests on it that have not ended
    backed_off: bool = False  # it refused for load: nothing more until its next heartbeat
    recent: dict[str, float] = field(default_factory=dict)  # adapter key -> when we placed it here
    classes: frozenset[int] = field(init=False)  # its rank classes: slot classes and pool, from the heartbeat

    def __post_init__(self) -> None:
        self.classes = _classes(self.beat)

    @property
    def load(self) -> int:
        """What runs or waits there: its heartbeat's count, less what of it has ended since, plus what
        was sent since; never less than this scheduler's own requests on it."""
        beat = max(0, self.beat.running + self.beat.waiting - len(self.ended_since))
        return max(beat + len(self.sent), self.inflight)

    def tier(self, key: str | None, now: float, rank: int | None = None) -> str:
        """Where the adapter is: gpu, cpu (a cheap copy), free_slot (a load needing no eviction), miss."""
        if key is None or key in self.beat.resident_adapters or now - self.recent.get(key, -1e9) < RECENT_S:
            return "gpu"
        if key in self.beat.cpu_adapters:
            return "cpu"
        return "free_slot" if rank is not None and self.free_slot(rank) else "miss"

    def rank_class(self, rank: int) -> int | None:
        """The rank class of this worker that holds ``rank`` (None: none does, or none is announced)."""
        return class_of(rank, self.classes)

    def role(self, rank: int | None) -> int:
        """OWN_POOL, NO_POOL or OTHER_POOL for a request of adapter ``rank`` (None: the base model)."""
        if not self.beat.rank_pool:
            return NO_POOL
        return OWN_POOL if rank is not None and self.rank_class(rank) in self.beat.rank_pool else OTHER_POOL

    def free_slot(self, rank: int) -> bool:
        """Whether the smallest rank class that holds ``rank`` has a free slot on this worker."""
        fitting = sorted(int(r) for r in self.beat.slots if int(r) >= rank)
        if not fitting:
            return False
        used, total = self.beat.slots[str(fitting[0])]
        return used < total


@dataclass(slots=True)
class Fleet:
    timeout_s: float
    headroom: int = 2
    workers: dict[str, WorkerView] = field(default_factory=dict)

    def heartbeat(self, beat: WorkerHeartbeat, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        view = self.workers.get(beat.worker_id)
        if view is None:
            self.workers[beat.worker_id] = WorkerView(beat, now)
            return
        view.beat, view.seen_at, view.backed_off = beat, now, False
        view.classes = _classes(beat)
        view.sent = {ref: t for ref, t in view.sent.items() if t > beat.ts}
        view.ended_since = {ref: t for ref, t in view.ended_since.items() if t > beat.ts}
        view.recent = {k: t for k, t in view.recent.items() if now - t < RECENT_S}

    def expire(self, now: float | None = None) -> list[str]:
        """Drop workers silent past the timeout; their ids."""
        now = time.monotonic() if now is None else now
        dead = [w for w, v in self.workers.items() if now - v.seen_at > self.timeout_s]
        for w in dead:
            del self.workers[w]
        return dead

    def resume(self, now: float | None = None) -> None:
        """This scheduler was itself cut off from the bus: what it did not hear says nothing about the
        workers, so each one's silence counts from now."""
        now = time.monotonic() if now is None else now
        for view in self.workers.values():
            view.seen_at = now

    def serves(self, request: InferRequest) -> bool:
        """Whether a live worker serves the request's base model with an engine that fits its adapter."""
        return any(v.beat.ready and self._fits(v, request) for v in self.workers.values())

    @staticmethod
    def signature(request: InferRequest) -> tuple:
        """What decides whether some worker can take ``request`` (``choose`` is None or not): its base
        model, and its adapter's rank and modules. Which worker is best depends on more."""
        adapter = request.adapter
        if adapter is None:
            return (request.base_model,)
        return (request.base_model, adapter.rank, tuple(adapter.target_modules or ()))

    @staticmethod
    def _fits(view: WorkerView, request: InferRequest) -> bool:
        adapter = request.adapter
        if view.beat.base_model != request.base_model:
            return False
        return adapter is None or view.beat.capability.serves(adapter.rank, adapter.target_modules)

    def has_room(self, view: WorkerView) -> bool:
        return view.beat.ready and not view.backed_off and view.load < view.beat.max_running + self.headroom

    def pooled(self, request: InferRequest) -> bool:
        """Whether a live worker fitting the request holds its adapter's rank class in its pool."""
        rank = request.adapter.rank if request.adapter else None
        return any(v.beat.ready and self._fits(v, request) and v.role(rank) == OWN_POOL for v in self.workers.values())

    def free_sequences(self, request: InferRequest) -> int:
        """How many more requests like ``request`` the live workers that fit it would take now (the
        room ``has_room`` counts, summed)."""
        return sum(
            max(0, v.beat.max_running + self.headroom - v.load)
            for v in self.workers.values()
            if self._fits(v, request) and v.beat.ready and not v.backed_off
        )

    def choose(self, request: InferRequest, exclude: Iterable[str] = (), now: float | None = None) -> str | None:
        """The best worker with room for ``request``, or None."""
        now = time.monotonic() if now is None else now
        key, skip = adapter_key_of(request), set(exclude)
        rank = request.adapter.rank if request.adapter else None
        pooled = self.pooled(request)
        load_weight = LOAD_WEIGHT[request.priority or "standard"]
        best: tuple | None = None
        for worker_id, v in self.workers.items():
            if worker_id in skip or not self._fits(v, request) or not self.has_room(v):
                continue
            tier = v.tier(key, now, rank)
            home = HOME_WEIGHT * _spread(key, worker_id) if tier != "gpu" else 0.0
            saturated = v.load >= v.beat.max_running  # a busy holder spills its adapter to idle workers
            role = v.role(rank)
            # a pooled adapter leaves its pool only when the pool is saturated; the rest keep off pools
            # while a worker outside them has room
            band = (saturated, role) if pooled else (role, saturated)
            cost = TIER_COST[tier] + home + load_weight * v.load / v.beat.max_running
            score = (*band, cost, -v.beat.kv_blocks_free, worker_id)
            if best is None or score < best:
                best = score
        return best[-1] if best else None

    def spilled_from(self, request: InferRequest, worker_id: str) -> int | None:
        """The pooled rank class ``request`` leaves by going to ``worker_id`` (None: no spill)."""
        view = self.workers.get(worker_id)
        if request.adapter is None or view is None or not self.pooled(request):
            return None
        if view.role(request.adapter.rank) == OWN_POOL:
            return None
        rank = request.adapter.rank
        return min(v.rank_class(rank) or rank for v in self.workers.values() if v.role(rank) == OWN_POOL)

    def sent(self, worker_id: str, request: InferRequest, now: float | None = None) -> None:
        """A dispatch is on its way to ``worker_id``: count it against the worker until heartbeats do."""
        view = self.workers.get(worker_id)
        if view is None:
            return
        view.sent[RequestRef.of(request)] = time.time()
        key = adapter_key_of(request)
        if key is not None:
            view.recent[key] = time.monotonic() if now is None else now

    def accepted(self, worker_id: str) -> None:
        view = self.workers.get(worker_id)
        if view is not None:
            view.inflight += 1

    def ended(self, worker_id: str, ref: RequestRef, at: float | None = None) -> None:
        """A request this scheduler placed there finished at wall time ``at`` (the worker's clock, as
        its heartbeats'; None: not known). It no longer loads the worker: one sent since the last
        heartbeat leaves ``sent``; one that heartbeat counted as running is taken off its count until
        a heartbeat taken after it ended, so its sequence is free at once, not at the next beat."""
        view = self.workers.get(worker_id)
        if view is not None:
            if view.sent.pop(ref, None) is None and at is not None and at > view.beat.ts:
                view.ended_since[ref] = at
            view.inflight = max(0, view.inflight - 1)

    def refused(self, worker_id: str, ref: RequestRef, back_off: bool) -> None:
        """The worker did not take the request; ``back_off``: it is busy, send nothing until its next heartbeat."""
        view = self.workers.get(worker_id)
        if view is not None:
            view.sent.pop(ref, None)
            view.backed_off = view.backed_off or back_off

    def holders(self, key: str) -> list[str]:
        return [w for w, v in self.workers.items() if key in v.beat.resident_adapters]
