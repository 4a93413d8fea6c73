"""``lorafleet adapter ...``: push, inspect and move adapters through their lifecycle over NATS."""

import argparse
import asyncio
import getpass
import json
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path

import nats
import nats.errors
from nats.aio.client import Client as NATS
from pydantic import BaseModel

from lorafleet.evaluation.release import PROMOTE_TIMEOUT_S
from shared import signing, subjects
from shared.adapter_format import file_digests, read_adapter_dir
from shared.base_model import resolve_model_dir
from shared.bus import request
from shared.config import CommonSettings
from shared.errors import InvalidRequest, LorafleetError, NoResponders, ServiceUnavailable, UpstreamTimeout
from shared.eval_set import EVAL_SET_FILE, parse_eval_set
from shared.fingerprint import fingerprint_model_dir
from shared.schemas import (
    AdapterRecord,
    AdapterRecordsReply,
    AttachEvalSetRequest,
    GetAdapterRequest,
    ListAdaptersRequest,
    ListPinsRequest,
    PinRecord,
    PinRequest,
    PinsReply,
    PromoteRequest,
    RegisterRequest,
    RetireRequest,
    RevokeRequest,
    RollbackRequest,
    RolloutRequest,
)

TIMEOUT_S = 30.0
PUSH_ATTEMPTS = 3  # a push whose answer was lost (a timeout, a registry replica gone) is sent again
PUSH_RETRY_S = 1.0


def actor() -> str:
    """Who the audit trail names for a CLI change: ``cli:<user>``, or LF_ACTOR."""
    name = os.environ.get("LF_ACTOR") or f"cli:{getpass.getuser()}"
    return re.sub(r"[^A-Za-z0-9_.:@-]", "-", name)[:128]


async def cli_connect(url: str) -> NATS:
    """A short-lived client: no reconnect loop, no connection-state logging on stdout."""

    async def quiet(_: Exception) -> None:  # the failure is reported once, below
        return None

    try:
        settings = CommonSettings()
        credentials = settings.nats_credentials()
        user, password = credentials if credentials else (None, None)
        return await nats.connect(servers=[u.strip() for u in url.split(",")], name="lorafleet-cli", connect_timeout=2,
                                  max_reconnect_attempts=1, allow_reconnect=False, error_cb=quiet,
                                  user=user, password=password, tls=settings.nats_tls())  # fmt: skip
    except (OSError, nats.errors.Error) as e:
        raise ServiceUnavailable(f"cannot reach NATS at {url}: {e}") from None


async def call(nc: NATS, op: str, message: BaseModel) -> AdapterRecordsReply:
    timeout_s = PROMOTE_TIMEOUT_S if op == "promote" else TIMEOUT_S  # a promote runs the eval set first
    return await request(nc, subjects.registry(op), message, AdapterRecordsReply, timeout_s)


async def push_adapter(
    nc: NATS,
    directory: Path | None,
    *,
    adapter_id: str,
    tenant_id: str,
    task_type: str,
    base_fingerprint: str,
    sign_key: Path | None = None,
    aliases: list[str] | None = None,
    scopes: list[str] | None = None,
    who: str = "cli",
    source_uri: str | None = None,
    eval_set: Path | None = None,
) -> AdapterRecord:
    """Upload the two files (and ``eval_set``, the version's own eval set, as ``eval.jsonl``), sign the
    manifest for the next version, and register it.

    With ``source_uri`` nothing is uploaded: the registry fetches the files from that allow-listed
    remote source; ``directory`` is then the local copy the signature is made over (needed only
    with ``sign_key``). The signer's name is the key file's stem (``keys gen NAME`` writes ``NAME.key``)."""
    if directory is None and (source_uri is None or sign_key is not None):
        raise InvalidRequest("push needs the adapter directory (with --source-uri, to sign its files)")
    files = read_adapter_dir(directory) if directory is not None else {}
    if eval_set is not None:
        if source_uri is not None:
            raise InvalidRequest("--eval-set goes with an upload; attach one to a fetched version (attach-eval)")
        data = await asyncio.to_thread(eval_set.read_bytes)
        parse_eval_set(data)  # refused here rather than after the upload
        files[EVAL_SET_FILE] = data
    versions = (await call(nc, "get", GetAdapterRequest(adapter_id=adapter_id))).records
    version = versions[-1].version + 1 if versions else 1
    signature = signer = None
    if sign_key is not None:
        digests = file_digests(files)
        manifest = signing.manifest_bytes(digests, adapter_id, version, tenant_id, base_fingerprint)
        signature = signing.sign(manifest, signing.load_private_key(await asyncio.to_thread(sign_key.read_bytes)))
        signer = sign_key.stem
    push_key = secrets.token_hex(16)  # every attempt of this push: the registry stores it once
    for attempt in range(1, PUSH_ATTEMPTS + 1):
        upload_id = None
        if source_uri is None:  # the registry drops an upload once it has read it: a retry sends its own
            upload_id = secrets.token_hex(12)
            uploads = await nc.jetstream().object_store(subjects.ADAPTER_UPLOADS_BUCKET)
            for name, data in files.items():
                await uploads.put(f"{upload_id}/{name}", data)
        req = RegisterRequest(
            adapter_id=adapter_id,
            tenant_id=tenant_id,
            task_type=task_type,
            version=version,
            upload_id=upload_id,
            source_uri=source_uri,
            signature=signature,
            signer=signer,
            aliases=aliases or [],
            allowed_scopes=scopes or [],
            push_key=push_key,
            wait_s=TIMEOUT_S if source_uri is not None else None,  # the registry cancels its fetch when this gives up
            actor=who,
        )
        try:
            return (await call(nc, "register", req)).records[0]
        except (UpstreamTimeout, NoResponders, ServiceUnavailable):
            if attempt == PUSH_ATTEMPTS:
                raise
            await asyncio.sleep(PUSH_RETRY_S * attempt)  # its answer lost, or its replica gone: the same push again
    raise AssertionError("unreachable")


def _print(records: list[AdapterRecord], as_json: bool) -> None:
    if as_json:
        print(json.dumps([r.model_dump() for r in records], indent=2))
        return
    print(f"{'adapter':<24} {'ver':>4} {'tenant':<12} {'status':<10} {'traffic':>7} {'rank':>4}  checksum")
    for r in records:
        print(
            f"{r.adapter_id:<24} {r.version:>4} {r.tenant_id:<12} {r.status:<10} "
            f"{r.traffic_percent:>6.1f}% {r.rank:>4}  {r.digest[:12]}"
        )


def _print_pins(pins: list[PinRecord], as_json: bool) -> None:
    if as_json:
        print(json.dumps([p.model_dump() for p in pins], indent=2))
        return
    print(f"{'adapter':<24} {'version':<8} {'worker':<16} {'tenant':<12} actor")
    for p in pins:
        version = "served" if p.version is None else str(p.version)
        print(f"{p.adapter_id:<24} {version:<8} {p.worker_id or 'every':<16} {p.tenant_id:<12} {p.actor}")


async def _pins(args: argparse.Namespace) -> list[PinRecord]:
    """pin, unpin (an operator's: any tenant's adapter) and the pins listing."""
    nc = await cli_connect(args.nats_url)
    try:
        if args.adapter_cmd == "pins":
            message: BaseModel = ListPinsRequest(adapter_id=args.id)
        else:
            message = PinRequest(adapter_id=args.id, version=args.version, worker_id=args.worker, actor=actor())
        op = subjects.registry(args.adapter_cmd)
        return (await request(nc, op, message, PinsReply, TIMEOUT_S)).pins
    finally:
        await nc.drain()


async def _run(args: argparse.Namespace) -> list[AdapterRecord]:
    if getattr(args, "skip_eval", False) and not args.reason:
        raise InvalidRequest("--skip-eval needs --reason: passing a version unevaluated is audited with it")
    nc = await cli_connect(args.nats_url)
    try:
        who = actor()
        if args.adapter_cmd == "push":
            base_dir = resolve_model_dir(args.base_model_dir)
            record = await push_adapter(
                nc, args.dir, adapter_id=args.id, tenant_id=args.tenant, task_type=args.task,
                base_fingerprint=fingerprint_model_dir(base_dir), sign_key=args.sign_key,
                aliases=args.alias, scopes=args.scope, who=who, source_uri=args.source_uri,
                eval_set=args.eval_set,
            )  # fmt: skip
            return [record]
        ops: dict[str, Callable[[], tuple[str, BaseModel]]] = {
            "list": lambda: ("adapters", ListAdaptersRequest(tenant_id=args.tenant)),
            "show": lambda: ("get", GetAdapterRequest(adapter_id=args.id, version=args.version)),
            "promote": lambda: ("promote", PromoteRequest(adapter_id=args.id, version=args.version,
                                                          traffic_percent=args.percent, skip_eval=args.skip_eval,
                                                          reason=args.reason, actor=who)),
            "attach-eval": lambda: ("attach_eval_set", AttachEvalSetRequest(
                adapter_id=args.id, version=args.version, eval_set=args.file.read_text(), actor=who)),
            "rollout": lambda: ("rollout", RolloutRequest(adapter_id=args.id, traffic_percent=args.percent, actor=who)),
            "rollback": lambda: ("rollback", RollbackRequest(adapter_id=args.id, reason=args.reason, actor=who)),
            "retire": lambda: ("retire", RetireRequest(adapter_id=args.id, version=args.version, actor=who)),
            "revoke": lambda: ("revoke", RevokeRequest(adapter_id=args.id, version=args.version, actor=who)),
        }  # fmt: skip
        op, message = ops[args.adapter_cmd]()
        return (await call(nc, op, message)).records
    finally:
        await nc.drain()


def run(args: argparse.Namespace) -> int:
    try:
        if args.adapter_cmd in ("pin", "unpin", "pins"):
            _print_pins(asyncio.run(_pins(args)), args.json)
            return 0
        records = asyncio.run(_run(args))
    except LorafleetError as e:
        print(f"error ({e.code}): {e.message}")
        return 1
    _print(records, args.json)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    opts = argparse.ArgumentParser(add_help=False)
    opts.add_argument("--nats-url", default=os.environ.get("LF_NATS_URL", "nats://127.0.0.1:4222"))
    opts.add_argument("--json", action="store_true", help="print records as JSON")
    adapter = subparsers.add_parser("adapter", help="push and manage LoRA adapters in the registry")
    adapter.set_defaults(func=run)
    sub = adapter.add_subparsers(dest="adapter_cmd", required=True)
    push = sub.add_parser(
        "push",
        parents=[opts],
        help="upload (or have the registry fetch), sign and register a new version (status staging)",
        description="Register a new adapter version. From DIR the two files are uploaded; with --source-uri the "
        "registry fetches them from an allow-listed s3:// or https:// prefix (see `lorafleet source`), and DIR, if "
        "given, is the local copy --sign-key signs. Either way the files pass the same admission checks.",
    )
    push.add_argument(
        "dir", type=Path, nargs="?", help="directory with adapter_model.safetensors + adapter_config.json"
    )
    push.add_argument(
        "--source-uri",
        help="s3://bucket/prefix/ or https://host/path/ holding the two files; the registry fetches them "
        "(needs the prefix allow-listed for --tenant and remote sources enabled on the registry)",
    )
    push.add_argument("--id", required=True)
    push.add_argument("--tenant", required=True, help='owner tenant, or "shared"')
    push.add_argument("--task", required=True, help="task type, e.g. summarization")
    push.add_argument("--sign-key", type=Path, help="Ed25519 private key (NAME.key from `keys gen`)")
    push.add_argument("--alias", action="append", default=[], help="extra name clients may ask for")
    push.add_argument("--scope", action="append", default=[], help='tenant allowed to use a shared adapter, or "*"')
    push.add_argument(
        "--eval-set", type=Path, help="the version's own eval set (JSONL), uploaded and signed with it as eval.jsonl"
    )
    push.add_argument("--base-model-dir", help="base model the adapter is for; default: the embedded SmolLM2")
    sub.add_parser("list", parents=[opts], help="every adapter version").add_argument("--tenant")
    show = sub.add_parser("show", parents=[opts], help="one adapter's versions")
    show.add_argument("id")
    show.add_argument("--version", type=int)
    promote = sub.add_parser("promote", parents=[opts], help="staging -> canary at --percent (100 = production)")
    promote.add_argument("id")
    promote.add_argument("version", type=int)
    promote.add_argument("--percent", type=float, default=1.0)
    promote.add_argument(
        "--skip-eval",
        action="store_true",
        help="pass the version without the registry's run of its eval set (operator only; needs --reason, audited)",
    )
    promote.add_argument("--reason", help="why, for the audit trail")
    attach = sub.add_parser(
        "attach-eval", parents=[opts], help="attach (or replace) a version's eval set, which the release gate runs"
    )
    attach.add_argument("id")
    attach.add_argument("version", type=int)
    attach.add_argument("file", type=Path, help="JSONL eval set (prompt or messages, expected, scorer)")
    rollout = sub.add_parser("rollout", parents=[opts], help="set the canary's traffic share; 100 makes it production")
    rollout.add_argument("id")
    rollout.add_argument("--percent", type=float, required=True)
    rollback = sub.add_parser("rollback", parents=[opts], help="undo the latest rollout step")
    rollback.add_argument("id")
    rollback.add_argument("--reason", help="why, for the audit trail")
    retire = sub.add_parser("retire", parents=[opts], help="stop serving one version")
    retire.add_argument("id")
    retire.add_argument("version", type=int)
    revoke = sub.add_parser("revoke", parents=[opts], help="security stop: one version, or all without --version")
    revoke.add_argument("id")
    revoke.add_argument("--version", type=int)
    for name, text in (("pin", "keep an adapter in a GPU slot (every worker, or --worker), across restarts"),
                       ("unpin", "remove a pin (the same --version and --worker it was made with)")):  # fmt: skip
        pin = sub.add_parser(name, parents=[opts], help=text)
        pin.add_argument("id")
        pin.add_argument("--worker", help="one worker's id; default: every worker")
        pin.add_argument("--version", type=int, help="one version; default: whatever version is served")
    sub.add_parser("pins", parents=[opts], help="the pins, of one adapter or all").add_argument("id", nargs="?")
