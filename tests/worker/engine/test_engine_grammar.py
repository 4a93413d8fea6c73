"""Structured outputs in the engine: constrained and free rows share a batch, the constrained
output parses and validates, a free neighbour is unchanged, a bad schema is a typed refusal."""

import json

import jsonschema
import pytest
from prometheus_client import REGISTRY

from services.worker.engine import EngineRequest, LLMEngine
from services.worker.engine.grammar import digest
from services.worker.engine.model_loader import LoadedModel, load_model
from shared.errors import InvalidSchema
from shared.schemas import SamplingParams, StructuredOutput
from tests.worker.engine.test_engine import make_engine, run

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "enum": ["France", "Italy", "Spain"]},
        "population_millions": {"type": "number"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["city", "country", "population_millions", "landmarks"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model()


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> LLMEngine:
    return make_engine(loaded)


def chat(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_constrained_and_free_requests_share_a_batch(loaded: LoadedModel, engine: LLMEngine) -> None:
    free_ids = chat(loaded, "What is the capital of France?")
    free = SamplingParams(max_tokens=24, temperature=0.0)
    engine.add_request(EngineRequest("alone", free_ids, free))
    alone = run(engine)["alone"]
    structured = StructuredOutput(kind="json_schema", json_schema=json.dumps(SCHEMA))
    constrained = SamplingParams(max_tokens=160, temperature=0.7, seed=3, structured=structured)
    json_mode = SamplingParams(max_tokens=160, temperature=0.0, structured=StructuredOutput(kind="json_object"))
    engine.add_request(EngineRequest("json", chat(loaded, "Describe Paris as JSON."), constrained))
    engine.add_request(EngineRequest("free", free_ids, free))
    engine.add_request(EngineRequest("object", chat(loaded, "Give me a JSON object about a cat."), json_mode))
    results = run(engine)
    assert results["free"] == alone
    _, text, reason = results["json"]
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    _, text, reason = results["object"]
    assert reason == "stop" and isinstance(json.loads(text), dict)


def test_grammars_are_cached_by_digest(engine: LLMEngine) -> None:
    a = StructuredOutput(kind="json_schema", json_schema=json.dumps(SCHEMA))
    b = StructuredOutput(kind="json_schema", json_schema=json.dumps({**SCHEMA, "required": ["city"]}))
    assert engine.grammars.compile(a) is engine.grammars.compile(a)
    assert engine.grammars.compile(b) is not engine.grammars.compile(a)
    assert digest(a) != digest(b) and digest(a) != digest(StructuredOutput(kind="json_object"))


@pytest.mark.parametrize(
    "schema",
    [{"type": "nonsense"}, {"type": "string", "pattern": "(?<=a)b"}, {"$ref": "#/$defs/missing"}],
)
def test_a_schema_xgrammar_cannot_compile_is_a_typed_400(loaded: LoadedModel, engine: LLMEngine, schema: dict) -> None:
    params = SamplingParams(structured=StructuredOutput(kind="json_schema", json_schema=json.dumps(schema)))
    with pytest.raises(InvalidSchema) as raised:
        engine.add_request(EngineRequest("bad", chat(loaded, "hi"), params))
    assert raised.value.status == 400 and raised.value.code == "invalid_json_schema"
    assert not engine.has_unfinished()


def test_a_request_carrying_its_compiled_grammar_is_not_compiled_on_the_step_loop(
    loaded: LoadedModel, engine: LLMEngine
) -> None:
    spec = StructuredOutput(kind="json_schema", json_schema=json.dumps({**SCHEMA, "title": "carried"}))
    grammar = engine.grammars.compile(spec, "alice")  # as AsyncEngine.generate does, before the step loop
    compiled = REGISTRY.get_sample_value("grammar_compiles_total", {"outcome": "compiled"})
    params = SamplingParams(max_tokens=8, temperature=0.0, structured=spec)
    # bob has no cache entry for it: without the carried grammar the engine would compile it here
    engine.add_request(
        EngineRequest("carried", chat(loaded, "Describe Paris as JSON."), params, tenant="bob", grammar=grammar)
    )
    assert REGISTRY.get_sample_value("grammar_compiles_total", {"outcome": "compiled"}) == compiled
    assert engine.grammars.cached(spec, "bob") is None
    assert run(engine)["carried"][1].startswith("{")
