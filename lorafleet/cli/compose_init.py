"""compose's one-shot init service: every credential into named volumes, one volume per consumer.

``python -m lorafleet.cli.compose_init --root /secrets --workers cpu-1,cpu-2 [--nats-cluster nats-1,...]``
expects one directory (a named volume) per consumer under ``--root`` and writes, when absent:
  state/nats-users.json        every password (only the init service mounts ``state``)
  nats/nats.conf               the single-node server config, users and permissions included
  nats/auth.conf               the same ``accounts`` block alone (the cluster config includes it)
  nats/cluster.conf            route credentials and routes (``--nats-cluster``: the cluster profile)
  redis/redis.conf, password   ``requirepass`` for redis-server, the password for its health probe
  <service>/nats-password      for gateway, registry, scheduler, auditor, admin (``nats-setup``)
  <service>/redis-password     for the scheduler and every worker
  worker-<id>/nats-password    one NATS user per worker in ``--workers``
Passwords are kept across runs and a second run rewrites nothing. ``--import`` takes the passwords of
``python -m lorafleet.cli.nats_auth init --dir deploy`` (deploy/secrets/nats-users.json) instead, for
operators who keep secrets elsewhere (compose.secrets-dir.yaml). Run as root, it hands each file to
the user of the image that reads it.
"""

import argparse
import json
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

from lorafleet.cli.nats_auth import COMPOSE_SERVER, COMPOSE_TLS, REDIS_USERS, SECRETS_FILE, Secrets, render_config
from lorafleet.cli.nats_permissions import ADMIN, AUDIT_READER, SERVICES, worker_user

DEFAULT_WORKERS = ("cpu-1", "cpu-2")  # compose.yaml's worker-cpu-1 and worker-cpu-2
STATE = "state"
NATS = "nats"
REDIS = "redis"
ROUTE_USER = "route"  # the nats-server route (cluster) credential, not a client user
CLUSTER_PORT = 6222
LORAFLEET_UID = 10001  # the Dockerfile's lorafleet user
REDIS_UID = 999  # the official redis image's redis user
ROOT_UID = 0  # the official nats image runs as root
NATS_PASSWORD = "nats-password"
REDIS_PASSWORD = "redis-password"


def write_if_changed(path: Path, text: str, uid: int | None) -> bool:
    """Write ``text`` to ``path`` (0600, owned by ``uid`` when running as root) unless it holds it already."""
    if path.exists() and path.read_text() == text:
        return False
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(text)
    if uid is not None and os.geteuid() == 0:
        os.chown(path, uid, uid)
        os.chown(path.parent, uid, uid)
    return True


def load(state: Path, workers: Sequence[str], imported: Path | None) -> Secrets:
    """The kept passwords, the imported file's winning over them; missing ones generated."""
    kept = json.loads(state.read_text()) if state.exists() else {}
    if imported is not None:
        raw = json.loads(imported.read_text())
        for key in ("users", "tenants", "workers"):
            kept[key] = {**kept.get(key, {}), **raw.get(key, {})}
        kept["redis"] = raw.get("redis") or kept.get("redis", "")
    creds = Secrets(
        users=kept.get("users", {}),
        tenants=kept.get("tenants", {}),
        workers=kept.get("workers", {}),
        redis=kept.get("redis", ""),
    )
    for user in (*SERVICES, ADMIN, AUDIT_READER, ROUTE_USER):
        creds.users.setdefault(user, secrets.token_urlsafe(24))
    creds.redis = creds.redis or secrets.token_urlsafe(24)
    for worker in workers:
        creds.workers.setdefault(worker, secrets.token_urlsafe(24))
    return creds


def cluster_fragment(creds: Secrets, nodes: Sequence[str]) -> str:
    """The ``cluster`` block's credentials and routes (included by deploy/compose/nats-cluster.conf)."""
    password = creds.users[ROUTE_USER]
    routes = [f"nats://{ROUTE_USER}:{password}@{node}:{CLUSTER_PORT}" for node in nodes]
    return f"authorization: {json.dumps({'user': ROUTE_USER, 'password': password})}\nroutes: {json.dumps(routes)}\n"


def init_volumes(
    root: Path,
    workers: Sequence[str] = DEFAULT_WORKERS,
    nats_cluster: Sequence[str] = (),
    imported: Path | None = None,
    tls: bool = False,
) -> list[Path]:
    """Write every consumer's credentials under ``root/<consumer>``; returns the files (re)written.
    Raises FileNotFoundError, writing nothing, when a consumer's directory (its volume) is missing."""
    state = root / STATE / SECRETS_FILE
    creds = load(state, workers, imported)
    config = json.loads(render_config(creds, COMPOSE_SERVER, COMPOSE_TLS if tls else None))
    files: dict[Path, tuple[str, int | None]] = {
        state: (json.dumps(creds_raw(creds), indent=2), ROOT_UID),
        root / NATS / "nats.conf": (json.dumps(config, indent=2) + "\n", ROOT_UID),
        root / NATS / "auth.conf": (f"accounts: {json.dumps(config['accounts'], indent=2)}\n", ROOT_UID),
        root / REDIS / "redis.conf": (f"requirepass {creds.redis}\n", REDIS_UID),
        root / REDIS / "password": (creds.redis + "\n", REDIS_UID),
    }
    if nats_cluster:
        files[root / NATS / "cluster.conf"] = (cluster_fragment(creds, nats_cluster), ROOT_UID)
    for user in (*SERVICES, ADMIN):
        files[root / user / NATS_PASSWORD] = (creds.users[user] + "\n", LORAFLEET_UID)
        if user in REDIS_USERS:
            files[root / user / REDIS_PASSWORD] = (creds.redis + "\n", LORAFLEET_UID)
    for worker in workers:
        files[root / worker_user(worker) / NATS_PASSWORD] = (creds.workers[worker] + "\n", LORAFLEET_UID)
        files[root / worker_user(worker) / REDIS_PASSWORD] = (creds.redis + "\n", LORAFLEET_UID)
    missing = sorted({p.parent.name for p in files if not p.parent.is_dir()})
    if missing:
        raise FileNotFoundError(f"no volume mounted for {', '.join(missing)} under {root}")
    return [path for path, (text, uid) in files.items() if write_if_changed(path, text, uid)]


def creds_raw(creds: Secrets) -> dict:
    return {"users": creds.users, "tenants": creds.tenants, "workers": creds.workers, "redis": creds.redis}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lorafleet.cli.compose_init", description="every credential into named volumes, one per consumer"
    )
    parser.add_argument("--root", type=Path, required=True, help="the directory every secrets volume is mounted under")
    parser.add_argument("--workers", default=",".join(DEFAULT_WORKERS), help="worker ids, comma separated")
    parser.add_argument("--nats-cluster", default="", help="NATS node hostnames, comma separated (cluster profile)")
    parser.add_argument("--import", dest="imported", type=Path, help="nats-users.json of `nats_auth init` to use")
    parser.add_argument("--tls", action="store_true", help="require TLS (certificates at /etc/nats/tls)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    workers = [w for w in args.workers.split(",") if w]
    nodes = [n for n in args.nats_cluster.split(",") if n]
    try:
        written = init_volumes(args.root, workers, nodes, args.imported, args.tls)
    except FileNotFoundError as e:
        sys.exit(f"lorafleet-init: {e}")
    print(f"wrote {len(written)} file(s) under {args.root}" if written else f"{args.root}: up to date", file=sys.stderr)


if __name__ == "__main__":
    main()
