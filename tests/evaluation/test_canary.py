"""Canary comparison: which differences between the new and the old version count as regressions."""

import pytest

from lorafleet.cli.release_cmd import parse_steps
from lorafleet.evaluation.canary import CanaryPolicy, VersionStats, regressions
from shared.errors import InvalidRequest

OLD = VersionStats(score=0.8, error_rate=0.0, ttft_ms=100.0, tpot_ms=20.0)


def test_an_equal_or_better_version_passes() -> None:
    assert regressions(OLD, OLD, CanaryPolicy()) == []
    assert regressions(VersionStats(0.9, 0.0, 90.0, 19.0), OLD, CanaryPolicy()) == []


def test_each_kind_of_regression_is_named() -> None:
    worse = VersionStats(score=0.5, error_rate=0.25, ttft_ms=450.0, tpot_ms=90.0)
    reasons = regressions(worse, OLD, CanaryPolicy())
    assert [r.split()[0] for r in reasons] == ["quality", "error", "TTFT", "TPOT"]


def test_tolerances_are_respected() -> None:
    slightly = VersionStats(score=0.76, error_rate=0.04, ttft_ms=190.0, tpot_ms=39.0)
    assert regressions(slightly, OLD, CanaryPolicy()) == []
    assert regressions(slightly, OLD, CanaryPolicy(max_quality_drop=0.01)) != []


def test_missing_latency_is_not_a_regression() -> None:
    assert regressions(VersionStats(0.8, 0.0, None, None), OLD, CanaryPolicy()) == []


def test_steps_parse_and_must_increase() -> None:
    assert parse_steps("1,10,50,100") == [1.0, 10.0, 50.0, 100.0]
    for bad in ("10,5", "0,50", "50,150", ""):
        with pytest.raises(InvalidRequest):
            parse_steps(bad)
