"""Admission check of a LoRA adapter's two files, before anything is stored or loaded.

A push may carry a third file, its eval set (``eval.jsonl``, shared/eval_set.py): signed with the
adapter, kept by the registry for its release gate, never served.

Only ``adapter_model.safetensors`` + ``adapter_config.json`` are admitted: no pickle, no
remote code, no feature the serving engine does not implement (DoRA, modules_to_save,
per-module ranks that change a module's scale: shared.lora_ranks), tensors exactly shaped for the
base model (its routed experts included: shared.lora_targets), all values finite.
"""

import hashlib
import json
import math
import mmap
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import IntegrityError, InvalidRequest, PayloadTooLarge
from shared.eval_set import EVAL_SET_FILE, MAX_EVAL_SET_BYTES, parse_eval_set
from shared.fingerprint import BaseModelSpec
from shared.lora_ranks import RankPlan
from shared.lora_targets import EXPERT_PARAMETERS, MIXTRAL_NAMES, entry_matches, expert_parameter, module_name, resolve

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
OBJECT_STORE_SCHEME = "nats-os"  # storage URIs nats-os://<bucket>/<adapter_id>/<version>
IGNORED_IN_DIR = frozenset({"README.md"})  # the model card peft writes; never uploaded
ALLOWED_MODULES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", *MIXTRAL_NAMES}
)

# dtype -> (little-endian word, exponent mask, bytes per value)
_FLOAT_BITS: dict[str, tuple[np.dtype[np.unsignedinteger[Any]], int, int]] = {
    "F32": (np.dtype("<u4"), 0x7F800000, 4),
    "F16": (np.dtype("<u2"), 0x7C00, 2),
    "BF16": (np.dtype("<u2"), 0x7F80, 2),
}
MAX_CONFIG_BYTES = 64 * 1024
AdapterBytes = bytes | mmap.mmap  # a file's contents, or a read-only map of a file too large to copy

_TENSOR_NAME = re.compile(r"^base_model\.model\.model\.layers\.\d+\.")
_MODULE_PATH = re.compile(r"^(.*)\.lora_[AB]\.weight$")  # the module a per-module tensor's target_modules entry names
_NEUTRAL_KEYS = frozenset({
    "peft_type", "peft_version", "r", "lora_alpha", "use_rslora", "target_modules", "base_model_name_or_path",
    "revision", "task_type", "inference_mode", "init_lora_weights", "lora_dropout", "bias", "auto_mapping",
    "megatron_core", "qalora_group_size", "target_parameters", "rank_pattern", "alpha_pattern",
})  # fmt: skip
_REFUSED = {
    "use_dora": "DoRA adapters (use_dora) are not supported by the serving engine",
    "modules_to_save": "modules_to_save is refused: an adapter may only carry LoRA A/B matrices",
    "auto_map": "auto_map references remote code and is refused",
}


@dataclass(frozen=True, slots=True)
class AdapterLimits:
    max_rank: int = 64
    max_weights_bytes: int = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class AdapterSummary:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    tensor_count: int


def file_digests(files: Mapping[str, AdapterBytes]) -> dict[str, str]:
    """File name -> sha256 hex: a record's ``files``, what its signed manifest covers. The weights file's
    is the adapter's ``digest``."""
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def read_adapter_dir(path: str | Path, limits: AdapterLimits = AdapterLimits()) -> dict[str, bytes]:
    """Read the two adapter files from a directory, refusing symlinks and any other file."""
    directory = Path(path)
    if directory.is_symlink() or not directory.is_dir():
        raise InvalidRequest(f"{directory} is not a plain directory")
    files: dict[str, bytes] = {}
    for entry in sorted(directory.iterdir()):
        if entry.name in IGNORED_IN_DIR and entry.is_file() and not entry.is_symlink():
            continue
        _check_name(entry.name)
        if entry.is_symlink() or not entry.is_file():
            raise InvalidRequest(f"{entry.name}: must be a regular file, not a symlink or directory")
        caps = {CONFIG_FILE: MAX_CONFIG_BYTES, EVAL_SET_FILE: MAX_EVAL_SET_BYTES}
        cap = caps.get(entry.name, limits.max_weights_bytes)
        if entry.stat().st_size > cap:
            raise PayloadTooLarge(f"{entry.name}: {entry.stat().st_size} bytes exceeds the {cap}-byte cap")
        files[entry.name] = entry.read_bytes()
    return files


def validate_adapter(files: Mapping[str, AdapterBytes], spec: BaseModelSpec, limits: AdapterLimits) -> AdapterSummary:
    """Check both files completely; raise a typed error naming the first problem found. Hashing is
    the caller's (``file_digests``), done once per push."""
    for name in files:
        _check_name(name)
    missing = [n for n in ADAPTER_FILES if n not in files]
    if missing:
        raise InvalidRequest(f"adapter is missing {', '.join(missing)}")
    if len(files[CONFIG_FILE]) > MAX_CONFIG_BYTES:
        raise PayloadTooLarge(f"{CONFIG_FILE}: exceeds the {MAX_CONFIG_BYTES}-byte cap")
    if len(files[WEIGHTS_FILE]) > limits.max_weights_bytes:
        raise PayloadTooLarge(f"{WEIGHTS_FILE}: exceeds the {limits.max_weights_bytes}-byte cap")
    if EVAL_SET_FILE in files:
        parse_eval_set(bytes(files[EVAL_SET_FILE]))
    plan, use_rslora, modules = _check_config(bytes(files[CONFIG_FILE]), limits)
    count, slot_modules = _check_weights(files[WEIGHTS_FILE], spec, plan, modules)
    return AdapterSummary(  # held at its largest rank (a rank_pattern's smaller modules zero-padded)
        rank=plan.max_rank,
        alpha=plan.scale * plan.max_rank if not use_rslora else plan.alpha,
        use_rslora=use_rslora,
        target_modules=tuple(sorted(slot_modules)),
        tensor_count=count,
    )


def _check_name(name: str) -> None:
    if "/" in name or "\\" in name or name in ("", ".", "..") or "\x00" in name:
        raise InvalidRequest(f"file name {name!r} is refused: path components are not allowed")
    if name not in (*ADAPTER_FILES, EVAL_SET_FILE):
        raise InvalidRequest(
            f"file {name!r} is refused: only {WEIGHTS_FILE}, {CONFIG_FILE} and {EVAL_SET_FILE} are accepted "
            "(no pickle, .bin, .pt or code files)"
        )


def _check_config(raw: bytes, limits: AdapterLimits) -> tuple[RankPlan, bool, set[str]]:
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidRequest(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise InvalidRequest(f"{CONFIG_FILE} must be a JSON object")
    for key, reason in _REFUSED.items():
        if config.get(key):
            raise InvalidRequest(f"{CONFIG_FILE}: {reason}")
    mapping = config.get("auto_mapping")
    if mapping and not (
        isinstance(mapping, dict) and str(mapping.get("parent_library", "")).startswith("transformers.models.")
    ):
        raise InvalidRequest(f"{CONFIG_FILE}: auto_mapping names a custom class outside transformers: {mapping}")
    for key, value in config.items():
        if key not in _NEUTRAL_KEYS and value not in (None, False, {}, [], 0, ""):
            raise InvalidRequest(f"{CONFIG_FILE}: unsupported setting {key}={value!r}")
    if config.get("peft_type") != "LORA":
        raise InvalidRequest(f"{CONFIG_FILE}: peft_type must be LORA, got {config.get('peft_type')!r}")
    if config.get("bias", "none") != "none":
        raise InvalidRequest(f"{CONFIG_FILE}: bias={config['bias']!r} is refused, only 'none'")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidRequest(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > limits.max_rank:
        raise InvalidRequest(f"{CONFIG_FILE}: rank {rank} exceeds the admitted maximum {limits.max_rank}")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not alpha > 0:
        raise InvalidRequest(f"{CONFIG_FILE}: lora_alpha must be a positive number, got {alpha!r}")
    modules = config.get("target_modules") or []
    if isinstance(modules, str):
        modules = [modules]
    parameters = config.get("target_parameters") or []
    if not all(isinstance(v, list) and all(isinstance(m, str) for m in v) for v in (modules, parameters)) or not (
        modules or parameters
    ):
        raise InvalidRequest(f"{CONFIG_FILE}: target_modules (or target_parameters) must be a non-empty list of names")
    unknown = sorted(m for m in modules if module_name(m) not in ALLOWED_MODULES)
    if unknown:
        raise InvalidRequest(f"{CONFIG_FILE}: target_modules {unknown} are refused; allowed: {sorted(ALLOWED_MODULES)}")
    unserved = sorted(p for p in parameters if not expert_parameter(p))
    if unserved:
        raise InvalidRequest(
            f"{CONFIG_FILE}: target_parameters {unserved} are refused; served: the routed experts' "
            f"{' and '.join(EXPERT_PARAMETERS)}"
        )
    try:
        plan = RankPlan.from_config(config)
    except IntegrityError as e:
        raise InvalidRequest(f"{CONFIG_FILE}: {e.message}", param=e.param) from None
    if plan.max_rank > limits.max_rank:
        raise InvalidRequest(f"{CONFIG_FILE}: rank_pattern's rank {plan.max_rank} exceeds the admitted maximum")
    return plan, bool(config.get("use_rslora", False)), set(modules)


def _check_weights(raw: AdapterBytes, spec: BaseModelSpec, plan: RankPlan, modules: set[str]) -> tuple[int, set[str]]:
    """Every tensor's name, dtype and shape against the base model; the slot modules the adapter fills."""
    header = _header(raw)
    for name, entry in header.items():
        if not _TENSOR_NAME.match(name):
            raise IntegrityError(f"{WEIGHTS_FILE}: tensor {name!r} is not a LoRA A/B weight of a decoder layer")
        if entry.get("dtype") not in _FLOAT_BITS:
            raise IntegrityError(f"{WEIGHTS_FILE}: tensor {name!r} has dtype {entry.get('dtype')!r}")
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(type(d) is int for d in shape):
            raise IntegrityError(f"{WEIGHTS_FILE}: tensor {name!r} has a malformed shape {shape!r}")
    try:
        targets = resolve({name: entry["shape"] for name, entry in header.items()}, spec.layer_dims(), plan.rank_of)
    except IntegrityError as err:
        raise type(err)(f"{WEIGHTS_FILE}: {err.message}", param=err.param) from None
    seen: set[str] = set()
    for name, target in targets.items():
        path = _MODULE_PATH.match(name)
        if path is not None and not target.fused:
            if not any(entry_matches(entry, path[1]) for entry in modules):
                raise IntegrityError(f"{WEIGHTS_FILE}: tensor {name!r} targets a module outside target_modules")
            seen.add(module_name(path[1]))
    missing = sorted({module_name(m) for m in modules} - seen)
    if missing:
        raise IntegrityError(f"{WEIGHTS_FILE}: no tensors for target_modules {missing}")
    _check_data(raw, header, data_start=8 + struct.unpack("<Q", raw[:8])[0])
    return len(header), {m for target in targets.values() for m in target.modules}


def _header(raw: AdapterBytes) -> dict[str, dict[str, Any]]:
    """Parse and bound-check the safetensors header: tensor name -> {dtype, shape, data_offsets}."""
    if len(raw) < 8:
        raise IntegrityError(f"{WEIGHTS_FILE}: too short to be a safetensors file")
    (length,) = struct.unpack("<Q", raw[:8])
    if length > min(len(raw) - 8, MAX_CONFIG_BYTES * 16):
        raise IntegrityError(f"{WEIGHTS_FILE}: header length {length} is out of bounds")
    try:
        header = json.loads(raw[8 : 8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise IntegrityError(f"{WEIGHTS_FILE}: header is not valid JSON") from None
    if not isinstance(header, dict):
        raise IntegrityError(f"{WEIGHTS_FILE}: header is not a JSON object")
    header.pop("__metadata__", None)
    if not header:
        raise IntegrityError(f"{WEIGHTS_FILE}: contains no tensors")
    if not all(isinstance(entry, dict) for entry in header.values()):
        raise IntegrityError(f"{WEIGHTS_FILE}: every header entry must be a JSON object")
    return header


def _check_data(raw: AdapterBytes, header: dict[str, dict[str, Any]], data_start: int) -> None:
    """Every tensor's bytes lie in the file, with no gap or overlap, and hold finite values.

    A float is NaN or Inf exactly when all its exponent bits are set, so the check reads the
    raw little-endian words, for bf16 too, without any tensor library."""
    spans = []
    for name, entry in header.items():
        word, exponent, itemsize = _FLOAT_BITS[entry["dtype"]]
        count = math.prod(entry["shape"])
        offsets = entry.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise IntegrityError(f"{WEIGHTS_FILE}: tensor {name!r}: data_offsets must be two integers")
        begin, end = offsets
        if not 0 <= begin <= end or end - begin != count * itemsize or data_start + end > len(raw):
            raise IntegrityError(f"{WEIGHTS_FILE}: tensor {name!r}: data offsets out of bounds (truncated or corrupt)")
        spans.append((begin, end))
        words = np.frombuffer(raw, dtype=word, count=count, offset=data_start + begin)
        if bool(((words & exponent) == exponent).any()):
            raise IntegrityError(f"{WEIGHTS_FILE}: tensor {name!r} contains NaN or Inf values")
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise IntegrityError(f"{WEIGHTS_FILE}: tensor data overlaps or leaves a gap at byte {position}")
        position = end
    if data_start + position != len(raw):
        raise IntegrityError(f"{WEIGHTS_FILE}: {len(raw) - data_start - position} trailing bytes after the tensors")
