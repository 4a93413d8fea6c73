// fp32 projections of any row count through sixteen-lane FMAs (AVX-512): out = x @ weight^T + bias,
// the weight [out, in] packed once by panel_pack_wide into panels of 32 output features, [panels][in][32],
// zero past the last feature.
//
// Why: on a 2-core AMD EPYC with AVX-512 (Zen 4) oneDNN's fp32 GEMM reaches 140-170 GFLOP/s at a
// decode batch of 32 rows over SmolLM2's projections, where its own 2048^3 GEMM reaches 220; the
// eight-lane panel kernel (panel_gemm.cpp, 4 x 24 tiles) was 1.04-1.11x oneDNN there. Here a register
// tile of up to 8 rows x 32 features (sixteen 16-lane accumulators) takes, per input feature, two
// panel loads and one broadcast of each row's value, feeding sixteen FMAs: half the instructions of
// eight-lane FMAs for the same sums, and fewer loads per FMA than the 4 x 24 tile. A panel (72 KB at
// in = 576) is streamed from memory by its first row tile and read from L2 by the others; the threads
// and the prefetch are panel_run.h's. The sums are fp32 FMAs in input order, as panel_gemm.cpp's.
//
// Built only where the compiler targets AVX-512F; elsewhere panel_wide_avx512() is false and the
// engine does not take this path.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "panel_run.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#define LF_WIDE 1
#endif

namespace {

using namespace lorafleet;

constexpr int64_t kFeatures = 32;  // output features per panel: two 16-lane accumulators per row
constexpr int64_t kRows = 8;       // rows per register tile (with_tile_rows takes up to 8)

#if defined(LF_WIDE)
// out[r][0 .. valid) = x[r] . panel + bias for R rows of x (row stride ldx), panel [in][32].
// `lines` cache lines from `prefetch` on are fetched into L2 along the way (the next panel's).
template <int R>
void tile(const float* x, int64_t ldx, const float* panel, int64_t in, const float* bias, int64_t valid, float* out,
          int64_t out_stride, const char* prefetch, int64_t lines) {
  __m512 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  // one line every `every` steps, two a step where there are more lines than steps (a panel of one row tile)
  const int64_t every = std::max<int64_t>(1, in / std::max<int64_t>(1, lines));
  const bool twice = lines > in;
  // a countdown, not k % every: the division was a 64-bit idiv each step (on a 2-core Xeon the 121
  // projections at 32 rows took 0.975x the time without it, at 64 rows 0.93x, four rounds each)
  int64_t line = 0, countdown = 0;
  for (int64_t k = 0; k < in; ++k) {
    if (countdown-- == 0) {
      countdown = every - 1;
      if (line < lines) _mm_prefetch(prefetch + 64 * line++, _MM_HINT_T1);
    }
    if (twice && line < lines) _mm_prefetch(prefetch + 64 * line++, _MM_HINT_T1);
    __m512 b0 = _mm512_loadu_ps(panel + k * kFeatures), b1 = _mm512_loadu_ps(panel + k * kFeatures + 16);
    // held in registers: folded into every FMA, the panel would be loaded once per row
    asm("" : "+v"(b0), "+v"(b1));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  const __mmask16 low = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const __mmask16 high = valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : static_cast<__mmask16>((1u << (valid - 16)) - 1);
  const __m512 bias0 = bias ? _mm512_maskz_loadu_ps(low, bias) : _mm512_setzero_ps();
  const __m512 bias1 = bias ? _mm512_maskz_loadu_ps(high, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(out + r * out_stride, low, _mm512_add_ps(acc[r][0], bias0));
    _mm512_mask_storeu_ps(out + r * out_stride + 16, high, _mm512_add_ps(acc[r][1], bias1));
  }
  for (; line < lines; ++line) _mm_prefetch(prefetch + 64 * line, _MM_HINT_T1);
}

#endif

at::Tensor panel_pack_wide(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) >= 1 && weight.size(1) >= 1, "panel_pack_wide: weight [out, in]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "panel_pack_wide: fp32 only");
  const at::Tensor w = weight.contiguous();
  const int64_t features = w.size(0), in = w.size(1), n_panels = (features + kFeatures - 1) / kFeatures;
  at::Tensor packed = at::zeros({n_panels, in, kFeatures}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, n_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t valid = std::min(kFeatures, features - p * kFeatures);
      for (int64_t j = 0; j < valid; ++j) {
        const float* row = src + (p * kFeatures + j) * in;
        for (int64_t k = 0; k < in; ++k) dst[(p * in + k) * kFeatures + j] = row[k];
      }
    }
  });
  return packed;
}

at::Tensor panel_linear_wide(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                             int64_t features) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kFeatures,
              "panel_linear_wide: x [rows, in] and a weight from panel_pack_wide");
  TORCH_CHECK(packed.is_contiguous(), "panel_linear_wide: the packed weight must be contiguous");
  TORCH_CHECK(x.size(1) == packed.size(1), "panel_linear_wide: x has ", x.size(1), " features, the weight ",
              packed.size(1));
  TORCH_CHECK(features >= 1 && (features + kFeatures - 1) / kFeatures == packed.size(0),
              "panel_linear_wide: ", features, " output features do not fit ", packed.size(0), " panels");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "panel_linear_wide: fp32 only");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == features, "panel_linear_wide: bias [out]");
    TORCH_CHECK(bias->scalar_type() == at::kFloat, "panel_linear_wide: bias and x differ in dtype");
  }
  const int64_t rows = x.size(0), in = x.size(1);
  at::Tensor out = at::empty({rows, features}, x.options());
  if (rows == 0) return out;
#if defined(LF_WIDE)
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor bias_c = has_bias ? bias->contiguous() : at::Tensor();
  const float* xp = xc.data_ptr<float>();
  const float* bp = has_bias ? bias_c.data_ptr<float>() : nullptr;
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = xc.stride(0), panel_elems = in * kFeatures;
  for_each_panel_tile(packed.size(0), rows, kRows, wp, panel_elems * int64_t(sizeof(float)),
                      [&](int64_t p, int64_t m, int64_t r, const char* prefetch, int64_t lines) {
                        const int64_t n0 = p * kFeatures;
                        with_tile_rows(r, [&](auto tile_rows) {
                          tile<tile_rows.value>(xp + m * ldx, ldx, wp + p * panel_elems, in, bp ? bp + n0 : nullptr,
                                           std::min(kFeatures, features - n0), op + m * features + n0, features,
                                           prefetch, lines);
                        });
                      });
#else
  TORCH_CHECK(false, "panel_linear_wide: this build has no AVX-512 (see panel_wide_avx512())");
#endif
  return out;
}

bool panel_wide_avx512() {
#if defined(LF_WIDE)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lorafleet, m) {
  m.def("panel_pack_wide(Tensor weight) -> Tensor");
  m.def("panel_linear_wide(Tensor x, Tensor packed, Tensor? bias, int features) -> Tensor");
  m.def("panel_wide_avx512() -> bool", &panel_wide_avx512);
}

TORCH_LIBRARY_IMPL(lorafleet, CPU, m) {
  m.impl("panel_pack_wide", &panel_pack_wide);
  m.impl("panel_linear_wide", &panel_linear_wide);
}
