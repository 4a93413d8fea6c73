"""JetStream setup that times out while a cluster settles is tried again, within a bound."""

import nats.errors
import pytest

from shared import bus


async def test_setup_is_tried_again_while_the_api_times_out_and_gives_up_past_the_bound(monkeypatch):
    monkeypatch.setattr(bus, "SETTLE_PAUSE_S", 0.0)
    calls: list[int] = []

    @bus.settling
    async def setup(answer: str) -> str:
        calls.append(1)
        if len(calls) < 3:
            raise nats.errors.TimeoutError
        return answer

    assert await setup("made") == "made" and len(calls) == 3

    monkeypatch.setattr(bus, "SETTLE_S", 0.05)

    @bus.settling
    async def never() -> None:
        raise nats.errors.TimeoutError

    with pytest.raises(nats.errors.TimeoutError):
        await never()

    @bus.settling
    async def refused() -> None:
        calls.append(1)
        raise ValueError("not a timeout")

    before = len(calls)
    with pytest.raises(ValueError):
        await refused()
    assert len(calls) == before + 1  # any other error is not retried
