"""The registry killed (kill -9) under load: requests already resolved finish, new ones get a prompt
typed 503 while it is gone (every request resolves its model there), and all is served once it is back."""

import asyncio
import time

import pytest

from tests.faults.observe import readyz
from tests.faults.traffic import MIX, chat, check_served_or_refused, gateway, steady

pytestmark = pytest.mark.timeout(150)
MAX_TOKENS = 32
PROMPT_REFUSAL_S = 3.0  # a refusal while the registry is gone comes this fast (no-responders, or the 2 s resolve bound)


async def test_killing_the_registry_under_load_refuses_promptly_and_recovers(fleet):
    async with gateway(fleet.gateway_url) as client:
        load = asyncio.create_task(steady(client, 30, 0.2, MAX_TOKENS))
        await asyncio.sleep(1.5)
        fleet.stack.kill("registry")
        killed = time.monotonic()
        components = await readyz(fleet.gateway_url, 503, 15)  # the operator sees why
        assert components["registry"] == "missing", components
        outcomes = await load
        gone_for = time.monotonic() - killed

    check_served_or_refused(outcomes, allowed={"service_unavailable", "upstream_timeout"})
    refused = [o for o in outcomes if not o.served]
    assert refused and all(o.elapsed_s < PROMPT_REFUSAL_S for o in refused), [o.describe() for o in refused]
    assert all(o.whole(MAX_TOKENS) for o in outcomes if o.served)
    assert sum(o.served for o in outcomes) >= 3  # those resolved before the kill were not dropped
    assert gone_for > 3  # the outage lasted while traffic kept arriving

    await asyncio.to_thread(fleet.start, "registry")
    await readyz(fleet.gateway_url, 200, 15)
    async with gateway(fleet.gateway_url) as client:
        after = await asyncio.gather(*(chat(client, key, model, max_tokens=8, stream=stream)
                                       for key, model in MIX for stream in (False, True)))
    assert all(o.whole(8) for o in after), [o.describe() for o in after]
