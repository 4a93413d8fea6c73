"""The live comparison of a canary with the production version it would replace, as metrics: its
shadow agreement and the quality regression family (canary minus production on the same items)."""

from shared import metrics
from shared.schemas import PlatformEval, VersionFigures


def export_comparison(
    adapter_id: str, canary: VersionFigures, production_version: int, platform_eval: PlatformEval | None
) -> None:
    """Set the rollout's gauges from the step's figures and the canary's platform-run eval. Production
    agrees with itself, so agreement regressions are the agreement minus one (0: no change)."""
    labels = (adapter_id, str(canary.version), str(production_version))
    measures = {"exact": canary.agreement_rate, "prefix": canary.prefix_agreement}
    for measure, value in measures.items():
        if value is not None:
            metrics.SHADOW_AGREEMENT.labels(*labels, measure).set(value)
            metrics.QUALITY_REGRESSION.labels(*labels, measure).set(value - 1.0)
    if (
        platform_eval is not None
        and platform_eval.baseline_version == production_version
        and platform_eval.baseline_score is not None
    ):
        regression = platform_eval.score - platform_eval.baseline_score
        metrics.QUALITY_REGRESSION.labels(*labels, "eval_score").set(regression)
