"""``lorafleet audit query|verify``: ask the auditor over ``lf.auditor.query`` (the admin NATS user)."""

import argparse
import asyncio
import json
import os
import sys
from datetime import datetime

from lorafleet.cli.adapter_cmd import TIMEOUT_S, cli_connect
from shared import subjects
from shared.bus import request
from shared.errors import LorafleetError
from shared.schemas import AuditQueryReply, AuditQueryRequest

VERIFY_TIMEOUT_S = 600.0  # re-hashing the whole chain takes about 2 s per 500k records


def register(sub: argparse._SubParsersAction) -> None:
    audit = sub.add_parser("audit", help="query or verify the audit trail")
    cmds = audit.add_subparsers(dest="audit_command", required=True)
    query = cmds.add_parser("query", help="records by request, tenant, adapter, kind and time range, newest first")
    query.add_argument("--tenant")
    query.add_argument("--request-id")
    query.add_argument("--adapter")
    query.add_argument("--kind")
    query.add_argument("--since", type=datetime.fromisoformat, help="ISO time, e.g. 2026-11-29T14:00")
    query.add_argument("--until", type=datetime.fromisoformat)
    query.add_argument("--before", type=int, help="the cursor a previous page printed: only older records")
    query.add_argument("--limit", type=int, default=100)
    query.set_defaults(func=run_query)
    verify = cmds.add_parser("verify", help="re-hash the chain against every signed head, or say where it breaks")
    verify.set_defaults(func=run_verify)
    for cmd in (query, verify):
        cmd.add_argument("--nats-url", default=os.environ.get("LF_NATS_URL", "nats://127.0.0.1:4222"))


async def ask(nats_url: str, query: AuditQueryRequest, timeout_s: float = TIMEOUT_S) -> AuditQueryReply:
    nc = await cli_connect(nats_url)
    try:
        return await request(nc, subjects.AUDITOR_QUERY, query, AuditQueryReply, timeout_s)
    finally:
        await nc.drain()


def run_query(args: argparse.Namespace) -> int:
    try:
        query = AuditQueryRequest(
            tenant_id=args.tenant,
            request_id=args.request_id,
            adapter_id=args.adapter,
            kind=args.kind,
            since=args.since.timestamp() if args.since else None,
            until=args.until.timestamp() if args.until else None,
            before=args.before,
            limit=args.limit,
        )
        reply = asyncio.run(ask(args.nats_url, query))
    except LorafleetError as e:
        print(f"error ({e.code}): {e.message}")
        return 1
    for record in reply.records:
        print(json.dumps(record, sort_keys=True))
    if reply.next_cursor is not None:
        print(f"more: --before {reply.next_cursor}", file=sys.stderr)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    try:
        reply = asyncio.run(ask(args.nats_url, AuditQueryRequest(limit=1, verify=True), VERIFY_TIMEOUT_S))
    except LorafleetError as e:
        print(f"error ({e.code}): {e.message}")
        return 1
    chain = reply.chain
    assert chain is not None, "the auditor answers a platform-wide query with the chain's status"
    if chain.intact:
        print(f"audit chain intact: {chain.count} records, signed up to {chain.signed_pos or 0}")
        print(f"head key: {chain.public_key}")
        return 0
    print(f"audit chain BROKEN at record {chain.broken_at}: {chain.problem}")
    return 2
