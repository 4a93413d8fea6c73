"""compose.yaml as a user starts it: image size, `docker compose up` to a ready gateway (cold: new
volumes; warm: the same volumes again), with one worker and with two, each container's memory at ready,
and the TTFT of one streamed request through it.

    python -m bench.compose_up [--quick]

Needs a running Docker daemon with compose v2 and the images built (tests/compose builds them;
deploy/offline/build.sh where no registry answers). Writes bench/results/compose_up.json."""

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import httpx
import torch

from bench.environment import environment
from lorafleet.cli.infra import free_port

REPO = Path(__file__).resolve().parents[1]
ONE_WORKER = ("gateway", "registry", "scheduler", "auditor", "worker-cpu-1")
TWO_WORKERS = (*ONE_WORKER, "worker-cpu-2")
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def compose(project: str, port: int, *args: str, timeout_s: float = 1800) -> str:
    done = subprocess.run(
        ["docker", "compose", "--project-directory", str(REPO), "-f", str(REPO / "compose.yaml"), "-p", project, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "LF_GATEWAY_PORT": str(port)},
        check=True,
    )
    return done.stdout


def ready_s(url: str, start: float, timeout_s: float = 1800) -> float:
    while time.monotonic() - start < timeout_s:
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready in {timeout_s:.0f}s")


def memory_mib(project: str) -> dict[str, float]:
    """Each running container's memory use now (docker stats), MiB."""
    out = subprocess.run(
        ["docker", "stats", "--no-stream", "--format", "{{.Name}} {{.MemUsage}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    units = {"KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}
    found = {}
    for line in out.splitlines():
        name, usage = line.split(" ", 1)
        if name.startswith(project):
            value = usage.split("/")[0].strip()
            number, unit = value[:-3], value[-3:]
            found[name.removeprefix(f"{project}-").removesuffix("-1")] = round(float(number) * units[unit], 1)
    return found


def ttft_ms(url: str, key: str, n: int) -> list[float]:
    """TTFT of ``n`` sequential streamed requests on the base model."""
    times = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for _ in range(n):
            body = {"model": "SmolLM2-135M-Instruct", "messages": PROMPT, "max_tokens": 16, "stream": True}
            start = time.perf_counter()
            with client.stream(
                "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        times.append((time.perf_counter() - start) * 1000)
                        break
    return times


def demo_key(project: str, port: int) -> str:
    for _ in range(900):
        logs = compose(project, port, "logs", "--no-color", "--no-log-prefix", "lorafleet-demo")
        for line in logs.splitlines():
            if line.startswith("demo tenant API key: "):
                return line.split()[4]
        time.sleep(1)
    raise TimeoutError("lorafleet-demo printed no key")


def one_shape(services: tuple[str, ...], requests: int) -> dict:
    project, port = f"lfbench{os.getpid()}", free_port()
    url = f"http://127.0.0.1:{port}"
    figures: dict = {"workers": sum(s.startswith("worker") for s in services)}
    try:
        start = time.monotonic()
        compose(project, port, "up", "-d", *services)
        figures["cold_ready_s"] = round(ready_s(url, start), 1)
        figures["memory_mib"] = memory_mib(project)
        compose(project, port, "up", "-d", "lorafleet-demo")
        figures["ttft_ms"] = ttft_ms(url, demo_key(project, port), requests)
        compose(project, port, "stop")
        start = time.monotonic()
        compose(project, port, "up", "-d", *services)
        figures["warm_ready_s"] = round(ready_s(url, start), 1)
    finally:
        compose(project, port, "--profile", "cli", "down", "-v", "--remove-orphans", "--timeout", "10")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="two workers only, 5 requests")
    args = parser.parse_args()
    start = time.monotonic()
    compose(f"lfbench{os.getpid()}", 0, "build", "lorafleet-init", timeout_s=3600)  # what changed since the last build
    build_s = round(time.monotonic() - start, 1)
    size = subprocess.run(
        ["docker", "image", "inspect", "lorafleet:cpu", "--format", "{{.Size}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    shapes = [TWO_WORKERS] if args.quick else [ONE_WORKER, TWO_WORKERS]
    results = [one_shape(s, 5 if args.quick else 20) for s in shapes]
    report = {
        "env": environment(torch.get_num_threads()),
        "build_s": build_s,
        "image_bytes": int(size),
        "shapes": results,
    }
    out = REPO / "bench" / "results" / "compose_up.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(
        f"image lorafleet:cpu: {int(size) / 2**30:.2f} GiB, build {build_s} s (layers changed since the last build)\n"
    )
    print("| workers | up to ready, cold (s) | warm (s) | TTFT p50 (ms) | worker memory (MiB) | all containers (MiB) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        memory = r["memory_mib"]
        print(
            f"| {r['workers']} | {r['cold_ready_s']} | {r['warm_ready_s']} | {statistics.median(r['ttft_ms']):.0f} | "
            f"{memory.get('worker-cpu-1', 0):.0f} | {sum(memory.values()):.0f} |"
        )


if __name__ == "__main__":
    main()
