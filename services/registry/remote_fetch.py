"""Fetch an adapter's two files from an allow-listed s3:// or https:// source, within hard limits.

Every connection goes to an address resolved and checked here (``check_addresses``), and that
same address is the one connected to: the URL's host is swapped for it, while the Host header,
TLS SNI and certificate check keep the name, so a second DNS answer (rebinding) is never used.
Redirects are followed by hand, each to an allow-listed URL only, re-resolved and re-checked.
Bodies stream to files on disk with per-file and total byte caps; one deadline bounds it all.
S3 requests are path-style against the configured endpoint, signed with botocore's SigV4.
"""

import asyncio
import hashlib
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlencode, urljoin, urlsplit
from xml.etree import ElementTree

import certifi
import httpx
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.session import Session

from services.registry.fetch_bounds import FetchLease
from services.registry.settings import RemoteSourceSettings
from services.registry.source_uri import SourceLocation, check_addresses
from shared.adapter_format import ADAPTER_FILES, CONFIG_FILE, MAX_CONFIG_BYTES
from shared.errors import (
    SourceFetchFailed,
    SourceFileRefused,
    SourceRedirectRefused,
    SourceTimeout,
    SourceTooLarge,
)
from shared.schemas import SourceEntry

Resolver = Callable[[str, int], Awaitable[list[str]]]
RedirectEntry = Callable[[str], SourceEntry]  # the entry admitting a redirect target, or SourceRedirectRefused
CHUNK_BYTES = 1 << 16
LISTING_MAX_BYTES = 1 << 20


async def system_resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True, slots=True)
class FetchedFile:
    path: Path
    size: int
    digest: str  # sha256 hex of the bytes written to ``path``
    etag: str | None


class _Budget:
    """Bytes left for the whole fetch, each also charged to the spool the fetch shares with the others."""

    def __init__(self, total: int, lease: FetchLease) -> None:
        self.left = total
        self.total = total
        self.lease = lease

    def take(self, n: int, uri: str) -> None:
        self.left -= n
        if self.left < 0:
            raise SourceTooLarge(f"{uri}: the source exceeds the fetch's {self.total}-byte total limit")
        self.lease.spool(n, uri)


class RemoteFetcher:
    def __init__(self, settings: RemoteSourceSettings, resolve: Resolver = system_resolve) -> None:
        self._settings = settings
        self._resolve = resolve
        self._tls = ssl.create_default_context(cafile=settings.ca_file or certifi.where())
        self._credentials: Credentials | None = None
        self._credentials_loaded = False

    async def fetch(
        self,
        location: SourceLocation,
        entry: SourceEntry,
        redirect_entry: RedirectEntry,
        into: Path,
        lease: FetchLease,
        timeout_s: float,
    ) -> dict[str, FetchedFile]:
        """Both adapter files of ``location``, written under ``into`` within ``timeout_s`` and charged
        to ``lease``; a typed error otherwise."""
        limits = self._settings
        try:
            async with asyncio.timeout(timeout_s):
                async with httpx.AsyncClient(verify=self._tls, trust_env=False, timeout=timeout_s) as client:
                    budget = _Budget(limits.max_total_bytes, lease)
                    if location.scheme == "s3":
                        return await self._fetch_s3(client, location, entry, into, budget)
                    files = {}
                    for name in ADAPTER_FILES:
                        url = location.file_uri(name)
                        files[name] = await self._download(
                            client, url, entry, redirect_entry, into / name, _cap(name, limits), budget, sign=False
                        )
                    return files
        except TimeoutError:
            raise SourceTimeout(f"{location.uri}: the fetch did not finish within {timeout_s} s") from None

    async def _fetch_s3(
        self, client: httpx.AsyncClient, location: SourceLocation, entry: SourceEntry, into: Path, budget: _Budget
    ) -> dict[str, FetchedFile]:
        listed = await self._s3_list(client, location, entry)
        for name in listed:
            if name not in ADAPTER_FILES:
                raise SourceFileRefused(
                    f"{location.uri} holds {name!r}: only {' and '.join(ADAPTER_FILES)} may be there "
                    "(no pickle, .bin, .pt, code or other files)"
                )
        files = {}
        for name in ADAPTER_FILES:
            if name not in listed:
                raise SourceFileRefused(f"{location.uri} has no {name}")
            cap = _cap(name, self._settings)
            if listed[name] > cap:
                raise SourceTooLarge(f"{location.file_uri(name)}: {listed[name]} bytes exceeds the {cap}-byte limit")
            url = self._s3_url(location.host, location.path.lstrip("/") + name)
            files[name] = await self._download(client, url, entry, _no_redirect, into / name, cap, budget, sign=True)
        return files

    async def _s3_list(self, client: httpx.AsyncClient, location: SourceLocation, entry: SourceEntry) -> dict[str, int]:
        """name under the prefix -> size, refusing a listing longer than max_files."""
        prefix = location.path.lstrip("/")
        query = {"list-type": "2", "max-keys": str(self._settings.max_files + 1), "prefix": prefix}
        url = self._s3_url(location.host, "") + "?" + urlencode(sorted(query.items()), quote_via=quote)
        response = await self._send(client, url, entry.allow_private, sign=True)
        try:
            if response.status_code != 200:
                raise SourceFetchFailed(f"{location.uri}: listing answered HTTP {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_raw(CHUNK_BYTES):
                body += chunk
                if len(body) > LISTING_MAX_BYTES:
                    raise SourceFetchFailed(f"{location.uri}: the listing exceeds {LISTING_MAX_BYTES} bytes")
        finally:
            await response.aclose()
        try:
            root = ElementTree.fromstring(bytes(body))
        except ElementTree.ParseError:
            raise SourceFetchFailed(f"{location.uri}: the listing is not valid XML") from None
        contents = root.findall("{*}Contents")
        if len(contents) > self._settings.max_files or root.findtext("{*}IsTruncated") == "true":
            raise SourceFileRefused(f"{location.uri} lists more than {self._settings.max_files} objects")
        listed: dict[str, int] = {}
        for item in contents:
            key, size = item.findtext("{*}Key") or "", item.findtext("{*}Size") or ""
            if not key.startswith(prefix) or not size.isdigit():
                raise SourceFetchFailed(f"{location.uri}: the listing holds a malformed entry")
            listed[key[len(prefix) :]] = int(size)
        return listed

    def _s3_url(self, bucket: str, key: str) -> str:
        return f"{self._settings.s3_endpoint_url.rstrip('/')}/{bucket}/{quote(key)}"

    async def _download(
        self,
        client: httpx.AsyncClient,
        url: str,
        entry: SourceEntry,
        redirect_entry: RedirectEntry,
        sink: Path,
        cap: int,
        budget: _Budget,
        *,
        sign: bool,
    ) -> FetchedFile:
        for _ in range(self._settings.max_redirects + 1):
            response = await self._send(client, url, entry.allow_private, sign=sign)
            try:
                if response.is_redirect:
                    url = urljoin(url, response.headers["location"])
                    entry = redirect_entry(url)
                    continue
                if response.status_code != 200:
                    raise SourceFetchFailed(f"{_display(url)}: HTTP {response.status_code}")
                return await _stream(response, url, sink, cap, budget)
            finally:
                await response.aclose()
        raise SourceRedirectRefused(f"{_display(url)}: more than {self._settings.max_redirects} redirects")

    async def _send(self, client: httpx.AsyncClient, url: str, allow_private: bool, *, sign: bool) -> httpx.Response:
        target = httpx.URL(url)
        port = target.port or (443 if target.scheme == "https" else 80)
        addresses = await self._resolve(target.host, port)
        check_addresses(target.host, addresses, allow_private)
        headers = {"Host": target.netloc.decode("ascii"), "Accept-Encoding": "identity"}
        if sign:
            headers.update(await self._sign(url))
        pinned = target.copy_with(host=addresses[0])
        request = client.build_request("GET", pinned, headers=headers, extensions={"sni_hostname": target.host})
        try:
            return await client.send(request, stream=True)
        except httpx.TransportError as e:
            raise SourceFetchFailed(f"{_display(url)}: {type(e).__name__}: {e}"[:500]) from None

    async def _sign(self, url: str) -> dict[str, str]:
        """SigV4 headers for a GET of ``url`` (none when no AWS credentials are configured)."""
        if not self._credentials_loaded:
            self._credentials = await asyncio.to_thread(Session().get_credentials)
            self._credentials_loaded = True
        if self._credentials is None:
            return {}
        frozen = await asyncio.to_thread(self._credentials.get_frozen_credentials)
        request = AWSRequest(method="GET", url=url, headers={})
        S3SigV4Auth(frozen, "s3", self._settings.s3_region).add_auth(request)
        return {k: str(v) for k, v in request.headers.items()}


async def _stream(response: httpx.Response, url: str, sink: Path, cap: int, budget: _Budget) -> FetchedFile:
    """The body into ``sink`` chunk by chunk, hashed on the way; never held whole in memory."""
    if response.headers.get("content-encoding", "identity").lower() not in ("identity", ""):
        raise SourceFetchFailed(f"{_display(url)}: content-encoding {response.headers['content-encoding']!r} refused")
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise SourceTooLarge(f"{_display(url)}: {declared} bytes exceeds the {cap}-byte per-file limit")
    digest, size = hashlib.sha256(), 0
    with sink.open("xb") as out:
        # each read as it arrives (httpcore reads at most 64 KiB): on disk and charged at once, never buffered
        async for chunk in response.aiter_raw():
            size += len(chunk)
            if size > cap:
                raise SourceTooLarge(f"{_display(url)}: exceeds the {cap}-byte per-file limit")
            budget.take(len(chunk), _display(url))
            digest.update(chunk)
            out.write(chunk)
            out.flush()  # the spool on disk is what the quota charged, not less
    return FetchedFile(path=sink, size=size, digest=digest.hexdigest(), etag=response.headers.get("etag"))


def _cap(name: str, settings: RemoteSourceSettings) -> int:
    return min(settings.max_file_bytes, MAX_CONFIG_BYTES) if name == CONFIG_FILE else settings.max_file_bytes


def _no_redirect(url: str) -> SourceEntry:
    raise SourceRedirectRefused(f"{_display(url)}: an S3 source is never redirected")


def _display(url: str) -> str:
    """The URL without its query (a signed or presigned query carries credentials)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"
