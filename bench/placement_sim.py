"""The fleet placement simulator behind ``bench.placement_scale``: a discrete-event model driving the
scheduler's real ``Fleet.choose`` (rank pools included), ``FairQueue`` and ``LoadShedder``, and each
worker's real ``SlotTier`` with the heat eviction policy fed by the scheduler's ``DecayedRate``. The
model (defaults):

- Fleet: 100 workers of 8 running requests (the scheduler may send 2 more, which wait on the worker:
  ``capacity_headroom``), 16 GPU slots per rank class 8/16/32/64. Each worker sends a heartbeat every
  second (staggered); between heartbeats the scheduler knows only its own dispatches and completions.
- Adapters: 10,000, rank 8/16/32/64 for 40/30/20/10% of them (drawn at random, independent of
  popularity), zipf(1.1) popularity. A GPU miss loads the adapter in 0.25 s.
- Requests: 100,000 per run (1,000,000 with ``--requests 1000000``: see Cost), Poisson arrivals at 0.9x and 1.2x the fleet's nominal capacity; 100 tenants, of tier
  interactive/standard/batch for 20/50/30% of them, each request in its tenant's tier; 64 prompt
  tokens, 32..128 output tokens (uniform).
- Service: every running request on a worker makes one token per engine step, and a step takes
  ``20 ms + 0.4 ms x the highest rank in the batch`` (a rank-64 adapter makes every request of its
  batch ~2x slower than rank 8 alone). TTFT = scheduler queue + worker queue + adapter load on a miss
  + one step.
- Policies: ``fcfs`` = one FIFO in front of today's affinity placement, no classes, no shedding;
  ``class_aware`` = the real ``FairQueue`` (three classes, VTC per tenant, default TTFT targets
  2/8/60 s) and ``LoadShedder`` at admission; ``class_aware_pools`` = the same with the first 10% of
  the workers declaring rank class 64 as their pool (``WorkerHeartbeat.rank_pool``).

Capacity: ``workers x max_running / (mean output tokens x step at the expected highest rank of a
full batch + 0.3 x load)``. The scheduler queue holds every admitted request (``max_inflight`` large
enough that its intake never holds any back). Every simulated worker serves every rank, so
``Fleet.choose`` finds a worker for any request exactly when one has room (``Fleet.has_room``), which
is asked again of a worker only when the fleet's view of it changes.

Cost: nearly all of it is the scheduler's own code. ``Fleet.choose`` over 100 workers takes ~0.5 ms
of one core per dispatch (94% of a 0.9x run's profile), and under overload ``FairQueue.pop`` and
``ahead_of``, both linear in the queue, add ~1 ms over the shed-bounded queue. The six runs of 40,000
requests took 252 s of CPU (shared machine), so 100,000 take ~11 minutes and 1,000,000 ~2 hours.
"""

import heapq
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from services.scheduler.fairness import FairQueue
from services.scheduler.placement import Fleet
from services.scheduler.shedding import LoadShedder
from services.worker.adapter_cache.cache_config import CacheConfig
from services.worker.adapter_cache.policy import Entry, make_policy
from services.worker.adapter_cache.slot_tier import SlotTier
from shared.config import SloTargets
from shared.decay import DecayedRate
from shared.errors import Overloaded
from shared.request_ref import RequestRef
from shared.schemas import SLO_CLASSES, InferRequest, ResolvedAdapter, SloClass, WorkerHeartbeat

RANKS = (8, 16, 32, 64)
RANK_MIX = (0.4, 0.3, 0.2, 0.1)  # share of adapters of each rank
TIER_MIX = {"interactive": 0.2, "standard": 0.5, "batch": 0.3}  # share of tenants of each tier
POLICIES = ("fcfs", "class_aware", "class_aware_pools")
STEP_BASE_S, STEP_PER_RANK_S = 0.020, 0.0004
LOAD_S, HEADROOM, HEARTBEAT_S, HEAT_S = 0.25, 2, 1.0, 5.0
PROMPT_TOKENS, OUTPUT_TOKENS = 64, (32, 128)


@dataclass(frozen=True, slots=True)
class Scale:
    workers: int = 100
    adapters: int = 10_000
    requests: int = 100_000
    tenants: int = 100
    max_running: int = 8
    slots_per_class: int = 16
    pool_share: float = 0.1
    loads: tuple[float, ...] = (0.9, 1.2)
    seed: int = 0


def step_s(max_rank: int) -> float:
    return STEP_BASE_S + STEP_PER_RANK_S * max_rank


@dataclass
class Trace:
    adapters: np.ndarray  # [requests] adapter index
    tenants: np.ndarray  # [requests] tenant index
    tokens: np.ndarray  # [requests] output tokens
    gaps: np.ndarray  # [requests] exponential inter-arrival gaps at rate 1
    ranks: np.ndarray  # [adapters] rank
    tiers: list[SloClass]  # tenant index -> tier

    @classmethod
    def draw(cls, scale: Scale) -> "Trace":
        rng = np.random.default_rng(scale.seed)
        weights = 1.0 / np.arange(1, scale.adapters + 1) ** 1.1
        ranks = rng.choice(RANKS, size=scale.adapters, p=RANK_MIX)
        cuts = np.cumsum([TIER_MIX[c] for c in SLO_CLASSES]) * scale.tenants
        tiers = [SLO_CLASSES[int(np.searchsorted(cuts, t, side="right"))] for t in range(scale.tenants)]
        return cls(
            adapters=rng.choice(scale.adapters, size=scale.requests, p=weights / weights.sum()),
            tenants=rng.integers(0, scale.tenants, size=scale.requests),
            tokens=rng.integers(OUTPUT_TOKENS[0], OUTPUT_TOKENS[1] + 1, size=scale.requests),
            gaps=rng.exponential(1.0, size=scale.requests),
            ranks=ranks,
            tiers=tiers,
        )

    def capacity(self, scale: Scale) -> float:
        """Nominal requests/s of the fleet: full batches at the expected highest rank of their mix."""
        traffic = np.bincount(self.adapters, minlength=len(self.ranks))
        share = np.array([traffic[self.ranks == r].sum() for r in RANKS]) / len(self.adapters)
        below = np.cumsum(share)  # P(rank <= r) per request
        p_max = np.diff(np.concatenate([[0.0], below**scale.max_running]))
        expected_step = sum(p * step_s(r) for p, r in zip(p_max, RANKS, strict=True))
        service = float(self.tokens.mean()) * expected_step + 0.3 * LOAD_S
        return scale.workers * scale.max_running / service


@dataclass(slots=True, eq=False)
class Item:
    """One queued request, as the fair queue sees it."""

    index: int
    tenant: str
    priority: SloClass
    request_id: str
    enqueued: float
    request: InferRequest


@dataclass(eq=False)
class Worker:
    worker_id: str
    slots: SlotTier
    max_running: int
    pool: list[int]
    running: int = 0  # holding a running slot: loading or in the batch
    waiting: deque[Item] = field(default_factory=deque)
    loading: dict[str, list[Item]] = field(default_factory=dict)  # adapter key -> requests waiting for its load
    in_use: Counter[str] = field(default_factory=Counter)
    batch_ranks: Counter[int] = field(default_factory=Counter)
    finishes: list[tuple[float, int, Item]] = field(default_factory=list)  # (token clock at end, index, item)
    clock: float = 0.0  # tokens every batch member has made since the start
    clock_at: float = 0.0
    step: float = STEP_BASE_S
    version: int = 0  # of the next-finish event in the heap
    hits: int = 0
    misses: int = 0

    def beat(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            base_model="base",
            ready=True,
            running=self.running,
            waiting=len(self.waiting),
            max_running=self.max_running,
            kv_blocks_free=1000,
            kv_blocks_total=1000,
            resident_adapters=self.slots.keys(),
            slots={str(r): [self.slots.used(r), n] for r, n in self.slots.slots.items()},
            rank_pool=self.pool,
        )

    def advance(self, now: float) -> None:
        if self.batch_ranks:
            self.clock += (now - self.clock_at) / self.step
        self.clock_at = now

    def restep(self) -> None:
        self.step = step_s(max(self.batch_ranks)) if self.batch_ranks else STEP_BASE_S

    def next_finish(self, now: float) -> float | None:
        if not self.finishes:
            return None
        return now + max(0.0, self.finishes[0][0] - self.clock) * self.step


@dataclass
class Outcome:
    ttft: np.ndarray  # [requests] seconds; nan: shed
    served_by: np.ndarray  # [requests] 0 none, 1 gpu hit, 2 miss


class Simulation:
    """One policy over one trace at one arrival rate."""

    def __init__(self, scale: Scale, trace: Trace, policy: str, rate: float):
        self.scale, self.trace, self.policy = scale, trace, policy
        config = CacheConfig()
        pools = round(scale.workers * scale.pool_share) if policy == "class_aware_pools" else 0
        self.workers = [
            Worker(
                f"w{i:03d}",
                SlotTier(dict.fromkeys(RANKS, scale.slots_per_class), make_policy("heat", config)),
                scale.max_running,
                [RANKS[-1]] if i < pools else [],
            )
            for i in range(scale.workers)
        ]
        self.by_id = {w.worker_id: w for w in self.workers}
        self.fleet = Fleet(timeout_s=1e9, headroom=HEADROOM)
        self.targets = SloTargets()
        self.fair: FairQueue[Item] = FairQueue(targets_s={c: self.targets.of(c) for c in SLO_CLASSES})
        self.fifo: deque[Item] = deque()
        self.shedder = LoadShedder(self.targets, enabled=policy != "fcfs")
        self.heat = DecayedRate(config.half_life_s)
        self.arrivals = np.cumsum(trace.gaps / rate)
        self.templates = [self._template(a) for a in range(scale.adapters)]
        n = scale.requests
        self.outcome = Outcome(np.full(n, np.nan), np.zeros(n, dtype=np.int8))
        self.dispatched_at = np.zeros(n)
        self.worker_ttft = np.zeros(n)
        self.refs: dict[int, RequestRef] = {}
        self.inflight = 0
        self.with_room: set[str] = set()  # workers the fleet gives room to, as of their last change
        self.spills = 0
        self.placed: Counter[tuple[int, bool]] = Counter()  # (rank, on a pool worker) -> dispatches
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0

    def _template(self, adapter: int) -> InferRequest:
        resolved = ResolvedAdapter(
            adapter_id=f"adapter-{adapter:05d}",
            version=1,
            rank=int(self.trace.ranks[adapter]),
            digest="0" * 64,
            storage_uri="x",
            alpha=16,
        )
        return InferRequest(
            request_id="r",
            tenant_id="t",
            model="m",
            base_model="base",
            prompt="p",
            reply_to="_INBOX.x",
            adapter=resolved,
        )

    def push(self, at: float, kind: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    def run(self) -> Outcome:
        for i, w in enumerate(self.workers):
            self.fleet.heartbeat(w.beat(), 0.0)
            self.review(w.worker_id)
            self.push(HEARTBEAT_S * (i + 1) / len(self.workers), BEAT, w)
        self.push(0.0, HEAT, None)
        self.push(float(self.arrivals[0]), ARRIVE, 0)
        handlers: dict[int, Callable[[float, object], None]] = {
            ARRIVE: self.on_arrive,
            LOADED: self.on_loaded,
            FINISH: self.on_finish,
            BEAT: self.on_beat,
            HEAT: self.on_heat,
        }
        self.pending = self.scale.requests
        while self.pending:
            now, _, kind, payload = heapq.heappop(self.events)
            handlers[kind](now, payload)
        return self.outcome

    # -- scheduler side

    def on_arrive(self, now: float, index: object) -> None:
        assert isinstance(index, int)
        if index + 1 < self.scale.requests:
            self.push(float(self.arrivals[index + 1]), ARRIVE, index + 1)
        adapter, tenant = int(self.trace.adapters[index]), int(self.trace.tenants[index])
        request = self.templates[adapter]
        assert request.adapter is not None
        self.heat.bump(f"{request.adapter.adapter_id}@1", now)
        item = Item(index, f"t{tenant}", self.trace.tiers[tenant], f"r{index}", now, request)
        if self.policy == "fcfs":
            self.fifo.append(item)
        else:
            free = self.free_sequences()
            try:
                self.shedder.check(item.priority, self.fair.ahead_of(item.priority, now), free, self.inflight, now)
            except Overloaded:
                self.pending -= 1
                return
            self.shedder.admitted(item.priority, now)
            self.fair.push(item)
        self.pump(now)

    def has_room(self, item: Item) -> bool:
        """Whether ``Fleet.choose`` would find a worker for ``item``: one that fits it and has room.
        Every simulated worker serves every rank, so a worker's room is the same for every request
        and changes only with the fleet's view of it (a dispatch, a completion, its heartbeat): each
        worker's is asked of the fleet again only then (``review``)."""
        return bool(self.with_room)

    def free_sequences(self) -> int:
        """``Fleet.free_sequences`` for any request (every simulated worker serves every rank), over
        the workers with room only: the others have none."""
        workers, headroom = self.fleet.workers, self.fleet.headroom
        return sum(max(0, workers[w].beat.max_running + headroom - workers[w].load) for w in self.with_room)

    def review(self, worker_id: str) -> None:
        fleet, view = self.fleet, self.fleet.workers[worker_id]
        if fleet._fits(view, self.templates[0]) and fleet.has_room(view):
            self.with_room.add(worker_id)
        else:
            self.with_room.discard(worker_id)

    def pump(self, now: float) -> None:
        if self.policy == "fcfs":
            while self.fifo and self.has_room(self.fifo[0]):
                self.dispatch(self.fifo.popleft(), now)
            return
        # a worker with room places any request (see has_room): the queue's order alone picks it
        while len(self.fair) and self.has_room(next(iter(self.fair))):
            item = self.fair.pop(now, lambda _: True)
            assert item is not None
            self.dispatch(item, now)

    def dispatch(self, item: Item, now: float) -> None:
        chosen = self.fleet.choose(item.request, now=now)
        assert chosen is not None, "dispatched only when a worker has room"
        if self.policy == "class_aware_pools" and self.fleet.spilled_from(item.request, chosen) is not None:
            self.spills += 1
        assert item.request.adapter is not None
        self.placed[item.request.adapter.rank, bool(self.by_id[chosen].pool)] += 1
        request = item.request.model_copy(update={"request_id": item.request_id, "tenant_id": item.tenant})
        self.refs[item.index] = RequestRef.of(request)
        self.fleet.sent(chosen, request, now)
        self.fleet.accepted(chosen)
        self.fair.charge(item.tenant, PROMPT_TOKENS, float(self.trace.tokens[item.index]))
        self.inflight += 1
        self.review(chosen)
        self.dispatched_at[item.index] = now
        self.by_id[chosen].waiting.append(item)
        self.start_waiting(self.by_id[chosen], now)

    def completed(self, worker: Worker, item: Item, now: float) -> None:
        self.fleet.ended(worker.worker_id, self.refs.pop(item.index))
        self.shedder.ended(now - self.dispatched_at[item.index], self.worker_ttft[item.index])
        self.inflight -= 1
        self.pending -= 1
        self.review(worker.worker_id)

    def on_beat(self, now: float, worker: object) -> None:
        assert isinstance(worker, Worker)
        self.fleet.heartbeat(worker.beat(), now)
        self.review(worker.worker_id)
        self.push(now + HEARTBEAT_S, BEAT, worker)
        self.pump(now)

    def on_heat(self, now: float, _: object) -> None:
        snapshot = self.heat.snapshot(now)
        for w in self.workers:
            w.slots.policy.update_heat(snapshot)
        self.push(now + HEAT_S, HEAT, None)

    # -- worker side

    def start_waiting(self, w: Worker, now: float) -> None:
        while w.waiting and w.running < w.max_running:
            item = w.waiting.popleft()
            w.running += 1
            key = f"{item.request.adapter.adapter_id}@1" if item.request.adapter else ""
            w.slots.policy.touch(key, now)
            w.in_use[key] += 1
            if key in w.slots:
                w.hits += 1
                self.outcome.served_by[item.index] = 1
                self.join(w, item, now)
                continue
            w.misses += 1
            self.outcome.served_by[item.index] = 2
            if key in w.loading:
                w.loading[key].append(item)
                continue
            self.begin_load(w, key, item, now)

    def begin_load(self, w: Worker, key: str, item: Item, now: float) -> None:
        assert item.request.adapter is not None
        rank = item.request.adapter.rank
        rank_class = w.slots.class_of(rank)
        if w.slots.free(rank_class) == 0:
            victim = w.slots.victim(Entry(key, rank), now, protected=lambda k: w.in_use[k] > 0)
            assert victim is not None, "a class holds more slots than a worker runs requests"
            w.slots.remove(victim.key)
        w.slots.reserve(rank_class)
        w.loading[key] = [item]
        self.push(now + LOAD_S, LOADED, (w, key, rank))

    def on_loaded(self, now: float, payload: object) -> None:
        w, key, rank = cast(tuple[Worker, str, int], payload)
        w.slots.commit(Entry(key, rank))
        for item in w.loading.pop(key):
            self.join(w, item, now)

    def join(self, w: Worker, item: Item, now: float) -> None:
        """The request enters the worker's batch: its first token comes after one step."""
        assert item.request.adapter is not None
        w.advance(now)
        w.batch_ranks[item.request.adapter.rank] += 1
        w.restep()
        first = now + w.step
        self.outcome.ttft[item.index] = first - item.enqueued
        self.worker_ttft[item.index] = first - self.dispatched_at[item.index]
        heapq.heappush(w.finishes, (w.clock + float(self.trace.tokens[item.index]), item.index, item))
        self.reschedule(w, now)

    def reschedule(self, w: Worker, now: float) -> None:
        w.version += 1
        at = w.next_finish(now)
        if at is not None:
            self.push(at, FINISH, (w, w.version))

    def on_finish(self, now: float, payload: object) -> None:
        w, version = cast(tuple[Worker, int], payload)
        if version != w.version:
            return
        w.advance(now)
        while w.finishes and w.finishes[0][0] <= w.clock + 1e-9:
            _, _, item = heapq.heappop(w.finishes)
            assert item.request.adapter is not None
            rank = item.request.adapter.rank
            w.batch_ranks[rank] -= 1
            if not w.batch_ranks[rank]:
                del w.batch_ranks[rank]
            key = f"{item.request.adapter.adapter_id}@1"
            w.in_use[key] -= 1
            w.running -= 1
            self.completed(w, item, now)
        w.restep()
        self.start_waiting(w, now)
        self.reschedule(w, now)
        self.pump(now)


ARRIVE, LOADED, FINISH, BEAT, HEAT = range(5)
