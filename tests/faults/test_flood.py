"""A flood of invalid adapter pushes (straight at the registry over NATS) and of requests for another
tenant's private adapter, during good traffic of two tenants: the good traffic sees zero errors, each
bad push gets its typed refusal and leaves nothing stored, each foreign request a plain 404."""

import asyncio
import base64
import json
import secrets
import sqlite3
import time

import httpx
import nats
import pytest
import torch
from nats.aio.client import Client as NATS
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from shared import subjects
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE, read_adapter_dir
from shared.bus import request
from shared.errors import LorafleetError
from shared.kv_read import read_latest
from shared.schemas import AdapterRecordsReply, ListAdaptersRequest, RegisterRequest
from tests.faults.conftest import ADAPTER, Fleet
from tests.faults.traffic import Outcome, gateway, steady

pytestmark = pytest.mark.timeout(150)
Files = dict[str, bytes]
ROUNDS = 3  # each bad variant is pushed this many times, half inline and half through the uploads bucket


def _tensors(files: Files, change) -> Files:
    tensors = load_tensors(files[WEIGHTS_FILE])
    change(tensors)
    return {**files, WEIGHTS_FILE: save_tensors(tensors)}


def _config(files: Files, **update: object) -> Files:
    return {**files, CONFIG_FILE: json.dumps({**json.loads(files[CONFIG_FILE]), **update}).encode()}


def _poison(tensors: dict[str, torch.Tensor]) -> None:
    name = min(tensors)
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = float("nan")


def _widen(tensors: dict[str, torch.Tensor]) -> None:
    """As if trained on a base model twice as wide: every lora_A reads a longer input."""
    for name in [n for n in tensors if "lora_A" in n]:
        tensors[name] = torch.cat([tensors[name], tensors[name]], dim=1)


def bad_variants(good: Files) -> dict[str, tuple[Files, str]]:
    """Name -> (files, the error code its push must get)."""
    return {
        "nan": (_tensors(good, _poison), "integrity_error"),
        "wrong-base": (_tensors(good, _widen), "integrity_error"),
        "dora": (_config(good, use_dora=True), "invalid_request"),
        "rank": (_config(good, r=4096), "invalid_request"),
        "save": (_config(good, modules_to_save=["lm_head"]), "invalid_request"),
        "remote-code": (_config(good, auto_map={"AutoModel": "evil.Model"}), "invalid_request"),
        "pickle": ({CONFIG_FILE: good[CONFIG_FILE], "adapter_model.bin": b"\x80\x04\x95pickle"}, "invalid_request"),
        "garbage": ({**good, WEIGHTS_FILE: b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}"}, "integrity_error"),
    }


async def push(nc: NATS, adapter_id: str, files: Files, inline: bool, tenant: str = "demo") -> str:
    """Register ``files``; the error code the registry answered ("" if it admitted them)."""
    source: dict = {"inline_files": {n: base64.b64encode(d).decode() for n, d in files.items()}}
    if not inline:
        source = {"upload_id": secrets.token_hex(12)}
        uploads = await nc.jetstream().object_store(subjects.ADAPTER_UPLOADS_BUCKET)
        for name, data in files.items():
            await uploads.put(f"{source['upload_id']}/{name}", data)
    try:
        await request(
            nc,
            subjects.registry("register"),
            RegisterRequest(adapter_id=adapter_id, tenant_id=tenant, task_type="chat", actor="test", **source),
            AdapterRecordsReply,
            30,
        )
    except LorafleetError as e:
        return e.code
    return ""


async def flood_pushes(nc: NATS, good: Files) -> dict[str, tuple[str, str]]:
    """Adapter id -> (code expected, code answered), for every bad push, all sent at once."""
    pushes, expected = [], {}
    for n, (name, (files, code)) in enumerate(bad_variants(good).items()):
        for i in range(ROUNDS):
            adapter_id = f"bad-{name}-{i}"
            expected[adapter_id] = code
            pushes.append(push(nc, adapter_id, files, inline=(n + i) % 2 == 0))
    expected["sea"] = "conflict"  # tenant other pushing a valid adapter under tenant demo's id
    pushes.append(push(nc, ADAPTER, good, inline=True, tenant="other"))
    answers = await asyncio.gather(*pushes)
    return {adapter_id: (code, answer) for (adapter_id, code), answer in zip(expected.items(), answers, strict=True)}


async def foreign_requests(client: httpx.AsyncClient, n: int) -> list[httpx.Response]:
    models = [ADAPTER, f"{ADAPTER}@1", "no-such-adapter"]
    return list(
        await asyncio.gather(
            *(
                client.post(
                    "/v1/chat/completions",
                    headers={"Authorization": "Bearer key-other"},
                    json={
                        "model": models[i % len(models)],
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 4,
                    },
                )
                for i in range(n)
            )
        )
    )


async def stored(nc: NATS) -> tuple[list[str], list[str], list[str]]:
    """Adapter ids the registry lists, approved-store object names, record keys: those of bad pushes."""
    js = nc.jetstream()
    listed = (await request(nc, subjects.registry("adapters"), ListAdaptersRequest(), AdapterRecordsReply, 10)).records
    objects = await (await js.object_store(subjects.ADAPTER_STORE_BUCKET)).list()
    keys = [v.key for v in await read_latest(await js.key_value(subjects.REGISTRY_RECORDS_BUCKET))]
    return (
        [r.adapter_id for r in listed if r.adapter_id.startswith("bad-") or r.tenant_id == "other"],
        [o.name for o in objects if o.name.startswith("bad-")],
        [k for k in keys if k.startswith("bad-")],
    )


def isolation_attempts(fleet: Fleet) -> int:
    """Tenant other's attempts at another tenant's adapter, as the auditor indexed them."""
    with sqlite3.connect(fleet.db_path, timeout=5) as db:
        rows = db.execute("SELECT body FROM audit WHERE kind = 'rejection' AND tenant_id = 'other'").fetchall()
    return sum(json.loads(body)["code"] == "tenant_isolation_attempt" for (body,) in rows)


async def attempts_audited(fleet: Fleet, at_least: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while isolation_attempts(fleet) < at_least:
        assert time.monotonic() < deadline, f"{isolation_attempts(fleet)} isolation attempts audited, not {at_least}"
        await asyncio.sleep(0.3)


async def test_a_flood_of_bad_pushes_and_foreign_requests_leaves_good_traffic_untouched(fleet):
    good = read_adapter_dir(fleet.model_dir.parent / ADAPTER)
    attempts_before = isolation_attempts(fleet)
    nc = await nats.connect(fleet.nats.url)
    try:
        async with gateway(fleet.gateway_url) as client:
            traffic = asyncio.create_task(steady(client, 30, 0.1, 16))
            await asyncio.sleep(0.3)
            pushed, foreign = await asyncio.gather(flood_pushes(nc, good), foreign_requests(client, 30))
            outcomes: list[Outcome] = await traffic
        assert all(o.whole(16) for o in outcomes), [o.describe() for o in outcomes if not o.whole(16)]
        assert {a: got for a, (want, got) in pushed.items() if got != want} == {}, pushed
        assert await stored(nc) == ([], [], [])
    finally:
        await nc.close()

    assert {r.status_code for r in foreign} == {404}
    assert {r.json()["error"]["code"] for r in foreign} == {"model_not_found"}
    unknown = next(r for r in foreign if "no-such-adapter" in r.json()["error"]["message"])
    for r in foreign:  # a foreign adapter reads exactly like one that does not exist
        model = r.json()["error"]["message"].split("'")[1]
        assert r.json()["error"]["message"] == unknown.json()["error"]["message"].replace("no-such-adapter", model)
    await attempts_audited(fleet, attempts_before + 20, 15)  # the 20 asking for sea or sea@1
