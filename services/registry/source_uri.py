"""Remote source URIs in one canonical form, matched against allow-listed prefixes, and the
address check that keeps a fetch off internal networks.

A source URI names the adapter's directory: ``s3://bucket/prefix/`` or ``https://host/path/``.
Anything that could make two spellings of one location compare differently (percent escapes,
``.``/``..`` segments, empty segments, user info, a query) is refused, so prefix matching on the
canonical string is exact.
"""

import ipaddress
import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from shared.adapter_format import ADAPTER_FILES
from shared.errors import InvalidRequest, SourceAddressRefused, SourceFileRefused

Scheme = Literal["s3", "https"]
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_HOST = re.compile(r"^[a-z0-9.-]{1,253}$|^\[[0-9a-f:.]+\]$")
_SEGMENT = re.compile(r"^[A-Za-z0-9._~!$&'()*+,;=:@-]+$")
# a last segment that names a file, not a directory: the weights in a refused format, or any adapter file
_FILE_NAME = re.compile(r"\.(bin|pt|pth|pkl|pickle|ckpt|safetensors|json|py|h5|msgpack|onnx|gguf|npz|zip|tar|gz)$")


@dataclass(frozen=True, slots=True)
class SourceLocation:
    scheme: Scheme
    host: str  # the bucket for s3, else the lower-cased host (IPv6 in brackets)
    port: int | None
    path: str  # "/", or "/a/b/": always begins and ends with "/"

    @property
    def uri(self) -> str:
        port = f":{self.port}" if self.port is not None else ""
        return f"{self.scheme}://{self.host}{port}{self.path}"

    def file_uri(self, name: str) -> str:
        return f"{self.uri}{name}"


def parse_source(uri: str) -> SourceLocation:
    """The canonical location of a source URI, or a typed refusal. A URI that names a file
    (``.../adapter_model.bin``) rather than the adapter's directory is refused."""
    if any(c.isspace() or ord(c) < 0x20 or c in "\\%" for c in uri):
        raise InvalidRequest(f"source {uri!r} is refused: no whitespace, control characters, '\\' or '%' escapes")
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in ("s3", "https"):
        raise InvalidRequest(f"source {uri!r} is refused: a remote source is s3://bucket/prefix/ or https://host/path/")
    if parts.query or parts.fragment or "?" in uri or "#" in uri:
        raise InvalidRequest(f"source {uri!r} is refused: no query or fragment")
    if "@" in parts.netloc:
        raise InvalidRequest(f"source {uri!r} is refused: no user info in the URI")
    try:
        port = parts.port
    except ValueError:
        raise InvalidRequest(f"source {uri!r} has an invalid port") from None
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    if scheme == "s3" and (port is not None or not _BUCKET.match(host)):
        raise InvalidRequest(f"source {uri!r} does not name a valid bucket")
    if scheme == "https" and not _HOST.match(host):
        raise InvalidRequest(f"source {uri!r} does not name a valid host")
    segments = parts.path.split("/")[1:] if parts.path else []
    if segments and segments[-1] == "":
        segments.pop()
    elif segments and _FILE_NAME.search(segments[-1]):
        raise SourceFileRefused(
            f"source {uri!r} names a file: a source is the directory holding {' and '.join(ADAPTER_FILES)}, "
            "and nothing else is read (no pickle, .bin or .pt files)"
        )
    for segment in segments:
        if segment in ("", ".", "..") or not _SEGMENT.match(segment):
            raise InvalidRequest(f"source {uri!r} is refused: path segment {segment!r} is not allowed")
    path = "/" + "".join(f"{s}/" for s in segments)
    return SourceLocation(scheme=scheme, host=host, port=port, path=path)  # type: ignore[arg-type]


def covers(prefix: SourceLocation, location: SourceLocation) -> bool:
    """The prefix names the location's directory or one above it."""
    return location.uri.startswith(prefix.uri)


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
# RFC 8215 local-use NAT64: internal by definition; read as its usual /96 prefix (the IPv4 in the last 32 bits)
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")
_SIIT = ipaddress.IPv6Network("::ffff:0:0:0/96")
_COMPATIBLE = ipaddress.IPv6Network("::/96")


def embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses a translator or tunnel would deliver a connection to ``address`` to: IPv4-mapped,
    SIIT, IPv4-compatible, NAT64 (well-known and local-use prefixes), 6to4 and Teredo (server and client)."""
    if address.ipv4_mapped is not None:
        return [address.ipv4_mapped]
    if any(address in net for net in (_NAT64, _NAT64_LOCAL, _SIIT)) or (address in _COMPATIBLE and int(address) > 1):
        return [ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)]
    if address.sixtofour is not None:
        return [address.sixtofour]
    if address.teredo is not None:
        return list(address.teredo)
    return []


def check_addresses(host: str, addresses: list[str], allow_private: bool) -> None:
    """Refuse the host unless every address it resolved to is a public unicast one; an entry with
    ``allow_private`` also admits loopback, private and link-local (never unspecified or multicast).
    An IPv6 address that embeds IPv4 ones is judged by each of them, as that IPv4 address would be."""
    if not addresses:
        raise SourceAddressRefused(f"{host} resolved to no address")
    for text in addresses:
        address = ipaddress.ip_address(text.split("%")[0])
        inner = embedded_ipv4(address) if isinstance(address, ipaddress.IPv6Address) else []
        if address in _NAT64_LOCAL and not allow_private:
            raise SourceAddressRefused(
                f"{host} resolves to {address}, a local-use NAT64 address (an internal network); "
                "only an allow-list entry with allow_private may fetch from it"
            )
        for embedded in inner:
            _check_one(host, embedded, f"{embedded} (embedded in {address})", allow_private)
        if not inner:
            _check_one(host, address, str(address), allow_private)


def _check_one(
    host: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address, shown: str, allow_private: bool
) -> None:
    if address.is_unspecified or address.is_multicast:
        raise SourceAddressRefused(f"{host} resolves to {shown}, which is never fetched from")
    if not address.is_global and not allow_private:
        raise SourceAddressRefused(
            f"{host} resolves to the internal address {shown} (loopback, private, link-local or reserved); "
            "only an allow-list entry with allow_private may fetch from it"
        )
