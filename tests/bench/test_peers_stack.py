"""bench.peers_stack's pieces that need no model or peer: its arguments, the rotation of its rounds, the
ratios and the report table from given figures, the greedy-answer comparison, and the clear reason a peer
that cannot be built or started gets."""

import random
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peer_servers import PeerServer, agreement, wait_healthy
from bench.peers_build import PeerUnavailable, llama_server
from bench.peers_stack import Started, measure, parse_args, summarise, table


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
