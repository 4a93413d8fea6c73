"""The batch scheduler by SLO class, on a real BlockManager: admission order, the KV victim, and the
preemption of lower classes for a waiting interactive request (bounded by its delay)."""

import pytest

from services.worker.engine.batch_scheduler import BatchScheduler, SchedulerOutput
from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.kv_cache import BlockManager
from services.worker.engine.sequence import EngineRequest, Sequence
from shared.schemas import SamplingParams, SloClass

BLOCK = 4


class _NullTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


def make(num_blocks: int, max_num_seqs: int = 8, delay: int | None = 2, kv_share: float = 1.0) -> BatchScheduler:
    config = EngineConfig(
        tenant_kv_share=kv_share,
        num_blocks=num_blocks,
        kv_block_size=BLOCK,
        max_num_seqs=max_num_seqs,
        max_model_len=64,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        class_preempt_after_steps=delay,
    )
    return BatchScheduler(config, BlockManager(num_blocks, BLOCK, prefix_caching=False))


_next_token = iter(range(1, 10**9))


def seq(rid: str, prompt: int, slo: SloClass = "standard", max_tokens: int = 40, tenant: str | None = None) -> Sequence:
    ids = [next(_next_token) % 250 + 1 for _ in range(prompt)]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    request = EngineRequest(rid, ids, sampling, slo_class=slo, tenant=tenant)
    return Sequence(request, _NullTokenizer())


def step(scheduler: BatchScheduler) -> SchedulerOutput:
    """One engine step without a model: every scheduled sequence gains a token; done ones finish."""
    out = scheduler.schedule()
    for s in out.decodes + out.prefills:
        s.num_cached = s.num_tokens
        s.token_ids.append(7)
        if s.num_output_tokens >= s.request.sampling.max_tokens:
            scheduler.finish(s)
    scheduler.blocks.commit()
    return out


def ids(seqs: list[Sequence]) -> list[str]:
    return [s.request_id for s in seqs]


def drain(scheduler: BatchScheduler) -> tuple[list[str], list[str]]:
    """Step to the end: (the order of first admissions, every preemption in order)."""
    admitted: list[str] = []
    preempted: list[str] = []
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            return admitted, preempted
        out = step(scheduler)
        admitted += [rid for rid in ids(out.prefills) if rid not in admitted]
        preempted += ids(out.preempted)
    raise AssertionError("the scheduler did not finish")


def test_one_class_is_fcfs_and_the_newest_yields_when_kv_runs_out() -> None:
    scheduler = make(num_blocks=6)
    for rid in "abc":
        scheduler.add(seq(rid, prompt=4, max_tokens=12))
    admitted, preempted = drain(scheduler)
    assert admitted == ["a", "b", "c"]
    assert preempted and preempted[0] == "c"
    assert scheduler.blocks.allocator.num_free == 6


def test_short_slots_admit_interactive_then_standard_then_batch_fcfs_within_a_class() -> None:
    scheduler = make(num_blocks=64, max_num_seqs=1)
    for rid, slo in [("b1", "batch"), ("s1", "standard"), ("i1", "interactive"), ("b2", "batch"),
                     ("i2", "interactive"), ("s2", "standard")]:  # fmt: skip
        scheduler.add(seq(rid, prompt=3, slo=slo, max_tokens=2))
    admitted, preempted = drain(scheduler)
    assert admitted == ["i1", "i2", "s1", "s2", "b1", "b2"]
    assert preempted == []


def test_short_kv_admits_by_class_and_no_batch_slips_past_a_waiting_interactive() -> None:
    scheduler = make(num_blocks=4, delay=None)
    scheduler.add(seq("b0", prompt=5, slo="batch", max_tokens=3))  # 2 of the 4 blocks
    assert ids(step(scheduler).prefills) == ["b0"]
    scheduler.add(seq("b1", prompt=2, slo="batch", max_tokens=2))  # 1 block: it would fit now
    scheduler.add(seq("i1", prompt=9, slo="interactive", max_tokens=2))  # 3 blocks: it waits for b0
    out = step(scheduler)
    assert ids(out.prefills) == [] and ids(out.decodes) == ["b0"]
    admitted, preempted = drain(scheduler)
    assert admitted == ["i1", "b1"] and preempted == []


def test_kv_exhaustion_preempts_the_lowest_class_first_though_it_is_the_oldest() -> None:
    scheduler = make(num_blocks=6)
    scheduler.add(seq("b", prompt=4, slo="batch", max_tokens=12))
    step(scheduler)
    scheduler.add(seq("i", prompt=4, slo="interactive", max_tokens=12))
    scheduler.add(seq("s", prompt=4, slo="standard", max_tokens=12))
    _, preempted = drain(scheduler)
    assert preempted[:2] == ["b", "s"]  # FCFS would take s, the newest, first
    assert "i" not in preempted


@pytest.mark.parametrize("delay", [0, 1, 3])
def test_a_waiting_interactive_preempts_the_newest_batch_once_it_has_waited_its_delay(delay: int) -> None:
    scheduler = make(num_blocks=4, delay=delay)
    for rid in ("b1", "b2"):  # 2 blocks each: the cache is full, with room in their blocks for 3 more tokens
        scheduler.add(seq(rid, prompt=5, slo="batch", max_tokens=12))
    assert ids(step(scheduler).prefills) == ["b1", "b2"]
    scheduler.add(seq("i", prompt=3, slo="interactive", max_tokens=4))
    waited = 0
    while True:
        out = step(scheduler)
        waited += 1
        if out.preempted:
            break
        assert ids(out.decodes) == ["b1", "b2"] and out.prefills == []
    assert waited == max(delay, 1)
    assert ids(out.preempted) == ["b2"] and ids(out.prefills) == ["i"] and ids(out.decodes) == ["b1"]
    admitted, preempted = drain(scheduler)
    assert "b2" in admitted and "i" not in preempted
    assert scheduler.blocks.allocator.num_free == 4


NEVER = [
    ("standard", "standard"),
    ("batch", "batch"),
    ("interactive", "standard"),
    ("interactive", "interactive"),
    ("standard", "batch"),
]


@pytest.mark.parametrize(("running", "waiting"), NEVER)
def test_a_waiting_request_never_preempts_its_own_class_or_a_higher_one(running: SloClass, waiting: SloClass) -> None:
    scheduler = make(num_blocks=4, delay=0)
    for rid in ("r1", "r2"):
        scheduler.add(seq(rid, prompt=5, slo=running, max_tokens=12))
    step(scheduler)
    scheduler.add(seq("w", prompt=3, slo=waiting, max_tokens=4))
    for _ in range(3):  # the running pair has room for 3 more tokens: nothing forces a preemption
        out = step(scheduler)
        assert out.preempted == [] and out.prefills == []


@pytest.mark.parametrize(("prompt", "victims"), [(4, ["b"]), (8, [])])
def test_lower_classes_are_preempted_only_when_their_room_lets_the_waiting_one_in(
    prompt: int, victims: list[str]
) -> None:
    scheduler = make(num_blocks=4, delay=0)
    scheduler.add(seq("i0", prompt=9, slo="interactive", max_tokens=3))  # 3 blocks
    scheduler.add(seq("b", prompt=1, slo="batch", max_tokens=3))  # 1 block
    step(scheduler)
    scheduler.add(seq("i1", prompt=prompt, slo="interactive", max_tokens=2))  # 1 (+1 to grow) or 2 blocks
    out = step(scheduler)
    assert ids(out.preempted) == victims
    assert ids(out.prefills) == (["i1"] if victims else [])


def test_without_a_delay_setting_a_waiting_interactive_never_preempts() -> None:
    scheduler = make(num_blocks=4, delay=None)
    for rid in ("b1", "b2"):
        scheduler.add(seq(rid, prompt=5, slo="batch", max_tokens=12))
    step(scheduler)
    scheduler.add(seq("i", prompt=3, slo="interactive", max_tokens=4))
    for _ in range(3):
        out = step(scheduler)
        assert out.preempted == [] and out.prefills == []
    out = step(scheduler)  # now KV runs out mid-generation: the newest batch yields and i is next
    assert ids(out.preempted) == ["b2"]
    admitted, _ = drain(scheduler)
    assert admitted[0] == "i"


def tenants_seqs(scheduler: BatchScheduler, plan: str) -> None:
    """``plan``: one letter per request, its tenant; each takes 2 blocks (5 prompt tokens, 3 more)."""
    for i, tenant in enumerate(plan):
        scheduler.add(seq(f"{tenant}{i}", prompt=5, max_tokens=3, tenant=tenant))


def test_a_tenant_past_its_kv_share_waits_while_another_tenants_request_waits() -> None:
    """Issue 47: one tenant's burst used to take every KV block, queueing the others behind it."""
    scheduler = make(num_blocks=6, kv_share=0.5)  # a share of 3 blocks: one 2-block request each while both wait
    tenants_seqs(scheduler, "aaab")
    assert ids(step(scheduler).prefills) == ["a0", "b3"]
    held = {s.request.tenant: len(s.block_table) for s in scheduler.running}
    assert held == {"a": 2, "b": 2}
    admitted, preempted = drain(scheduler)
    assert admitted == ["a1", "a2"] and preempted == []  # nobody starves: a's rest run once b has nothing waiting
    assert scheduler.blocks.allocator.num_free == 6


def test_the_kv_share_binds_only_while_another_tenant_waits() -> None:
    scheduler = make(num_blocks=6, kv_share=0.5)
    tenants_seqs(scheduler, "aaa")
    assert ids(step(scheduler).prefills) == ["a0", "a1", "a2"]  # alone, a tenant may use every block


def test_a_tenant_with_nothing_running_is_admitted_past_its_share() -> None:
    scheduler = make(num_blocks=8, kv_share=0.25)  # a share of 2 blocks
    scheduler.add(seq("a-big", prompt=11, max_tokens=1, tenant="a"))  # 3 blocks
    scheduler.add(seq("b-big", prompt=11, max_tokens=1, tenant="b"))
    assert ids(step(scheduler).prefills) == ["a-big", "b-big"]


def test_without_a_share_one_tenant_takes_every_block_first() -> None:
    scheduler = make(num_blocks=6, kv_share=1.0)
    tenants_seqs(scheduler, "aaab")
    assert ids(step(scheduler).prefills) == ["a0", "a1", "a2"]


@pytest.mark.parametrize("delay", [1, 2])  # a's run 3 steps: a longer delay lets them finish first
def test_a_tenant_grown_past_its_kv_share_yields_its_newest_to_another_tenants_request(delay: int) -> None:
    scheduler = make(num_blocks=6, delay=delay, kv_share=0.5)
    tenants_seqs(scheduler, "aaa")
    assert ids(step(scheduler).prefills) == ["a0", "a1", "a2"]  # alone: every block
    scheduler.add(seq("b", prompt=5, max_tokens=3, tenant="b"))
    waited = 0
    while not (out := step(scheduler)).preempted:
        waited += 1
        assert out.prefills == []
    assert waited == delay - 1
    assert ids(out.preempted) == ["a2"] and ids(out.prefills) == ["b"]
    admitted, preempted = drain(scheduler)
    assert admitted == ["a2"] and preempted == []


def test_the_kv_share_never_preempts_a_higher_class_for_a_lower_one() -> None:
    scheduler = make(num_blocks=6, delay=1, kv_share=0.5)
    for i in range(3):
        scheduler.add(seq(f"a{i}", prompt=5, slo="interactive", max_tokens=3, tenant="a"))
    step(scheduler)
    scheduler.add(seq("b", prompt=5, slo="batch", max_tokens=3, tenant="b"))
    assert not step(scheduler).preempted and not step(scheduler).preempted
