"""Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) into slot layout.

Everything the slots cannot serve exactly is refused with IntegrityError, naming the offending
field in ``param``: pickle weights, DoRA, modules_to_save, per-module rank / alpha patterns,
bias terms, unknown modules, a rank above the admitted maximum, shapes that do not match the
base model, non-finite values.
"""

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import load_file

from services.worker.lora.fused import split_fused
from services.worker.lora.layout import AdapterWeights, ModelShapes
from shared.errors import IntegrityError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# Options that change what a LoRA layer computes; the slots serve plain LoRA only.
UNSUPPORTED_OPTIONS = (
    "use_dora",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "lora_bias",
    "fan_in_fan_out",
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
    "use_qalora",
    "alora_invocation_tokens",
)
MLP_MODULES = frozenset({"gate_proj", "up_proj", "down_proj"})
EXPERTS = re.compile(r"\.mlp\.(?:experts|shared_expert|gate)\.")  # a mixture-of-experts block's modules
KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


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
    rank, alpha = config["r"], float(config["lora_alpha"])
    if rank > max_rank:
        raise IntegrityError(f"adapter rank {rank} is above the admitted maximum {max_rank}", param="r")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(allowed_modules))
        if unknown:
            raise IntegrityError(f"target modules {unknown} are not served {list(allowed_modules)}", param=unknown[0])
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = KEY.match(key)
        sparse = match is not None and int(match[1]) in shapes.sparse_layers and match[2] in MLP_MODULES
        if EXPERTS.search(key) or sparse:
            raise IntegrityError(
                f"{key!r} targets a mixture-of-experts layer's MLP: LoRA on experts is not served yet "
                "(attention projections only)",
                param=key,
            )
        if match is None:
            raise IntegrityError(f"unexpected tensor {key!r}: only lora_A / lora_B of Llama projections", param=key)
        layer, module, side = int(match[1]), match[2], match[3]
        if module not in allowed_modules:
            raise IntegrityError(f"module {module!r} is not a served target {list(allowed_modules)}", param=module)
        if layer >= shapes.num_layers:
            raise IntegrityError(f"layer {layer} does not exist in the {shapes.num_layers}-layer base model", param=key)
        in_f, out_f = shapes.dims[module]
        expected = (rank, in_f) if side == "A" else (out_f, rank)
        if tuple(tensor.shape) != expected:
            raise IntegrityError(f"{key} has shape {tuple(tensor.shape)}, expected {expected} for r={rank}", param=key)
        if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
            raise IntegrityError(f"{key} holds non-finite or non-float values", param=key)
        pairs.setdefault((layer, module), {})[side] = tensor
    if not pairs:
        raise IntegrityError(f"{WEIGHTS_FILE} holds no LoRA weights", param=WEIGHTS_FILE)
    for (layer, module), pair in pairs.items():
        if len(pair) != 2:
            raise IntegrityError(f"layer {layer} {module} lacks its lora_A or lora_B", param=module)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterWeights(
        rank=rank,
        scale=scale,
        a={k: p["A"].t().contiguous() for k, p in pairs.items()},
        b={k: p["B"].t().contiguous() for k, p in pairs.items()},
    )
