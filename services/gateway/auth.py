"""Bearer API key -> Principal (tenant, scopes).

Registry-issued keys are checked against an in-memory mirror of the registry's ``lf_tenants``
KV bucket (kept fresh by ``key_watch.follow_keys``), so a revocation takes effect as soon as
the watch delivers it (milliseconds). Keys from ``LF_API_KEYS`` stay as a bootstrap / dev
option and carry the ``inference`` scope only.

Scopes: ``inference`` calls the OpenAI routes; ``admin`` manages its own tenant's adapters,
keys and quotas-as-read; ``platform_admin`` manages every tenant (creating tenants, setting
quotas, granting platform_admin). An admin-only key cannot call inference routes.
"""

import hmac
from dataclasses import dataclass

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from shared.api_keys import matches, parse_key
from shared.errors import Forbidden, Unauthorized
from shared.schemas import ApiKeyRecord, TenantRecord

KEY_PREFIX = "key."
TENANT_PREFIX = "tenant."
DEFAULT_TIER = "standard"  # a tenant's tier when neither its record nor the fleet default sets one
bearer = HTTPBearer(auto_error=False, description="an API key: `lf-<key_id>-<secret>`")


@dataclass(frozen=True, slots=True)
class Principal:
    tenant_id: str
    scopes: frozenset[str]
    key_id: str | None = None

    @property
    def platform_admin(self) -> bool:
        return "platform_admin" in self.scopes

    def require(self, scope: str) -> None:
        """Raise 403 unless the key holds ``scope`` (platform_admin implies admin)."""
        if scope in self.scopes or (scope == "admin" and self.platform_admin):
            return
        raise Forbidden(f"this API key lacks the '{scope}' scope")


class ApiKeys:
    def __init__(self, config_keys: dict[str, str], default_tier: str = DEFAULT_TIER) -> None:
        self._config = dict(config_keys)
        self._default_tier = default_tier  # the fleet's LF_DEFAULT_QUOTA__SLO_TIER, as the scheduler reads it
        self._records: dict[str, ApiKeyRecord] = {}
        self._tiers: dict[str, str] = {}
        self.loaded = False

    def tier(self, tenant_id: str) -> str:
        """The tenant's SLO tier, as routing policies match it."""
        return self._tiers.get(tenant_id, self._default_tier)

    def apply(self, kv_key: str, value: bytes | None) -> None:
        """One watched bucket entry: a put (value) or a delete/purge (None)."""
        if kv_key.startswith(TENANT_PREFIX):
            tenant_id = kv_key[len(TENANT_PREFIX) :]
            tier = TenantRecord.model_validate_json(value).quota.slo_tier if value is not None else None
            if tier is None:
                self._tiers.pop(tenant_id, None)
            else:
                self._tiers[tenant_id] = tier
            return
        if not kv_key.startswith(KEY_PREFIX):
            return
        key_id = kv_key[len(KEY_PREFIX) :]
        if value is None:
            self._records.pop(key_id, None)
        else:
            self._records[key_id] = ApiKeyRecord.model_validate_json(value)

    def principal(self, key: str) -> Principal:
        parsed = parse_key(key)
        if parsed is not None:
            record = self._records.get(parsed[0])
            if record is not None and not record.revoked and matches(record, parsed[1]):
                return Principal(record.tenant_id, frozenset(record.scopes), record.key_id)
        for known, tenant in self._config.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                return Principal(tenant, frozenset({"inference"}))
        raise Unauthorized("invalid API key")

    def authenticate(self, credentials: HTTPAuthorizationCredentials | None) -> Principal:
        if credentials is None or not credentials.credentials.strip():
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        return self.principal(credentials.credentials.strip())


# The dependencies are ``async def`` although they never await: FastAPI runs a plain ``def``
# dependency on its thread pool, two thread hand-offs per request for a dictionary lookup.
async def principal(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Principal:
    """FastAPI dependency: the caller, authenticated (401 otherwise)."""
    return request.app.state.ctx.keys.authenticate(credentials)


async def inference_caller(caller: Principal = Depends(principal)) -> Principal:
    caller.require("inference")
    return caller


async def admin_caller(caller: Principal = Depends(principal)) -> Principal:
    caller.require("admin")
    return caller
