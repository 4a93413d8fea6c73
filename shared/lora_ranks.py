"""An adapter's rank per module, as PEFT reads ``rank_pattern`` / ``alpha_pattern``.

PEFT 0.22 writes them for a mixture-of-experts model whose MLP names it turns into the routed experts'
fused tensors: ``{".*\\.gate_up_proj": 2r}`` and ``{".*\\.gate_up_proj": 2 alpha}`` (gate and up fused,
each keeping its rank). A module's rank is the value of the first pattern key that matches the end of
its path (PEFT's ``get_pattern_key``: ``(.*\\.)?(key)$``), else ``r``.

Served exactly when every module keeps the adapter's one scale (alpha_m / r_m == lora_alpha / r): the
slots hold the adapter at its largest rank, the smaller modules zero-padded (zero rows of A and columns
of B add nothing). A pattern key may be a dotted name with an optional leading ``.*\\.`` or ``^`` and
nothing else of regular-expression syntax, so matching one never backtracks.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.errors import IntegrityError

MAX_PATTERNS = 64
_SAFE_KEY = re.compile(r"^\^?(?:\.\*\\\.)?[A-Za-z0-9_]+(?:(?:\\?\.)[A-Za-z0-9_]+)*$")


@dataclass(frozen=True, slots=True)
class RankPlan:
    """``r`` and ``lora_alpha`` with their per-module patterns; ``scale`` is every module's."""

    r: int
    alpha: float
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "RankPlan":
        """The plan of a parsed adapter_config.json whose ``r`` and ``lora_alpha`` are checked already."""
        ranks, alphas = checked_patterns(config)
        return cls(int(config["r"]), float(config["lora_alpha"]), ranks, alphas)

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.rank_pattern.values()])

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def rank_of(self, module_path: str) -> int:
        """The rank of the module (or expert tensor) at ``module_path`` (``model.layers.3.mlp.gate_proj``),
        checked to keep the adapter's scale."""
        r = int(_value(self.rank_pattern, module_path, self.r))
        alpha = float(_value(self.alpha_pattern, module_path, self.alpha))
        if alpha * self.r != self.alpha * r:
            raise IntegrityError(
                f"{module_path}: rank {r} and lora_alpha {alpha:g} scale its delta by {alpha / r:g}, the rest of "
                f"the adapter by {self.scale:g}: one adapter's modules must share one scale",
                param="alpha_pattern",
            )
        return r


def checked_patterns(config: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, float]]:
    """A parsed adapter_config.json's ``rank_pattern`` and ``alpha_pattern``, each key checked to be
    served (a dotted name, at most ``MAX_PATTERNS``, not with ``use_rslora``)."""
    ranks, alphas = _patterns(config, "rank_pattern", int), _patterns(config, "alpha_pattern", float)
    if (ranks or alphas) and config.get("use_rslora"):
        raise IntegrityError("rank_pattern / alpha_pattern with use_rslora is not served", param="use_rslora")
    return ranks, alphas


def _patterns(config: Mapping[str, Any], option: str, kind: type) -> dict[str, Any]:
    raw = config.get(option) or {}
    if not isinstance(raw, dict) or len(raw) > MAX_PATTERNS:
        raise IntegrityError(f"{option} must be an object of at most {MAX_PATTERNS} entries", param=option)
    for key, value in raw.items():
        if not isinstance(key, str) or len(key) > 200 or not _SAFE_KEY.match(key):
            raise IntegrityError(
                f"{option} key {key!r} is not served: a dotted module name, optionally after '.*\\.' or '^'",
                param=option,
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0 or kind(value) != value:
            raise IntegrityError(f"{option}[{key!r}] must be a positive {kind.__name__}, got {value!r}", param=option)
    return {key: kind(value) for key, value in raw.items()}


def _value(patterns: Mapping[str, Any], path: str, default: Any) -> Any:
    for key in patterns:  # PEFT's get_pattern_key: the first key, in the file's order, that matches
        if re.match(rf"(.*\.)?({key})$", path):
            return patterns[key]
    return default
