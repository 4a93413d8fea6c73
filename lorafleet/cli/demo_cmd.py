"""``lorafleet demo``: on a running stack, the demo tenant and its API key, the example adapters
released (signed, evaluated through the gateway, gated), and working examples printed. ``lorafleet up``
does this once its services are ready; compose's one-shot ``lorafleet-demo`` service runs the command."""

import argparse
import asyncio
import os
from pathlib import Path

from lorafleet.cli.demo import curl_example, seed_demo_adapters
from lorafleet.cli.demo_fit import ServedModel
from lorafleet.cli.demo_tenant import ACTOR, DEMO_TENANT, ensure_demo_key, openai_snippet
from shared.errors import LorafleetError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="on a running stack: the demo tenant, its API key and the example adapters")
    p.add_argument("--nats-url", default=os.environ.get("LF_NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--gateway-url", default="http://127.0.0.1:8000", help="where this command reaches the gateway")
    p.add_argument("--public-port", type=int, default=8000, help="the gateway's port on 127.0.0.1 in the examples")
    p.add_argument("--state-dir", type=Path, default=Path(".lorafleet"), help="keeps the demo key and signing key")
    p.add_argument("--model-dir", default=os.environ.get("LF_MODEL_DIR") or None, help="the served base model")
    p.add_argument(
        "--model-cache",
        type=Path,
        default=Path(os.environ["LF_MODEL_CACHE"]) if os.environ.get("LF_MODEL_CACHE") else None,
        help="the services' model cache (default: STATE_DIR/models)",
    )
    p.set_defaults(func=run)


def example(port: int, key: str, model: str) -> str:
    return curl_example(port, key, model, "What is the capital of France?")


def seed_demo(
    nats_url: str, gateway_url: str, public_port: int, state: Path, model_dir: str | None, cache_dir: Path
) -> None:
    """Print the demo key and examples, then release the example adapters that fit the served model."""
    served = ServedModel.resolve(model_dir, cache_dir)
    key = asyncio.run(ensure_demo_key(nats_url, state))
    print(
        f"demo tenant API key: {key}  (more: lorafleet tenant create / key create)\n\nTry:\n"
        f"{example(public_port, key, served.name)}\n\nor with the openai client:\n"
        f"{openai_snippet(public_port, key, served.name)}\n"
    )
    print("releasing the example adapters (signed, evaluated through the gateway, gated)...")
    demos, fit = asyncio.run(seed_demo_adapters(nats_url, gateway_url, state, served, DEMO_TENANT, ACTOR, cache_dir))
    for line in fit.skip_lines():
        print(f"  {line}")
    for demo in demos:
        print(f"  {demo.summary}")
    for demo in demos[:2]:
        print(
            f"\n{demo.adapter_id} answers its own task:\n{curl_example(public_port, key, demo.adapter_id, demo.prompt)}"
        )
        if demo.answer is not None:
            print(f"  -> {demo.answer}")
    print(flush=True)


def run(args: argparse.Namespace) -> int:
    state = args.state_dir.resolve()
    state.mkdir(parents=True, exist_ok=True)
    try:
        seed_demo(
            args.nats_url,
            args.gateway_url,
            args.public_port,
            state,
            args.model_dir,
            args.model_cache or state / "models",
        )
    except LorafleetError as e:
        print(f"error: {e}")
        return 1
    return 0
