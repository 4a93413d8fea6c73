"""The ``lorafleet`` command: ``up`` and the admin subcommands."""

import argparse
import sys

from lorafleet.cli import (
    adapter_cmd,
    audit_cmd,
    demo_cmd,
    eval_cmd,
    experiment_cmd,
    kernels_cmd,
    keys_cmd,
    nats_auth,
    release_cmd,
    route_cmd,
    source_cmd,
    tenant_cmd,
    up,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafleet", description="multi-tenant multi-LoRA serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (
        up,
        demo_cmd,
        adapter_cmd,
        keys_cmd,
        audit_cmd,
        nats_auth,
        tenant_cmd,
        route_cmd,
        experiment_cmd,
        eval_cmd,
        release_cmd,
        source_cmd,
        kernels_cmd,
    ):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args) or 0)
