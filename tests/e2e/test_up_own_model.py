"""``lorafleet up`` as a new user runs it on their own base model (``LF_MODEL_DIR``): the demo adapters,
trained for SmolLM2, are skipped in one line, the stack stays up, and the printed example answers."""

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
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
