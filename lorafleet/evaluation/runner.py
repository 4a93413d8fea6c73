"""Run an eval set through the gateway (the real serving path) and score every answer.

An eval set is JSONL: an optional first line ``{"meta": {"threshold": ..}}``, then one item a
line with ``messages`` (or ``prompt``), ``expected`` and ``scorer``.
"""

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import openai
from openai.types.chat import ChatCompletionMessageParam

from shared.errors import InvalidRequest
from shared.eval_scorers import scorer


@dataclass(frozen=True, slots=True)
class EvalItem:
    expected: str
    scorer: str
    messages: list[dict] | None = None
    prompt: str | None = None


@dataclass(frozen=True, slots=True)
class EvalSet:
    items: list[EvalItem]
    threshold: float = 0.0


@dataclass(slots=True)
class EvalReport:
    model: str
    scores: list[float] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0

    @property
    def score(self) -> float:
        return sum(self.scores) / len(self.scores) if self.scores else 0.0

    @property
    def error_rate(self) -> float:
        return self.errors / len(self.scores) if self.scores else 0.0


def load_eval_set(path: Path) -> EvalSet:
    items, threshold = [], 0.0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "meta" in row:
            threshold = float(row["meta"].get("threshold", 0.0))
            continue
        if ("messages" in row) == ("prompt" in row) or "expected" not in row:
            raise InvalidRequest(f"{path}:{number}: an item needs expected and exactly one of messages or prompt")
        scorer(row.get("scorer", "exact"))
        items.append(
            EvalItem(
                expected=row["expected"],
                scorer=row.get("scorer", "exact"),
                messages=row.get("messages"),
                prompt=row.get("prompt"),
            )
        )
    if not items:
        raise InvalidRequest(f"{path}: the eval set is empty")
    return EvalSet(items=items, threshold=threshold)


async def _ask(client: openai.AsyncOpenAI, model: str, item: EvalItem, max_tokens: int) -> tuple[str, str]:
    """(answer, request id): greedy decoding, so a score is reproducible."""
    if item.messages is not None:
        messages = cast("list[ChatCompletionMessageParam]", item.messages)  # the eval set's JSON, as the API takes it
        chat = await client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0
        )
        text, headers = chat.parse().choices[0].message.content or "", chat.headers
    else:
        completion = await client.completions.with_raw_response.create(
            model=model, prompt=item.prompt or "", max_tokens=max_tokens, temperature=0
        )
        text, headers = completion.parse().choices[0].text, completion.headers
    return text, headers.get("x-lorafleet-request-id", "")


async def run_eval(
    client: openai.AsyncOpenAI, model: str, eval_set: EvalSet, *, max_tokens: int = 48, concurrency: int = 8
) -> EvalReport:
    """Every item concurrently (bounded), so the worker batches them; a failed request scores 0."""
    report = EvalReport(model=model)
    gate = asyncio.Semaphore(concurrency)

    async def one(item: EvalItem) -> tuple[float, str, str, bool]:
        async with gate:
            try:
                answer, request_id = await _ask(client, model, item, max_tokens)
            except openai.APIError as e:
                return 0.0, f"<error: {e}>", "", True
        return scorer(item.scorer)(answer, item.expected), answer, request_id, False

    start = time.perf_counter()
    for score, answer, request_id, failed in await asyncio.gather(*(one(i) for i in eval_set.items)):
        report.scores.append(score)
        report.answers.append(answer)
        report.request_ids.append(request_id)
        report.errors += failed
    report.seconds = time.perf_counter() - start
    return report


def gateway_client(gateway_url: str, api_key: str, timeout_s: float = 300.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{gateway_url.rstrip('/')}/v1", api_key=api_key, max_retries=0, timeout=timeout_s
    )
