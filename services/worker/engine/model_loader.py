"""Load the base model for the engine: the HF model and tokenizer of a resolved directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared.base_model import resolve_model_dir, served_model_name

if TYPE_CHECKING:  # torch and transformers load lazily
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True)
class LoadedModel:
    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    directory: Path


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

    dtype = dtype or torch.float32
    directory = resolve_model_dir(model_dir, cache_dir)
    family_of(AutoConfig.from_pretrained(directory))  # refuse before any weight is read
    tokenizer = AutoTokenizer.from_pretrained(directory)
    # PreTrainedModel.to is functools.wraps(Module.to), whose stub mypy does not bind to the instance
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    return LoadedModel(
        name=served_model_name(model_dir, directory), model=model, tokenizer=tokenizer, directory=directory
    )
