"""The registry's own evaluation of a version: every item of its eval set asked of the version (greedy,
pinned), scored with the item's scorer. A failed request scores 0 and is counted; the asking itself
(the serving path over NATS) is ``eval_client.py``'s."""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shared.errors import LorafleetError, ServiceUnavailable
from shared.eval_scorers import scorer
from shared.eval_set import EvalItem, EvalSetSpec

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
