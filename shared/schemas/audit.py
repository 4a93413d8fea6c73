"""Audit events on the AUDIT stream and queries of the auditor's index."""

import time
from typing import Annotated, Any, Literal

from pydantic import Field

from shared.schemas.base import Identifier, Message, RequestId, SloClass
from shared.schemas.registry import Actor, AdapterStatus, RequestRoute
from shared.schemas.release import DecisionAction, VersionFigures

# ---- audit -------------------------------------------------------------------------------


class AnswerDigest(Message):
    """An answer's output tokens as digests (``shared/answer_digest.py``): compared, never shown."""

    tokens: int = Field(ge=0, description="output tokens digested (at most the request's compare_tokens)")
    digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of all of them")
    prefixes: list[Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]] = Field(
        default_factory=list, max_length=32, description="of the first 1, 2, 4, ... and all of them"
    )


class CompletionAudit(Message):
    kind: Literal["completion"] = "completion"
    ts: float = Field(default_factory=time.time)
    request_id: RequestId
    tenant_id: Identifier
    base_model: str
    adapter_id: str | None = None
    adapter_version: int | None = None
    adapter_rank: int | None = None
    adapter_digest: str | None = None
    cache_hit: bool
    ttft_ms: float = Field(ge=0)
    tpot_ms: float = Field(ge=0)
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    worker_id: Identifier
    outcome: Literal["stop", "length", "cancelled", "error"]
    slo_class: SloClass | None = Field(default=None, description="the SLO class it was served under")
    task: str | None = Field(default=None, max_length=64, description="the task it was routed by, if any")
    experiment: str | None = Field(default=None, max_length=64, description="the experiment it was assigned by")
    arm: str | None = Field(default=None, max_length=32, description="the experiment's arm that served it")
    engine_s: float | None = Field(
        default=None,
        ge=0,
        description="engine seconds the request consumed (its token share of each step it ran in); the worker "
        "measures it, None where its engine does not (vLLM) and in records written before it was measured",
    )
    shadow_of: RequestId | None = Field(
        default=None,
        description="a shadow run: the canary answering this production request's prompt off the client's path; "
        "never billed, never counted as the version's served traffic",
    )
    answer: AnswerDigest | None = Field(
        default=None, description="digests of the output tokens of a run compared in the shadow (never its text)"
    )


class RejectionAudit(Message):
    kind: Literal["rejection"] = "rejection"
    ts: float = Field(default_factory=time.time)
    request_id: RequestId
    tenant_id: Identifier
    service: str
    code: str
    reason: str = Field(max_length=2000)
    route: RequestRoute | None = Field(default=None, description="a refused cross-tenant attempt's path")


class RegistryChangeAudit(Message):
    kind: Literal["registry_change"] = "registry_change"
    ts: float = Field(default_factory=time.time)
    actor: Actor
    tenant_id: Identifier
    adapter_id: Identifier
    version: int = Field(ge=1)
    action: Literal[
        "registered", "promoted", "rollout", "rolled_back", "retired", "revoked", "evaluated", "eval_set_attached"
    ]
    before: AdapterStatus | None = None
    after: AdapterStatus
    reason: str | None = Field(default=None, max_length=500)


class AdminAudit(Message):
    """A change to tenants, API keys, quotas, signer trust or remote sources, recorded under each tenant it concerns."""

    kind: Literal["admin"] = "admin"
    ts: float = Field(default_factory=time.time)
    actor: Actor
    tenant_id: Identifier
    action: Literal[
        "tenant_created",
        "quota_set",
        "api_key_created",
        "api_key_revoked",
        "signer_trusted",
        "signer_rotated",
        "signer_untrusted",
        "source_added",
        "source_removed",
        "source_approved",
        "adapter_pinned",
        "adapter_unpinned",
        "task_routes_set",
        "task_routes_deleted",
        "route_policies_set",
        "experiment_created",
        "experiment_state_set",
    ]
    target: str = Field(max_length=128, description="the tenant, key id, signer or adapter changed")
    detail: dict[str, Any] = Field(default_factory=dict, description="what it changed to (never a secret)")


class ViolationAudit(Message):
    """What the auditor's cross-check found wrong with a completion: served across tenants, or
    with weights other than the registry's for that version."""

    kind: Literal["violation"] = "violation"
    ts: float = Field(default_factory=time.time)
    violation: Literal["tenant_isolation", "integrity"]
    request_id: RequestId
    tenant_id: Identifier
    adapter_id: str | None = None
    adapter_version: int | None = None
    detail: str = Field(max_length=2000)


class FeedbackAudit(Message):
    """A user's rating of one of its own completions (``POST /v1/feedback``), checked by the gateway
    against the completion's audit record, whose adapter version it names."""

    kind: Literal["feedback"] = "feedback"
    ts: float = Field(default_factory=time.time)
    request_id: RequestId
    tenant_id: Identifier
    adapter_id: str | None = None
    adapter_version: int | None = None
    rating: Literal["up", "down"]
    reason: str | None = Field(default=None, max_length=1000)


class ReleaseDecisionAudit(Message):
    """A release controller decision and the live figures it was based on."""

    kind: Literal["release_decision"] = "release_decision"
    ts: float = Field(default_factory=time.time)
    actor: Actor
    tenant_id: Identifier
    adapter_id: Identifier
    version: int = Field(ge=1)
    baseline_version: int | None = None
    action: DecisionAction
    percent: float = Field(ge=0, le=100)
    reasons: list[str] = Field(default_factory=list)
    canary: VersionFigures | None = None
    baseline: VersionFigures | None = None


AuditEvent = Annotated[
    CompletionAudit
    | RejectionAudit
    | RegistryChangeAudit
    | AdminAudit
    | ViolationAudit
    | FeedbackAudit
    | ReleaseDecisionAudit,
    Field(discriminator="kind"),
]


class AuditQueryRequest(Message):
    """A query of the audit index, newest record first; ``tenant_id`` scopes it (None only for
    platform operators). ``before`` is the cursor of the previous page (its ``next_cursor``)."""

    tenant_id: Identifier | None = None
    request_id: RequestId | None = None
    adapter_id: Identifier | None = None
    kind: str | None = Field(default=None, max_length=32)
    since: float | None = None
    until: float | None = None
    before: int | None = Field(default=None, ge=1, description="only records older than this position")
    limit: int = Field(default=100, ge=1, le=1000)
    verify: bool = Field(default=False, description="recompute the whole chain against every signed head first")


class SignedHead(Message):
    """An auditor's signed statement that its chain held ``pos`` records ending in ``hash``."""

    auditor_id: Identifier
    pos: int = Field(ge=1)
    hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    stream_seq: int
    ts: float
    public_key: str = Field(max_length=64, description="base64 raw Ed25519 key that signed this head")
    signature: str = Field(max_length=128)


class ChainStatus(Message):
    """What the auditor knows of its chain: verified up to ``verified_pos``, signed up to ``signed_pos``."""

    intact: bool
    broken_at: int | None = Field(default=None, description="the first record that breaks the chain, if any")
    problem: str | None = Field(default=None, max_length=500)
    count: int = Field(ge=0, description="records in the index")
    verified_pos: int = Field(ge=0)
    signed_pos: int | None = None
    public_key: str = Field(description="the auditor's head-signing key, base64 raw Ed25519")


class AuditQueryReply(Message):
    records: list[dict[str, Any]] = Field(default_factory=list)
    next_cursor: int | None = Field(default=None, description="``before`` of the next (older) page; None on the last")
    chain: ChainStatus | None = Field(default=None, description="platform-wide queries only")


class AuditEnvelope(Message):
    body: AuditEvent
