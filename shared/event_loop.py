"""Every service's entry point: its main coroutine on uvloop (libuv-based, the usual loop of
production asyncio servers), or on asyncio's own loop where uvloop is not installed."""

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # e.g. Windows: uvloop is Unix-only
        return asyncio.run(main)
    return uvloop.run(main)
