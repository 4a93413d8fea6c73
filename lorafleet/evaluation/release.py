"""A version's evaluation through the gateway on the client's side (advisory: recorded beside the
version, never read by the release gate, which runs the version's own eval set itself), and promote.

Shared by ``lorafleet eval``, ``lorafleet release`` and the demo seeding of ``lorafleet up``.
"""

from dataclasses import dataclass

import openai
from nats.aio.client import Client as NATS

from lorafleet.evaluation.runner import EvalReport, EvalSet, run_eval
from shared import subjects
from shared.bus import request
from shared.errors import ServiceUnavailable
from shared.schemas import AdapterRecord, AdapterRecordsReply, PromoteRequest, RecordEvalRequest

REGISTRY_TIMEOUT_S = 30.0
PROMOTE_TIMEOUT_S = 600.0  # the registry's release gate runs the version's eval set on a worker before answering


@dataclass(frozen=True, slots=True)
class Evaluation:
    adapter: EvalReport
    base: EvalReport | None
    threshold: float

    def results(self) -> dict[str, float]:
        """What the registry records in the version's eval slot."""
        results = {
            "score": self.adapter.score,
            "threshold": self.threshold,
            "items": float(len(self.adapter.scores)),
            "error_rate": self.adapter.error_rate,
        }
        if self.base is not None:
            results["base_score"] = self.base.score
        return results


async def evaluate(
    client: openai.AsyncOpenAI,
    adapter_id: str,
    version: int,
    eval_set: EvalSet,
    *,
    base_model: str | None,
    max_tokens: int = 48,
) -> Evaluation:
    """Score ``adapter_id@version`` (a staging version needs an admin-scoped key) and, if named, the base.

    Raises ServiceUnavailable when no request was answered: an outage is not a score to record."""
    adapter = await run_eval(client, f"{adapter_id}@{version}", eval_set, max_tokens=max_tokens)
    if adapter.errors == len(adapter.scores):
        raise ServiceUnavailable(f"no eval request of {adapter_id}@{version} was answered: {adapter.answers[0]}")
    base = await run_eval(client, base_model, eval_set, max_tokens=max_tokens) if base_model else None
    return Evaluation(adapter=adapter, base=base, threshold=eval_set.threshold)


async def record_eval(nc: NATS, adapter_id: str, version: int, evaluation: Evaluation, actor: str) -> AdapterRecord:
    """Store the client's scores with the version: advisory only, the release gate runs its own."""
    reply = await request(
        nc,
        subjects.registry("record_eval"),
        RecordEvalRequest(adapter_id=adapter_id, version=version, results=evaluation.results(), actor=actor),
        AdapterRecordsReply,
        REGISTRY_TIMEOUT_S,
    )
    return reply.records[0]


async def promote(
    nc: NATS,
    adapter_id: str,
    version: int,
    percent: float,
    actor: str,
    *,
    skip_eval: bool = False,
    reason: str | None = None,
) -> list[AdapterRecord]:
    """staging -> canary at ``percent`` (100 = production); the registry's release gate decides, on its
    own run of the version's eval set. ``skip_eval`` (the operator's, with ``reason``) passes it unevaluated."""
    message = PromoteRequest(
        adapter_id=adapter_id, version=version, traffic_percent=percent, skip_eval=skip_eval, reason=reason, actor=actor
    )
    return (await request(nc, subjects.registry("promote"), message, AdapterRecordsReply, PROMOTE_TIMEOUT_S)).records


def summary(adapter_id: str, version: int, evaluation: Evaluation) -> str:
    line = f"{adapter_id}@{version}: score {evaluation.adapter.score:.3f} on {len(evaluation.adapter.scores)} items"
    if evaluation.base is not None:
        line += f" (base model {evaluation.base.score:.3f})"
    return line + f", threshold {evaluation.threshold:.2f}, errors {evaluation.adapter.errors}"
