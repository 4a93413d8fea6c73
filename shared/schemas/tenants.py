"""Tenants, quotas and API keys (registry ops; the gateway mirrors their KV bucket)."""

import time
from typing import Annotated, Literal

from pydantic import Field

from shared.schemas.base import Identifier, Message, SloClass
from shared.schemas.registry import Actor, Sha256Hex

# ---- tenants and API keys (registry ops; the gateway mirrors the KV bucket) -----------------

SlotEnforce = Literal["soft", "hard"]
ApiScope = Literal["inference", "admin", "platform_admin"]


def default_key_scopes() -> list[ApiScope]:
    """The scopes of a new API key when the request names none."""
    return ["inference"]


class ChargeRequest(Message):
    """Charge one request of ``tenant_id`` that runs no model (``POST /v1/feedback``) against its
    requests-per-minute quota, as the scheduler charges an inference request (``lf.scheduler.charge``)."""

    tenant_id: Identifier
    kind: Literal["feedback"]


class ChargeReply(Message):
    charged: bool = True


class TenantQuota(Message):
    """A tenant's limits, as data for the scheduler; None = the platform default
    (``LF_DEFAULT_QUOTA__*``), 0 = no limit of that kind."""

    requests_per_min: int | None = Field(default=None, ge=0, le=10_000_000)
    tokens_per_min: int | None = Field(default=None, ge=0, le=10_000_000_000)
    max_concurrent: int | None = Field(default=None, ge=0, le=100_000)
    max_gpu_adapter_slots: int | None = Field(default=None, ge=0, le=100_000)
    slo_tier: SloClass | None = Field(
        default=None, description="the highest SLO class the tenant's requests may ask for (set by a platform admin)"
    )
    enforce: SlotEnforce = Field(
        default="soft",
        description="soft: at its slot quota a tenant evicts its own adapters first, others' when it has none "
        "to spare; hard: it waits for one of its own slots and never evicts another tenant's adapter",
    )


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
    scopes: list[ApiScope] = Field(default_factory=default_key_scopes, min_length=1, max_length=3)
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
