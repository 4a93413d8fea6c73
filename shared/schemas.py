"""Every message body exchanged over NATS: pydantic v2 models serialised as JSON."""

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Identifier = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
RequestId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")]


class Message(BaseModel):
    """Base for bus messages: unknown fields are refused, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ErrorBody(Message):
    code: str = Field(max_length=64)
    message: str = Field(max_length=2000)
    status: int = Field(ge=400, le=599)
    retry_after_s: float | None = None
    param: str | None = None


# ---- inference ---------------------------------------------------------------------------


class ChatMessage(Message):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=200_000)


class SamplingParams(Message):
    max_tokens: int = Field(default=128, ge=1, le=32_768)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1000, description="0 disables top-k")
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list, max_length=8)
    ignore_eos: bool = False


class ResolvedAdapter(Message):
    """The exact adapter version a request was granted by the registry."""

    adapter_id: Identifier
    version: int = Field(ge=1)
    rank: int = Field(ge=1, le=1024)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    storage_uri: str = Field(max_length=2048)
    alpha: float = Field(gt=0)
    use_rslora: bool = False


class InferRequest(Message):
    """One generation request, as submitted on ``lf.infer.submit.<tenant>``."""

    request_id: RequestId
    tenant_id: Identifier
    model: str = Field(min_length=1, max_length=256, description="the name the client asked for")
    base_model: str = Field(min_length=1, max_length=256)
    adapter: ResolvedAdapter | None = None
    messages: list[ChatMessage] | None = Field(default=None, max_length=1024)
    prompt: str | None = Field(default=None, max_length=400_000)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    reply_to: str = Field(
        min_length=1, max_length=256, pattern=r"^_INBOX[._][A-Za-z0-9_.-]+$",
        description="the requester's inbox: _INBOX.<id> (gateway) or _INBOX_<tenant>.<id> (direct tenant clients)",
    )
    priority: Literal["interactive", "batch"] = "interactive"
    created_at: float = Field(default_factory=time.time)
    timeout_s: float = Field(default=120.0, gt=0, le=3600)
    accept_deadline: float | None = Field(
        default=None, description="epoch seconds after which the client no longer waits for a worker"
    )

    @model_validator(mode="after")
    def _one_input(self) -> "InferRequest":
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("exactly one of messages or prompt must be given")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class DispatchReply(Message):
    """A worker's answer to ``lf.worker.<id>.dispatch``: it took the request, or why not."""

    accepted: bool
    worker_id: Identifier
    error: ErrorBody | None = None


class ServedBy(Message):
    worker_id: Identifier
    base_model: str
    adapter_id: str | None = None
    adapter_version: int | None = None
    adapter_digest: str | None = None
    cache_hit: bool = True


class Usage(Message):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)


class ReplyAccepted(Message):
    kind: Literal["accepted"] = "accepted"
    request_id: RequestId
    worker_id: Identifier
    cache_hit: bool = Field(description="the adapter (or base model) was resident when the worker accepted")


class ReplyToken(Message):
    kind: Literal["token"] = "token"
    request_id: RequestId
    index: int = Field(ge=0)
    text: str
    token_ids: list[int]


class ReplyFinal(Message):
    kind: Literal["final"] = "final"
    request_id: RequestId
    text: str
    finish_reason: Literal["stop", "length", "cancelled"]
    usage: Usage
    served_by: ServedBy
    ttft_ms: float = Field(ge=0)
    tpot_ms: float = Field(ge=0)


class ReplyError(Message):
    kind: Literal["error"] = "error"
    request_id: RequestId
    error: ErrorBody


ReplyMessage = Annotated[ReplyAccepted | ReplyToken | ReplyFinal | ReplyError, Field(discriminator="kind")]


class ReplyEnvelope(Message):
    """What travels on a request's reply inbox; one wrapper so a consumer decodes one type."""

    body: ReplyMessage


# ---- worker control and liveness -----------------------------------------------------------


class WorkerControl(Message):
    action: Literal["prefetch", "evict", "pin", "unpin", "cancel"]
    request_id: RequestId | None = None
    adapter_id: Identifier | None = None
    adapter_version: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _target(self) -> "WorkerControl":
        if self.action == "cancel" and self.request_id is None:
            raise ValueError("cancel needs request_id")
        if self.action != "cancel" and self.adapter_id is None:
            raise ValueError(f"{self.action} needs adapter_id")
        return self


class WorkerHeartbeat(Message):
    worker_id: Identifier
    base_model: str
    ready: bool
    running: int = Field(ge=0)
    waiting: int = Field(ge=0)
    max_running: int = Field(ge=1)
    kv_blocks_free: int = Field(ge=0)
    kv_blocks_total: int = Field(ge=0)
    resident_adapters: list[str] = Field(default_factory=list)
    cpu_adapters: list[str] = Field(
        default_factory=list, description="adapter keys held verified in the worker's CPU tier (a cheap load)"
    )
    slots: dict[str, list[int]] = Field(default_factory=dict, description="rank class -> [slots used, slots]")
    cache_hit_ratio: dict[str, float] = Field(default_factory=dict, description="tier -> share of adapter lookups")
    load_ms_mean: dict[str, float] = Field(default_factory=dict, description="source tier -> mean adapter load ms")
    ts: float = Field(default_factory=time.time)


class ServiceHeartbeat(Message):
    service: Literal["gateway", "scheduler", "worker", "registry", "auditor"]
    instance_id: Identifier
    ready: bool
    detail: str = Field(default="", max_length=500)
    metrics_port: int | None = Field(default=None, ge=1, le=65535, description="where its /metrics listens")
    ts: float = Field(default_factory=time.time)


# ---- registry --------------------------------------------------------------------------------
# Request-reply: a reply is the op's reply model, or an ErrorBody flagged by the
# ``Lf-Error`` header (see shared/bus.py ``serve`` / ``request``).


class ResolveRequest(Message):
    tenant_id: Identifier
    model: str = Field(min_length=1, max_length=256)
    request_key: str = Field(min_length=1, max_length=256)
    preview: bool = Field(default=False, description="a pinned model@version may be a staging version (pre-release eval)")


class ModelInfo(Message):
    id: str
    owned_by: str
    created: int
    kind: Literal["base", "adapter"]


class ResolveReply(Message):
    base_model: str
    adapter: ResolvedAdapter | None = None


class ListModelsRequest(Message):
    tenant_id: Identifier


class ListModelsReply(Message):
    models: list[ModelInfo] = Field(default_factory=list)


AdapterStatus = Literal["staging", "canary", "production", "retired", "revoked"]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Actor = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:@-]{1,128}$", description="who asked for a change")]
Scope = Annotated[str, Field(pattern=r"^(\*|[A-Za-z0-9_-]{1,64})$")]
TrafficPercent = Annotated[float, Field(gt=0, le=100, description="share of the adapter's requests, in percent")]


class AdapterRecord(Message):
    """One immutable adapter version plus its lifecycle state (status, traffic, aliases)."""

    adapter_id: Identifier
    version: int = Field(ge=1, description="immutable, strictly increasing per adapter")
    tenant_id: Identifier = Field(description='owner tenant, or "shared"')
    base_model: str = Field(min_length=1, max_length=256)
    base_model_fingerprint: Sha256Hex
    task_type: str = Field(min_length=1, max_length=64)
    rank: int = Field(ge=1, le=1024)
    alpha: float = Field(gt=0)
    use_rslora: bool = False
    target_modules: list[str] = Field(min_length=1, max_length=7)
    files: dict[str, Sha256Hex] = Field(description="file name -> sha256: the signed manifest's content")
    checksum: Sha256Hex = Field(description="sha256 of adapter_model.safetensors")
    manifest_digest: Sha256Hex
    signature: str | None = Field(default=None, max_length=200, description="base64 Ed25519; None only in dev mode")
    signer: Identifier | None = None
    storage_uri: str = Field(max_length=2048)
    created_at: float = Field(default_factory=time.time)
    status: AdapterStatus = "staging"
    traffic_percent: float = Field(default=0.0, ge=0, le=100)
    promoted_at: float | None = Field(default=None, description="when it last became production")
    allowed_scopes: list[Scope] = Field(default_factory=list, max_length=1000)
    aliases: list[Identifier] = Field(default_factory=list, max_length=16)
    eval_results: dict[str, float] = Field(default_factory=dict, max_length=64)


class AdapterEvent(Message):
    """A lifecycle change, published on ``lf.adapter.event.<adapter_id>`` (stream ADAPTER_EVENTS)."""

    kind: Literal["registered", "promoted", "rollout", "rolled_back", "retired", "revoked", "evaluated"]
    adapter_id: Identifier
    version: int = Field(ge=1)
    tenant_id: Identifier
    status: AdapterStatus
    traffic_percent: float = Field(ge=0, le=100)
    actor: Actor
    ts: float = Field(default_factory=time.time)


class RegisterRequest(Message):
    """Register a new version from exactly one source: an upload, inline files, or a trusted URI."""

    adapter_id: Identifier
    tenant_id: Identifier
    task_type: str = Field(min_length=1, max_length=64)
    version: int | None = Field(default=None, ge=1, description="None = next; a signed push names it")
    upload_id: Identifier | None = Field(default=None, description="objects <upload_id>/<file> in the uploads bucket")
    inline_files: dict[str, str] | None = Field(default=None, description="file name -> base64 content")
    source_uri: str | None = Field(default=None, max_length=2048)
    signature: str | None = Field(default=None, max_length=200)
    signer: Identifier | None = None
    aliases: list[Identifier] = Field(default_factory=list, max_length=16)
    allowed_scopes: list[Scope] = Field(default_factory=list, max_length=1000)
    eval_results: dict[str, float] = Field(default_factory=dict, max_length=64)
    actor: Actor

    @model_validator(mode="after")
    def _one_source(self) -> "RegisterRequest":
        given = [s for s in (self.upload_id, self.inline_files, self.source_uri) if s is not None]
        if len(given) != 1:
            raise ValueError("exactly one of upload_id, inline_files or source_uri must be given")
        if (self.signature is None) != (self.signer is None):
            raise ValueError("signature and signer go together")
        return self


class PromoteRequest(Message):
    """staging -> canary at ``traffic_percent`` (100 = straight to production)."""

    adapter_id: Identifier
    version: int = Field(ge=1)
    traffic_percent: TrafficPercent = 1.0
    force: bool = Field(default=False, description="skip the release gate (audited with the reason)")
    reason: str | None = Field(default=None, max_length=500)
    actor: Actor


class RolloutRequest(Message):
    """Move the canary's traffic share; 100 makes it production."""

    adapter_id: Identifier
    traffic_percent: TrafficPercent
    actor: Actor


class RollbackRequest(Message):
    adapter_id: Identifier
    reason: str | None = Field(default=None, max_length=500, description="why, for the audit trail")
    actor: Actor


class RecordEvalRequest(Message):
    """An evaluation of one version: ``results`` holds score (and base_score, threshold, items)."""

    adapter_id: Identifier
    version: int = Field(ge=1)
    results: dict[str, float] = Field(max_length=64)
    actor: Actor

    @model_validator(mode="after")
    def _has_score(self) -> "RecordEvalRequest":
        if not 0 <= self.results.get("score", -1) <= 1:
            raise ValueError("results must hold a score in [0, 1]")
        return self


class RetireRequest(Message):
    adapter_id: Identifier
    version: int = Field(ge=1)
    actor: Actor


class RevokeRequest(Message):
    """Security stop: the version (or every version when None) is never served again."""

    adapter_id: Identifier
    version: int | None = Field(default=None, ge=1)
    actor: Actor


class GetAdapterRequest(Message):
    adapter_id: Identifier
    version: int | None = Field(default=None, ge=1, description="None = every version")


class ListAdaptersRequest(Message):
    tenant_id: Identifier | None = Field(default=None, description="None = every tenant")


class AdapterRecordsReply(Message):
    """The records an op read or changed, oldest version first."""

    records: list[AdapterRecord] = Field(default_factory=list)


class TrustKeyRequest(Message):
    signer: Identifier
    public_key: str = Field(pattern=r"^[A-Za-z0-9+/]{43}=$", description="base64 raw Ed25519 public key")
    actor: Actor


class ListKeysRequest(Message):
    pass


class TrustedKeysReply(Message):
    keys: dict[str, str] = Field(default_factory=dict, description="signer -> base64 public key")


# ---- tenants and API keys (registry ops; the gateway mirrors the KV bucket) -----------------

ApiScope = Literal["inference", "admin", "platform_admin"]


class TenantQuota(Message):
    """A tenant's limits, as data for the scheduler; None = no limit of that kind."""

    requests_per_min: int | None = Field(default=None, ge=1, le=10_000_000)
    tokens_per_min: int | None = Field(default=None, ge=1, le=10_000_000_000)
    max_concurrent: int | None = Field(default=None, ge=1, le=100_000)
    max_gpu_adapter_slots: int | None = Field(default=None, ge=1, le=100_000)


class TenantRecord(Message):
    tenant_id: Identifier
    created_at: float = Field(default_factory=time.time)
    quota: TenantQuota = Field(default_factory=TenantQuota)


class ApiKeyInfo(Message):
    """An API key as listed: everything but the secret and its hash."""

    key_id: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
    tenant_id: Identifier
    scopes: list[ApiScope] = Field(min_length=1, max_length=3)
    created_at: float = Field(default_factory=time.time)
    revoked: bool = False


class ApiKeyRecord(ApiKeyInfo):
    """As stored: ``sha256(salt || secret)``; the secret itself is shown once, at creation."""

    salt: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    secret_sha256: Sha256Hex


class CreateTenantRequest(Message):
    tenant_id: Identifier
    quota: TenantQuota = Field(default_factory=TenantQuota)
    actor: Actor


class ListTenantsRequest(Message):
    tenant_id: Identifier | None = Field(default=None, description="None = every tenant")


class TenantsReply(Message):
    tenants: list[TenantRecord] = Field(default_factory=list)


class SetQuotaRequest(Message):
    tenant_id: Identifier
    quota: TenantQuota
    actor: Actor


class CreateApiKeyRequest(Message):
    tenant_id: Identifier
    scopes: list[ApiScope] = Field(default_factory=lambda: ["inference"], min_length=1, max_length=3)
    actor: Actor


class ApiKeyCreatedReply(Message):
    key: str = Field(description="the bearer key, shown only in this reply")
    info: ApiKeyInfo


class RevokeApiKeyRequest(Message):
    key_id: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
    tenant_id: Identifier | None = Field(default=None, description="when set, only a key of this tenant")
    actor: Actor


class ListApiKeysRequest(Message):
    tenant_id: Identifier | None = Field(default=None, description="None = every tenant")


class ApiKeysReply(Message):
    keys: list[ApiKeyInfo] = Field(default_factory=list)


# ---- audit -------------------------------------------------------------------------------


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


class RejectionAudit(Message):
    kind: Literal["rejection"] = "rejection"
    ts: float = Field(default_factory=time.time)
    request_id: RequestId
    tenant_id: Identifier
    service: str
    code: str
    reason: str = Field(max_length=2000)


class RegistryChangeAudit(Message):
    kind: Literal["registry_change"] = "registry_change"
    ts: float = Field(default_factory=time.time)
    actor: Actor
    tenant_id: Identifier
    adapter_id: Identifier
    version: int = Field(ge=1)
    action: Literal["registered", "promoted", "rollout", "rolled_back", "retired", "revoked", "evaluated"]
    before: AdapterStatus | None = None
    after: AdapterStatus
    reason: str | None = Field(default=None, max_length=500)


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


AuditEvent = Annotated[
    CompletionAudit | RejectionAudit | RegistryChangeAudit | ViolationAudit, Field(discriminator="kind")
]


class AuditQueryRequest(Message):
    """A query of the audit index; ``tenant_id`` scopes it (None only for platform operators)."""

    tenant_id: Identifier | None = None
    request_id: RequestId | None = None
    adapter_id: Identifier | None = None
    kind: str | None = Field(default=None, max_length=32)
    since: float | None = None
    until: float | None = None
    limit: int = Field(default=100, ge=1, le=1000)


class AuditQueryReply(Message):
    records: list[dict] = Field(default_factory=list)
    intact: bool | None = Field(default=None, description="the hash chain verified, when asked")


class AuditEnvelope(Message):
    body: AuditEvent
