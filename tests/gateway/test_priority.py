"""The SLO class a client asks for (x-lorafleet-priority header or body ``priority``): malformed or
contradictory asks are refused with a 400 before anything reaches NATS; the tier check itself is
the scheduler's (tests/scheduler/test_slo_classes.py), so direct-NATS clients meet it too."""

import pytest

from tests.gateway.test_http_validation import AUTH, assert_openai_error, client  # noqa: F401

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("path", "body", "header", "param"),
    [
        ("/v1/chat/completions", CHAT, "urgent", "x-lorafleet-priority"),
        ("/v1/completions", {"model": "m", "prompt": "hi"}, "", "x-lorafleet-priority"),
        ("/v1/chat/completions", {**CHAT, "priority": "batch"}, "interactive", "priority"),
        ("/v1/chat/completions", {**CHAT, "priority": "urgent"}, None, "priority"),
    ],
)
async def test_a_malformed_or_contradictory_priority_is_a_400(client, path, body, header, param):  # noqa: F811
    headers = {**AUTH, **({"x-lorafleet-priority": header} if header is not None else {})}
    error = assert_openai_error(await client.post(path, json=body, headers=headers), 400)
    assert param in (error["param"] or "") or param in error["message"], error


async def test_a_well_formed_priority_passes_the_gateway(client):  # noqa: F811
    # no worker in this fixture: a request the gateway accepts ends in its 503, not a 400
    for headers, body in (({"x-lorafleet-priority": " Batch "}, CHAT), ({}, {**CHAT, "priority": "interactive"})):
        response = await client.post("/v1/chat/completions", json=body, headers={**AUTH, **headers})
        assert response.status_code == 503, response.text
