"""Canonical source URIs, the prefixes an allow-list entry covers, and the address check: no server."""

import ipaddress

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
