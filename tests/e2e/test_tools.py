"""Tool calling end to end with the official openai client on SmolLM2: a call -> tool result ->
answer round trip, streamed and not, in OpenAI's exact shapes. Calls through an adapter, on either
worker engine: tests/e2e/test_engines.py."""

import json

import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_PARAMETERS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": WEATHER_PARAMETERS},
    },
    {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": ADD_PARAMETERS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "add": ADD_PARAMETERS}
ASK = {"role": "user", "content": "What is the weather in Paris right now, in celsius?"}


@pytest.fixture(scope="module")
def client(running_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running_stack.gateway_url}/v1", api_key=running_stack.api_key, max_retries=0)


def _streamed(client: openai.OpenAI, **request) -> tuple[str | None, list[dict], str]:
    """A streamed chat's content, calls (accumulated from their deltas, as a client does) and finish reason."""
    content, calls, reason = "", {}, ""
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    return content or None, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True])
def test_call_then_tool_result_then_answer(client, stream):
    first = {"model": MODEL, "messages": [ASK], "tools": TOOLS, "tool_choice": "required", "max_tokens": 80}
    first["parallel_tool_calls"] = False
    first["temperature"] = 0
    if stream:
        content, calls, reason = _streamed(client, **first)
    else:
        reply = client.chat.completions.create(**first)
        message = reply.choices[0].message
        content, reason = message.content, reply.choices[0].finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
        assert all(c.type == "function" for c in message.tool_calls)
    assert reason == "tool_calls" and content is None and len(calls) == 1
    call = calls[0]
    assert call["id"].startswith("call_") and call["name"] in SCHEMAS
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    history = [
        ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temperature_c": 21, "sky": "clear"})},
    ]
    second = {"model": MODEL, "messages": history, "tools": TOOLS, "tool_choice": "none", "max_tokens": 24}
    if stream:
        content, calls, reason = _streamed(client, **second)
    else:
        reply = client.chat.completions.create(**second)
        content, calls, reason = reply.choices[0].message.content, reply.choices[0].message.tool_calls or [], ""
        reason = reply.choices[0].finish_reason
    assert content and not calls and reason in ("stop", "length")


def test_streamed_and_unstreamed_calls_agree(client):
    request = {"model": MODEL, "messages": [ASK], "tools": TOOLS, "tool_choice": "required", "max_tokens": 80}
    request.update(temperature=0, parallel_tool_calls=False)
    reply = client.chat.completions.create(**request)
    message = reply.choices[0].message
    _, calls, reason = _streamed(client, **request)
    assert reason == reply.choices[0].finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls
    ]


def test_named_function_and_the_response_message_sent_back_as_it_came(client):
    """``tool_choice`` naming a function calls it; the client's own message object goes back as history."""
    ask = {"role": "user", "content": "What is 2 plus 40?"}
    named = {"type": "function", "function": {"name": "add"}}
    reply = client.chat.completions.create(
        model=MODEL, messages=[ask], tools=TOOLS, tool_choice=named, max_tokens=60, temperature=0.7, seed=5
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and [c.function.name for c in message.tool_calls] == ["add"]
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), ADD_PARAMETERS)
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[ask, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "42"}],
        tools=TOOLS,
        max_tokens=24,
        temperature=0,
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_choice_answers_in_text_or_valid_calls(client):
    for prompt in ("Say hello.", "What is the weather in Rome, in fahrenheit?"):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], tools=TOOLS, max_tokens=80, temperature=0
        )
        choice = reply.choices[0]
        for call in choice.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert (choice.finish_reason == "tool_calls") == bool(
            choice.message.tool_calls
        ) or choice.finish_reason == "length"
        assert choice.message.content or choice.message.tool_calls
