"""The registry's own evaluation of a version: every item of its eval set asked of the version (greedy,
pinned), scored with the item's scorer. A failed request scores 0 and is counted; the asking itself
(the serving path over NATS) is ``eval_client.py``'s."""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shared import metrics
from shared.errors import LorafleetError, ServiceUnavailable
from shared.eval_scorers import scorer
from shared.eval_set import EvalItem, EvalSetSpec
from shared.schemas import AdapterRecord, PlatformEval

Ask = Callable[[str, EvalItem, int], Awaitable[str]]  # (model "<adapter>@<version>", item, max_tokens) -> answer
CONCURRENCY = 8  # items in flight at once, so the worker batches them


@dataclass(frozen=True, slots=True)
class SetScore:
    score: float
    items: int
    errors: int


async def score_set(ask: Ask, model: str, spec: EvalSetSpec) -> SetScore:
    """``model``'s mean score over ``spec``; ServiceUnavailable when no item was answered (an outage
    is not a score)."""
    gate = asyncio.Semaphore(CONCURRENCY)
    first_error: list[LorafleetError] = []

    async def one(item: EvalItem) -> float | None:
        async with gate:
            try:
                answer = await ask(model, item, spec.meta.max_tokens)
            except LorafleetError as e:
                first_error.append(e)
                return None
        return scorer(item.scorer)(answer, item.expected)

    scores = await asyncio.gather(*(one(i) for i in spec.items))
    errors = sum(s is None for s in scores)
    if errors == len(scores):
        raise ServiceUnavailable(f"no eval request of {model} was answered: {first_error[0].message}")
    return SetScore(score=sum(s or 0.0 for s in scores) / len(scores), items=len(scores), errors=errors)


async def platform_eval(
    ask: Ask, adapter_id: str, version: int, spec: EvalSetSpec, digest: str, production: int | None
) -> PlatformEval:
    """``adapter_id@version``'s score on ``spec`` (digest ``digest``), and the production version's on the
    same set in the same run (none when ``production`` is None or the version itself)."""
    mine = await score_set(ask, f"{adapter_id}@{version}", spec)
    compared = production if production is not None and production != version else None
    baseline = await score_set(ask, f"{adapter_id}@{compared}", spec) if compared is not None else None
    return PlatformEval(
        eval_set_digest=digest,
        score=mine.score,
        threshold=spec.meta.threshold,
        items=mine.items,
        errors=mine.errors,
        baseline_version=compared,
        baseline_score=baseline.score if baseline is not None else None,
    )


def export_quality(record: AdapterRecord) -> None:
    """``adapter_quality_score``: a version's platform-run score as the records bucket holds it (every
    replica follows the bucket, so each exports the same figure)."""
    if record.platform_eval is not None:
        metrics.QUALITY_SCORE.labels(record.adapter_id, str(record.version)).set(record.platform_eval.score)
