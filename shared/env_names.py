"""The ``LF_*`` environment variables a settings model reads, as names: a nested model's fields are
``LF_<FIELD>__<SUBFIELD>`` (and ``LF_<FIELD>`` takes the whole model as JSON)."""

import typing
from collections.abc import Iterator

from pydantic import BaseModel
from pydantic.fields import FieldInfo

PREFIX = "LF_"


def _nested_model(annotation: object) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def model_variables(model: type[BaseModel], prefix: str = PREFIX) -> Iterator[tuple[str, FieldInfo]]:
    """(variable name, field) for every field of ``model``, nested models' fields after their own."""
    for field, info in model.model_fields.items():
        name = prefix + field.upper()
        yield name, info
        nested = _nested_model(info.annotation)
        if nested is not None:
            yield from model_variables(nested, name + "__")


def model_env_names(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for name, _ in model_variables(model))


def describe(model: type[BaseModel]) -> str:
    """What ``python -m services.<name> --help`` prints: every variable ``model`` reads, its default and
    what it means."""
    lines = [
        f"{model.__name__}: configured by environment variables only (no command-line options but --help).",
        "",
    ]
    for name, info in model_variables(model):
        default = "" if info.is_required() else f" (default: {_default(info)})"
        lines.append(f"  {name}{default}")
        if info.description:
            lines.append(f"      {info.description}")
    return "\n".join(lines)


def _default(info: FieldInfo) -> str:
    if info.default_factory in (dict, list, tuple):
        return repr(info.default_factory())
    if info.default_factory is not None:
        return "computed" if _nested_model(info.annotation) is None else "see below"
    return repr(info.default)
