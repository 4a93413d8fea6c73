"""``lorafleet source ...``: the registry's allow-list of remote adapter sources (s3://, https://),
each prefix bound to the tenants that may register from it, and per-URI approvals."""

import argparse
import asyncio
import os

from pydantic import BaseModel

from lorafleet.cli.adapter_cmd import TIMEOUT_S, actor, cli_connect
from shared import subjects
from shared.bus import request
from shared.errors import LorafleetError
from shared.schemas import (
    AddSourceRequest,
    ApproveSourceRequest,
    ListSourcesRequest,
    RemoveSourceRequest,
    SourcesReply,
)

EPILOG = """\
Remote fetching is off until the registry runs with LF_REMOTE__S3_ENABLED=true and/or
LF_REMOTE__HTTPS_ENABLED=true; then `lorafleet adapter push --source-uri s3://bucket/prefix/`
registers from an allow-listed prefix, through the same checks as an upload (signature included).
Every fetch is bounded (LF_REMOTE__MAX_TOTAL_BYTES, __MAX_FILE_BYTES, __TIMEOUT_S, __MAX_FILES,
__MAX_REDIRECTS) and refuses hosts that resolve to internal addresses unless --allow-private.
"""


async def _call(args: argparse.Namespace) -> SourcesReply:
    nc = await cli_connect(args.nats_url)
    try:
        who = actor()
        message: BaseModel
        if args.source_cmd == "add":
            op, message = "source_add", AddSourceRequest(
                prefix=args.prefix, tenants=args.tenant, allow_private=args.allow_private,
                require_approval=args.require_approval, actor=who,
            )  # fmt: skip
        elif args.source_cmd == "remove":
            op, message = "source_remove", RemoveSourceRequest(prefix=args.prefix, actor=who)
        elif args.source_cmd == "approve":
            op, message = "source_approve", ApproveSourceRequest(uri=args.uri, actor=who)
        else:
            op, message = "sources", ListSourcesRequest()
        return await request(nc, subjects.registry(op), message, SourcesReply, TIMEOUT_S)
    finally:
        await nc.drain()


def run(args: argparse.Namespace) -> int:
    try:
        reply = asyncio.run(_call(args))
    except LorafleetError as e:
        print(f"error ({e.code}): {e.message}")
        return 1
    except ValueError as e:  # a prefix the request model refuses, before anything is sent
        print(f"error (invalid_request): {e}")
        return 1
    for s in reply.sources:
        flags = [f for f, on in (("allow-private", s.allow_private), ("require-approval", s.require_approval)) if on]
        print(f"{s.prefix:<48} tenants={','.join(s.tenants)} {' '.join(flags)}".rstrip())
    for a in reply.approvals:
        print(f"approved {a.uri} by {a.approved_by}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    opts = argparse.ArgumentParser(add_help=False)
    opts.add_argument("--nats-url", default=os.environ.get("LF_NATS_URL", "nats://127.0.0.1:4222"))
    source = subparsers.add_parser(
        "source",
        help="allow-list remote adapter sources (s3://, https://) per tenant",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source.set_defaults(func=run)
    sub = source.add_subparsers(dest="source_cmd", required=True)
    add = sub.add_parser("add", parents=[opts], help="allow a prefix for tenants (replaces an entry of that prefix)")
    add.add_argument("prefix", help="s3://bucket/prefix/ or https://host/path/ (ending in '/')")
    add.add_argument("--tenant", action="append", required=True, help="a tenant that may use it (repeatable)")
    add.add_argument(
        "--allow-private",
        action="store_true",
        help="its hosts may resolve to loopback/private/link-local addresses (an internal store)",
    )
    add.add_argument(
        "--require-approval", action="store_true", help="each URI under it needs `source approve` before first use"
    )
    remove = sub.add_parser("remove", parents=[opts], help="drop a prefix and the approvals under it")
    remove.add_argument("prefix")
    approve = sub.add_parser("approve", parents=[opts], help="approve one URI under a --require-approval prefix")
    approve.add_argument("uri")
    sub.add_parser("list", parents=[opts], help="the allow-list and the approved URIs")
