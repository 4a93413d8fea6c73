"""NATS barriers for tests."""

from nats.aio.client import Client as NATS


async def settled(nc: NATS) -> None:
    """Return once the server has read every command ``nc`` issued before the call (a SUB is live, a
    PUB delivered or refused).

    One ``nc.flush()`` does not promise that: nats-py (2.16) writes flush's PING straight to the socket,
    ahead of the commands still in its pending buffer, so the PONG can come back while a SUB issued just
    before is still unread by the server (a permissions test saw a token published to an inbox whose SUB
    the server read after it: lost, 2 runs in 30 with a fresh server each). By the time that first PONG
    is read, nats-py's flusher has written the pending commands, so a second flush's PING follows them
    on the wire, and the server answers a connection's commands in order."""
    await nc.flush()
    await nc.flush()
