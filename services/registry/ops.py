"""The registry's operations as plain async methods: the service maps one subject to each.

Every change is written to KV first, then applied to the in-memory catalog, then confirmed by
every live gateway's catalog mirror, then announced (an AdapterEvent and a registry_change audit
record), all under one lock so that lifecycle steps of this replica never interleave.

Replicas: the catalog and the signers follow their KV buckets (a watch), never memory alone, and
every write is a compare-and-set on the revisions it was planned from (``RecordsKV.commit``). A
change another replica beat to one of its records is planned again on the records as they are now
(up to ``COMMIT_ATTEMPTS`` times), so two replicas registering one adapter at once get two
versions, never one twice or one lost, and each push's files lie under a prefix of its own.
"""

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path

import structlog

from services.registry import lifecycle
from services.registry.evaluation import Ask, export_quality, platform_eval
from services.registry.fleet_ranks import RankClasses, default_fleet
from services.registry.gate import GatePolicy, check_release, needs_run, summary
from services.registry.kv import COMMIT_ATTEMPTS, RecordsKV, StaleRecords, contended
from services.registry.push_admission import BaseModelIdentity, IntakePolicy, admit, push_prefix, stored_push
from services.registry.remote_intake import RemoteIntake
from services.registry.signer_ops import Audit, Publish, SignerOps
from services.registry.stores import (
    ApprovedStore,
    Uploads,
    decode_inline,
    is_local_source,
    trusted_source_dir,
)
from shared import subjects
from shared.adapter_format import AdapterBytes, file_digests, read_adapter_dir
from shared.catalog.access import may_use
from shared.catalog.grants import IsolationAttempt
from shared.catalog.records import Catalog, Change, record_key
from shared.catalog.resolve import list_models, resolve
from shared.errors import LorafleetError, ModelNotFound, ServiceUnavailable, SourceTimeout
from shared.eval_set import EVAL_SET_FILE, eval_set_digest, parse_eval_set
from shared.schemas import (
    AdapterEvent,
    AdapterRecord,
    AdapterRecordsReply,
    AttachEvalSetRequest,
    GetAdapterRequest,
    ListAdaptersRequest,
    ListModelsReply,
    ListModelsRequest,
    PromoteRequest,
    RecordEvalRequest,
    RegisterRequest,
    RegistryChangeAudit,
    RejectionAudit,
    ResolveReply,
    ResolveRequest,
    RetireRequest,
    RevokeRequest,
    RollbackRequest,
    RolloutRequest,
    SignerRecord,
    SourceOrigin,
)

log = structlog.get_logger("registry")
SyncViews = Callable[[int], Awaitable[object]]  # wait until every service's catalog view holds a records revision
Askers = Callable[[str, str], Ask]  # (owner tenant, base model) -> how the release gate asks a version an eval item


async def _no_views(_: int) -> None:
    return None


class Registry:
    def __init__(
        self,
        *,
        catalog: Catalog,
        signers: dict[str, SignerRecord],
        kv: RecordsKV,
        approved: ApprovedStore,
        uploads: Uploads,
        base: BaseModelIdentity,
        policy: IntakePolicy,
        trusted_dirs: tuple[Path, ...],
        remote: RemoteIntake,
        publish: Publish,
        audit: Audit,
        gate: GatePolicy = GatePolicy(),
        fleet: Callable[[], RankClasses] = default_fleet,
        sync_views: SyncViews = _no_views,
        askers: Askers | None = None,
    ) -> None:
        self.catalog = catalog
        self.signers = signers
        self._kv = kv
        self._approved = approved
        self._uploads = uploads
        self._base = base
        self._policy = policy
        self._trusted_dirs = trusted_dirs
        self._remote = remote
        self._publish = publish  # adapter events
        self._audit = audit
        self._gate = gate
        self._sync_views = sync_views
        self._askers = askers
        self._fleet = fleet  # the fleet's rank classes now, which a push's rank must fit
        self._lock = asyncio.Lock()
        self._started = int(time.time())
        self._audits: set[asyncio.Task] = set()  # isolation-attempt records being published
        self._revisions: dict[str, int] = {}  # record key -> the bucket revision the catalog holds
        # the signers' ops share this lock: a trust change never interleaves with a push being checked
        self.signer_ops = SignerOps(signers, kv, audit, self._lock)

    def apply_entry(self, key: str, value: bytes | None, revision: int) -> None:
        """One entry of the records bucket's watch (records are never deleted): any replica's write."""
        if value is not None and revision > self._revisions.get(key, 0):
            record = AdapterRecord.model_validate_json(value)
            self.catalog.put(record)
            self._revisions[key] = revision
            export_quality(record)

    async def _refresh(self, adapter_id: str) -> None:
        """One adapter's records and revisions as KV holds them now."""
        for record, revision in await self._kv.load_adapter(adapter_id):
            key = record_key(record.adapter_id, record.version)
            if revision > self._revisions.get(key, 0):
                self.catalog.put(record)
                self._revisions[key] = revision

    async def resolve(self, req: ResolveRequest) -> ResolveReply:
        try:
            return resolve(self.catalog, self._base.name, req.tenant_id, req.model, req.request_key, req.preview)
        except ModelNotFound:
            # audited after the answer goes out: awaiting the audit's publish first would make a
            # foreign adapter's 404 measurably slower than a missing one's, telling them apart
            task = asyncio.create_task(self._audit_foreign_attempt(req))
            self._audits.add(task)
            task.add_done_callback(self._audit_done)
            raise

    def _audit_done(self, task: asyncio.Task) -> None:
        self._audits.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("isolation_audit_failed", error=str(task.exception()))

    async def _audit_foreign_attempt(self, req: ResolveRequest) -> None:
        """A tenant naming another tenant's adapter gets the plain 404, and the attempt is audited."""
        records = self.catalog.versions(req.model.partition("@")[0])
        if not records or any(may_use(r, req.tenant_id) for r in records):
            return
        attempt = RejectionAudit(
            request_id=re.sub(r"[^A-Za-z0-9_.:-]", "-", req.request_key)[:128],
            tenant_id=req.tenant_id,
            service="registry",
            code=IsolationAttempt.code,
            reason=f"tenant {req.tenant_id} asked for {records[0].adapter_id} of another tenant",
            route=req.route,
        )
        await self._audit(attempt)

    async def list_models(self, req: ListModelsRequest) -> ListModelsReply:
        return list_models(self.catalog, self._base.name, req.tenant_id, self._started)

    async def get(self, req: GetAdapterRequest) -> AdapterRecordsReply:
        records = self.catalog.versions(req.adapter_id)
        if req.version is not None:
            records = [r for r in records if r.version == req.version]
        return AdapterRecordsReply(records=records)

    async def adapters(self, req: ListAdaptersRequest) -> AdapterRecordsReply:
        records = [r for a in sorted(self.catalog.adapters()) for r in self.catalog.versions(a)]
        return AdapterRecordsReply(records=[r for r in records if req.tenant_id in (None, r.tenant_id)])

    async def register(self, req: RegisterRequest) -> AdapterRecordsReply:
        """Validate, verify, store, record. A refusal stores nothing, drops the upload and is audited."""
        try:
            if req.source_uri is not None and not is_local_source(req.source_uri):
                record = await self._register_remote(req, req.source_uri)
            else:
                files = await self._read_source(req)
                digests = await asyncio.to_thread(file_digests, files)
                for _ in range(COMMIT_ATTEMPTS):
                    async with self._lock:
                        if (stored := stored_push(self.catalog, req, digests)) is not None:
                            return AdapterRecordsReply(records=[stored])
                        view = self._intake_view(req)
                        prefix = push_prefix(view, req)
                        change = await self._admit(view, req, files, digests, prefix)
                        await self._approved.put(prefix, files)
                        if EVAL_SET_FILE in files:
                            await self._approved.put_eval_set(digests[EVAL_SET_FILE], bytes(files[EVAL_SET_FILE]))
                        if await self._committed([change], req.actor, prefix, files):
                            record = change.after
                            break
                else:
                    raise contended(req.adapter_id)
        except LorafleetError as e:
            refusal = RejectionAudit(
                request_id=f"register.{req.adapter_id}",
                tenant_id=req.tenant_id,
                service="registry",
                code=e.code,
                reason=f"push refused: {e.message}"[:2000],
            )
            await self._audit(refusal)
            raise
        finally:
            if req.upload_id is not None:
                await self._uploads.delete(req.upload_id)
        return AdapterRecordsReply(records=[record])

    async def _register_remote(self, req: RegisterRequest, uri: str) -> AdapterRecord:
        """Fetch (allow-list, approval, limits), then the upload's admission, then the tenant's prefix.
        The fetch runs outside the lock: a slow source never holds up other registry changes."""
        until = None if req.wait_s is None else asyncio.get_running_loop().time() + req.wait_s
        async with self._remote.fetched(uri, req.tenant_id, req.wait_s) as fetched:
            digests = fetched.digests
            for _ in range(COMMIT_ATTEMPTS):
                async with self._locked_until(until, fetched.uri):
                    if (stored := stored_push(self.catalog, req, digests)) is not None:
                        return stored
                    view = self._intake_view(req)
                    prefix = push_prefix(view, req, req.tenant_id)
                    with fetched.mapped() as files:
                        change = await self._admit(view, req, files, digests, prefix, fetched.origin)
                    await self._approved.put(prefix, fetched.paths)
                    reason = f"fetched from {fetched.uri}"[:500]
                    if await self._committed([change], req.actor, prefix, fetched.paths, reason):
                        return change.after
        raise contended(req.adapter_id)

    @contextlib.asynccontextmanager
    async def _locked_until(self, until: float | None, uri: str) -> AsyncIterator[None]:
        """The registry's lock, waited for until loop time ``until`` at most: a fetched push whose caller
        has stopped waiting gives its spool back at once instead of queueing for admission."""
        try:
            async with asyncio.timeout_at(until):
                await self._lock.acquire()
        except TimeoutError:
            raise SourceTimeout(
                f"{uri}: fetched, but its caller stopped waiting before the registry could admit it"
            ) from None
        try:
            yield
        finally:
            self._lock.release()

    async def _admit(
        self,
        view: Catalog,
        req: RegisterRequest,
        files: Mapping[str, AdapterBytes],
        digests: Mapping[str, str],
        prefix: str,
        origin: SourceOrigin | None = None,
    ) -> Change:
        """The push's staging record, its files (of sha256s ``digests``) to lie under ``prefix``. Validation
        reads every tensor: off the event loop, so resolves keep flowing meanwhile."""
        uri = self._approved.uri(prefix)
        return await asyncio.to_thread(
            admit, view, req, files, self._base, self._policy, self.signers, uri, origin,
            digests=digests, fleet=self._fleet(),
        )  # fmt: skip

    async def _committed(
        self, changes: list[Change], actor: str, prefix: str, files: Mapping[str, object], reason: str | None = None
    ) -> bool:
        """Commit a push's record; False (its files removed, the adapter's records read again) when
        another replica took that version first."""
        try:
            await self._commit(changes, actor, reason)
        except StaleRecords as e:
            log.info("push_replanned", adapter=changes[0].after.adapter_id, reason=str(e))
            await self._approved.delete(prefix, files)
            await self._refresh(changes[0].after.adapter_id)
            return False
        return True

    def _intake_view(self, req: RegisterRequest) -> Catalog:
        """A copy of what admission reads of the catalog (the adapter, its aliases' holders): admission
        runs in a thread while the records watch may change the catalog itself."""
        names = {req.adapter_id, *req.aliases}
        names |= {held for alias in req.aliases if (held := self.catalog.alias_owner(req.tenant_id, alias))}
        return Catalog(record for name in names for record in self.catalog.versions(name))

    async def promote(self, req: PromoteRequest) -> AdapterRecordsReply:
        """staging -> canary/production through the release gate: the version's eval set is run on a
        worker first when it has no platform score against today's production. ``skip_eval`` (a platform
        admin's, with a reason) passes it unevaluated, audited."""
        if not req.skip_eval:
            await self.evaluate_for_release(req.adapter_id, req.version)

        def plan() -> list[Change]:
            changes = lifecycle.promote(self.catalog, req.adapter_id, req.version, req.traffic_percent)
            candidate = changes[-1].before
            assert candidate is not None
            if not req.skip_eval:
                check_release(candidate, self.catalog.released(req.adapter_id)[0], self._gate)
            return changes

        candidate = self.catalog.get(req.adapter_id, req.version)
        if req.skip_eval:
            reason = f"eval gate skipped by platform admin {req.actor}: {req.reason}"
        else:
            reason = req.reason or f"release gate passed: {summary(candidate.platform_eval if candidate else None)}"
        return await self._change(req.actor, plan, reason[:500])

    async def evaluate_for_release(self, adapter_id: str, version: int) -> AdapterRecord:
        """The version's record with a platform-run score of its eval set against the production version
        serving now: run on a worker and recorded (with the set's digest) when it has none yet. A version
        without an eval set is returned as it is (the gate decides)."""
        record = self.catalog.get(adapter_id, version)
        if record is None:
            raise ModelNotFound(f"adapter {adapter_id!r} has no version {version}")
        production = self.catalog.released(adapter_id)[0]
        if not needs_run(record, production):
            return record
        if self._askers is None:
            raise ServiceUnavailable("this registry cannot run evaluations (no serving path wired)")
        digest = record.eval_set_digest
        assert digest is not None
        spec = parse_eval_set(await self._approved.eval_set(digest))
        ask = self._askers(record.tenant_id, record.base_model)
        serving = production.version if production is not None else None
        run = await platform_eval(ask, adapter_id, version, spec, digest, serving)
        reply = await self._change(
            "release-gate", lambda: lifecycle.record_platform_eval(self.catalog, adapter_id, version, run), summary(run)
        )
        log.info("platform_eval", adapter_id=adapter_id, version=version, score=run.score, digest=digest[:12])
        return reply.records[0]

    async def attach_eval_set(self, req: AttachEvalSetRequest) -> AdapterRecordsReply:
        """Attach (or replace) a version's eval set, kept by its digest; a tenant admin only to its own
        tenant's versions (another tenant's answers as missing). Audited with the set's digest."""
        data = req.eval_set.encode()
        spec = parse_eval_set(data)
        digest = eval_set_digest(data)
        record = self.catalog.get(req.adapter_id, req.version)
        if record is None or req.tenant_id not in (None, record.tenant_id):
            raise ModelNotFound(f"adapter {req.adapter_id!r} has no version {req.version}")
        await self._approved.put_eval_set(digest, data)
        why = f"eval set {digest[:12]} attached ({len(spec.items)} items, threshold {spec.meta.threshold:.3f})"
        return await self._change(
            req.actor, lambda: lifecycle.attach_eval_set(self.catalog, req.adapter_id, req.version, digest), why
        )

    async def record_eval(self, req: RecordEvalRequest) -> AdapterRecordsReply:
        """Store a client's eval results (replacing earlier ones): advisory only, the gate never reads them."""
        return await self._change(
            req.actor,
            lambda: lifecycle.record_eval(self.catalog, req.adapter_id, req.version, req.results),
            "client-supplied eval results (advisory)",
        )

    async def rollout(self, req: RolloutRequest) -> AdapterRecordsReply:
        return await self._change(
            req.actor, lambda: lifecycle.rollout(self.catalog, req.adapter_id, req.traffic_percent)
        )

    async def rollback(self, req: RollbackRequest) -> AdapterRecordsReply:
        return await self._change(req.actor, lambda: lifecycle.rollback(self.catalog, req.adapter_id), req.reason)

    async def retire(self, req: RetireRequest) -> AdapterRecordsReply:
        return await self._change(req.actor, lambda: lifecycle.retire(self.catalog, req.adapter_id, req.version))

    async def revoke(self, req: RevokeRequest) -> AdapterRecordsReply:
        return await self._change(req.actor, lambda: lifecycle.revoke(self.catalog, req.adapter_id, req.version))

    async def _change(
        self, actor: str, plan: Callable[[], list[Change]], reason: str | None = None
    ) -> AdapterRecordsReply:
        for _ in range(COMMIT_ATTEMPTS):
            async with self._lock:
                changes = plan()
                try:
                    await self._commit(changes, actor, reason)
                except StaleRecords as e:  # planned on records another replica changed since: plan again
                    log.info("change_replanned", adapter=changes[0].after.adapter_id, reason=str(e))
                    await self._refresh(changes[0].after.adapter_id)
                    continue
            return AdapterRecordsReply(records=[c.after for c in changes])
        raise contended(changes[0].after.adapter_id)

    async def reload(self, adapter_id: str) -> None:
        """Take one adapter's records from KV: another replica may have changed them since the watch's last entry."""
        async with self._lock:
            await self._refresh(adapter_id)

    async def _read_source(self, req: RegisterRequest) -> dict[str, bytes]:
        limits = self._policy.limits
        if req.inline_files is not None:
            return decode_inline(req.inline_files)
        if req.upload_id is not None:
            return await self._uploads.read(req.upload_id, limits)
        assert req.source_uri is not None
        return read_adapter_dir(trusted_source_dir(req.source_uri, self._trusted_dirs), limits)

    async def _commit(self, changes: list[Change], actor: str, reason: str | None = None) -> None:
        """Write ``changes`` at once if their records are still as planned from (``StaleRecords`` if
        not), then apply, confirm and announce them."""
        if not changes:
            return
        keys = [record_key(c.after.adapter_id, c.after.version) for c in changes]
        # a new version must still be absent; a changed one at the revision its plan read (the watch
        # may bring another replica's write of that key while this one is planned: it must not pass)
        expected = [0 if c.before is None else self._revisions.get(k, 0) for c, k in zip(changes, keys, strict=True)]
        revisions = await self._kv.commit([(c.after, e) for c, e in zip(changes, expected, strict=True)])
        self.catalog.apply(changes)
        for change in changes:
            export_quality(change.after)
        for key, written in zip(keys, revisions, strict=True):  # this replica's next plan starts from them
            self._revisions[key] = max(self._revisions.get(key, 0), written)
        revision = max(revisions)
        if changes:  # the caller's next request, through any gateway, sees this write
            await self._sync_views(revision)
        for change in changes:
            after = change.after
            event = AdapterEvent(
                kind=change.kind,
                adapter_id=after.adapter_id,
                version=after.version,
                tenant_id=after.tenant_id,
                status=after.status,
                traffic_percent=after.traffic_percent,
                actor=actor,
            )
            await self._publish(subjects.adapter_event(after.adapter_id), event)
            audit = RegistryChangeAudit(
                actor=actor,
                tenant_id=after.tenant_id,
                adapter_id=after.adapter_id,
                version=after.version,
                action=change.kind,
                before=change.before.status if change.before else None,
                after=after.status,
                reason=reason,
            )
            await self._audit(audit)
