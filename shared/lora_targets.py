"""What each tensor of a PEFT LoRA adapter targets in the base model, by name and shape: the one reading
the registry's admission check and the worker's loader share, mixture-of-experts layers included.

Slot modules are the dense projections (``q_proj`` .. ``down_proj``; on a Qwen2-MoE sparse layer the
MLP ones are its shared expert's) and the routed experts' ``experts.gate_proj`` / ``experts.up_proj`` /
``experts.down_proj``, each held for every expert of the layer. Two forms of expert LoRA are read:

- per-expert modules, as PEFT writes them for checkpoints whose experts are modules
  (``mlp.experts.N.gate_proj``, Mixtral's ``block_sparse_moe.experts.N.w1`` / ``w3`` / ``w2``):
  A [r, in], B [out, r] per expert;
- PEFT's ``target_parameters`` on transformers' fused expert tensors (``mlp.experts.gate_up_proj``
  [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]): a ParamWrapper per tensor, nested on the one
  ``experts`` module (the inner one's keys carry ``base_layer.``), lora_A [E * r, in] expert-major,
  lora_B [out, r * E] rank-major (peft's ``get_delta_weight``: B.reshape(out, r, E), A.reshape(E, r, in)).
  Which tensor a wrapper adapts is read from its (in, out): (H, 2I) is gate_up, (I, H) is down.

Anything else on a mixture-of-experts block (the router ``mlp.gate``, ``shared_expert_gate``) is
refused with :class:`UnservedTarget`.
"""

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from shared.errors import IntegrityError, UnservedTarget

# module -> (copies: 1, or the layer's expert count, in_features, out_features)
LayerDims = Mapping[str, tuple[int, int, int]]
DENSE_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_MODULES = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")  # target_parameters served, as name suffixes


def module_name(entry: str) -> str:
    """The module a target_modules entry names. PEFT matches a list entry against a module's path by
    suffix (``mlp.gate_proj`` names each ``....mlp.gate_proj``; PEFT 0.22 needs such names to target a
    transformers-v5 MoE model's plain MLPs alone), so the served module is the entry's last component."""
    return entry.rsplit(".", 1)[-1]


_EXPERTS_PATH = ("model", "layers", "N", "mlp", "experts")  # where the fused expert tensors are


def expert_parameter(entry: str) -> bool:
    """A target_parameters entry that PEFT matches (by path suffix) to the routed experts' fused tensors
    alone: a dot-suffix of ``model.layers.N.mlp.experts.gate_up_proj`` or ``...down_proj``. PEFT 0.22
    writes the bare name (``down_proj``) when it turns a target_modules entry (Mixtral's ``w2``) into one."""
    *prefix, leaf = entry.split(".")
    if f"experts.{leaf}" not in EXPERT_PARAMETERS or len(prefix) > len(_EXPERTS_PATH):
        return False
    path = _EXPERTS_PATH[len(_EXPERTS_PATH) - len(prefix) :]
    return all(p == q or (q == "N" and p.isdigit()) for p, q in zip(prefix, path, strict=True))


def entry_matches(entry: str, module_path: str) -> bool:
    """PEFT's list match: the module's path is the entry or ends with ``.entry``."""
    return module_path == entry or module_path.endswith(f".{entry}")


_LAYER = r"^(?:base_model\.model\.)?model\.layers\.(\d+)\."
_DENSE = re.compile(_LAYER + r"(self_attn|mlp|mlp\.shared_expert)\.([a-z]+_proj)\.lora_([AB])\.weight$")
_PER_EXPERT = re.compile(
    _LAYER + r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.lora_([AB])\.weight$"
)
_FUSED = re.compile(_LAYER + r"mlp\.experts\.((?:base_layer\.)*)lora_([AB])\.weight$")
_MOE_BLOCK = re.compile(r"\.(?:block_sparse_moe|mlp\.(?:experts|shared_expert|shared_expert_gate|gate))\.")
_ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})


@dataclass(frozen=True, slots=True)
class Target:
    """Where one lora_A / lora_B tensor goes: ``modules`` are the slot modules it feeds (a fused
    gate_up tensor feeds two), ``expert`` the expert of a per-expert module, ``fused`` whether it is a
    ``target_parameters`` tensor (all experts at once)."""

    layer: int
    modules: tuple[str, ...]
    side: str
    expert: int | None = None
    fused: bool = False
    rank: int = 0  # the tensor's own rank (an adapter with a rank_pattern has several)


def resolve(
    shapes: Mapping[str, Sequence[int]], layers: Sequence[LayerDims], rank: int | Callable[[str], int]
) -> dict[str, Target]:
    """Tensor name -> its target, for every tensor of an adapter of rank ``rank`` (or of the rank
    ``rank(path)`` gives the module at PEFT's path ``model.layers.N.<module>``), each shape checked
    against the base model's ``layers`` and each A paired with its B; raises IntegrityError (or
    UnservedTarget) naming the first tensor that does not fit."""
    rank_of = rank if callable(rank) else lambda _path: rank
    targets: dict[str, Target] = {}
    fused: dict[tuple[int, int], dict[str, tuple[str, list[int]]]] = {}  # (layer, depth) -> side -> (name, shape)
    for name, raw_shape in shapes.items():
        shape = [int(d) for d in raw_shape]
        fused_match = _FUSED.match(name)
        if fused_match is not None:
            key = (int(fused_match[1]), fused_match[2].count("base_layer."))
            fused.setdefault(key, {})[fused_match[3]] = (name, shape)
            continue
        target, dims = _module_target(name, layers)
        in_f, out_f = dims
        r = rank_of(_peft_path(name))
        expected = (r, in_f) if target.side == "A" else (out_f, r)
        if tuple(shape) != expected:
            raise IntegrityError(f"{name} has shape {tuple(shape)}, expected {expected} for r={r}", param=name)
        targets[name] = dataclasses.replace(target, rank=r)
    for (layer, _), sides in fused.items():
        targets |= _fused_targets(layer, sides, layers, rank_of)
    _check_pairs(targets)
    return targets


def _layer(name: str, layer: int, layers: Sequence[LayerDims]) -> LayerDims:
    if layer >= len(layers):
        raise IntegrityError(f"{name}: layer {layer} does not exist in the {len(layers)}-layer base model", param=name)
    return layers[layer]


def _module_target(name: str, layers: Sequence[LayerDims]) -> tuple[Target, tuple[int, int]]:
    match = _PER_EXPERT.match(name)
    if match is not None:
        layer, expert, module = int(match[1]), int(match[2]), f"experts.{MIXTRAL_NAMES.get(match[3], match[3])}"
        dims = _layer(name, layer, layers).get(module)
        if dims is None:
            raise UnservedTarget(f"{name}: layer {layer} of the base model has no routed experts", param=name)
        if expert >= dims[0]:
            raise IntegrityError(f"{name}: layer {layer} has {dims[0]} experts", param=name)
        return Target(layer, (module,), match[4], expert=expert), dims[1:]
    match = _DENSE.match(name)
    if match is None or (match[2] == "self_attn") != (match[3] in _ATTENTION):
        if _MOE_BLOCK.search(name):
            raise UnservedTarget(f"{name} targets a mixture-of-experts module LoRA is not served on", param=name)
        raise IntegrityError(f"unexpected tensor {name!r}: only lora_A / lora_B of the served projections", param=name)
    layer, block, module = int(match[1]), match[2], match[3]
    layer_dims = _layer(name, layer, layers)
    sparse = "experts.gate_proj" in layer_dims
    if module not in DENSE_MODULES or (block == "mlp.shared_expert") != (sparse and module not in _ATTENTION):
        raise UnservedTarget(
            f"{name} does not fit layer {layer}'s "
            + ("mixture-of-experts MLP (its routed experts, or its shared expert)" if sparse else "dense MLP"),
            param=name,
        )
    dims = layer_dims.get(module)
    if dims is None:  # a sparse layer with no shared expert
        raise UnservedTarget(f"{name}: layer {layer} has no shared expert", param=name)
    return Target(layer, (module,), match[4]), dims[1:]


def _peft_path(name: str) -> str:
    """The path PEFT matches a tensor's module by: ``model.layers.0.mlp.gate_proj`` of
    ``base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight``."""
    return name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]


def _fused_targets(
    layer: int, sides: dict[str, tuple[str, list[int]]], layers: Sequence[LayerDims], rank_of: Callable[[str], int]
) -> dict[str, Target]:
    if len(sides) != 2:
        (name, _), *_ = sides.values()
        raise IntegrityError(f"{name}: a target_parameters lora_A or lora_B without its pair", param=name)
    (a_name, a_shape), (b_name, b_shape) = sides["A"], sides["B"]
    layer_dims = _layer(a_name, layer, layers)
    gate, down = layer_dims.get("experts.gate_proj"), layer_dims.get("experts.down_proj")
    if gate is None or down is None:
        raise UnservedTarget(f"{a_name}: layer {layer} of the base model has no routed experts", param=a_name)
    experts, hidden, inter = gate
    if len(a_shape) != 2 or len(b_shape) != 2:
        raise IntegrityError(f"{a_name} and {b_name} must be matrices", param=a_name)
    modules = {(hidden, 2 * inter): EXPERT_MODULES[:2], (inter, hidden): EXPERT_MODULES[2:]}.get(
        (a_shape[1], b_shape[0])
    )
    fused_name = "down_proj" if modules == EXPERT_MODULES[2:] else "gate_up_proj"  # neither: named for the error
    rank = rank_of(f"model.layers.{layer}.mlp.experts.{fused_name}")
    if modules is None or a_shape[0] != rank * experts or b_shape[1] != rank * experts:
        raise IntegrityError(
            f"{a_name} {a_shape} / {b_name} {b_shape} fit neither experts.gate_up_proj (A [{rank * experts}, {hidden}], "
            f"B [{2 * inter}, {rank * experts}]) nor experts.down_proj (A [{rank * experts}, {inter}], "
            f"B [{hidden}, {rank * experts}]) of layer {layer} for r={rank}",
            param=a_name,
        )
    return {
        a_name: Target(layer, modules, "A", fused=True, rank=rank),
        b_name: Target(layer, modules, "B", fused=True, rank=rank),
    }


def _check_pairs(targets: Mapping[str, Target]) -> None:
    """Every lora_A has its lora_B, and no slot module of an expert is written by two forms."""
    sides: dict[tuple[int, str, int | None], set[str]] = {}
    for name, target in targets.items():
        for module in target.modules:
            key = (target.layer, module, target.expert)
            if target.side in sides.setdefault(key, set()):
                raise IntegrityError(f"{name}: layer {target.layer} {module} is targeted twice", param=name)
            sides[key].add(target.side)
    for (layer, module, expert), seen in sides.items():
        if len(seen) != 2:
            where = f"expert {expert} " if expert is not None else ""
            (side,) = seen
            raise IntegrityError(
                f"layer {layer} {where}{module} lacks its lora_A or lora_B: lora_{side} without its pair", param=module
            )
        if expert is not None and (layer, module, None) in sides:
            raise IntegrityError(f"layer {layer} {module}: per-expert modules and target_parameters both", param=module)
