"""``lorafleet release <adapter> <version>``: hand a staging version to the registry's release
controller and return; ``lorafleet release status [<adapter>]``: the rollouts, their steps, live
figures and decisions. The controller's gate runs the version's own eval set on a worker first;
``--eval`` also scores it on this machine and records that beside it (advisory: the gate never reads it)."""

import argparse
import asyncio
import datetime
import os

from lorafleet.cli.adapter_cmd import actor, cli_connect
from lorafleet.cli.eval_cmd import eval_set_path, gateway_options
from lorafleet.evaluation.release import PROMOTE_TIMEOUT_S, REGISTRY_TIMEOUT_S, evaluate, record_eval, summary
from lorafleet.evaluation.runner import gateway_client, load_eval_set
from shared import subjects
from shared.bus import request
from shared.errors import InvalidRequest, LorafleetError
from shared.schemas import ReleaseStartRequest, ReleaseState, ReleaseStatusReply, ReleaseStatusRequest, VersionFigures

STATUS = "status"


def _version(text: str | None) -> int:
    if text is None or not text.isdigit() or int(text) < 1:
        raise InvalidRequest(f"version {text!r}: a positive integer, as in `lorafleet release <adapter> <version>`")
    return int(text)


async def _start(args: argparse.Namespace) -> ReleaseState:
    version = _version(args.version)
    if args.skip_eval and not args.reason:
        raise InvalidRequest("--skip-eval needs --reason: passing a version unevaluated is audited with it")
    if args.eval:
        eval_set = load_eval_set(eval_set_path(args.adapter, args.eval_set))
        client = gateway_client(args.gateway_url, args.api_key or "")
        evaluation = await evaluate(
            client, args.adapter, version, eval_set, base_model=None, max_tokens=args.max_tokens
        )
        print(summary(args.adapter, version, evaluation))
    nc = await cli_connect(args.nats_url)
    try:
        if args.eval:
            await record_eval(nc, args.adapter, version, evaluation, actor())
        message = ReleaseStartRequest(
            adapter_id=args.adapter, version=version, skip_eval=args.skip_eval, reason=args.reason, actor=actor()
        )
        reply = await request(nc, subjects.registry("release_start"), message, ReleaseStatusReply, PROMOTE_TIMEOUT_S)
    finally:
        await nc.drain()
    return reply.releases[0]


async def _status(args: argparse.Namespace) -> list[ReleaseState]:
    nc = await cli_connect(args.nats_url)
    try:
        message = ReleaseStatusRequest(adapter_id=args.version)
        reply = await request(nc, subjects.registry("release_status"), message, ReleaseStatusReply, REGISTRY_TIMEOUT_S)
    finally:
        await nc.drain()
    return reply.releases


def _figures(f: VersionFigures | None) -> str:
    if f is None:
        return "-"

    def ms(value: float | None) -> str:
        return f"{value:.0f}" if value is not None else "?"

    tokens = f"{f.tokens_per_request:.1f}" if f.tokens_per_request is not None else "?"
    cost = f"{f.engine_ms_per_token:.2f}" if f.engine_ms_per_token is not None else "?"
    shadow = ""
    if f.agreement_rate is not None:  # the canary's answers to production's requests, in the shadow
        shadow = f" shadow agreement {f.agreement_rate:.1%} (prefix {f.prefix_agreement or 0:.1%}) of {f.shadow_pairs}"
    return (
        f"v{f.version}: n={f.samples} errors {f.error_rate:.1%} TTFT p50/p95 {ms(f.ttft_p50_ms)}/{ms(f.ttft_p95_ms)} ms "
        f"TPOT p50/p95 {ms(f.tpot_p50_ms)}/{ms(f.tpot_p95_ms)} ms tokens/req {tokens} engine ms/token {cost} "
        f"complaints {f.complaint_rate:.1%}{shadow}"
    )


def show(state: ReleaseState) -> str:
    """A rollout as the status command prints it."""
    steps = " -> ".join(
        f"[{s:g}%]" if i == state.step and state.phase == "running" else f"{s:g}%" for i, s in enumerate(state.steps)
    )
    baseline = f"v{state.baseline_version}" if state.baseline_version else "none"
    lines = [
        f"{state.adapter_id} v{state.version} ({state.phase}) vs production {baseline}: {steps}  driven by {state.owner}"
    ]
    lines += [f"  now  {_figures(f)}" for f in state.figures]
    for d in state.decisions:
        when = datetime.datetime.fromtimestamp(d.ts, tz=datetime.UTC).strftime("%H:%M:%S")
        lines.append(f"  {when} {d.action} at {d.percent:g}%: {'; '.join(d.reasons)}")
        lines += [f"         {_figures(f)}" for f in (d.canary, d.baseline) if f is not None]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        if args.adapter == STATUS:
            states = asyncio.run(_status(args))
            print("\n".join(show(s) for s in states) if states else "no rollouts")
            return 0
        state = asyncio.run(_start(args))
    except LorafleetError as e:
        print(f"error ({e.code}): {e.message}")
        return 1
    print(f"{state.adapter_id} v{state.version}: rollout started at {state.percent:g}% (`lorafleet release status`)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "release",
        help="start a controlled canary rollout in the registry (`release <adapter> <version>`), "
        "or show rollouts (`release status [<adapter>]`)",
    )
    p.add_argument("adapter", help=f"the adapter to roll out, or {STATUS!r}")
    p.add_argument("version", nargs="?", help="the staging version; after status: an adapter to show alone")
    p.add_argument(
        "--eval", action="store_true", help="also score the eval set on this machine and record it (advisory only)"
    )
    p.add_argument(
        "--skip-eval",
        action="store_true",
        help="skip the registry's run of the version's eval set (operator only; needs --reason, audited)",
    )
    p.add_argument("--reason", default=None)
    gateway_options(p)
    p.set_defaults(func=run, nats_url=os.environ.get("LF_NATS_URL", "nats://127.0.0.1:4222"))
