"""AsyncEngine: streaming, interleaving of concurrent requests, cancellation and abandonment free KV."""

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from services.worker.engine import AsyncEngine, EngineConfig, EngineRequest, LLMEngine, RequestTooLarge
from services.worker.engine.model_loader import load_model
from services.worker.engine.weights import ModelWeights, load_weights
from shared.schemas import SamplingParams
from tests.helpers.families import tiny_llama


@pytest.fixture(scope="module")
def parts() -> tuple[ModelWeights, PreTrainedTokenizerBase]:
    model = tiny_llama(vocab_size=49152)  # the SmolLM2 tokenizer's vocabulary
    weights = load_weights(model, torch.float32, "cpu", 256)
    return weights, load_model().tokenizer


@pytest.fixture
async def engine(parts: tuple[ModelWeights, PreTrainedTokenizerBase]) -> AsyncIterator[AsyncEngine]:
    weights, tokenizer = parts
    config = EngineConfig(num_blocks=64, kv_block_size=8, max_model_len=256, max_num_batched_tokens=256)
    async_engine = AsyncEngine(LLMEngine(weights, tokenizer, config, eos_token_ids=set()))
    async_engine.start()
    yield async_engine
    async_engine.shutdown()


def request(request_id: str, max_tokens: int) -> EngineRequest:
    return EngineRequest(request_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens, temperature=0.0))


async def wait_for_free(engine: AsyncEngine) -> None:
    for _ in range(200):
        stats = engine.stats()
        if stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks not freed: {engine.stats()}")


async def test_generate_streams_every_token(engine: AsyncEngine) -> None:
    outputs = [out async for out in engine.generate(request("r", 8))]
    assert len(outputs) == 8 and all(len(o.token_ids) == 1 for o in outputs)
    assert [o.finished for o in outputs] == [False] * 7 + [True]
    last = outputs[-1]
    assert last.finish_reason == "length" and last.completion_tokens == 8 and last.prompt_tokens == 5
    assert last.first_token_time is not None
    await wait_for_free(engine)


async def test_concurrent_generates_interleave(engine: AsyncEngine) -> None:
    order: list[str] = []

    async def consume(request_id: str) -> None:
        async for out in engine.generate(request(request_id, 40 if request_id == "x" else 12)):
            order.append(out.request_id)  # noqa: PERF401 - each as it comes: the two streams interleave in order

    await asyncio.gather(consume("x"), consume("y"))
    assert order.count("x") == 40 and order.count("y") == 12
    assert order.index("y") < len(order) - order[::-1].index("x") - 1, "y never ran while x was running"


async def test_cancel_ends_the_stream_and_frees_blocks(engine: AsyncEngine) -> None:
    seen = []
    async for out in engine.generate(request("c", 200)):
        seen.append(out)
        if len(seen) == 2:
            engine.cancel("c")
    assert seen[-1].finished and seen[-1].finish_reason == "abort"
    assert len(seen) < 200  # ended by the cancel, not by its length
    await wait_for_free(engine)


async def test_abandoned_stream_and_cancelled_task_free_blocks(engine: AsyncEngine) -> None:
    async with contextlib.aclosing(engine.generate(request("a", 200))) as stream:
        async for _ in stream:
            break
    await wait_for_free(engine)

    async def consume() -> None:
        async for _ in engine.generate(request("t", 200)):
            pass

    task = asyncio.create_task(consume())
    while engine.stats().running == 0:  # noqa: ASYNC110 - the engine signals no start; its stats are polled
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for_free(engine)


async def test_too_large_request_raises(engine: AsyncEngine) -> None:
    with pytest.raises(RequestTooLarge):
        async for _ in engine.generate(EngineRequest("big", [1] * 300)):
            pass
    assert engine.stats().kv_blocks_total == 64


def _nice(tid: int) -> int:
    """A thread's nice value, from Linux /proc (field 19 of its stat line)."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[16])


async def test_the_step_loop_runs_at_the_configured_niceness_and_the_caller_does_not(engine: AsyncEngine) -> None:
    async for _ in engine.generate(request("n", 2)):
        pass
    caller = _nice(threading.get_native_id())  # the event loop's thread
    assert engine.step_thread_id not in (None, threading.get_native_id())
    # EngineConfig.compute_nice's default, never lowered if the process already ran nicer
    assert _nice(engine.step_thread_id) == max(caller, 5)
    assert os.getpriority(os.PRIO_PROCESS, 0) == caller
