"""Base-model identity: architecture dims plus every tensor's name, dtype, shape and content, hashed.

Registry, workers and the CLI compute it the same way from the model directory, so an adapter
trained for another base model — another revision, or another fine-tune with identical shapes —
is refused before it loads. Content is hashed per tensor (sharding does not matter) straight
from the memory-mapped files; the result is cached per directory, keyed by every file's size,
mtime and inode, in memory and under ``fingerprint_cache_dir()``, so it is computed once.
"""

import hashlib
import json
import mmap
import os
import struct
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shared.errors import IntegrityError
from shared.signing import canonical_json

MAX_HEADER_BYTES = 100 * 1024 * 1024
FINGERPRINT_VERSION = 2  # 1: names, dtypes and shapes only; 2: and each tensor's bytes
CACHE_VERSION = 3  # the disk cache's: 3 since a mixture-of-experts model's architecture names its experts


@dataclass(frozen=True, slots=True)
class BaseModelSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    # mixture-of-experts layers (0 / empty on a dense model): routed experts, their width, the sparse
    # layers, and Qwen2-MoE's shared expert's width (0: none)
    num_experts: int = 0
    expert_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "BaseModelSpec":
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            layers = int(config["num_hidden_layers"])
            experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
            return cls(
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                vocab=int(config["vocab_size"]),
                num_experts=experts,
                expert_intermediate_size=int(config.get("moe_intermediate_size") or config["intermediate_size"])
                if experts
                else 0,
                sparse_layers=_sparse_layers(config, layers) if experts else (),
                shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0)
                if experts
                else 0,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise IntegrityError(f"base model config.json lacks a Llama-family field: {e}") from None

    @classmethod
    def from_model_dir(cls, path: Path) -> "BaseModelSpec":
        return cls.from_config(json.loads((Path(path) / "config.json").read_text()))

    def projection_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each LoRA-targetable projection."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden_size, q_out),
            "k_proj": (self.hidden_size, kv_out),
            "v_proj": (self.hidden_size, kv_out),
            "o_proj": (q_out, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }

    def layer_dims(self) -> list[dict[str, tuple[int, int, int]]]:
        """Per layer, each LoRA-targetable slot module's (copies, in_features, out_features): a dense
        layer's seven projections; a sparse layer's attention, its routed experts (copies: the expert
        count) and, on Qwen2-MoE, its shared expert as the MLP projections (shared.lora_targets)."""
        dense = {m: (1, i, o) for m, (i, o) in self.projection_dims().items()}
        attention = {m: dense[m] for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
        sparse = dict(attention)
        e, h, inter = self.num_experts, self.hidden_size, self.expert_intermediate_size
        sparse |= {
            "experts.gate_proj": (e, h, inter),
            "experts.up_proj": (e, h, inter),
            "experts.down_proj": (e, inter, h),
        }
        shared = self.shared_expert_intermediate_size
        if shared:
            sparse |= {"gate_proj": (1, h, shared), "up_proj": (1, h, shared), "down_proj": (1, shared, h)}
        return [sparse if i in self.sparse_layers else dense for i in range(self.num_layers)]

    def architecture(self) -> dict[str, Any]:
        """The fields the fingerprint hashes: a dense model's as before the MoE fields existed."""
        fields = asdict(self)
        if not self.num_experts:
            for name in ("num_experts", "expert_intermediate_size", "sparse_layers", "shared_expert_intermediate_size"):
                del fields[name]
        return fields


def _sparse_layers(config: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers transformers builds as a mixture of experts: all, but for Qwen-MoE's ``mlp_only_layers``
    and the layers ``decoder_sparse_step`` skips."""
    dense = set(config.get("mlp_only_layers") or ())
    step = int(config.get("decoder_sparse_step") or 1)
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def _read_header(f: Any, name: str) -> tuple[int, dict[str, dict[str, Any]]]:
    prefix = f.read(8)
    if len(prefix) != 8:
        raise IntegrityError(f"{name}: too short to be a safetensors file")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise IntegrityError(f"{name}: safetensors header of {length} bytes is too large")
    try:
        header: dict[str, dict[str, Any]] = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IntegrityError(f"{name}: unreadable safetensors header: {e}") from None
    header.pop("__metadata__", None)
    return 8 + length, header


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The JSON header of a safetensors file (tensor name -> dtype/shape/offsets), metadata removed."""
    with open(path, "rb") as f:
        return _read_header(f, path.name)[1]


def _tensor_digests(path: Path) -> list[list[Any]]:
    """[name, dtype, shape, sha256 of the tensor's bytes] of every tensor in one safetensors file."""
    rows: list[list[Any]] = []
    with open(path, "rb") as f:
        data_start, header = _read_header(f, path.name)
        size = os.fstat(f.fileno()).st_size
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        try:
            for name, entry in header.items():
                try:
                    begin, end = (data_start + int(o) for o in entry["data_offsets"])
                    dtype, shape = str(entry["dtype"]), [int(d) for d in entry["shape"]]
                except (KeyError, TypeError, ValueError):
                    raise IntegrityError(f"{path.name}: tensor {name!r} has a malformed header entry") from None
                if not data_start <= begin <= end <= size or view is None:
                    raise IntegrityError(f"{path.name}: tensor {name!r} lies outside the file")
                rows.append([name, dtype, shape, hashlib.sha256(memoryview(view)[begin:end]).hexdigest()])
        finally:
            if view is not None:
                view.close()
    return rows


_memo: dict[tuple[str, tuple[tuple[str, int, int, int], ...]], str] = {}
_memo_lock = threading.Lock()


def _file_keys(directory: Path, files: list[Path]) -> tuple[tuple[str, int, int, int], ...]:
    keys = []
    for file in [directory / "config.json", *files]:
        st = file.stat()
        keys.append((file.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(keys)


def fingerprint_cache_dir() -> Path:
    """``LF_FINGERPRINT_CACHE``, else ``$XDG_CACHE_HOME/lorafleet/fingerprints`` (``~/.cache`` by default)."""
    if explicit := os.environ.get("LF_FINGERPRINT_CACHE"):
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lorafleet" / "fingerprints"


def _disk_cache_path(directory: Path) -> Path:
    return fingerprint_cache_dir() / f"{hashlib.sha256(str(directory).encode()).hexdigest()}.json"


def _read_disk_cache(path: Path, keys: tuple[tuple[str, int, int, int], ...]) -> str | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if entry.get("version") != CACHE_VERSION or [tuple(k) for k in entry.get("files", [])] != list(keys):
        return None
    value = entry.get("fingerprint")
    return value if isinstance(value, str) and len(value) == 64 else None


def _write_disk_cache(path: Path, keys: tuple[tuple[str, int, int, int], ...], value: str) -> None:
    """Best effort: a read-only cache directory only costs a recomputation in the next process."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "files": keys, "fingerprint": value}))
        tmp.replace(path)
    except OSError:
        pass


def compute_fingerprint(directory: Path) -> str:
    """The fingerprint, computed from the files (no cache): sha256 of canonical JSON of the
    architecture and every tensor's [name, dtype, shape, content sha256], sorted by name."""
    spec = BaseModelSpec.from_model_dir(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise IntegrityError(f"{directory}: no safetensors weights to fingerprint")
    tensors = sorted(row for file in files for row in _tensor_digests(file))
    names = [row[0] for row in tensors]
    if len(set(names)) != len(names):
        raise IntegrityError(f"{directory}: a tensor name appears in two safetensors files")
    body = {"version": FINGERPRINT_VERSION, "architecture": spec.architecture(), "tensors": tensors}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def fingerprint_model_dir(path: str | Path) -> str:
    """The base-model fingerprint of a model directory, computed once per directory content."""
    directory = Path(path).resolve()
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise IntegrityError(f"{directory}: no safetensors weights to fingerprint")
    try:
        keys = _file_keys(directory, files)
    except OSError as e:
        raise IntegrityError(f"{directory}: cannot read the model files: {e}") from None
    memo_key = (str(directory), keys)
    with _memo_lock:
        if memo_key in _memo:
            return _memo[memo_key]
    cache = _disk_cache_path(directory)
    value = _read_disk_cache(cache, keys)
    if value is None:
        value = compute_fingerprint(directory)
        _write_disk_cache(cache, keys, value)
    with _memo_lock:
        _memo[memo_key] = value
    return value
