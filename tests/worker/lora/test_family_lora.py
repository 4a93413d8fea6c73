"""LoRA on every served family (on MoE families: attention, and the dense layers' MLP; experts:
tests/worker/lora/test_expert_lora.py): greedy tokens through the engine equal HF PEFT, one adapter on the
attention projections and one on every projection (Phi-3's on its fused modules, split at load)."""

import copy
from pathlib import Path

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import GenerationConfig, PreTrainedModel

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.model_loader import LoadedModel
from services.worker.lora import MODULES, AdapterManager, LoraConfig, ModelShapes
from services.worker.lora.fused import split_fused
from shared.errors import IntegrityError
from shared.schemas import SamplingParams
from tests.helpers.adapters import ALL_MODULES
from tests.helpers.families import FAMILIES, MOE_FAMILIES, PROMPTS, word_tokenizer

NEW_TOKENS = 8
Adapters = dict[str, tuple[int, int, tuple[str, ...]]]
ADAPTERS: Adapters = {"attn-r8": (8, 96, ("q_proj", "k_proj", "v_proj", "o_proj")), "all-r16": (16, 192, ALL_MODULES)}
PHI3_ADAPTERS: Adapters = {
    "attn-r8": (8, 96, ("self_attn.qkv_proj", "o_proj")),  # by path: PEFT matches an entry as a suffix
    "all-r16": (16, 192, ("qkv_proj", "o_proj", "mlp.gate_up_proj", "down_proj")),
}
SERVED = [f for f in FAMILIES if not f.startswith("phi3")]
MOE_ADAPTERS: Adapters = {"attn-r8": ADAPTERS["attn-r8"], "qvo-r16": (16, 24, ("q_proj", "v_proj", "o_proj"))}


def _peft(model: PreTrainedModel, root: Path, adapters: Adapters, layers: list[int] | None = None) -> PeftModel:
    peft: PeftModel | None = None
    for seed, (name, (rank, alpha, modules)) in enumerate(adapters.items()):
        torch.manual_seed(seed)
        config = PeftLoraConfig(
            r=rank, lora_alpha=alpha, target_modules=list(modules), init_lora_weights=False, layers_to_transform=layers
        )
        if peft is None:
            peft = get_peft_model(copy.deepcopy(model), config, adapter_name=name)
        else:
            peft.add_adapter(name, config)
    assert peft is not None
    peft.eval()
    peft.save_pretrained(str(root), selected_adapters=list(adapters))
    return peft


def _manager(model: PreTrainedModel) -> AdapterManager:
    shapes = ModelShapes.from_hf_config(model.config)
    per_rank = shapes.params_per_rank(MODULES) * 4
    config = LoraConfig(
        rank_classes=(8, 16), class_shares=(1.0, 2.0), memory_budget_bytes=int(24 * per_rank * 1.01), max_num_tokens=512
    )
    return AdapterManager(config, shapes)


def _reference(peft: PeftModel, prompt: list[int], adapter: str | None) -> list[int]:
    generation = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        if adapter is None:
            with peft.disable_adapter():
                out = peft.generate(input_ids=ids, generation_config=generation)
        else:
            peft.set_adapter(adapter)
            out = peft.generate(input_ids=ids, generation_config=generation)
    return [int(t) for t in out[0, ids.shape[1] :]]


@pytest.mark.parametrize("family", SERVED)
def test_lora_greedy_matches_peft(family: str, tmp_path: Path) -> None:
    _check_against_peft(FAMILIES[family](), tmp_path, ADAPTERS)


def _check_against_peft(
    model: PreTrainedModel, tmp_path: Path, adapters: Adapters, layers: list[int] | None = None
) -> None:
    family = type(model).__name__
    peft = _peft(model, tmp_path, adapters, layers)
    manager = _manager(model)
    for adapter in adapters:
        manager.load_adapter(adapter, tmp_path / adapter)
    loaded = LoadedModel(
        name=family, model=model, tokenizer=word_tokenizer(model.config.vocab_size), directory=tmp_path
    )
    config = EngineConfig(kv_cache_bytes=16 * 2**20, max_model_len=64, max_num_batched_tokens=512)
    engine = LLMEngine.from_loaded(loaded, config, manager)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    names: list[str | None] = [*adapters, None]
    cases = [(i, name) for i in range(len(PROMPTS)) for name in names]
    for i, name in cases:
        engine.add_request(EngineRequest(f"{i}-{name}", PROMPTS[i], params, adapter=name))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    for i, name in cases:
        assert tokens[f"{i}-{name}"] == _reference(peft, PROMPTS[i], name), f"prompt {i} adapter {name}"
    changed = [(i, name) for i, name in cases if name is not None and tokens[f"{i}-{name}"] != tokens[f"{i}-None"]]
    assert changed, "no adapter changes a greedy output: too weak to test"


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.startswith("phi3")])
def test_phi3_fused_adapters_split_and_match_peft(family: str, tmp_path: Path) -> None:
    """Phi-3 adapters target the fused qkv_proj / gate_up_proj; split per module they equal PEFT."""
    _check_against_peft(FAMILIES[family](), tmp_path, PHI3_ADAPTERS)


def test_fused_adapter_with_wrong_rows_is_refused() -> None:
    shapes = ModelShapes.from_hf_config(FAMILIES["phi3-fused"]().config)
    tensors = {"base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight": torch.zeros(10, 8)}
    with pytest.raises(IntegrityError, match=r"qkv_proj.lora_B.weight has shape \(10, 8\), expected 128 rows"):
        split_fused({"target_modules": ["qkv_proj"]}, tensors, shapes)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_moe_attention_lora_greedy_matches_peft(family: str, tmp_path: Path) -> None:
    _check_against_peft(MOE_FAMILIES[family](), tmp_path, MOE_ADAPTERS)


def test_moe_models_dense_layer_mlp_lora_matches_peft(tmp_path: Path) -> None:
    """Qwen2-MoE's mlp_only_layers are a plain MLP: an adapter on layer 0's gate/up/down is served."""
    adapters: Adapters = {"mlp-r8": (8, 96, ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))}  # by path: PEFT 0.22
    # reads a bare MLP name on an MoE model as the routed experts' fused tensors too
    _check_against_peft(MOE_FAMILIES["qwen2-moe-shared-expert-dense-first"](), tmp_path, adapters, layers=[0])
