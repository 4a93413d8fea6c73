"""Load the base model for the engine: the HF model and tokenizer of a resolved directory.

A pre-quantized checkpoint (prequant.py) loads without transformers' quantizers: the model is built on
the meta device, its unquantized tensors (embedding, norms, biases, lm_head) assigned from the files in
the serving dtype, and each quantized projection converted into ``LoadedModel.packed``; its plain weight
stays a meta tensor of the logical shape, so no full-precision copy of it is ever made. A mixture-of-experts
checkpoint quantizes each expert's gate, up and down as modules of their own (``mlp.experts.E.gate_proj``,
Mixtral's ``block_sparse_moe.experts.E.w1/w3/w2``): they enter ``packed`` under the first form, and the
fused expert tensors transformers holds stay meta. The router and Qwen2-MoE's shared-expert gate are read plain.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.base_model import resolve_model_dir, served_model_name

if TYPE_CHECKING:  # torch and transformers load lazily
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from services.worker.engine.prequant import CheckpointQuant, PackedLinear


@dataclass(frozen=True, slots=True)
class LoadedModel:
    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    directory: Path
    packed: dict[str, PackedLinear] = field(default_factory=dict)  # module name -> a pre-quantized projection


# Mixtral's on-disk names of its sparse block and of its experts' w1, w3, w2 (gate, up, down)
MIXTRAL_BLOCK = re.compile(r"\.block_sparse_moe\.")
MIXTRAL_EXPERT = re.compile(r"(\.experts\.\d+\.)w([123])\.")
EXPERT_PROJECTIONS = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}
EXPERT_MODULE = re.compile(r"^(.*\.mlp)\.experts\.\d+\.(gate_proj|up_proj|down_proj)$")
ROUTERS = (".mlp.gate", ".mlp.shared_expert_gate")  # routing stays plain: a quantized one is refused


def load_model(
    model_dir: str | None = None,
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    cache_dir: Path | None = None,
) -> LoadedModel:
    """The model of ``model_dir`` (the embedded SmolLM2 when None) in ``dtype`` on ``device``.

    Pass the engine's serving dtype: transformers then reads each safetensors tensor (memory-mapped)
    straight into that dtype, so a bf16 deployment never holds an fp32 copy, and the engine's
    weight views (``load_weights``) share these tensors instead of converting them again.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from services.worker.engine.families import family_of
    from services.worker.engine.prequant import checkpoint_quant

    dtype = dtype or torch.float32
    directory = resolve_model_dir(model_dir, cache_dir)
    config = AutoConfig.from_pretrained(directory)
    family_of(config)  # refuse before any weight is read
    quant = checkpoint_quant(config)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if quant is not None:
        if torch.device(device).type != "cpu":
            from services.worker.engine.errors import UnsupportedQuantization

            raise UnsupportedQuantization(
                f"a {quant.method} checkpoint is served by the CPU engine, not on {device}", param="model"
            )
        model, packed = _load_prequantized(directory, config, quant, dtype)
        name = served_model_name(model_dir, directory)
        return LoadedModel(name=name, model=model, tokenizer=tokenizer, directory=directory, packed=packed)
    # PreTrainedModel.to is functools.wraps(Module.to), whose stub mypy does not bind to the instance
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    return LoadedModel(
        name=served_model_name(model_dir, directory), model=model, tokenizer=tokenizer, directory=directory
    )


def _load_prequantized(
    directory: Path, config: Any, quant: CheckpointQuant, dtype: torch.dtype
) -> tuple[PreTrainedModel, dict[str, PackedLinear]]:
    """The model skeleton with its unquantized tensors, and every quantized projection by module name."""
    import copy

    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, GenerationConfig

    from services.worker.engine.errors import UnsupportedQuantization
    from services.worker.engine.prequant import checked, quantized_modules, read_linear

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors |= {memory_name(key): f.get_tensor(key) for key in f.keys()}  # noqa: SIM118  # safe_open is not iterable
    modules = quantized_modules(quant, list(tensors))
    routers = [m for m in modules if m.endswith(ROUTERS)]
    if routers:
        raise UnsupportedQuantization(
            f"{directory}: the {quant.method} checkpoint quantizes the router {routers[0]}, which the engine "
            "reads plain (as GPTQ, AWQ and llm-compressor leave it)",
            param="model",
        )
    packed = {module: checked(read_linear(quant, tensors, module), module) for module in modules}
    plain = copy.deepcopy(config)
    del plain.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(plain, dtype=dtype)  # type: ignore[no-untyped-call]
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    result = model.load_state_dict(state, strict=False, assign=True)
    head = model.get_output_embeddings()
    sparse = {match[1] for m in packed if (match := EXPERT_MODULE.match(m))}  # their fused experts stay meta
    fused = {f"{block}.experts.{name}" for block in sparse for name in ("gate_up_proj", "down_proj")}
    missing = set(result.missing_keys) - {f"{m}.weight" for m in packed} - fused
    if plain.tie_word_embeddings and "lm_head.weight" in missing:
        head.weight = model.get_input_embeddings().weight
        missing.discard("lm_head.weight")
    if missing or result.unexpected_keys:
        detail = f"lacks {sorted(missing)[0]}" if missing else f"holds {sorted(result.unexpected_keys)[0]}"
        raise UnsupportedQuantization(
            f"{directory}: the {quant.method} checkpoint {detail}, which the engine does not read", param="model"
        )
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model.eval(), packed


def memory_name(key: str) -> str:
    """A checkpoint tensor's name as transformers holds the module (Mixtral's ``block_sparse_moe.experts.E.w1``
    -> ``mlp.experts.E.gate_proj``); other names as they are."""
    key = MIXTRAL_BLOCK.sub(".mlp.", key)
    return MIXTRAL_EXPERT.sub(lambda m: f"{m[1]}{EXPERT_PROJECTIONS[m[2]]}.", key)
