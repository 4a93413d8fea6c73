"""The engine under a batch flood: an interactive request's time to first token, counted in engine
steps (not wall time), with SLO classes and without them (every request standard: FCFS)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.weights import ModelWeights, load_weights
from shared.schemas import SamplingParams, SloClass

FLOOD = 6
NEW_TOKENS = 16
ARRIVES_AT = 2  # the step before which the interactive request is added
DELAY = 2


class _NullTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


@pytest.fixture(scope="module")
def weights() -> ModelWeights:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return load_weights(LlamaForCausalLM(config).eval(), torch.float32, "cpu", 64)


def flood(weights: ModelWeights, batch: SloClass, interactive: SloClass) -> tuple[int, dict[str, int]]:
    """Steps from the interactive request's arrival to its first token; tokens per request at the end."""
    config = EngineConfig(
        num_blocks=64, kv_block_size=4, max_num_seqs=3, max_model_len=64, max_num_batched_tokens=64,
        class_preempt_after_steps=DELAY,
    )  # fmt: skip
    engine = LLMEngine(weights, tokenizer=_NullTokenizer(), config=config, eos_token_ids=set())
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i in range(FLOOD):
        engine.add_request(EngineRequest(f"batch-{i}", [10 + i, 20, 30, 40, 50, 60], params, slo_class=batch))
    tokens: dict[str, int] = {}
    first: int | None = None
    step = 0
    while engine.has_unfinished():
        if step == ARRIVES_AT:
            engine.add_request(EngineRequest("interactive", [7, 8, 9, 11], params, slo_class=interactive))
        for out in engine.step():
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.token_ids)
            if out.request_id == "interactive" and first is None:
                first = step - ARRIVES_AT + 1
        step += 1
    assert first is not None
    return first, tokens


def test_an_interactive_request_overtakes_a_batch_flood_only_with_classes(weights: ModelWeights) -> None:
    with_classes, served = flood(weights, batch="batch", interactive="interactive")
    without, served_fcfs = flood(weights, batch="standard", interactive="standard")
    # with classes: it waits its delay for a slot, then the newest batch request yields it one
    assert with_classes == DELAY
    # without: it queues behind the whole flood, FLOOD / max_num_seqs rounds of NEW_TOKENS steps
    assert without == (FLOOD // 3) * NEW_TOKENS - ARRIVES_AT + 1
    expected = {f"batch-{i}": NEW_TOKENS for i in range(FLOOD)} | {"interactive": NEW_TOKENS}
    assert served == served_fcfs == expected  # the preempted batch request is recomputed, nothing lost
