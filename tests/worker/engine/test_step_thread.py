"""StepThread: the worker's model load, engine build and step loop on one thread, which holds the
process's only OpenMP team (kernels/omp_threads.py) while every other thread runs torch inline. In a
child Python process: the intra-op counts are process-wide state."""

import textwrap

from tests.helpers.native import child_report, needs_toolchain

pytestmark = needs_toolchain

CHILD = textwrap.dedent(
    """
    import asyncio, json, os, threading
    import torch
    from kernels import omp_threads
    from services.worker.engine import AsyncEngine, EngineConfig, EngineRequest, LLMEngine
    from services.worker.engine.async_engine import StepThread
    from services.worker.engine.weights import load_weights
    from shared.schemas import SamplingParams
    from tests.helpers.families import tiny_llama, word_tokenizer

    def tasks():  # the process's live threads
        return {int(t) for t in os.listdir("/proc/self/task")}

    async def main():
        config = EngineConfig(num_blocks=64, kv_block_size=8, max_model_len=256, max_num_batched_tokens=256)
        threads = omp_threads.serial_process()
        base = tasks()
        thread = StepThread(config, threads)

        def build():
            weights = load_weights(tiny_llama(vocab_size=256), torch.float32, "cpu", 256)
            engine = AsyncEngine(LLMEngine(weights, word_tokenizer(256), config, eos_token_ids=set()))
            return engine, torch.get_num_threads()

        engine, step_count = await thread.run(build)
        engine.start(thread)
        tokens = []
        request = EngineRequest("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=6, temperature=0.0))
        async for out in engine.generate(request):
            tokens += out.token_ids
        added = len(tasks() - base)  # alive and new
        step_id = engine.step_thread_id
        engine.shutdown()
        thread.close()
        return dict(
            tokens=len(tokens), threads=threads, main=torch.get_num_threads(), added=added,
            step_is_other=step_id not in (None, threading.get_native_id()), step_count=step_count,
        )

    print(json.dumps(asyncio.run(main())))
    """
)


def test_the_engine_is_built_and_stepped_on_one_thread_with_the_only_team() -> None:
    got = child_report(CHILD)
    assert got["tokens"] == 6 and got["step_is_other"]
    assert got["threads"] == 2 and got["main"] == 1 and got["step_count"] == 2
    assert got["added"] == 2  # the step thread and its team's one worker thread: no other pool
