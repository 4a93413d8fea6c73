"""NATS auth: generate passwords and a nats-server config, add tenant users, create the streams.

``python -m lorafleet.cli.nats_auth init --dir deploy [--workers N] [--cpu-workers M] [--vllm-workers K]`` writes, for
``compose.yaml``:
  deploy/secrets/nats-users.json   every password (0600), kept across runs
  deploy/nats.conf                 the server config: one user per service and per worker (0600)
  deploy/secrets/<service>.env     LF_NATS_USER / LF_NATS_PASSWORD (+ Redis URL) per container (0600)
  deploy/secrets/worker-<id>.env   the same for each worker, with its LF_WORKER_ID (0600)
  deploy/secrets/redis.env         REDIS_PASSWORD for the redis container (0600)
  (each service's and worker's env file also holds LF_METRICS_TOKEN, the bearer token of every /metrics)
  deploy/compose.workers.yaml      one compose service per worker (``-f compose.yaml -f deploy/compose.workers.yaml``)
  deploy/prometheus.yml            Prometheus scrape config (the worker services and this file: compose_services.py): every service's and every worker's /metrics, with
                                   the token compose_init --import puts in the prometheus volume
``user create --tenant T`` adds a direct-NATS user for one tenant and prints a working snippet;
``user create --audit-reader`` prints the SIEM role's credentials; ``setup`` creates the shared
streams as the admin. ``start_secured_nats`` runs the same model for ``lorafleet up`` and tests.
Permissions themselves live in lorafleet/cli/nats_permissions.py.
"""

import argparse
import asyncio
import json
import secrets
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import nats
import nats.errors
import yaml

from lorafleet.cli import nats_snippets
from lorafleet.cli.compose_services import (
    PROMETHEUS_FILE,
    VLLM_PROFILE,
    compose_worker,
    compose_worker_ids,
    prometheus_config,
)
from lorafleet.cli.infra import Server, cluster_url, jetstream_limits, start_nats, start_nats_cluster, wait_jetstream
from lorafleet.cli.nats_accounts import accounts, adopt_unaccounted_store, ensure_reader_consumers
from lorafleet.cli.nats_permissions import (
    ADMIN,
    AUDIT_READER,
    SERVICES,
    admin_permissions,
    audit_reader_permissions,
    service_permissions,
    tenant_permissions,
    tenant_user,
    worker_permissions,
    worker_user,
)
from shared import subjects
from shared.bus import connect, ensure_streams
from shared.config import CommonSettings

SECRETS_FILE = "nats-users.json"
WORKERS_COMPOSE_FILE = "compose.workers.yaml"
REDIS_USERS = ("scheduler", "worker")  # the services that talk to Redis (workers read adapter heat)
LOCAL_WORKER = "local"  # the worker id of ``lorafleet up``
REACH_S = 5.0  # how long ``user create`` tries to reach NATS to make a tenant's replay consumer


@dataclass(slots=True)
class Secrets:
    """Every NATS user's password (services, workers, admin, audit-reader, tenants), the Redis password,
    the bearer token of every /metrics and Grafana's admin password."""

    users: dict[str, str]
    tenants: dict[str, str] = field(default_factory=dict)
    workers: dict[str, str] = field(default_factory=dict)  # worker id -> password of ``worker-<id>``
    redis: str = ""
    metrics: str = ""
    grafana: str = ""

    def fill(self) -> None:
        """Draw the Redis password, the metrics token and the Grafana password where missing."""
        self.redis = self.redis or secrets.token_urlsafe(24)
        self.metrics = self.metrics or secrets.token_urlsafe(32)
        self.grafana = self.grafana or secrets.token_urlsafe(18)

    @classmethod
    def load_or_create(cls, path: Path, workers: Sequence[str] | None = None) -> "Secrets":
        """Read ``path``; add any missing password (new passwords for a fresh file) and save it 0600.
        ``workers`` names the worker ids to hold users for (kept passwords; others dropped); None
        keeps the file's workers."""
        raw = json.loads(path.read_text()) if path.exists() else {}
        made = cls(
            users=raw.get("users", {}),
            tenants=raw.get("tenants", {}),
            workers=raw.get("workers", {}),
            redis=raw.get("redis", ""),
            metrics=raw.get("metrics", ""),
            grafana=raw.get("grafana", ""),
        )
        made.users.pop("worker", None)  # the one credential every worker once shared
        for user in (*SERVICES, ADMIN, AUDIT_READER):
            made.users.setdefault(user, secrets.token_urlsafe(24))
        if workers is not None:
            made.workers = {w: made.workers.get(subjects.token(w)) or secrets.token_urlsafe(24) for w in workers}
        made.fill()
        made.save(path)
        return made

    def raw(self) -> dict:
        """The JSON form ``load_or_create`` reads (nats-users.json)."""
        return {
            "users": self.users,
            "tenants": self.tenants,
            "workers": self.workers,
            "redis": self.redis,
            "metrics": self.metrics,
            "grafana": self.grafana,
        }

    def save(self, path: Path) -> None:
        write_private(path, json.dumps(self.raw(), indent=2))


def render_config(creds: Secrets, server: dict | None = None, tls: dict | None = None) -> str:
    """The nats-server config (JSON is valid NATS config syntax). ``server`` adds top-level
    settings such as ``listen`` and ``jetstream``; ``tls`` a ``tls`` block (cert_file, key_file,
    ca_file, verify). Services, workers (``worker-<id>``) and the admin share the platform's account;
    each tenant user (``tenant-<tenant>``) and the audit-reader have their own (nats_accounts.py)."""
    perms = service_permissions(creds.tenants)
    platform = [
        {"user": name, "password": creds.users[name], "permissions": perms[name].to_conf()} for name in SERVICES
    ]
    platform += [
        {"user": worker_user(w), "password": pw, "permissions": worker_permissions(w, creds.tenants).to_conf()}
        for w, pw in sorted(creds.workers.items())
    ]
    platform.append({"user": ADMIN, "password": creds.users[ADMIN], "permissions": admin_permissions().to_conf()})
    reader = audit_reader_permissions().to_conf()
    siem = [{"user": AUDIT_READER, "password": creds.users[AUDIT_READER], "permissions": reader}]
    tenants = {
        t: {"user": tenant_user(t), "password": pw, "permissions": tenant_permissions(t).to_conf()}
        for t, pw in creds.tenants.items()
    }
    conf: dict = {**(server or {}), "accounts": accounts(platform, siem, tenants)}
    if tls:
        conf["tls"] = tls
    return json.dumps(conf, indent=2) + "\n"


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to a file only its owner can read (created 0600, never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(text)


# JetStream's ceiling (lorafleet.cli.infra.jetstream_limits), set when `init` runs:
# LF_JETSTREAM_MAX_FILE_STORE=200G python -m lorafleet.cli.nats_auth init
COMPOSE_JETSTREAM = {"store_dir": "/data", **jetstream_limits()}
# monitoring lists every connection and subscription: inside the container only, for its health probe
COMPOSE_SERVER = {"listen": "0.0.0.0:4222", "http": "127.0.0.1:8222", "jetstream": COMPOSE_JETSTREAM}
COMPOSE_TLS = {
    "cert_file": "/etc/nats/tls/server.pem",
    "key_file": "/etc/nats/tls/server-key.pem",
    "ca_file": "/etc/nats/tls/ca.pem",
    "timeout": 2,
}


def init_deploy(directory: Path, tls: bool = False, workers: Sequence[str] | None = None) -> Secrets:
    """Write the compose secrets and config under ``directory`` (idempotent: passwords are kept).
    ``tls`` makes the server require TLS with the certificates mounted at /etc/nats/tls; ``workers``
    names the workers (one NATS user each; None keeps the last set, ``gpu-1`` for a fresh one)."""
    path = directory / "secrets" / SECRETS_FILE
    if workers is None and not path.exists():
        workers = compose_worker_ids(1, 0)
    creds = Secrets.load_or_create(path, workers)
    write_private(directory / "nats.conf", render_config(creds, COMPOSE_SERVER, COMPOSE_TLS if tls else None))
    redis_url = f"redis://:{creds.redis}@redis:6379/0"
    for user in (*SERVICES, ADMIN):
        lines = [f"LF_NATS_USER={user}", f"LF_NATS_PASSWORD={creds.users[user]}"]
        if user in REDIS_USERS:
            lines.append(f"LF_REDIS_URL={redis_url}")
        if user in SERVICES:
            lines.append(f"LF_METRICS_TOKEN={creds.metrics}")
        write_private(directory / "secrets" / f"{user}.env", "\n".join(lines) + "\n")
    for old in (directory / "secrets").glob("worker*.env"):
        old.unlink()  # a worker dropped from the set keeps no credential file (its user is gone)
    for worker_id, password in creds.workers.items():
        lines = [
            f"LF_WORKER_ID={worker_id}",
            f"LF_NATS_USER={worker_user(worker_id)}",
            f"LF_NATS_PASSWORD={password}",
            f"LF_REDIS_URL={redis_url}",
            f"LF_METRICS_TOKEN={creds.metrics}",
        ]
        write_private(directory / "secrets" / f"{worker_user(worker_id)}.env", "\n".join(lines) + "\n")
    workers_compose = {"services": {worker_user(w): compose_worker(w) for w in creds.workers}}
    header = "# generated by `lorafleet nats init`: one service per worker, each with its own NATS user\n"
    (directory / WORKERS_COMPOSE_FILE).write_text(header + yaml.safe_dump(workers_compose, sort_keys=False))
    header = "# generated by `lorafleet nats init`: every service's /metrics (re-run init when the workers change)\n"
    prometheus = yaml.safe_dump(prometheus_config(list(creds.workers)), sort_keys=False)
    (directory / PROMETHEUS_FILE).write_text(header + prometheus)
    write_private(directory / "secrets" / "redis.env", f"REDIS_PASSWORD={creds.redis}\n")
    return creds


def add_tenant_user(directory: Path, tenant: str) -> str:
    """Give ``tenant`` a direct-NATS user (kept if it exists), rewrite the config, return its password.
    The running server picks it up on a config reload (SIGHUP)."""
    path = directory / "secrets" / SECRETS_FILE
    creds = Secrets.load_or_create(path)
    creds.tenants.setdefault(subjects.token(tenant), secrets.token_urlsafe(24))
    creds.save(path)
    init_deploy(directory, tls=_has_tls(directory))
    return creds.tenants[tenant]


@dataclass(frozen=True, slots=True)
class LocalAuth:
    """The permission model for a local stack (``lorafleet up``, e2e tests)."""

    config: Path
    creds: Secrets

    def service_env(self, service: str) -> dict[str, str]:
        """Environment to pass to ``Stack.start(service, extra_env=...)``; a worker is ``worker_env``'s."""
        if service == "worker":
            return self.worker_env(LOCAL_WORKER)
        return {"LF_NATS_USER": service, "LF_NATS_PASSWORD": self.creds.users[service]}

    def worker_env(self, worker_id: str) -> dict[str, str]:
        """One worker's identity and its own NATS user (``local_auth(workers=...)`` made it)."""
        return {
            "LF_WORKER_ID": worker_id,
            "LF_NATS_USER": worker_user(worker_id),
            "LF_NATS_PASSWORD": self.creds.workers[worker_id],
        }

    def tenant_password(self, tenant: str) -> str:
        """The password of ``tenant-<tenant>`` (``local_auth(tenants=...)`` made it)."""
        return self.creds.tenants[tenant]

    def admin(self) -> tuple[str, str]:
        return ADMIN, self.creds.users[ADMIN]

    def admin_url(self, nats_url: str) -> str:
        """``nats_url`` (one URL or a cluster's, comma separated) with the admin credentials in each,
        for in-process clients (wait_ready)."""
        return nats_url.replace("nats://", f"nats://{ADMIN}:{self.creds.users[ADMIN]}@")


def local_auth(state_dir: Path, workers: Sequence[str] = (LOCAL_WORKER,), tenants: Sequence[str] = ()) -> LocalAuth:
    """Generate (or reuse) passwords and a nats-server config under ``state_dir``, one NATS user per
    worker id in ``workers`` and per direct-NATS tenant in ``tenants``, and ``admin.env`` for admin
    CLI sessions (``set -a; . state/admin.env; set +a``)."""
    creds = Secrets.load_or_create(state_dir / SECRETS_FILE, workers)
    for tenant in tenants:
        creds.tenants.setdefault(subjects.token(tenant), secrets.token_urlsafe(24))
    creds.save(state_dir / SECRETS_FILE)
    config = state_dir / "nats.conf"
    write_private(config, render_config(creds))
    write_private(state_dir / "admin.env", f"LF_NATS_USER={ADMIN}\nLF_NATS_PASSWORD={creds.users[ADMIN]}\n")
    return LocalAuth(config, creds)


def start_secured_nats(
    port: int,
    state_dir: Path,
    log_file: Path | None = None,
    workers: Sequence[str] = (LOCAL_WORKER,),
    tenants: Sequence[str] = (),
) -> tuple[Server, LocalAuth]:
    """nats-server with the permission model (data in ``state_dir/nats``) and the streams created
    by the admin. Start each service with ``extra_env=auth.service_env(name)`` (a worker with
    ``auth.worker_env(id)``); in-process clients connect to ``auth.admin_url(server.url)``."""
    auth = local_auth(state_dir, workers, tenants)
    adopt_unaccounted_store(state_dir / "nats")
    server = start_nats(port, state_dir / "nats", log_file, config=auth.config)
    try:
        asyncio.run(setup_streams(server.url, auth.admin(), tenants=auth.creds.tenants))
    except BaseException:
        server.stop()
        raise
    return server, auth


def start_secured_nats_cluster(
    ports: Sequence[int],
    state_dir: Path,
    log_dir: Path | None = None,
    workers: Sequence[str] = (LOCAL_WORKER,),
    tenants: Sequence[str] = (),
) -> tuple[list[Server], LocalAuth]:
    """``start_secured_nats`` as a cluster: one node per port in ``ports`` (``start_nats_cluster``), the
    same permission model on each, and the streams created with one replica per node."""
    auth = local_auth(state_dir, workers, tenants)
    servers = start_nats_cluster(ports, state_dir / "nats-cluster", log_dir, config=auth.config)
    try:
        url = cluster_url(servers)
        asyncio.run(wait_jetstream(url, 60, auth.admin()))
        asyncio.run(setup_streams(url, auth.admin(), replicas=len(servers), tenants=auth.creds.tenants))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers, auth


async def setup_streams(
    nats_url: str, admin: tuple[str, str] | None, replicas: int | None = None, tenants: Iterable[str] = ()
) -> None:
    """Create or update the shared streams as the admin, so services only need STREAM.INFO, and the
    replay consumers of the audit-reader and of each direct-NATS tenant in ``tenants``; where each
    stream lives is reported on stderr."""
    nc = await connect(nats_url, "lorafleet-setup", admin)
    try:
        js = nc.jetstream()
        for p in await ensure_streams(js, replicas=replicas):
            where = f"leader {p.leader}, peers {', '.join(p.peers) or '-'}" if p.leader else "one server"
            print(f"stream {p.stream}: {p.replicas} replica(s), {where}", file=sys.stderr)
        made = await ensure_reader_consumers(js, tenants)
        print(f"replay consumers on {subjects.AUDIT_STREAM}: {', '.join(made)}", file=sys.stderr)
    finally:
        await nc.close()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("nats", help="NATS users, permissions and streams")
    cmds = p.add_subparsers(dest="nats_command", required=True)
    init = cmds.add_parser("init", help="generate passwords, nats.conf and env files for compose")
    init.add_argument("--dir", type=Path, default=Path("deploy"))
    init.add_argument("--tls", action="store_true", help="require TLS (certificates in deploy/tls, see docs)")
    init.add_argument("--workers", type=int, default=None, help="GPU workers gpu-1..N (default: keep; 1 at first)")
    init.add_argument("--cpu-workers", type=int, default=0, help="CPU workers cpu-1..M (with --workers)")
    init.add_argument(
        "--vllm-workers",
        type=int,
        default=0,
        help="vLLM GPU workers vllm-1..K (with --workers; started by `--profile vllm`)",
    )
    init.set_defaults(func=_init)
    user = cmds.add_parser("user", help="NATS users for clients").add_subparsers(dest="user_command", required=True)
    create = user.add_parser("create", help="a direct-NATS tenant user, or the audit-reader role; prints how to use it")
    who = create.add_mutually_exclusive_group(required=True)
    who.add_argument("--tenant", help="submit inference and follow this tenant's own audit records")
    who.add_argument("--audit-reader", action="store_true", help="a SIEM: read every audit subject, publish nothing")
    create.add_argument("--dir", type=Path, default=Path("deploy"))
    create.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="the URL clients reach NATS at")
    create.set_defaults(func=_user_create)
    setup = cmds.add_parser(
        "setup", help="create the streams and replay consumers (uses LF_NATS_URL / LF_NATS_USER / password)"
    )
    setup.add_argument(
        "--tenant", action="append", default=[], help="make this direct-NATS tenant's replay consumer (repeatable)"
    )
    setup.set_defaults(func=_setup)


def _init(args: argparse.Namespace) -> int:
    workers = None if args.workers is None else compose_worker_ids(args.workers, args.cpu_workers, args.vllm_workers)
    creds = init_deploy(args.dir, args.tls, workers)
    print(
        f"wrote {args.dir / 'nats.conf'}, {args.dir / WORKERS_COMPOSE_FILE} and {args.dir / 'secrets'}/ "
        f"(keep them out of images and git); workers: {', '.join(creds.workers)}\n"
        f"start: docker compose -f compose.yaml -f compose.secrets-dir.yaml -f {args.dir / WORKERS_COMPOSE_FILE}"
        f"{' --profile ' + VLLM_PROFILE if any(w.startswith('vllm-') for w in creds.workers) else ''} up -d"
    )
    return 0


def _user_create(args: argparse.Namespace) -> int:
    reload = "reload the server to apply: docker compose kill -s HUP nats"
    if args.audit_reader:
        creds = init_deploy(args.dir, tls=_has_tls(args.dir))
        print(
            f"user: {AUDIT_READER}\npassword: {creds.users[AUDIT_READER]}\n"
            f"inbox_prefix: {subjects.AUDIT_READER_INBOX}\nsubscribe: {subjects.AUDIT_ALL}\n"
            f"replay: consumer {AUDIT_READER!r} on stream {subjects.AUDIT_STREAM} (made by `lorafleet nats setup`)\n"
            f"{reload}"
        )
        return 0
    tenant = subjects.token(args.tenant)
    password = add_tenant_user(args.dir, tenant)
    admin = Secrets.load_or_create(args.dir / "secrets" / SECRETS_FILE).users[ADMIN]
    consumer = subjects.tenant_audit_consumer(tenant)
    try:
        asyncio.run(asyncio.wait_for(_make_replay_consumer(args.nats_url, (ADMIN, admin), tenant), REACH_S))
        made = f"made consumer {consumer!r} on {subjects.AUDIT_STREAM}"
    except (OSError, nats.errors.Error, TimeoutError) as e:
        made = f"NATS not reached ({type(e).__name__}): once it is up, `lorafleet nats setup --tenant {tenant}`"
    print(
        f"user: {tenant_user(tenant)}\npassword: {password}\ninbox_prefix: {subjects.tenant_inbox(tenant)}\n"
        f"publish to: {subjects.infer_submit(tenant)}\n"
        f"audit records: {subjects.audit_of_tenant(tenant)} (replay: consumer {consumer!r}; {made})\n"
        f"{reload}\n\n{nats_snippets.tenant_env(args.nats_url, tenant, password)}\n\n"
        f"# submit a request and stream the reply (python submit.py):\n{nats_snippets.SUBMIT}\n"
        f"# follow this tenant's own audit records (python follow_audit.py):\n{nats_snippets.FOLLOW_AUDIT}"
    )
    return 0


def _has_tls(directory: Path) -> bool:
    config = directory / "nats.conf"
    return config.exists() and "tls" in json.loads(config.read_text())


async def _make_replay_consumer(nats_url: str, admin: tuple[str, str], tenant: str) -> None:
    """The tenant's replay consumer, made as the admin."""

    async def quiet(_: Exception) -> None:  # nats-py prints each failed try otherwise; the caller says it once
        return None

    nc = await nats.connect(
        nats_url, user=admin[0], password=admin[1], allow_reconnect=False, connect_timeout=2, error_cb=quiet
    )
    try:
        await ensure_reader_consumers(nc.jetstream(timeout=5), [tenant])
    finally:
        await nc.close()


def _setup(args: argparse.Namespace) -> int:
    settings = CommonSettings()
    tenants = [subjects.token(t) for t in args.tenant]
    asyncio.run(setup_streams(settings.nats_url, settings.nats_credentials(), tenants=tenants))
    print("streams ready")
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lorafleet.cli.nats_auth")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["nats", *(argv if argv is not None else sys.argv[1:])])
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
