"""A chat's tools as the constraint its reply decodes under: xgrammar's ``qwen_3`` structural tag,
which writes calls in ``shared.tool_calls``' format (name, then arguments valid under the
function's JSON schema). The same constraint goes to either engine."""

from typing import Any, Literal

import xgrammar as xgr

from shared.errors import InvalidSchema
from shared.schemas import StructuredOutput, Tools
from shared.tool_calls import openai_tools

# whitespace between JSON tokens of the arguments: a small model must not wander off into it
MAX_WHITESPACE = 2


def _choice(tools: Tools) -> dict[str, Any] | Literal["auto", "required"]:
    if tools.choice == "function":
        return {"type": "function", "function": {"name": tools.function_name}}
    assert tools.choice != "none"
    return tools.choice


def constraint(tools: Tools | None) -> StructuredOutput | None:
    """The structured output a reply with these tools decodes under; None: unconstrained (no tools,
    or tool choice ``none``). With ``required`` or a named function the reply is calls only; with
    ``auto`` free text, where a ``<tool_call>`` tag begins a constrained call.

    The calls' shape is xgrammar's ``qwen_3`` tag; for ``required`` its tags are rearranged as
    calls separated by newlines and nothing else (xgrammar's own ``required`` lets free text
    follow the first call, which OpenAI's ``required`` does not)."""
    listed = openai_tools(tools)
    if tools is None or listed is None:
        return None
    try:
        tag = xgr.get_model_structural_tag(
            "qwen_3",
            tools=list[Any](listed),
            tool_choice="auto" if tools.choice == "required" else _choice(tools),
            reasoning="disabled",
            exclude_special_tokens=False,
            max_whitespace_cnt=MAX_WHITESPACE,
            parallel_tool_calls=tools.parallel,
        )
    except (ValueError, TypeError) as e:
        raise InvalidSchema(f"the tools cannot be enforced: {e}", param="tools") from None
    if tools.choice == "required":
        calls = tag.format
        if not isinstance(calls, xgr.structural_tag.TriggeredTagsFormat):  # a newer xgrammar's layout
            raise RuntimeError(f"xgrammar's qwen_3 tag is now a {type(calls).__name__}: rebuild `required` for it")
        tag = xgr.StructuralTag(
            format=xgr.structural_tag.TagsWithSeparatorFormat(
                tags=calls.tags, separator="\n", at_least_one=True, stop_after_first=not tools.parallel
            )
        )
    return StructuredOutput(kind="structural_tag", structural_tag=tag.model_dump_json())
