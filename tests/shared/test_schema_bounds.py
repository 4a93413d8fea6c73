"""A JSON schema's shape bounds hold wherever a request enters: the gateway's checked_schema and the
scheduler's check of a direct-NATS submission, whose schema arrives as JSON text."""

import json

import pytest

from shared.config import RequestBounds
from shared.errors import InvalidSchema, SchemaTooLarge
from shared.request_bounds import check_submission
from shared.schema_bounds import check_schema_shape
from shared.schemas import InferRequest, SamplingParams, StructuredOutput, ToolFunction, Tools
from tests.helpers.requests import infer_request


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def submission(schema_text: str | None = None, parameters: dict | None = None) -> InferRequest:
    structured = StructuredOutput(kind="json_schema", json_schema=schema_text) if schema_text else None
    tools = Tools(functions=[ToolFunction(name="f", parameters=parameters)]) if parameters is not None else None
    return infer_request(tools=tools, sampling=SamplingParams(structured=structured))


def test_depth_counts_objects_and_arrays_and_values_count_every_json_value() -> None:
    check_schema_shape(nested(15), max_depth=31, max_values=1000, param="p")  # 2 per level and the leaf: 31 deep
    with pytest.raises(SchemaTooLarge, match="deeper than 30"):
        check_schema_shape(nested(15), max_depth=30, max_values=1000, param="p")
    check_schema_shape({"enum": list(range(9))}, max_depth=4, max_values=11, param="p")  # dict, list, 9 values
    with pytest.raises(SchemaTooLarge, match="more than 10 values") as refused:
        check_schema_shape({"enum": list(range(9))}, max_depth=4, max_values=10, param="p")
    assert refused.value.status == 400 and refused.value.code == "schema_too_large" and refused.value.param == "p"


async def test_a_direct_submission_is_held_to_the_same_schema_bounds() -> None:
    bounds = RequestBounds()
    await check_submission(submission(json.dumps(nested(8))), 1000, bounds, None)
    with pytest.raises(SchemaTooLarge) as refused:
        await check_submission(submission(json.dumps(nested(100))), 1000, bounds, None)
    assert refused.value.param == "response_format"
    deeper_than_json_loads = "[" * 5000 + "]" * 5000  # a RecursionError in json.loads: still the typed 400
    with pytest.raises(SchemaTooLarge):
        await check_submission(submission(deeper_than_json_loads), 1000, bounds, None)
    with pytest.raises(InvalidSchema):
        await check_submission(submission("{not json"), 1000, bounds, None)
    with pytest.raises(SchemaTooLarge) as refused:
        await check_submission(submission(parameters=nested(100)), 1000, bounds, None)
    assert refused.value.param == "tools"
