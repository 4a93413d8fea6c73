"""shared.tool_calls: replies parsed into content and calls the same whatever their chunking, and
chats with tools rendered the same by the fast path and transformers, native and Hermes layouts."""

import json
import random

import pytest
from transformers import AutoTokenizer

from services.worker.prompt_ids import PromptIds
from shared import tool_calls
from shared.chat_tokens import ChatTokenizer
from shared.schemas import ChatMessage, ToolCall, ToolCallFunction, ToolFunction, Tools

NOT_A_CALL = '<tool_call>\n{"name": "add", "arguments": 3}\n</tool_call>'
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
WEATHER = ToolFunction(
    name="get_weather",
    description="Weather in a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TOOLS = Tools(functions=[WEATHER], choice="auto")
CALLED = ToolCall(id="call_1", function=ToolCallFunction(name="get_weather", arguments='{"city": "Paris"}'))
HISTORY = [
    ChatMessage(role="system", content="Be brief."),
    ChatMessage(role="user", content="Weather in Paris?"),
    ChatMessage(role="assistant", content="", tool_calls=[CALLED]),
    ChatMessage(role="tool", tool_call_id="call_1", content="21C"),
]
# a template of this project's own that renders tools in the Hermes format (as Qwen's do)
NATIVE = (
    "{%- if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        ("plain answer", "plain answer", []),
        (CALL, None, ["add"]),
        (f"  Let me add.  \n{CALL}\n", "Let me add.", ["add"]),
        (f"{CALL}\n{CALL}", None, ["add", "add"]),
        (f"{CALL}\n  and done ", "and done", ["add"]),
        (f"a <b> c {CALL} d", "a <b> c d", ["add"]),
        ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
        (NOT_A_CALL, NOT_A_CALL, []),  # arguments that are no object: kept as content
        ('cut short <tool_call>\n{"name": "add", "argu', 'cut short <tool_call>\n{"name": "add", "argu', []),
        ("ends with <tool_ca", "ends with <tool_ca", []),
    ],
)
def test_parse(text, content, names):
    parsed, calls = tool_calls.parse(text)
    assert parsed == content
    assert [c.function.name for c in calls] == names
    for call in calls:
        assert call.id.startswith("call_") and json.loads(call.function.arguments) == {"a": 1, "b": 2}


@pytest.mark.parametrize("seed", range(20))
def test_any_chunking_gives_the_same_content_and_calls(seed):
    rng = random.Random(seed)
    text = rng.choice(["", "  Sure: ", "x"]) + CALL + rng.choice(["", "\n", " then <b> "]) + CALL + " end  "
    whole, calls = tool_calls.parse(text)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    parser = tool_calls.ToolCallParser()
    segments = [s for piece in pieces for s in parser.feed(piece)] + parser.finish()
    streamed = "".join(s.content for s in segments) or None
    assert streamed == whole
    assert [c.function for c in parser.calls] == [c.function for c in calls]
    assert [s.call for s in segments if s.call] == parser.calls


@pytest.fixture(scope="module")
def hf(smollm_dir):
    return AutoTokenizer.from_pretrained(smollm_dir)


def test_a_template_that_renders_tools_gets_them_as_transformers_passes_them(smollm_dir, hf):
    fast = ChatTokenizer.load(smollm_dir)
    native = ChatTokenizer(fast._tokenizer, NATIVE, {})
    assert native.renders_tools and not fast.renders_tools
    text = native.render(HISTORY, TOOLS)
    assert '"arguments": {"city": "Paris"}' in text and "<tool_response>21C</tool_response>" in text
    assert json.dumps(tool_calls.openai_tools(TOOLS)[0], ensure_ascii=False) in text
    hf.chat_template = NATIVE
    slow = PromptIds(hf)
    assert slow.encode(HISTORY, None, TOOLS) == native.encode(HISTORY, None, TOOLS)


def test_a_template_without_tools_gets_the_hermes_layout_on_both_paths(smollm_dir):
    hf = AutoTokenizer.from_pretrained(smollm_dir)
    fast = ChatTokenizer.load(smollm_dir)
    text = fast.render(HISTORY, TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert tool_calls.call_text(CALLED) in text
    assert "<|im_start|>user\n<tool_response>\n21C\n</tool_response><|im_end|>" in text
    assert PromptIds(hf).encode(HISTORY, None, TOOLS) == fast.encode(HISTORY, None, TOOLS)
    # tool choice none: the tools are not shown; the history's calls and results still are
    hidden = fast.render(HISTORY, Tools(functions=[WEATHER], choice="none"))
    assert "# Tools" not in hidden and "<tool_response>" in hidden


def test_consecutive_tool_results_are_one_user_turn(smollm_dir):
    second = CALLED.model_copy(update={"id": "call_2"})
    history = [
        ChatMessage(role="user", content="Two cities?"),
        ChatMessage(role="assistant", content="", tool_calls=[CALLED, second]),
        ChatMessage(role="tool", tool_call_id="call_1", content="21C"),
        ChatMessage(role="tool", tool_call_id="call_2", content="18C"),
    ]
    text = ChatTokenizer.load(smollm_dir).render(history, TOOLS)
    assert "<|im_start|>user\n<tool_response>\n21C\n</tool_response>\n<tool_response>\n18C\n</tool_response>" in text


def test_the_worker_constraint_writes_the_format_the_parser_reads():
    """xgrammar's qwen_3 tag and shared.tool_calls agree on the text of a call."""
    from services.worker.tool_grammar import constraint

    spec = constraint(Tools(functions=[WEATHER], choice="function", function_name="get_weather"))
    assert spec is not None and spec.structural_tag is not None
    tag = json.loads(spec.structural_tag)["format"]
    assert tag["begin"] == tool_calls.NAME_PREFIX + "get_weather" + tool_calls.ARGUMENTS_PREFIX
    assert tag["end"] == tool_calls.CALL_END
    required = json.loads(constraint(Tools(functions=[WEATHER], choice="required")).structural_tag)["format"]
    assert required["type"] == "tags_with_separator" and required["at_least_one"]


def test_the_bus_contract_refuses_inconsistent_tool_requests():
    """What a direct-NATS client could send: checked by the schema before any service acts on it."""
    from pydantic import ValidationError

    from shared.schemas import InferRequest, SamplingParams, StructuredOutput

    base = {"request_id": "r1", "tenant_id": "t", "model": "m", "base_model": "b", "reply_to": "_INBOX.x"}
    json_mode = SamplingParams(structured=StructuredOutput(kind="json_object"))
    with pytest.raises(ValidationError, match="exclusive"):
        InferRequest(**base, messages=HISTORY[:2], tools=TOOLS, sampling=json_mode)
    InferRequest(**base, messages=HISTORY[:2], tools=Tools(functions=[WEATHER], choice="none"), sampling=json_mode)
    with pytest.raises(ValidationError, match="tools come with messages"):
        InferRequest(**base, prompt="hi", tools=TOOLS)
    with pytest.raises(ValidationError, match="not among the tools"):
        Tools(functions=[WEATHER], choice="function", function_name="other")
    with pytest.raises(ValidationError, match="unique"):
        Tools(functions=[WEATHER, WEATHER])
    with pytest.raises(ValidationError, match="tool_call_id"):
        ChatMessage(role="tool", content="21C")
    with pytest.raises(ValidationError, match="only an assistant"):
        ChatMessage(role="user", content="x", tool_calls=[CALLED])
