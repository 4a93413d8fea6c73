"""The demo release of ``lorafleet up``: the shipped example adapters, signed with a generated dev key,
evaluated through the gateway, recorded, and promoted through the release gate."""

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import openai
from nats.aio.client import Client as NATS

from lorafleet.cli.adapter_cmd import TIMEOUT_S, cli_connect, push_adapter
from lorafleet.cli.demo_fit import DEMO_ADAPTERS, DemoFit, ServedModel, fit_demos
from lorafleet.cli.keys_cmd import ensure_trusted, generate
from lorafleet.evaluation.release import evaluate, promote, record_eval, summary
from lorafleet.evaluation.runner import gateway_client, load_eval_set
from shared import subjects
from shared.bus import request
from shared.errors import Unauthorized
from shared.schemas import (
    AdapterRecordsReply,
    ApiKeyCreatedReply,
    ApiKeysReply,
    CreateApiKeyRequest,
    GetAdapterRequest,
    RevokeApiKeyRequest,
)

SIGNER = "lorafleet-demo"


@dataclass(frozen=True, slots=True)
class DemoAdapter:
    adapter_id: str
    version: int
    prompt: str  # the eval set's first prompt, for the printed example
    summary: str
    answer: str | None = None  # what the adapter answered to it, when it was evaluated now


def _signing_key(state_dir: Path) -> tuple[Path, str]:
    keys = state_dir / "keys"
    if (keys / f"{SIGNER}.key").exists():
        return keys / f"{SIGNER}.key", (keys / f"{SIGNER}.pub").read_text().strip()
    return generate(SIGNER, keys)


async def _wait_for_key(client: openai.AsyncOpenAI, timeout_s: float = 15.0) -> None:
    """The gateway mirrors new keys from the registry's bucket: wait until it knows this one."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            await client.models.list()
            return
        except openai.AuthenticationError:
            if asyncio.get_running_loop().time() > deadline:
                raise Unauthorized("the gateway did not learn the release key in time") from None
            await asyncio.sleep(0.3)


async def seed_demo_adapters(
    nats_url: str,
    gateway_url: str,
    state_dir: Path,
    served: ServedModel,
    tenant_id: str,
    actor: str,
    cache_dir: Path,
) -> tuple[list[DemoAdapter], DemoFit]:
    """Release every example adapter that fits the served model and has no production version yet;
    the fitting ones listed, and why the others were skipped. ``cache_dir`` is the services' model cache."""
    directories = sorted(p for p in DEMO_ADAPTERS.iterdir() if (p / "eval.jsonl").is_file())
    fit = await asyncio.to_thread(fit_demos, directories, served, cache_dir)
    if not fit.fitting:
        return [], fit
    nc = await cli_connect(nats_url)
    try:
        return await _seed(nc, gateway_url, state_dir, served, fit.fitting, tenant_id, actor), fit
    finally:
        await nc.drain()


async def _seed(
    nc: NATS,
    gateway_url: str,
    state_dir: Path,
    served: ServedModel,
    directories: list[Path],
    tenant_id: str,
    actor: str,
) -> list[DemoAdapter]:
    key_file, public = _signing_key(state_dir)
    await ensure_trusted(nc, SIGNER, public, [tenant_id], actor)
    created = await request(
        nc,
        subjects.registry("api_key_create"),
        CreateApiKeyRequest(tenant_id=tenant_id, scopes=["inference", "admin"], actor=actor),
        ApiKeyCreatedReply,
        TIMEOUT_S,
    )
    client = gateway_client(gateway_url, created.key)
    try:
        await _wait_for_key(client)
        seeded = [
            await _release(nc, client, directory, key_file, served, tenant_id, actor) for directory in directories
        ]
    finally:
        await request(
            nc,
            subjects.registry("api_key_revoke"),
            RevokeApiKeyRequest(key_id=created.info.key_id, actor=actor),
            ApiKeysReply,
            TIMEOUT_S,
        )
    return seeded


async def _release(
    nc: NATS,
    client: openai.AsyncOpenAI,
    directory: Path,
    key_file: Path,
    served: ServedModel,
    tenant_id: str,
    actor: str,
) -> DemoAdapter:
    adapter_id = directory.name
    eval_set = load_eval_set(directory / "eval.jsonl")
    prompt = (eval_set.items[0].messages or [{"content": ""}])[-1]["content"]
    records = (
        await request(
            nc, subjects.registry("get"), GetAdapterRequest(adapter_id=adapter_id), AdapterRecordsReply, TIMEOUT_S
        )
    ).records
    live = next((r for r in records if r.status == "production"), None)
    if live is not None:
        return DemoAdapter(
            adapter_id,
            live.version,
            prompt,
            f"{adapter_id}@{live.version}: already in production, "
            f"platform eval {live.platform_eval.score if live.platform_eval else float('nan'):.3f}",
        )
    record = await push_adapter(
        nc,
        directory / "adapter",
        adapter_id=adapter_id,
        tenant_id=tenant_id,
        task_type=adapter_id,
        base_fingerprint=served.fingerprint,
        sign_key=key_file,
        who=actor,
        eval_set=directory / "eval.jsonl",
    )
    evaluation = await evaluate(client, adapter_id, record.version, eval_set, base_model=served.name, max_tokens=40)
    await record_eval(nc, adapter_id, record.version, evaluation, actor)
    await promote(nc, adapter_id, record.version, 100, actor)
    return DemoAdapter(
        adapter_id,
        record.version,
        prompt,
        summary(adapter_id, record.version, evaluation),
        evaluation.adapter.answers[0],
    )


def curl_example(port: int, key: str, model: str, prompt: str) -> str:
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0}
    ).replace("'", "'\\''")  # inside a single-quoted shell word
    return (
        f"curl -s http://127.0.0.1:{port}/v1/chat/completions \\\n"
        f"  -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\\n"
        f"  -d '{body}'"
    )
