from services.auditor.crosscheck import check_completion
from shared.schemas import AdapterRecord, CompletionAudit

DIGEST = "a" * 64


def record(tenant: str = "acme", scopes: list[str] | None = None) -> AdapterRecord:
    return AdapterRecord(
        adapter_id="sql",
        version=2,
        tenant_id=tenant,
        base_model="m",
        base_model_fingerprint="f" * 64,
        task_type="sql",
        rank=8,
        alpha=16,
        target_modules=["q_proj"],
        files={"adapter_model.safetensors": DIGEST},
        digest=DIGEST,
        manifest_digest="b" * 64,
        storage_uri="nats-os://store/sql/2",
        allowed_scopes=scopes or [],
    )


def completion(tenant: str = "acme", digest: str | None = DIGEST, adapter: str | None = "sql") -> CompletionAudit:
    return CompletionAudit(
        request_id="r1",
        tenant_id=tenant,
        base_model="m",
        adapter_id=adapter,
        adapter_version=2 if adapter else None,
        adapter_digest=digest,
        cache_hit=True,
        ttft_ms=1,
        tpot_ms=1,
        prompt_tokens=3,
        completion_tokens=4,
        worker_id="w",
        outcome="stop",
    )


def test_owner_with_right_digest_is_clean():
    assert check_completion(completion(), record()) == []
    assert check_completion(completion(adapter=None), None) == []


def test_foreign_tenant_is_an_isolation_violation():
    [v] = check_completion(completion(tenant="other"), record())
    assert v.violation == "tenant_isolation" and "other" in v.detail


def test_shared_adapter_within_scope_is_clean_outside_is_not():
    assert check_completion(completion(tenant="other"), record("shared", ["other"])) == []
    assert check_completion(completion(tenant="other"), record("shared", ["*"])) == []
    [v] = check_completion(completion(tenant="third"), record("shared", ["other"]))
    assert v.violation == "tenant_isolation"


def test_wrong_digest_or_unknown_version_is_an_integrity_violation():
    [v] = check_completion(completion(digest="c" * 64), record())
    assert v.violation == "integrity"
    [v] = check_completion(completion(), None)
    assert v.violation == "integrity"
