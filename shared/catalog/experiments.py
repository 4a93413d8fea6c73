"""The one weighted traffic split: a request key's stable bucket picks an arm by weight. An
experiment across adapters uses it with its N arms; a canary rollout (``shared.catalog.rollout``)
is the 2-arm case [canary, production].

A key's bucket is ``sha256(salt \\x00 key)`` mod 10000, so it is stable (the same key always gets
the same arm while the weights stand) and independent per salt (an adapter id, or an experiment).
"""

import hashlib
from collections.abc import Sequence

from shared.schemas import Experiment, ExperimentArm

BUCKETS = 10_000
EXPERIMENT_PREFIX = "experiment:"
EXPERIMENTS_PREFIX = "experiments."


def bucket(salt: str, request_key: str) -> int:
    """Stable bucket in [0, 10000) of a request key, independent per salt."""
    digest = hashlib.sha256(f"{salt}\x00{request_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def assign(weights: Sequence[int], salt: str, request_key: str) -> int:
    """The index of the arm this key falls in: arm ``i`` holds the buckets ``b`` with
    ``cum[i-1] <= b * total / BUCKETS < cum[i]`` (exact integer arithmetic). Weights are
    non-negative with a positive total; an arm of weight 0 gets no key."""
    total = sum(weights)
    scaled = bucket(salt, request_key) * total
    reached = 0
    for index, weight in enumerate(weights):
        reached += weight
        if scaled < reached * BUCKETS:
            return index
    raise ValueError("weights must have a positive total")


def experiment_key(tenant_id: str, name: str) -> str:
    """The experiment's key in the ``lf_routing`` bucket."""
    return f"{EXPERIMENTS_PREFIX}{tenant_id}.{name}"


def experiment_salt(name: str) -> str:
    return f"{EXPERIMENT_PREFIX}{name}"


def arm_for(experiment: Experiment, split_key: str) -> ExperimentArm:
    """The arm a request with this split key (``rollout.split_key``: tenant and user) is served:
    by weight while running, the control (first arm) while paused, the winner once stopped."""
    if experiment.state == "paused":
        return experiment.arms[0]
    if experiment.state == "stopped":
        assert experiment.winner is not None  # Experiment checks it
        return experiment.arm(experiment.winner)
    index = assign([a.weight for a in experiment.arms], experiment_salt(experiment.name), split_key)
    return experiment.arms[index]
