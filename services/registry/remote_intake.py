"""A register request's remote ``source_uri``: enabled? allow-listed for this tenant? approved?
then fetched into a private temporary directory, for the same admission as an upload.

The fetched files are never shared between requests: each register fetches anew, and what it
admits is stored under the pushing tenant's own prefix, so another tenant naming the same URI
gets its own fetch, its own check and its own copy.
"""

import contextlib
import mmap
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

from services.registry.fetch_bounds import FetchBounds
from services.registry.remote_fetch import FetchedFile, RemoteFetcher
from services.registry.settings import RemoteSourceSettings
from services.registry.source_uri import parse_source
from services.registry.sources import Sources
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE, AdapterBytes
from shared.errors import RemoteSourceDisabled
from shared.schemas import SourceOrigin


@dataclass(frozen=True, slots=True)
class FetchedAdapter:
    uri: str  # canonical
    files: dict[str, FetchedFile]

    @property
    def origin(self) -> SourceOrigin:
        etags = {name: f.etag for name, f in self.files.items() if f.etag is not None}
        return SourceOrigin(uri=self.uri, etags=etags)

    @property
    def digests(self) -> dict[str, str]:
        """File name -> sha256 hex, hashed as the fetch streamed each file to disk."""
        return {name: f.digest for name, f in self.files.items()}

    @property
    def paths(self) -> dict[str, Path]:
        return {name: f.path for name, f in self.files.items()}

    @contextlib.contextmanager
    def mapped(self) -> Iterator[dict[str, AdapterBytes]]:
        """The files as admission reads them: the small config in memory, the weights mapped
        read-only from disk (the page cache holds them, not the heap)."""
        config = self.files[CONFIG_FILE].path.read_bytes()
        with self.files[WEIGHTS_FILE].path.open("rb") as f:
            weights = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.files[WEIGHTS_FILE].size else b""
        try:
            yield {CONFIG_FILE: config, WEIGHTS_FILE: weights}
        finally:
            if isinstance(weights, mmap.mmap):
                # a refusal's traceback may still hold a numpy view of the map; it unmaps when freed
                with contextlib.suppress(BufferError):
                    weights.close()


class RemoteIntake:
    def __init__(self, settings: RemoteSourceSettings, sources: Sources, fetcher: RemoteFetcher) -> None:
        self._settings = settings
        self._sources = sources
        self._fetcher = fetcher
        self._bounds = FetchBounds(settings)

    @contextlib.asynccontextmanager
    async def fetched(self, uri: str, tenant_id: str, wait_s: float | None = None) -> AsyncIterator[FetchedAdapter]:
        """The adapter at ``uri`` on disk for the block's duration; a typed refusal otherwise. The fetch
        ends by the registry's time limit, or by ``wait_s`` when the caller waits less: a fetch whose
        answer nobody awaits is cancelled, and its spool deleted, when the caller gives up."""
        location = parse_source(uri)
        enabled = self._settings.s3_enabled if location.scheme == "s3" else self._settings.https_enabled
        if not enabled:
            variable = f"LF_REMOTE__{location.scheme.upper()}_ENABLED"
            raise RemoteSourceDisabled(f"this registry does not fetch {location.scheme}:// sources ({variable} is off)")
        grant = await self._sources.authorize(location, tenant_id)
        timeout_s = min(self._settings.timeout_s, wait_s or self._settings.timeout_s)
        with (
            self._bounds.lease(tenant_id, timeout_s) as lease,
            tempfile.TemporaryDirectory(prefix="lf-fetch-", dir=self._settings.spool_dir) as spool,
        ):
            files = await self._fetcher.fetch(
                location, grant.entry, grant.redirect_entry, Path(spool), lease, timeout_s
            )
            yield FetchedAdapter(uri=location.uri, files=files)
