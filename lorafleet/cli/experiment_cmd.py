"""``lorafleet experiment create|list|status|pause|resume|stop``: a tenant's experiments across
adapters, as registry ops over NATS (the admin NATS user). ``create`` takes each arm as
``name=target:weight`` (target: ``adapter``, ``adapter@version`` or ``base``); the first arm is the
control. ``status`` prints each arm's figures with their 95% confidence intervals."""

import argparse
import asyncio

from pydantic import BaseModel, ValidationError

from lorafleet.cli.adapter_cmd import actor
from lorafleet.cli.bus_cli import answer, bus_options
from lorafleet.cli.route_cmd import target
from lorafleet.cli.tenant_cmd import call
from shared.errors import LorafleetError
from shared.schemas import (
    CreateExperimentRequest,
    ExperimentArm,
    ExperimentReply,
    ExperimentsReply,
    ExperimentState,
    ExperimentStateRequest,
    ExperimentStatusReply,
    GetExperimentRequest,
    Interval,
    ListExperimentsRequest,
)

STATES: dict[str, ExperimentState] = {"pause": "paused", "resume": "running", "stop": "stopped"}


def arm(text: str) -> ExperimentArm:
    """``name=target:weight``, ``target`` being ``adapter``, ``adapter@version`` or ``base``."""
    name, sep, rest = text.partition("=")
    to, colon, weight = rest.rpartition(":")
    if not sep or not colon or not weight.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: an arm is name=target:weight (target: adapter[@version] or base)")
    try:
        return ExperimentArm(name=name, adapter=None if to == "base" else target(to), weight=int(weight))
    except ValidationError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e.errors()[0]['msg']}") from None


async def _call(args: argparse.Namespace) -> BaseModel:
    if args.sub == "create":
        made = CreateExperimentRequest(tenant_id=args.tenant, name=args.name, arms=args.arms, actor=actor())
        return await call(args.nats_url, "experiment_create", made, ExperimentReply)
    if args.sub == "list":
        return await call(args.nats_url, "experiments", ListExperimentsRequest(tenant_id=args.tenant), ExperimentsReply)
    if args.sub == "status":
        ask = GetExperimentRequest(tenant_id=args.tenant, name=args.name)
        return await call(args.nats_url, "experiment_status", ask, ExperimentStatusReply)
    message = ExperimentStateRequest(tenant_id=args.tenant, name=args.name, state=STATES[args.sub],
                                     winner=getattr(args, "winner", None), actor=actor())  # fmt: skip
    return await call(args.nats_url, "experiment_state", message, ExperimentReply)


def _ci(interval: Interval, digits: int) -> str:
    if interval.value is None:
        return "-"
    if interval.low is None or interval.high is None:
        return f"{interval.value:.{digits}f}"
    return f"{interval.value:.{digits}f} [{interval.low:.{digits}f}, {interval.high:.{digits}f}]"


def _print(reply: BaseModel) -> None:
    if isinstance(reply, ExperimentsReply):
        for e in reply.experiments:
            arms = ", ".join(f"{a.name}={a.target}:{a.weight}" for a in e.arms)
            print(f"{e.name:<24} {e.state:<8} {e.winner or '':<10} rev {e.revision}  {arms}")
        return
    experiment = reply.experiment  # type: ignore[attr-defined]
    winner = f", winner {experiment.winner}" if experiment.winner else ""
    print(f"experiment {experiment.name} (tenant {experiment.tenant_id}): {experiment.state}{winner}, "
          f"revision {experiment.revision}")  # fmt: skip
    if not isinstance(reply, ExperimentStatusReply):
        return
    print(f"  {'arm':<12} {'target':<22} {'count':>6}  share           TTFT p50 ms          TPOT p50 ms"
          "          engine ms/token      complaint rate       eval score")  # fmt: skip
    for a in reply.arms:
        print(f"  {a.arm:<12} {a.target:<22} {a.count:>6}  {_ci(a.share, 2):<15} {_ci(a.ttft_p50_ms, 1):<20} "
              f"{_ci(a.tpot_p50_ms, 1):<20} {_ci(a.engine_ms_per_token, 2):<20} {_ci(a.complaint_rate, 3):<20} "
              f"{_ci(a.eval_score, 2)}")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        reply = asyncio.run(_call(args))
    except LorafleetError as e:
        print(f"error ({e.code}): {e.message}")
        return 1
    except ValidationError as e:
        print(f"error (invalid_request): {e}")
        return 1
    return answer(reply, args.json, _print)


def register(subparsers: argparse._SubParsersAction) -> None:
    opts = bus_options()
    parser = subparsers.add_parser("experiment", help="experiments across adapters: weighted arms, sticky by user")
    subs = parser.add_subparsers(dest="sub", required=True)
    create = subs.add_parser("create", parents=[opts], help="create and start an experiment")
    create.add_argument("tenant")
    create.add_argument("name")
    create.add_argument("arms", nargs="+", type=arm, help="name=target:weight (2 to 8; the first is the control)")
    subs.add_parser("list", parents=[opts], help="the tenant's experiments").add_argument("tenant")
    texts = {"status": "per-arm figures with 95%% intervals", "pause": "serve the control to all",
             "resume": "split by weight again", "stop": "end it: the winner serves every request"}  # fmt: skip
    for name, text in texts.items():
        sub = subs.add_parser(name, parents=[opts], help=text)
        sub.add_argument("tenant")
        sub.add_argument("name")
        if name == "stop":
            sub.add_argument("--winner", required=True, help="the arm that serves from now on")
    for choice in subs.choices.values():
        choice.set_defaults(func=run)
