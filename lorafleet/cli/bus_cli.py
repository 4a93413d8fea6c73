"""What every CLI command that talks to the registry over NATS shares: its options and how it prints a reply."""

import argparse
import json
import os
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel

Reply = TypeVar("Reply", bound=BaseModel)


def bus_options() -> argparse.ArgumentParser:
    """``--nats-url`` (default ``LF_NATS_URL``) and ``--json``, as a parent parser."""
    opts = argparse.ArgumentParser(add_help=False)
    opts.add_argument("--nats-url", default=os.environ.get("LF_NATS_URL", "nats://127.0.0.1:4222"))
    opts.add_argument("--json", action="store_true")
    return opts


def answer(reply: Reply, as_json: bool, show: Callable[[Reply], None]) -> int:
    """Print the reply (as JSON with ``--json``, else as ``show`` words it); exit status 0."""
    if as_json:
        print(json.dumps(reply.model_dump(mode="json"), indent=2))
    else:
        show(reply)
    return 0
