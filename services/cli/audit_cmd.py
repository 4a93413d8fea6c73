"""``lorafleet audit query|verify``: read the auditor's hash-chained index."""

import argparse
import json
import os
from datetime import datetime

from services.auditor.store import AuditStore


def register(sub: argparse._SubParsersAction) -> None:
    audit = sub.add_parser("audit", help="query or verify the audit trail")
    cmds = audit.add_subparsers(dest="audit_command", required=True)
    db_default = os.environ.get("LF_DB_PATH", ".lorafleet/audit.sqlite3")
    query = cmds.add_parser("query", help="records by request, tenant, adapter, kind and time range")
    query.add_argument("--db", default=db_default)
    query.add_argument("--tenant")
    query.add_argument("--request-id")
    query.add_argument("--adapter")
    query.add_argument("--kind")
    query.add_argument("--since", type=datetime.fromisoformat, help="ISO time, e.g. 2026-11-29T14:00")
    query.add_argument("--until", type=datetime.fromisoformat)
    query.add_argument("--limit", type=int, default=100)
    query.set_defaults(func=run_query)
    verify = cmds.add_parser("verify", help="prove the chain is intact, or say where it breaks")
    verify.add_argument("--db", default=db_default)
    verify.set_defaults(func=run_verify)


def run_query(args: argparse.Namespace) -> int:
    store = AuditStore(args.db)
    rows = store.query(
        tenant_id=args.tenant,
        request_id=args.request_id,
        adapter_id=args.adapter,
        kind=args.kind,
        since=args.since.timestamp() if args.since else None,
        until=args.until.timestamp() if args.until else None,
        limit=args.limit,
    )
    for row in rows:
        print(json.dumps({"pos": row.pos, "hash": row.hash, **row.body}, sort_keys=True))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    store = AuditStore(args.db)
    broken = store.verify()
    if broken is None:
        print(f"audit chain intact: {store.count()} records")
        return 0
    print(f"audit chain BROKEN at record {broken}: it was altered, or a record before it was dropped or moved")
    return 2
