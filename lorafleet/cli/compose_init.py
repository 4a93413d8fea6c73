"""compose's one-shot init service: every credential into named volumes, one volume per consumer.

``python -m lorafleet.cli.compose_init --root /secrets --workers cpu-1,cpu-2 [--nats-cluster nats-1,...]``
expects one directory (a named volume) per consumer under ``--root`` and writes, when absent:
  state/nats-users.json        every password (only the init service mounts ``state``)
  nats/nats.conf               the single-node server config, users and permissions included
  nats/auth.conf               the same ``accounts`` block alone (the cluster config includes it)
  nats/cluster.conf            route credentials and routes (``--nats-cluster``: the cluster profile)
  redis/redis.conf, password   ``requirepass`` for redis-server, the password for its health probe
  <service>/metrics-token      the bearer token of every /metrics (gateway, registry, scheduler, auditor, workers)
  prometheus/metrics-token     the same token, which Prometheus's scrape configs send
  grafana/admin-password       Grafana's admin password (``--grafana``)
  <nats data dirs>             handed to the NATS user (``--nats-data``): nats-server runs as NATS_UID, not root
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
NATS_UID = 10002  # the official nats image runs as root unless told otherwise: compose and k8s run it as this
PROMETHEUS_UID = 65534  # the official prometheus image's nobody
GRAFANA_UID = 472  # the official grafana image's grafana user
ROOT_UID = 0
NATS_PASSWORD = "nats-password"
REDIS_PASSWORD = "redis-password"
METRICS_TOKEN = "metrics-token"
GRAFANA_PASSWORD = "admin-password"
PROMETHEUS = "prometheus"
GRAFANA = "grafana"


def write_if_changed(path: Path, text: str, uid: int | None) -> bool:
    """Write ``text`` to ``path`` (0600, owned by ``uid`` when running as root) unless it holds it already;
    a file that does is still handed to ``uid`` (its reader changed: NATS once ran as root)."""
    changed = not (path.exists() and path.read_text() == text)
    if changed:
        path.touch(mode=0o600, exist_ok=True)
        path.chmod(0o600)
        path.write_text(text)
    if uid is not None and os.geteuid() == 0:
        os.chown(path, uid, uid)
        os.chown(path.parent, uid, uid)
    return changed


def load(state: Path, workers: Sequence[str], imported: Path | None) -> Secrets:
    """The kept passwords, the imported file's winning over them; missing ones generated."""
    kept = json.loads(state.read_text()) if state.exists() else {}
    if imported is not None:
        raw = json.loads(imported.read_text())
        for key in ("users", "tenants", "workers"):
            kept[key] = {**kept.get(key, {}), **raw.get(key, {})}
        for key in ("redis", "metrics", "grafana"):
            kept[key] = raw.get(key) or kept.get(key, "")
    creds = Secrets(
        users=kept.get("users", {}),
        tenants=kept.get("tenants", {}),
        workers=kept.get("workers", {}),
        redis=kept.get("redis", ""),
        metrics=kept.get("metrics", ""),
        grafana=kept.get("grafana", ""),
    )
    for user in (*SERVICES, ADMIN, AUDIT_READER, ROUTE_USER):
        creds.users.setdefault(user, secrets.token_urlsafe(24))
    creds.fill()
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
    nats_data: Sequence[str] = (),
    grafana: bool = False,
) -> list[Path]:
    """Write every consumer's credentials under ``root/<consumer>``; returns the files (re)written.
    ``nats_data`` names directories under ``root`` (NATS data volumes) handed to NATS_UID; ``grafana``
    writes Grafana's admin password. Raises FileNotFoundError, writing nothing, when a consumer's
    directory (its volume) is missing."""
    state = root / STATE / SECRETS_FILE
    creds = load(state, workers, imported)
    config = json.loads(render_config(creds, COMPOSE_SERVER, COMPOSE_TLS if tls else None))
    files: dict[Path, tuple[str, int | None]] = {
        state: (json.dumps(creds.raw(), indent=2), ROOT_UID),
        root / NATS / "nats.conf": (json.dumps(config, indent=2) + "\n", NATS_UID),
        root / NATS / "auth.conf": (f"accounts: {json.dumps(config['accounts'], indent=2)}\n", NATS_UID),
        root / REDIS / "redis.conf": (f"requirepass {creds.redis}\n", REDIS_UID),
        root / REDIS / "password": (creds.redis + "\n", REDIS_UID),
    }
    if nats_cluster:
        files[root / NATS / "cluster.conf"] = (cluster_fragment(creds, nats_cluster), NATS_UID)
    files[root / PROMETHEUS / METRICS_TOKEN] = (creds.metrics + "\n", PROMETHEUS_UID)
    if grafana:
        files[root / GRAFANA / GRAFANA_PASSWORD] = (creds.grafana + "\n", GRAFANA_UID)
    for user in (*SERVICES, ADMIN):
        files[root / user / NATS_PASSWORD] = (creds.users[user] + "\n", LORAFLEET_UID)
        if user in REDIS_USERS:
            files[root / user / REDIS_PASSWORD] = (creds.redis + "\n", LORAFLEET_UID)
        if user in SERVICES:
            files[root / user / METRICS_TOKEN] = (creds.metrics + "\n", LORAFLEET_UID)
    for worker in workers:
        files[root / worker_user(worker) / NATS_PASSWORD] = (creds.workers[worker] + "\n", LORAFLEET_UID)
        files[root / worker_user(worker) / REDIS_PASSWORD] = (creds.redis + "\n", LORAFLEET_UID)
        files[root / worker_user(worker) / METRICS_TOKEN] = (creds.metrics + "\n", LORAFLEET_UID)
    missing = sorted(
        {p.parent.name for p in files if not p.parent.is_dir()} | {d for d in nats_data if not (root / d).is_dir()}
    )
    if missing:
        raise FileNotFoundError(f"no volume mounted for {', '.join(missing)} under {root}")
    for data in nats_data:
        hand_over(root / data, NATS_UID)
    return [path for path, (text, uid) in files.items() if write_if_changed(path, text, uid)]


def hand_over(directory: Path, uid: int) -> None:
    """Give ``directory`` and everything in it to ``uid`` (when running as root): a data volume written
    by a NATS that once ran as root stays usable by the non-root one."""
    if os.geteuid() != 0:
        return
    for path in (directory, *directory.rglob("*")):
        if path.lstat().st_uid != uid and not path.is_symlink():
            os.chown(path, uid, uid)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lorafleet.cli.compose_init", description="every credential into named volumes, one per consumer"
    )
    parser.add_argument("--root", type=Path, required=True, help="the directory every secrets volume is mounted under")
    parser.add_argument("--workers", default=",".join(DEFAULT_WORKERS), help="worker ids, comma separated")
    parser.add_argument("--nats-cluster", default="", help="NATS node hostnames, comma separated (cluster profile)")
    parser.add_argument("--import", dest="imported", type=Path, help="nats-users.json of `nats_auth init` to use")
    parser.add_argument("--tls", action="store_true", help="require TLS (certificates at /etc/nats/tls)")
    parser.add_argument("--nats-data", default="", help="NATS data volumes under --root, comma separated (made NATS's)")
    parser.add_argument("--grafana", action="store_true", help="write Grafana's admin password (grafana/)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    workers = [w for w in args.workers.split(",") if w]
    nodes = [n for n in args.nats_cluster.split(",") if n]
    try:
        data = [d for d in args.nats_data.split(",") if d]
        written = init_volumes(args.root, workers, nodes, args.imported, args.tls, data, args.grafana)
    except FileNotFoundError as e:
        sys.exit(f"lorafleet-init: {e}")
    print(f"wrote {len(written)} file(s) under {args.root}" if written else f"{args.root}: up to date", file=sys.stderr)


if __name__ == "__main__":
    main()
