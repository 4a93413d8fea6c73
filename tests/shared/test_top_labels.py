"""Per-adapter metric labels: the top N adapters by traffic keep their own series, the rest read
``other``; an adapter that falls out of the top has its series removed, one that climbs in gets one."""

from prometheus_client import CollectorRegistry, Counter, generate_latest

from shared.metrics import TopLabels


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def series(registry: CollectorRegistry) -> set[str]:
    text = generate_latest(registry).decode()
    return {line.split('adapter="')[1].split('"')[0] for line in text.splitlines() if line.startswith("tokens_total{")}


def test_the_top_adapters_by_traffic_keep_their_series_and_the_rest_read_other():
    registry = CollectorRegistry()
    tokens = Counter("tokens", "t", ["adapter"], registry=registry)
    clock = Clock()
    labels = TopLabels(2, (tokens,), half_life_s=10.0, rerank_s=5.0, clock=clock)
    for name in ("early-a", "early-b", "late-hot"):
        tokens.labels(labels(name)).inc()
    assert series(registry) == {"early-a", "early-b", "other"}  # the first two fill the top
    for _ in range(30):  # late-hot takes the traffic; early-a still gets some
        clock.now += 0.2
        tokens.labels(labels("late-hot")).inc()
        tokens.labels(labels("early-a")).inc()
    assert labels.top() == {"early-a", "late-hot"}  # re-ranked at 5 s
    assert series(registry) == {"early-a", "late-hot", "other"}  # early-b's series is gone
    assert labels("early-b") == "other"


def test_nothing_is_reranked_before_its_period():
    clock = Clock()
    labels = TopLabels(1, half_life_s=10.0, rerank_s=60.0, clock=clock)
    assert labels("first") == "first"
    for _ in range(50):
        clock.now += 1
        assert labels("busy") == "other"
    clock.now += 10
    assert labels("busy") == "busy" and labels("first") == "other"
