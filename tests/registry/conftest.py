"""Registry fixtures: a tiny Llama base model directory and a real peft LoRA adapter for it."""

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch
from nats.aio.client import Client as NATS
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from safetensors.torch import save_file

from services.registry.push_admission import BaseModelIdentity, IntakePolicy
from services.registry.service import run
from services.registry.settings import RegistrySettings
from shared import subjects
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE, AdapterLimits
from shared.bus import connect
from shared.fingerprint import BaseModelSpec, fingerprint_model_dir
from shared.schemas import AdapterRecord, ServiceHeartbeat
from shared.signing import KeyPair, generate_keypair
from tests.helpers import records
from tests.registry.bus_world import wired  # noqa: F401  # the op-table fixture of the *_bus tests

TINY = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}

Files = dict[str, bytes]


def write_base_model(directory: Path, config: dict) -> Path:
    """A Llama-shaped model directory (config.json + safetensors) without loading transformers."""
    spec = BaseModelSpec.from_config(config)
    tensors = {"model.embed_tokens.weight": torch.zeros(spec.vocab, spec.hidden_size)}
    for i in range(spec.num_layers):
        for module, (in_f, out_f) in spec.projection_dims().items():
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            tensors[f"model.layers.{i}.{block}.{module}.weight"] = torch.zeros(out_f, in_f)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, directory / "model.safetensors")
    return directory


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_base_model(tmp_path_factory.mktemp("base") / "tiny-llama", TINY)


@pytest.fixture(scope="session")
def base(base_dir: Path) -> BaseModelIdentity:
    return BaseModelIdentity(
        name="tiny-llama", fingerprint=fingerprint_model_dir(base_dir), spec=BaseModelSpec.from_model_dir(base_dir)
    )


@pytest.fixture(scope="session")
def peft_adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter saved by peft itself (r=8, alpha=16, q_proj + v_proj) on the tiny base."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k not in ("model_type", "architectures")}))
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    directory = tmp_path_factory.mktemp("adapter") / "peft-adapter"
    get_peft_model(model, config).save_pretrained(directory)
    return directory


@pytest.fixture
def adapter_files(peft_adapter_dir: Path) -> Files:
    return {name: (peft_adapter_dir / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)}


@pytest.fixture
def variant(adapter_files: Files) -> Callable[..., Files]:
    """Copy of the peft adapter with config keys replaced and/or tensors edited in place."""

    def make(config: dict | None = None, tensors: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Files:
        files = dict(adapter_files)
        if config is not None:
            files[CONFIG_FILE] = json.dumps({**json.loads(files[CONFIG_FILE]), **config}).encode()
        if tensors is not None:
            loaded = load_tensors(files[WEIGHTS_FILE])
            tensors(loaded)
            files[WEIGHTS_FILE] = save_tensors(loaded)
        return files

    return make


@pytest.fixture(scope="session")
def signer_keys() -> KeyPair:
    return generate_keypair()


@pytest.fixture
def policy() -> IntakePolicy:
    return IntakePolicy(limits=AdapterLimits(max_rank=16, max_weights_bytes=1_000_000), dev_mode=False)


@pytest.fixture
def make_record() -> Callable[..., AdapterRecord]:
    """An AdapterRecord with placeholder digests, for catalog-level tests that need no files."""
    return records.make_record


@pytest.fixture
async def registry(nats_url: str, base_dir: Path, tmp_path: Path) -> AsyncIterator[NATS]:
    """A running registry service and a client connection; the service stops at teardown."""
    settings = RegistrySettings(
        nats_url=nats_url,
        model_dir=str(base_dir),
        instance_id="reg-test",
        heartbeat_interval_s=0.1,
        max_rank=16,
        trusted_source_dirs=(str(tmp_path),),
    )
    nc = await connect(nats_url, "registry-test")
    beats = await nc.subscribe(subjects.service_heartbeat("registry"))
    stop = asyncio.Event()
    service = asyncio.create_task(run(settings, stop))
    beat = ServiceHeartbeat.model_validate_json((await beats.next_msg(timeout=30)).data)
    assert (beat.service, beat.ready) == ("registry", True)
    await beats.unsubscribe()
    yield nc
    stop.set()
    await service
    await nc.drain()
