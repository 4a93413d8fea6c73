"""A nats-server running the generated permission model, and clients that record refusals."""

import asyncio
import re
import shlex
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from lorafleet.cli.infra import Server, free_port, start_nats
from lorafleet.cli.nats_auth import Secrets, render_config, setup_streams, write_private
from lorafleet.cli.nats_permissions import ADMIN
from shared import subjects
from tests.deploy.compose_files import K8S, REPO
from tests.helpers.bus import settled

TENANTS = ("acme", "globex")
WORKERS = ("w1", "w2")


@dataclass
class AuthServer:
    server: Server
    creds: Secrets

    def password(self, user: str) -> str:
        if user.startswith("tenant-"):
            return self.creds.tenants[user.removeprefix("tenant-")]
        if user.startswith("worker-"):
            return self.creds.workers[user.removeprefix("worker-")]
        return self.creds.users[user]


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    root = tmp_path_factory.mktemp("nats-auth")
    creds = Secrets.load_or_create(root / "nats-users.json", WORKERS)
    creds.tenants = {t: f"pw-{t}" for t in TENANTS}
    write_private(root / "nats.conf", render_config(creds))
    server = start_nats(free_port(), root / "data", root / "nats.log", config=root / "nats.conf")
    try:
        asyncio.run(setup_streams(server.url, (ADMIN, creds.users[ADMIN]), tenants=TENANTS))
        yield AuthServer(server, creds)
    finally:
        server.stop()


@dataclass
class Client:
    """A connection as one user; permission violations arrive asynchronously in ``errors``."""

    nc: NATS
    errors: list[str] = field(default_factory=list)

    async def refused(self, what: str, subject: str, timeout_s: float = 2.0) -> bool:
        """Whether the server reported a violation for ``what`` ("Publish" or "Subscription") to ``subject``."""
        needle = f'permissions violation for {what} to "{subject}"'.lower()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            if any(needle in e.lower() for e in self.errors):
                return True
            await asyncio.sleep(0.02)
        return False

    async def publish_refused(self, subject: str) -> bool:
        await self.nc.publish(subject, b"{}")
        await settled(self.nc)
        return await self.refused("Publish", subject)

    async def subscribe_refused(self, subject: str) -> bool:
        await self.nc.subscribe(subject)
        await settled(self.nc)
        return await self.refused("Subscription", subject)


@pytest.fixture
async def connect_as(auth_server: AuthServer) -> AsyncIterator:
    clients: list[Client] = []

    async def _connect(user: str, **options) -> Client:
        """Connect as ``user``; a worker with its own inbox prefix, as services/worker does."""
        client = Client(nc=None)  # type: ignore[arg-type]
        if user.startswith("worker-"):
            options.setdefault("inbox_prefix", subjects.worker_inbox(user.removeprefix("worker-")))

        async def on_error(e: Exception) -> None:
            client.errors.append(str(e))

        client.nc = await nats.connect(
            auth_server.server.url,
            user=user,
            password=auth_server.password(user),
            error_cb=on_error,
            allow_reconnect=False,
            **options,
        )
        clients.append(client)
        return client

    yield _connect
    for client in clients:
        await client.nc.close()


@pytest.fixture(scope="module")
def secret_dirs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directories create-secrets.sh fills, by its own compose_init command."""
    script = (K8S / "create-secrets.sh").read_text()
    consumers = re.search(r"^for consumer in (.*); do\n  mkdir", script, re.M)
    command = re.search(r"^python -m lorafleet\.cli\.compose_init (.*)$", script, re.M)
    assert consumers and command
    root = tmp_path_factory.mktemp("k8s-secrets")
    for consumer in consumers.group(1).split():
        (root / consumer).mkdir()
    args = shlex.split(command.group(1).replace('"$dir"', str(root)))
    done = subprocess.run(
        [sys.executable, "-m", "lorafleet.cli.compose_init", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    certs = subprocess.run(
        ["sh", str(K8S / "make-nats-certs.sh"), str(root / "nats-tls")], capture_output=True, text=True, timeout=60
    )
    assert certs.returncode == 0, certs.stderr
    # the Secrets create-secrets.sh makes of them: the nodes' certificate, key and CA; the CA alone for clients
    assert '--from-file=ca.crt="$dir/nats-tls/ca.crt"' in script and "lorafleet-nats-ca" in script
    (root / "nats-ca").mkdir()
    (root / "nats-ca" / "ca.crt").write_text((root / "nats-tls" / "ca.crt").read_text())
    return root
