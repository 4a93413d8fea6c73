"""An adapter version's own eval set: the JSONL file pushed with it (``eval.jsonl``, covered by its
signed manifest) or attached later by an admin, validated and bounded before the registry keeps it.

The format is the harness's (``lorafleet eval``): an optional first line ``{"meta": {"threshold": ..,
"max_tokens": ..}}``, then one item a line with ``prompt`` (or ``messages``), ``expected`` and ``scorer``.
Its identity is the sha256 of its bytes: a platform-run score is recorded with it, and two versions'
scores are compared only on the same digest.
"""

import hashlib
import json

from pydantic import Field, ValidationError, model_validator

from shared.errors import InvalidRequest, PayloadTooLarge
from shared.eval_scorers import SCORERS
from shared.schemas.base import Message
from shared.schemas.inference import ChatMessage

EVAL_SET_FILE = "eval.jsonl"
MAX_EVAL_SET_BYTES = 64 * 1024  # the registry runs every item on a worker at each release: a handful, not a benchmark
MAX_EVAL_ITEMS = 64
MAX_EVAL_TOKENS = 256


class EvalItem(Message):
    prompt: str | None = Field(default=None, min_length=1, max_length=8192)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=16)
    expected: str = Field(max_length=8192)
    scorer: str = Field(default="exact", description=f"one of {sorted(SCORERS)}")

    @model_validator(mode="after")
    def _one_input_known_scorer(self) -> "EvalItem":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("an item needs exactly one of prompt or messages")
        if self.scorer not in SCORERS:
            raise ValueError(f"unknown scorer {self.scorer!r}; known: {sorted(SCORERS)}")
        return self


class EvalSetMeta(Message):
    threshold: float = Field(default=0.0, ge=0, le=1, description="the score a version must reach to be released")
    max_tokens: int = Field(default=48, ge=1, le=MAX_EVAL_TOKENS, description="per answer, greedy")


class EvalSetSpec(Message):
    meta: EvalSetMeta
    items: list[EvalItem] = Field(min_length=1, max_length=MAX_EVAL_ITEMS)


def eval_set_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_eval_set(data: bytes) -> EvalSetSpec:
    """The eval set in ``data``, or InvalidRequest / PayloadTooLarge naming the first problem. Meta keys
    other than threshold and max_tokens (a shipped set's ``adapter``, ``scorer``) are informative only."""
    if len(data) > MAX_EVAL_SET_BYTES:
        raise PayloadTooLarge(f"{EVAL_SET_FILE}: {len(data)} bytes exceeds the {MAX_EVAL_SET_BYTES}-byte cap")
    meta, items = EvalSetMeta(), []
    try:
        lines = data.decode().splitlines()
    except UnicodeDecodeError:
        raise InvalidRequest(f"{EVAL_SET_FILE} is not UTF-8 text") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("a line must be a JSON object")
            if "meta" in row:
                known = {k: v for k, v in dict(row["meta"]).items() if k in EvalSetMeta.model_fields}
                meta = EvalSetMeta.model_validate(known)
            else:
                items.append(EvalItem.model_validate(row))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise InvalidRequest(
                f"{EVAL_SET_FILE}:{number}: {where + ': ' if where else ''}{first['msg'].removeprefix('Value error, ')}"[
                    :500
                ]
            ) from None
        except (ValueError, TypeError) as e:
            raise InvalidRequest(f"{EVAL_SET_FILE}:{number}: {str(e)[:300]}") from None
    try:
        return EvalSetSpec(meta=meta, items=items)
    except ValidationError as e:
        raise InvalidRequest(f"{EVAL_SET_FILE}: {e.errors()[0]['msg']} ({len(items)} items)") from None
