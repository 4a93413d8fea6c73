"""bench.lowload's pieces that need no stack: CPU accounting from /proc, variant specs, the report table."""

import os
import threading
import time
from pathlib import Path

import pytest

from bench.lowload import cpu_s, parse_variant, table


def test_a_threads_cpu_time_grows_with_its_work_and_an_idle_threads_does_not():
    go, worked, done = threading.Event(), threading.Event(), threading.Event()
    tids: dict[str, int] = {}

    def busy() -> None:
        tids["busy"] = threading.get_native_id()
        go.wait()
        end = time.thread_time() + 0.3  # this thread's own CPU time, however busy the machine is
        while time.thread_time() < end:
            sum(range(1000))
        worked.set()
        done.wait()  # alive until read: an ended thread leaves /proc

    def idle() -> None:
        tids["idle"] = threading.get_native_id()
        done.wait()

    workers = [threading.Thread(target=busy), threading.Thread(target=idle)]
    for w in workers:
        w.start()
    while len(tids) < 2:
        time.sleep(0.01)
    stat = {name: Path(f"/proc/{os.getpid()}/task/{tid}/stat") for name, tid in tids.items()}
    before = {name: cpu_s(path) for name, path in stat.items()}
    go.set()
    worked.wait()
    after = {name: cpu_s(path) for name, path in stat.items()}
    done.set()
    for w in workers:
        w.join()
    assert after["busy"] - before["busy"] > 0.15  # of 0.3 s, read in clock ticks
    assert after["idle"] - before["idle"] < 0.05


def test_a_variant_spec_names_its_settings():
    assert parse_variant("passive:OMP_WAIT_POLICY=PASSIVE,LF_ENGINE__NUM_THREADS=1") == (
        "passive",
        {"OMP_WAIT_POLICY": "PASSIVE", "LF_ENGINE__NUM_THREADS": "1"},
    )
    assert parse_variant("plain:") == ("plain", {})
    for bad in (":A=1", "stack:A=1", "engine:A=1", "x:A"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def test_the_table_gives_each_systems_ratio_to_the_engine_and_its_cpu_per_token():
    spread = {"min": 1.0, "median": 2.0, "max": 3.0}
    results = {
        "float32": {
            "systems": {
                "stack": {
                    "ttft_ms": spread,
                    "tpot_ms": spread,
                    "tpot_vs_engine": {"min": 1.0, "median": 1.25, "max": 1.5},
                    "worker_tpot_ms": spread,
                    "cpu_ms_per_token": {"worker": 20.0, "gateway": 0.5},
                },
                "engine": {"ttft_ms": spread, "tpot_ms": spread, "cpu_ms_per_token": {"engine": 19.0}},
            }
        }
    }
    text = table(results)
    assert "| float32 | stack | 2.00 (1.00-3.00) | 2.00 (1.00-3.00) | 1.25 (1.00-1.50) | 2.00 (1.00-3.00) |" in text
    assert "- float32 stack: worker 20.00, gateway 0.50" in text
    assert "- float32 engine: engine 19.00" in text
