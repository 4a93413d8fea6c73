"""A tiny random Llama with the SmolLM2 tokenizer: a real model directory that every service can
load in a second, for tests and benchmarks that exercise the platform rather than the model."""

import json
import os
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def make_tiny_model(directory: Path) -> Path:
    """A random 2-layer, 64-wide Llama with the SmolLM2 tokenizer (so every service tokenises alike)."""
    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from shared.base_model import resolve_model_dir

    smol = resolve_model_dir(None, Path(os.environ["LF_MODEL_CACHE"]))
    ref = AutoConfig.from_pretrained(smol)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=ref.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
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
