"""NATS auth: generate passwords and a nats-server config, add tenant users, create the streams.

``python -m lorafleet.cli.nats_auth init --dir deploy`` writes, for ``compose.yaml``:
  deploy/secrets/nats-users.json   every password (0600), kept across runs
  deploy/nats.conf                 the server config with one user per service (0600)
  deploy/secrets/<service>.env     LF_NATS_USER / LF_NATS_PASSWORD (+ Redis URL) per container (0600)
  deploy/secrets/redis.env         REDIS_PASSWORD for the redis container (0600)
``tenant-user <tenant>`` adds a direct-NATS user for one tenant; ``setup`` creates the shared
streams as the admin. ``start_secured_nats`` runs the same model for ``lorafleet up`` and tests.
Permissions themselves live in lorafleet/cli/nats_permissions.py.
"""

import argparse
import asyncio
import json
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from lorafleet.cli.infra import Server, start_nats
from lorafleet.cli.nats_permissions import (
    ADMIN,
    SERVICES,
    admin_permissions,
    service_permissions,
    tenant_inbox,
    tenant_permissions,
)
from shared import subjects
from shared.bus import connect, ensure_streams
from shared.config import CommonSettings

SECRETS_FILE = "nats-users.json"
REDIS_USERS = ("gateway", "scheduler")  # the services that talk to Redis


@dataclass(slots=True)
class Secrets:
    """Every NATS user's password (services, admin, tenants) and the Redis password."""

    users: dict[str, str]
    tenants: dict[str, str] = field(default_factory=dict)
    redis: str = ""

    @classmethod
    def load_or_create(cls, path: Path) -> "Secrets":
        """Read ``path``; add any missing password (new passwords for a fresh file) and save it 0600."""
        raw = json.loads(path.read_text()) if path.exists() else {}
        made = cls(users=raw.get("users", {}), tenants=raw.get("tenants", {}), redis=raw.get("redis", ""))
        for user in (*SERVICES, ADMIN):
            made.users.setdefault(user, secrets.token_urlsafe(24))
        made.redis = made.redis or secrets.token_urlsafe(24)
        made.save(path)
        return made

    def save(self, path: Path) -> None:
        write_private(path, json.dumps({"users": self.users, "tenants": self.tenants, "redis": self.redis}, indent=2))


def render_config(creds: Secrets, server: dict | None = None, tls: dict | None = None) -> str:
    """The nats-server config (JSON is valid NATS config syntax). ``server`` adds top-level
    settings such as ``listen`` and ``jetstream``; ``tls`` a ``tls`` block (cert_file, key_file,
    ca_file, verify). Tenant users are named ``tenant-<tenant>``."""
    perms = service_permissions(creds.tenants)
    users = [{"user": name, "password": creds.users[name], "permissions": perms[name].to_conf()} for name in SERVICES]
    users.append({"user": ADMIN, "password": creds.users[ADMIN], "permissions": admin_permissions().to_conf()})
    users += [
        {"user": f"tenant-{t}", "password": pw, "permissions": tenant_permissions(t).to_conf()}
        for t, pw in sorted(creds.tenants.items())
    ]
    conf: dict = {**(server or {}), "authorization": {"users": users}}
    if tls:
        conf["tls"] = tls
    return json.dumps(conf, indent=2) + "\n"


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to a file only its owner can read (created 0600, never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(text)


# JetStream's ceiling over every stream, KV bucket and object store together, so a flood meets a
# refused publish, not a full disk; above the streams' own bounds (shared/config.py StreamLimits).
# Set when `init` runs: LF_JETSTREAM_MAX_FILE_STORE=200G python -m lorafleet.cli.nats_auth init
COMPOSE_JETSTREAM = {
    "store_dir": "/data",
    "max_memory_store": os.environ.get("LF_JETSTREAM_MAX_MEMORY_STORE", "256M"),
    "max_file_store": os.environ.get("LF_JETSTREAM_MAX_FILE_STORE", "64G"),
}
COMPOSE_SERVER = {"listen": "0.0.0.0:4222", "http": "0.0.0.0:8222", "jetstream": COMPOSE_JETSTREAM}
COMPOSE_TLS = {
    "cert_file": "/etc/nats/tls/server.pem",
    "key_file": "/etc/nats/tls/server-key.pem",
    "ca_file": "/etc/nats/tls/ca.pem",
    "timeout": 2,
}


def init_deploy(directory: Path, tls: bool = False) -> Secrets:
    """Write the compose secrets and config under ``directory`` (idempotent: passwords are kept).
    ``tls`` makes the server require TLS with the certificates mounted at /etc/nats/tls."""
    creds = Secrets.load_or_create(directory / "secrets" / SECRETS_FILE)
    write_private(directory / "nats.conf", render_config(creds, COMPOSE_SERVER, COMPOSE_TLS if tls else None))
    redis_url = f"redis://:{creds.redis}@redis:6379/0"
    for user in (*SERVICES, ADMIN):
        lines = [f"LF_NATS_USER={user}", f"LF_NATS_PASSWORD={creds.users[user]}"]
        if user in REDIS_USERS:
            lines.append(f"LF_REDIS_URL={redis_url}")
        write_private(directory / "secrets" / f"{user}.env", "\n".join(lines) + "\n")
    write_private(directory / "secrets" / "redis.env", f"REDIS_PASSWORD={creds.redis}\n")
    return creds


def add_tenant_user(directory: Path, tenant: str) -> str:
    """Give ``tenant`` a direct-NATS user (kept if it exists), rewrite the config, return its password.
    The running server picks it up on a config reload (SIGHUP)."""
    path = directory / "secrets" / SECRETS_FILE
    creds = Secrets.load_or_create(path)
    creds.tenants.setdefault(subjects.token(tenant), secrets.token_urlsafe(24))
    creds.save(path)
    config = directory / "nats.conf"
    init_deploy(directory, tls=config.exists() and "tls" in json.loads(config.read_text()))
    return creds.tenants[tenant]


@dataclass(frozen=True, slots=True)
class LocalAuth:
    """The permission model for a local stack (``lorafleet up``, e2e tests)."""

    config: Path
    creds: Secrets

    def service_env(self, service: str) -> dict[str, str]:
        """Environment to pass to ``Stack.start(service, extra_env=...)``."""
        return {"LF_NATS_USER": service, "LF_NATS_PASSWORD": self.creds.users[service]}

    def admin(self) -> tuple[str, str]:
        return ADMIN, self.creds.users[ADMIN]

    def admin_url(self, nats_url: str) -> str:
        """``nats_url`` with the admin credentials in it, for in-process clients (wait_ready)."""
        return nats_url.replace("nats://", f"nats://{ADMIN}:{self.creds.users[ADMIN]}@", 1)


def local_auth(state_dir: Path) -> LocalAuth:
    """Generate (or reuse) passwords and a nats-server config under ``state_dir``, and
    ``admin.env`` for admin CLI sessions (``set -a; . state/admin.env; set +a``)."""
    creds = Secrets.load_or_create(state_dir / SECRETS_FILE)
    config = state_dir / "nats.conf"
    write_private(config, render_config(creds))
    write_private(state_dir / "admin.env", f"LF_NATS_USER={ADMIN}\nLF_NATS_PASSWORD={creds.users[ADMIN]}\n")
    return LocalAuth(config, creds)


def start_secured_nats(port: int, state_dir: Path, log_file: Path | None = None) -> tuple[Server, LocalAuth]:
    """nats-server with the permission model (data in ``state_dir/nats``) and the streams created
    by the admin. Start each service with ``extra_env=auth.service_env(name)``; in-process
    clients connect to ``auth.admin_url(server.url)``."""
    auth = local_auth(state_dir)
    server = start_nats(port, state_dir / "nats", log_file, config=auth.config)
    try:
        asyncio.run(setup_streams(server.url, auth.admin()))
    except BaseException:
        server.stop()
        raise
    return server, auth


async def setup_streams(nats_url: str, admin: tuple[str, str] | None) -> None:
    """Create or update the shared streams as the admin, so services only need STREAM.INFO."""
    nc = await connect(nats_url, "lorafleet-setup", admin)
    try:
        await ensure_streams(nc.jetstream())
    finally:
        await nc.close()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("nats", help="NATS users, permissions and streams")
    cmds = p.add_subparsers(dest="nats_command", required=True)
    init = cmds.add_parser("init", help="generate passwords, nats.conf and env files for compose")
    init.add_argument("--dir", type=Path, default=Path("deploy"))
    init.add_argument("--tls", action="store_true", help="require TLS (certificates in deploy/tls, see docs)")
    init.set_defaults(func=_init)
    tenant = cmds.add_parser("tenant-user", help="add a direct-NATS user for one tenant")
    tenant.add_argument("tenant")
    tenant.add_argument("--dir", type=Path, default=Path("deploy"))
    tenant.set_defaults(func=_tenant)
    setup = cmds.add_parser("setup", help="create the streams (uses LF_NATS_URL / LF_NATS_USER / password)")
    setup.set_defaults(func=_setup)


def _init(args: argparse.Namespace) -> int:
    init_deploy(args.dir, args.tls)
    print(f"wrote {args.dir / 'nats.conf'} and {args.dir / 'secrets'}/ (keep them out of images and git)")
    return 0


def _tenant(args: argparse.Namespace) -> int:
    password = add_tenant_user(args.dir, args.tenant)
    print(
        f"user: tenant-{args.tenant}\npassword: {password}\ninbox_prefix: {tenant_inbox(args.tenant)}\n"
        f"publish to: {subjects.infer_submit(args.tenant)}\n"
        "reload the server to apply: docker compose kill -s HUP nats"
    )
    return 0


def _setup(_: argparse.Namespace) -> int:
    settings = CommonSettings()
    asyncio.run(setup_streams(settings.nats_url, settings.nats_credentials()))
    print("streams ready")
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lorafleet.cli.nats_auth")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["nats", *(argv if argv is not None else sys.argv[1:])])
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
