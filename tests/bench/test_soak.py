"""bench.soak: the flatness verdict on sampled footprints, and sampling a live process from /proc."""

import asyncio
import os

import pytest

from bench.soak.procstat import Sample, sample, sample_every
from bench.soak.trend import Tolerance, slope_per_min, trend

TOL = Tolerance(rss_mb=20, rss_pct=2, open_files=4)


def series(rss: list[float], files: list[int] | None = None, every_s: float = 10.0) -> list[Sample]:
    files = files or [10] * len(rss)
    return [Sample(i * every_s, r, f) for i, (r, f) in enumerate(zip(rss, files, strict=True))]


def verdict(samples: list[Sample], last_s: float | None = None) -> dict:
    last = last_s if last_s is not None else samples[-1].t_s if samples else 0.0
    return trend(samples, warmup_s=60, window_s=30, last_s=last, interval_s=10, tol=TOL)


def test_slope_is_least_squares_per_minute():
    assert slope_per_min([(0, 100.0), (60, 101.0), (120, 102.0)]) == pytest.approx(1.0)
    assert slope_per_min([(5, 1.0)]) is None


def test_growth_during_warm_up_then_a_plateau_is_flat():
    rss = [100 + 10 * i for i in range(7)] + [160.0 + (i % 2) for i in range(30)]  # fills, then holds
    t = verdict(series(rss))
    assert t["flat"], t["why"]
    assert t["warm_rss_mb"] == pytest.approx(160.5, abs=0.5) and abs(t["rss_growth_mb"]) < 1


def test_steady_growth_after_warm_up_is_not_flat():
    t = verdict(series([500 + 2.0 * i for i in range(60)]))  # 12 MB/min
    assert not t["flat"] and "RSS grew" in t["why"]
    assert t["rss_slope_mb_per_min"] == pytest.approx(12.0)


def test_in_flight_connections_do_not_count_as_leaked_files_but_a_rising_floor_does():
    waves = [10 + (i % 4) * 5 for i in range(60)]  # connections come and go around a floor of 10
    assert verdict(series([100.0] * 60, waves))["flat"]
    leaking = [w + i // 6 for i, w in enumerate(waves)]
    t = verdict(series([100.0] * 60, leaking))
    assert not t["flat"] and "open files grew" in t["why"]


def test_a_process_that_exits_is_never_flat():
    assert not verdict(series([100.0] * 20), last_s=590)["flat"]
    assert not verdict([])["flat"]


def test_this_process_is_sampled_and_a_missing_one_is_not():
    here = sample(os.getpid(), 0.0)
    assert here is not None and here.rss_mb > 10 and here.open_files >= 3
    assert sample(2**22 + 1, 0.0) is None  # above pid_max


async def test_sampling_runs_until_stopped():
    into: dict[str, list[Sample]] = {}
    stop = asyncio.Event()
    task = asyncio.create_task(sample_every({"me": os.getpid()}, 0.05, stop, into))
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.wait_for(task, 1)
    assert 3 <= len(into["me"]) <= 8 and into["me"][0].t_s < into["me"][-1].t_s
