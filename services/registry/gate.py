"""The release gate: may a staging version be promoted, given its recorded eval and production's?"""

from dataclasses import dataclass

from shared.errors import ReleaseGateFailed
from shared.schemas import AdapterRecord


@dataclass(frozen=True, slots=True)
class GatePolicy:
    require_eval: bool = True  # a version with no recorded eval is refused
    min_score: float = 0.0  # floor under every adapter's own threshold
    max_regression: float = 0.05  # how far below production's score a candidate may be


def check_release(candidate: AdapterRecord, production: AdapterRecord | None, policy: GatePolicy) -> None:
    """Raise ReleaseGateFailed unless ``candidate``'s eval clears its threshold and does not regress.

    The threshold is the one recorded with the eval (from the eval set), never under ``min_score``;
    the regression check compares with production's recorded score on the same adapter's eval set."""
    name = f"{candidate.adapter_id} v{candidate.version}"
    results = candidate.eval_results
    if "score" not in results:
        if policy.require_eval:
            raise ReleaseGateFailed(
                f"{name} has no recorded eval: run `lorafleet eval {candidate.adapter_id}@"
                f"{candidate.version}` first (or promote with --force)"
            )
        return
    score = results["score"]
    threshold = max(results.get("threshold", 0.0), policy.min_score)
    if score < threshold:
        raise ReleaseGateFailed(f"{name} scored {score:.3f}, under its release threshold {threshold:.3f}")
    if production is None or production.version == candidate.version or "score" not in production.eval_results:
        return
    floor = production.eval_results["score"] - policy.max_regression
    if score < floor:
        raise ReleaseGateFailed(
            f"{name} scored {score:.3f}: a regression beyond {policy.max_regression:.3f} from production "
            f"v{production.version} ({production.eval_results['score']:.3f})"
        )
