"""LoRA on a mixture-of-experts model's routed experts (and attention, and Qwen2-MoE's shared expert):
per-token logits within 1e-4 (fp32) of HF PEFT and equal greedy tokens, each adapter alone and in one
batch with a different-rank adapter and a base row. Both expert forms: PEFT's ``target_parameters`` on
transformers' fused expert tensors, and per-expert modules (``mlp.experts.N.gate_proj``, Mixtral's
``block_sparse_moe.experts.N.w1``), which transformers 5 cannot build and PEFT cannot apply, checked
against the base model with each delta merged into its weights."""

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from safetensors.torch import save_file
from transformers import GenerationConfig, PreTrainedModel

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.batch import build_batch
from services.worker.engine.kv_cache import BlockManager, KVCache
from services.worker.engine.linear import LinearFactory
from services.worker.engine.model import LlamaForward
from services.worker.engine.model_loader import LoadedModel
from services.worker.engine.sequence import Sequence
from services.worker.engine.weights import load_weights
from services.worker.lora import MODULES, AdapterManager, LoraConfig, ModelShapes, applier
from services.worker.lora.peft_loader import to_slot_layout
from shared.errors import IntegrityError, UnservedTarget
from shared.schemas import SamplingParams
from tests.helpers.families import MOE_FAMILIES, PROMPTS, QWEN2_MOE_DENSE_GATE, word_tokenizer

BLOCK = 4
NEW_TOKENS = 6
FAMILIES = [
    "mixtral-window-8",
    "qwen2-moe-shared-expert-dense-first",
    "qwen3-moe-qk-norm-normalised",
    "olmoe-wide-qk-norm",
]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# name -> (rank, alpha, target_modules); both also target the experts' fused tensors; the second also Qwen2-MoE's
# shared expert and dense first layer gate_proj (families without them take k_proj: PEFT maps a lone gate_proj
# onto gate_up_proj)
PARAM_ADAPTERS = {
    "experts-r8": (8, 32, ["q_proj", "v_proj"]),
    "experts-r16": (16, 24, ["o_proj", *QWEN2_MOE_DENSE_GATE]),
}


def _manager(model: PreTrainedModel) -> AdapterManager:
    shapes = ModelShapes.from_hf_config(model.config)
    per_rank = shapes.params_per_rank(MODULES) * 4
    config = LoraConfig(
        rank_classes=(8, 16), class_shares=(1.0, 2.0), memory_budget_bytes=int(48 * per_rank * 1.01), max_num_tokens=512
    )
    return AdapterManager(config, shapes)


def _peft_experts(model: PreTrainedModel, root: Path) -> PeftModel:
    """Two target_parameters adapters of different ranks (PEFT: all must target the same parameters);
    on Qwen2-MoE "gate_proj" is the shared expert's (and the dense first layer's)."""
    peft: PeftModel | None = None
    for seed, (name, (rank, alpha, modules)) in enumerate(PARAM_ADAPTERS.items()):
        torch.manual_seed(seed + 1)
        if model.config.model_type != "qwen2_moe":
            modules = [m for m in modules if m not in QWEN2_MOE_DENSE_GATE] + (
                ["k_proj"] if set(QWEN2_MOE_DENSE_GATE) & set(modules) else []
            )
        config = PeftLoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=modules,
            target_parameters=EXPERT_PARAMETERS,
            init_lora_weights=False,
        )
        if peft is None:
            peft = get_peft_model(copy.deepcopy(model), config, adapter_name=name)
        else:
            peft.add_adapter(name, config)
    assert peft is not None
    with torch.no_grad():  # peft's random B is small: scaled up so every adapter moves greedy tokens
        for param_name, param in peft.named_parameters():
            if "lora_B" in param_name:
                param.mul_(4.0)
    peft.eval()
    peft.save_pretrained(str(root), selected_adapters=list(PARAM_ADAPTERS))
    return peft


Reference = Callable[[list[int], str | None], torch.Tensor]  # (token ids, adapter) -> last-token logits


def _peft_reference(peft: PeftModel) -> Reference:
    def logits(ids: list[int], adapter: str | None) -> torch.Tensor:
        with torch.no_grad():
            if adapter is None:
                with peft.disable_adapter():
                    return peft(input_ids=torch.tensor([ids])).logits[0, -1].float()
            peft.set_adapter(adapter)
            return peft(input_ids=torch.tensor([ids])).logits[0, -1].float()

    return logits


def _steps(
    model: PreTrainedModel, manager: AdapterManager, cases: list[tuple[list[int], str | None]], reference: Reference
) -> None:
    """All cases prefilled in one step (one token slot per adapter, -1 for the base row), then decoded
    together: each row's logits against ``reference``, greedy tokens appended."""
    weights = load_weights(model, torch.float32, "cpu", 256)
    forward = LlamaForward(weights, LinearFactory("torch", "cpu", torch.float32))
    cache = KVCache(weights.spec, 64, BLOCK, torch.float32, "cpu")
    blocks = BlockManager(64, BLOCK)
    tokenizer = word_tokenizer(model.config.vocab_size)
    seqs = []
    for i, (prompt, adapter) in enumerate(cases):
        seq = Sequence(EngineRequest(str(i), prompt, adapter=adapter), tokenizer)
        seq.slot = manager.slot_of(adapter) if adapter is not None else -1  # type: ignore[assignment]
        seqs.append(seq)
    running: list[Sequence] = []
    changed = 0
    for step, joining in enumerate([seqs, [], []]):
        for seq in running:
            blocks.append(seq)
        for seq in joining:
            blocks.allocate(seq)
        batch = build_batch(running, joining, BLOCK, "cpu")
        lora = manager.prepare(batch.token_slots)
        logits = forward.forward(batch.input_ids, batch.positions, batch.meta, cache, batch.logits_indices, lora)
        for row, seq in enumerate(batch.seqs):
            adapter = cases[int(seq.request_id)][1]
            expected = reference(seq.token_ids, adapter)
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4, msg=f"step {step} {adapter}")
            if adapter is not None:
                changed += int(not torch.allclose(expected, reference(seq.token_ids, None), atol=1e-3))
            seq.num_cached = seq.num_tokens
            seq.token_ids.append(int(logits[row].argmax()))
        running = batch.seqs
    assert changed, "no adapter moves the logits: too weak to test"


def _cases(adapters: list[str]) -> list[tuple[list[int], str | None]]:
    names: list[str | None] = [*adapters, None]
    return [(PROMPTS[i % len(PROMPTS)], name) for i, name in enumerate(names * 2)]


@pytest.mark.parametrize("family", FAMILIES)
def test_target_parameters_adapters_match_peft_logits_alone_and_mixed(family: str, tmp_path: Path) -> None:
    model = MOE_FAMILIES[family]()
    peft = _peft_experts(model, tmp_path)
    manager = _manager(model)
    for name in PARAM_ADAPTERS:
        manager.load_adapter(name, tmp_path / name)
    reference = _peft_reference(peft)
    for name in PARAM_ADAPTERS:  # alone, beside a base row, then every adapter mixed in one batch
        _steps(model, manager, [(PROMPTS[0], name)], reference)
        _steps(model, manager, [(PROMPTS[0], name), (PROMPTS[1], None)], reference)
    _steps(model, manager, _cases(list(PARAM_ADAPTERS)), reference)


def _generate(peft: PeftModel, prompt: list[int], adapter: str | None) -> list[int]:
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


@pytest.mark.parametrize("family", ["qwen2-moe-shared-expert-dense-first", "mixtral-window-8"])
def test_expert_adapters_greedy_through_the_engine_equal_peft(family: str, tmp_path: Path) -> None:
    model = MOE_FAMILIES[family]()
    peft = _peft_experts(model, tmp_path)
    manager = _manager(model)
    for name in PARAM_ADAPTERS:
        manager.load_adapter(name, tmp_path / name)
    loaded = LoadedModel(
        name=family, model=model, tokenizer=word_tokenizer(model.config.vocab_size), directory=tmp_path
    )
    engine = LLMEngine.from_loaded(
        loaded, EngineConfig(kv_cache_bytes=16 * 2**20, max_model_len=64, max_num_batched_tokens=512), manager
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    names: list[str | None] = [*PARAM_ADAPTERS, None]
    cases = [(i, name) for i in range(len(PROMPTS)) for name in names]
    for i, name in cases:
        engine.add_request(EngineRequest(f"{i}-{name}", PROMPTS[i], params, adapter=name))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    for i, name in cases:
        assert tokens[f"{i}-{name}"] == _generate(peft, PROMPTS[i], name), f"prompt {i} adapter {name}"
    assert any(tokens[f"{i}-{n}"] != tokens[f"{i}-None"] for i, n in cases if n is not None)


# family -> (the experts' block, the names of gate, up and down there)
PER_EXPERT = {
    "mixtral-window-8": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3-moe-qk-norm-normalised": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


def _write_per_expert(
    family: str, model: PreTrainedModel, directory: Path, rank: int, alpha: float, seed: int
) -> PreTrainedModel:
    """A per-expert-module adapter (and q_proj) on every sparse layer, written as PEFT names such
    modules; returns ``model`` with every delta merged into its weights (the reference)."""
    block, names = PER_EXPERT[family]
    torch.manual_seed(seed)
    merged = copy.deepcopy(model)
    scale = alpha / rank
    tensors: dict[str, torch.Tensor] = {}

    def pair(key: str, in_f: int, out_f: int) -> torch.Tensor:
        a, b = torch.randn(rank, in_f) * 0.3, torch.randn(out_f, rank) * 0.3
        tensors[f"base_model.model.model.layers.{key}.lora_A.weight"] = a
        tensors[f"base_model.model.model.layers.{key}.lora_B.weight"] = b
        return scale * b @ a

    with torch.no_grad():
        for i, layer in enumerate(merged.model.layers):  # type: ignore[union-attr]
            q = layer.self_attn.q_proj.weight
            q += pair(f"{i}.self_attn.q_proj", q.shape[1], q.shape[0])
            experts = layer.mlp.experts
            num, two_inter, hidden = experts.gate_up_proj.shape
            inter = two_inter // 2
            for e in range(0, num, 2):  # every other expert: the rest stay zero in the slot
                gate = pair(f"{i}.{block}.experts.{e}.{names[0]}", hidden, inter)
                up = pair(f"{i}.{block}.experts.{e}.{names[1]}", hidden, inter)
                experts.gate_up_proj[e] += torch.cat([gate, up])
                experts.down_proj[e] += pair(f"{i}.{block}.experts.{e}.{names[2]}", inter, hidden)
    directory.mkdir()
    save_file(tensors, directory / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": ["q_proj", *names]}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return merged


@pytest.mark.parametrize("family", list(PER_EXPERT))
def test_per_expert_module_adapters_match_merged_weights(family: str, tmp_path: Path) -> None:
    model = MOE_FAMILIES[family]()
    merged = {"per-expert-r8": _write_per_expert(family, model, tmp_path / "per-expert-r8", 8, 16, 3)}
    merged["per-expert-r16"] = _write_per_expert(family, model, tmp_path / "per-expert-r16", 16, 8, 4)
    manager = _manager(model)
    for name in merged:
        manager.load_adapter(name, tmp_path / name)

    def reference(ids: list[int], adapter: str | None) -> torch.Tensor:
        with torch.no_grad():
            return (merged[adapter] if adapter else model)(torch.tensor([ids])).logits[0, -1].float()

    _steps(model, manager, [(PROMPTS[0], "per-expert-r8"), (PROMPTS[1], None)], reference)
    _steps(model, manager, _cases(list(merged)), reference)


def _load(family: str, shapes_of: dict[str, list[int]], modules: list[str] | None = None) -> None:
    shapes = ModelShapes.from_hf_config(MOE_FAMILIES[family]().config)
    tensors = {f"base_model.model.model.layers.{key}": torch.ones(shape) for key, shape in shapes_of.items()}
    config = {"r": 8, "lora_alpha": 16, "target_modules": modules or []}
    to_slot_layout(config, tensors, shapes, max_rank=64, allowed_modules=MODULES)


@pytest.mark.parametrize(
    ("family", "key"),
    [
        ("mixtral-window-8", "1.mlp.gate"),  # the router
        ("qwen2-moe-shared-expert-dense-first", "1.mlp.shared_expert_gate"),
        ("mixtral-window-8", "1.mlp.gate_proj"),  # a dense-MLP name on a layer that has experts only
        ("qwen3-moe-qk-norm-normalised", "1.mlp.shared_expert.gate_proj"),  # no shared expert
        ("qwen2-moe-shared-expert-dense-first", "0.mlp.experts.0.gate_proj"),  # layer 0 is dense
        ("qwen2-moe-shared-expert-dense-first", "0.mlp.shared_expert.gate_proj"),
    ],
)
def test_lora_on_an_unserved_moe_module_is_refused_with_one_type(family: str, key: str) -> None:
    with pytest.raises(UnservedTarget):
        _load(family, {f"{key}.lora_A.weight": [8, 64], f"{key}.lora_B.weight": [64, 8]})


@pytest.mark.parametrize(
    ("shapes_of", "message"),
    [
        ({"1.mlp.experts.6.gate_proj.lora_A.weight": [8, 64], "1.mlp.experts.6.gate_proj.lora_B.weight": [40, 8]},
         "layer 1 has 6 experts"),
        ({"1.mlp.experts.0.gate_proj.lora_A.weight": [8, 64], "1.mlp.experts.0.gate_proj.lora_B.weight": [96, 8]},
         r"expected \(40, 8\)"),
        ({"1.mlp.experts.lora_A.weight": [48, 64], "1.mlp.experts.lora_B.weight": [80, 40]},
         "fit neither experts.gate_up_proj"),
        ({"1.mlp.experts.lora_A.weight": [48, 64]}, "without its pair"),
        ({"1.mlp.experts.lora_A.weight": [48, 64], "1.mlp.experts.lora_B.weight": [80, 48],
          "1.mlp.experts.0.gate_proj.lora_A.weight": [8, 64], "1.mlp.experts.0.gate_proj.lora_B.weight": [40, 8]},
         "per-expert modules and target_parameters both"),
    ],
)  # fmt: skip
def test_expert_adapters_of_the_wrong_shape_are_refused(shapes_of: dict[str, list[int]], message: str) -> None:
    with pytest.raises(IntegrityError, match=message):
        _load("qwen3-moe-qk-norm-normalised", shapes_of)


def test_expert_lora_bytes_count_in_the_slot_size() -> None:
    """A slot on a MoE model holds every expert's A and B: E * (in + out) per expert module and layer."""
    model = MOE_FAMILIES["qwen3-moe-qk-norm-normalised"]()
    shapes = ModelShapes.from_hf_config(model.config)
    experts, hidden, inter = 6, 64, 40
    per_layer = experts * ((hidden + inter) * 2 + (inter + hidden))
    attention_only = shapes.params_per_rank(("q_proj", "k_proj", "v_proj", "o_proj"))
    assert shapes.params_per_rank(MODULES) == attention_only + 2 * per_layer
    weights = to_slot_layout(
        {"r": 8, "lora_alpha": 16},
        {
            "base_model.model.model.layers.1.mlp.experts.lora_A.weight": torch.ones(48, inter),
            "base_model.model.model.layers.1.mlp.experts.lora_B.weight": torch.ones(hidden, 48),
        },
        shapes,
        max_rank=64,
        allowed_modules=MODULES,
    )
    assert weights.modules == {"experts.down_proj"}
    assert weights.nbytes == 8 * experts * (inter + hidden) * 4


def test_a_prefills_pairs_gathered_in_chunks_give_the_same_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GATHER_ELEMENTS bounds what one gather holds (a long prefill's pairs); chunked, the deltas are the same."""
    monkeypatch.setattr(applier, "GATHER_ELEMENTS", 1)  # one pair per chunk
    model = MOE_FAMILIES["olmoe-wide-qk-norm"]()
    peft = _peft_experts(model, tmp_path)
    manager = _manager(model)
    for name in PARAM_ADAPTERS:
        manager.load_adapter(name, tmp_path / name)
    _steps(model, manager, _cases(list(PARAM_ADAPTERS)), _peft_reference(peft))


# PEFT >= 0.22 turns a target_modules name of the routed experts into a bare target_parameters entry:
# Mixtral's "w2" becomes ["down_proj"]; Qwen2-MoE's "down_proj" stays for the shared expert and dense layer
# and also becomes ["down_proj"] for the experts (one rank: down_proj is not a fused pair)
CONVERTED = {"mixtral-window-8": ["q_proj", "w2"], "qwen2-moe-shared-expert-dense-first": ["q_proj", "down_proj"]}


# ... and all of an MLP's names into the experts' fused tensors, gate_up_proj at twice the rank and alpha (a
# rank_pattern / alpha_pattern): served at the largest rank, the rest zero-padded
ALL_MLP = {
    "mixtral-window-8": ["q_proj", "w1", "w2", "w3"],
    "qwen2-moe-shared-expert-dense-first": ["q_proj", "gate_proj", "up_proj", "down_proj"],
}


@pytest.mark.parametrize(
    ("family", "modules", "parameters"),
    [(f, m, ["down_proj"]) for f, m in CONVERTED.items()]
    + [(f, m, ["down_proj", "gate_up_proj"]) for f, m in ALL_MLP.items()],
)
def test_an_adapter_whose_expert_names_peft_converted_is_served_as_peft_serves_it(
    family: str, modules: list[str], parameters: list[str], tmp_path: Path
) -> None:
    model = MOE_FAMILIES[family]()
    torch.manual_seed(5)
    config = PeftLoraConfig(r=8, lora_alpha=32, target_modules=modules, init_lora_weights=False)
    peft = get_peft_model(copy.deepcopy(model), config, adapter_name="converted")
    with torch.no_grad():
        for param_name, param in peft.named_parameters():
            if "lora_B" in param_name:
                param.mul_(4.0)
    peft.eval()
    peft.save_pretrained(str(tmp_path))
    written = json.loads((tmp_path / "converted" / "adapter_config.json").read_text())
    assert sorted(written["target_parameters"]) == parameters, written  # what this test is about: bare names
    assert (written["rank_pattern"] == {".*\\.gate_up_proj": 16}) == ("gate_up_proj" in parameters), written
    manager = _manager(model)
    manager.load_adapter("converted", tmp_path / "converted")
    reference = _peft_reference(peft)
    _steps(model, manager, [(PROMPTS[0], "converted"), (PROMPTS[1], None)], reference)
