// bf16 projections of any row count on CPUs without a bf16 matmul: out = T(x @ weight^T + bias),
// weight [out, in] row major (torch's Linear layout) and kept bf16 in memory.
//
// Where oneDNN has no bf16 path (no AVX-512: torch.ops.mkldnn._is_mkldnn_bf16_supported() is False),
// F.linear in bf16 runs torch's reference GEMM at about 16 GFLOP/s, where the same CPU's fp32 FMA
// GEMM runs at 100 or more. Here the weight is widened to fp32 (a shift, exact) sixteen output
// features at a time into a packed panel held in L2, [in][16], and a register-tiled FMA kernel
// multiplies up to six x rows (widened once per call) by the panel: six rows times sixteen features
// of fp32 accumulators, one broadcast of x and two loads of the panel per six-by-sixteen multiply-add,
// the panel's block reused by every row tile. The fp32 sum plus bias is rounded once to the output's
// dtype, as a bf16 matmul with an fp32 accumulator rounds it.
//
// Output features are spread over torch's intra-op threads in contiguous runs of panels. The kernel
// is AVX2 + FMA (every x86 CPU this path is for); elsewhere the same loops in portable C++.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using namespace lorafleet;

constexpr int64_t kPanel = 16;                   // output features per packed panel
constexpr int64_t kRowTile = 5;                  // x rows per register tile (5 x 16 accumulators)
constexpr int64_t kBlockBytes = 192 * 1024;      // packed panels per block: about this much fp32 (L2)
constexpr int64_t kGrainFlops = 1 << 20;         // multiply-adds per task at least

#if defined(__AVX2__) && defined(__FMA__)
// Eight fp32 lanes stored, or rounded to bf16 (to nearest even, NaN kept a quiet NaN, as
// at::BFloat16(float) rounds) and stored.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  rounded = _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
  const __m256i high = _mm256_srli_epi32(rounded, 16);  // eight 16-bit values in 32-bit lanes
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

// panel[k * 16 + j] = weight row (n0 + j), element k, widened; rows past `valid` are zero.
template <typename T>
void pack_panel(const T* w, int64_t in, int64_t valid, float* panel) {
  int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
  {
    for (; k + 8 <= in; k += 8) {
      for (int half = 0; half < 2; ++half) {  // features 0-7, then 8-15: one 8 x 8 transpose each
        __m256 r[8];
        for (int j = 0; j < 8; ++j) {
          const int64_t row = half * 8 + j;
          r[j] = row < valid ? load8(w + row * in + k) : _mm256_setzero_ps();
        }
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
        const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
        float* dst = panel + k * kPanel + half * 8;  // column c of the 8 x 8 block lands at k + c
        _mm256_storeu_ps(dst + 0 * kPanel, _mm256_permute2f128_ps(s0, s4, 0x20));
        _mm256_storeu_ps(dst + 1 * kPanel, _mm256_permute2f128_ps(s1, s5, 0x20));
        _mm256_storeu_ps(dst + 2 * kPanel, _mm256_permute2f128_ps(s2, s6, 0x20));
        _mm256_storeu_ps(dst + 3 * kPanel, _mm256_permute2f128_ps(s3, s7, 0x20));
        _mm256_storeu_ps(dst + 4 * kPanel, _mm256_permute2f128_ps(s0, s4, 0x31));
        _mm256_storeu_ps(dst + 5 * kPanel, _mm256_permute2f128_ps(s1, s5, 0x31));
        _mm256_storeu_ps(dst + 6 * kPanel, _mm256_permute2f128_ps(s2, s6, 0x31));
        _mm256_storeu_ps(dst + 7 * kPanel, _mm256_permute2f128_ps(s3, s7, 0x31));
      }
    }
  }
#endif
  for (; k < in; ++k)
    for (int64_t j = 0; j < kPanel; ++j) panel[k * kPanel + j] = j < valid ? widen(w[j * in + k]) : 0.f;
}

// out[r][0 .. valid) = T(x[r] . panel + bias) for R rows of x (fp32, row stride in).
template <typename T, int R>
void tile(const float* x, int64_t in, const float* panel, const float* bias, int64_t valid, T* out,
          int64_t out_stride) {
  alignas(32) float sums[R][kPanel];
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < in; ++k) {
    __m256 b0 = _mm256_loadu_ps(panel + k * kPanel), b1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    // Held in registers: left to itself GCC folds the two loads into all twelve FMAs, and the
    // kernel is bound by its loads (18 per 12 FMAs instead of 8).
    asm("" : "+x"(b0), "+x"(b1));
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * in + k);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  if (valid == kPanel) {
    const __m256 bias0 = _mm256_loadu_ps(bias), bias1 = _mm256_loadu_ps(bias + 8);
    for (int r = 0; r < R; ++r) {
      store8(out + r * out_stride, _mm256_add_ps(acc[r][0], bias0));
      store8(out + r * out_stride + 8, _mm256_add_ps(acc[r][1], bias1));
    }
    return;
  }
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(sums[r], acc[r][0]);
    _mm256_store_ps(sums[r] + 8, acc[r][1]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < kPanel; ++j) sums[r][j] = 0.f;
  for (int64_t k = 0; k < in; ++k)
    for (int r = 0; r < R; ++r) {
      const float a = x[r * in + k];
#pragma omp simd
      for (int64_t j = 0; j < kPanel; ++j) sums[r][j] += a * panel[k * kPanel + j];
    }
#endif
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < valid; ++j) store(out + r * out_stride + j, sums[r][j] + bias[j]);
}

template <typename T>
void row_tile(int64_t rows, const float* x, int64_t in, const float* panel, const float* bias, int64_t valid, T* out,
              int64_t out_stride) {
  switch (rows) {
    case 1: return tile<T, 1>(x, in, panel, bias, valid, out, out_stride);
    case 2: return tile<T, 2>(x, in, panel, bias, valid, out, out_stride);
    case 3: return tile<T, 3>(x, in, panel, bias, valid, out, out_stride);
    case 4: return tile<T, 4>(x, in, panel, bias, valid, out, out_stride);

    default: return tile<T, 5>(x, in, panel, bias, valid, out, out_stride);
  }
}

// Panels [begin, end): a block of them packed at a time, then every row tile against the block.
template <typename T>
void panels(const float* x, int64_t rows, const T* w, const T* bias, T* out, int64_t features_out, int64_t in,
            int64_t begin, int64_t end) {
  const int64_t per_block = std::max<int64_t>(1, kBlockBytes / (in * kPanel * int64_t(sizeof(float))));
  std::vector<float> packed(std::min(per_block, end - begin) * in * kPanel);
  float bias_wide[kPanel];
  for (int64_t b0 = begin; b0 < end; b0 += per_block) {
    const int64_t b1 = std::min(end, b0 + per_block);
    for (int64_t p = b0; p < b1; ++p) {
      const int64_t n0 = p * kPanel;
      pack_panel(w + n0 * in, in, std::min(kPanel, features_out - n0), packed.data() + (p - b0) * in * kPanel);
    }
    for (int64_t m0 = 0; m0 < rows; m0 += kRowTile) {
      const int64_t tile_rows = std::min(kRowTile, rows - m0);
      for (int64_t p = b0; p < b1; ++p) {
        const int64_t n0 = p * kPanel, valid = std::min(kPanel, features_out - n0);
        for (int64_t j = 0; j < kPanel; ++j) bias_wide[j] = bias != nullptr && j < valid ? widen(bias[n0 + j]) : 0.f;
        row_tile<T>(tile_rows, x + m0 * in, in, packed.data() + (p - b0) * in * kPanel, bias_wide, valid,
                    out + m0 * features_out + n0, features_out);
      }
    }
  }
}

template <typename T>
void run(const T* x, int64_t x_stride, int64_t rows, const T* w, const T* bias, T* out, int64_t features_out,
         int64_t in) {
  std::vector<float> wide(rows * in);  // x widened once, contiguous rows
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / in), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t k = 0; k < in; ++k) wide[m * in + k] = widen(x[m * x_stride + k]);
  });
  const int64_t n_panels = (features_out + kPanel - 1) / kPanel;
  const int64_t grain = std::max<int64_t>(1, kGrainFlops / std::max<int64_t>(1, rows * in * kPanel));
  at::parallel_for(0, n_panels, grain, [&](int64_t begin, int64_t end) {
    panels<T>(wide.data(), rows, w, bias, out, features_out, in, begin, end);
  });
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "panel_linear: x [rows, in] and weight [out, in]");
  TORCH_CHECK(x.size(1) == weight.size(1), "panel_linear: x has ", x.size(1), " features, weight ", weight.size(1));
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "panel_linear: x and weight differ in dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "panel_linear: fp32 or bf16");
  TORCH_CHECK(weight.is_contiguous(), "panel_linear: weight must be contiguous");
  TORCH_CHECK(x.size(1) >= 1 && weight.size(0) >= 1, "panel_linear: empty weight");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous(),
                "panel_linear: bias [out], contiguous");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "panel_linear: bias and x differ in dtype");
  }
  const at::Tensor rows_in = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t rows = x.size(0), in = x.size(1), features_out = weight.size(0);
  at::Tensor out = at::empty({rows, features_out}, x.options());
  if (rows == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    run<float>(rows_in.data_ptr<float>(), rows_in.stride(0), rows, weight.data_ptr<float>(),
               has_bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), features_out, in);
  } else {
    run<at::BFloat16>(rows_in.data_ptr<at::BFloat16>(), rows_in.stride(0), rows, weight.data_ptr<at::BFloat16>(),
                      has_bias ? bias->data_ptr<at::BFloat16>() : nullptr, out.data_ptr<at::BFloat16>(),
                      features_out, in);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lorafleet, m) { m.def("panel_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(lorafleet, CPU, m) { m.impl("panel_linear", &panel_linear); }
