"""``lorafleet tenant ...``, ``lorafleet key ...``, ``lorafleet quota set``: tenants, their API keys
and limits, as registry ops over NATS (the admin NATS user)."""

import argparse
import asyncio
from collections.abc import Callable

from pydantic import BaseModel

from lorafleet.cli.adapter_cmd import TIMEOUT_S, actor, cli_connect
from lorafleet.cli.bus_cli import answer, bus_options
from shared import subjects
from shared.bus import request
from shared.errors import LorafleetError
from shared.schemas import (
    SLO_CLASSES,
    ApiKeyCreatedReply,
    ApiKeysReply,
    CreateApiKeyRequest,
    CreateTenantRequest,
    ListApiKeysRequest,
    ListTenantsRequest,
    RevokeApiKeyRequest,
    SetQuotaRequest,
    TenantQuota,
    TenantsReply,
)

Op = tuple[str, BaseModel, type[BaseModel]]


def _quota(args: argparse.Namespace) -> TenantQuota:
    return TenantQuota(
        requests_per_min=args.rpm,
        tokens_per_min=args.tpm,
        max_concurrent=args.concurrent,
        max_gpu_adapter_slots=args.gpu_slots,
        slo_tier=args.tier,
        enforce=args.enforce,
    )


def _op(args: argparse.Namespace) -> Op:
    who = actor()
    ops: dict[str, Callable[[], Op]] = {
        "tenant create": lambda: ("tenant_create", CreateTenantRequest(tenant_id=args.name, actor=who), TenantsReply),
        "tenant list": lambda: ("tenants", ListTenantsRequest(), TenantsReply),
        "key create": lambda: (
            "api_key_create",
            CreateApiKeyRequest(tenant_id=args.tenant, scopes=["inference", *args.scope], actor=who),
            ApiKeyCreatedReply,
        ),
        "key revoke": lambda: ("api_key_revoke", RevokeApiKeyRequest(key_id=args.key_id, actor=who), ApiKeysReply),
        "key list": lambda: ("api_keys", ListApiKeysRequest(tenant_id=args.tenant), ApiKeysReply),
        "quota set": lambda: (
            "quota_set",
            SetQuotaRequest(tenant_id=args.tenant, quota=_quota(args), actor=who),
            TenantsReply,
        ),
    }
    return ops[f"{args.command} {args.sub}"]()


async def call(nats_url: str, op: str, message: BaseModel, reply: type[BaseModel]) -> BaseModel:
    nc = await cli_connect(nats_url)
    try:
        return await request(nc, subjects.registry(op), message, reply, TIMEOUT_S)
    finally:
        await nc.drain()


def _print(reply: BaseModel) -> None:
    if isinstance(reply, ApiKeyCreatedReply):
        print(f"key {reply.info.key_id} of tenant {reply.info.tenant_id}, scopes {','.join(reply.info.scopes)}")
        print(f"{reply.key}\n(shown once: store it now)")
    elif isinstance(reply, ApiKeysReply):
        for k in reply.keys:
            print(f"{k.key_id}  {k.tenant_id:<16} {','.join(k.scopes):<28} {'revoked' if k.revoked else 'active'}")
    elif isinstance(reply, TenantsReply):
        for t in reply.tenants:
            print(f"{t.tenant_id:<20} {t.quota.model_dump_json(exclude_none=True)}")


def run(args: argparse.Namespace) -> int:
    op, message, reply_type = _op(args)
    try:
        reply = asyncio.run(call(args.nats_url, op, message, reply_type))
    except LorafleetError as e:
        print(f"error ({e.code}): {e.message}")
        return 1
    return answer(reply, args.json, _print)


def register(subparsers: argparse._SubParsersAction) -> None:
    opts = bus_options()
    tenant = subparsers.add_parser("tenant", help="tenants of the platform").add_subparsers(dest="sub", required=True)
    tenant.add_parser("create", parents=[opts], help="a new tenant").add_argument("name")
    tenant.add_parser("list", parents=[opts], help="every tenant and its quota")
    key = subparsers.add_parser("key", help="API keys of tenants").add_subparsers(dest="sub", required=True)
    create = key.add_parser("create", parents=[opts], help="a new key (printed once); always has the inference scope")
    create.add_argument("--tenant", required=True)
    create.add_argument("--scope", action="append", default=[], choices=["admin", "platform_admin"])
    key.add_parser("revoke", parents=[opts], help="revoke a key at once").add_argument("key_id")
    key.add_parser("list", parents=[opts], help="keys without secrets").add_argument("--tenant")
    quota = subparsers.add_parser("quota", help="tenant limits").add_subparsers(dest="sub", required=True)
    qset = quota.add_parser(
        "set", parents=[opts], help="replace a tenant's limits (omitted = the platform default, 0 = unlimited)"
    )
    qset.add_argument("tenant")
    qset.add_argument("--rpm", type=int, help="requests per minute")
    qset.add_argument("--tpm", type=int, help="tokens per minute")
    qset.add_argument("--concurrent", type=int, help="requests in flight at once")
    qset.add_argument("--gpu-slots", type=int, help="GPU adapter slots the tenant may hold")
    qset.add_argument(
        "--tier", choices=SLO_CLASSES, help="the highest SLO class its requests may ask for (x-lorafleet-priority)"
    )
    qset.add_argument(
        "--enforce",
        choices=["soft", "hard"],
        default="soft",
        help="soft: at its slots the tenant evicts its own first, others' when none of its own can go; "
        "hard: it waits for one of its own slots and never evicts another tenant's adapter",
    )
    for parser in (tenant, key, quota):
        for choice in parser.choices.values():
            choice.set_defaults(func=run)
