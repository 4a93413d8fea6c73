"""Every service's entry point: its main coroutine on uvloop (libuv-based, the usual loop of
production asyncio servers), or on asyncio's own loop where uvloop is not installed."""

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

import structlog

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # e.g. Windows: uvloop is Unix-only
        return asyncio.run(main)
    return uvloop.run(main)


async def cancel_all(tasks: Iterable[asyncio.Task[Any]], grace_s: float = 5.0) -> None:
    """Cancel ``tasks`` and wait, up to ``grace_s``, until each has run its own cleanup (a watch's
    unsubscribe while the connection is still open), whatever it raised; one still running after
    that is left, logged by name, rather than holding the shutdown."""
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    _, late = await asyncio.wait(pending, timeout=grace_s)
    for task in late:
        structlog.get_logger("shutdown").warning("task_still_running", task=task.get_name(), grace_s=grace_s)


def keep_cancel(cause: BaseException) -> None:
    """Raise ``CancelledError`` if the current task is being cancelled. A retry loop that catches
    ``Exception`` calls this first: cleanup run while a cancel unwinds (an unsubscribe on a connection
    that has closed) can raise in the cancel's place, and a loop that retried it would never end."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from cause
