"""Stop a request's downstream work when its HTTP client goes away before the answer is ready.

Starlette cancels a streamed response when the client leaves, but a plain (non-streamed) handler
keeps waiting for its worker. ``unless_disconnected`` races the handler's work against the
client's ``http.disconnect``: if the client wins, the work is cancelled, and its ``finally``
blocks cancel the request on its worker (or in the scheduler's queue)."""

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog
from fastapi import Request

from shared import metrics

T = TypeVar("T")
log = structlog.get_logger("gateway")


class ClientDisconnected(Exception):
    """The client closed its connection before the response was ready."""


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass  # the body was read already: the only message left to come is the disconnect


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """The result of ``work``; ClientDisconnected (with ``work`` cancelled) if the client left first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task  # let its cleanup (the downstream cancels) finish first
    except asyncio.CancelledError:
        pass
    except Exception as e:  # it failed on its own as the client left: nobody to tell
        log.info("request_failed_after_disconnect", error=str(e))
    metrics.REQUESTS.labels("gateway", "client_disconnected").inc()
    raise ClientDisconnected
