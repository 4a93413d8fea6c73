"""Make random PEFT LoRA adapters of mixed ranks and register them through the registry's real push path
(upload to the object store, admission, then promotion to production)."""

import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from lorafleet.cli.adapter_cmd import cli_connect, push_adapter
from shared import subjects
from shared.bus import request
from shared.fingerprint import BaseModelSpec, fingerprint_model_dir
from shared.schemas import AdapterRecordsReply, PromoteRequest

TARGETS = ("q_proj", "v_proj")
ACTOR = "bench-load"


@dataclass(frozen=True, slots=True)
class AdapterPlan:
    adapter_id: str
    tenant: str
    rank: int


def parse_rank_mix(text: str) -> dict[int, float]:
    """``"8:4,16:3,32:2,64:1"`` -> {rank: weight}."""
    mix = {}
    for part in text.split(","):
        rank, _, weight = part.partition(":")
        mix[int(rank)] = float(weight or 1)
    if not mix or any(r < 1 for r in mix) or any(w <= 0 for w in mix.values()):
        raise ValueError(f"bad rank mix {text!r}: want rank:weight,... with positive numbers")
    return mix


def plan_adapters(count: int, tenants: list[str], rank_mix: dict[int, float], seed: int) -> list[AdapterPlan]:
    """Adapter i belongs to tenant i mod T; its rank is drawn from ``rank_mix`` (seeded)."""
    rng = random.Random(f"ranks-{seed}")
    ranks = rng.choices(list(rank_mix), weights=list(rank_mix.values()), k=count)
    return [AdapterPlan(f"load-{i:04d}", tenants[i % len(tenants)], ranks[i]) for i in range(count)]


def peft_config(rank: int) -> dict:
    """The fields peft writes for a plain LoRA (importing peft itself costs seconds)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": False,
        "inference_mode": True,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "base_model_name_or_path": None,
        "revision": None,
    }


def write_adapter(directory: Path, spec: BaseModelSpec, rank: int, seed: int, dtype: str = "bfloat16") -> Path:
    """A PEFT adapter directory as ``save_pretrained`` writes it, with random non-zero A and B."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(peft_config(rank)))
    dims = spec.projection_dims()
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module in TARGETS:
            in_f, out_f = dims[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=generator) / in_f**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=generator) * 0.01
    typed = {name: t.to(getattr(torch, dtype)) for name, t in tensors.items()}
    save_file(typed, str(directory / "adapter_model.safetensors"))
    return directory


async def register_adapters(
    nats_url: str, model_dir: Path, plans: list[AdapterPlan], *, concurrency: int, seed: int
) -> dict:
    """Push and promote every planned adapter, ``concurrency`` at a time; timing figures of the whole."""
    spec, fingerprint = BaseModelSpec.from_model_dir(model_dir), fingerprint_model_dir(model_dir)
    nc = await cli_connect(nats_url)
    gate = asyncio.Semaphore(concurrency)
    weight_bytes = 0

    async def one(i: int, plan: AdapterPlan, scratch: Path) -> None:
        nonlocal weight_bytes
        async with gate:
            directory = await asyncio.to_thread(write_adapter, scratch / plan.adapter_id, spec, plan.rank, seed + i)
            weight_bytes += (directory / "adapter_model.safetensors").stat().st_size
            record = await push_adapter(
                nc,
                directory,
                adapter_id=plan.adapter_id,
                tenant_id=plan.tenant,
                task_type="chat",
                base_fingerprint=fingerprint,
                who=ACTOR,
            )
            await request(
                nc,
                subjects.registry("promote"),
                PromoteRequest(
                    adapter_id=plan.adapter_id,
                    version=record.version,
                    traffic_percent=100,
                    skip_eval=True,  # the release gate needs an eval set: these adapters are random weights
                    reason="load bench: synthetic adapter, no eval set",
                    actor=ACTOR,
                ),
                AdapterRecordsReply,
                30,
            )
            for path in directory.iterdir():
                path.unlink()
            directory.rmdir()

    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="lf-load-adapters-") as scratch:
            await asyncio.gather(*(one(i, p, Path(scratch)) for i, p in enumerate(plans)))
    finally:
        await nc.drain()
    seconds = time.perf_counter() - started
    return {
        "adapters": len(plans),
        "seconds": seconds,
        "per_s": len(plans) / seconds if seconds else 0.0,
        "weight_bytes": weight_bytes,
        "dtype": "bfloat16",
        "targets": list(TARGETS),
        "concurrency": concurrency,
        "ranks": {str(r): sum(p.rank == r for p in plans) for r in sorted({p.rank for p in plans})},
    }
