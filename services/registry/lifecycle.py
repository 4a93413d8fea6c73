"""Lifecycle transitions: each op reads the catalog and returns the changes, mutating nothing.

staging --promote(p%)--> canary --rollout(p%)...--> production (at 100%)
rollback undoes the latest rollout step: a canary goes back to staging, or, with no canary,
production is retired and the previous production version serves again. retire stops a
version; revoke is the security stop, terminal, of one version or all of them.
"""

import time

from shared.catalog.records import Catalog, Change
from shared.errors import Conflict, ModelNotFound
from shared.schemas import AdapterRecord, AdapterStatus, PlatformEval


def _record(catalog: Catalog, adapter_id: str, version: int) -> AdapterRecord:
    record = catalog.get(adapter_id, version)
    if record is None:
        raise ModelNotFound(f"adapter {adapter_id!r} has no version {version}")
    return record


def _change(kind: str, record: AdapterRecord, status: AdapterStatus, percent: float, **extra: object) -> Change:
    after = record.model_copy(update={"status": status, "traffic_percent": percent, **extra})
    return Change(kind=kind, before=record, after=after)


def _go_production(catalog: Catalog, record: AdapterRecord, kind: str) -> list[Change]:
    """``record`` takes all traffic; the production version it replaces is retired."""
    production, _ = catalog.released(record.adapter_id)
    changes = []
    if production is not None and production.version != record.version:
        changes.append(_change("retired", production, "retired", 0.0))
    changes.append(_change(kind, record, "production", 100.0, promoted_at=time.time()))
    return changes


def promote(catalog: Catalog, adapter_id: str, version: int, traffic_percent: float) -> list[Change]:
    record = _record(catalog, adapter_id, version)
    if record.status != "staging":
        raise Conflict(f"{adapter_id} v{version} is {record.status}; only a staging version can be promoted")
    _, canary = catalog.released(adapter_id)
    if canary is not None:
        raise Conflict(f"{adapter_id} v{canary.version} is already in canary; roll it out or back first")
    if traffic_percent >= 100:
        return _go_production(catalog, record, "promoted")
    return [_change("promoted", record, "canary", traffic_percent)]


def rollout(catalog: Catalog, adapter_id: str, traffic_percent: float) -> list[Change]:
    _, canary = catalog.released(adapter_id)
    if canary is None:
        raise Conflict(f"{adapter_id} has no canary version to roll out")
    if traffic_percent >= 100:
        return _go_production(catalog, canary, "rollout")
    return [_change("rollout", canary, "canary", traffic_percent)]


def rollback(catalog: Catalog, adapter_id: str) -> list[Change]:
    production, canary = catalog.released(adapter_id)
    if canary is not None:
        return [_change("rolled_back", canary, "staging", 0.0)]
    if production is None:
        raise Conflict(f"{adapter_id} has no released version to roll back")
    previous = [
        r
        for r in catalog.versions(adapter_id)
        if r.status == "retired" and r.promoted_at is not None and r.version != production.version
    ]
    if not previous:
        raise Conflict(f"{adapter_id} v{production.version} has no previous production version to return to")
    target = max(previous, key=lambda r: r.promoted_at or 0.0)
    return [
        _change("rolled_back", production, "retired", 0.0),
        _change("rolled_back", target, "production", 100.0, promoted_at=time.time()),
    ]


def retire(catalog: Catalog, adapter_id: str, version: int) -> list[Change]:
    record = _record(catalog, adapter_id, version)
    if record.status in ("retired", "revoked"):
        raise Conflict(f"{adapter_id} v{version} is already {record.status}")
    return [_change("retired", record, "retired", 0.0)]


def revoke(catalog: Catalog, adapter_id: str, version: int | None) -> list[Change]:
    """Revoke one version, or every version not yet revoked when ``version`` is None."""
    if version is not None:
        targets = [_record(catalog, adapter_id, version)]
    else:
        targets = catalog.versions(adapter_id)
        if not targets:
            raise ModelNotFound(f"no adapter {adapter_id!r}")
    targets = [r for r in targets if r.status != "revoked"]
    if not targets:
        raise Conflict(f"{adapter_id} is already revoked")
    return [_change("revoked", r, "revoked", 0.0) for r in targets]


def record_eval(catalog: Catalog, adapter_id: str, version: int, results: dict[str, float]) -> list[Change]:
    """Attach a client's (advisory) eval results to a version; its status and traffic stay as they are."""
    record = _record(catalog, adapter_id, version)
    if record.status == "revoked":
        raise Conflict(f"{adapter_id} v{version} is revoked; its eval is not recorded")
    return [Change(kind="evaluated", before=record, after=record.model_copy(update={"eval_results": dict(results)}))]


def record_platform_eval(catalog: Catalog, adapter_id: str, version: int, run: PlatformEval) -> list[Change]:
    """The release gate's own score of a version's eval set; refused if the set changed meanwhile."""
    record = _record(catalog, adapter_id, version)
    if record.eval_set_digest != run.eval_set_digest:
        raise Conflict(f"{adapter_id} v{version}'s eval set changed while it was being evaluated; promote again")
    if record.status == "revoked":
        raise Conflict(f"{adapter_id} v{version} is revoked; its eval is not recorded")
    return [Change(kind="evaluated", before=record, after=record.model_copy(update={"platform_eval": run}))]


def attach_eval_set(catalog: Catalog, adapter_id: str, version: int, digest: str) -> list[Change]:
    """A version's eval set is now the one of sha256 ``digest``; a platform score of another set is dropped."""
    record = _record(catalog, adapter_id, version)
    if record.status in ("retired", "revoked"):
        raise Conflict(f"{adapter_id} v{version} is {record.status}; its eval set is not changed")
    run = record.platform_eval if record.platform_eval and record.platform_eval.eval_set_digest == digest else None
    after = record.model_copy(update={"eval_set_digest": digest, "platform_eval": run})
    return [Change(kind="eval_set_attached", before=record, after=after)]
