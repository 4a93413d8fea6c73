"""vLLM's async engine (``vllm.v1`` AsyncLLM) driven in-process, as a services.worker.engine_port.WorkerEngine.

vLLM runs its engine core in a child process it spawns and owns; this object is its only client.
Adapters enter through ``add_adapter`` with files lorafleet has verified, and are served by the
lorafleet cache key that ``EngineRequest.adapter`` names."""

import asyncio
import itertools
import json
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.lora.request import LoRARequest
from vllm.platforms import current_platform
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase

from services.worker.engine.async_engine import EngineDead, EngineStats
from services.worker.engine.errors import DuplicateRequest, UnsupportedSampling
from services.worker.engine.grammar import Grammars
from services.worker.engine.sequence import EngineRequest, RequestOutput
from services.worker.engine.token_text import TokenText
from services.worker.vllm_engine.adapter_dir import AdapterDir
from services.worker.vllm_engine.base_check import check_base
from services.worker.vllm_engine.sampling import to_vllm
from services.worker.vllm_engine.vllm_config import VllmConfig, VllmPlan
from shared.errors import InvalidRequest, InvalidSchema, ServiceUnavailable
from shared.schemas import StructuredOutput, TokenLogprob, slo_rank


def _schema_refused(spec: StructuredOutput, error: Exception) -> InvalidSchema:
    if spec.structural_tag is not None:  # tool calls
        return InvalidSchema(f"the tools cannot be enforced: {error}", param="tools")
    return InvalidSchema(f"the JSON schema cannot be enforced: {error}", param="response_format")


_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
# Logprobs of the model's distribution before any sampling transform, as the built-in engine's;
# vLLM's prompt logprobs are of the raw logits in every mode, so this keeps both the same.
LOGPROBS_MODE = "raw_logprobs"


@dataclass(frozen=True, slots=True)
class _Adapter:
    lora: LoRARequest
    digest: str


class _SchedulerView(StatLoggerBase):
    """Keeps the engine core's latest scheduler stats for the heartbeat (vLLM calls ``record`` per step)."""

    def __init__(self, vllm_config, engine_index: int = 0, sink: "VllmEngine | None" = None):  # type: ignore[no-untyped-def]
        self._sink = sink

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):  # type: ignore[no-untyped-def]
        if scheduler_stats is not None and self._sink is not None:
            self._sink._observe(scheduler_stats)

    def log_engine_initialized(self) -> None:
        pass


class VllmEngine:
    """One worker's vLLM engine. ``start`` builds it (seconds: the engine core loads the model), ``shutdown`` at exit."""

    def __init__(
        self,
        model_dir: str | Path,
        config: VllmConfig,
        adapter_dir: AdapterDir,
        grammars: Grammars | None = None,
        rank_classes: tuple[int, ...] | None = None,
    ):
        """``rank_classes``: the fleet's (the worker's LF_LORA__RANK_CLASSES); default the configured
        ``max_lora_rank`` alone, else 64."""
        self.model_dir = str(model_dir)
        self.config = config
        self.rank_classes = rank_classes or (config.max_lora_rank or 64,)
        self.plan: VllmPlan | None = None  # set by start, on the platform vLLM found
        self.adapters = adapter_dir
        # vLLM compiles a grammar in its engine core, where nothing bounds or stops a compile: each is
        # first compiled here, under the built-in engine's bounds (time, per-tenant turns, per-tenant cache)
        self.grammars = grammars
        self._llm: AsyncLLM | None = None
        self._loras: dict[str, _Adapter] = {}
        self._ids = itertools.count(1)
        self._streaming: set[str] = set()
        self._aborts: set[asyncio.Task[None]] = set()
        self._lock = threading.Lock()
        self._changing = asyncio.Lock()  # one add or remove at a time: a removal never deletes files an add is using
        self._stats = EngineStats(0, 0, 0, 0)
        self._token_text: TokenText | None = None  # OpenAI's token text and bytes, from vLLM's tokenizer

    def start(self) -> None:
        # Read by the CPU build when its engine core starts (the child inherits the environment).
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.config.cpu_kv_cache_gib)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self.config.cpu_omp_threads_bind
        c = self.config
        on_cpu = current_platform.is_cpu()
        check_base(json.loads((Path(self.model_dir) / "config.json").read_text()), c.dtype, on_cpu)
        self.plan = plan = VllmPlan.of(c, self.rank_classes, on_cpu=on_cpu)
        args = AsyncEngineArgs(
            model=self.model_dir,
            dtype=c.dtype,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            enable_lora=True,
            max_loras=c.max_loras,
            max_cpu_loras=c.max_cpu_loras,
            max_lora_rank=plan.max_lora_rank,
            enable_prefix_caching=c.enable_prefix_caching,
            gpu_memory_utilization=c.gpu_memory_utilization,
            enforce_eager=plan.enforce_eager,  # the CPU build runs eagerly; CUDA graphs cover LoRA on a GPU
            logprobs_mode=LOGPROBS_MODE,
            scheduling_policy=c.scheduling_policy,
            disable_log_stats=False,  # the scheduler stats feed the heartbeat
        )
        self._llm = AsyncLLM.from_engine_args(
            args, stat_loggers=[lambda cfg, index: _SchedulerView(cfg, index, sink=self)]
        )
        policy = self._llm.vllm_config.scheduler_config.policy
        if policy != c.scheduling_policy:  # a platform that swapped the scheduler would drop the classes silently
            self._llm.shutdown()
            raise RuntimeError(f"vLLM runs scheduling policy {policy!r}, not the configured {c.scheduling_policy!r}")
        total = self._llm.vllm_config.cache_config.num_gpu_blocks or 0
        self._stats = EngineStats(0, 0, total, total)
        self._token_text = TokenText(AutoTokenizer.from_pretrained(self.model_dir))

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
        if self.grammars is not None:
            self.grammars.close()
        self.adapters.close()

    def stats(self) -> EngineStats:
        return self._stats

    async def add_adapter(self, key: str, digest: str, files: dict[str, bytes]) -> None:
        """Hand vLLM one verified adapter version under lorafleet's cache ``key`` (a no-op when it holds it)."""
        llm = self._running()
        async with self._changing:
            if key in self._loras:
                return
            path = await asyncio.to_thread(self.adapters.put, digest, files)
            lora = LoRARequest(lora_name=key, lora_int_id=next(self._ids), lora_path=str(path))
            try:
                await llm.add_lora(lora)
            except (ValueError, VLLMValidationError) as e:  # e.g. a rank above max_lora_rank
                if all(a.digest != digest for a in self._loras.values()):
                    await asyncio.to_thread(self.adapters.remove, digest)
                raise InvalidRequest(f"vLLM cannot serve adapter {key}: {e}", param="adapter") from None
            self._loras[key] = _Adapter(lora, digest)

    async def remove_adapter(self, key: str) -> bool:
        """Drop ``key`` from vLLM's slots and CPU cache and its files from disk; False when not held."""
        async with self._changing:
            adapter = self._loras.pop(key, None)
            if adapter is None:
                return False
            await self._running().remove_lora(adapter.lora.lora_int_id)
            if all(a.digest != adapter.digest for a in self._loras.values()):
                await asyncio.to_thread(self.adapters.remove, adapter.digest)
            return True

    def adapter_keys(self) -> list[str]:
        return sorted(self._loras)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        llm = self._running()
        rid = request.request_id
        prompt_tokens = len(request.prompt_token_ids)
        sampling = to_vllm(
            request.sampling,
            prompt_tokens=prompt_tokens,
            max_model_len=self.config.max_model_len,
            logprobs=request.logprobs,
        )
        lora = self._lora_of(request.adapter)
        # lower runs earlier; with fcfs vLLM ignores it, so none is passed rather than one that means nothing
        priority = slo_rank(request.slo_class) if self.config.scheduling_policy == "priority" else 0
        wants_logprobs = request.logprobs or request.sampling.logprobs
        prompt: dict[str, object] = {"prompt_token_ids": list(request.prompt_token_ids)}
        if request.cache_salt:
            prompt["cache_salt"] = request.cache_salt
        if request.sampling.logprobs and request.sampling.structured is not None:
            # vLLM applies a grammar's token mask to the logits its logprobs come from; the built-in
            # engine's (and this platform's) logprobs are the model's own, before any mask
            raise UnsupportedSampling(
                "the vLLM engine cannot report the model's logprobs under response_format or tools "
                "(vLLM computes them after the grammar mask): ask without one of them",
                param="logprobs",
            )
        if request.sampling.prompt_logprobs is not None and llm.model_config.logprobs_mode != LOGPROBS_MODE:
            raise UnsupportedSampling(
                f"prompt logprobs are of the raw model; this engine reports {llm.model_config.logprobs_mode}",
                param="prompt_logprobs",
            )
        if request.sampling.structured is not None and self.grammars is not None:
            # past the compile bound a typed 400 (429 while the tenant's compile turns are taken), before
            # vLLM's engine core would spend an unbounded, unstoppable compile on it
            await self.grammars.prepare(request.sampling.structured, request.tenant or "")
        with self._lock:
            if rid in self._streaming:
                raise DuplicateRequest(f"request {rid!r} is already streaming")
            self._streaming.add(rid)
        completion, first_token_time, finished = 0, None, False
        try:
            # engine_s stays None: vLLM's per-request metrics are timestamps (queued, scheduled, first and last
            # token) of batches it shares with others, not its share of the steps' time
            async for out in llm.generate(prompt, sampling, rid, lora_request=lora, priority=priority):  # type: ignore[arg-type]
                piece = out.outputs[0]
                token_ids = list(piece.token_ids)
                completion += len(token_ids)
                if token_ids and first_token_time is None:
                    first_token_time = time.monotonic()
                finished = out.finished
                yield RequestOutput(
                    request_id=rid,
                    token_ids=token_ids,
                    text=piece.text,
                    finished=finished,
                    finish_reason=_FINISH_REASONS.get(piece.finish_reason or "abort", "abort") if finished else None,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion,
                    first_token_time=first_token_time,
                    logprobs=_chosen_logprobs(piece.logprobs, token_ids) if wants_logprobs else None,
                    token_logprobs=self._entries(piece.logprobs, token_ids, request.sampling.top_logprobs)
                    if request.sampling.logprobs
                    else None,
                    prompt_logprobs=self._prompt_entries(out.prompt_logprobs, request),
                )
        except VLLMValidationError as e:
            if request.sampling.structured is not None and e.parameter in (None, "structured_outputs", "guided_json"):
                raise _schema_refused(request.sampling.structured, e) from None
            raise InvalidRequest(f"vLLM refused the request: {e}", param=e.parameter) from None
        except ValueError as e:  # vLLM's structured-output backend refusing a grammar it cannot compile
            if request.sampling.structured is None or first_token_time is not None:
                raise
            raise _schema_refused(request.sampling.structured, e) from None
        except EngineDeadError as e:
            raise EngineDead(f"the vLLM engine died: {e}") from None
        finally:
            with self._lock:
                self._streaming.discard(rid)
        if not finished:  # aborted from outside (cancel): vLLM ends the stream without a last output
            yield RequestOutput(rid, [], "", True, "abort", prompt_tokens, completion, first_token_time)

    def cancel(self, request_id: str) -> None:
        """Abort ``request_id`` in vLLM (frees its KV blocks); call from the event loop that generates."""
        task = asyncio.get_running_loop().create_task(self._running().abort(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    def _entries(self, logprobs, token_ids: list[int], k: int) -> list[TokenLogprob] | None:  # type: ignore[no-untyped-def]
        """OpenAI's entry per token: vLLM's per-step dict (the chosen token plus the ``k`` most likely,
        each with its rank) -> the chosen token's logprob and the top ``k`` by rank."""
        if logprobs is None or self._token_text is None:
            return None
        out = []
        for step, token in zip(logprobs, token_ids, strict=True):
            top = sorted((lp.rank, tid, _finite(lp.logprob)) for tid, lp in step.items() if lp.rank is not None)[:k]
            out.append(
                self._token_text.entry(
                    token, _finite(step[token].logprob), [t for _, t, _ in top], [v for _, _, v in top]
                )
            )
        return out

    def _prompt_entries(self, logprobs, request: EngineRequest) -> list[TokenLogprob] | None:  # type: ignore[no-untyped-def]
        """vLLM's prompt logprobs (None for the first token, then per position the prompt token plus
        the ``k`` most likely, with ranks) -> OpenAI's entries, the first with logprob None. With delta
        outputs vLLM hands them over once, whole, at the end of the prefill (an empty list after that)."""
        k = request.sampling.prompt_logprobs
        if not logprobs or k is None or self._token_text is None:
            return None
        ids = request.prompt_token_ids
        if len(logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {len(logprobs)} prompt logprobs for {len(ids)} prompt tokens")
        text, raw = self._token_text.of(ids[0])
        entries = [TokenLogprob(token=text, logprob=None, bytes=raw)]
        entries += self._entries(logprobs[1:], ids[1:], k) or []
        return entries

    def _observe(self, stats) -> None:  # type: ignore[no-untyped-def]
        total = self._stats.kv_blocks_total
        self._stats = EngineStats(
            running=stats.num_running_reqs,
            waiting=stats.num_waiting_reqs + stats.num_skipped_waiting_reqs,
            kv_blocks_free=round(total * (1 - stats.kv_cache_usage)),
            kv_blocks_total=total,
            prefix_queried_tokens=self._stats.prefix_queried_tokens + stats.prefix_cache_stats.queries,
            prefix_hit_tokens=self._stats.prefix_hit_tokens + stats.prefix_cache_stats.hits,
        )

    def _lora_of(self, key: str | None) -> LoRARequest | None:
        if key is None:
            return None
        adapter = self._loras.get(key)
        if adapter is None:
            raise ServiceUnavailable(f"adapter {key} is not loaded in this worker's vLLM engine")
        return adapter.lora

    def _running(self) -> AsyncLLM:
        if self._llm is None:
            raise EngineDead("the vLLM engine is not started")
        return self._llm


def _finite(logprob: float) -> float:
    """OpenAI's (and vLLM's server's) -9999.0 for a token of probability 0: JSON has no -inf."""
    return max(float(logprob), -9999.0)


def _chosen_logprobs(logprobs, token_ids: list[int]) -> list[float] | None:  # type: ignore[no-untyped-def]
    if logprobs is None:
        return None
    return [float(step[token].logprob) for step, token in zip(logprobs, token_ids, strict=True)]
