"""Load the base model for the engine: the HF model and tokenizer of a resolved directory.

A pre-quantized checkpoint (prequant.py) loads without transformers' quantizers: the model is built on
the meta device, its unquantized tensors (embedding, norms, biases, lm_head) assigned from the files in
the serving dtype, and each quantized projection converted into ``LoadedModel.packed``; its plain weight
stays a meta tensor of the logical shape, so no full-precision copy of it is ever made.
"""

from __future__ import annotations

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
    family = family_of(config)  # refuse before any weight is read
    quant = checkpoint_quant(config)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if quant is not None:
        if family.moe is not None or torch.device(device).type != "cpu":
            from services.worker.engine.errors import UnsupportedQuantization

            raise UnsupportedQuantization(
                f"a {quant.method} checkpoint is served by the CPU engine for dense families, not "
                f"{config.model_type} on {device}",
                param="model",
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
            tensors |= {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118  # safe_open is not iterable
    packed = {
        module: checked(read_linear(quant, tensors, module), module)
        for module in quantized_modules(quant, list(tensors))
    }
    plain = copy.deepcopy(config)
    del plain.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(plain, dtype=dtype)  # type: ignore[no-untyped-call]
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    result = model.load_state_dict(state, strict=False, assign=True)
    head = model.get_output_embeddings()
    missing = set(result.missing_keys) - {f"{m}.weight" for m in packed}
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
