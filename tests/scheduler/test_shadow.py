"""Shadow evaluation in the scheduler: which production requests are marked, what the canary's
shadow run is, and that the dispatcher runs it off the client's path, charged to no one."""

import asyncio
import time

import pytest

from services.scheduler.dispatcher import Ports
from services.scheduler.service import build
from services.scheduler.settings import SchedulerSettings
from services.scheduler.shadow import ShadowPolicy, mark, shadow_id, shadow_of
from shared import subjects
from shared.catalog.records import Catalog
from shared.catalog.resolve import resolve, to_resolved
from shared.catalog.rollout import in_canary, split_key
from shared.catalog.view import CatalogView
from shared.errors import InvalidRequest, LorafleetError
from shared.redis_conn import connect_redis
from shared.schemas import CompletionAudit, DispatchReply, InferRequest, ResolveReply, ResolveRequest, WorkerHeartbeat
from tests.helpers.records import make_record

BASE = "tiny-llama"
PROD = make_record("acme-sum", 1, "acme", status="production", traffic_percent=100)
CANARY = make_record("acme-sum", 2, "acme", status="canary", traffic_percent=10)
POLICY = ShadowPolicy(sample=1.0, max_tokens=16, max_inflight=4)


def production_key() -> str:
    return next(f"u{i}" for i in range(1000) if not in_canary("acme-sum", split_key("acme", f"u{i}"), 10))


def request(rid: str = "r1", temperature: float = 0.0, adapter=PROD, **over) -> InferRequest:
    fields = {
        "request_id": rid,
        "tenant_id": "acme",
        "model": "acme-sum",
        "request_key": production_key(),
        "base_model": BASE,
        "prompt": "hello",
        "reply_to": "_INBOX.client",
        "sampling": {"max_tokens": 40, "temperature": temperature},
        "adapter": to_resolved(adapter),
        "metadata": {"team": "x"},
    }
    return InferRequest(**{**fields, **over})


def test_only_greedy_production_requests_with_a_canary_out_are_marked() -> None:
    catalog = Catalog([PROD, CANARY])
    assert mark(request(), catalog, POLICY).compare_tokens == 16
    assert mark(request(preview=True), catalog, POLICY).compare_tokens == 16  # an admin's, served by production
    assert mark(request(temperature=0.7), catalog, POLICY).compare_tokens is None  # sampled: not comparable
    assert mark(request(adapter=CANARY), catalog, POLICY).compare_tokens is None  # served by the canary itself
    assert mark(request(), Catalog([PROD]), POLICY).compare_tokens is None  # no canary out
    assert mark(request(), catalog, ShadowPolicy(0.0, 16, 4)).compare_tokens is None


def test_the_sample_share_is_about_the_setting_and_stable_per_request() -> None:
    catalog = Catalog([PROD, CANARY])
    policy = ShadowPolicy(0.05, 16, 4)
    marked = [mark(request(f"r{i}"), catalog, policy).compare_tokens is not None for i in range(4000)]
    assert 120 <= sum(marked) <= 280  # 5% of 4000 = 200, far inside a binomial bound
    assert marked[:50] == [mark(request(f"r{i}"), catalog, policy).compare_tokens is not None for i in range(50)]


def test_the_shadow_run_is_the_canary_pinned_greedy_capped_batch_and_answered_to_no_one() -> None:
    catalog = Catalog([PROD, CANARY])
    marked = mark(request(), catalog, POLICY)
    shadow = shadow_of(marked, catalog, 30.0)
    assert shadow is not None
    assert shadow.request_id == shadow_id("r1") != "r1" and shadow.shadow_of == "r1"
    assert shadow.model == "acme-sum@2" and shadow.adapter == to_resolved(CANARY)
    assert shadow.sampling.max_tokens == 16 and shadow.sampling.temperature == 0
    assert shadow.priority == "batch" and shadow.ttft_target_s == 30.0
    assert shadow.reply_to != marked.reply_to and not shadow.stream
    assert shadow.metadata == {} and shadow.tenant_id == "acme" and shadow.prompt == "hello"
    assert shadow.compare_tokens == 16
    assert shadow_of(request(), catalog, 30.0) is None  # not marked
    assert shadow_of(shadow, catalog, 30.0) is None  # a shadow is never shadowed
    assert shadow_of(marked, Catalog([PROD]), 30.0) is None  # the canary is gone


class Handle:
    headers = None

    def __init__(self) -> None:
        self.acts: list[str] = []

    async def ack(self) -> None:
        self.acts.append("ack")

    async def term(self) -> None:
        self.acts.append("term")

    async def nak(self, delay: float | None = None) -> None:
        self.acts.append("nak")

    async def in_progress(self) -> None:
        return None


class World:
    """A real Dispatcher on a real Redis, its catalog holding a rollout, one fake worker."""

    def __init__(self, redis, refuse_shadows: LorafleetError | None = None) -> None:
        self.dispatched: list[InferRequest] = []
        self.rejections: list[str] = []

        async def registry(req: ResolveRequest) -> ResolveReply:
            return resolve(Catalog([PROD, CANARY]), BASE, req.tenant_id, req.model, req.request_key, req.preview)

        view = CatalogView(registry)
        for revision, record in enumerate((PROD, CANARY), start=1):
            view.apply(f"{record.adapter_id}.{record.version}", record.model_dump_json().encode(), revision)
        view.mark_loaded()
        view.base_model = BASE

        async def dispatch(worker_id: str, req: InferRequest, headers) -> DispatchReply:
            self.dispatched.append(req)
            if req.shadow_of is not None and refuse_shadows is not None:
                return DispatchReply(accepted=False, worker_id=worker_id, error=refuse_shadows.to_body())
            return DispatchReply(accepted=True, worker_id=worker_id)

        async def record_rejection(tenant: str, rid: str, err: LorafleetError) -> None:
            self.rejections.append(rid)

        async def nothing(*_) -> None:
            return None

        settings = SchedulerSettings(
            capacity_headroom=0,
            redis_key_prefix=f"s{time.monotonic_ns()}:",
            shadow_sample=1.0,
            shadow_max_tokens=16,
            default_quota={"tokens_per_min": 1000},
        )
        self.core, _ = build(settings, Ports(dispatch, nothing, record_rejection, nothing, view), redis)
        self.core.fleet.heartbeat(
            WorkerHeartbeat(
                worker_id="w1",
                base_model=BASE,
                ready=True,
                running=0,
                waiting=0,
                max_running=8,
                kv_blocks_free=10,
                kv_blocks_total=10,
                ts=time.time(),
            )
        )

    async def submit(self, req: InferRequest) -> Handle:
        handle = Handle()
        data = req.model_dump_json().encode()
        await self.core.submit(subjects.infer_submit("acme", subjects.VIA_GATEWAY), data, handle, 1)
        while self.core.tasks:  # the production dispatch, then the shadow's it queues
            await asyncio.wait(list(self.core.tasks))
        return handle

    async def finish(self, rid: str, tokens: int) -> None:
        entry = next(e for ref, e in self.core.inflight.items() if ref.request_id == rid)
        await self.core.completed(
            CompletionAudit(
                request_id=rid,
                tenant_id="acme",
                base_model=BASE,
                cache_hit=True,
                ttft_ms=1,
                tpot_ms=1,
                prompt_tokens=2,
                completion_tokens=tokens,
                worker_id=entry.worker_id,
                outcome="length",
                shadow_of=entry.request.shadow_of,
            )
        )


@pytest.fixture
async def redis(redis_url):
    client = connect_redis(redis_url)
    yield client
    await client.aclose()


async def test_a_marked_request_is_served_first_and_its_shadow_is_charged_to_no_one(redis) -> None:
    world = World(redis)
    # a client's own compare_tokens and shadow_of are never taken: the scheduler sets them
    forged = request(temperature=0.7, compare_tokens=1, shadow_of="someone-else", adapter=PROD)
    await world.submit(forged.model_copy(update={"request_id": "forged", "adapter": None}))
    assert [(r.request_id, r.compare_tokens, r.shadow_of) for r in world.dispatched] == [("forged", None, None)]

    handle = await world.submit(request("r1", adapter=PROD).model_copy(update={"adapter": None}))
    production, shadow = world.dispatched[1:]
    assert handle.acts == ["ack"]
    assert production.request_id == "r1" and production.compare_tokens == 16 and production.shadow_of is None
    assert production.adapter == to_resolved(PROD) and production.reply_to == "_INBOX.client"
    assert shadow.shadow_of == "r1" and shadow.adapter == to_resolved(CANARY) and shadow.priority == "batch"
    grants = {ref.request_id: e.grant for ref, e in world.core.inflight.items()}
    assert grants[shadow.request_id] is None and grants["r1"] is not None
    fair_share = world.core.queue.counters["acme"]
    await world.finish(shadow.request_id, tokens=16)
    assert shadow.request_id not in {ref.request_id for ref in world.core.inflight}
    assert world.core.queue.counters["acme"] == fair_share  # its tokens are no tenant's
    await world.finish("r1", tokens=8)
    assert world.core.queue.counters["acme"] != fair_share  # production's are corrected to what it used
    await world.finish("forged", tokens=8)
    assert not world.core.inflight and world.rejections == []


async def test_a_refused_shadow_is_dropped_without_answering_or_auditing_the_tenant(redis) -> None:
    world = World(redis, refuse_shadows=InvalidRequest("no"))
    await world.submit(request("r2").model_copy(update={"adapter": None}))
    assert [r.shadow_of for r in world.dispatched] == [None, "r2"]
    assert world.rejections == [] and not world.core.held
