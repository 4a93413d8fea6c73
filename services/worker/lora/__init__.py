"""Adapter slot pool: rank-class stacks, PEFT loading, per-step metadata and the engine's LoRA hook."""

from services.worker.lora.applier import LoraBatch
from services.worker.lora.layout import MODULES, AdapterWeights, ModelShapes
from services.worker.lora.lora_config import LoraConfig
from services.worker.lora.manager import AdapterManager, PoolStats, RankClassStats
from services.worker.lora.peft_loader import load_peft_adapter

__all__ = [
    "MODULES",
    "AdapterManager",
    "AdapterWeights",
    "LoraBatch",
    "LoraConfig",
    "ModelShapes",
    "PoolStats",
    "RankClassStats",
    "load_peft_adapter",
]
