"""The release gate: may a staging version be promoted, given the registry's own run of its eval set?

Only ``AdapterRecord.platform_eval`` counts, a score measured on a worker through the serving path on
the version's own eval set (its digest recorded with it); the client's ``eval_results`` are advisory
and never read here.
"""

from dataclasses import dataclass

from shared.errors import ReleaseGateFailed
from shared.schemas import AdapterRecord, PlatformEval


@dataclass(frozen=True, slots=True)
class GatePolicy:
    require_eval: bool = True  # a version without an eval set is refused (a version with one is always run)
    min_score: float = 0.0  # floor under every eval set's own threshold
    max_regression: float = 0.05  # how far below production's score on the same set a candidate may be


def needs_run(candidate: AdapterRecord, production: AdapterRecord | None) -> bool:
    """Whether the registry must run ``candidate``'s eval set before judging it: it has one, and no
    platform score on that set against the production version serving now."""
    if candidate.eval_set_digest is None:
        return False
    run = candidate.platform_eval
    baseline = production.version if production is not None and production.version != candidate.version else None
    return run is None or run.eval_set_digest != candidate.eval_set_digest or run.baseline_version != baseline


def check_release(candidate: AdapterRecord, production: AdapterRecord | None, policy: GatePolicy) -> None:
    """Raise ReleaseGateFailed unless ``candidate``'s platform-run score on its own eval set clears the
    set's threshold (never under ``min_score``) and is not below production's score on the same set
    by more than ``max_regression``."""
    name = f"{candidate.adapter_id} v{candidate.version}"
    if candidate.eval_set_digest is None:
        if policy.require_eval:
            raise ReleaseGateFailed(
                f"{name} has no eval set: push one with it (eval.jsonl) or attach one "
                f"(`lorafleet adapter attach-eval {candidate.adapter_id} {candidate.version} FILE`); only a "
                "platform admin may pass it unevaluated (--skip-eval, audited)"
            )
        return
    if needs_run(candidate, production):
        raise ReleaseGateFailed(f"{name} has no platform-run score on its eval set against the production serving now")
    run = candidate.platform_eval
    assert run is not None
    threshold = max(run.threshold, policy.min_score)
    if run.score < threshold:
        raise ReleaseGateFailed(
            f"{name} scored {run.score:.3f} on its eval set {run.eval_set_digest[:12]} (run by the platform), "
            f"under its release threshold {threshold:.3f}"
        )
    if run.baseline_score is not None and run.score < run.baseline_score - policy.max_regression:
        raise ReleaseGateFailed(
            f"{name} scored {run.score:.3f}: a regression beyond {policy.max_regression:.3f} from production "
            f"v{run.baseline_version} ({run.baseline_score:.3f}) on the same eval set {run.eval_set_digest[:12]}"
        )


def summary(run: PlatformEval | None) -> str:
    if run is None:
        return "no eval set"
    baseline = "" if run.baseline_score is None else f", production v{run.baseline_version} {run.baseline_score:.3f}"
    return (
        f"platform eval {run.score:.3f} on {run.items} items of set {run.eval_set_digest[:12]}, "
        f"threshold {run.threshold:.3f}{baseline}"
    )
