"""Options of a load run (shared with the soak), the loopback-only rule, and ``python -m bench.load``."""

import argparse
import asyncio
import ipaddress
import sys
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from bench.load.run import RESULTS, LoadConfig, fire, open_target, result_of, write
from bench.load.stack import SHAPES, VLLM_PYTHON
from bench.load.traffic import parse_slo_mix

QUICK = {
    "base_model": "tiny",
    "adapters": 20,
    "tenants": 2,
    "rate": 4.0,
    "count": 40,
    "duration_s": 30.0,
    "max_tokens": 8,
    "timeout_s": 60.0,
    "drain_s": 65.0,
}
DEFAULTS = LoadConfig()


def loopback_url(url: str) -> str:
    """``url`` if it names a loopback host over http(s); else ValueError: traffic never leaves the machine."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if parts.scheme not in ("http", "https") or not loopback:
        raise ValueError(
            f"refusing {url!r}: the load generator only sends to loopback "
            "(http://127.0.0.1:PORT, http://localhost:PORT or http://[::1]:PORT)"
        )
    return url.rstrip("/")


def add_load_options(parser: argparse.ArgumentParser, defaults: LoadConfig = DEFAULTS) -> None:
    d = defaults
    parser.add_argument(
        "--base-model",
        choices=("smollm2", "tiny", "tiny-h64"),
        default=d.base_model,
        help="smollm2 (embedded), tiny (random 2-layer Llama, fast) or tiny-h64 (the same with head size 64, "
        "which vLLM's CPU build runs)",
    )
    parser.add_argument(
        "--engine",
        choices=("builtin", "vllm"),
        default=d.engine,
        help="the started stack's worker engine; vllm runs the worker under .venv-vllm (`make venv-vllm`) "
        "with LF_WORKER_ENGINE=vllm",
    )
    parser.add_argument("--adapters", type=int, default=d.adapters, help="adapters to register (up to 1000)")
    parser.add_argument("--tenants", type=int, default=d.tenants)
    parser.add_argument("--rate", type=float, default=d.rate, help="mean arrivals per second (Poisson)")
    parser.add_argument("--count", type=int, default=d.count, help="stop after this many requests...")
    parser.add_argument("--duration-s", type=float, default=d.duration_s, help="...or after this long")
    parser.add_argument("--zipf-s", type=float, default=d.zipf_s, help="zipf exponent of adapter popularity")
    parser.add_argument("--base-share", type=float, default=d.base_share, help="share of base-model requests")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens generated per request")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--timeout-s", type=float, default=d.timeout_s, help="client bound of one request")
    parser.add_argument("--drain-s", type=float, default=d.drain_s, help="wait for in-flight after the last send")
    parser.add_argument("--rank-mix", default=d.rank_mix, help="rank:weight,... of the registered adapters")
    parser.add_argument(
        "--slo-mix", default=d.slo_mix, help="interactive:w,standard:w,batch:w: the class each request asks for"
    )
    parser.add_argument("--workers", type=int, default=d.workers, help="worker processes of the started stack")
    parser.add_argument(
        "--shape",
        choices=SHAPES,
        default=d.shape,
        help="the started stack: single (one of each process) or cluster (3 NATS nodes at replicas 3, "
        "2 registries, 2 schedulers, 2 gateways the client alternates between)",
    )
    parser.add_argument(
        "--kill-nats-at-s", type=float, default=d.kill_nats_at_s, help="kill -9 a NATS node this far into the run"
    )
    parser.add_argument(
        "--kill-nats",
        choices=("infer_leader", "follower"),
        default=d.kill_nats,
        help="which node --kill-nats-at-s kills",
    )
    parser.add_argument("--push-concurrency", type=int, default=d.push_concurrency, help="adapters pushed at once")
    parser.add_argument("--warmup", type=int, default=d.warmup, help="base-model requests before the run")
    parser.add_argument("--url", help="target an already running gateway (loopback only) instead of starting one")
    parser.add_argument("--key", action="append", default=[], help="API key for --url; repeat: one per tenant")


def config_from(args: argparse.Namespace) -> LoadConfig:
    url = None if args.url is None else loopback_url(args.url)
    if url is not None and not args.key:
        raise ValueError("--url needs at least one --key")
    if args.engine == "vllm":
        if url is not None:
            raise ValueError("--engine picks the worker engine of the stack the bench starts: not with --url")
        if args.base_model == "tiny":
            raise ValueError(
                "--engine vllm cannot run --base-model tiny (head size 16, which vLLM's CPU attention refuses)"
            )
        if not VLLM_PYTHON.exists():
            raise ValueError(f"--engine vllm needs {VLLM_PYTHON}: run `make venv-vllm`")
    if url is not None and args.shape != "single":
        raise ValueError("--shape picks the shape of the stack the bench starts: not with --url")
    if args.kill_nats_at_s is not None:
        if args.shape != "cluster":
            raise ValueError("--kill-nats-at-s needs --shape cluster (a single NATS node is the whole bus)")
        if not 0 < args.kill_nats_at_s < args.duration_s:
            raise ValueError("--kill-nats-at-s must fall inside the run (0 < it < --duration-s)")
    parse_slo_mix(args.slo_mix)  # a ValueError names the bad entry
    if not 0 < args.adapters <= 1000 or args.tenants < 1 or args.count < 1 or args.duration_s <= 0:
        raise ValueError("want 1 <= --adapters <= 1000, --tenants >= 1, --count >= 1, --duration-s > 0")
    fields = {k: v for k, v in vars(args).items() if k in LoadConfig.__dataclass_fields__ and k != "keys"}
    return LoadConfig(**{**fields, "url": url, "keys": tuple(args.key)})


def parse_load_args(
    parser: argparse.ArgumentParser, argv: list[str] | None, quick: Mapping[str, object]
) -> tuple[argparse.Namespace, LoadConfig]:
    """The arguments (``--quick`` sets the ``quick`` defaults) and the load run they describe; a bad
    combination ends the program with the parser's usage error."""
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    try:
        return args, config_from(args)
    except ValueError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 20 adapters, 40 requests (< 1 min)")
    parser.add_argument("--out", type=Path, default=RESULTS / "load.json", help="JSON path (.md, .png beside)")
    add_load_options(parser)
    args, config = parse_load_args(parser, argv, QUICK)
    target = open_target(config)
    outcomes = None
    try:
        outcomes, wall_s = asyncio.run(fire(target, config))
    finally:  # a run with errors keeps the services' logs
        target.close(keep_logs=outcomes is None or any(o.status != "completed" for o in outcomes))
    result = result_of(config, target, outcomes, wall_s)
    print(write(result, outcomes, args.out))
    return 1 if result["lost"] or not result["completed"] else 0


if __name__ == "__main__":
    sys.exit(main())
