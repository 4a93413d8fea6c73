"""Tool-calling request shapes the gateway refuses with a 400 before anything reaches NATS."""

import pytest

from tests.gateway.test_http_validation import AUTH, assert_openai_error, client  # noqa: F401

USER = {"role": "user", "content": "weather?"}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def chat(**fields) -> dict:
    return {"model": "m", "messages": [USER], **fields}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (chat(tool_choice="auto"), "need tools"),
        (chat(parallel_tool_calls=False), "need tools"),
        (chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}}), "not among"),
        (chat(tools=[WEATHER, WEATHER]), "unique"),
        (chat(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
        (chat(tools=[{"type": "code_interpreter"}]), "tools"),
        (chat(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools"),
        (chat(tools=[WEATHER], response_format={"type": "json_object"}), "response_format together with tools"),
        (chat(functions=[WEATHER["function"]]), "functions"),  # the deprecated API: refused, not ignored
        ({"model": "m", "messages": [USER, {"role": "tool", "content": "21C"}]}, "tool_call_id"),
        ({"model": "m", "messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "tool_call_id"),
        ({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "tool_calls"),
        ({"model": "m", "messages": [USER, {"role": "assistant", "content": None}]}, "content"),
        ({"model": "m", "messages": [USER, {"role": "assistant", "content": "", "refusal": "no"}]}, "refusal"),
    ],
)
async def test_refused_tool_shapes(client, body, says):  # noqa: F811
    r = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    error = assert_openai_error(r, 400)
    assert says in error["message"] or says in (error["param"] or ""), error


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([USER, {"role": "tool", "tool_call_id": "call_9", "content": "21C"}], "answers no tool call"),
        (
            [
                USER,
                {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
            ],
            "answers no tool call",
        ),
    ],
)
async def test_a_tool_result_must_answer_an_earlier_call(client, messages, says):  # noqa: F811
    r = await client.post("/v1/chat/completions", json={"model": "m", "messages": messages}, headers=AUTH)
    assert says in assert_openai_error(r, 400, "invalid_request")["message"]


async def test_a_function_schema_that_is_not_json_schema_is_a_typed_400(client):  # noqa: F811
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "not-a-type"}}}
    r = await client.post("/v1/chat/completions", json=chat(tools=[bad]), headers=AUTH)
    error = assert_openai_error(r, 400, "invalid_json_schema")
    assert error["param"] == "tools"
