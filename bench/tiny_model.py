"""A tiny random Llama with the SmolLM2 tokenizer: a real model directory that every service can
load in a second, for tests and benchmarks that exercise the platform rather than the model."""

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


# name in the model cache -> (hidden size, attention heads): "tiny-llama-h64" has SmolLM2's head size,
# 64, which vLLM's CPU attention supports (it refuses 16)
TINY_MODELS = {"tiny-llama": (64, 4), "tiny-llama-h64": (128, 2)}


def make_tiny_model(directory: Path, hidden_size: int = 64, num_heads: int = 4, max_positions: int = 2048) -> Path:
    """A random 2-layer Llama (64 wide by default) with the SmolLM2 tokenizer (so every service tokenises alike)."""
    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from shared.base_model import resolve_model_dir

    smol = resolve_model_dir(None, Path(os.environ["LF_MODEL_CACHE"]))
    ref = AutoConfig.from_pretrained(smol)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=ref.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=ref.bos_token_id,
        eos_token_id=ref.eos_token_id,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (smol / name).is_file():
            shutil.copy(smol / name, directory / name)
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    if "chat_template" not in tokenizer_config:  # the gateway reads the template from here
        tokenizer_config["chat_template"] = (smol / "chat_template.jinja").read_text()
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def cached_tiny_model(cache: Path, name: str) -> Path:
    """``cache/name``, one of TINY_MODELS, made on first use (seeded, so every run gets the same weights)."""
    target = cache / name
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent)) / name
        staging.mkdir()
        make_tiny_model(staging, *TINY_MODELS[name])
        with contextlib.suppress(OSError):  # another run made it meanwhile
            os.replace(staging, target)
        shutil.rmtree(staging.parent, ignore_errors=True)
    return target
