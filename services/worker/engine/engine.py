"""The synchronous engine: each step schedules, runs one forward pass and postprocesses."""

import time
from collections.abc import Callable

import structlog
import torch
from transformers import PreTrainedTokenizerBase

from kernels.native import argmax as native_argmax
from services.worker.engine.attention import use_native_decode
from services.worker.engine.batch import StepBatch, build_batch
from services.worker.engine.batch_scheduler import BatchScheduler
from services.worker.engine.cuda_graph import DecodeGraphs, graph_batch_sizes
from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.errors import DuplicateRequest, RequestTooLarge, UnsupportedModel, UnsupportedSampling
from services.worker.engine.grammar import Grammars
from services.worker.engine.kv_cache import BlockManager, KVCache, blocks_for_budget
from services.worker.engine.linear import LinearFactory
from services.worker.engine.lora_hook import LoraHook, LoraProvider
from services.worker.engine.model import LlamaForward, use_native_layer_ops
from services.worker.engine.model_loader import LoadedModel
from services.worker.engine.prompt_logprobs import prompt_entries
from services.worker.engine.rank_skew import RankSkew
from services.worker.engine.sampler import Sampled, sample
from services.worker.engine.sequence import EngineRequest, RequestOutput, Sequence
from services.worker.engine.token_text import TokenText
from services.worker.engine.weights import ModelWeights, load_weights
from shared import metrics
from shared.config import GrammarBounds
from shared.schemas import TokenLogprob

log = structlog.get_logger("engine")

PromptLogprobs = dict[str, list[TokenLogprob]]  # request id -> its prompt's entries


def step_shares(step_s: float, fed: list[int]) -> list[float]:
    """The step's seconds split over its rows by the tokens each fed it (a prefill row its prompt
    tokens this step, a decode row one): the shares sum to ``step_s``."""
    total = sum(fed)
    return [step_s * n / total for n in fed] if total else [0.0] * len(fed)


def rank_mix(lora: LoraHook | None) -> str:
    """A step's rank-mix label: ``base`` (no adapter token), ``r16``, or the classes joined, ``r8+r64``."""
    return "+".join(f"r{rank}" for rank in lora.ranks) if lora is not None else "base"


class LLMEngine:
    """Continuous batching over a paged KV cache; not thread-safe (AsyncEngine owns it from one thread)."""

    def __init__(
        self,
        weights: ModelWeights,
        tokenizer: PreTrainedTokenizerBase,
        config: EngineConfig,
        eos_token_ids: set[int],
        adapter_manager: LoraProvider | None = None,
        grammar_bounds: GrammarBounds | None = None,
    ):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.adapter_manager = adapter_manager
        spec = weights.spec
        num_blocks = config.num_blocks or blocks_for_budget(
            spec, config.kv_block_size, config.torch_dtype, config.kv_cache_bytes
        )
        if num_blocks < 1:
            raise ValueError("kv_cache_bytes is too small for one KV block")
        scratch = 1 if config.cuda_graphs else 0  # the graphs' padding rows write to a block past the allocator's
        self.cache = KVCache(spec, num_blocks + scratch, config.kv_block_size, config.torch_dtype, config.device)
        self.blocks = BlockManager(num_blocks, config.kv_block_size, config.enable_prefix_caching)
        self.scheduler = BatchScheduler(config, self.blocks, adapter_manager)
        native = use_native_decode(config.cpu_attention, config.device, config.torch_dtype, spec.head_dim)
        linear = LinearFactory(
            config.cpu_linear, config.device, config.torch_dtype, config.weights, config.weight_group_size
        )
        layer_ops = use_native_layer_ops(config.cpu_layer_ops, config.device, config.torch_dtype)
        loop = config.cpu_layer_loop == "auto"
        self.model = LlamaForward(
            weights, linear, native_attention=native, native_layer_ops=layer_ops, native_layer_loop=loop
        )
        if self.model.loop is not None:
            log.info("native_layer_loop", dtype=str(config.torch_dtype), path=self.model.proj[0]["qkv"].path)
        self._argmax: Callable[[torch.Tensor], torch.Tensor] | None = native_argmax if layer_ops else None
        self.graphs: DecodeGraphs | None = None
        if config.cuda_graphs and any(layer.experts is not None for layer in weights.layers):
            raise UnsupportedModel(
                "cuda_graphs is not supported for a mixture-of-experts model: its expert groups are sized on the "
                "host each step, which a captured graph cannot replay",
                param="cuda_graphs",
            )
        if config.cuda_graphs:
            sizes = graph_batch_sizes(config.max_num_seqs)
            hook = adapter_manager.graph_hook(sizes[-1]) if adapter_manager is not None else None
            self.graphs = DecodeGraphs(self.model, self.cache, num_blocks, config.max_model_len, sizes, lora=hook)
        self.vocab_size = spec.vocab_size
        self.grammars = Grammars(
            tokenizer, spec.vocab_size, eos_token_ids, config.max_num_seqs, config.grammar_cache, grammar_bounds
        )
        self.token_text = TokenText(tokenizer)
        self._seqs: dict[str, Sequence] = {}
        self.rank_skew = RankSkew(min(adapter_manager.rank_classes)) if adapter_manager is not None else None

    @classmethod
    def from_loaded(
        cls,
        loaded: LoadedModel,
        config: EngineConfig,
        adapter_manager: LoraProvider | None = None,
        grammar_bounds: GrammarBounds | None = None,
    ) -> "LLMEngine":
        """Build from the worker's loaded transformers model (weights shared, not copied, when dtypes match)."""
        weights = load_weights(loaded.model, config.torch_dtype, config.device, config.max_model_len, loaded.packed)
        eos = loaded.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        if loaded.tokenizer.eos_token_id is not None:
            eos_ids.add(loaded.tokenizer.eos_token_id)
        return cls(weights, loaded.tokenizer, config, eos_ids, adapter_manager, grammar_bounds)

    @property
    def num_blocks(self) -> int:
        """KV blocks the sequences may hold (the cache has one more, the graphs' scratch, with cuda_graphs)."""
        return self.blocks.allocator.num_blocks

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raises RequestTooLarge when it could never fit this engine."""
        if request.request_id in self._seqs:
            raise DuplicateRequest(f"request {request.request_id!r} is already in the engine")
        prompt = len(request.prompt_token_ids)
        limit = self.config.max_model_len
        if prompt == 0 or prompt >= limit:
            raise RequestTooLarge(f"prompt has {prompt} tokens; this engine accepts 1 to {limit - 1}", param="prompt")
        longest = min(prompt + request.sampling.max_tokens, limit)
        capacity = self.num_blocks * self.config.kv_block_size
        if self.blocks.blocks_needed(longest) > self.num_blocks:
            raise RequestTooLarge(
                f"prompt + max_tokens = {longest} tokens exceeds the whole KV cache ({capacity} tokens)",
                param="max_tokens",
            )
        self._check_token_ids(request)
        seq = Sequence(request, self.tokenizer)
        if request.sampling.structured is not None:
            seq.matcher = self.grammars.matcher(request.sampling.structured, request.tenant or "", request.grammar)
        self._seqs[request.request_id] = seq
        self.scheduler.add(seq)

    def _check_token_ids(self, request: EngineRequest) -> None:
        params = request.sampling
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            outside = [token for token in ids if token >= self.vocab_size]
            if outside:
                raise UnsupportedSampling(
                    f"{name}: token id {outside[0]} is outside the vocabulary (0 to {self.vocab_size - 1})", param=name
                )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request and free its KV blocks; its final output, or None if unknown."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        return self._output(seq, [])

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt block (blocks in use stay with their sequences)."""
        self.blocks.allocator.clear_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the forward pass, sample and detokenise."""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        seqs = plan.decodes + plan.prefills
        fed = [seq.num_new_tokens for seq in seqs]  # after scheduling: prefix-cache hits are not fed
        try:
            logits, lora, prompts, num_tokens = self._forward(plan.decodes, plan.prefills)
        except BaseException:
            self.blocks.rollback()
            raise
        self.blocks.commit()
        constrained = any(seq.matcher is not None for seq in seqs)
        with torch.inference_mode():  # the logits are an inference tensor, changed in place
            sampled = sample(logits, seqs, self.grammars.mask if constrained else None, self._argmax)
        outputs = self._postprocess(seqs, sampled, prompts)
        step_s = time.perf_counter() - started
        for seq, output, share in zip(seqs, outputs, step_shares(step_s, fed), strict=True):
            seq.engine_s += share
            output.engine_s = seq.engine_s
        step_ms = step_s * 1000
        metrics.STEP_TIME.labels(rank_mix(lora)).observe(step_ms)
        if lora is not None and self.rank_skew is not None:
            self.rank_skew.observe(lora.ranks, num_tokens, step_ms)
        return outputs

    def _forward(
        self, decodes: list[Sequence], prefills: list[Sequence]
    ) -> tuple[torch.Tensor, LoraHook | None, PromptLogprobs, int]:
        """The step's logits (a decode-only step through the CUDA graphs when they hold it), its LoRA
        hook, prompt logprobs and token count."""
        if self.graphs is not None and not prefills and self.graphs.fits(decodes):
            return self.graphs.run(decodes), self.graphs.hook, {}, len(decodes)
        batch = build_batch(decodes, prefills, self.config.kv_block_size, self.config.device)
        logits, lora, prompts = self._run(batch)
        return logits, lora, prompts, len(batch.input_ids)

    def _run(self, batch: StepBatch) -> tuple[torch.Tensor, LoraHook | None, PromptLogprobs]:
        lora = None
        if self.adapter_manager is not None and batch.has_adapters:
            lora = self.adapter_manager.prepare(batch.token_slots)
        prefills = batch.seqs[batch.meta.num_decode :]
        scored = [(seq, bounds) for seq, bounds in zip(prefills, batch.meta.prefill_bounds, strict=True)]
        scored = [(seq, bounds) for seq, bounds in scored if seq.wants_prompt_logprobs]
        if not scored:  # the common step: logits of the last positions only
            logits = self.model.forward(
                batch.input_ids, batch.positions, batch.meta, self.cache, batch.logits_indices, lora
            )
            return logits, lora, {}
        hidden = self.model.hidden(batch.input_ids, batch.positions, batch.meta, self.cache, lora)
        prompts = {}
        for seq, (start, end) in scored:
            # the prefix cache is bypassed for this prefill (BlockManager), so it covers the whole prompt
            assert seq.num_cached == 0 and end - start == seq.num_prompt_tokens, "a partial prompt prefill"
            k = seq.request.sampling.prompt_logprobs or 0
            prompts[seq.request_id] = prompt_entries(
                seq.token_ids, hidden[start : end - 1], self.model.logits, k, self.token_text
            )
        return self.model.logits(hidden[batch.logits_indices]), lora, prompts

    def _postprocess(self, seqs: list[Sequence], sampled: Sampled, prompts: PromptLogprobs) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for row, (seq, token) in enumerate(zip(seqs, sampled.tokens, strict=True)):
            seq.num_cached = seq.num_tokens
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.finish_reason = self._finish_reason(seq, token)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                del self._seqs[seq.request_id]
            output = self._output(seq, [token], sampled, row)
            output.prompt_logprobs = prompts.get(seq.request_id)
            outputs.append(output)
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.request.sampling
        if token in params.stop_token_ids:
            return "stop"  # its text is not part of the output (as on vLLM)
        if seq.matcher is not None and not seq.matcher.accept_token(token):
            raise RuntimeError(f"{seq.request_id}: the sampler chose token {token} outside the grammar")
        if seq.detokenizer.update():
            return "stop"
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop"
        if seq.matcher is not None and seq.matcher.is_terminated():
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, tokens: list[int], sampled: Sampled | None = None, row: int = 0) -> RequestOutput:
        finished = seq.finish_reason is not None
        logprobs = entries = None
        if sampled is not None and sampled.logprobs is not None and tokens:
            logprobs = [sampled.logprobs[row]]
            if seq.request.sampling.logprobs:
                k = seq.request.sampling.top_logprobs
                top_ids = sampled.top_ids[row][:k] if sampled.top_ids is not None else []
                top_lps = sampled.top_logprobs[row][:k] if sampled.top_logprobs is not None else []
                entries = [self.token_text.entry(tokens[0], logprobs[0], top_ids, top_lps)]
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=tokens,
            text=seq.detokenizer.delta(finished),
            finished=finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            first_token_time=seq.first_token_time,
            logprobs=logprobs,
            token_logprobs=entries,
            engine_s=seq.engine_s,
        )
