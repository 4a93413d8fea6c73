"""Which demo adapters the served base model can run: the registry's own shape check, then the
base-model fingerprint (the demo adapters were trained on the embedded SmolLM2's weights)."""

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from shared.adapter_format import AdapterLimits, read_adapter_dir, validate_adapter
from shared.base_model import EMBEDDED_MODEL_NAME, prepare_embedded, resolve_model_dir, served_model_name
from shared.errors import IntegrityError
from shared.fingerprint import BaseModelSpec, fingerprint_model_dir

DEMO_BASE = EMBEDDED_MODEL_NAME  # lorafleet/demo_adapters/README.md: every demo adapter is trained on it
# shipped in the package (package data), so an installed wheel has them as a checkout does
DEMO_ADAPTERS = Path(__file__).resolve().parents[1] / "demo_adapters"


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The base model the stack serves, as the worker and the registry resolve it."""

    name: str
    directory: Path
    fingerprint: str
    embedded: bool  # no LF_MODEL_DIR: the embedded SmolLM2, converted into the cache

    @classmethod
    def resolve(cls, model_dir: str | None, cache_dir: Path) -> "ServedModel":
        directory = resolve_model_dir(model_dir, cache_dir)
        return cls(served_model_name(model_dir, directory), directory, fingerprint_model_dir(directory), not model_dir)


@dataclass(slots=True)
class DemoFit:
    fitting: list[Path] = field(default_factory=list)  # demo directories to release
    skipped: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # reason -> adapter ids

    def skip_lines(self) -> list[str]:
        """One line per distinct reason (the shipped adapters share one)."""
        return [f"demo adapters skipped: {', '.join(ids)}, because {why}" for why, ids in self.skipped.items()]


def fit_demos(directories: list[Path], served: ServedModel, cache_dir: Path) -> DemoFit:
    """Split the demo directories (``<id>/adapter``, ``<id>/eval.jsonl``) into those that fit ``served``
    and the reason each other one does not."""
    fit = DemoFit()
    spec = BaseModelSpec.from_model_dir(served.directory)
    shaped = []
    for directory in directories:
        try:
            validate_adapter(read_adapter_dir(directory / "adapter"), spec, AdapterLimits())
        except IntegrityError as e:
            fit.skipped[f"they were trained for {DEMO_BASE} and do not fit {served.name}: {e.message}"].append(
                directory.name
            )
        else:
            shaped.append(directory)
    reason = _other_weights(served, cache_dir) if shaped else None
    if reason is None:
        fit.fitting = shaped
    else:
        fit.skipped[reason].extend(d.name for d in shaped)
    return fit


def _other_weights(served: ServedModel, cache_dir: Path) -> str | None:
    """Why a model with the demo base's shapes is still another model, or None when it is that model."""
    if served.embedded:
        return None
    try:
        base = fingerprint_model_dir(prepare_embedded(cache_dir))  # converted once, then cached
    except FileNotFoundError as e:
        return f"they were trained for {DEMO_BASE}, which is not installed to compare {served.name} with ({e})"
    if base == served.fingerprint:
        return None
    return (
        f"they were trained for {DEMO_BASE}, and {served.name} has its shapes but other weights "
        f"(base-model fingerprint {served.fingerprint[:12]}…, theirs {base[:12]}…)"
    )
