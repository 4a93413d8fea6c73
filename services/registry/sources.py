"""The operator's allow-list of remote adapter sources and its per-URI approvals: the registry ops
behind ``lf.registry.source_*``, and the check a register request from a remote URI must pass.

State lives in the KV bucket ``lf_sources`` (``source.<sha256 of prefix>``, ``approval.<sha256 of
uri>``) and is read from there on every check, so every registry replica sees a removal at once.
Each change is written first, then recorded (``AdminAudit``) under every tenant it concerns.
"""

import hashlib
from collections.abc import Awaitable, Callable
from typing import Literal

from services.registry.source_uri import SourceLocation, covers, parse_source
from shared import subjects
from shared.errors import InvalidRequest, NotFound, SourceNotAllowed, SourceNotApproved, SourceRedirectRefused
from shared.schemas import (
    AddSourceRequest,
    AdminAudit,
    ApproveSourceRequest,
    ListSourcesRequest,
    RemoveSourceRequest,
    SourceApproval,
    SourceEntry,
    SourcesReply,
)
from shared.undecodable import skip

SOURCE_PREFIX = "source."
APPROVAL_PREFIX = "approval."
Load = Callable[[], Awaitable[dict[str, bytes]]]
Put = Callable[[str, bytes], Awaitable[None]]
Delete = Callable[[str], Awaitable[None]]
Audit = Callable[[AdminAudit], Awaitable[None]]
SourceAction = Literal["source_added", "source_removed", "source_approved"]


def _key(kind: str, text: str) -> str:
    return kind + hashlib.sha256(text.encode()).hexdigest()


class Sources:
    def __init__(self, load: Load, put: Put, delete: Delete, audit: Audit) -> None:
        self._load = load
        self._put = put
        self._delete = delete
        self._audit = audit

    async def list_sources(self, req: ListSourcesRequest) -> SourcesReply:
        entries, approvals = await self._state()
        return SourcesReply(
            sources=sorted(entries.values(), key=lambda e: e.prefix),
            approvals=sorted(approvals.values(), key=lambda a: a.uri),
        )

    async def add(self, req: AddSourceRequest) -> SourcesReply:
        """Allow-list a prefix for ``tenants`` (replacing the entry when the prefix is listed)."""
        prefix = parse_source(req.prefix).uri
        if prefix != req.prefix:
            raise InvalidRequest(f"prefix {req.prefix!r} is not in canonical form; use {prefix!r}", param="prefix")
        entry = SourceEntry(
            prefix=prefix,
            tenants=sorted(set(req.tenants)),
            allow_private=req.allow_private,
            require_approval=req.require_approval,
            added_by=req.actor,
        )
        entries, _ = await self._state()
        before = entries.get(prefix)
        await self._put(_key(SOURCE_PREFIX, prefix), entry.model_dump_json().encode())
        tenants = set(entry.tenants) | set(before.tenants if before else [])
        await self._record(
            "source_added", req.actor, tenants, prefix, _detail(entry) | {"replaced": before is not None}
        )
        return await self.list_sources(ListSourcesRequest())

    async def remove(self, req: RemoveSourceRequest) -> SourcesReply:
        """Drop a prefix and every approval under it: re-adding it needs fresh approvals."""
        entries, approvals = await self._state()
        entry = entries.get(req.prefix)
        if entry is None:
            raise NotFound(f"source prefix {req.prefix!r} is not on the allow-list", param="prefix")
        await self._delete(_key(SOURCE_PREFIX, entry.prefix))
        for uri in approvals:
            if uri.startswith(entry.prefix):
                await self._delete(_key(APPROVAL_PREFIX, uri))
        await self._record("source_removed", req.actor, set(entry.tenants), entry.prefix, _detail(entry))
        return await self.list_sources(ListSourcesRequest())

    async def approve(self, req: ApproveSourceRequest) -> SourcesReply:
        """Approve one URI under an entry that asks for approval, before its first use."""
        uri = parse_source(req.uri).uri
        entries, _ = await self._state()
        covering = [e for e in entries.values() if uri.startswith(e.prefix) and e.require_approval]
        if not covering:
            raise NotFound(f"no allow-list entry that requires approval covers {uri}", param="uri")
        await self._put(
            _key(APPROVAL_PREFIX, uri), SourceApproval(uri=uri, approved_by=req.actor).model_dump_json().encode()
        )
        tenants = {t for e in covering for t in e.tenants}
        await self._record("source_approved", req.actor, tenants, uri, {"uri": uri})
        return await self.list_sources(ListSourcesRequest())

    async def authorize(self, location: SourceLocation, tenant_id: str) -> "SourceGrant":
        """The entry that lets ``tenant_id`` register from ``location``: the longest covering prefix
        bound to the tenant. No entry and an entry of other tenants only get the same refusal."""
        entries, approvals = await self._state()
        mine = [e for e in entries.values() if covers(parse_source(e.prefix), location) and tenant_id in e.tenants]
        if not mine:
            raise SourceNotAllowed(f"{location.uri} is not on the registry's source allow-list for tenant {tenant_id}")
        entry = max(mine, key=lambda e: len(e.prefix))
        if entry.require_approval and location.uri not in approvals:
            raise SourceNotApproved(
                f"{location.uri} needs an operator's approval before its first use (lorafleet source approve)"
            )
        return SourceGrant(tenant_id, [e for e in entries.values() if tenant_id in e.tenants], entry, set(approvals))

    async def _state(self) -> tuple[dict[str, SourceEntry], dict[str, SourceApproval]]:
        entries: dict[str, SourceEntry] = {}
        approvals: dict[str, SourceApproval] = {}
        for key, value in (await self._load()).items():
            try:
                if key.startswith(SOURCE_PREFIX):
                    entry = SourceEntry.model_validate_json(value)
                    entries[entry.prefix] = entry
                elif key.startswith(APPROVAL_PREFIX):
                    approval = SourceApproval.model_validate_json(value)
                    approvals[approval.uri] = approval
            except ValueError as e:  # one bad entry grants nothing and blocks nothing else
                skip(subjects.REGISTRY_SOURCES_BUCKET, key, e)
        return entries, approvals

    async def _record(self, action: SourceAction, actor: str, tenants: set[str], target: str, detail: dict) -> None:
        for tenant in sorted(tenants):
            await self._audit(
                AdminAudit(actor=actor, tenant_id=tenant, action=action, target=target[:128], detail=detail)
            )


class SourceGrant:
    """A tenant's permission to fetch from one location, and where its redirects may lead."""

    def __init__(self, tenant_id: str, entries: list[SourceEntry], entry: SourceEntry, approved: set[str]) -> None:
        self.tenant_id = tenant_id
        self.entry = entry
        self._entries = entries
        self._approved = approved  # URIs an operator approved

    def redirect_entry(self, url: str) -> SourceEntry:
        """The tenant's entry covering a redirect target's directory; refused when none does, and when
        that entry asks for approval and the target's directory is not approved itself: what is
        fetched is what was approved, not what an approved URL answers with."""
        directory = url.split("?", 1)[0].rsplit("/", 1)[0] + "/"
        try:
            location = parse_source(directory)
        except InvalidRequest:
            raise SourceRedirectRefused(f"redirect to {directory} is refused: not an https source URL") from None
        covering = [e for e in self._entries if covers(parse_source(e.prefix), location)]
        if location.scheme != "https" or not covering:
            raise SourceRedirectRefused(
                f"redirect to {location.uri} is refused: it is outside tenant {self.tenant_id}'s allow-list"
            )
        entry = max(covering, key=lambda e: len(e.prefix))
        if entry.require_approval and location.uri not in self._approved:
            raise SourceNotApproved(
                f"redirect to {location.uri} needs an operator's approval before its first use (lorafleet source approve)"
            )
        return entry


def _detail(entry: SourceEntry) -> dict:
    return {
        "prefix": entry.prefix,
        "tenants": entry.tenants,
        "allow_private": entry.allow_private,
        "require_approval": entry.require_approval,
    }
