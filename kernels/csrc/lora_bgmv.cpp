// LoRA shrink and expand on CPU for a step's scattered tokens, each reading its own adapter in place.
//
// y[t] += scale[row] * (x[t] @ a[row]) @ b[row] for each (t, row) = (token_idx[i], token_row[i]), for
// each projection of a group that reads the same x (q/k/v or gate/up: one call where there were three
// or two, each adding into its own columns of the fused output). One call replaces the eager path's
// gathers, two matmuls, scale and scatter-add per projection: a token's shrink streams its adapter's
// A once ([in, r], r contiguous: one vector per input feature) and its expand streams B ([r, out]) once front to back, accumulating in fp32. Streaming B
// whole rather than in 256-column chunks (sixteen short strided streams each) cut 32 distinct
// all-seven adapters' LoRA time per step from 22.8 to 15.2 ms (fp32, SmolLM2, 2 threads: 625 MB at
// 41 GB/s), batch 1 from 1.7 to 1.1 ms. A prefetch cursor (ahead.h) runs along each thread's
// adapters ahead of the reads.
// Tokens are spread over torch's intra-op threads; each writes only its own row of y.
// bf16 x, y, A, B are widened on load and the fp32 delta is rounded to bf16 before it is added to
// y, as the eager path's `y += delta.to(y.dtype)` does.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "ahead.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace lorafleet;

constexpr int64_t kWork = 1 << 16;  // multiply-adds per thread below which tokens stay on one thread

// Prefetch distance (ahead.h): 512 lines (32 KB) into L2. Measured (32 tokens of distinct all-seven
// rank-16 adapters, SmolLM2's shapes, 30 layers, 2 threads, paired in one process): fp32 24.2 ->
// 20.3 ms, bf16 19.3 -> 12.0 ms, batch 1 1.24 -> 1.03 ms. 64 and 256 lines into L1 were slower than
// none; 1024 lines the same as 512.
constexpr int64_t kAheadLines = 512;

// y += delta, rounding delta to y's dtype first (a no-op for fp32).
inline void add_out(float* y, const float* delta, int64_t n) {
#pragma omp simd
  for (int64_t e = 0; e < n; ++e) y[e] += delta[e];
}
inline void add_out(at::BFloat16* y, const float* delta, int64_t n) {
  for (int64_t e = 0; e < n; ++e) {
    y[e] = at::BFloat16(widen(y[e]) + widen(at::BFloat16(delta[e])));
  }
}

// h[0:r] = x[0:in] @ a[in, r]. R > 0: rank known at compile time; R == 0: rank r at run time.
// Four independent accumulators per rank lane hide the multiply-add latency.
template <typename T, int64_t R>
inline void shrink(const T* x, const T* a, int64_t in, int64_t r, float* h, Ahead& ahead) {
  const int64_t rank = R > 0 ? R : r;
  std::fill(h, h + rank, 0.f);
  int64_t i = 0;
  if constexpr (R > 0) {
    float acc[4][R] = {};
    for (; i + 4 <= in; i += 4) {
      for (int64_t u = 0; u < 4; ++u) {
        const float xv = widen(x[i + u]);
        const T* row = a + (i + u) * R;
#pragma omp simd
        for (int64_t e = 0; e < R; ++e) acc[u][e] += xv * widen(row[e]);
      }
      ahead.consumed(4 * R * static_cast<int64_t>(sizeof(T)));
    }
#pragma omp simd
    for (int64_t e = 0; e < R; ++e) h[e] = (acc[0][e] + acc[1][e]) + (acc[2][e] + acc[3][e]);
  }
  for (; i < in; ++i) {
    const float xv = widen(x[i]);
    const T* row = a + i * rank;
#pragma omp simd
    for (int64_t e = 0; e < rank; ++e) h[e] += xv * widen(row[e]);
    ahead.consumed(rank * static_cast<int64_t>(sizeof(T)));
  }
}

// y[0:out] += (h[0:r] * scale) @ b[r, out]: B streamed front to back (four of its rows at a time,
// one pass over acc per four), the fp32 sums in acc[0:out] (L1 or L2), added to y at the end.
template <typename T>
inline void expand(const float* h, float scale, const T* b, int64_t r, int64_t out, T* y, float* acc, Ahead& ahead) {
  std::fill(acc, acc + out, 0.f);
  int64_t e = 0;
  for (; e + 4 <= r; e += 4) {
    const float h0 = h[e] * scale, h1 = h[e + 1] * scale, h2 = h[e + 2] * scale, h3 = h[e + 3] * scale;
    const T* b0 = b + e * out;
    const T* b1 = b0 + out;
    const T* b2 = b1 + out;
    const T* b3 = b2 + out;
    int64_t c = 0;
    for (; c + 16 <= out; c += 16) {
#pragma omp simd
      for (int64_t k = c; k < c + 16; ++k) {
        acc[k] += (h0 * widen(b0[k]) + h1 * widen(b1[k])) + (h2 * widen(b2[k]) + h3 * widen(b3[k]));
      }
      ahead.consumed(4 * 16 * static_cast<int64_t>(sizeof(T)));
    }
#pragma omp simd
    for (int64_t k = c; k < out; ++k) {
      acc[k] += (h0 * widen(b0[k]) + h1 * widen(b1[k])) + (h2 * widen(b2[k]) + h3 * widen(b3[k]));
    }
    ahead.consumed(4 * (out - c) * static_cast<int64_t>(sizeof(T)));
  }
  for (; e < r; ++e) {
    const float hv = h[e] * scale;
    const T* row = b + e * out;
#pragma omp simd
    for (int64_t c = 0; c < out; ++c) acc[c] += hv * widen(row[c]);
    ahead.consumed(out * static_cast<int64_t>(sizeof(T)));
  }
  add_out(y, acc, out);
}

// One projection of the group: its A [num_slots, in, r], B [num_slots, r, out] and its first column in y.
template <typename T>
struct Part {
  const T* a;
  const T* b;
  int64_t out;
  int64_t col;
};

template <typename T, int64_t R>
void run(const torch::Tensor& x, torch::Tensor& y, const std::vector<Part<T>>& parts, int64_t in, int64_t r,
         const torch::Tensor& scale, const torch::Tensor& token_idx, const torch::Tensor& token_row) {
  const int64_t n = token_idx.size(0);
  const int64_t x_row = x.stride(0), y_row = y.stride(0);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const float* sp = scale.data_ptr<float>();
  const int32_t* tp = token_idx.data_ptr<int32_t>();
  const int32_t* rp = token_row.data_ptr<int32_t>();
  int64_t per_token = 0, widest = 0;
  for (const Part<T>& part : parts) {
    per_token += r * (in + part.out);
    widest = std::max(widest, part.out);
  }
  const int64_t grain = std::max<int64_t>(1, kWork / std::max<int64_t>(1, per_token));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> h(r), acc(widest);
    Ahead ahead(kAheadLines);
    for (int64_t i = begin; i < end; ++i) {
      for (const Part<T>& part : parts) {
        ahead.add(part.a + rp[i] * in * r, in * r * static_cast<int64_t>(sizeof(T)));
        ahead.add(part.b + rp[i] * r * part.out, r * part.out * static_cast<int64_t>(sizeof(T)));
      }
    }
    ahead.start();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = tp[i], row = rp[i];
      for (const Part<T>& part : parts) {
        shrink<T, R>(xp + t * x_row, part.a + row * in * r, in, r, h.data(), ahead);
        expand<T>(h.data(), sp[row], part.b + row * r * part.out, r, part.out, yp + t * y_row + part.col, acc.data(), ahead);
      }
    }
  });
}

template <typename T>
void run_rank(const torch::Tensor& x, torch::Tensor& y, const at::TensorList& a, const at::TensorList& b,
              at::IntArrayRef cols, const torch::Tensor& scale, const torch::Tensor& token_idx,
              const torch::Tensor& token_row) {
  std::vector<Part<T>> parts;
  for (size_t m = 0; m < a.size(); ++m) parts.push_back({a[m].data_ptr<T>(), b[m].data_ptr<T>(), b[m].size(2), cols[m]});
  const int64_t in = x.size(1), r = a[0].size(2);
  switch (r) {
    case 8: run<T, 8>(x, y, parts, in, r, scale, token_idx, token_row); break;
    case 16: run<T, 16>(x, y, parts, in, r, scale, token_idx, token_row); break;
    case 32: run<T, 32>(x, y, parts, in, r, scale, token_idx, token_row); break;
    case 64: run<T, 64>(x, y, parts, in, r, scale, token_idx, token_row); break;
    default: run<T, 0>(x, y, parts, in, r, scale, token_idx, token_row);
  }
}

}  // namespace

// x [num_tokens, in] and y [num_tokens, out_total] with contiguous rows; the projections of one group
// that read the same x (a fused q/k/v or gate/up output, or a single projection): for each m,
// a[m] [num_slots, in, r] and b[m] [num_slots, r, out_m] contiguous, x's dtype, one rank r, added into
// y's columns [cols[m], cols[m] + out_m) (disjoint, inside y); scale fp32 [num_slots]; token_idx,
// token_row int32 [n], distinct tokens, rows < num_slots.
void lora_bgmv(const torch::Tensor& x, torch::Tensor y, at::TensorList a, at::TensorList b, at::IntArrayRef cols,
               const torch::Tensor& scale, const torch::Tensor& token_idx, const torch::Tensor& token_row) {
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu(), "lora_bgmv runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [num_tokens, in] with contiguous rows");
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && y.size(0) == x.size(0), "y must be [num_tokens, out] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y share a dtype");
  TORCH_CHECK(!a.empty() && a.size() == b.size() && cols.size() == a.size(),
              "a, b and cols must name the same one or more projections");
  const int64_t num_slots = a[0].dim() == 3 ? a[0].size(0) : -1;
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (size_t m = 0; m < a.size(); ++m) {
    TORCH_CHECK(a[m].device().is_cpu() && b[m].device().is_cpu(), "lora_bgmv runs on CPU tensors");
    TORCH_CHECK(a[m].dim() == 3 && a[m].is_contiguous() && a[m].size(0) == num_slots && a[m].size(1) == x.size(1) &&
                    a[m].size(2) == a[0].size(2),
                "a[", m, "] must be a contiguous [num_slots, in, r] matching x and a[0]");
    TORCH_CHECK(b[m].dim() == 3 && b[m].is_contiguous() && b[m].size(0) == num_slots && b[m].size(1) == a[0].size(2),
                "b[", m, "] must be a contiguous [num_slots, r, out] matching a");
    TORCH_CHECK(a[m].scalar_type() == x.scalar_type() && b[m].scalar_type() == x.scalar_type(), "x, y, a and b share a dtype");
    TORCH_CHECK(cols[m] >= 0 && cols[m] + b[m].size(2) <= y.size(1), "projection ", m, "'s columns lie outside y");
    spans.emplace_back(cols[m], cols[m] + b[m].size(2));
  }
  std::sort(spans.begin(), spans.end());
  for (size_t m = 1; m < spans.size(); ++m) {
    TORCH_CHECK(spans[m].first >= spans[m - 1].second, "the projections' columns overlap");
  }
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == num_slots,
              "scale must be a contiguous fp32 [num_slots]");
  TORCH_CHECK(token_idx.scalar_type() == torch::kInt && token_row.scalar_type() == torch::kInt &&
                  token_idx.dim() == 1 && token_idx.is_contiguous() && token_row.is_contiguous() &&
                  token_row.numel() == token_idx.numel(),
              "token_idx and token_row must be contiguous int32 [n]");
  const int32_t* tp = token_idx.data_ptr<int32_t>();
  const int32_t* rp = token_row.data_ptr<int32_t>();
  for (int64_t i = 0; i < token_idx.numel(); ++i) {
    TORCH_CHECK(tp[i] >= 0 && tp[i] < x.size(0) && rp[i] >= 0 && rp[i] < num_slots,
                "token ", tp[i], " or row ", rp[i], " out of range");
  }
  switch (x.scalar_type()) {
    case torch::kFloat: run_rank<float>(x, y, a, b, cols, scale, token_idx, token_row); break;
    case torch::kBFloat16: run_rank<at::BFloat16>(x, y, a, b, cols, scale, token_idx, token_row); break;
    default: TORCH_CHECK(false, "lora_bgmv supports float32 and bfloat16, not ", x.scalar_type());
  }
}

TORCH_LIBRARY_FRAGMENT(lorafleet, m) {
  m.def(
      "lora_bgmv(Tensor x, Tensor(a!) y, Tensor[] a, Tensor[] b, int[] cols, Tensor scale, Tensor token_idx, "
      "Tensor token_row) -> ()");
}

TORCH_LIBRARY_IMPL(lorafleet, CPU, m) { m.impl("lora_bgmv", &lora_bgmv); }
