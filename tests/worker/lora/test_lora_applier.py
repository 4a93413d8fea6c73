"""The engine's LoRA hook: mixed ranks and base tokens vs a plain loop, and vs PEFT itself."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from services.worker.engine.batch import build_batch
from services.worker.engine.kv_cache import BlockManager, KVCache
from services.worker.engine.lora_hook import GROUPS
from services.worker.engine.model import LlamaForward
from services.worker.engine.sequence import EngineRequest, Sequence
from services.worker.engine.weights import load_weights
from services.worker.lora import AdapterManager, AdapterWeights, LoraConfig, ModelShapes
from shared.errors import IntegrityError, NoFreeSlot
from tests.helpers.adapters import (
    ALL_MODULES,
    make_peft_model,
    peft_delta,
    save_peft_adapter,
    tiny_llama,
    tiny_llama_config,
)
from tests.helpers.native import needs_toolchain

SHAPES = ModelShapes.from_hf_config(tiny_llama_config())
SPECS = {  # name -> (rank, alpha, target modules, rsLoRA)
    "r8": (8, 16, ("q_proj", "v_proj"), False),
    "r16": (16, 8, ALL_MODULES, True),
    "r64": (64, 32, ("k_proj", "o_proj", "down_proj", "up_proj"), False),
    "r12": (12, 24, ("gate_proj", "q_proj"), False),
}


@pytest.fixture(scope="module")
def base():
    return tiny_llama()


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory, base) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: save_peft_adapter(root / name, base, rank=r, alpha=al, target_modules=mods, use_rslora=rs, seed=i)
        for i, (name, (r, al, mods, rs)) in enumerate(SPECS.items())
    }


def new_manager(**config: object) -> AdapterManager:
    config.setdefault("memory_budget_bytes", 2**24)
    return AdapterManager(LoraConfig(**config), SHAPES)


def loop_delta(
    weights: dict[str, AdapterWeights], names: list[str | None], layer: int, module: str, x: torch.Tensor
) -> torch.Tensor:
    """One token at a time, straight from each adapter's unpadded weights."""
    delta = torch.zeros(x.shape[0], SHAPES.dims[module][1])
    for t, name in enumerate(names):
        if name is not None and (layer, module) in weights[name].a:
            w = weights[name]
            delta[t] = w.scale * (x[t] @ w.a[(layer, module)]) @ w.b[(layer, module)]
    return delta


def group_delta(
    weights: dict[str, AdapterWeights], names: list[str | None], layer: int, group: str, x: torch.Tensor
) -> torch.Tensor:
    """The group's members' loop deltas side by side, as the fused output holds them."""
    return torch.cat([loop_delta(weights, names, layer, module, x) for module in GROUPS[group]], dim=1)


def group_width(group: str) -> int:
    return sum(SHAPES.dims[module][1] for module in GROUPS[group])


def group_input(group: str) -> int:
    return SHAPES.dims[GROUPS[group][0]][0]


@pytest.mark.parametrize("kernel", ["torch", pytest.param("native", marks=needs_toolchain)])
@pytest.mark.parametrize("layout", ["decode", "prefill", "interleaved"])
def test_mixed_ranks_and_base_tokens_match_a_plain_loop(
    adapter_dirs: dict[str, Path], layout: str, kernel: str
) -> None:
    """Both CPU LoRA paths: the eager forms (``cpu_kernel='torch'``) and the native kernel."""
    manager = new_manager(cpu_kernel=kernel)
    assert manager.native == (kernel == "native")
    weights = {name: manager.read_adapter(d) for name, d in adapter_dirs.items()}
    slots = {name: manager.load_adapter(name, d) for name, d in adapter_dirs.items()}
    assert {manager.pool.locate(s)[0].rank for s in slots.values()} == {8, 16, 64}
    order: list[str | None] = ["r8", "r16", None, "r64", "r12"]
    if layout == "decode":
        names = order * 3
    elif layout == "prefill":
        names = [n for n in order for _ in range(5)]
    else:
        names = [order[(7 * i) % 5] for i in range(23)]
    token_slots = torch.tensor([-1 if n is None else slots[n] for n in names])
    lora = manager.prepare(token_slots)
    assert lora is not None
    gen = torch.Generator().manual_seed(1)
    for layer in range(SHAPES.num_layers):
        for group in GROUPS:
            x = torch.randn(len(names), group_input(group), generator=gen)
            y = torch.randn(len(names), group_width(group), generator=gen)
            out = y.clone()
            lora.apply(layer, group, x, out)
            torch.testing.assert_close(out, y + group_delta(weights, names, layer, group, x), atol=1e-5, rtol=1e-5)
            base_tokens = token_slots < 0
            assert torch.equal(out[base_tokens], y[base_tokens])


def test_each_rank_class_computes_at_its_own_rank(adapter_dirs: dict[str, Path]) -> None:
    manager = new_manager()
    slot8, slot64 = manager.load_adapter("r8", adapter_dirs["r8"]), manager.load_adapter("r64", adapter_dirs["r64"])
    lora = manager.prepare(torch.tensor([slot8, slot64, slot8]))
    assert lora is not None
    ranks = {part.stack.rank: part for part in lora.classes}
    assert set(ranks) == {8, 64}
    assert ranks[8].index.token_idx.tolist() == [0, 2] and ranks[64].index.token_idx.tolist() == [1]
    assert ranks[8].modules == {"q_proj", "v_proj"}
    assert ranks[8].stack.a[0]["q_proj"].shape[2] == 8


def test_delta_equals_what_peft_adds_to_each_projection(tmp_path: Path, base) -> None:
    model = make_peft_model(base, rank=16, alpha=32, target_modules=ALL_MODULES, use_rslora=True, seed=5)
    model.save_pretrained(tmp_path)
    manager = new_manager()
    lora = manager.prepare(torch.full((6,), manager.load_adapter("tenant-a", tmp_path)))
    assert lora is not None
    gen = torch.Generator().manual_seed(2)
    for layer in range(2):
        for group, members in GROUPS.items():
            x = torch.randn(6, group_input(group), generator=gen)
            y = torch.zeros(6, group_width(group))
            lora.apply(layer, group, x, y)
            want = torch.cat([peft_delta(model, layer, module, x) for module in members], dim=1)
            torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["torch", pytest.param("native", marks=needs_toolchain)])
def test_adds_each_targeted_member_into_its_own_columns(adapter_dirs: dict[str, Path], kernel: str) -> None:
    """A q,v adapter's step: one "qkv" call adds into q's and v's columns of the fused output and
    leaves k's bit-identical; base tokens' rows are untouched; groups it does not target are not called."""
    manager = new_manager(cpu_kernel=kernel)
    weights = manager.read_adapter(adapter_dirs["r8"])
    slot = manager.load_adapter("r8", weights)
    names: list[str | None] = ["r8", None, "r8"]
    lora = manager.prepare(torch.tensor([slot, -1, slot]))
    assert lora is not None and lora.groups == {"qkv"}
    q, kv = SHAPES.dims["q_proj"][1], SHAPES.dims["k_proj"][1]
    x = torch.randn(3, group_input("qkv"))
    qkv = torch.randn(3, group_width("qkv"))
    expected = qkv.clone()
    expected[:, :q] += loop_delta({"r8": weights}, names, 1, "q_proj", x)
    expected[:, q + kv :] += loop_delta({"r8": weights}, names, 1, "v_proj", x)
    before = qkv.clone()
    lora.apply(1, "qkv", x, qkv)
    torch.testing.assert_close(qkv, expected)
    assert torch.equal(qkv[:, q : q + kv], before[:, q : q + kv])
    assert torch.equal(qkv[1], before[1])


def test_residency_slot_of_unload_and_stats(adapter_dirs: dict[str, Path]) -> None:
    manager = new_manager(max_slots_per_class=2)
    assert manager.slot_of("r8") is None and manager.prepare(torch.tensor([-1, -1])) is None
    slot = manager.load_adapter("r8", adapter_dirs["r8"])
    assert manager.load_adapter("r8", adapter_dirs["r8"]) == slot and manager.slot_of("r8") == slot
    manager.load_adapter("r8-b", adapter_dirs["r8"])
    assert not manager.can_load(8) and manager.can_load(9)
    with pytest.raises(NoFreeSlot):
        manager.load_adapter("r8-c", adapter_dirs["r8"])
    stats = manager.stats()
    assert stats.resident == {"r8": slot, "r8-b": slot + 1}
    assert [(c.rank, c.slots, c.free) for c in stats.classes] == [(8, 2, 0), (16, 2, 2), (32, 2, 2), (64, 2, 2)]
    manager.unload("r8")
    assert manager.slot_of("r8") is None and manager.stats().free_slots == 7
    stack, row = manager.pool.locate(slot)
    assert not stack.a[0]["q_proj"][row].any() and stack.scale[row] == 0
    with pytest.raises(KeyError):
        manager.unload("r8")


def test_a_refused_adapter_takes_no_slot(adapter_dirs: dict[str, Path]) -> None:
    manager = new_manager(rank_classes=(8, 16), target_modules=("q_proj", "v_proj"))
    with pytest.raises(IntegrityError, match="above the admitted maximum 16"):
        manager.load_adapter("r64", adapter_dirs["r64"])
    with pytest.raises(IntegrityError, match="not served"):
        manager.load_adapter("r16", adapter_dirs["r16"])
    assert manager.resident() == {} and manager.stats().free_slots == sum(c.num_slots for c in manager.pool.classes)


def test_engine_forward_with_the_hook_matches_peft_logits(tmp_path: Path, base) -> None:
    """Two adapters of ranks 8 and 64 beside a base request, through prefill, mixed and decode steps."""
    models = {
        "a8": make_peft_model(base, rank=8, target_modules=("q_proj", "v_proj"), seed=1),
        "b64": make_peft_model(base, rank=64, alpha=32, target_modules=ALL_MODULES, use_rslora=True, seed=2),
    }
    manager = new_manager()
    for name, model in models.items():
        model.save_pretrained(tmp_path / name)
        manager.load_adapter(name, tmp_path / name)
    weights = load_weights(base, torch.float32, "cpu", 256)
    forward, cache = LlamaForward(weights), KVCache(weights.spec, 64, 4, torch.float32, "cpu")
    blocks = BlockManager(64, 4)
    names = ["a8", None, "b64"]
    prompts = [[5, 17, 42, 99, 3, 8], [40, 2, 9], [33, 44, 5]]
    seqs = [Sequence(EngineRequest(str(i), p), None) for i, p in enumerate(prompts)]
    for seq, name in zip(seqs, names, strict=True):
        seq.slot = -1 if name is None else manager.slot_of(name)
    running: list[Sequence] = []
    for joining in (seqs[:2], seqs[2:], []):
        for seq in running:
            blocks.append(seq)
        for seq in joining:
            blocks.allocate(seq)
        batch = build_batch(running, joining, 4, "cpu")
        lora = manager.prepare(batch.token_slots)
        logits = forward.forward(batch.input_ids, batch.positions, batch.meta, cache, batch.logits_indices, lora)
        for row, seq in enumerate(batch.seqs):
            name = names[seqs.index(seq)]
            model = base if name is None else models[name]
            with torch.no_grad():
                expected = model(torch.tensor([seq.token_ids])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)
            seq.num_cached = seq.num_tokens
            seq.token_ids.append(int(logits[row].argmax()))
        running = batch.seqs


def test_concurrent_loads_get_distinct_slots_and_one_slot_per_name(adapter_dirs: dict[str, Path]) -> None:
    manager = new_manager()
    weights = manager.read_adapter(adapter_dirs["r8"])
    names = ["a", "b", "c", "a", "b", "c", "d", "a"]
    with ThreadPoolExecutor(max_workers=4) as pool:
        slots = list(pool.map(lambda name: manager.load_adapter(name, weights), names))
    by_name = dict(zip(names, slots, strict=True))
    assert all(by_name[n] == s for n, s in zip(names, slots, strict=True)) and len(set(by_name.values())) == 4
    assert manager.stats().classes[0].free == manager.pool.classes[0].num_slots - 4
