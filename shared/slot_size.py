"""What one adapter slot costs: A and B of every targeted projection over every layer, padded to the
rank class; a routed expert module counts once per expert. The worker sizes its slot stacks with it and
the registry records it per rank class."""

from collections.abc import Iterable, Sequence

from shared.lora_targets import LayerDims

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def params_per_rank(layers: Sequence[LayerDims], modules: Iterable[str]) -> int:
    """A and B elements of one rank unit over every layer: slot elements = rank * this.

    layers: per layer, module -> (copies, in_features, out_features) (BaseModelSpec.layer_dims); A is
    [in, rank] and B is [rank, out] per copy; a module a layer lacks costs nothing there."""
    wanted = set(modules)
    return sum(c * (i + o) for layer in layers for m, (c, i, o) in layer.items() if m in wanted)


def class_of(rank: int, classes: Iterable[int]) -> int | None:
    """The smallest rank class that holds ``rank`` (None: none does)."""
    return min((c for c in classes if c >= rank), default=None)


def slot_bytes(
    rank: int, classes: Iterable[int], layers: Sequence[LayerDims], modules: Iterable[str], element_bytes: int
) -> dict[int, int]:
    """Rank class -> bytes of one slot holding an adapter of ``rank`` on ``modules``, for each class >= rank."""
    per_rank = params_per_rank(layers, modules) * element_bytes
    return {c: c * per_rank for c in sorted(classes) if c >= rank}
