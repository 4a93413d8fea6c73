"""The registry killed (kill -9) under load: the gateways keep serving every model they know from
their catalog mirrors (the data path does not depend on the control plane), /readyz names the
registry missing while staying ready, an adapter no worker has loaded yet is loaded cold without it
(workers read the record and the signers from their KV buckets), what needs the registry (an unknown
model) gets a prompt typed 503/504, and all is as before once it is back."""

import asyncio
import time

import pytest

from tests.faults.conftest import make_adapter, release
from tests.faults.observe import readyz
from tests.faults.traffic import MIX, chat, check_served_or_refused, gateway, steady

pytestmark = pytest.mark.timeout(150)
MAX_TOKENS = 32
COLD = "cold-adapter"
PROMPT_REFUSAL_S = 3.0  # a refusal that needs the registry comes this fast (no-responders, or the 2 s bound)


async def test_killing_the_registry_under_load_keeps_serving_and_recovers(fleet, tmp_path):
    cold = make_adapter(fleet.model_dir, tmp_path / "cold", seed=11)
    await release(fleet.nats.url, fleet.model_dir, cold, COLD)  # released, never asked for: on no worker yet
    async with gateway(fleet.gateway_url) as client:
        load = asyncio.create_task(steady(client, 30, 0.2, MAX_TOKENS))
        await asyncio.sleep(1.5)
        fleet.stack.kill("registry")
        killed = time.monotonic()
        deadline = killed + 15
        while (components := await readyz(fleet.gateway_url, 200, 15))["registry"] != "missing":
            assert time.monotonic() < deadline, components
            await asyncio.sleep(0.3)
        assert components["catalog"] == "mirrored", components  # ready: it serves from its mirror
        unknown = await chat(client, "key-demo", "no-such-adapter", max_tokens=4)
        loaded_cold = await chat(client, "key-demo", COLD, max_tokens=MAX_TOKENS)
        outcomes = await load
        gone_for = time.monotonic() - killed

    check_served_or_refused(outcomes)
    assert all(o.whole(MAX_TOKENS) for o in outcomes), [o.describe() for o in outcomes if not o.whole(MAX_TOKENS)]
    assert gone_for > 3  # the outage lasted while traffic kept arriving
    assert unknown.status in (503, 504) and unknown.code in ("service_unavailable", "upstream_timeout"), (
        unknown.describe()
    )
    assert unknown.elapsed_s < PROMPT_REFUSAL_S
    assert loaded_cold.whole(MAX_TOKENS), loaded_cold.describe()  # a cold load with no registry running

    await asyncio.to_thread(fleet.start, "registry")
    deadline = time.monotonic() + 15
    while (await readyz(fleet.gateway_url, 200, 15))["registry"] != "ok":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.3)
    async with gateway(fleet.gateway_url) as client:
        after = await asyncio.gather(
            *(chat(client, key, model, max_tokens=8, stream=stream) for key, model in MIX for stream in (False, True))
        )
        missing = await chat(client, "key-demo", "no-such-adapter", max_tokens=4)
    assert all(o.whole(8) for o in after), [o.describe() for o in after]
    assert missing.status == 404 and missing.code == "model_not_found", missing.describe()
