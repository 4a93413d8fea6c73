"""The ``lorafleet`` command: ``up`` and the admin subcommands."""

import argparse
import sys

from services.cli import up


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafleet", description="multi-tenant multi-LoRA serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (up,):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args) or 0)
