"""A copy of the registry's adapter catalog, and resolution from it: the gateway's, and the
scheduler's (which resolves direct-NATS submissions exactly as the gateway resolves HTTP ones).

A watch on the registry's records bucket (``shared.kv_follow``) keeps ``CatalogMirror`` equal to
the registry's own catalog (every change is written to that bucket before the registry applies
it), so a request is resolved in microseconds instead of a registry round trip (~1.5 ms on the
request's path to its first token). Only successes are answered locally: any refusal (unknown, foreign,
unreleased, revoked) is asked of the registry, which holds the newest state and audits an
attempt on another tenant's adapter. The registry's writes wait for every live gateway's mirror
to confirm them (``catalog.sync``), so once a promote, rollback or revoke has returned, no
gateway resolves with the state before it.
"""

import asyncio
from collections.abc import Awaitable, Callable

from shared import metrics
from shared.catalog import Catalog
from shared.errors import LorafleetError
from shared.resolve import resolve
from shared.schemas import AdapterRecord, ResolveReply, ResolveRequest

AskRegistry = Callable[[ResolveRequest], Awaitable[ResolveReply]]


class CatalogMirror:
    def __init__(self) -> None:
        self.catalog = Catalog()
        self.loaded = False
        self.revision = 0  # the last bucket revision applied
        self.base_model: str | None = None  # learnt from the registry's first answer
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def apply(self, key: str, value: bytes | None, revision: int) -> None:
        """One watched entry. Records are never deleted (a retired version keeps its record)."""
        if value is not None:
            self.catalog.put(AdapterRecord.model_validate_json(value))
        self.revision = max(self.revision, revision)
        self._wake()

    def mark_loaded(self) -> None:
        self.loaded = True
        self._wake()

    def _wake(self) -> None:
        if not self.loaded:
            return
        waiting = []
        for revision, future in self._waiters:
            if self.revision >= revision:
                if not future.done():
                    future.set_result(None)
            else:
                waiting.append((revision, future))
        self._waiters = waiting

    async def caught_up(self, revision: int, timeout_s: float) -> bool:
        """Whether the mirror holds ``revision`` (waiting up to ``timeout_s`` for the watch to bring it)."""
        if self.loaded and self.revision >= revision:
            return True
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((revision, future))
        try:
            await asyncio.wait_for(future, timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            self._waiters = [(r, f) for r, f in self._waiters if f is not future]


class Resolver:
    def __init__(self, mirror: CatalogMirror, ask_registry: AskRegistry) -> None:
        self.mirror = mirror
        self._ask = ask_registry

    async def resolve(self, req: ResolveRequest, ask_registry: bool = False) -> ResolveReply:
        """From the mirror when it resolves; the registry's answer for a refusal, or with
        ``ask_registry`` (a mirror may lag the registry by a watch delivery)."""
        mirror = self.mirror
        if mirror.loaded and mirror.base_model is not None and not ask_registry:
            try:
                reply = resolve(
                    mirror.catalog, mirror.base_model, req.tenant_id, req.model, req.request_key, req.preview
                )
                metrics.GATEWAY_RESOLVES.labels("mirror").inc()
                return reply
            except LorafleetError:
                pass  # the registry answers (and audits) every refusal
        reply = await self._ask(req)
        metrics.GATEWAY_RESOLVES.labels("registry").inc()
        mirror.base_model = reply.base_model
        return reply
