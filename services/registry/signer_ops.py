"""The registry's signer operations: which keys may sign pushes, for which tenants. Each change is a
compare-and-set on the signers bucket (another replica's concurrent change is planned again), is
applied to the replica's signer map, and is audited under every tenant it concerns."""

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from pydantic import BaseModel

from services.registry.kv import COMMIT_ATTEMPTS, RecordsKV, StaleRecords, contended
from shared.catalog.access import SHARED_TENANT
from shared.catalog.signers import parse_signer
from shared.errors import Conflict, NotFound
from shared.schemas import (
    AdminAudit,
    AuditEvent,
    ListKeysRequest,
    SignerRecord,
    TrustedKeysReply,
    TrustKeyRequest,
    UntrustKeyRequest,
)

Publish = Callable[[str, BaseModel], Awaitable[None]]  # a subject and the message published on it
Audit = Callable[[AuditEvent], Awaitable[None]]  # stores one audit record (kv.publish_registry_audit)
SignerAction = Literal["signer_trusted", "signer_rotated", "signer_untrusted"]


class SignerOps:
    def __init__(
        self,
        signers: dict[str, SignerRecord],
        kv: RecordsKV,
        audit: Audit,
        lock: asyncio.Lock,
    ) -> None:
        self.signers = signers  # the registry's own map: what its pushes are verified against
        self._kv = kv
        self._audit = audit
        self._lock = lock

    def apply_signer(self, key: str, value: bytes | None, revision: int) -> None:
        """One entry of the signers bucket's watch."""
        if value is None:
            self.signers.pop(key, None)
        else:
            self.signers[key] = parse_signer(key, value)

    async def keys(self, req: ListKeysRequest) -> TrustedKeysReply:
        return self._signers_reply()

    async def trust_key(self, req: TrustKeyRequest) -> TrustedKeysReply:
        """Trust a new signer for its tenants; changing a known one (key, tenants, trust) needs
        ``rotate``. Asking again for exactly what is stored changes nothing and is no error."""
        for _ in range(COMMIT_ATTEMPTS):
            async with self._lock:
                before, revision = await self._kv.load_signer(req.signer)  # as stored now, by any replica
                if (
                    before is not None
                    and before.trusted
                    and (before.public_key, before.tenants) == (req.public_key, sorted(set(req.tenants)))
                ):
                    self.signers[req.signer] = before
                    return self._signers_reply()
                if before is None and req.rotate:
                    raise NotFound(f"signer {req.signer!r} is not known; trust it without rotate", param="signer")
                if before is not None and not req.rotate:
                    raise Conflict(
                        f"signer {req.signer!r} is already known; replacing its key or tenants needs rotate",
                        param="signer",
                    )
                retired = before.retired_keys if before else []
                if before is not None and before.public_key != req.public_key:
                    retired = [*retired, before.public_key]
                record = SignerRecord(
                    signer=req.signer, public_key=req.public_key, tenants=sorted(set(req.tenants)), retired_keys=retired
                )
                try:
                    await self._kv.put_signer(record, revision)
                except StaleRecords:
                    continue
                self.signers[req.signer] = record
                await self._audit_signer("signer_rotated" if before else "signer_trusted", req.actor, before, record)
            return self._signers_reply()
        raise contended(f"signer {req.signer}")

    async def untrust_key(self, req: UntrustKeyRequest) -> TrustedKeysReply:
        """New pushes signed by it are refused; the versions it signed stay until they are revoked."""
        for _ in range(COMMIT_ATTEMPTS):
            async with self._lock:
                before, revision = await self._kv.load_signer(req.signer)
                if before is None:
                    raise NotFound(f"signer {req.signer!r} is not known", param="signer")
                record = before.model_copy(update={"trusted": False, "updated_at": time.time()})
                try:
                    await self._kv.put_signer(record, revision)
                except StaleRecords:
                    continue
                self.signers[req.signer] = record
                await self._audit_signer("signer_untrusted", req.actor, before, record)
            return self._signers_reply()
        raise contended(f"signer {req.signer}")

    def _signers_reply(self) -> TrustedKeysReply:
        records = [self.signers[name] for name in sorted(self.signers)]
        return TrustedKeysReply(keys={r.signer: r.public_key for r in records if r.trusted}, signers=records)

    async def _audit_signer(
        self, action: SignerAction, actor: str, before: SignerRecord | None, after: SignerRecord
    ) -> None:
        """One record under each tenant the signer could or can sign for (the platform's when none)."""
        tenants = sorted(set(after.tenants) | set(before.tenants if before else [])) or [SHARED_TENANT]
        detail = {
            "public_key": after.public_key,
            "tenants": after.tenants,
            "trusted": after.trusted,
            "key_changed": before is not None and before.public_key != after.public_key,
        }
        for tenant in tenants:
            audit = AdminAudit(actor=actor, tenant_id=tenant, action=action, target=after.signer, detail=detail)
            await self._audit(audit)
