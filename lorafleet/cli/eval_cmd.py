"""``lorafleet eval <adapter>@<version>``: score a version on an eval set through the gateway, beside
the base model (``--base``), and record the score with the version as advisory: the release gate runs
the version's own eval set itself and never reads a client's score."""

import argparse
import asyncio
import os
from pathlib import Path

from lorafleet.cli.adapter_cmd import actor, cli_connect
from lorafleet.cli.demo_fit import DEMO_ADAPTERS
from lorafleet.evaluation.release import Evaluation, evaluate, record_eval, summary
from lorafleet.evaluation.runner import gateway_client, load_eval_set
from shared.base_model import EMBEDDED_MODEL_NAME
from shared.errors import InvalidRequest, LorafleetError


def parse_target(target: str) -> tuple[str, int]:
    adapter_id, _, version = target.partition("@")
    if not version.isdigit() or int(version) < 1:
        raise InvalidRequest(f"{target!r}: name a version, as <adapter>@<version>")
    return adapter_id, int(version)


def eval_set_path(adapter_id: str, given: Path | None) -> Path:
    """The ``--eval-set`` file, else the shipped demo adapter's ``lorafleet/demo_adapters/<adapter>/eval.jsonl``."""
    path = given or DEMO_ADAPTERS / adapter_id / "eval.jsonl"
    if not path.is_file():
        raise InvalidRequest(f"no eval set at {path}: pass --eval-set")
    return path


def gateway_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway-url", default=os.environ.get("LF_GATEWAY_URL", "http://127.0.0.1:8000"))
    parser.add_argument(
        "--api-key",
        default=os.environ.get("LF_API_KEY"),
        help="the owner tenant's key; an admin-scoped one may evaluate a staging version",
    )
    parser.add_argument("--nats-url", default=os.environ.get("LF_NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--eval-set", type=Path, help="JSONL eval set; default: the shipped example's")
    parser.add_argument("--max-tokens", type=int, default=48)


async def _run(args: argparse.Namespace) -> tuple[str, int, Evaluation]:
    adapter_id, version = parse_target(args.target)
    eval_set = load_eval_set(eval_set_path(adapter_id, args.eval_set))
    client = gateway_client(args.gateway_url, args.api_key or "")
    evaluation = await evaluate(
        client,
        adapter_id,
        version,
        eval_set,
        base_model=args.base_model if args.base else None,
        max_tokens=args.max_tokens,
    )
    if not args.no_record:
        nc = await cli_connect(args.nats_url)
        try:
            await record_eval(nc, adapter_id, version, evaluation, actor())
        finally:
            await nc.drain()
    return adapter_id, version, evaluation


def run(args: argparse.Namespace) -> int:
    try:
        adapter_id, version, evaluation = asyncio.run(_run(args))
    except LorafleetError as e:
        print(f"error ({e.code}): {e.message}")
        return 1
    if args.verbose:
        for answer, score in zip(evaluation.adapter.answers, evaluation.adapter.scores, strict=True):
            print(f"  [{score:.0f}] {answer!r}")
    print(summary(adapter_id, version, evaluation) + ("" if args.no_record else " (recorded)"))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="score an adapter version on an eval set through the gateway (recorded as advisory only)"
    )
    p.add_argument("target", help="<adapter>@<version>")
    p.add_argument("--base", action="store_true", help="score the base model on the same set, beside it")
    p.add_argument("--base-model", default=EMBEDDED_MODEL_NAME)
    p.add_argument("--no-record", action="store_true", help="print only; leave the registry record as it is")
    p.add_argument("--verbose", action="store_true", help="print every answer with its score")
    gateway_options(p)
    p.set_defaults(func=run)
