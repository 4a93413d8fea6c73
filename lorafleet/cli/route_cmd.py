"""``lorafleet route ...`` and ``lorafleet policy ...``: a tenant's task routes and the routing
policies (a tenant's, or the platform's), as registry ops over NATS (the admin NATS user). Every
change is versioned and audited by the registry; ``POST /admin/route/explain`` on the gateway
says which rule a request matches."""

import argparse
import asyncio
from pathlib import Path

from pydantic import BaseModel, TypeAdapter, ValidationError

from lorafleet.cli.adapter_cmd import actor
from lorafleet.cli.bus_cli import answer, bus_options
from lorafleet.cli.tenant_cmd import call
from shared.errors import LorafleetError
from shared.schemas import (
    DeleteRoutesRequest,
    GetPoliciesRequest,
    GetRoutesRequest,
    PoliciesReply,
    PolicyRule,
    RoutesReply,
    RouteTarget,
    SetPoliciesRequest,
    SetRoutesRequest,
)

RULES = TypeAdapter(list[PolicyRule])


def target(text: str) -> RouteTarget:
    """``adapter`` or ``adapter@version``."""
    name, sep, version = text.partition("@")
    if sep and not version.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: a version after @ is a positive integer")
    return RouteTarget(adapter=name, version=int(version) if sep else None)


async def _route(args: argparse.Namespace) -> BaseModel:
    who = actor()
    if args.sub == "show":
        return await call(args.nats_url, "routes", GetRoutesRequest(tenant_id=args.tenant), RoutesReply)
    if args.sub == "delete":
        message = DeleteRoutesRequest(tenant_id=args.tenant, task=args.task, actor=who)
        return await call(args.nats_url, "routes_delete", message, RoutesReply)
    current = await call(args.nats_url, "routes", GetRoutesRequest(tenant_id=args.tenant), RoutesReply)
    assert isinstance(current, RoutesReply)
    routes = {**current.routes.routes, args.task: args.target}  # one task added or replaced, the rest kept
    return await call(args.nats_url, "routes_set", SetRoutesRequest(tenant_id=args.tenant, routes=routes, actor=who),
                      RoutesReply)  # fmt: skip


async def _policy(args: argparse.Namespace, rules: list[PolicyRule]) -> BaseModel:
    tenant = None if args.platform else args.tenant
    if args.sub == "show":
        return await call(args.nats_url, "policies", GetPoliciesRequest(tenant_id=tenant), PoliciesReply)
    message = SetPoliciesRequest(tenant_id=tenant, rules=rules, actor=actor())
    return await call(args.nats_url, "policies_set", message, PoliciesReply)


def _print(reply: BaseModel) -> None:
    if isinstance(reply, RoutesReply):
        table = reply.routes
        print(f"tenant {table.tenant_id}, revision {table.revision}")
        for task, to in sorted(table.routes.items()):
            print(f"  task:{task:<30} -> {to.model}")
    elif isinstance(reply, PoliciesReply):
        policies = reply.policies
        print(
            f"{'platform' if policies.tenant_id is None else f'tenant {policies.tenant_id}'}, revision {policies.revision}"
        )
        for i, rule in enumerate(policies.rules, start=1):
            match = rule.match.model_dump_json(exclude_none=True, exclude_defaults=True)
            print(f"  {i}. {rule.name:<24} {match} -> {rule.target.model_dump_json(exclude_none=True)}")


def run(args: argparse.Namespace) -> int:
    try:
        rules = (
            RULES.validate_json(Path(args.file).read_text()) if args.command == "policy" and args.sub == "set" else []
        )
        reply = asyncio.run(_route(args) if args.command == "route" else _policy(args, rules))
    except LorafleetError as e:
        print(f"error ({e.code}): {e.message}")
        return 1
    except (ValidationError, OSError) as e:
        print(f"error (invalid_request): {e}")
        return 1
    return answer(reply, args.json, _print)


def register(subparsers: argparse._SubParsersAction) -> None:
    opts = bus_options()
    route = subparsers.add_parser("route", help="a tenant's task routes (task:<name> -> adapter)")
    routes = route.add_subparsers(dest="sub", required=True)
    put = routes.add_parser("set", parents=[opts], help="route a task to an adapter (the tenant's other routes kept)")
    put.add_argument("tenant")
    put.add_argument("task")
    put.add_argument("target", type=target, help="adapter or adapter@version")
    routes.add_parser("show", parents=[opts], help="the tenant's routing table").add_argument("tenant")
    delete = routes.add_parser("delete", parents=[opts], help="one task's route, or (no task) the whole table")
    delete.add_argument("tenant")
    delete.add_argument("task", nargs="?")
    policy = subparsers.add_parser("policy", help="routing policies: ordered rules, a tenant's or the platform's")
    policies = policy.add_subparsers(dest="sub", required=True)
    for name, text in (("set", "replace the rules with a JSON file's list"), ("show", "the rules in order"),
                       ("delete", "remove every rule")):  # fmt: skip
        parser = policies.add_parser(name, parents=[opts], help=text)
        scope = parser.add_mutually_exclusive_group(required=True)
        scope.add_argument("--tenant")
        scope.add_argument("--platform", action="store_true", help="the platform-wide rules (evaluated first)")
        if name == "set":
            parser.add_argument("--file", required=True, help="a JSON list of rules (see docs/api.md)")
    for parser in (routes, policies):
        for choice in parser.choices.values():
            choice.set_defaults(func=run)
