"""Real PEFT LoRA adapters on a tiny random Llama, saved the way users ship them."""

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from nats.aio.client import Client as NATS
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from lorafleet.cli.adapter_cmd import push_adapter
from shared import subjects
from shared.bus import request
from shared.schemas import AdapterRecordsReply, PromoteRequest

TINY_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(**TINY_LLAMA)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config()).eval()


def make_peft_model(
    base: LlamaForCausalLM,
    *,
    rank: int = 8,
    alpha: float = 16,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    seed: int = 0,
    **extra: Any,
) -> PeftModel:
    """A LoRA model on a copy of ``base`` with random non-zero A and B (init_lora_weights=False)."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        init_lora_weights=False,
        **extra,
    )
    return get_peft_model(copy.deepcopy(base), config).eval()


def save_peft_adapter(directory: Path, base: LlamaForCausalLM | None = None, **options: Any) -> Path:
    """Save a PEFT adapter (adapter_config.json + adapter_model.safetensors) into ``directory``."""
    make_peft_model(base if base is not None else tiny_llama(), **options).save_pretrained(directory)
    return directory


def edit_adapter_config(directory: Path, **changes: Any) -> None:
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def peft_delta(model: PeftModel, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
    """What PEFT adds to one projection's output for input x: lora_layer(x) - base_layer(x)."""
    block = model.base_model.model.model.layers[layer]
    lora_layer = getattr(block.self_attn if hasattr(block.self_attn, module) else block.mlp, module)
    with torch.no_grad():
        return lora_layer(x) - lora_layer.base_layer(x)


async def push_released(nc: NATS, dirs: dict[str, Path], *, fingerprint: str, sign_key: Path) -> dict[str, int]:
    """Push each adapter directory as tenant demo's (signed with ``sign_key``) and promote it to 100%:
    adapter id -> version."""
    versions = {}
    for name, directory in dirs.items():
        record = await push_adapter(
            nc,
            directory,
            adapter_id=name,
            tenant_id="demo",
            task_type="chat",
            base_fingerprint=fingerprint,
            sign_key=sign_key,
            who="test",
        )
        promote = PromoteRequest(adapter_id=name, version=record.version, traffic_percent=100, actor="test")
        await request(nc, subjects.registry("promote"), promote, AdapterRecordsReply, 10)
        versions[name] = record.version
    return versions


def assert_greedy_matches_peft(
    peft: PeftModel,
    prompts: Sequence[list[int]],
    cases: Sequence[tuple[int, str | None]],
    tokens: dict[str, list[int]],
    logprobs: dict[str, list[float]],
) -> None:
    """Each case's (prompt index, adapter or None = base) greedy tokens ``tokens["<i>-<name>"]`` are PEFT's
    argmax, and their ``logprobs`` PEFT's within 1e-4."""
    for i, name in cases:
        ids = torch.tensor([prompts[i] + tokens[f"{i}-{name}"]])
        with torch.no_grad():
            if name is None:
                with peft.disable_adapter():
                    logits = peft(input_ids=ids).logits[0].float()
            else:
                peft.set_adapter(name)
                logits = peft(input_ids=ids).logits[0].float()
        expected = logits[len(prompts[i]) - 1 : -1].log_softmax(-1)
        out_ids = torch.tensor(tokens[f"{i}-{name}"])
        assert torch.equal(expected.argmax(-1), out_ids), f"prompt {i} adapter {name}"
        got = torch.tensor(logprobs[f"{i}-{name}"])
        torch.testing.assert_close(got, expected.gather(1, out_ids[:, None])[:, 0], atol=1e-4, rtol=0)
