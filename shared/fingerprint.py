"""Base-model identity: architecture dims plus every tensor's name/shape/dtype, hashed.

Registry and workers compute it the same way from the model directory, so an adapter
trained for another base model (or another revision of it) is refused before it loads.
Only safetensors headers are read, never tensor data.
"""

import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shared.errors import IntegrityError
from shared.signing import canonical_json

MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class BaseModelSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "BaseModelSpec":
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            return cls(
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                vocab=int(config["vocab_size"]),
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


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The JSON header of a safetensors file (tensor name -> dtype/shape/offsets), metadata removed."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise IntegrityError(f"{path.name}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise IntegrityError(f"{path.name}: safetensors header of {length} bytes is too large")
        header: dict[str, dict[str, Any]] = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def fingerprint_model_dir(path: str | Path) -> str:
    """sha256 over canonical JSON of the architecture and every tensor's name, shape and dtype."""
    directory = Path(path)
    spec = BaseModelSpec.from_model_dir(directory)
    tensors: list[list[Any]] = []  # [name, dtype, shape]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise IntegrityError(f"{directory}: no safetensors weights to fingerprint")
    for file in files:
        for name, entry in read_safetensors_header(file).items():
            tensors.append([name, entry["dtype"], list(entry["shape"])])
    tensors.sort()
    return hashlib.sha256(canonical_json({"architecture": asdict(spec), "tensors": tensors})).hexdigest()
