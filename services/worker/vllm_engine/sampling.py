"""lorafleet's sampling parameters as vLLM's, one to one; what vLLM cannot honour is refused, typed."""

from typing import Any

from vllm import SamplingParams as VllmSamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from services.worker.engine.errors import RequestTooLarge, UnsupportedSampling
from shared.schemas import SamplingParams, StructuredOutput

# Every field of shared.schemas.SamplingParams that has a vLLM counterpart with the built-in
# engine's semantics (temperature 0 = greedy, top_k 0 = off, stop strings cut from the text,
# special tokens skipped, stop token ids end the output without their text, logprobs of the raw
# distribution, prompt logprobs likewise (vLLM computes them from the raw logits whatever its
# logprobs_mode; the engine runs "raw_logprobs", so output and prompt logprobs share the
# convention), JSON grammars through vLLM's structured outputs, xgrammar backend, compact JSON).
# A field added to the schema and not here is refused when set.
MAPPED = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "ignore_eos",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "logit_bias",
        "stop_token_ids",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "structured",
    }
)
_ANY_OBJECT = '{"type": "object"}'  # JSON mode as on the built-in engine: any object, not any JSON value


def to_vllm(params: SamplingParams, *, prompt_tokens: int, max_model_len: int, logprobs: bool) -> VllmSamplingParams:
    """vLLM's parameters for one request, streaming deltas.

    Raises RequestTooLarge as the built-in engine does (a prompt that leaves no room to generate),
    and UnsupportedSampling for a parameter vLLM cannot honour. ``max_tokens`` past the model
    length ends at the model length ("length"), as on the built-in engine.
    """
    if prompt_tokens == 0 or prompt_tokens >= max_model_len:
        raise RequestTooLarge(
            f"prompt has {prompt_tokens} tokens; this engine accepts 1 to {max_model_len - 1}", param="prompt"
        )
    fields = type(params).model_fields
    unmapped = sorted(name for name in fields if name not in MAPPED and getattr(params, name) != _default(params, name))
    if unmapped:
        raise UnsupportedSampling(f"the vLLM engine cannot honour {', '.join(unmapped)}", param=unmapped[0])
    try:
        return VllmSamplingParams(
            max_tokens=min(params.max_tokens, max_model_len - prompt_tokens),
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            stop=list(params.stop),
            ignore_eos=params.ignore_eos,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            min_p=params.min_p,
            logit_bias=dict(params.logit_bias) or None,
            stop_token_ids=list(params.stop_token_ids),
            logprobs=params.top_logprobs if params.logprobs else (0 if logprobs else None),
            prompt_logprobs=params.prompt_logprobs,
            structured_outputs=_structured(params.structured),
            skip_special_tokens=True,
            output_kind=RequestOutputKind.DELTA,
        )
    except VLLMValidationError as e:
        raise UnsupportedSampling(f"vLLM refused the sampling parameters: {e}", param=e.parameter) from None


def _structured(spec: StructuredOutput | None) -> StructuredOutputsParams | None:
    if spec is None:
        return None
    if spec.structural_tag is not None:  # tool calls (services/worker/tool_grammar.py)
        return StructuredOutputsParams(structural_tag=spec.structural_tag)
    return StructuredOutputsParams(json=spec.json_schema or _ANY_OBJECT, disable_any_whitespace=True)


def _default(params: SamplingParams, name: str) -> Any:
    field = type(params).model_fields[name]
    return field.get_default(call_default_factory=True)
