"""``lorafleet release <adapter> --version V --steps 1,10,50,100``: a guarded canary rollout."""

import argparse
import asyncio

from lorafleet.cli.adapter_cmd import actor, cli_connect
from lorafleet.cli.eval_cmd import eval_set_path, gateway_options
from lorafleet.evaluation.canary import CanaryOutcome, CanaryPolicy, run_canary
from lorafleet.evaluation.runner import gateway_client, load_eval_set
from shared.errors import InvalidRequest, LorafleetError


def parse_steps(text: str) -> list[float]:
    steps = [float(s) for s in text.split(",") if s.strip()]
    if not steps or any(not 0 < s <= 100 for s in steps) or steps != sorted(set(steps)):
        raise InvalidRequest(f"--steps {text!r}: increasing traffic percentages in (0, 100]")
    return steps


async def _run(args: argparse.Namespace) -> CanaryOutcome:
    eval_set = load_eval_set(eval_set_path(args.adapter, args.eval_set))
    policy = CanaryPolicy(
        max_quality_drop=args.max_quality_drop,
        max_latency_ratio=args.max_latency_ratio,
        max_error_rate_increase=args.max_error_increase,
    )
    nc = await cli_connect(args.nats_url)
    try:
        return await run_canary(
            nc,
            gateway_client(args.gateway_url, args.api_key or ""),
            args.adapter,
            args.version,
            parse_steps(args.steps),
            eval_set,
            actor=actor(),
            policy=policy,
            max_tokens=args.max_tokens,
            force=args.force,
        )
    finally:
        await nc.drain()


def run(args: argparse.Namespace) -> int:
    try:
        outcome = asyncio.run(_run(args))
    except LorafleetError as e:
        print(f"error ({e.code}): {e.message}")
        return 1
    if outcome.released:
        print(f"{args.adapter} v{args.version} released at {outcome.percent:g}%")
        return 0
    return 2


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("release", help="canary rollout with automatic rollback on regression")
    p.add_argument("adapter")
    p.add_argument("--version", type=int, required=True)
    p.add_argument("--steps", default="1,10,50,100", help="traffic percentages, comma separated")
    p.add_argument("--max-quality-drop", type=float, default=0.05)
    p.add_argument("--max-latency-ratio", type=float, default=2.0)
    p.add_argument("--max-error-increase", type=float, default=0.05)
    p.add_argument("--force", action="store_true", help="start the canary past the release gate (audited)")
    gateway_options(p)
    p.set_defaults(func=run)
