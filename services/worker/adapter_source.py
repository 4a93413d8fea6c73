"""The cache's loader from the trusted store: fetch, re-verify, and lay out one adapter version.

It runs on the cache's load threads; the NATS calls it needs are handed to the worker's event
loop, so a slow store never blocks the step loop or the dispatch handler."""

import asyncio
import dataclasses
import time
from dataclasses import dataclass

import nats.errors
import structlog
from nats.aio.client import Client as NATS

from services.worker.adapter_verify import fetch_verified
from services.worker.lora.layout import AdapterWeights, ModelShapes
from services.worker.lora.lora_config import LoraConfig
from services.worker.lora.peft_loader import load_peft_files
from shared import metrics
from shared.adapter_keys import parse_adapter_key
from shared.catalog.view import CatalogView
from shared.errors import IntegrityError, ServiceUnavailable

ATTEMPT_S = 5.0  # one try of a cold load's store reads
RETRY_PAUSE_S = 0.5
# what a try meets while NATS is away or electing: no answer, no responder, a connection reconnecting
RETRIED = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionReconnectingError)
log = structlog.get_logger("worker.adapter_source")


@dataclass(frozen=True, slots=True, eq=False)
class VerifiedFiles:
    """One adapter version's files as fetched and verified, for an engine that loads PEFT files itself (vLLM)."""

    digest: str  # sha256 of adapter_model.safetensors, as the signed record names it
    files: dict[str, bytes]
    rank: int
    modules: frozenset[str]

    @property
    def nbytes(self) -> int:
        return sum(len(data) for data in self.files.values())


class StoreLoader:
    def __init__(
        self,
        nc: NATS,
        catalog: CatalogView,
        loop: asyncio.AbstractEventLoop,
        base_fingerprint: str,
        shapes: ModelShapes,
        lora: LoraConfig,
        *,
        require_signature: bool,
        timeout_s: float = 30.0,
    ):
        self.nc = nc
        self.catalog = catalog
        self.loop = loop
        self.base_fingerprint = base_fingerprint
        self.shapes = shapes
        self.lora = lora
        self.require_signature = require_signature
        self.timeout_s = timeout_s

    def __call__(self, key: str) -> AdapterWeights:
        """The verified weights of ``key`` in slot layout, carrying the digest they were verified against."""
        digest, _, weights = self._verified(key)
        return dataclasses.replace(weights, digest=digest)

    def files(self, key: str) -> VerifiedFiles:
        """The verified files of ``key``, laid out once so the same rank, module and shape checks refuse them."""
        digest, files, weights = self._verified(key)
        return VerifiedFiles(digest, files, weights.rank, weights.modules)

    def _verified(self, key: str) -> tuple[str, dict[str, bytes], AdapterWeights]:
        adapter_id, version = parse_adapter_key(key)
        future = asyncio.run_coroutine_threadsafe(self._fetch(adapter_id, version), self.loop)
        try:
            digest, files = future.result(self.timeout_s + 1.0)  # _fetch bounds itself by timeout_s
        except IntegrityError:
            metrics.INTEGRITY_ERRORS.labels("worker").inc()
            raise
        except TimeoutError:
            future.cancel()
            raise ServiceUnavailable(f"{key}: the adapter store did not answer within {self.timeout_s:g} s") from None
        weights = load_peft_files(
            files, self.shapes, max_rank=self.lora.max_rank, allowed_modules=self.lora.target_modules
        )
        return digest, files, weights

    async def _fetch(self, adapter_id: str, version: int) -> tuple[str, dict[str, bytes]]:
        """The record and the signers from the worker's catalog view (which reads their KV buckets,
        served by NATS itself: no registry replica, dead or stalled, is on a cold load's path), then
        the files. Each try has
        ``ATTEMPT_S``: while a NATS cluster elects new leaders for the buckets of a node that died
        (a few seconds), a JetStream request goes unanswered or finds no responder; it is sent again
        until ``timeout_s`` is spent, instead of waiting out the whole bound once."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            js = self.nc.jetstream(timeout=max(0.1, min(ATTEMPT_S, left)))
            try:
                record = await self.catalog.record(js, adapter_id, version)
                keys = await self.catalog.signers(js, max(0.1, min(ATTEMPT_S, left)))
                files = await fetch_verified(
                    js, record, self.base_fingerprint, keys, require_signature=self.require_signature
                )
                return record.digest, files
            except (*RETRIED, ServiceUnavailable) as e:
                if time.monotonic() + RETRY_PAUSE_S >= deadline:
                    raise ServiceUnavailable(
                        f"{adapter_id} v{version}: the adapter store did not answer within {self.timeout_s:g} s"
                    ) from e
                log.warning("adapter_fetch_retry", adapter_id=adapter_id, version=version, error=type(e).__name__)
                await asyncio.sleep(RETRY_PAUSE_S)
