"""What the vLLM worker refuses of a base model at start-up, judged from its config alone
(services/worker/vllm_engine/base_check.py; measured against vLLM in tests/worker/vllm_engine/test_vllm_bases.py)."""

import pytest

from services.worker.engine.errors import UnsupportedModel, UnsupportedQuantization
from services.worker.vllm_engine.base_check import check_base


def test_a_moe_base_is_refused_on_the_cpu_build_only() -> None:
    moe = {"model_type": "qwen3_moe", "num_experts": 8}
    with pytest.raises(UnsupportedModel, match=r"mixture-of-experts.*LF_WORKER_ENGINE=builtin"):
        check_base(moe, "float32", on_cpu=True)
    check_base(moe, "float32", on_cpu=False)
    check_base({"model_type": "mixtral", "num_local_experts": 1}, "float32", on_cpu=True)  # one expert: dense
    check_base({"model_type": "llama"}, "float32", on_cpu=True)


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_a_quantized_base_runs_in_half_precision_only(method: str) -> None:
    config = {"model_type": "llama", "quantization_config": {"quant_method": method}}
    with pytest.raises(UnsupportedQuantization, match=rf"a {method} checkpoint .* not float32.*LF_VLLM__DTYPE"):
        check_base(config, "float32", on_cpu=True)
    for dtype in ("float16", "bfloat16"):
        check_base(config, dtype, on_cpu=True)
