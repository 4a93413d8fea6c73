"""``python -m lorafleet.cli.healthcheck <service>``: exit 0 only if this container's instance of
``<service>`` published a ready heartbeat recently (a compose / Kubernetes health probe).

The instance is ``LF_WORKER_ID`` (workers) or ``LF_INSTANCE_ID`` when set; otherwise any instance
whose default id starts with this host's name (the container's hostname), or with ``--any``
any ready instance of the service."""

import argparse
import asyncio
import sys

from shared import subjects
from shared.bus import connect, decode
from shared.config import CommonSettings, WorkerIdentity, _default_instance_id
from shared.schemas import ServiceHeartbeat


def instance_matcher(service: str, any_instance: bool) -> tuple[str, bool]:
    """(id or prefix to match, whether it is an exact id)."""
    if any_instance:
        return "", False
    wanted = WorkerIdentity().worker_id if service == "worker" else CommonSettings().instance_id
    default = _default_instance_id()
    if wanted != default:
        return wanted, True
    return default.rsplit("-", 1)[0] + "-", False


async def ready_heartbeat(service: str, match: str, exact: bool, timeout_s: float) -> tuple[bool, str]:
    """Wait up to ``timeout_s`` for a ready heartbeat of a matching instance: (ready, what the last
    not-ready heartbeat said, such as a worker's phase; "" where none came)."""
    settings = CommonSettings()
    nc = await connect(settings.nats_url, f"healthcheck-{service}")
    found = asyncio.Event()
    last: list[str] = [""]

    async def on_beat(msg) -> None:
        beat = decode(ServiceHeartbeat, msg.data)
        if not (beat.instance_id == match if exact else beat.instance_id.startswith(match)):
            return
        if beat.ready:
            found.set()
        else:
            last[0] = f"{beat.instance_id} {beat.detail or beat.phase or 'not ready'}"

    try:
        await nc.subscribe(subjects.service_heartbeat(service), cb=on_beat)
        await asyncio.wait_for(found.wait(), timeout_s)
        return True, ""
    except TimeoutError:
        return False, last[0]
    finally:
        await nc.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lorafleet.cli.healthcheck")
    parser.add_argument("service", choices=("gateway", "registry", "scheduler", "worker", "auditor"))
    parser.add_argument("--any", action="store_true", help="accept any ready instance of the service")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a heartbeat")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        match, exact = instance_matcher(args.service, args.any)
        # bounded as a whole: connect() keeps retrying an unreachable server
        ok, unready = asyncio.run(
            asyncio.wait_for(ready_heartbeat(args.service, match, exact, args.timeout), args.timeout + 3)
        )
    except TimeoutError:
        print(f"unhealthy: NATS at {CommonSettings().nats_url} not reachable", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # a probe reports, never raises
        print(f"unhealthy: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
    if ok:
        print("ready")
    elif unready:  # alive, on its way: say where (a worker building its kernels says building_kernels)
        print(f"not ready: {unready}")
    else:
        print(f"no ready heartbeat from {args.service} within {args.timeout:.0f}s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
