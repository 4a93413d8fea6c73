"""The bases users bring, on the vLLM worker engine: a GPTQ checkpoint serves with an adapter trained on the
unquantized model, greedy equal to HF PEFT on the dequantized weights; what vLLM's CPU build cannot serve is
refused at the engine's start in one typed line (services/worker/vllm_engine/base_check.py; its rules alone:
tests/worker/vllm_engine/test_vllm_base_check.py)."""

import copy
import hashlib

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from bench.prequant_writer import write_gptq
from tests.helpers.families import PROMPTS, save_family
from tests.helpers.prequant import with_weights
from tests.helpers.vllm_runner import NO_VLLM, VLLM_PYTHON, run_program

# head size 64: vLLM's CPU attention takes 32, 64, 80, 96, 112, 128, 256 only
SHAPES = {"vocab_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
MAX_TOKENS = 8
GROUP = 64

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(900),  # vLLM's engine starts in a child process: minutes on a contended 2-core machine
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=NO_VLLM),
]


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict[str, list[list[int]]]]:
    """vLLM's run (vllm_program.py "bases") and HF PEFT's greedy tokens on the dequantized weights."""
    work = tmp_path_factory.mktemp("vllm-bases")
    torch.manual_seed(0)
    dense = LlamaForCausalLM(LlamaConfig(**SHAPES, hidden_size=256, intermediate_size=512)).eval()
    dense.generation_config.eos_token_id = None
    gptq = save_family(dense, work / "gptq")
    reference = with_weights(dense, write_gptq(dense, gptq, GROUP, symmetric=True))
    torch.manual_seed(1)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapted = get_peft_model(copy.deepcopy(reference), config).eval()
    with torch.no_grad():  # deltas large enough to change greedy tokens
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)
    adapted.save_pretrained(work / "qv")
    digest = hashlib.sha256((work / "qv" / "adapter_model.safetensors").read_bytes()).hexdigest()
    torch.manual_seed(0)
    moe_config = Qwen3MoeConfig(**SHAPES, hidden_size=128, head_dim=32, num_experts=4, moe_intermediate_size=64)
    save_family(Qwen3MoeForCausalLM(moe_config).eval(), work / "moe")
    prompts = PROMPTS[:2]
    tokens: dict[str, list[list[int]]] = {"None": [], "qv": []}
    with torch.no_grad():
        for key, model in (("None", reference), ("qv", adapted)):
            for ids in prompts:
                out = model.generate(
                    input_ids=torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
                )
                tokens[key].append(out[0, len(ids) :].tolist())
    spec = {
        "model_dir": str(gptq),
        "moe_dir": str(work / "moe"),
        "scratch": str(work),
        "adapters": [{"key": "qv", "digest": digest, "dir": str(work / "qv"), "rank": 8}],
        "prompts": prompts,
        "max_tokens": MAX_TOKENS,
    }
    return run_program(work, spec, "bases")["bases"], tokens


@pytest.mark.parametrize("key", ["None", "qv"])
def test_a_gptq_base_and_its_adapter_give_peft_greedy_tokens_on_the_dequantized_weights(
    bases: tuple[dict, dict[str, list[list[int]]]], key: str
) -> None:
    result, reference = bases
    assert result["tokens"][key] == reference[key]
    assert reference["qv"] != reference["None"]  # the adapter changes the answer


def test_the_bases_vllm_cannot_serve_are_refused_at_start_typed(bases: tuple[dict, dict]) -> None:
    refusals = bases[0]["refusals"]
    assert refusals["quantized_float32"]["type"] == "UnsupportedQuantization"
    assert refusals["moe"]["type"] == "UnsupportedModel" and "mixture-of-experts" in refusals["moe"]["message"]
