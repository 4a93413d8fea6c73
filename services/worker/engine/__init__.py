"""Continuous-batching inference engine with a paged, prefix-shared KV cache and a per-token LoRA hook."""

from services.worker.engine.async_engine import AsyncEngine, EngineDead, EngineStats
from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.errors import DuplicateRequest, RequestTooLarge, UnsupportedSampling
from services.worker.engine.lora_hook import LoraHook, LoraProvider
from services.worker.engine.sequence import EngineRequest, RequestOutput

__all__ = [
    "AsyncEngine",
    "DuplicateRequest",
    "EngineConfig",
    "EngineDead",
    "EngineRequest",
    "EngineStats",
    "LLMEngine",
    "LoraHook",
    "LoraProvider",
    "RequestOutput",
    "RequestTooLarge",
    "UnsupportedSampling",
]
