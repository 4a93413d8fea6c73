"""bench.peers_stack's pieces that need no model or peer: its arguments, the rotation of its rounds, the
ratios and the report table from given figures, the greedy-answer comparison, and the clear reason a peer
that cannot be built or started gets; and one short run of the load table on the tiny model (the stack only)."""

import json
import random
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from bench.peer_servers import PeerServer, agreement, wait_healthy
from bench.peers_build import PeerUnavailable, llama_server
from bench.peers_load import LoadOptions, load_table, run_load
from bench.peers_stack import Started, load_options, measure, parse_args, summarise, table, write


def test_the_arguments_default_to_fp32_and_bf16_and_int8_is_added_on_request():
    args = parse_args([])
    assert args.precisions == ["fp32", "bf16"]
    assert args.systems == ["lorafleet", "engine", "llama.cpp", "vllm"]
    args = parse_args(["--precision", "bf16", "--int8", "--rounds", "3", "--requests", "2", "--systems", "lorafleet"])
    assert (args.precisions, args.rounds, args.requests, args.systems) == (["bf16", "int8"], 3, 2, ["lorafleet"])
    for bad in (["--rounds", "0"], ["--precision", "int8"], ["--systems", "ollama"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_every_round_runs_every_system_on_the_same_prompts_and_the_first_to_run_rotates():
    calls: list[tuple[str, tuple[str, ...]]] = []
    started = Started()
    for name, tpot in (("lorafleet", 10.0), ("llama.cpp", 20.0), ("vllm", 40.0)):

        def run(prompts: list[str], name: str = name, tpot: float = tpot) -> list[tuple[float, float]]:
            calls.append((name, tuple(prompts)))
            return [(100.0 + i, tpot + i) for i in range(len(prompts))]

        started.runners[name] = run
    per_round = measure(started, rounds=3, requests=3, rng=random.Random(0), label="fp32")
    rounds = calls[3:]  # after one warm-up call each
    assert [c[0] for c in rounds] == [
        "lorafleet", "llama.cpp", "vllm", "llama.cpp", "vllm", "lorafleet", "vllm", "lorafleet", "llama.cpp",
    ]  # fmt: skip
    for r in range(3):
        assert len({c[1] for c in rounds[3 * r : 3 * r + 3]}) == 1  # one set of prompts per round
    assert per_round["llama.cpp"] == [(101.0, 21.0)] * 3  # the round's median request
    result = summarise(started, per_round)
    assert result["systems"]["llama.cpp"]["lorafleet_tpot_over_this"]["median"] == pytest.approx(11 / 21)
    assert "lorafleet_tpot_over_this" not in result["systems"]["lorafleet"]


def test_the_table_puts_figures_ratios_and_not_run_reasons_in_their_rows():
    s = {"min": 9.0, "median": 10.0, "max": 12.5}
    half = {"min": 0.4, "median": 0.5, "max": 0.6}
    results = {
        "fp32": {
            "systems": {
                "lorafleet": {"ttft_ms": s, "tpot_ms": s},
                "llama.cpp": {"ttft_ms": s, "tpot_ms": {"min": 19.0, "median": 20.0, "max": 21.0}, "lorafleet_tpot_over_this": half},
            },
            "not_run": {"vllm": "/x/vllm is missing: run `make venv-vllm`"},
            "greedy": {"lorafleet": {"text": "a b c"}, "llama.cpp": agreement("a b c", "a b d")},
        },
        "int8": {
            "systems": {"lorafleet": {"ttft_ms": s, "tpot_ms": s}},
            "not_run": {"llama.cpp": "building llama-server needs cmake: apt-get install cmake g++"},
            "greedy": {},
        },
    }  # fmt: skip
    text = table(results)
    assert "| fp32 | 10.00 | - | 20.00 | not run |" in text
    assert "| int8 | 10.00 | - | not run | - |" in text
    assert "| fp32 | llama.cpp | 10.00 (9.00-12.50) | 20.00 (19.00-21.00) | 0.50 (0.40-0.60) |" in text
    assert "| fp32 | vllm | not run: /x/vllm is missing: run `make venv-vllm` | | |" in text
    assert "| int8 | llama.cpp | not run: building llama-server needs cmake" in text
    assert "- fp32 llama.cpp: first 2 of 3 words" in text


def test_greedy_agreement_counts_the_words_in_common_from_the_start():
    assert agreement("The tides rise twice a day.", "The tides rise twice a day.")["identical"]
    check = agreement("The tides rise twice a day.", "The tides fall twice a day.")
    assert (check["same_words"], check["of_words"], check["identical"]) == (2, 6, False)
    assert agreement("a b c", "a b")["same_words"] == 2


def test_without_cmake_building_llama_server_fails_with_one_clear_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no cmake, no compiler
    with pytest.raises(PeerUnavailable, match="needs cmake and c\\+\\+: apt-get install cmake g\\+\\+"):
        llama_server(tmp_path / "cache")


def test_a_peer_that_exits_while_starting_is_unavailable_with_its_log(tmp_path):
    log = tmp_path / "peer.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "print('bad flag --lora'); raise SystemExit(3)"], stdout=out, stderr=out
        )
    server = PeerServer("llama.cpp", proc, "http://127.0.0.1:9", "base", Path(log))
    with pytest.raises(PeerUnavailable, match=r"llama.cpp exited \(3\): bad flag --lora"):
        wait_healthy(server, timeout_s=60)
    server.stop()


def test_a_system_whose_requests_keep_failing_leaves_the_run_with_its_reason():
    started = Started()
    started.runners["lorafleet"] = lambda prompts: [(100.0, 10.0) for _ in prompts]
    calls = []

    def flaky(prompts: list[str]) -> list[tuple[float, float]]:
        calls.append(prompts)
        if len(calls) > 1:  # the warm-up passes, round 1 fails
            raise RuntimeError("llama.cpp: request 0 failed three times: ['completed:None:63']")
        return [(100.0, 20.0) for _ in prompts]

    started.runners["llama.cpp"] = flaky
    per_round = measure(started, rounds=3, requests=2, rng=random.Random(0), label="fp32")
    assert list(per_round) == ["lorafleet"] and len(per_round["lorafleet"]) == 3
    assert started.not_run == {
        "llama.cpp": "failed round 1: llama.cpp: request 0 failed three times: ['completed:None:63']"
    }
    assert len(calls) == 2  # never asked again


def test_the_load_options_default_to_3_per_s_for_60_s_over_32_adapters():
    args = parse_args(["--load"])
    assert args.load and load_options(args) == LoadOptions(rate=3.0, duration_s=60.0, adapters=32)
    args = parse_args(["--load", "--load-rate", "10", "--load-duration-s", "5", "--load-count", "7"])
    assert (load_options(args).rate, load_options(args).duration_s, load_options(args).count) == (10.0, 5.0, 7)
    for bad in (["--load-rate", "0"], ["--load-adapters", "0"], ["--load-count", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--load", *bad])


def test_a_load_run_keeps_the_batch_1_figures_already_written_and_the_other_way_round(tmp_path):
    s = {"min": 9.0, "median": 10.0, "max": 12.5}
    batch_1 = {
        "results": {"fp32": {"systems": {"lorafleet": {"ttft_ms": s, "tpot_ms": s}}, "not_run": {}, "greedy": {}}}
    }
    load = {
        "options": asdict(LoadOptions()), "model": "m", "requests": 2, "distinct_adapters": 2, "not_run": {},
        "systems": {"lorafleet": {
            "requests": 2, "completed": 1, "errors": 1, "errors_by_code": {"worker_lost": 1}, "lost": 0,
            "lost_by_reason": {}, "ttft_p50_ms": 61.7, "ttft_p95_ms": 3295.2, "tpot_p50_ms": 26.66,
            "throughput_tok_s": 85.04, "throughput_req_s": 1.0, "wall_s": 1.0,
        }},
    }  # fmt: skip
    out = tmp_path / "peers_stack.json"
    write(out, batch_1)
    markdown = write(out, {"load": load})
    assert json.loads(out.read_text()).keys() == {"results", "load"}
    assert "| fp32 | lorafleet | 10.00 (9.00-12.50)" in markdown
    assert "| lorafleet | 2 | 1 | 1 {'worker_lost': 1} | 0 | 61.7 / 3,295 | 26.7 | 85.0 |" in markdown
    assert write(out, batch_1) == markdown and out.with_suffix(".md").read_text() == markdown + "\n"


@pytest.mark.slow
def test_the_load_table_of_a_short_run_with_a_missing_peer(tmp_path, monkeypatch):
    monkeypatch.setattr("bench.peer_servers.VLLM_PYTHON", tmp_path / "missing" / "python")
    options = LoadOptions(
        rate=4.0, duration_s=2.0, adapters=3, max_tokens=8, timeout_s=60, drain_s=60, base_model="tiny", warmup=1
    )
    load = run_load(["lorafleet", "vllm"], options, build=False)
    row = load["systems"]["lorafleet"]
    assert list(load["systems"]) == ["lorafleet"] and row["requests"] == load["requests"] > 0
    assert row["completed"] == row["requests"] and row["errors"] == row["lost"] == 0
    assert row["ttft_p50_ms"] <= row["ttft_p95_ms"] and row["tpot_p50_ms"] > 0 and row["throughput_tok_s"] > 0
    assert load["not_run"] == {"vllm": f"{tmp_path / 'missing' / 'python'} is missing: run `make venv-vllm`"}
    text = load_table(load)
    assert f"| lorafleet | {row['requests']} | {row['requests']} | 0 | 0 |" in text
    assert "| vllm | not run: " in text and "make venv-vllm" in text
