"""What one adapter slot costs: A and B of every targeted projection over every layer, padded to the
rank class. The worker sizes its slot stacks with it and the registry records it per rank class."""

from collections.abc import Iterable, Mapping

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def params_per_rank(num_layers: int, dims: Mapping[str, tuple[int, int]], modules: Iterable[str]) -> int:
    """A and B elements of one rank unit over every layer: slot elements = rank * this.

    dims: module -> (in_features, out_features); A is [in, rank] and B is [rank, out] per layer."""
    return num_layers * sum(dims[m][0] + dims[m][1] for m in modules)


def class_of(rank: int, classes: Iterable[int]) -> int | None:
    """The smallest rank class that holds ``rank`` (None: none does)."""
    return min((c for c in classes if c >= rank), default=None)


def slot_bytes(
    rank: int,
    classes: Iterable[int],
    num_layers: int,
    dims: Mapping[str, tuple[int, int]],
    modules: Iterable[str],
    element_bytes: int,
) -> dict[int, int]:
    """Rank class -> bytes of one slot holding an adapter of ``rank`` on ``modules``, for each class >= rank."""
    per_rank = params_per_rank(num_layers, dims, modules) * element_bytes
    return {c: c * per_rank for c in sorted(classes) if c >= rank}
