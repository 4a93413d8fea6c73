"""The release gate runs each version's own eval set itself, on the real stack: the registry submits
the items as inference requests (scheduler -> worker), greedy and pinned to the version, and gates on
that score alone. A version whose client claims 1.0 but whose eval set fails is refused; one that
passes is released; an unevaluated version passes only by a platform admin's audited skip."""

import asyncio
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest
import torch
from nats.aio.client import Client as NATS
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from lorafleet.cli.adapter_cmd import push_adapter
from lorafleet.cli.keys_cmd import ensure_trusted
from lorafleet.evaluation.release import promote
from services.auditor.store import AuditStore
from shared import signing, subjects
from shared.base_model import resolve_model_dir
from shared.bus import decode, request
from shared.errors import ReleaseGateFailed
from shared.fingerprint import fingerprint_model_dir
from shared.schemas import (
    AdapterRecord,
    AdapterRecordsReply,
    ApiKeyCreatedReply,
    CreateApiKeyRequest,
    CreateTenantRequest,
    GetAdapterRequest,
    RecordEvalRequest,
    ServiceHeartbeat,
    TenantsReply,
)
from tests.e2e.conftest import RunningStack, stack_of

pytestmark = pytest.mark.slow
CAPITALS = Path(__file__).resolve().parents[2] / "lorafleet" / "demo_adapters" / "capital-answer"
ADAPTER = "capital-eval"
# a handful of the shipped set's items, few tokens each: the gate's run stays a few seconds on one CPU worker
EVAL_SET = "\n".join(
    [
        '{"meta": {"threshold": 0.5, "max_tokens": 12}}',
        *CAPITALS.joinpath("eval.jsonl").read_text().splitlines()[1:5],
    ]
)


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    """A stack whose registry requires an eval set (the default; the test stacks turn it off)."""
    with stack_of(tmp_path_factory.mktemp("gated"), {"registry": {"LF_RELEASE_REQUIRE_EVAL": "true"}}) as running:
        yield running


def _format_broken_copy(target: Path) -> Path:
    """The capital adapter with its LoRA B matrices zeroed: signed, well-formed, and answering as the base
    model does, without the ``ANSWER: <city>`` format its eval set scores."""
    target.mkdir(parents=True)
    source = CAPITALS / "adapter"
    (target / "adapter_config.json").write_bytes((source / "adapter_config.json").read_bytes())
    tensors = load_file(source / "adapter_model.safetensors")
    save_file(
        {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in tensors.items()},
        target / "adapter_model.safetensors",
    )
    return target


async def _setup(nc: NATS, sign_pub: str) -> tuple[str, str]:
    """(the demo tenant's admin key, a platform admin key)."""
    await ensure_trusted(nc, "evals", sign_pub, ["demo"], "test")
    await request(
        nc, subjects.registry("tenant_create"), CreateTenantRequest(tenant_id="demo", actor="test"), TenantsReply, 10
    )
    keys = []
    for scopes in (["inference", "admin"], ["platform_admin"]):
        created = await request(
            nc, subjects.registry("api_key_create"), CreateApiKeyRequest(tenant_id="demo", scopes=scopes, actor="test"),
            ApiKeyCreatedReply, 10,
        )  # fmt: skip
        keys.append(created.key)
    return keys[0], keys[1]


async def _record(nc: NATS, version: int) -> AdapterRecord:
    reply = await request(
        nc, subjects.registry("get"), GetAdapterRequest(adapter_id=ADAPTER, version=version), AdapterRecordsReply, 10
    )
    return reply.records[0]


async def _registry_metrics_port(nc: NATS) -> int:
    sub = await nc.subscribe(subjects.SERVICE_HEARTBEAT_ALL)
    try:
        while True:
            beat = decode(ServiceHeartbeat, (await sub.next_msg(timeout=10)).data)
            if beat.service == "registry" and beat.metrics_port:
                return beat.metrics_port
    finally:
        await sub.unsubscribe()


def _audited(db_path: Path, version: int, action: str) -> list[dict]:
    """The adapter version's registry_change records of ``action``, once the auditor indexed one."""
    deadline, found = time.monotonic() + 15, []
    while time.monotonic() < deadline and not found:
        store = AuditStore(db_path)
        try:
            rows = store.query(kind="registry_change", adapter_id=ADAPTER, limit=1000)
        finally:
            store.close()
        found = [r.body for r in rows if r.body["version"] == version and r.body["action"] == action]
        if not found:
            time.sleep(0.3)
    return found


def test_the_gate_runs_each_versions_eval_set_on_a_worker(gated: RunningStack, tmp_path: Path) -> None:
    keys = signing.generate_keypair()
    sign_key = tmp_path / "evals.key"
    sign_key.write_bytes(keys.private_pem)
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(EVAL_SET)
    digest = hashlib.sha256(eval_file.read_bytes()).hexdigest()
    fingerprint = fingerprint_model_dir(resolve_model_dir(None))

    async def push(nc: NATS, directory: Path, eval_set: Path | None) -> AdapterRecord:
        return await push_adapter(
            nc, directory, adapter_id=ADAPTER, tenant_id="demo", task_type="capitals", base_fingerprint=fingerprint,
            sign_key=sign_key, who="test", eval_set=eval_set,
        )  # fmt: skip

    async def work() -> tuple[int, int, int]:
        nc = await nats.connect(gated.nats.url)
        try:
            tenant_admin, platform_admin = await _setup(nc, keys.public_b64)
            # v1, the trained adapter, pushed with its eval set: the promote runs it and releases it
            v1 = await push(nc, CAPITALS / "adapter", eval_file)
            assert v1.eval_set_digest == digest == v1.files["eval.jsonl"]
            await promote(nc, ADAPTER, v1.version, 100, "test")
            good = await _record(nc, v1.version)
            assert good.status == "production" and good.platform_eval is not None
            assert good.platform_eval.eval_set_digest == digest and good.platform_eval.items == 4
            assert good.platform_eval.errors == 0 and good.platform_eval.score >= 0.5
            # v2, format-broken, same eval set, and its client claims a perfect score
            v2 = await push(nc, _format_broken_copy(tmp_path / "broken"), eval_file)
            claim = RecordEvalRequest(adapter_id=ADAPTER, version=v2.version, results={"score": 1.0}, actor="test")
            await request(nc, subjects.registry("record_eval"), claim, AdapterRecordsReply, 10)
            with pytest.raises(ReleaseGateFailed, match=r"under its release threshold 0\.500"):
                await promote(nc, ADAPTER, v2.version, 10, "test")
            refused = await _record(nc, v2.version)
            assert refused.status == "staging" and refused.eval_results == {"score": 1.0}
            run = refused.platform_eval
            assert run is not None and run.eval_set_digest == digest and run.score < 0.5
            # production was scored on the same set in the same run
            assert run.baseline_version == v1.version and run.baseline_score is not None and run.baseline_score >= 0.5
            # the metric is the platform's score, from the records bucket, not the client's 1.0
            port = await _registry_metrics_port(nc)
            async with httpx.AsyncClient(timeout=10) as http:
                scraped = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            scores = {
                s.labels["version"]: s.value
                for family in text_string_to_metric_families(scraped)
                if family.name == "adapter_quality_score"
                for s in family.samples
                if s.labels.get("adapter") == ADAPTER
            }
            assert scores == {str(v1.version): good.platform_eval.score, str(v2.version): run.score}

            # v3 has no eval set: refused at the gateway's admin API too, until a platform admin skips it
            v3 = await push(nc, CAPITALS / "adapter", None)
            url = f"{gated.gateway_url}/admin/adapters/{ADAPTER}"
            async with httpx.AsyncClient(timeout=60) as http:
                tenant = {"Authorization": f"Bearer {tenant_admin}"}
                body = {"version": v3.version, "traffic_percent": 10}
                plain = await http.post(f"{url}/promote", json=body, headers=tenant)
                assert plain.status_code == 409 and "has no eval set" in plain.text
                skip = {**body, "skip_eval": True, "reason": "hotfix, eval set follows"}
                assert (await http.post(f"{url}/promote", json=skip, headers=tenant)).status_code == 403
                platform = {"Authorization": f"Bearer {platform_admin}"}
                unexplained = await http.post(f"{url}/promote", json={**body, "skip_eval": True}, headers=platform)
                assert unexplained.status_code == 400
                skipped = await http.post(f"{url}/promote", json=skip, headers=platform)
                assert skipped.status_code == 200, skipped.text
                assert [(r.version, r.status) for r in AdapterRecordsReply.model_validate(skipped.json()).records] == [
                    (v3.version, "canary")
                ]
                # an admin attaches an eval set to a version later, audited with its digest
                attached = await http.post(
                    f"{url}/eval-set", json={"version": v2.version, "eval_set": EVAL_SET + "\n"}, headers=tenant
                )
                assert attached.status_code == 200, attached.text
            v2_now = await _record(nc, v2.version)
            assert v2_now.eval_set_digest == hashlib.sha256((EVAL_SET + "\n").encode()).hexdigest()
            assert v2_now.platform_eval is None  # a score of the old set is not a score of the new one
            return v1.version, v2.version, v3.version
        finally:
            await nc.close()

    v1, v2, v3 = asyncio.run(work())
    [passed] = _audited(gated.db_path, v1, "promoted")
    assert passed["actor"] == "test" and passed["reason"].startswith("release gate passed: platform eval")
    evaluated = _audited(gated.db_path, v2, "evaluated")
    assert any(e["actor"] == "release-gate" and digest[:12] in (e["reason"] or "") for e in evaluated)
    [skipped] = _audited(gated.db_path, v3, "promoted")
    assert skipped["reason"].startswith("eval gate skipped by platform admin apikey:")
    assert skipped["reason"].endswith(": hotfix, eval set follows")
    [attached] = _audited(gated.db_path, v2, "eval_set_attached")
    assert attached["reason"].startswith("eval set ") and "(4 items, threshold 0.500)" in attached["reason"]
