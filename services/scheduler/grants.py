"""A submission's adapter must be the registry's record of that version, one its tenant may use.

The gateway fills ``InferRequest.adapter`` from the registry's resolve; a direct-NATS client
writes it itself, so the scheduler checks it before anything is queued or loaded."""

from collections import OrderedDict
from collections.abc import Awaitable, Callable

from shared.access import may_use
from shared.errors import Forbidden, IntegrityError, ModelNotFound
from shared.schemas import AdapterRecord, InferRequest

FetchRecord = Callable[[str, int], Awaitable[AdapterRecord]]  # raises ModelNotFound when there is no such version
CACHE_LIMIT = 10_000


class IsolationAttempt(Forbidden):
    """A tenant named another tenant's adapter. Audited under this code; the client gets ``answer``,
    the same model_not_found as for a missing adapter, so it learns nothing."""

    code = "tenant_isolation_attempt"

    def __init__(self, message: str, answer: ModelNotFound):
        super().__init__(message)
        self.answer = answer


class Grants:
    def __init__(self, fetch: FetchRecord):
        self._fetch = fetch
        self._records: OrderedDict[tuple[str, int], AdapterRecord] = OrderedDict()

    async def _record(self, adapter_id: str, version: int) -> AdapterRecord:
        """The registry's record; cached, since what is checked here never changes for a version."""
        key = (adapter_id, version)
        if key not in self._records:
            self._records[key] = await self._fetch(adapter_id, version)
            while len(self._records) > CACHE_LIMIT:
                self._records.popitem(last=False)
        return self._records[key]

    async def check(self, request: InferRequest) -> None:
        """Raise unless the request's adapter (if any) is exactly one its tenant was granted."""
        adapter = request.adapter
        if adapter is None:
            return
        not_found = ModelNotFound(
            f"The model '{request.model}' does not exist or you do not have access to it.", param="model"
        )
        try:
            record = await self._record(adapter.adapter_id, adapter.version)
        except ModelNotFound:
            raise not_found from None
        if not may_use(record, request.tenant_id):
            raise IsolationAttempt(
                f"tenant {request.tenant_id} submitted {adapter.adapter_id} of another tenant", not_found
            )
        registry = (record.rank, record.checksum, record.storage_uri, record.alpha, record.use_rslora)
        if (adapter.rank, adapter.digest, adapter.storage_uri, adapter.alpha, adapter.use_rslora) != registry:
            raise IntegrityError(
                f"{adapter.adapter_id} v{adapter.version}: the request's adapter is not the "
                "registry's record of that version"
            )
