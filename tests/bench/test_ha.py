"""bench.ha's plan (three runs on one schedule, the node killed halfway through the arrivals) and its
comparison (TTFT added by replication and by the lost node; lost requests summed)."""

from bench.ha import DEFAULTS, compare, markdown, runs_of


def test_three_runs_on_one_schedule_with_the_node_killed_halfway():
    runs = runs_of(DEFAULTS, "infer_leader")
    assert list(runs) == ["single", "cluster", "cluster_node_killed"]
    assert [r.shape for r in runs.values()] == ["single", "cluster", "cluster"]
    assert {(r.rate, r.count, r.seed, r.workers) for r in runs.values()} == {(4.0, 360, 0, 2)}
    assert runs["cluster_node_killed"].kill_nats_at_s == 45.0  # 360 at 4/s: 90 s of arrivals
    assert runs["single"].kill_nats_at_s is None and runs["cluster"].kill_nats_at_s is None


def result(p50: float, p95: float, lost: int = 0, fault: dict | None = None) -> dict:
    return {
        "ttft_p50_ms": p50,
        "ttft_p95_ms": p95,
        "ttft_p99_ms": p95,
        "tpot_p50_ms": 3.0,
        "tpot_p95_ms": 4.0,
        "throughput_tok_s": 60.0,
        "requests": 10,
        "completed": 10 - lost,
        "errors": 0,
        "errors_by_code": {},
        "lost": lost,
        "fault": fault,
        "environment": {"shape": {"nats-server": 1}},
        "config": {},
    }


def test_the_comparison_gives_what_replication_and_the_lost_node_add():
    fault = {"killed": "n1", "which": "infer_leader", "at_s": 45.0}
    summary = compare(
        {
            "single": result(17.0, 31.0),
            "cluster": result(23.0, 52.0),
            "cluster_node_killed": result(18.0, 1548.0, 1, fault),
        }
    )
    assert summary["added_by_replication"] == {"ttft_p50_ms": 6.0, "ttft_p95_ms": 21.0}
    assert summary["added_by_node_loss"] == {"ttft_p50_ms": -5.0, "ttft_p95_ms": 1496.0}
    assert summary["lost"] == 1
    table = markdown(summary)
    assert "n1 (infer_leader) at 45 s" in table and "lost in all runs: 1" in table
