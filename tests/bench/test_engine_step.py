"""bench.engine_step's stage clock: a part counts its own time only, so the parts add up to the whole."""

import time
from types import SimpleNamespace

from bench.engine_step import StageClock


def test_nested_parts_count_their_own_time_and_the_wrappers_come_off():
    def inner(seconds: float) -> str:
        time.sleep(seconds)
        return "inner"

    stages = SimpleNamespace(inner=inner)

    def outer() -> str:
        time.sleep(0.02)
        return stages.inner(0.03) + stages.inner(0.01)

    stages.outer = outer
    clock = StageClock()
    clock.wrap(stages, "outer", "outer")
    clock.wrap(stages, "inner", lambda seconds: f"inner {seconds}")
    start = time.perf_counter()
    assert stages.outer() == "innerinner"
    whole = (time.perf_counter() - start) * 1000
    assert set(clock.ms) == {"outer", "inner 0.03", "inner 0.01"}
    assert clock.ms["inner 0.03"] >= 30 and clock.ms["inner 0.01"] >= 10
    assert 20 <= clock.ms["outer"] < clock.ms["inner 0.03"] + clock.ms["inner 0.01"]  # its callees taken out
    assert abs(sum(clock.ms.values()) - whole) < 1.0
    clock.remove()
    assert stages.outer is outer and stages.inner is inner
