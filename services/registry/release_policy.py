"""When a canary step advances, holds or rolls back, judged on the live figures of both versions."""

import math
from dataclasses import dataclass
from typing import Literal

from services.registry.settings import RegistrySettings
from shared.schemas import VersionFigures

GUARD_Z = 2.326  # one-sided 99%: a rate guard trips on the canary's Wilson lower bound, not on one unlucky error


@dataclass(frozen=True, slots=True)
class ReleasePolicy:
    min_samples: int = 200
    dwell_s: float = 300.0
    guard_min_samples: int = 20
    max_error_increase: float = 0.02
    max_latency_ratio: float = 1.5
    latency_slack_ms: float = 5.0
    max_cost_ratio: float = 1.5
    max_complaint_increase: float = 0.05
    min_complaint_tenants: int = 3  # a shared version's complaint guard needs this many tenants complaining
    max_tenant_complaint_share: float = 0.1  # of a shared version's window, the most one tenant's complaints weigh
    min_shadow_pairs: int = 50  # shadow pairs before the agreement guard judges
    min_agreement: float = 0.0  # the canary's shadow answers equal to production's, at least (0: not judged)

    @classmethod
    def from_settings(cls, settings: RegistrySettings) -> "ReleasePolicy":
        return cls(
            min_samples=settings.release_min_samples,
            dwell_s=settings.release_dwell_s,
            guard_min_samples=settings.release_guard_min_samples,
            max_error_increase=settings.release_max_error_increase,
            max_latency_ratio=settings.release_max_latency_ratio,
            latency_slack_ms=settings.release_latency_slack_ms,
            max_cost_ratio=settings.release_max_cost_ratio,
            max_complaint_increase=settings.release_max_complaint_increase,
            min_complaint_tenants=settings.release_min_complaint_tenants,
            max_tenant_complaint_share=settings.release_max_tenant_complaint_share,
            min_shadow_pairs=settings.release_min_shadow_pairs,
            min_agreement=settings.release_min_agreement,
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Literal["advance", "hold", "rollback"]
    reasons: tuple[str, ...] = ()


def wilson_lower(events: int, trials: int, z: float = GUARD_Z) -> float:
    """Lower bound of the Wilson score interval of a rate: how low the true rate plausibly is."""
    if trials == 0:
        return 0.0
    p = events / trials
    centre = p + z * z / (2 * trials)
    spread = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return max(0.0, (centre - spread) / (1 + z * z / trials))


def _rate_guard(name: str, events: int, trials: int, baseline_rate: float, allowed: float) -> str | None:
    lower = wilson_lower(events, trials)
    if lower > baseline_rate + allowed:
        return (
            f"{name} {events}/{trials} (at least {lower:.3f} at 99%) vs production {baseline_rate:.3f} "
            f"(allowed +{allowed:.3f})"
        )
    return None


def _ratio_guard(name: str, mine: float | None, theirs: float | None, ratio: float, slack: float) -> str | None:
    if mine is None or theirs is None:
        return None
    if mine > theirs * ratio and mine - theirs > slack:
        return f"{name} {mine:.1f} vs production {theirs:.1f} (allowed x{ratio:g})"
    return None


def agreement_guard(canary: VersionFigures, policy: ReleasePolicy) -> str | None:
    """Why the canary's shadow answers disagree with production's too often: over at least
    ``min_shadow_pairs`` pairs, fewer than ``min_agreement`` of them are the same tokens."""
    rate = canary.agreement_rate
    if policy.min_agreement <= 0 or rate is None or canary.shadow_pairs < policy.min_shadow_pairs:
        return None
    if rate < policy.min_agreement:
        agreed = round(rate * canary.shadow_pairs)
        return (
            f"shadow agreement {agreed}/{canary.shadow_pairs} ({rate:.3f}, prefix {canary.prefix_agreement or 0:.3f}) "
            f"with production, below {policy.min_agreement:g}"
        )
    return None


def guard_trips(
    canary: VersionFigures, baseline: VersionFigures | None, policy: ReleasePolicy, shared: bool = False
) -> list[str]:
    """Why the canary is worse than production beyond the policy; empty while it is not, or while
    it has too few completions to judge (the shadow agreement guard counts its own pairs instead).
    With no production to compare (or too little of its traffic), the rates are held against zero and the ratios are not judged. A ``shared`` version
    (served to many tenants) is judged on complaints only once ``min_complaint_tenants`` tenants
    complained: any one tenant chooses which of its requests it rates."""
    agreement = agreement_guard(canary, policy)
    if canary.samples < policy.guard_min_samples:
        return [agreement] if agreement else []
    compared = baseline is not None and baseline.samples >= policy.guard_min_samples
    base_errors = baseline.error_rate if compared and baseline else 0.0
    base_complaints = baseline.complaint_rate if compared and baseline else 0.0
    errors = _rate_guard("error rate", canary.errors, canary.samples, base_errors, policy.max_error_increase)
    reasons = [agreement, errors]
    if not shared or canary.complaining_tenants >= policy.min_complaint_tenants:
        reasons.append(
            _rate_guard(
                "complaint rate", canary.complaints, canary.samples, base_complaints, policy.max_complaint_increase
            )
        )
    if compared and baseline is not None:
        ratio, slack = policy.max_latency_ratio, policy.latency_slack_ms
        reasons += [
            _ratio_guard("TTFT p50 ms", canary.ttft_p50_ms, baseline.ttft_p50_ms, ratio, slack),
            _ratio_guard("TTFT p95 ms", canary.ttft_p95_ms, baseline.ttft_p95_ms, ratio, slack),
            _ratio_guard("TPOT p50 ms", canary.tpot_p50_ms, baseline.tpot_p50_ms, ratio, slack),
            _ratio_guard("TPOT p95 ms", canary.tpot_p95_ms, baseline.tpot_p95_ms, ratio, slack),
            _ratio_guard(
                "engine time per output token ms",
                canary.engine_ms_per_token,
                baseline.engine_ms_per_token,
                policy.max_cost_ratio,
                0.0,
            ),
        ]
    return [r for r in reasons if r is not None]


def judge(
    canary: VersionFigures,
    baseline: VersionFigures | None,
    step_age_s: float,
    policy: ReleasePolicy,
    shared: bool = False,
) -> Verdict:
    """Roll back when a guard trips; advance once the step has dwelt long enough and both versions
    have the minimum sample count (production only when there is one), and, with the agreement guard
    on, the canary the minimum shadow pairs with production; hold otherwise."""
    reasons = guard_trips(canary, baseline, policy, shared)
    if reasons:
        return Verdict("rollback", tuple(reasons))
    waiting = []
    if step_age_s < policy.dwell_s:
        waiting.append(f"dwell {step_age_s:.0f}/{policy.dwell_s:.0f} s")
    if canary.samples < policy.min_samples:
        waiting.append(f"canary samples {canary.samples}/{policy.min_samples}")
    if baseline is not None and baseline.samples < policy.min_samples:
        waiting.append(f"production samples {baseline.samples}/{policy.min_samples}")
    if baseline is not None and policy.min_agreement > 0 and canary.shadow_pairs < policy.min_shadow_pairs:
        waiting.append(f"shadow pairs {canary.shadow_pairs}/{policy.min_shadow_pairs}")
    return Verdict("hold", tuple(waiting)) if waiting else Verdict("advance")
