"""Push and release PEFT adapters through the gateway's admin API (dev-mode registry, unsigned)."""

from pathlib import Path

import httpx

from tests.helpers.adapters import save_peft_adapter, tiny_llama


def make_adapter(directory: Path, seed: int = 0) -> Path:
    return save_peft_adapter(directory, tiny_llama(), seed=seed)


async def push(client: httpx.AsyncClient, directory: Path, adapter_id: str, **form: object) -> httpx.Response:
    files = {
        "adapter_config": ("adapter_config.json", (directory / "adapter_config.json").read_bytes()),
        "adapter_model": ("adapter_model.safetensors", (directory / "adapter_model.safetensors").read_bytes()),
    }
    return await client.post(
        "/admin/adapters", data={"adapter_id": adapter_id, "task_type": "chat", **form}, files=files
    )


async def release(client: httpx.AsyncClient, directory: Path, adapter_id: str, **form: object) -> None:
    """Push version 1 and promote it straight to production."""
    r = await push(client, directory, adapter_id, **form)
    assert r.status_code == 201, r.text
    r = await client.post(f"/admin/adapters/{adapter_id}/promote", json={"version": 1, "traffic_percent": 100})
    assert r.status_code == 200, r.text
