"""Fixtures of the remote-source tests; their helpers are in support.py."""

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from services.registry.push_admission import BaseModelIdentity
from services.registry.settings import RemoteSourceSettings
from shared.bus import connect
from shared.schemas import TrustedKeysReply, TrustKeyRequest
from shared.signing import KeyPair
from tests.helpers.remote_sources import HttpsServer, MotoS3, aws_env, make_ca
from tests.registry.remote.support import (
    MAX_FILE,
    MAX_FILES,
    MAX_TOTAL,
    TIMEOUT_S,
    Push,
    Servers,
    call,
    start_registry,
    unique,
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    root = tmp_path_factory.mktemp("remote")
    ca = make_ca(root / "ca")
    with aws_env():
        running = Servers(MotoS3(), HttpsServer(ca), ca, HttpsServer(make_ca(root / "other-ca")))
        try:
            yield running
        finally:
            running.s3.stop()
            running.https.stop()
            running.stranger.stop()


@pytest.fixture
async def remote_registry(nats_url: str, base_dir: Path, servers: Servers) -> AsyncIterator[NATS]:
    remote = RemoteSourceSettings(
        s3_enabled=True,
        https_enabled=True,
        ca_file=str(servers.ca.ca_file),
        s3_endpoint_url=servers.s3.endpoint,
        timeout_s=TIMEOUT_S,
        max_file_bytes=MAX_FILE,
        max_total_bytes=MAX_TOTAL,
        max_files=MAX_FILES,
    )
    stop, service = await start_registry(nats_url, base_dir, remote)
    nc = await connect(nats_url, "remote-test")
    yield nc
    stop.set()
    await service
    # close, not drain: a drain waits out nats-py's 30 s drain timeout for any subscription a test
    # left with unread messages (an audit subject it read one record of)
    await nc.close()


@pytest.fixture
async def push(remote_registry: NATS, base: BaseModelIdentity, signer_keys: KeyPair) -> Push:
    """A fresh tenant with a trusted signer, so no test sees another's allow-list entries."""
    tenant, signer = unique("t"), unique("release")
    trust = TrustKeyRequest(signer=signer, public_key=signer_keys.public_b64, tenants=[tenant], actor="test")
    await call(remote_registry, "trust_key", trust, TrustedKeysReply)
    return Push(remote_registry, base, signer_keys, signer, tenant)
