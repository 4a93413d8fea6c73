"""The JetStream ceiling every nats-server lorafleet starts runs under: written into its own
server.conf (the permission model included), whatever the disk has free, so the platform's streams
(their reservations total ~9.3 GB at the defaults) are placed on a machine with little free disk and a
cap below them is refused by the server itself."""

import asyncio

import nats
import nats.errors
import pytest
from nats.js.errors import ServerError

from lorafleet.cli.infra import free_port, start_nats
from lorafleet.cli.nats_auth import start_secured_nats
from shared.bus import ensure_streams


async def streams_on(url: str) -> list[str]:
    nc = await nats.connect(url)
    try:
        return [p.stream for p in await ensure_streams(nc.jetstream(), replicas=1)]
    finally:
        await nc.close()


def test_the_streams_are_placed_under_the_default_ceiling_and_refused_under_a_smaller_one(tmp_path, monkeypatch):
    server = start_nats(free_port(), tmp_path / "default")
    try:
        assert "max_file_store" in (tmp_path / "default" / "server.conf").read_text()
        assert len(asyncio.run(streams_on(server.url))) >= 3
    finally:
        server.stop()
    monkeypatch.setenv("LF_JETSTREAM_MAX_FILE_STORE", "1G")  # below AUDIT's 8 GiB reservation
    small = start_nats(free_port(), tmp_path / "small")
    try:
        with pytest.raises(ServerError, match="insufficient storage"):
            asyncio.run(streams_on(small.url))
    finally:
        small.stop()


def test_the_permission_model_is_included_beside_the_ceiling(tmp_path):
    server, auth = start_secured_nats(free_port(), tmp_path, tmp_path / "nats.log")
    try:
        conf = (tmp_path / "nats" / "server.conf").read_text()
        assert "include" in conf and "max_file_store" in conf

        async def anonymous() -> None:
            await nats.connect(server.url, max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=2)

        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            asyncio.run(anonymous())
        assert len(asyncio.run(streams_on(auth.admin_url(server.url)))) >= 3
    finally:
        server.stop()
