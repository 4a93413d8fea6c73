// bf16 projections of any row count through AVX512-BF16's dot product: out = bf16(x @ weight^T + bias),
// x, weight [out, in] and bias bf16, the weight packed once by panel_pack_dot into panels of 32 output
// features with the input features in pairs, [panels][ceil(in / 2)][32][2], zero past the last
// feature and past an odd in.
//
// Why: on a CPU with AVX512-BF16 oneDNN's bf16 GEMM reaches about half of its own 2048^3 rate at a
// decode batch of 32 rows over SmolLM2's projections (219 of 419 GFLOP/s, 2 threads), and the fp32
// panel kernel (panel_gemm.cpp) widens bf16 and runs at fp32's rate. Here a register tile of up to 8
// rows x 32 features (sixteen 16-lane fp32 accumulators) takes, per pair of input features, two
// panel loads and one 32-bit broadcast of each row's pair, feeding sixteen vdpbf16ps: each adds two
// exact bf16 products to its fp32 lane. A panel (36 KB at in = 576) is streamed from memory by its
// first row tile and read from L2 by the others; the threads and the prefetch are panel_run.h's. The
// fp32 sum plus bias is rounded once to bf16: a bf16 GEMM with an fp32 accumulator, up to the order
// of the sum (vdpbf16ps flushes denormals).
//
// Built only where the compiler targets AVX512-BF16; elsewhere panel_dot_bf16() is false and the
// engine does not take this path.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "panel_run.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define LF_DOT_BF16 1
#endif

namespace {

using namespace lorafleet;

constexpr int64_t kFeatures = 32;  // output features per panel: two 16-lane accumulators per row
constexpr int64_t kRows = 8;       // rows per register tile (with_tile_rows takes up to 8)

#if defined(LF_DOT_BF16)
// out[r][0 .. valid) = bf16(x[r] . panel + bias) for R rows; x rows of `pairs` 32-bit bf16 pairs
// (row stride ldx pairs), panel [pairs][32][2] bf16.
// `lines` cache lines from `prefetch` on are fetched into L2 along the way (the next panel's).
template <int R>
void tile(const uint32_t* x, int64_t ldx, const at::BFloat16* panel, int64_t pairs, const float* bias, int64_t valid,
          at::BFloat16* out, int64_t out_stride, const char* prefetch, int64_t lines) {
  __m512 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  // one line every `every` steps, two a step where there are more lines than steps (a panel of one row tile)
  const int64_t every = std::max<int64_t>(1, pairs / std::max<int64_t>(1, lines));
  const bool twice = lines > pairs;
  int64_t line = 0;
  for (int64_t k = 0; k < pairs; ++k) {
    if (k % every == 0 && line < lines) _mm_prefetch(prefetch + 64 * line++, _MM_HINT_T1);
    if (twice && line < lines) _mm_prefetch(prefetch + 64 * line++, _MM_HINT_T1);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + k * 2 * kFeatures);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + k * 2 * kFeatures + kFeatures);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + k]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
    }
  }
  alignas(64) float sums[kFeatures];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(sums, acc[r][0]);
    _mm512_store_ps(sums + 16, acc[r][1]);
    at::BFloat16* o = out + r * out_stride;
    for (int64_t j = 0; j < valid; ++j) o[j] = at::BFloat16(bias ? sums[j] + bias[j] : sums[j]);
  }
  for (; line < lines; ++line) _mm_prefetch(prefetch + 64 * line, _MM_HINT_T1);
}

void run(const uint32_t* x, int64_t ldx, int64_t rows, int64_t pairs, const at::BFloat16* packed, int64_t features,
         const float* bias, at::BFloat16* out) {
  const int64_t panel_elems = pairs * 2 * kFeatures;
  for_each_panel_tile((features + kFeatures - 1) / kFeatures, rows, kRows, packed, panel_elems * 2,
                      [&](int64_t p, int64_t m, int64_t r, const char* prefetch, int64_t lines) {
                        const int64_t n0 = p * kFeatures;
                        with_tile_rows(r, [&](auto tile_rows) {
                          tile<tile_rows.value>(x + m * ldx, ldx, packed + p * panel_elems, pairs,
                                           bias ? bias + n0 : nullptr, std::min(kFeatures, features - n0),
                                           out + m * features + n0, features, prefetch, lines);
                        });
                      });
}
#endif

at::Tensor panel_pack_dot(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) >= 1 && weight.size(1) >= 1, "panel_pack_dot: weight [out, in]");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "panel_pack_dot: bf16 only");
  const at::Tensor w = weight.contiguous();
  const int64_t features = w.size(0), in = w.size(1), pairs = (in + 1) / 2;
  const int64_t n_panels = (features + kFeatures - 1) / kFeatures;
  at::Tensor packed = at::zeros({n_panels, pairs, kFeatures, 2}, w.options());
  const at::BFloat16* src = w.data_ptr<at::BFloat16>();
  at::BFloat16* dst = packed.data_ptr<at::BFloat16>();
  at::parallel_for(0, n_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t valid = std::min(kFeatures, features - p * kFeatures);
      for (int64_t j = 0; j < valid; ++j) {
        const at::BFloat16* row = src + (p * kFeatures + j) * in;
        for (int64_t k = 0; k < in; ++k) dst[((p * pairs + k / 2) * kFeatures + j) * 2 + k % 2] = row[k];
      }
    }
  });
  return packed;
}

at::Tensor panel_linear_dot(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t features) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.size(2) == kFeatures && packed.size(3) == 2,
              "panel_linear_dot: x [rows, in] and a weight from panel_pack_dot");
  TORCH_CHECK(packed.is_contiguous(), "panel_linear_dot: the packed weight must be contiguous");
  TORCH_CHECK((x.size(1) + 1) / 2 == packed.size(1), "panel_linear_dot: x has ", x.size(1),
              " features, the weight's pairs ", packed.size(1));
  TORCH_CHECK(features >= 1 && (features + kFeatures - 1) / kFeatures == packed.size(0),
              "panel_linear_dot: ", features, " output features do not fit ", packed.size(0), " panels");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "panel_linear_dot: bf16 only");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == features, "panel_linear_dot: bias [out]");
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16, "panel_linear_dot: bias and x differ in dtype");
  }
  const int64_t rows = x.size(0), in = x.size(1);
  at::Tensor out = at::empty({rows, features}, x.options());
  if (rows == 0) return out;
#if defined(LF_DOT_BF16)
  // rows of whole pairs: read in place where contiguous with an even width, else copied with a zero
  // after an odd width (its weight pair holds a zero there, and 0 x anything finite adds nothing)
  at::Tensor xp = x;
  if (in % 2 != 0 || x.stride(1) != 1 || x.stride(0) % 2 != 0 ||
      reinterpret_cast<uintptr_t>(x.data_ptr()) % alignof(uint32_t) != 0) {
    xp = at::zeros({rows, 2 * packed.size(1)}, x.options());
    xp.narrow(1, 0, in).copy_(x);
  }
  const at::Tensor bias_f = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  run(reinterpret_cast<const uint32_t*>(xp.data_ptr<at::BFloat16>()), xp.stride(0) / 2, rows, packed.size(1),
      packed.data_ptr<at::BFloat16>(), features, has_bias ? bias_f.data_ptr<float>() : nullptr,
      out.data_ptr<at::BFloat16>());
#else
  TORCH_CHECK(false, "panel_linear_dot: this build has no AVX512-BF16 (see panel_dot_bf16())");
#endif
  return out;
}

bool panel_dot_bf16() {
#if defined(LF_DOT_BF16)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lorafleet, m) {
  m.def("panel_pack_dot(Tensor weight) -> Tensor");
  m.def("panel_linear_dot(Tensor x, Tensor packed, Tensor? bias, int features) -> Tensor");
  m.def("panel_dot_bf16() -> bool", &panel_dot_bf16);
}

TORCH_LIBRARY_IMPL(lorafleet, CPU, m) {
  m.impl("panel_pack_dot", &panel_pack_dot);
  m.impl("panel_linear_dot", &panel_linear_dot);
}
