"""A decode step's decoder layers in one native call (kernels/csrc/decoder_stack.cpp's DecoderStack).

From Python each of a layer's dozen ops (four projections, RoPE with the K/V write, the paged
attention, two residual adds with their norms, the activation, the slices between them) costs 4-6 us
of interpreter and dispatch before it runs: about 2.4 ms of a 30-layer decode step, a tenth of a
batch-1 step. The native stack calls the same registered ops with the same arguments from C++, so a
step's values are the Python loop's bit for bit.

It serves a step of decodes only (prefills take the Python loop: their attention is SDPA's), where
every piece has its native form: the fused layer ops and the native paged decode attention are on,
every projection takes the same path past the same small rows (linear.py's ``path``: a panel kernel,
or oneDNN's packed weight as bf16 on AMX does; or weight-only int8 codes or int4 nibbles with their
native small-row kernel, quant.py's ``QuantWeight``) as ``Linear`` does, and the step's LoRA deltas, if any,
are all ``lora_bgmv`` calls (``LoraHook.bgmv_calls``). ``cpu_layer_loop=python`` keeps the Python loop
for every step.
"""

from typing import Any, Literal

import torch

from services.worker.engine.attention import AttentionMetadata, AttentionParams
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.linear import Linear, LinearPath
from services.worker.engine.lora_hook import BgmvCalls
from services.worker.engine.weights import ModelWeights

CpuLayerLoop = Literal["auto", "python"]
PATHS: dict[LinearPath, int] = {"eight": 0, "wide": 1, "dot": 2, "onednn": 3, "int8": 4, "int4": 5}  # its kernel codes
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # lora_hook.GROUPS' order, DecoderStack's


class NativeLayerLoop:
    """The decoder layers of one model as a DecoderStack: built once at load, called per decode step."""

    def __init__(
        self, weights: ModelWeights, proj: list[dict[str, Linear]], attention: list[AttentionParams], gelu: bool
    ):
        s = weights.spec
        linears = [layer[name] for layer in proj for name in PROJECTIONS]
        first = linears[0]
        quant = [linear.quant for linear in linears if linear.quant is not None]
        weights_in: list[torch.Tensor | None]
        prepared: list[torch.Tensor | None]
        if quant:  # the codes stand for the weight (bf16 int4: torch's layout, all it keeps), the scales for the panel
            weights_in = [q.codes if q.codes is not None else q.packed for q in quant]
            prepared = [q.scales for q in quant]
        else:
            weights_in = [linear.weight for linear in linears]
            prepared = [linear.prepared for linear in linears]
        self._stack: Any = torch.classes.lorafleet.DecoderStack(
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
            s.rms_norm_eps,
            s.residual_multiplier,
            gelu,
            _small_rows(first),
            PATHS[first.path],
            weights_in,
            [linear.bias for linear in linears],
            prepared,
            [layer.post_norm for layer in weights.layers],
            [layer.input_norm for layer in weights.layers],
            [layer.attn_out_norm for layer in weights.layers],
            [layer.mlp_out_norm for layer in weights.layers],
            [layer.qk_norm for layer in weights.layers],
            s.norm_fp32,
            [int(layer.local_rope) for layer in weights.layers],
            [params.window or 0 for params in attention],
            [params.scale for params in attention],
            [params.softcap or 0.0 for params in attention],
            quant[0].kernel_rows if quant else 0,
        )
        if first.path == "int4":
            self._stack.use_int4(
                quant[0].group_size, [q.zeros for q in quant], [q.packed for q in quant], [q.scale_zeros for q in quant]
            )

    @staticmethod
    def serves(
        weights: ModelWeights, proj: list[dict[str, Linear]], attention: list[AttentionParams], native_ops: bool
    ) -> bool:
        """Whether a model's layers can run natively: CPU, the fused layer ops and the native decode
        attention on, one panel kernel (or oneDNN's packed weight; or int8 codes or int4 nibbles on their
        native small-row kernel) and small-row split for every projection, and dense layers only (no experts, no
        OLMoE-wide q/k norm)."""
        if any(layer.experts is not None or layer.wide_qk_norm is not None for layer in weights.layers):
            return False
        linears = [layer[name] for layer in proj for name in PROJECTIONS]
        return (
            native_ops
            and weights.embed.device.type == "cpu"
            and all(params.native for params in attention)
            and len({(linear.path, _small_rows(linear), _kernel_rows(linear), _group(linear)) for linear in linears})
            == 1
            and linears[0].path in PATHS
            and (linears[0].path not in ("int8", "int4") or _small_rows(linears[0]) > 0 or _int4_kernel(linears[0]))
        )

    def __call__(
        self,
        h: torch.Tensor,
        x: torch.Tensor,
        cos_sin: torch.Tensor,
        cos_sin_local: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
        lora: BgmvCalls,
    ) -> torch.Tensor:
        """h: the step's embedded decodes [n, hidden] (updated in place); x: layer 0's normed input ->
        the last layer's output, as LlamaForward.hidden returns it."""
        n = meta.num_decode
        out: torch.Tensor = self._stack.forward(
            h,
            x,
            cos_sin,
            cos_sin_local,
            meta.slot_mapping,
            cache.data,
            meta.decode_blocks.view(n, -1),
            meta.decode_lengths,
            cache.block_size,
            lora.tensors,
            lora.layout,
        )
        return out


def _small_rows(linear: Linear) -> int:
    """Rows up to which ``linear`` takes its native small-row kernel (a quantized weight's own)."""
    return linear.quant.small_rows if linear.quant is not None else linear.small_rows


def _int4_kernel(linear: Linear) -> bool:
    """Whether an int4 weight runs torch's int4 kernel at every row count (bf16)."""
    return linear.quant is not None and linear.quant.format == "int4" and linear.quant.packed is not None


def _group(linear: Linear) -> int:
    """An int4 weight's group size (0 otherwise): one per stack."""
    return linear.quant.group_size if linear.quant is not None and linear.quant.format == "int4" else 0


def _kernel_rows(linear: Linear) -> int:
    """Rows up to which an int8 weight takes torch's bf16 kernel past its small rows (0 otherwise)."""
    return linear.quant.kernel_rows if linear.quant is not None else 0
