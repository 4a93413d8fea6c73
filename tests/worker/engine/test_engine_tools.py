"""Tool calls in the engine: the chat's tools rendered into the prompt, each tool choice's
constraint decodes calls that parse into OpenAI calls with arguments valid under the function's
schema, and a free neighbour in the same batch is unchanged."""

import json

import jsonschema
import pytest

from services.worker.engine import EngineRequest, LLMEngine
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.prompt_ids import PromptIds
from services.worker.tool_grammar import constraint
from shared import tool_calls
from shared.errors import InvalidSchema
from shared.schemas import ChatMessage, SamplingParams, ToolFunction, Tools
from tests.worker.engine.test_engine import make_engine, run

WEATHER = ToolFunction(
    name="get_weather",
    description="The current weather in a city.",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
ADD = ToolFunction(
    name="add",
    parameters={
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
)
SCHEMAS = {f.name: f.parameters for f in (WEATHER, ADD)}
ASK = [ChatMessage(role="user", content="What is the weather in Paris? Answer in celsius.")]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model()


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> LLMEngine:
    # the tools' instructions and signatures make a prompt of ~300 tokens
    return make_engine(loaded, max_model_len=1024, max_num_batched_tokens=1024, kv_cache_bytes=128 * 2**20)


@pytest.fixture(scope="module")
def prompts(loaded: LoadedModel) -> PromptIds:
    return PromptIds.for_model(loaded.tokenizer, loaded.directory)


def _request(prompts: PromptIds, rid: str, tools: Tools, messages=ASK, **sampling) -> EngineRequest:
    params = SamplingParams(**{"max_tokens": 96, "temperature": 0.0, **sampling}, structured=constraint(tools))
    return EngineRequest(rid, prompts.encode(messages, None, tools), params)


@pytest.mark.parametrize(
    ("choice", "name", "parallel"),
    [
        ("required", None, False),
        ("required", None, True),
        ("function", "add", True),
        ("function", "get_weather", False),
    ],
)
def test_forced_choices_decode_calls_valid_under_the_schema(
    engine: LLMEngine, prompts: PromptIds, choice: str, name: str | None, parallel: bool
) -> None:
    tools = Tools(functions=[WEATHER, ADD], choice=choice, function_name=name, parallel=parallel)
    engine.add_request(_request(prompts, "call", tools, temperature=0.8, seed=11))
    _, text, reason = run(engine)["call"]
    content, calls = tool_calls.parse(text)
    if parallel and reason == "length":  # a small model may repeat its call until the token limit
        content = None if content is not None and content.startswith(tool_calls.BEGIN) else content
    else:
        assert reason == "stop", text
    assert content is None and calls, text
    assert parallel or len(calls) == 1
    for call in calls:
        assert name is None or call.function.name == name
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_and_none_choices_and_a_free_neighbour(loaded: LoadedModel, engine: LLMEngine, prompts: PromptIds) -> None:
    free_ids = prompts.encode([ChatMessage(role="user", content="Name a colour.")], None)
    engine.add_request(EngineRequest("alone", free_ids, SamplingParams(max_tokens=16, temperature=0.0)))
    alone = run(engine)["alone"]
    auto = Tools(functions=[WEATHER, ADD], choice="auto")
    none = Tools(functions=[WEATHER, ADD], choice="none")
    assert constraint(none) is None
    engine.add_request(_request(prompts, "auto", auto))
    engine.add_request(EngineRequest("free", free_ids, SamplingParams(max_tokens=16, temperature=0.0)))
    engine.add_request(_request(prompts, "none", none))
    results = run(engine)
    assert results["free"] == alone
    for rid in ("auto", "none"):
        _, text, _ = results[rid]
        _, calls = tool_calls.parse(text)
        for call in calls:  # auto: whatever the model chose, a call it wrote is a valid one
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    # with "none" the model is not shown the tools at all
    assert prompts.encode(ASK, None, none) == prompts.encode(ASK, None)
    assert prompts.encode(ASK, None, auto) != prompts.encode(ASK, None)


def test_a_round_trip_renders_the_call_and_its_result(engine: LLMEngine, prompts: PromptIds) -> None:
    tools = Tools(functions=[WEATHER], choice="function", function_name="get_weather")
    engine.add_request(_request(prompts, "call", tools))
    _, text, _ = run(engine)["call"]
    _, calls = tool_calls.parse(text)
    assert len(calls) == 1
    history = [
        *ASK,
        ChatMessage(role="assistant", content="", tool_calls=calls),
        ChatMessage(role="tool", tool_call_id=calls[0].id, content='{"temperature": 21, "sky": "clear"}'),
    ]
    answer = Tools(functions=[WEATHER], choice="none")
    rendered = prompts.fast.render(history, answer) if prompts.fast else ""
    assert tool_calls.call_text(calls[0]) in rendered
    assert '<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>' in rendered
    engine.add_request(EngineRequest("answer", prompts.encode(history, None, answer), SamplingParams(max_tokens=24)))
    _, text, _ = run(engine)["answer"]
    assert text and tool_calls.parse(text)[1] == []


def test_a_tool_schema_xgrammar_cannot_compile_is_a_typed_400(engine: LLMEngine, prompts: PromptIds) -> None:
    bad = ToolFunction(name="bad", parameters={"type": "object", "properties": {"x": {"type": "no-such-type"}}})
    tools = Tools(functions=[bad], choice="required")
    with pytest.raises(InvalidSchema) as refused:
        spec = constraint(tools)
        assert spec is not None
        engine.grammars.compile(spec)
    assert refused.value.param == "tools"
