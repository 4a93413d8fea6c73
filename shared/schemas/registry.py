"""Registry ops: resolve, adapter records, lifecycle events and requests, trusted keys."""

import time
from typing import Annotated, Literal

from pydantic import AliasChoices, ConfigDict, Field, model_validator

from shared.schemas.base import Identifier, Message
from shared.schemas.inference import ResolvedAdapter
from shared.schemas.sources import SourceOrigin

# ---- registry --------------------------------------------------------------------------------
# Request-reply: a reply is the op's reply model, or an ErrorBody flagged by the
# ``Lf-Error`` header (see shared/bus.py ``serve`` / ``request``).


MODEL_NAME_MAX = 256  # the longest model name any route accepts


# the path a request came by: the gateway (HTTP), the scheduler (a direct-NATS submission), a worker's
# check of a dispatch. Counts refused cross-tenant attempts by where they were refused.
RequestRoute = Literal["http", "nats", "dispatch"]


class ResolveRequest(Message):
    tenant_id: Identifier
    model: str = Field(min_length=1, max_length=MODEL_NAME_MAX)
    request_key: str = Field(min_length=1, max_length=256)
    preview: bool = Field(
        default=False, description="a pinned model@version may be a staging version (pre-release eval)"
    )
    route: RequestRoute = Field(default="http", description="the path of the request being resolved (for audit)")


class ModelInfo(Message):
    id: str
    owned_by: str
    created: int
    kind: Literal["base", "adapter", "task"]


class ResolveReply(Message):
    base_model: str
    adapter: ResolvedAdapter | None = None


class CatalogSync(Message):
    """Registry -> every catalog mirror (gateways, schedulers, workers), after a catalog write:
    answer once your mirror holds ``revision``."""

    revision: int = Field(ge=0, description="the records bucket's revision of the write")
    routing_revision: int = Field(default=0, ge=0, description="the routing bucket's revision of the write (0: none)")


class CatalogSynced(Message):
    service: Identifier = "gateway"  # whose mirror: instance ids are unique per service only
    instance_id: Identifier
    revision: int = Field(ge=0, description="the revision the mirror holds")


class ListModelsRequest(Message):
    tenant_id: Identifier


class ListModelsReply(Message):
    models: list[ModelInfo] = Field(default_factory=list)


AdapterStatus = Literal["staging", "canary", "production", "retired", "revoked"]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Actor = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:@-]{1,128}$", description="who asked for a change")]
Scope = Annotated[str, Field(pattern=r"^(\*|[A-Za-z0-9_-]{1,64})$")]
TrafficPercent = Annotated[float, Field(gt=0, le=100, description="share of the adapter's requests, in percent")]


class PlatformEval(Message):
    """A score the registry itself measured: the version's eval set run on a worker through the serving
    path (greedy, pinned to the version), and production's score on the same set at the same time."""

    eval_set_digest: Sha256Hex = Field(description="sha256 of the eval set the score is on")
    score: float = Field(ge=0, le=1)
    threshold: float = Field(ge=0, le=1, description="the eval set's own release threshold")
    items: int = Field(ge=1)
    errors: int = Field(ge=0, description="items whose request failed (scored 0)")
    baseline_version: int | None = Field(default=None, ge=1, description="the production version compared with")
    baseline_score: float | None = Field(default=None, ge=0, le=1, description="its score on the same eval set")
    ran_at: float = Field(default_factory=time.time)


class AdapterRecord(Message):
    """One immutable adapter version plus its lifecycle state (status, traffic, aliases)."""

    # ``digest`` is stored and sent as "checksum", its name before: records in the bucket, and every
    # reader of them (CLI, older replicas), keep theirs
    model_config = ConfigDict(serialize_by_alias=True)

    adapter_id: Identifier
    version: int = Field(ge=1, description="immutable, strictly increasing per adapter")
    tenant_id: Identifier = Field(description='owner tenant, or "shared"')
    base_model: str = Field(min_length=1, max_length=256)
    base_model_fingerprint: Sha256Hex
    task_type: str = Field(min_length=1, max_length=64)
    rank: int = Field(ge=1, le=1024)
    alpha: float = Field(gt=0)
    use_rslora: bool = False
    target_modules: list[str] = Field(min_length=1, max_length=10)  # 7 dense projections, 3 expert ones
    files: dict[str, Sha256Hex] = Field(description="file name -> sha256: the signed manifest's content")
    digest: Sha256Hex = Field(
        validation_alias=AliasChoices("digest", "checksum"),
        serialization_alias="checksum",
        description="sha256 of adapter_model.safetensors: the adapter's digest",
    )
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
    eval_results: dict[str, float] = Field(
        default_factory=dict,
        max_length=64,
        description="client-supplied scores: advisory only, shown, never read by the release gate",
    )
    eval_set_digest: Sha256Hex | None = Field(
        default=None, description="sha256 of the version's own eval set (pushed with it, or attached by an admin)"
    )
    platform_eval: PlatformEval | None = Field(
        default=None, description="the release gate's own run of that eval set: what the gate and metrics read"
    )
    origin: SourceOrigin | None = Field(default=None, description="the remote source it was fetched from, if any")
    push_key: Identifier | None = Field(default=None, description="the idempotency key of the push that stored it")
    slot_bytes: dict[str, int] = Field(
        default_factory=dict,
        max_length=16,
        description="rank class -> bytes of one GPU slot holding this version in that class (A and B of its "
        "target modules over every layer, padded to the class rank, at LF_FLEET_SLOT_DTYPE), for each class "
        "of the fleet at push that holds its rank",
    )


class AdapterEvent(Message):
    """A lifecycle change, published on ``lf.adapter.event.<adapter_id>`` (stream ADAPTER_EVENTS)."""

    kind: Literal[
        "registered", "promoted", "rollout", "rolled_back", "retired", "revoked", "evaluated", "eval_set_attached"
    ]
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
    eval_results: dict[str, float] = Field(
        default_factory=dict, max_length=64, description="the client's own scores: stored as advisory, never gate"
    )
    push_key: Identifier | None = Field(
        default=None,
        description="the client's idempotency key for this push: a retry with the same key (and the same "
        "files) gets the version it stored back, signed or not",
    )
    wait_s: float | None = Field(
        default=None,
        gt=0,
        le=3600,
        description="how long the caller waits for the answer: a remote fetch still running then is cancelled "
        "(None = the registry's own fetch time limit only)",
    )
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
    skip_eval: bool = Field(
        default=False,
        description="pass an unevaluated version: a platform admin's only (the operator CLI, or a platform_admin "
        "key at the gateway), with a reason, audited",
    )
    reason: str | None = Field(default=None, max_length=500)
    actor: Actor

    @model_validator(mode="after")
    def _skip_has_reason(self) -> "PromoteRequest":
        if self.skip_eval and not self.reason:
            raise ValueError("skip_eval needs a reason (it is audited)")
        return self


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
    """A client's evaluation of one version: ``results`` holds score (and base_score, threshold, items).
    Stored as advisory only: the release gate reads the registry's own run (``AdapterRecord.platform_eval``)."""

    adapter_id: Identifier
    version: int = Field(ge=1)
    results: dict[str, float] = Field(max_length=64)
    actor: Actor

    @model_validator(mode="after")
    def _has_score(self) -> "RecordEvalRequest":
        if not 0 <= self.results.get("score", -1) <= 1:
            raise ValueError("results must hold a score in [0, 1]")
        return self


class AttachEvalSetRequest(Message):
    """An admin attaches (or replaces) a version's eval set; the platform-run score of an earlier set is dropped."""

    adapter_id: Identifier
    version: int = Field(ge=1)
    eval_set: str = Field(min_length=1, max_length=64 * 1024, description="the JSONL text (shared/eval_set.py)")
    tenant_id: Identifier | None = Field(default=None, description="a tenant admin's tenant; None: a platform admin")
    actor: Actor


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


PublicKey = Annotated[str, Field(pattern=r"^[A-Za-z0-9+/]{43}=$", description="base64 raw Ed25519 public key")]


class SignerRecord(Message):
    """A signer as the registry keeps it (KV ``lf_signers``, key = signer)."""

    signer: Identifier
    public_key: PublicKey = Field(description="the key new pushes must be signed with")
    tenants: list[Identifier] = Field(default_factory=list, max_length=1000, description="who it may sign for")
    trusted: bool = Field(default=True, description="False once untrusted: new pushes refused, its versions stay")
    retired_keys: list[PublicKey] = Field(
        default_factory=list, max_length=100, description="earlier keys, kept so the versions they signed verify"
    )
    updated_at: float = Field(default_factory=time.time)

    def verify_keys(self) -> list[str]:
        """Every key whose signature on an admitted version still verifies."""
        return [self.public_key, *self.retired_keys]


class TrustKeyRequest(Message):
    """Trust a new signer for ``tenants``; an existing signer changes only with ``rotate`` (a new
    key, a new tenant list, or trusted again after ``untrust``)."""

    signer: Identifier
    public_key: PublicKey
    tenants: list[Identifier] = Field(min_length=1, max_length=1000)
    rotate: bool = False
    actor: Actor


class UntrustKeyRequest(Message):
    signer: Identifier
    actor: Actor


class ListKeysRequest(Message):
    pass


class TrustedKeysReply(Message):
    keys: dict[str, str] = Field(default_factory=dict, description="trusted signer -> its current public key")
    signers: list[SignerRecord] = Field(default_factory=list, description="every signer, trusted or not")
