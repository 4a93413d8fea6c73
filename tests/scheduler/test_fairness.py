from dataclasses import dataclass, field
from itertools import count

from services.scheduler.fairness import FairQueue

_ids = count()


@dataclass(eq=False)
class Item:
    tenant: str
    priority: str = "interactive"
    enqueued: float = 0.0
    request_id: str = field(default_factory=lambda: f"r{next(_ids)}")


def drain(queue: FairQueue, served_tokens: dict[str, int], n: int, now: float = 0.0) -> list[str]:
    order = []
    for _ in range(n):
        item = queue.pop(now, lambda _: True)
        if item is None:
            break
        queue.charge(item.tenant, 0, served_tokens[item.tenant])
        order.append(item.tenant)
    return order


def test_lowest_counter_is_served_first_so_a_flood_does_not_starve_a_quiet_tenant():
    queue = FairQueue(input_weight=1, output_weight=1)
    for _ in range(40):
        queue.push(Item("flood"))
    for _ in range(5):
        queue.push(Item("quiet"))
    order = drain(queue, {"flood": 100, "quiet": 100}, 10)
    assert order.count("quiet") == 5  # equal token cost: they alternate until quiet runs dry
    assert order[:10:2] == ["flood"] * 5 or order[1:10:2] == ["flood"] * 5


def test_service_is_shared_in_tokens_not_requests():
    queue = FairQueue(input_weight=1, output_weight=1)
    for _ in range(30):
        queue.push(Item("big"))
        queue.push(Item("small"))
    order = drain(queue, {"big": 400, "small": 100}, 25)
    assert order.count("small") == 4 * order.count("big")


def test_returning_tenant_is_lifted_to_the_active_minimum_not_credited_for_idling():
    queue = FairQueue(input_weight=1, output_weight=1)
    for _ in range(20):
        queue.push(Item("busy"))
    drain(queue, {"busy": 100}, 10)
    assert queue.counters["busy"] == 1000
    queue.push(Item("late"))
    assert queue.counters["late"] == 1000  # starts level with the active tenant, not at zero
    for _ in range(4):
        queue.push(Item("late"))
    order = drain(queue, {"busy": 100, "late": 100}, 6)
    assert order.count("late") == 3 and order.count("busy") == 3


def test_interactive_goes_before_batch_until_batch_waits_past_its_slo():
    queue = FairQueue(input_weight=1, output_weight=1, targets_s={"interactive": 2, "standard": 8, "batch": 30})
    old_batch = Item("b", priority="batch", enqueued=0.0)
    queue.push(old_batch)
    queue.push(Item("i", priority="interactive", enqueued=5.0))
    assert queue.pop(10.0, lambda _: True).tenant == "i"
    queue.push(Item("i", priority="interactive", enqueued=35.0))
    assert queue.pop(40.0, lambda _: True) is old_batch


def test_three_classes_go_in_order_whatever_the_counters_and_count_what_goes_ahead():
    queue = FairQueue(input_weight=1, output_weight=1, targets_s={"interactive": 2, "standard": 8, "batch": 30})
    queue.charge("i", 0, 10_000)  # the interactive tenant has used far more: class still comes first
    batch, standard, interactive = Item("b", "batch", 1.0), Item("s", "standard", 1.0), Item("i", "interactive", 1.0)
    for item in (batch, standard, interactive):
        queue.push(item)
    assert [queue.ahead_of(c, 2.0) for c in ("interactive", "standard", "batch")] == [1, 2, 3]
    assert queue.ahead_of("interactive", 9.5) == 2  # the standard one waited past 8 s: it ranks as interactive
    assert [queue.pop(2.0, lambda _: True) for _ in range(3)] == [interactive, standard, batch]


def test_a_request_no_worker_can_take_does_not_block_others():
    queue = FairQueue()
    stuck, free = Item("a"), Item("b")
    queue.push(stuck)
    queue.push(free)
    assert queue.pop(0, lambda item: item is not stuck) is free
    assert queue.pop(0, lambda item: item is not stuck) is None
    assert queue.remove((stuck.tenant, stuck.request_id)) is stuck and len(queue) == 0


def test_put_back_keeps_its_turn():
    queue = FairQueue()
    first, second = Item("a"), Item("a")
    queue.push(first)
    queue.push(second)
    assert queue.pop(0, lambda _: True) is first
    queue.push(first, front=True)
    assert queue.pop(0, lambda _: True) is first
