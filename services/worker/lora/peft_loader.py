"""Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) into slot layout.

Everything the slots cannot serve exactly is refused with IntegrityError, naming the offending
field in ``param``: pickle weights, DoRA, modules_to_save, rank / alpha patterns that change the scale,
bias terms, unknown modules, a rank above the admitted maximum, shapes that do not match the
base model, non-finite values.
"""

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import load_file

from services.worker.lora.fused import split_fused
from services.worker.lora.layout import AdapterWeights, ModelShapes
from shared.errors import IntegrityError, UnservedTarget
from shared.lora_ranks import RankPlan
from shared.lora_targets import EXPERT_PARAMETERS, MIXTRAL_NAMES, Target, expert_parameter, module_name, resolve

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# Options that change what a LoRA layer computes; the slots serve plain LoRA only.
UNSUPPORTED_OPTIONS = (
    "use_dora",
    "modules_to_save",
    "lora_bias",
    "fan_in_fan_out",
    "layer_replication",
    "trainable_token_indices",
    "use_qalora",
    "alora_invocation_tokens",
)


def read_adapter_config(directory: Path) -> dict[str, Any]:
    try:
        return parse_adapter_config((directory / CONFIG_FILE).read_bytes())
    except FileNotFoundError:
        raise IntegrityError(f"{CONFIG_FILE} is missing from the adapter", param=CONFIG_FILE) from None


def parse_adapter_config(data: bytes) -> dict[str, Any]:
    try:
        config = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise IntegrityError(f"{CONFIG_FILE} is not valid JSON: {err}", param=CONFIG_FILE) from None
    if not isinstance(config, dict):
        raise IntegrityError(f"{CONFIG_FILE} must hold a JSON object", param=CONFIG_FILE)
    if config.get("peft_type", "LORA") != "LORA":
        raise IntegrityError(f"peft_type {config.get('peft_type')!r} is not LORA", param="peft_type")
    for option in UNSUPPORTED_OPTIONS:
        if config.get(option):
            raise IntegrityError(f"{option}={config[option]!r} is not supported (plain LoRA only)", param=option)
    if config.get("bias", "none") != "none":
        raise IntegrityError(f"bias={config['bias']!r} is not supported: LoRA adapters without bias only", param="bias")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise IntegrityError(f"r={rank!r} and lora_alpha={alpha!r} must be positive numbers", param="r")
    return config


def load_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise IntegrityError(f"pickle weight files are refused, safetensors only: {pickles}", param=pickles[0])
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise IntegrityError(f"{WEIGHTS_FILE} is missing from the adapter", param=WEIGHTS_FILE)
    try:
        return load_file(path)
    except (SafetensorError, OSError) as err:
        raise IntegrityError(f"{WEIGHTS_FILE} is not a readable safetensors file: {err}", param=WEIGHTS_FILE) from None


def load_peft_adapter(
    directory: Path | str, shapes: ModelShapes, *, max_rank: int, allowed_modules: tuple[str, ...]
) -> AdapterWeights:
    """Validate a PEFT LoRA directory against the base model and return its weights in slot layout.

    Slot layout: A [in, r] = lora_A.weight.T, B [r, out] = lora_B.weight.T, in the file's dtype
    (copying into a slot converts); scale = alpha / r, or alpha / sqrt(r) with ``use_rslora``.
    """
    directory = Path(directory)
    return to_slot_layout(
        read_adapter_config(directory),
        load_safetensors(directory),
        shapes,
        max_rank=max_rank,
        allowed_modules=allowed_modules,
    )


def load_peft_files(
    files: dict[str, bytes], shapes: ModelShapes, *, max_rank: int, allowed_modules: tuple[str, ...]
) -> AdapterWeights:
    """The same as ``load_peft_adapter`` for the two files already in memory (fetched from a store)."""
    extra = sorted(set(files) - {CONFIG_FILE, WEIGHTS_FILE})
    if extra:
        raise IntegrityError(f"unexpected adapter files {extra}: {CONFIG_FILE} and {WEIGHTS_FILE} only", param=extra[0])
    if CONFIG_FILE not in files or WEIGHTS_FILE not in files:
        raise IntegrityError(f"an adapter needs {CONFIG_FILE} and {WEIGHTS_FILE}", param=CONFIG_FILE)
    try:
        tensors = load_safetensors_bytes(files[WEIGHTS_FILE])
    except (SafetensorError, OSError, ValueError) as err:
        raise IntegrityError(f"{WEIGHTS_FILE} is not a readable safetensors file: {err}", param=WEIGHTS_FILE) from None
    return to_slot_layout(
        parse_adapter_config(files[CONFIG_FILE]), tensors, shapes, max_rank=max_rank, allowed_modules=allowed_modules
    )


def to_slot_layout(
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    shapes: ModelShapes,
    *,
    max_rank: int,
    allowed_modules: tuple[str, ...],
) -> AdapterWeights:
    """Validate a parsed adapter against the base model and lay it out for the slots; modules fused
    in the checkpoint (Phi-3's qkv_proj, gate_up_proj) are split into the served ones first."""
    config, tensors = split_fused(config, tensors, shapes)
    plan = RankPlan.from_config(config)
    rank = plan.max_rank  # a rank_pattern's smaller modules are zero-padded to it: they add nothing more
    if rank > max_rank:
        raise IntegrityError(f"adapter rank {rank} is above the admitted maximum {max_rank}", param="r")
    _check_targets(config, allowed_modules)
    if not tensors:
        raise IntegrityError(f"{WEIGHTS_FILE} holds no LoRA weights", param=WEIGHTS_FILE)
    targets = resolve({key: tensor.shape for key, tensor in tensors.items()}, shapes.layers, plan.rank_of)
    a: dict[tuple[int, str], torch.Tensor] = {}
    b: dict[tuple[int, str], torch.Tensor] = {}
    for key, target in targets.items():
        tensor = tensors[key]
        unserved = [m for m in target.modules if m not in allowed_modules]
        if unserved:
            raise IntegrityError(f"module {unserved[0]!r} is not a served target {list(allowed_modules)}", param=key)
        if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
            raise IntegrityError(f"{key} holds non-finite or non-float values", param=key)
        _place(a if target.side == "A" else b, target, tensor, shapes, rank)
    scale = plan.alpha / math.sqrt(plan.r) if config.get("use_rslora") else plan.scale
    return AdapterWeights(rank=rank, scale=scale, a=_padded(a, rank, -1), b=_padded(b, rank, -2))


def _padded(out: dict[tuple[int, str], torch.Tensor], rank: int, dim: int) -> dict[tuple[int, str], torch.Tensor]:
    """Each tensor's rank dimension ``dim`` zero-padded to ``rank`` (a rank_pattern's smaller modules)."""
    for key, tensor in out.items():
        if tensor.shape[dim] < rank:
            sizes = list(tensor.shape)
            sizes[dim] = rank
            padded = tensor.new_zeros(sizes)
            padded.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
            out[key] = padded
    return out


def _check_targets(config: dict[str, Any], allowed_modules: tuple[str, ...]) -> None:
    """The config's target_modules name served modules (a per-expert name such as Mixtral's ``w1``: its
    expert module; a path-qualified entry: its last component), and its target_parameters the routed
    experts' fused tensors."""
    targets = config.get("target_modules")
    if isinstance(targets, list):
        leaves = {t: module_name(t) for t in targets}
        unknown = sorted(
            t
            for t, m in leaves.items()
            if m not in allowed_modules and f"experts.{MIXTRAL_NAMES.get(m, m)}" not in allowed_modules
        )
        if unknown:
            raise IntegrityError(f"target modules {unknown} are not served {list(allowed_modules)}", param=unknown[0])
    parameters = config.get("target_parameters") or []
    unserved = [p for p in parameters if not (isinstance(p, str) and expert_parameter(p))]
    if unserved:
        raise UnservedTarget(
            f"target_parameters {unserved} are not served: {list(EXPERT_PARAMETERS)} only", param=str(unserved[0])
        )


def _place(
    out: dict[tuple[int, str], torch.Tensor], target: Target, tensor: torch.Tensor, shapes: ModelShapes, rank: int
) -> None:
    """Lay one checked tensor out for the slots: a dense module's A [in, r] / B [r, out]; an expert
    module's [experts, in, rank] / [experts, rank, out], experts an adapter leaves out zero (``r``: the
    tensor's own rank, ``rank``: the adapter's largest)."""
    layer, side, r = target.layer, target.side, target.rank
    if target.expert is None and not target.fused:
        out[(layer, target.modules[0])] = tensor.t().contiguous()
        return
    copies, in_f, out_f = shapes.layers[layer][target.modules[0]]
    if target.fused:
        if side == "A":  # [E * r, in], expert-major -> [E, in, r]
            stacked = tensor.reshape(copies, r, -1).transpose(1, 2).contiguous()
            for module in target.modules:  # gate and up share the fused tensor's A
                out[(layer, module)] = stacked
        else:  # [out, r * E], rank-major -> [E, r, out]; gate_up's rows split into gate's and up's
            stacked = tensor.reshape(tensor.shape[0], r, copies).permute(2, 1, 0)
            for module, cols in zip(target.modules, torch.split(stacked, out_f, dim=2), strict=True):
                out[(layer, module)] = cols.contiguous()
        return
    module = target.modules[0]
    shape = (copies, in_f, rank) if side == "A" else (copies, rank, out_f)
    stacked = out.setdefault((layer, module), torch.zeros(shape, dtype=tensor.dtype))
    stacked[target.expert].narrow(1 if side == "A" else 0, 0, r).copy_(tensor.t())
