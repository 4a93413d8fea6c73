"""bench.engine's dtype comparison: each round's runs paired, the median round headlining."""

import pytest

from bench.engine import paired_vs
from bench.rounds import Run


def run(wall_s: float, tpot_s: list[float]) -> Run:
    return {"wall_s": wall_s, "ttft_s": [0.1] * len(tpot_s), "tpot_s": tpot_s}


def test_each_round_compared_with_the_base_run_of_the_same_round():
    # the machine slows by 2x in round 2: both dtypes slow with it, and the paired ratio does not move
    base = [run(2.0, [0.04, 0.06]), run(4.0, [0.08, 0.12]), run(2.2, [0.05, 0.05])]
    faster = [run(1.0, [0.02, 0.03]), run(2.0, [0.04, 0.06]), run(1.0, [0.025, 0.025])]
    ratio = paired_vs(faster, base)
    assert ratio["tok_s"] == pytest.approx({"min": 2.0, "median": 2.0, "max": 2.2})
    assert ratio["tpot"] == pytest.approx({"min": 2.0, "median": 2.0, "max": 2.0})
    # an unpaired comparison of the medians would mix rounds: 2.2 s / 1.0 s here
    assert paired_vs(base, faster)["tok_s"]["median"] == pytest.approx(0.5)


def test_rounds_must_pair_up():
    with pytest.raises(ValueError):
        paired_vs([run(1.0, [0.01])], [run(1.0, [0.01]), run(1.0, [0.01])])
