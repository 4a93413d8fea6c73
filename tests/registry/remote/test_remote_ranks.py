"""A remote registration passes the same rank admission as an upload: a rank no class of the
fleet holds is refused after the fetch, stores nothing and is audited."""

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from services.registry.push_admission import BaseModelIdentity
from services.registry.settings import RemoteSourceSettings
from shared.bus import connect
from shared.errors import RankNotServed
from shared.schemas import TrustedKeysReply, TrustKeyRequest
from shared.signing import KeyPair
from tests.registry.remote.support import Files, Push, Servers, allow, call, start_registry, unique


@pytest.fixture
async def rank4_registry(nats_url: str, base_dir: Path, servers: Servers) -> AsyncIterator[NATS]:
    """A registry whose fleet (no worker live) has the one rank class 4."""
    remote = RemoteSourceSettings(s3_enabled=True, s3_endpoint_url=servers.s3.endpoint)
    stop, service = await start_registry(nats_url, base_dir, remote, fleet_rank_classes=(4,))
    nc = await connect(nats_url, "remote-rank-test")
    yield nc
    stop.set()
    await service
    await nc.drain()


async def test_a_remote_push_of_a_rank_the_fleet_cannot_hold_is_refused(
    rank4_registry: NATS, base: BaseModelIdentity, signer_keys: KeyPair, servers: Servers, adapter_files: Files
) -> None:
    tenant, signer = unique("t"), unique("release")
    trust = TrustKeyRequest(signer=signer, public_key=signer_keys.public_b64, tenants=[tenant], actor="test")
    await call(rank4_registry, "trust_key", trust, TrustedKeysReply)
    push = Push(rank4_registry, base, signer_keys, signer, tenant)
    key = f"{tenant}/sum/"
    servers.s3.put_dir("models", key, adapter_files)
    await allow(rank4_registry, f"s3://models/{tenant}/", [tenant])
    error = await push.refused(unique("s3-r8"), f"s3://models/{key}", adapter_files, RankNotServed)
    assert "rank 8 fits no rank class of the fleet: classes 4 (LF_FLEET_RANK_CLASSES, no worker live)" in error.message
