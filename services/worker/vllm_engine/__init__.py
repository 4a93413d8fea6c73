"""The worker's second engine: vLLM's async engine, in-process, behind services.worker.engine_port.

Only ``engine.py`` and ``sampling.py`` import vllm (it lives in .venv-vllm, made by ``make venv-vllm``); the rest
imports in the project's own environment."""
