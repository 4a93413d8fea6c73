"""The engine's Llama-family forward pass over a flattened step of tokens, with the LoRA hook."""

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F

from kernels import native, projections
from services.worker.engine.attention import AttentionMetadata, AttentionParams, paged_attention, write_kv
from services.worker.engine.errors import UnsupportedQuantization
from services.worker.engine.experts import moe_mlp
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.layer_loop import NativeLayerLoop
from services.worker.engine.linear import Linear, LinearFactory
from services.worker.engine.lora_hook import BgmvCalls, LoraHook
from services.worker.engine.rope import apply_rope, rope_factors
from services.worker.engine.weights import ModelWeights

CpuLayerOps = Literal["auto", "torch", "native"]
NO_LORA = BgmvCalls([], [])


def use_native_layer_ops(mode: CpuLayerOps, device: str, dtype: torch.dtype) -> bool:
    """Whether a layer's RMSNorms, residual adds, RoPE and K/V write take kernels.native's fused ops:
    ``auto`` where they apply (CPU, fp32 or bf16) and build and pass their probe here, ``torch`` never,
    ``native`` always (raises ValueError where they cannot)."""
    if mode == "torch":
        return False
    if torch.device(device).type == "cpu" and dtype in native.DTYPES and native.native_layer_ops():
        return True
    if mode == "native":
        raise ValueError(
            f"cpu_layer_ops='native' is not usable for {device} {dtype}: the ops serve CPU fp32 and bf16, "
            "and need a C++ toolchain to build (see the log)"
        )
    return False


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class LlamaForward:
    """RMSNorm, RoPE, GQA attention, SwiGLU, with q/k/v and gate/up fused into one matmul each.

    With a ``lora`` object, each projection group's fused output (lora_hook.GROUPS: q|k|v, o,
    gate|up, down) is passed to ``lora.apply`` after the base matmul, which adds into each member's
    columns in place.

    With ``native_layer_ops`` (CPU: :func:`use_native_layer_ops`) the steps between the matmuls are
    kernels.native's fused ops: each residual add with the norm after it (the residual stream updated
    in place), RoPE with the K/V cache write (q and k rotated in place in the qkv output), the MLP's
    activation with its product by up. Their values are the eager ops', rounded where those round, up
    to the order of the norms' fp32 sums and the activation's exp (2 ulp).

    With ``native_layer_loop`` and where layer_loop.NativeLayerLoop serves the model, a step of
    decodes only runs its layers in one native call (the same ops, the same values); prefills, and
    steps whose LoRA deltas are not all native, take the loop here.
    """

    def __init__(
        self,
        weights: ModelWeights,
        linear: LinearFactory | None = None,
        native_attention: bool = False,
        native_layer_ops: bool = False,
        native_layer_loop: bool = False,
    ):
        self.spec = weights.spec
        make = linear or LinearFactory("torch", str(weights.embed.device), weights.embed.dtype)
        if make.weights != "none" and any(layer.experts is not None for layer in weights.layers):
            raise UnsupportedQuantization(
                f"LF_ENGINE__WEIGHTS={make.weights} does not quantize mixture-of-experts layers"
            )
        self.proj: list[dict[str, Linear]] = []
        for layer in weights.layers:
            packed = layer.packed
            proj = {
                "qkv": make(layer.qkv, layer.qkv_bias, packed=packed.get("qkv")),
                "o": make(layer.o, layer.o_bias, packed=packed.get("o")),
            }
            if layer.gate_up is not None and layer.down is not None:  # a dense MLP (or the shared expert)
                proj |= {
                    "gate_up": make(layer.gate_up, layer.gate_up_bias, packed=packed.get("gate_up")),
                    "down": make(layer.down, layer.down_bias, packed=packed.get("down")),
                }
            self.proj.append(proj)
        self.lm_head = make.head(weights.lm_head, weights.lm_head_packed)
        self.w = weights = _without_quantized(weights, self.proj, self.lm_head)
        # the experts keep their plain weights: the small-row kernel (if the factory may use it) or F.linear
        self._expert_small_rows = projections.SMALL_LINEAR_ROWS if make.small_rows else 0
        s = self.spec
        # Granite's multipliers, resolved once: None where the family leaves that step as Llama's
        self._embed_mul = s.embedding_multiplier if s.embedding_multiplier != 1.0 else None
        self._residual_mul = s.residual_multiplier if s.residual_multiplier != 1.0 else None
        self._logits_div = s.logits_scaling if s.logits_scaling != 1.0 else None
        # The family's norm form and activation, chosen once rather than tested per layer
        self.native = native_layer_ops
        self.norm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
            self._norm_native if native_layer_ops else self._norm_fp32 if s.norm_fp32 else self._norm_plain
        )
        self.act: Callable[[torch.Tensor], torch.Tensor] = _gelu_tanh if s.gelu_tanh else F.silu
        self._gelu = s.gelu_tanh
        self.attention = [
            AttentionParams(s.attention_scale, layer.window, s.attn_softcap, native_attention)
            for layer in weights.layers
        ]
        self.loop: NativeLayerLoop | None = None
        if native_layer_loop and NativeLayerLoop.serves(weights, self.proj, self.attention, native_layer_ops):
            self.loop = NativeLayerLoop(weights, self.proj, self.attention, s.gelu_tanh)

    def _norm_plain(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.spec.rms_norm_eps)

    def _norm_fp32(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Gemma: x * (1 + w) in fp32 (weight holds 1 + w), then cast, as transformers does."""
        return F.rms_norm(x.float(), (x.shape[-1],), weight, self.spec.rms_norm_eps).to(x.dtype)

    def _norm_native(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Either form in one call: an fp32 weight (Gemma's 1 + w) gives _norm_fp32's values."""
        return native.rms_norm(x, weight, self.spec.rms_norm_eps)

    def _add_norm(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta [* the residual multiplier], its norm by ``weight``): the residual stream and the
        next block's input. Native: one call, h updated in place."""
        if self.native:
            mul = self._residual_mul if self._residual_mul is not None else 1.0
            return h, native.add_rms_norm(h, delta, weight, self.spec.rms_norm_eps, mul)
        h = h + delta if self._residual_mul is None else h + delta * self._residual_mul
        return h, self.norm(h, weight)

    def _head_norm(self, qk: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """qk [tokens, heads, head_dim] normed over head_dim; weight [heads, head_dim]."""
        eps = self.spec.rms_norm_eps
        if self.spec.norm_fp32:
            return F.rms_norm(qk.float(), (qk.shape[-1],), None, eps).mul_(weight).to(qk.dtype)
        return F.rms_norm(qk, (qk.shape[-1],), None, eps).mul_(weight)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
        logits_indices: torch.Tensor,
        lora: LoraHook | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; logits_indices: [num_logits] -> fp32 logits [num_logits, vocab]."""
        return self.logits(self.hidden(input_ids, positions, meta, cache, lora)[logits_indices])

    @torch.inference_mode()
    def hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
        lora: LoraHook | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> the last layer's output [num_tokens, hidden] (before the final norm)."""
        s = self.spec
        cos_sin = self.w.rope[positions]
        cos_sin_local = self.w.rope_local[positions] if self.w.rope_local is not None else cos_sin
        h = self.w.embed[input_ids]
        if self._embed_mul is not None:
            h = h * self._embed_mul
        layers = self.w.layers
        x = self.norm(h, layers[0].input_norm)
        if self.loop is not None and not meta.prefill_bounds:
            calls = lora.bgmv_calls(h.dtype) if lora is not None else NO_LORA
            if calls is not None:
                return self.loop(h, x, cos_sin, cos_sin_local, meta, cache, calls)
        k_end = s.q_size + s.kv_size
        heads = s.num_heads + s.num_kv_heads
        rope, rope_local = rope_factors(cos_sin), rope_factors(cos_sin_local)
        attn_out = h.new_empty(h.shape[0], s.q_size)
        groups = lora.groups if lora is not None else frozenset[str]()
        for i, (layer, proj) in enumerate(zip(layers, self.proj, strict=True)):
            qkv = proj["qkv"](x)
            if lora is not None and "qkv" in groups:
                lora.apply(i, "qkv", x, qkv)
            if layer.wide_qk_norm is not None:
                q_norm, k_norm = layer.wide_qk_norm
                qkv = torch.cat(
                    [
                        self._norm_plain(qkv[:, : s.q_size], q_norm),
                        self._norm_plain(qkv[:, s.q_size : k_end], k_norm),
                        qkv[:, k_end:],
                    ],
                    dim=1,
                )
            qk = qkv[:, :k_end].view(-1, heads, s.head_dim)
            if layer.qk_norm is not None:
                qk = self._head_norm(qk, layer.qk_norm)
            v = qkv[:, k_end:].view(-1, s.num_kv_heads, s.head_dim)
            kv = cache.layer(i)
            if self.native:  # rotated in place, then this step's K/V written
                native.rope_write_kv(qk, v, cos_sin_local if layer.local_rope else cos_sin, meta.slot_mapping, kv)
            else:
                qk = apply_rope(qk, *(rope_local if layer.local_rope else rope))
                write_kv(kv, qk[:, s.num_heads :], v, meta.slot_mapping)
            q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]
            a = paged_attention(q, k, v, kv, meta, cache.block_size, attn_out, self.attention[i])
            o = proj["o"](a)
            if lora is not None and "o" in groups:
                lora.apply(i, "o", a, o)
            if layer.attn_out_norm is not None:
                o = self.norm(o, layer.attn_out_norm)
            h, x = self._add_norm(h, o, layer.post_norm)
            if layer.experts is None:
                d = self._mlp(i, proj, x, lora, groups)
            else:
                d = moe_mlp(x, layer.experts, self.act, self._expert_small_rows, lora, i)
                if layer.experts.shared_gate is not None:  # Qwen2-MoE's shared expert, gated per token; its
                    # LoRA is the layer's gate/up/down slots, sized for it (shared.lora_targets)
                    d = d + torch.sigmoid(F.linear(x, layer.experts.shared_gate)) * self._mlp(i, proj, x, lora, groups)
            if layer.mlp_out_norm is not None:
                d = self.norm(d, layer.mlp_out_norm)
            if i + 1 < len(layers):  # the residual add with the next layer's input norm
                h, x = self._add_norm(h, d, layers[i + 1].input_norm)
            else:
                h = h + d if self._residual_mul is None else h + d * self._residual_mul
        return h

    def _mlp(
        self, i: int, proj: dict[str, Linear], x: torch.Tensor, lora: LoraHook | None, groups: frozenset[str]
    ) -> torch.Tensor:
        """x [n, hidden] -> the layer's dense MLP output (Qwen2-MoE: its shared expert), with its LoRA deltas."""
        gate_up = proj["gate_up"](x)
        inter = gate_up.shape[1] // 2
        if lora is not None and "gate_up" in groups:
            lora.apply(i, "gate_up", x, gate_up)
        if self.native:
            act = native.act_mul(gate_up, self._gelu)
        else:
            act = self.act(gate_up[:, :inter]).mul_(gate_up[:, inter:])
        d = proj["down"](act)
        if lora is not None and "down" in groups:
            lora.apply(i, "down", act, d)
        return d

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [rows, hidden] from ``hidden`` -> fp32 logits [rows, vocab]."""
        s = self.spec
        logits = self.lm_head(self.norm(h, self.w.final_norm))
        if self._logits_div is not None:
            logits = logits / self._logits_div
        if s.final_softcap is not None:
            logits = torch.tanh(logits / s.final_softcap) * s.final_softcap
        return logits.float()


def _without_quantized(weights: ModelWeights, proj: list[dict[str, Linear]], lm_head: Linear) -> ModelWeights:
    """``weights`` as this forward keeps them: a quantized projection runs on its codes alone, so in
    place of its unquantized weight it holds only the logical (meta) one, and the unquantized copy is
    freed once the caller lets go of ``weights`` (the engine does, after building; ``weights`` itself is
    not changed). The embedding stays whether tied to lm_head or not: its rows are looked up."""
    if lm_head.quant is None and all(linear.quant is None for layer in proj for linear in layer.values()):
        return weights
    layers = []
    for layer, linears in zip(weights.layers, proj, strict=True):
        # the keys are LayerWeights' projection fields ("qkv", "o", "gate_up", "down"), each a tensor
        logical: dict[str, Any] = {name: linear.weight for name, linear in linears.items() if linear.quant is not None}
        layers.append(dataclasses.replace(layer, **logical))
    head = lm_head.weight if lm_head.quant is not None else weights.lm_head
    return dataclasses.replace(weights, layers=layers, lm_head=head)
