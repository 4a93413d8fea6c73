"""A retry loop keeps a cancel that cleanup code raised over (``shared.event_loop.keep_cancel``)."""

import asyncio

import pytest

from shared.event_loop import keep_cancel


async def _retrying(attempts: list[int], keep: bool) -> None:
    while True:
        try:
            try:
                await asyncio.sleep(0 if attempts else 60)  # waits until the cancel, then retries at once
            finally:  # cleanup that fails, as an unsubscribe does on a closed connection
                raise ConnectionError("connection closed")
        except Exception as e:
            if keep:
                keep_cancel(e)
            attempts.append(1)
            if len(attempts) > 2:
                return
            await asyncio.sleep(0)


@pytest.mark.parametrize("keep", [True, False])
async def test_a_cancel_that_cleanup_raised_over_ends_the_retry_loop(keep):
    attempts: list[int] = []
    task = asyncio.create_task(_retrying(attempts, keep))
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    if keep:
        assert task.cancelled() and attempts == []
    else:  # without it the cancel is lost: the loop went on retrying until it chose to stop
        assert not task.cancelled() and len(attempts) == 3


async def test_outside_a_cancel_it_lets_the_loop_retry():
    keep_cancel(ConnectionError("x"))  # no cancel pending: nothing raised
