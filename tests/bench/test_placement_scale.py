"""bench.placement_scale on a tiny fleet: every request is served or shed, attainment is a share,
FCFS sheds nothing, and the class-aware queue keeps interactive requests within target under
overload where FCFS lets them miss it; the high-rank pool takes rank-64 traffic."""

import json
import subprocess
import sys

import pytest

from bench.placement_scale import POLICIES, RANKS, RESULTS, Scale, run_all
from shared.schemas import SLO_CLASSES

# 2,000 requests (seeded): at 1.3x the class-aware queue still keeps 97% of interactive requests in target
# where FCFS keeps 9%, and the rank-64 pool takes 79% of its rank; 4,000 doubled the fast tier's longest setup
TINY = Scale(workers=6, adapters=300, requests=2_000, tenants=20, pool_share=1 / 6, loads=(0.9, 1.3))


@pytest.fixture(scope="module")
def result() -> dict:
    return run_all(TINY)


def test_every_request_is_served_or_shed(result: dict):
    for load, policies in result["runs"].items():
        assert set(policies) == set(POLICIES), load
        for policy, run in policies.items():
            classes = run["classes"]
            assert set(classes) == set(SLO_CLASSES)
            assert sum(c["requests"] for c in classes.values()) == TINY.requests
            for name, c in classes.items():
                assert c["served"] + c["shed"] == c["requests"], (load, policy, name)
                assert 0.0 <= c["attainment"] <= 1.0 and 0.0 <= c["shed_share"] <= 1.0
                assert c["attainment"] <= c["served"] / max(1, c["requests"])
            assert run["shed"] == sum(c["shed"] for c in classes.values())
            assert 0.0 < run["gpu_hit_rate"] <= 1.0
            assert run["wall_s"] > 0 and run["cpu_s"] > 0


def test_fcfs_sheds_nothing_and_only_pools_spill(result: dict):
    for policies in result["runs"].values():
        assert policies["fcfs"]["shed"] == 0
        assert policies["fcfs"]["spills"] == 0 and policies["class_aware"]["spills"] == 0
        assert policies["class_aware"]["on_pool_share"] == dict.fromkeys(map(str, RANKS), 0.0)


def test_classes_keep_interactive_within_target_under_overload(result: dict):
    over = result["runs"]["1.3x"]
    fcfs, aware = over["fcfs"]["classes"], over["class_aware"]["classes"]
    assert aware["interactive"]["attainment"] > fcfs["interactive"]["attainment"] + 0.5
    assert aware["interactive"]["attainment"] >= 0.75
    assert aware["batch"]["shed"] >= aware["interactive"]["shed"]  # batch is shed first


def test_the_pool_takes_rank_64(result: dict):
    pools = result["runs"]["0.9x"]["class_aware_pools"]["on_pool_share"]
    assert pools["64"] > 0.5  # one worker in six, but its rank class goes there first
    assert pools["8"] < pools["64"]


def test_the_command_writes_json_and_markdown():
    tiny = ["--workers", "3", "--adapters", "50", "--requests", "600", "--out", "test_placement_scale"]
    done = subprocess.run(
        [sys.executable, "-m", "bench.placement_scale", *tiny],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((RESULTS / "test_placement_scale.json").read_text())
    assert result["scale"]["requests"] == 600 and set(result["runs"]) == {"0.9x", "1.2x"}
    table = (RESULTS / "test_placement_scale.md").read_text()
    assert table.count("| class_aware_pools |") == 2 * len(SLO_CLASSES)
