// Weight-only int8 projections of a few rows on CPU (services/worker/engine/quant.py's int8 format):
// out[m, n] = (x[m] . q[n]) * s[n] (+ bias[n]), q [out, in] int8 codes row major, s [out] per output
// feature, both read once for all the rows.
//
// As small_gemm.cpp's dense form, at one to a few rows a projection is a pass over its weight, here a
// quarter of fp32's bytes (a half of bf16's): each task takes a run of output features and streams
// their code rows F at a time against every input row held in L1 (fp32; bf16 rows widened once per
// call, exactly), with the AVX-512 prefetch cursor of ahead.h running ahead along the run. Sixteen
// codes at a time are sign-extended to int32 and converted to fp32 (exact: |q| <= 127), multiplied and
// summed in fp32; each sum is scaled once by its feature's s, the bias added, and the result rounded
// once to the output's dtype. So the values are x @ (q * s).T in fp32 up to the order of the
// additions, the weights quant.py's dequantize gives (fp32 scales; bf16 ones are exact in fp32).
//
// Against torch's aten._weight_int8pack_mm (bf16 rows only; fp32 ones dequantized the weight per
// call) on SmolLM2-135M at batch 1 (2 threads, the shared 2-core box): see quant.py.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "ahead.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

using namespace lorafleet;

constexpr int64_t kMaxRows = 8;
constexpr int64_t kAheadLines = 512;
constexpr int64_t kGrainFeatures = 128;  // output features per task at least (~72 KB of codes at in=576)

#if defined(__AVX512F__)
inline __m512 codes16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 codes16(const int8_t* p, __mmask16 mask) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
}

// out[m * F + f] = x[m] . q[f] for F code rows starting at w (row stride in), M input rows.
template <int M, int F>
inline void dots(const float* x, int64_t x_stride, const int8_t* w, int64_t in, float* out, Ahead& ahead) {
  static_assert(M * F <= 16, "at most sixteen accumulators");
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= in; k += 16) {
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * x_stride + k);
    for (int f = 0; f < F; ++f) {
      const __m512 wv = codes16(w + f * in + k);
      for (int m = 0; m < M; ++m) acc[m * F + f] = _mm512_fmadd_ps(xv[m], wv, acc[m * F + f]);
    }
    ahead.consumed(F * 16);
  }
  if (k < in) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (in - k)) - 1u);
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_maskz_loadu_ps(mask, x + m * x_stride + k);
    for (int f = 0; f < F; ++f) {
      const __m512 wv = codes16(w + f * in + k, mask);
      for (int m = 0; m < M; ++m) acc[m * F + f] = _mm512_fmadd_ps(xv[m], wv, acc[m * F + f]);
    }
  }
  if constexpr (M * F == 1) {
    out[0] = _mm512_reduce_add_ps(acc[0]);
  } else {
    alignas(64) float sums[16];
    _mm512_store_ps(sums, sum_lanes16(acc));
    for (int i = 0; i < M * F; ++i) out[i] = sums[i];
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 codes8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// dots on AVX2: eight lanes, M * F <= 12 accumulators, the next block's rows prefetched.
template <int M, int F>
inline void dots(const float* x, int64_t x_stride, const int8_t* w, int64_t in, float* out, Ahead&) {
  static_assert(M * F <= 12, "at most twelve accumulators");
  __m256 acc[M * F];
  for (int i = 0; i < M * F; ++i) acc[i] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= in; k += 8) {
    for (int f = 0; f < F; ++f) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (F + f) * in + k), _MM_HINT_T0);
      const __m256 wv = codes8(w + f * in + k);
      for (int m = 0; m < M; ++m) acc[m * F + f] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * x_stride + k), wv, acc[m * F + f]);
    }
  }
  for (int i = 0; i < M * F; ++i) out[i] = sum_lanes8(acc[i]);
  for (; k < in; ++k) {
    for (int f = 0; f < F; ++f) {
      const float wk = static_cast<float>(w[f * in + k]);
      for (int m = 0; m < M; ++m) out[m * F + f] += x[m * x_stride + k] * wk;
    }
  }
}
#else
template <int M, int F>
inline void dots(const float* x, int64_t x_stride, const int8_t* w, int64_t in, float* out, Ahead&) {
  for (int m = 0; m < M; ++m) {
    for (int f = 0; f < F; ++f) {
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < in; ++k) sum += x[m * x_stride + k] * static_cast<float>(w[f * in + k]);
      out[m * F + f] = sum;
    }
  }
}
#endif

// Features [begin, end) for all M rows, F at a time, the last few one at a time.
template <typename T, int M>
void features(const float* x, int64_t x_stride, const int8_t* w, const T* scales, const T* bias, T* out,
              int64_t out_stride, int64_t in, int64_t begin, int64_t end) {
#if defined(__AVX512F__)
  constexpr int F = M <= 2 ? 8 : M <= 4 ? 4 : 2;
#else
  constexpr int F = M == 1 ? 8 : M == 2 ? 4 : M <= 4 ? 3 : 1;
#endif
  float sums[M * F];
  auto emit = [&](int64_t f0, int width) { store_features<T>(out, out_stride, sums, M, width, f0, scales, bias); };
  Ahead ahead(kAheadLines);
  ahead.add(w + begin * in, (end - begin) * in);
  ahead.start();
  int64_t f0 = begin;
  for (; f0 + F <= end; f0 += F) {
    dots<M, F>(x, x_stride, w + f0 * in, in, sums, ahead);
    emit(f0, F);
  }
  for (; f0 < end; ++f0) {
    dots<M, 1>(x, x_stride, w + f0 * in, in, sums, ahead);
    emit(f0, 1);
  }
}

template <typename T, int M>
void run(const float* x, int64_t x_stride, const int8_t* w, const T* scales, const T* bias, T* out,
         int64_t features_out, int64_t in) {
  at::parallel_for(0, features_out, kGrainFeatures, [&](int64_t begin, int64_t end) {
    features<T, M>(x, x_stride, w, scales, bias, out, features_out, in, begin, end);
  });
}

template <typename T>
void run_rows(int64_t rows, const float* x, int64_t x_stride, const int8_t* w, const T* scales, const T* bias,
              T* out, int64_t features_out, int64_t in) {
  switch (rows) {
    case 1: return run<T, 1>(x, x_stride, w, scales, bias, out, features_out, in);
    case 2: return run<T, 2>(x, x_stride, w, scales, bias, out, features_out, in);
    case 3: return run<T, 3>(x, x_stride, w, scales, bias, out, features_out, in);
    case 4: return run<T, 4>(x, x_stride, w, scales, bias, out, features_out, in);
    case 5: return run<T, 5>(x, x_stride, w, scales, bias, out, features_out, in);
    case 6: return run<T, 6>(x, x_stride, w, scales, bias, out, features_out, in);
    case 7: return run<T, 7>(x, x_stride, w, scales, bias, out, features_out, in);
    default: return run<T, 8>(x, x_stride, w, scales, bias, out, features_out, in);
  }
}

template <typename T>
void dispatch(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
              const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t rows = x.size(0), in = x.size(1), features_out = codes.size(0);
  const T* xs = x.data_ptr<T>();
  const T* b = bias.has_value() && bias->defined() ? bias->data_ptr<T>() : nullptr;
  if constexpr (std::is_same_v<T, float>) {
    run_rows<T>(rows, xs, x.stride(0), codes.data_ptr<int8_t>(), scales.data_ptr<T>(), b, out.data_ptr<T>(),
                features_out, in);
  } else {
    std::vector<float> wide(rows * in);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t k = 0; k < in; ++k) wide[m * in + k] = widen(xs[m * x.stride(0) + k]);
    run_rows<T>(rows, wide.data(), in, codes.data_ptr<int8_t>(), scales.data_ptr<T>(), b, out.data_ptr<T>(),
                features_out, in);
  }
}

at::Tensor small_linear_int8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2, "small_linear_int8: x [rows, in] and codes [out, in]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "small_linear_int8: 1 to ", kMaxRows, " rows, got ",
              x.size(0));
  TORCH_CHECK(x.size(1) == codes.size(1), "small_linear_int8: x has ", x.size(1), " features, codes ", codes.size(1));
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous(), "small_linear_int8: codes int8, contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "small_linear_int8: fp32 or bf16");
  TORCH_CHECK(x.stride(1) == 1, "small_linear_int8: x needs contiguous rows");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == codes.size(0) && scales.is_contiguous() &&
                  scales.scalar_type() == x.scalar_type(),
              "small_linear_int8: scales [out], contiguous, in x's dtype");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == codes.size(0) && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "small_linear_int8: bias [out], contiguous, in x's dtype");
  }
  at::Tensor out = at::empty({x.size(0), codes.size(0)}, x.options());
  if (x.scalar_type() == at::kFloat) {
    dispatch<float>(x, codes, scales, bias, out);
  } else {
    dispatch<at::BFloat16>(x, codes, scales, bias, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lorafleet, m) { m.def("small_linear_int8(Tensor x, Tensor codes, Tensor scales, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(lorafleet, CPU, m) { m.impl("small_linear_int8", &small_linear_int8); }
