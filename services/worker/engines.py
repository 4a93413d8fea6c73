"""The engine ``LF_WORKER_ENGINE`` names, with the adapter cache that feeds it: built-in or vLLM.

Either way adapters come through the same StoreLoader (fetch, digest, signature, base fingerprint) and
the same CacheHierarchy (heat policy, tenant slot quota, pins, directives, revocation); only the slot
backend differs: the built-in AdapterManager's slot tensors, or vLLM's add/remove LoRA calls."""

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

from services.worker.adapter_cache.hierarchy import CacheHierarchy
from services.worker.adapter_source import StoreLoader
from services.worker.engine_port import WorkerEngine
from services.worker.lora.layout import ModelShapes
from services.worker.prompt_ids import PromptIds
from services.worker.settings import WorkerSettings
from services.worker.start_phase import StartPhase
from shared import heap
from shared.base_model import resolve_model_dir, served_model_name
from shared.catalog.view import CatalogView
from shared.fingerprint import fingerprint_model_dir
from shared.lora_targets import EXPERT_MODULES
from shared.schemas import EngineCapability


@dataclass(frozen=True, slots=True)
class Served:
    """What the worker's service tier drives, whichever engine generates."""

    engine: WorkerEngine
    cache: CacheHierarchy
    loader: StoreLoader
    prompts: PromptIds
    model_name: str
    max_running: int
    capability: EngineCapability
    rank_classes: tuple[int, ...]  # ascending, as the slots are grouped
    rank_pool: tuple[int, ...]  # the classes served as a pool (LF_WORKER_RANK_POOL); () = none


def _loader(nc, catalog: CatalogView, settings: WorkerSettings, directory: Path, shapes: ModelShapes) -> StoreLoader:  # type: ignore[no-untyped-def]
    return StoreLoader(
        nc,
        catalog,
        asyncio.get_running_loop(),
        fingerprint_model_dir(directory),
        shapes,
        settings.lora,
        require_signature=settings.require_signature,
    )


async def builtin(
    nc, catalog: CatalogView, settings: WorkerSettings, stack: contextlib.AsyncExitStack, phases: StartPhase
) -> Served:  # type: ignore[no-untyped-def]
    import torch

    from kernels import native, omp_threads
    from services.worker.engine.async_engine import AsyncEngine, StepThread
    from services.worker.engine.model_loader import load_model
    from services.worker.lora.manager import AdapterManager

    if torch.device(settings.engine.device).type == "cpu":
        # found or built (in a child process, bounded in time) before the model loads, so a start that
        # waits on it says so; the engine's probes then find it loaded, or serve eager where it is not
        phases.enter("building_kernels", "the native CPU kernels: found, else built (lorafleet kernels status)")
        await asyncio.to_thread(native.built)
    phases.enter("loading_model", str(settings.model_dir or "embedded SmolLM2"))
    cache_dir = Path(settings.model_cache) if settings.model_cache else None
    # The model loads, and the engine is built, on the thread that then runs its steps: that thread's
    # OpenMP team is the process's only one (async_engine.StepThread); every other thread runs torch inline.
    thread = StepThread(settings.engine, omp_threads.serial_process())
    stack.callback(thread.close)
    loaded = await thread.run(
        lambda: load_model(
            settings.model_dir,
            device=settings.engine.device,
            dtype=settings.engine.torch_dtype,  # read straight into the serving dtype: no fp32 copy
            cache_dir=cache_dir,
        )
    )
    shapes = ModelShapes.from_hf_config(loaded.model.config)
    manager = AdapterManager(settings.lora, shapes, device=settings.engine.device, dtype=settings.engine.torch_dtype)
    loader = _loader(nc, catalog, settings, loaded.directory, shapes)
    cache = CacheHierarchy(manager, loader, settings.cache)
    stack.callback(cache.close)
    engine = await thread.run(
        lambda: AsyncEngine.from_loaded(
            loaded, settings.engine, adapter_manager=manager, grammar_bounds=settings.grammar
        )
    )
    omp_threads.serial_process()  # LF_ENGINE__NUM_THREADS set the process-wide count on the step thread: back to 1
    heap.trim()  # the load's freed intermediates (checkpoint tensors, weights made into int8/int4 codes) go back
    engine.start(thread)
    stack.callback(engine.shutdown)
    prompts = await asyncio.to_thread(PromptIds.for_model, loaded.tokenizer, loaded.directory)
    capability = EngineCapability(
        engine="builtin",
        max_lora_rank=settings.lora.max_rank,
        lora_modules=shapes.present(settings.lora.target_modules),
    )
    classes = settings.lora.rank_classes
    return Served(
        engine,
        cache,
        loader,
        prompts,
        loaded.name,
        settings.engine.max_num_seqs,
        capability,
        classes,
        settings.rank_pool(classes),
    )


async def vllm(
    nc, catalog: CatalogView, settings: WorkerSettings, stack: contextlib.AsyncExitStack, phases: StartPhase
) -> Served:  # type: ignore[no-untyped-def]
    """vLLM's engine on the base model's directory; this process loads only its config and tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    from services.worker.engine.grammar import Grammars
    from services.worker.vllm_engine.adapter_dir import AdapterDir
    from services.worker.vllm_engine.engine import VllmEngine
    from services.worker.vllm_engine.slots import VllmSlots

    phases.enter("loading_model", str(settings.model_dir or "embedded SmolLM2"))
    cache_dir = Path(settings.model_cache) if settings.model_cache else None
    directory = await asyncio.to_thread(resolve_model_dir, settings.model_dir, cache_dir)
    config = await asyncio.to_thread(AutoConfig.from_pretrained, directory)
    shapes = ModelShapes.from_hf_config(config)
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, directory)
    loader = _loader(nc, catalog, settings, directory, shapes)
    c = settings.vllm
    stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    # the bounded pre-compile of every grammar (VllmEngine.grammars); it masks nothing, so one row
    grammars = Grammars(tokenizer, config.vocab_size, stops, 1, settings.engine.grammar_cache, settings.grammar)
    engine = VllmEngine(directory, c, AdapterDir(), grammars, settings.lora.rank_classes)
    engine.start()  # vLLM builds its output handler on this loop; its engine core loads in a child process
    stack.callback(engine.shutdown)
    assert engine.plan is not None  # set by start
    rank = engine.plan.served_rank
    slots = VllmSlots(engine, asyncio.get_running_loop(), rank, engine.plan.slots)
    cache = CacheHierarchy(slots, loader.files, settings.cache)
    stack.callback(cache.close)
    prompts = await asyncio.to_thread(PromptIds.for_model, tokenizer, directory)
    # LoRA on experts is the built-in engine's: a vLLM worker announces (and the scheduler places on it) the rest
    served = [m for m in shapes.present(settings.lora.target_modules) if m not in EXPERT_MODULES]
    capability = EngineCapability(engine="vllm", max_lora_rank=rank, lora_modules=served)
    name = served_model_name(settings.model_dir, directory)
    # vLLM holds every adapter in one class of its max rank: any declared pool is that class
    pool = (rank,) if settings.worker_rank_pool else ()
    return Served(engine, cache, loader, prompts, name, c.max_num_seqs, capability, (rank,), pool)
