"""Canonical source URIs, the prefixes an allow-list entry covers, and the address check: no server."""

import ipaddress
import re

import pytest

from services.registry.source_uri import check_addresses, covers, parse_source
from shared.errors import (
    InvalidRequest,
    LorafleetError,
    SourceAddressRefused,
    SourceFileRefused,
)

# ---- canonical URIs and the address check, no server ------------------------------------------


@pytest.mark.parametrize(
    "uri, canonical",
    [
        ("s3://models/acme/sum", "s3://models/acme/sum/"),
        ("S3://models/acme/sum/", "s3://models/acme/sum/"),
        ("https://Hub.Example:8443/a/b/", "https://hub.example:8443/a/b/"),
        ("https://hub.example", "https://hub.example/"),
    ],
)
def test_source_uris_have_one_canonical_form(uri: str, canonical: str) -> None:
    assert parse_source(uri).uri == canonical


@pytest.mark.parametrize(
    "uri, error",
    [
        ("http://hub.example/a/", InvalidRequest),
        ("file:///etc/", InvalidRequest),
        ("org/model-lora", InvalidRequest),
        ("https://hub.example/a/../b/", InvalidRequest),
        ("https://hub.example/a/%2e%2e/b/", InvalidRequest),
        ("https://hub.example/a//b/", InvalidRequest),
        ("https://user:pw@hub.example/a/", InvalidRequest),
        ("https://hub.example/a/?x=1", InvalidRequest),
        ("s3://Bad_Bucket/a/", InvalidRequest),
        ("s3://models/acme/adapter_model.bin", SourceFileRefused),
        ("https://hub.example/acme/pytorch_model.pt", SourceFileRefused),
        ("s3://models/acme/adapter_model.safetensors", SourceFileRefused),
    ],
)
def test_ambiguous_or_file_naming_uris_are_refused(uri: str, error: type[LorafleetError]) -> None:
    with pytest.raises(error) as refused:
        parse_source(uri)
    assert type(refused.value) is error


def test_a_prefix_covers_only_its_own_directories() -> None:
    prefix = parse_source("https://models.internal/acme/")
    assert covers(prefix, parse_source("https://models.internal/acme/sum/"))
    assert not covers(prefix, parse_source("https://models.internal.evil/acme/sum/"))
    assert not covers(prefix, parse_source("https://models.internal/acme-other/sum/"))
    assert not covers(prefix, parse_source("https://models.internal:8443/acme/sum/"))


@pytest.mark.parametrize(
    "address", ["127.0.0.1", "10.0.0.7", "172.16.3.4", "192.168.1.1", "169.254.169.254", "100.64.0.1", "::1", "fe80::1",
                "fd00::1", "::ffff:10.0.0.1", "::ffff:127.0.0.1"],
)  # fmt: skip
def test_internal_addresses_are_refused_unless_the_entry_allows_private(address: str) -> None:
    with pytest.raises(SourceAddressRefused, match="internal address"):
        check_addresses("h", [address], allow_private=False)
    check_addresses("h", [address], allow_private=True)


def test_unspecified_and_multicast_are_refused_even_with_allow_private() -> None:
    for address in ("0.0.0.0", "::", "224.0.0.1"):
        with pytest.raises(SourceAddressRefused):
            check_addresses("h", [address], allow_private=True)
    check_addresses("h", ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"], allow_private=False)
    with pytest.raises(SourceAddressRefused):  # one internal answer among public ones is enough
        check_addresses("h", ["93.184.216.34", "10.0.0.1"], allow_private=False)
    assert ipaddress.ip_address("93.184.216.34").is_global


# IPv6 forms that carry an IPv4 address a translator or tunnel delivers to (issue 47, LOW)
EMBEDDED = [
    pytest.param("64:ff9b::a00:1", "10.0.0.1", id="nat64"),
    pytest.param("64:ff9b::a9fe:a9fe", "169.254.169.254", id="nat64-metadata"),
    pytest.param("2002:7f00:1::", "127.0.0.1", id="6to4"),
    pytest.param("2002:c0a8:101:1::1", "192.168.1.1", id="6to4-host"),
    pytest.param("::a00:1", "10.0.0.1", id="ipv4-compatible"),
    pytest.param("::ffff:a9fe:a9fe", "169.254.169.254", id="ipv4-mapped"),
    pytest.param("::ffff:0:a00:1", "10.0.0.1", id="siit"),
    pytest.param("::ffff:0:7f00:1", "127.0.0.1", id="siit-loopback"),
]  # fmt: skip


@pytest.mark.parametrize("address, inner", EMBEDDED)
def test_an_ipv6_address_embedding_an_internal_ipv4_one_is_refused(address: str, inner: str) -> None:
    with pytest.raises(SourceAddressRefused, match=rf"internal address {re.escape(inner)} \(embedded in "):
        check_addresses("h", [address], allow_private=False)
    check_addresses("h", [address], allow_private=True)


@pytest.mark.parametrize(
    "address",
    ["64:ff9b::e000:1", "64:ff9b:1::0", "2002:e000:1::", "::e000:1", "::ffff:0:0:0", "::ffff:0:e000:1",
     "2001:0:4136:e378:8000:63bf:1fff:fffe", "2001:0:0:0:8000:63bf:a2b4:2dcd"],
)  # fmt: skip
def test_an_embedded_unspecified_or_multicast_address_is_refused_even_with_allow_private(address: str) -> None:
    with pytest.raises(SourceAddressRefused, match=r"embedded in .* which is never fetched from"):
        check_addresses("h", [address], allow_private=True)


def test_local_use_nat64_is_internal_and_public_embedded_addresses_pass() -> None:
    with pytest.raises(SourceAddressRefused, match="local-use NAT64"):
        check_addresses("h", ["64:ff9b:1::5db8:d822"], allow_private=False)
    check_addresses("h", ["64:ff9b:1::5db8:d822"], allow_private=True)
    with pytest.raises(SourceAddressRefused, match=r"internal address 192\.0\.2\.45"):  # a Teredo client in TEST-NET-1
        check_addresses("h", ["2001:0:4136:e378:8000:63bf:3fff:fdd2"], allow_private=False)
    # 93.184.216.34 reached through NAT64, 6to4, SIIT and IPv4-mapped: as public as itself
    check_addresses("h", ["64:ff9b::5db8:d822", "2002:5db8:d822::1", "::ffff:0:5db8:d822"], allow_private=False)
