"""Both on-disk forms of a mixture-of-experts checkpoint serve exactly: one tensor per expert and
projection (what transformers' ``save_pretrained`` writes, and older checkpoints hold: Mixtral's
``block_sparse_moe.experts.N.w1/w3/w2``, Qwen-MoE's and OLMoE's ``mlp.experts.N.gate_proj/up_proj/down_proj``)
and the fused form transformers holds in memory (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj``)."""

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.engine import EngineConfig, LLMEngine
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.engine.sequence import EngineRequest
from shared.schemas import SamplingParams
from tests.helpers.families import MOE_FAMILIES, PROMPTS, save_family

NEW_TOKENS = 6
# family -> (the block's name on disk, the on-disk names of gate, up and down)
PER_EXPERT = {
    "mixtral-window-8": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2-moe-shared-expert-dense-first": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "olmoe-wide-qk-norm": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


def _fuse_experts(directory: Path, block: str, names: tuple[str, str, str]) -> None:
    """Rewrite the saved per-expert tensors in transformers' fused in-memory form."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    expert = re.compile(rf"^(.*)\.{block}\.experts\.(\d+)\.(\w+)\.weight$")
    fused: dict[str, torch.Tensor] = {}
    parts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = expert.match(key)
        if match is not None:
            parts.setdefault((match[1], match[3]), {})[int(match[2])] = tensor
        else:
            fused[key.replace(f".{block}.gate.", ".mlp.gate.")] = tensor
    for prefix in sorted({prefix for prefix, _ in parts}):
        gate, up, down = ([t for _, t in sorted(parts[prefix, name].items())] for name in names)
        fused[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat(p) for p in zip(gate, up, strict=True)])
        fused[f"{prefix}.mlp.experts.down_proj"] = torch.stack(down)
    save_file(fused, path, metadata={"format": "pt"})


def _serve(loaded: LoadedModel) -> list[list[int]]:
    config = EngineConfig(kv_cache_bytes=16 * 2**20, max_model_len=64, max_num_batched_tokens=256)
    engine = LLMEngine.from_loaded(loaded, config)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(EngineRequest(str(i), prompt, params))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return [tokens[str(i)] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("family", list(PER_EXPERT))
def test_moe_checkpoint_serves_as_transformers_generates(family: str, fused: bool, tmp_path: Path) -> None:
    model = MOE_FAMILIES[family]()
    save_family(model, tmp_path)
    block, names = PER_EXPERT[family]
    saved = load_file(tmp_path / "model.safetensors")
    assert f"model.layers.1.{block}.experts.0.{names[0]}.weight" in saved  # save_pretrained's per-expert form
    if fused:
        _fuse_experts(tmp_path, block, names)
        assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(tmp_path / "model.safetensors")
    expected = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)  # type: ignore[operator]
        expected.append([int(t) for t in out[0, len(prompt) :]])
    loaded = load_model(str(tmp_path))
    for mine, theirs in zip(loaded.model.model.layers, model.model.layers, strict=True):  # type: ignore[union-attr]
        if hasattr(theirs.mlp, "experts"):
            assert torch.equal(mine.mlp.experts.gate_up_proj, theirs.mlp.experts.gate_up_proj)
            assert torch.equal(mine.mlp.experts.down_proj, theirs.mlp.experts.down_proj)
            assert torch.equal(mine.mlp.gate.weight, theirs.mlp.gate.weight)
    assert _serve(loaded) == expected
