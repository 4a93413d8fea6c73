"""``lorafleet up`` as a new user runs it on their own base model (``LF_MODEL_DIR``): the demo adapters,
trained for SmolLM2, are skipped in one line, the stack stays up, and the printed example answers."""

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from lorafleet.cli.infra import free_port
from tests.helpers.own_model import save_own_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
READY_LINE = "Ctrl-C stops everything."


@dataclass
class Up:
    proc: subprocess.Popen[str]
    lines: list[str]
    state: Path


def _read(proc: subprocess.Popen[str], out: queue.Queue[str | None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        out.put(line.rstrip("\n"))
    out.put(None)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    root = tmp_path_factory.mktemp("up")
    model_dir = save_own_model(root / MODEL)
    env = {**os.environ, "LF_MODEL_DIR": str(model_dir), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "lorafleet.cli", "up", "--state-dir", str(root / "state"), "--ready-timeout", "300"]
    for flag in ("--port", "--nats-port", "--redis-port"):
        argv += [flag, str(free_port())]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_read, args=(proc, out), daemon=True).start()
    lines: list[str] = []
    deadline = time.monotonic() + 330
    try:
        while READY_LINE not in lines:
            line = out.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                pytest.fail("lorafleet up exited before it was up:\n" + "\n".join(lines))
            lines.append(line)
        yield Up(proc, lines, root / "state")
    finally:
        stop(proc, root / "state")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop(proc: subprocess.Popen[str], state: Path) -> list[str]:
    """SIGTERM to ``up`` (SIGINT may be ignored: a launcher that starts pytest in the background leaves
    it so); should ``up`` not have stopped in 60 s, kill it and every process it supervised, so that
    none outlives the test. The names of those still alive after ``up`` exited (none when it stops
    cleanly)."""
    pids_file = state / "processes.json"
    pids = json.loads(pids_file.read_text()) if pids_file.exists() else {}
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    left = [name for name, pid in pids.items() if _alive(pid)]
    for name in left:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pids[name], signal.SIGKILL)  # each runs in its own session
    return left


def _example(lines: list[str]) -> tuple[str, str, dict]:
    """The gateway URL, key and JSON body of the first printed curl example."""
    text = "\n".join(lines)
    found = re.search(r"curl -s (\S+) \\\n  -H 'Authorization: Bearer (\S+)' .*\\\n  -d '(.*)'", text)
    assert found, text
    return found[1], found[2], json.loads(found[3])


def test_up_skips_the_demo_adapters_in_one_line_and_stays_up(up: Up) -> None:
    assert not [line for line in up.lines if line.startswith("error:")], up.lines
    skipped = [line for line in up.lines if "skipped" in line]
    assert len(skipped) == 1, up.lines
    assert re.search(
        r"capital-answer, json-extract, sql-employees, because .*SmolLM2.* do not fit tiny-llama", skipped[0]
    )
    assert up.proc.poll() is None
    assert not (up.state / "models").exists()  # the embedded SmolLM2 was never converted


def test_the_printed_examples_name_the_served_model(up: Up) -> None:
    _, _, body = _example(up.lines)
    assert body["model"] == MODEL
    assert f"model='{MODEL}'" in "\n".join(up.lines)  # the openai snippet
    assert "SmolLM2-135M-Instruct" not in "\n".join(line for line in up.lines if "skipped" not in line)


def test_the_printed_example_answers_through_the_gateway(up: Up) -> None:
    url, key, body = _example(up.lines)
    reply = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["model"] == MODEL
    assert answer["choices"] and answer["choices"][0]["finish_reason"] in ("stop", "length")
    assert answer["usage"]["completion_tokens"] > 0


SUPERVISED = ("worker", "scheduler", "gateway", "registry", "auditor", "redis", "nats")
BACK_S = 150  # bound on a process being back and the stack answering again


def _serves(url: str, key: str, body: dict) -> bool:
    try:
        reply = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    except httpx.HTTPError:
        return False
    return reply.status_code == 200


@pytest.mark.timeout(BACK_S * len(SUPERVISED) + 60)
def test_every_process_it_started_comes_back_after_kill_9_and_the_stack_serves_again(up: Up) -> None:
    url, key, body = _example(up.lines)
    body = {**body, "max_tokens": 4}
    pids_file = up.state / "processes.json"
    assert set(json.loads(pids_file.read_text())) == set(SUPERVISED)
    answered: list[int | str] = []  # light load all along: every request ends, served or with a typed error
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                reply = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=90)
                answered.append(reply.status_code if reply.status_code == 200 else reply.json()["error"]["code"])
            except httpx.TransportError:  # the gateway itself is down: nothing was accepted
                answered.append("no_connection")
            stop.wait(0.5)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    try:
        for name in SUPERVISED:
            old = json.loads(pids_file.read_text())[name]
            os.kill(old, signal.SIGKILL)
            deadline = time.monotonic() + BACK_S
            while json.loads(pids_file.read_text())[name] == old:
                assert time.monotonic() < deadline, f"{name} was not restarted"
                time.sleep(0.2)
            while not _serves(url, key, body):
                assert time.monotonic() < deadline, f"not serving again after {name} was killed"
                time.sleep(0.5)
    finally:
        stop.set()
        loader.join(120)
    assert up.proc.poll() is None
    assert not loader.is_alive()  # no request hung past its bound
    assert answered.count(200) > len(SUPERVISED), answered
    log = (up.state / "logs" / "supervisor.log").read_text()
    for name in SUPERVISED:
        assert f"{name} exited with code -9" in log and f"{name} restarted (1 so far)" in log, log
    ready = httpx.get(url.replace("/v1/chat/completions", "/readyz"), timeout=10).json()
    assert ready["ready"] and ready["components"]["supervisor"] == "ok", ready


def test_sigterm_stops_every_process_it_started(up: Up) -> None:
    """Last in this module: it stops the stack the other tests share."""
    pids = json.loads((up.state / "processes.json").read_text())
    assert set(pids) == set(SUPERVISED)
    assert stop(up.proc, up.state) == []
    assert up.proc.returncode == 0  # it stopped on its own, within the bound
