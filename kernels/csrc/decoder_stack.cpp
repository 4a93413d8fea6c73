// A decode step's whole layer loop in one native call: the decoder layers of services/worker/engine/
// model.py's LlamaForward.hidden, op for op, for a step of decodes only.
//
// Why: a decode step runs about a dozen ops per layer (four projections, RoPE with the K/V write, the
// paged attention, two residual adds with their norms, the activation, their slices and views), and
// from Python each costs 4-6 us of interpreter and dispatch before it starts: about 2.4 ms of a
// 30-layer step, a tenth of a batch-1 step. Here the same ops are called from C++ through torch's
// dispatcher (a fraction of a microsecond each), so only the embedding and the first norm remain in
// Python.
//
// The ops are the registered lorafleet ops the Python loop calls (small_linear, the panel kernels,
// rope_write_kv, paged_decode, add_rms_norm, rms_norm, act_mul, lora_bgmv) and ATen's add and mul,
// with the same arguments in the same order, so a step's values are the Python loop's bit for bit
// (tests/worker/engine/test_decoder_stack.py). A projection takes small_linear up to `small_rows` rows and
// the stack's panel kernel past them, as linear.py's Linear does, or oneDNN's packed linear with the
// rows padded as linear.py's padded_rows pads them (bf16 on CPUs with AMX, where oneDNN's AMX GEMM is
// 1.5-5x the dot-product panel kernel from 16 rows on); the stack is built only where every projection
// has one of these (model.py says when it serves a step). Weight-only int8 projections (quant.py) take
// small_linear_int8 on their codes and scales up to `small_rows` rows, torch's bf16 int8 kernel up to
// `quant_rows`, and past them the weight dequantized per call, as quant.py's QuantWeight does; int4 ones
// take small_linear_int4 on their nibbles, scales and zeros up to `small_rows` rows, past them torch's bf16
// int4 kernel or the weight dequantized per call (use_int4 hands over the parts beside the constructor's).
//
// LoRA: the step's deltas come as lora_bgmv calls (group, per layer the targeted members' A and B,
// their columns, the class's scales and token rows), added after each group's projection in the order
// given, as LoraBatch.apply adds them.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr int64_t kGroups = 4;  // qkv, o, gate_up, down: linear.py's GROUPS order
enum Kernel : int64_t { kEight = 0, kWide = 1, kDot = 2, kOneDnn = 3, kInt8 = 4, kInt4 = 5 };

c10::OperatorHandle op(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

using Optional = c10::optional<at::Tensor>;

// The ops, looked up once (the typed handles check each kernel's C++ signature on first use).
struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const Optional&)> small_linear =
      op("lorafleet::small_linear").typed<at::Tensor(const at::Tensor&, const at::Tensor&, const Optional&)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Optional&)>
      small_linear_int8 = op("lorafleet::small_linear_int8")
                              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Optional&)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Optional&,
                                      const Optional&, int64_t)>
      small_linear_int4 = op("lorafleet::small_linear_int4")
                              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                const Optional&, const Optional&, int64_t)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const Optional&, int64_t)> panel[3] = {
      op("lorafleet::panel_linear").typed<at::Tensor(const at::Tensor&, const at::Tensor&, const Optional&, int64_t)>(),
      op("lorafleet::panel_linear_wide")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const Optional&, int64_t)>(),
      op("lorafleet::panel_linear_dot")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const Optional&, int64_t)>(),
  };
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor)>
      rope_write_kv = op("lorafleet::rope_write_kv")
                          .typed<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor)>();
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor,
                                int64_t, double, double, int64_t)>
      paged_decode = op("lorafleet::paged_decode")
                         .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     at::Tensor, int64_t, double, double, int64_t)>();
  c10::TypedOperatorHandle<at::Tensor(at::Tensor, const at::Tensor&, const at::Tensor&, double, double)> add_rms_norm =
      op("lorafleet::add_rms_norm").typed<at::Tensor(at::Tensor, const at::Tensor&, const at::Tensor&, double, double)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      op("lorafleet::rms_norm").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, bool)> act_mul =
      op("lorafleet::act_mul").typed<at::Tensor(const at::Tensor&, bool)>();
  c10::TypedOperatorHandle<void(const at::Tensor&, at::Tensor, at::TensorList, at::TensorList, at::IntArrayRef,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&)>
      lora_bgmv = op("lorafleet::lora_bgmv")
                      .typed<void(const at::Tensor&, at::Tensor, at::TensorList, at::TensorList, at::IntArrayRef,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
};

const Ops& ops() {
  static const Ops instance;
  return instance;
}

// oneDNN's packed linear, looked up on first use (a torch built without oneDNN has no such op, and
// only a stack of kernel kOneDnn calls it).
const c10::OperatorHandle& onednn_linear() {
  static const c10::OperatorHandle handle = op("mkldnn::_linear_pointwise");
  return handle;
}

// linear.py's padded_rows: 1, then multiples of 8 up to 32, then four steps per doubling.
int64_t padded_rows(int64_t rows) {
  if (rows <= 1) return rows;
  if (rows <= 32) return (rows + 7) / 8 * 8;
  int64_t bits = 0;
  for (int64_t v = rows - 1; v > 0; v >>= 1) ++bits;
  const int64_t step = int64_t{1} << (bits - 3);
  return (rows + step - 1) / step * step;
}

struct Projection {
  at::Tensor weight;  // [out, in], for small_linear (kInt8: the int8 codes; kInt4: the nibbles [out, in / 2])
  Optional bias;
  at::Tensor panel;  // weight packed for the stack's panel kernel (oneDNN's blocked layout for kOneDnn; kInt8: scales
                     // [out]; kInt4: scales [out, groups])
  int64_t features;
  Optional zeros = {};  // kInt4: z [out, groups] uint8, or none for 8
  Optional packed4 = {}, scale_zeros = {};  // kInt4 in bf16: torch's int4 layout and its (scale, offset) pairs
};

// One step's lora_bgmv call for one group and rank class, every layer.
struct LoraCall {
  int64_t group, members;
  std::vector<at::Tensor> a, b;  // [layer * members + m]
  std::vector<int64_t> cols;
  at::Tensor scale, token_idx, token_row;
};

struct DecoderStack : torch::CustomClassHolder {
  int64_t layers, heads, kv_heads, head_dim, small_rows, kernel, quant_rows;
  int64_t group = 0;  // kInt4: input features per scale (use_int4)
  double eps, residual_mul;
  bool gelu;
  std::vector<Projection> proj;  // [layer * 4 + group]
  std::vector<at::Tensor> post_norm, next_norm;  // next_norm[i]: layer i + 1's input norm (unused for the last)
  std::vector<Optional> attn_out_norm, mlp_out_norm, qk_norm;  // qk_norm [heads + kv_heads, d] (Qwen3, Gemma 3)
  bool norm_fp32;  // Gemma: the q/k head norm in fp32, then cast
  std::vector<int64_t> local_rope, window;
  std::vector<double> scale, softcap;

  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double residual_mul, bool gelu,
               int64_t small_rows, int64_t kernel, std::vector<at::Tensor> weights, c10::List<Optional> biases,
               std::vector<at::Tensor> panels, std::vector<at::Tensor> post_norms, std::vector<at::Tensor> input_norms,
               c10::List<Optional> attn_out_norms, c10::List<Optional> mlp_out_norms, c10::List<Optional> qk_norms,
               bool norm_fp32, std::vector<int64_t> local_rope, std::vector<int64_t> windows, std::vector<double> scales,
               std::vector<double> softcaps, int64_t quant_rows)
      : layers(static_cast<int64_t>(post_norms.size())),
        heads(heads),
        kv_heads(kv_heads),
        head_dim(head_dim),
        small_rows(small_rows),
        kernel(kernel),
        quant_rows(quant_rows),
        eps(eps),
        residual_mul(residual_mul),
        gelu(gelu),
        post_norm(std::move(post_norms)),
        norm_fp32(norm_fp32),
        local_rope(std::move(local_rope)),
        window(std::move(windows)),
        scale(std::move(scales)),
        softcap(std::move(softcaps)) {
    TORCH_CHECK(layers >= 1, "DecoderStack: no layers");
    TORCH_CHECK(kernel >= kEight && kernel <= kInt4, "DecoderStack: unknown panel kernel ", kernel);
    TORCH_CHECK(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0 && head_dim >= 1, "DecoderStack: head counts");
    const size_t n = static_cast<size_t>(layers);
    TORCH_CHECK(weights.size() == n * kGroups && biases.size() == n * kGroups && panels.size() == n * kGroups,
                "DecoderStack: four projections per layer");
    TORCH_CHECK(input_norms.size() == n && attn_out_norms.size() == n && mlp_out_norms.size() == n &&
                    qk_norms.size() == n && this->local_rope.size() == n && window.size() == n && scale.size() == n && softcap.size() == n,
                "DecoderStack: one of each per layer");
    for (size_t i = 0; i < weights.size(); ++i) {
      TORCH_CHECK(weights[i].dim() == 2 && weights[i].is_contiguous(), "DecoderStack: weights [out, in] contiguous");
      proj.push_back({weights[i], biases.get(i), panels[i], weights[i].size(0)});
    }
    for (size_t i = 0; i < n; ++i) {
      next_norm.push_back(i + 1 < n ? input_norms[i + 1] : input_norms[i]);
      attn_out_norm.push_back(attn_out_norms.get(i));
      mlp_out_norm.push_back(mlp_out_norms.get(i));
      qk_norm.push_back(qk_norms.get(i));
    }
  }

  at::Tensor linear(int64_t layer, int64_t group, const at::Tensor& x) const {
    const Projection& p = proj[layer * kGroups + group];
    const int64_t rows = x.size(0);
    if (kernel == kInt8) return int8_linear(x, p);
    if (kernel == kInt4) return int4_linear(x, p);
    if (rows <= small_rows && rows > 0)
      return ops().small_linear.call(x.stride(-1) == 1 ? x : x.contiguous(), p.weight, p.bias);
    if (kernel == kOneDnn) return packed_linear(x, p);
    return ops().panel[kernel].call(x, p.panel, p.bias, p.features);
  }

  // quant.py's QuantWeight.__call__ for int8 codes (p.weight) and scales (p.panel).
  at::Tensor int8_linear(const at::Tensor& x, const Projection& p) const {
    const int64_t rows = x.size(0);
    if (rows <= small_rows && rows > 0)
      return ops().small_linear_int8.call(x.stride(-1) == 1 ? x : x.contiguous(), p.weight, p.panel, p.bias);
    if (rows <= quant_rows && rows > 0) {
      at::Tensor out = at::_weight_int8pack_mm(x.contiguous(), p.weight, p.panel);
      return p.bias ? out.add_(*p.bias) : out;
    }
    return at::linear(x, p.weight.to(p.panel.scalar_type()).mul(p.panel.unsqueeze(1)), p.bias);
  }

  // kInt4's per-projection parts (quant.py's QuantWeight): each projection's zeros (none: z = 8) and, in
  // bf16, torch's int4 layout with its (scale, offset) pairs for the rows past small_rows.
  void use_int4(int64_t group_size, c10::List<Optional> zeros, c10::List<Optional> packed,
                c10::List<Optional> scale_zeros) {
    TORCH_CHECK(kernel == kInt4, "DecoderStack: use_int4 on a stack of kernel ", kernel);
    TORCH_CHECK(group_size > 0, "DecoderStack: int4 group size ", group_size);
    TORCH_CHECK(zeros.size() == proj.size() && packed.size() == proj.size() && scale_zeros.size() == proj.size(),
                "DecoderStack: use_int4 wants one of each per projection");
    group = group_size;
    for (size_t i = 0; i < proj.size(); ++i) {
      proj[i].zeros = zeros.get(i);
      proj[i].packed4 = packed.get(i);
      proj[i].scale_zeros = scale_zeros.get(i);
      TORCH_CHECK(proj[i].packed4.has_value() == proj[i].scale_zeros.has_value(),
                  "DecoderStack: torch's int4 layout comes with its scale and offset pairs");
    }
  }

  // quant.py's QuantWeight.__call__ for int4 nibbles (p.weight) and scales (p.panel): the small-row
  // kernel, else torch's bf16 kernel, else the weight dequantized per call as QuantWeight.dequantize does.
  at::Tensor int4_linear(const at::Tensor& x, const Projection& p) const {
    TORCH_CHECK(group > 0, "DecoderStack: int4 projections before use_int4");
    const int64_t rows = x.size(0);
    if (rows <= small_rows && rows > 0)
      return ops().small_linear_int4.call(x.stride(-1) == 1 ? x : x.contiguous(), p.weight, p.panel, p.zeros, p.bias,
                                          group);
    if (p.packed4) {
      at::Tensor out = at::_weight_int4pack_mm_for_cpu(x.contiguous(), *p.packed4, group, *p.scale_zeros);
      return p.bias ? out.add_(*p.bias) : out;
    }
    const at::Tensor low = p.weight.bitwise_and(0xF).to(at::kShort), high = p.weight.bitwise_right_shift(4).to(at::kShort);
    at::Tensor codes = at::stack({low, high}, -1).view({p.features, -1, group});
    codes = p.zeros ? codes - p.zeros->unsqueeze(2).to(at::kShort) : codes - 8;
    const at::Tensor weight = (codes.to(p.panel.scalar_type()) * p.panel.unsqueeze(2)).view({p.features, -1});
    return at::linear(x, weight, p.bias);
  }

  // linear.py's _packed_linear: the rows zero-padded to padded_rows (oneDNN keeps a primitive per shape).
  static at::Tensor packed_linear(const at::Tensor& x, const Projection& p) {
    const int64_t rows = x.size(0), padded = padded_rows(rows);
    const at::Tensor in = padded == rows ? x : at::cat({x, x.new_zeros({padded - rows, x.size(1)})});
    torch::jit::Stack stack{in, p.panel, p.bias, std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                            std::string("")};
    onednn_linear().callBoxed(&stack);
    at::Tensor out = stack.back().toTensor();
    return padded == rows ? out : out.narrow(0, 0, rows);
  }

  // LlamaForward._head_norm: each q and k head normed over head_dim (ATen's rms_norm), times its weight.
  at::Tensor head_norm(const at::Tensor& qk, const at::Tensor& weight) const {
    if (norm_fp32) return at::rms_norm(qk.to(at::kFloat), {head_dim}, c10::nullopt, eps).mul_(weight).to(qk.scalar_type());
    return at::rms_norm(qk, {head_dim}, c10::nullopt, eps).mul_(weight);
  }

  void lora(const std::vector<LoraCall>& calls, int64_t layer, int64_t group, const at::Tensor& x,
            const at::Tensor& y) const {
    for (const LoraCall& c : calls) {
      if (c.group != group) continue;
      const auto first = c.a.begin() + layer * c.members;
      const std::vector<at::Tensor> a(first, first + c.members);
      const std::vector<at::Tensor> b(c.b.begin() + layer * c.members, c.b.begin() + (layer + 1) * c.members);
      ops().lora_bgmv.call(x, y, a, b, c.cols, c.scale, c.token_idx, c.token_row);
    }
  }

  // h: the embedded tokens [n, hidden], updated in place (the residual stream); x: layer 0's normed
  // input. Returns the last layer's output (before the final norm), as LlamaForward.hidden does.
  at::Tensor forward(at::Tensor h, at::Tensor x, at::Tensor cos_sin, at::Tensor cos_sin_local, at::Tensor slots,
                     at::Tensor cache, at::Tensor tables, at::Tensor lengths, int64_t block_size,
                     std::vector<at::Tensor> lora_tensors, std::vector<int64_t> lora_layout) const {
    TORCH_CHECK(cache.dim() == 5 && cache.size(0) == layers, "DecoderStack: cache [layers, 2, kv_heads, slots, d]");
    const std::vector<LoraCall> calls = lora_calls(lora_tensors, lora_layout);
    const int64_t n = h.size(0), q_size = heads * head_dim, k_end = q_size + kv_heads * head_dim;
    const at::Tensor attn_out = at::empty({n, q_size}, h.options());
    const Ops& o = ops();
    for (int64_t i = 0; i < layers; ++i) {
      at::Tensor qkv = linear(i, 0, x);
      lora(calls, i, 0, x, qkv);
      at::Tensor qk = qkv.narrow(1, 0, k_end).view({-1, heads + kv_heads, head_dim});
      if (qk_norm[i]) qk = head_norm(qk, *qk_norm[i]);
      const at::Tensor v = qkv.narrow(1, k_end, qkv.size(1) - k_end).view({-1, kv_heads, head_dim});
      const at::Tensor kv = cache.select(0, i);
      o.rope_write_kv.call(qk, v, local_rope[i] ? cos_sin_local : cos_sin, slots, kv);
      o.paged_decode.call(qk.narrow(1, 0, heads), kv, tables, lengths, attn_out, block_size, scale[i], softcap[i],
                          window[i]);
      at::Tensor out = linear(i, 1, attn_out);
      lora(calls, i, 1, attn_out, out);
      if (attn_out_norm[i]) out = o.rms_norm.call(out, *attn_out_norm[i], eps);
      x = o.add_rms_norm.call(h, out, post_norm[i], eps, residual_mul);
      const at::Tensor gate_up = linear(i, 2, x);
      lora(calls, i, 2, x, gate_up);
      const at::Tensor act = o.act_mul.call(gate_up, gelu);
      at::Tensor down = linear(i, 3, act);
      lora(calls, i, 3, act, down);
      if (mlp_out_norm[i]) down = o.rms_norm.call(down, *mlp_out_norm[i], eps);
      if (i + 1 < layers) {
        x = o.add_rms_norm.call(h, down, next_norm[i], eps, residual_mul);
      } else {
        h = residual_mul == 1.0 ? at::add(h, down) : at::add(h, at::mul(down, residual_mul));
      }
    }
    return h;
  }

  // lora_layout: per call (group, members, then members columns); lora_tensors: per call its scale,
  // token_idx and token_row, then layers * members A, then as many B.
  std::vector<LoraCall> lora_calls(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& layout) const {
    std::vector<LoraCall> calls;
    size_t t = 0, l = 0;
    while (l < layout.size()) {
      TORCH_CHECK(l + 2 <= layout.size(), "DecoderStack: a LoRA call's layout is cut short");
      LoraCall c;
      c.group = layout[l];
      c.members = layout[l + 1];
      TORCH_CHECK(c.group >= 0 && c.group < kGroups && c.members >= 1, "DecoderStack: a LoRA call's group or members");
      TORCH_CHECK(l + 2 + c.members <= layout.size(), "DecoderStack: a LoRA call's columns are cut short");
      c.cols.assign(layout.begin() + l + 2, layout.begin() + l + 2 + c.members);
      l += 2 + c.members;
      const size_t weights = static_cast<size_t>(layers * c.members);
      TORCH_CHECK(t + 3 + 2 * weights <= tensors.size(), "DecoderStack: a LoRA call's tensors are cut short");
      c.scale = tensors[t];
      c.token_idx = tensors[t + 1];
      c.token_row = tensors[t + 2];
      t += 3;
      c.a.assign(tensors.begin() + t, tensors.begin() + t + weights);
      c.b.assign(tensors.begin() + t + weights, tensors.begin() + t + 2 * weights);
      t += 2 * weights;
      calls.push_back(std::move(c));
    }
    TORCH_CHECK(t == tensors.size(), "DecoderStack: LoRA tensors past the layout");
    return calls;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(lorafleet, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, bool, int64_t, int64_t, std::vector<at::Tensor>,
                       c10::List<Optional>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       c10::List<Optional>, c10::List<Optional>, c10::List<Optional>, bool, std::vector<int64_t>,
                       std::vector<int64_t>, std::vector<double>, std::vector<double>, int64_t>())
      .def("use_int4", &DecoderStack::use_int4)
      .def("forward", &DecoderStack::forward);
}
