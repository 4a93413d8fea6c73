"""Remote fetches at their limits and with hostile content: redirects, sizes, time, internal
addresses, untrusted certificates, tampered bytes, pickles and stray files. Each is one typed
refusal that stores nothing and is audited."""

import time

import pytest

from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.errors import (
    IntegrityError,
    SourceAddressRefused,
    SourceFetchFailed,
    SourceFileRefused,
    SourceRedirectRefused,
    SourceTimeout,
    SourceTooLarge,
)
from tests.helpers.remote_sources import Route
from tests.registry.remote.support import (
    HOSTS,
    MAX_FILE,
    MAX_FILES,
    MAX_TOTAL,
    TIMEOUT_S,
    Files,
    Push,
    Servers,
    allow,
    tampered,
    unique,
)

# ---- limits ------------------------------------------------------------------------------------


async def test_a_redirect_off_the_allow_list_is_refused(push: Push, servers: Servers, adapter_files: Files) -> None:
    base, path = servers.https.url("models.test"), f"/{push.tenant}/redir/"
    servers.https.routes[path + CONFIG_FILE] = Route(status=302, location=f"{servers.https.url('localhost')}/elsewhere")
    await allow(push.nc, f"{base}/{push.tenant}/", [push.tenant])
    error = await push.refused(unique("redir"), base + path, adapter_files, SourceRedirectRefused)
    assert "outside tenant" in error.message
    assert servers.https.hits["/elsewhere"] == 0


async def test_a_redirect_loop_stops_at_the_redirect_limit(push: Push, servers: Servers, adapter_files: Files) -> None:
    base, path = servers.https.url("models.test"), f"/{push.tenant}/loop/"
    servers.https.routes[path + CONFIG_FILE] = Route(status=302, location=base + path + CONFIG_FILE)
    await allow(push.nc, f"{base}/{push.tenant}/", [push.tenant])
    error = await push.refused(unique("loop"), base + path, adapter_files, SourceRedirectRefused)
    assert "more than 3 redirects" in error.message


@pytest.mark.parametrize("case", ["s3-file", "https-file", "https-file-unsized", "https-total"])
async def test_oversize_sources_are_refused(push: Push, servers: Servers, adapter_files: Files, case: str) -> None:
    big = {CONFIG_FILE: adapter_files[CONFIG_FILE], WEIGHTS_FILE: b"\0" * (MAX_FILE + 1)}
    if case == "s3-file":
        servers.s3.put_dir("models", f"{push.tenant}/big/", big)
        await allow(push.nc, f"s3://models/{push.tenant}/", [push.tenant])
        uri = f"s3://models/{push.tenant}/big/"
    else:
        base, path = servers.https.url("models.test"), f"/{push.tenant}/{case}/"
        if case == "https-total":  # each file under its cap, both together over the total
            big = {CONFIG_FILE: b" " * (MAX_TOTAL - MAX_FILE + 1000), WEIGHTS_FILE: b"\0" * (MAX_FILE - 10)}
        for name, data in big.items():
            servers.https.routes[path + name] = Route(data, unsized=case == "https-file-unsized")
        await allow(push.nc, f"{base}/{push.tenant}/", [push.tenant])
        uri = base + path
    error = await push.refused(unique("big"), uri, big, SourceTooLarge)
    assert (
        "total limit" if case == "https-total" else "per-file limit" if "https" in case else "-byte limit"
    ) in error.message


async def test_a_slow_drip_is_cut_at_the_time_limit(push: Push, servers: Servers, adapter_files: Files) -> None:
    base, path = servers.https.url("models.test"), f"/{push.tenant}/drip/"
    servers.https.routes[path + CONFIG_FILE] = Route(adapter_files[CONFIG_FILE], drip_s=0.05)  # ~50 s in all
    await allow(push.nc, f"{base}/{push.tenant}/", [push.tenant])
    started = time.monotonic()
    error = await push.refused(unique("drip"), base + path, adapter_files, SourceTimeout)
    assert f"within {TIMEOUT_S} s" in error.message
    assert time.monotonic() - started < TIMEOUT_S + 20  # cut at the limit, not at the drip's end


@pytest.mark.parametrize("host", ["internal.test", "localhost"])
async def test_a_host_resolving_to_an_internal_address_is_refused(
    push: Push, servers: Servers, adapter_files: Files, host: str
) -> None:
    base, path = servers.https.url(host), f"/{push.tenant}/ssrf/"
    servers.https.routes[path + CONFIG_FILE] = Route(adapter_files[CONFIG_FILE])
    await allow(push.nc, f"{base}/{push.tenant}/", [push.tenant], private=False)
    error = await push.refused(unique("ssrf"), base + path, adapter_files, SourceAddressRefused)
    assert HOSTS.get(host, "127.0.0.1") in error.message
    assert servers.https.hits[path + CONFIG_FILE] == 0  # refused before any connection


async def test_a_certificate_from_an_untrusted_ca_is_refused(
    push: Push, servers: Servers, adapter_files: Files
) -> None:
    base, path = servers.stranger.url("models.test"), f"/{push.tenant}/mitm/"
    servers.stranger.routes[path + CONFIG_FILE] = Route(adapter_files[CONFIG_FILE])
    await allow(push.nc, f"{base}/{push.tenant}/", [push.tenant])
    error = await push.refused(unique("mitm"), base + path, adapter_files, SourceFetchFailed)
    assert "CERTIFICATE_VERIFY_FAILED" in error.message


# ---- content: the same admission as an upload -------------------------------------------------


async def test_bytes_tampered_after_signing_are_refused(push: Push, servers: Servers, adapter_files: Files) -> None:
    key = f"{push.tenant}/tampered/"
    servers.s3.put_dir("models", key, tampered(adapter_files))
    await allow(push.nc, f"s3://models/{push.tenant}/", [push.tenant])
    error = await push.refused(unique("tampered"), f"s3://models/{key}", adapter_files, IntegrityError)
    assert "signature" in error.message


@pytest.mark.parametrize("case", ["names-a-pickle", "pickle-beside", "pickle-as-weights", "extra-file", "too-many"])
async def test_pickles_and_extra_files_are_refused(
    push: Push, servers: Servers, adapter_files: Files, case: str, pickle_bytes: bytes
) -> None:
    key = f"{push.tenant}/{case}/"
    layout = {
        "names-a-pickle": {"adapter_model.bin": pickle_bytes, CONFIG_FILE: adapter_files[CONFIG_FILE]},
        "pickle-beside": {**adapter_files, "adapter_model.bin": pickle_bytes},
        "pickle-as-weights": {**adapter_files, WEIGHTS_FILE: pickle_bytes},
        "extra-file": {**adapter_files, "README.md": b"# hi"},
        "too-many": {**adapter_files, "a/x": b"1", "a/y": b"2", "a/z": b"3"},
    }[case]
    servers.s3.put_dir("models", key, layout)
    await allow(push.nc, f"s3://models/{push.tenant}/", [push.tenant])
    uri = f"s3://models/{key}" + ("adapter_model.bin" if case == "names-a-pickle" else "")
    expected = IntegrityError if case == "pickle-as-weights" else SourceFileRefused
    error = await push.refused(unique("pkl"), uri, adapter_files, expected)
    message = {
        "names-a-pickle": "names a file",
        "pickle-beside": "holds 'adapter_model.bin'",
        "pickle-as-weights": "header length",
        "extra-file": "holds 'README.md'",
        "too-many": f"lists more than {MAX_FILES} objects",
    }[case]
    assert message in error.message


@pytest.fixture
def pickle_bytes() -> bytes:
    return b"\x80\x04\x95\x1a\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94\x8c\x06system\x94\x93\x94\x8c\x02id\x94\x85\x94R\x94."
