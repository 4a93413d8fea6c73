// Dense projections of a few rows on CPU: out[m] = x[m] @ weight^T (+ bias), weight [out, in] row
// major (torch's Linear layout), read once for all the rows.
//
// At one to a few rows a projection is a pass over its weight: the time is the weight's bytes over
// the memory bandwidth. Each task takes a run of output features and streams their weight rows F at
// a time (F * rows <= 16 vector accumulators, the sixteen reduced together at the end), against
// every input row held in L1. A task's rows are one contiguous run of the weight, read F rows side by
// side; on AVX-512 a prefetch cursor (ahead.h) runs 512 lines (32 KB) ahead along it, into L2, where
// the hardware prefetchers start over at each 4 KB page of each of the F streams. Against the F rows
// after the current ones fetched into L1 (and fp32 at one row on the hardware prefetchers alone), over
// SmolLM2's 121 projections (538 MB fp32, 2 threads, paired in one process): fp32 one row 0.89-0.99x
// the time, two rows 0.75-0.77x, four 0.83-0.84x; bf16 one row 0.57-0.74x, two 0.87x, four 0.70x. Features are spread over torch's intra-op threads in contiguous
// runs. Arithmetic is fp32 (bf16 inputs widened once per call, bf16 weights on load: shifts, exact),
// the fp32 sum plus bias rounded once to the output's dtype, as oneDNN's bf16 matmul rounds its fp32
// accumulator. 30 layers of SmolLM2's projections (425 MB fp32) at one row: 14.2 ms through
// oneDNN's packed path, 13.1 ms here; four rows 16.3 -> 12.5 ms (2 threads, about 40 GB/s of read
// bandwidth measured alongside).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "ahead.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

using namespace lorafleet;

constexpr int64_t kMaxRows = 8;
constexpr int64_t kAheadLines = 512;  // the cursor's distance: 128 lines was slower than none, 1024-2048 no better
constexpr int64_t kGrainFeatures = 64;  // output features per task at least (one task: ~36 KB of fp32 weight at in=576)

#if defined(__AVX512F__)
// out[i] = the sum of acc[i]'s lanes for the first N of the sixteen accumulators (one alone: a plain
// reduction; more: the sixteen reduced together in one shuffle tree).
template <int N>
inline void reduce_accumulators(const __m512* acc, float* out) {
  if constexpr (N == 1) {
    out[0] = _mm512_reduce_add_ps(acc[0]);
  } else {
    alignas(64) float sums[16];
    _mm512_store_ps(sums, sum_lanes16(acc));
    for (int i = 0; i < N; ++i) out[i] = sums[i];
  }
}

// out[m * F + f] = x[m] . w[f] for F features of weight starting at w (row stride in), M input rows:
// M * F <= 16 vector accumulators, reduced together at the end.
template <typename T, int M, int F>
inline void dots(const float* x, int64_t x_stride, const T* w, int64_t in, float* out, Ahead& ahead) {
  static_assert(M * F <= 16, "at most sixteen accumulators");
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= in; k += 16) {
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = load16(x + m * x_stride + k);
    for (int f = 0; f < F; ++f) {
      const __m512 wv = load16(w + f * in + k);
      for (int m = 0; m < M; ++m) acc[m * F + f] = _mm512_fmadd_ps(xv[m], wv, acc[m * F + f]);
    }
    ahead.consumed(F * 16 * static_cast<int64_t>(sizeof(T)));
  }
  if (k < in) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (in - k)) - 1u);
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = load16(x + m * x_stride + k, mask);
    for (int f = 0; f < F; ++f) {
      const __m512 wv = load16(w + f * in + k, mask);
      for (int m = 0; m < M; ++m) acc[m * F + f] = _mm512_fmadd_ps(xv[m], wv, acc[m * F + f]);
    }
  }
  reduce_accumulators<M * F>(acc, out);
}

#if defined(__AVX512BF16__)
constexpr bool kDotBf16 = true;
// dots for bf16 x and weight on AVX512-BF16: vdpbf16ps multiplies 32 bf16 pairs and adds each adjacent
// two products into an fp32 lane (products of bf16 are exact in fp32), no widening of the weight on
// load. The accumulation order differs from the fp32 FMA path's; the sum is still fp32.
template <int M, int F>
inline void dots_bf16(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w, int64_t in, float* out,
                      Ahead& ahead) {
  static_assert(M * F <= 16, "at most sixteen accumulators");
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= in; k += 32) {
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * x_stride + k);
    for (int f = 0; f < F; ++f) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + f * in + k);
      for (int m = 0; m < M; ++m) acc[m * F + f] = _mm512_dpbf16_ps(acc[m * F + f], xv[m], wv);
    }
    ahead.consumed(F * 64);
  }
  if (k < in) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (in - k)) - 1ull);
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * x_stride + k);
    for (int f = 0; f < F; ++f) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + f * in + k);
      for (int m = 0; m < M; ++m) acc[m * F + f] = _mm512_dpbf16_ps(acc[m * F + f], xv[m], wv);
    }
  }
  reduce_accumulators<M * F>(acc, out);
}
#endif
#elif defined(__AVX2__) && defined(__FMA__)
// dots on AVX2 (no AVX-512: the AMD EPYC CI machines among others): eight lanes, M * F <= 12 vector
// accumulators of the sixteen registers, each reduced on its own at the end, the next block's rows
// prefetched (here every row count streamed faster with it; the cursor is the AVX-512 path's). The portable loop below keeps one
// dependent FMA chain per output, where this runs M * F independent ones: 30 layers of SmolLM2's
// projections, 2 threads, at 1 / 2 / 4 / 8 rows, fp32 27 / 34 / 61 / 77 -> 25 / 24 / 28 / 35 ms,
// bf16 16 / 22 / 36 / 62 -> 14 / 14 / 16 / 29 ms.
template <typename T, int M, int F>
inline void dots(const float* x, int64_t x_stride, const T* w, int64_t in, float* out, Ahead&) {
  static_assert(M * F <= 12, "at most twelve accumulators");
  __m256 acc[M * F];
  for (int i = 0; i < M * F; ++i) acc[i] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= in; k += 8) {
    for (int f = 0; f < F; ++f) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (F + f) * in + k), _MM_HINT_T0);
      const __m256 wv = load8(w + f * in + k);
      for (int m = 0; m < M; ++m) acc[m * F + f] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * x_stride + k), wv, acc[m * F + f]);
    }
  }
  for (int i = 0; i < M * F; ++i) out[i] = sum_lanes8(acc[i]);
  for (; k < in; ++k) {
    for (int f = 0; f < F; ++f) {
      const float wk = widen(w[f * in + k]);
      for (int m = 0; m < M; ++m) out[m * F + f] += x[m * x_stride + k] * wk;
    }
  }
}
#else
template <typename T, int M, int F>
inline void dots(const float* x, int64_t x_stride, const T* w, int64_t in, float* out, Ahead&) {
  for (int m = 0; m < M; ++m) {
    for (int f = 0; f < F; ++f) {
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < in; ++k) sum += x[m * x_stride + k] * widen(w[f * in + k]);
      out[m * F + f] = sum;
    }
  }
}
#endif
#if !(defined(__AVX512F__) && defined(__AVX512BF16__))
constexpr bool kDotBf16 = false;
template <int M, int F>
inline void dots_bf16(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, float*, Ahead&) {}
#endif

// x . w for a block: fp32 x against fp32 or bf16 weight rows, or bf16 x against bf16 rows (kDotBf16).
template <typename X, typename T, int M, int F>
inline void block(const X* x, int64_t x_stride, const T* w, int64_t in, float* out, Ahead& ahead) {
  if constexpr (std::is_same_v<X, float>) {
    dots<T, M, F>(x, x_stride, w, in, out, ahead);
  } else {
    dots_bf16<M, F>(x, x_stride, w, in, out, ahead);
  }
}

// Features [begin, end) for all M rows: F at a time (M * F accumulators fit the vector registers, 32
// on AVX-512 and 16 on AVX2, with room for the loads), the last few one at a time.
template <typename X, typename T, int M>
void features(const X* x, int64_t x_stride, const T* w, const T* bias, T* out, int64_t out_stride, int64_t in,
              int64_t begin, int64_t end) {
#if defined(__AVX512F__)
  constexpr int F = M == 1 ? 8 : M == 2 ? 8 : M <= 4 ? 4 : 2;
#else
  constexpr int F = M == 1 ? 8 : M == 2 ? 4 : M <= 4 ? 3 : 1;
#endif
  float sums[M * F];
  auto emit = [&](int64_t f0, int width) { store_features<T>(out, out_stride, sums, M, width, f0, nullptr, bias); };
  Ahead ahead(kAheadLines);
  ahead.add(w + begin * in, (end - begin) * in * static_cast<int64_t>(sizeof(T)));
  ahead.start();
  int64_t f0 = begin;
  for (; f0 + F <= end; f0 += F) {
    block<X, T, M, F>(x, x_stride, w + f0 * in, in, sums, ahead);
    emit(f0, F);
  }
  for (; f0 < end; ++f0) {
    block<X, T, M, 1>(x, x_stride, w + f0 * in, in, sums, ahead);
    emit(f0, 1);
  }
}

template <typename X, typename T, int M>
void run(const X* x, int64_t x_stride, const T* w, const T* bias, T* out, int64_t features_out, int64_t in) {
  at::parallel_for(0, features_out, kGrainFeatures, [&](int64_t begin, int64_t end) {
    features<X, T, M>(x, x_stride, w, bias, out, features_out, in, begin, end);
  });
}

template <typename X, typename T>
void run_rows(int64_t rows, const X* x, int64_t x_stride, const T* w, const T* bias, T* out, int64_t features_out,
              int64_t in) {
  switch (rows) {
    case 1: return run<X, T, 1>(x, x_stride, w, bias, out, features_out, in);
    case 2: return run<X, T, 2>(x, x_stride, w, bias, out, features_out, in);
    case 3: return run<X, T, 3>(x, x_stride, w, bias, out, features_out, in);
    case 4: return run<X, T, 4>(x, x_stride, w, bias, out, features_out, in);
    case 5: return run<X, T, 5>(x, x_stride, w, bias, out, features_out, in);
    case 6: return run<X, T, 6>(x, x_stride, w, bias, out, features_out, in);
    case 7: return run<X, T, 7>(x, x_stride, w, bias, out, features_out, in);
    default: return run<X, T, 8>(x, x_stride, w, bias, out, features_out, in);
  }
}

// fp32 x read in place. bf16 from four rows up, where the CPU has AVX512-BF16: x read in place and
// vdpbf16ps, no widening (121 SmolLM2 projections, 2 threads: four rows 6.9 -> 5.5 ms, eight 12.9 ->
// 6.8); below four rows x is widened to fp32 once here (a shift, exact), as the widening loads stream
// faster there (one row 4.5 against 4.8-5.1 ms).
constexpr int64_t kDotBf16MinRows = 4;

template <typename T>
void dispatch_rows(int64_t rows, const T* x, int64_t x_stride, const T* w, const T* bias, T* out,
                   int64_t features_out, int64_t in) {
  if constexpr (std::is_same_v<T, float>) {
    run_rows<T, T>(rows, x, x_stride, w, bias, out, features_out, in);
  } else {
    if constexpr (kDotBf16) {
      if (rows >= kDotBf16MinRows) return run_rows<T, T>(rows, x, x_stride, w, bias, out, features_out, in);
    }
    std::vector<float> wide(rows * in);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t k = 0; k < in; ++k) wide[m * in + k] = widen(x[m * x_stride + k]);
    run_rows<float, T>(rows, wide.data(), in, w, bias, out, features_out, in);
  }
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_linear: x [rows, in] and weight [out, in]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "small_linear: 1 to ", kMaxRows, " rows, got ", x.size(0));
  TORCH_CHECK(x.size(1) == weight.size(1), "small_linear: x has ", x.size(1), " features, weight ", weight.size(1));
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "small_linear: x and weight differ in dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "small_linear: fp32 or bf16");
  TORCH_CHECK(weight.is_contiguous(), "small_linear: weight must be contiguous");
  TORCH_CHECK(x.stride(1) == 1, "small_linear: x needs contiguous rows");
  const int64_t rows = x.size(0), in = x.size(1), features_out = weight.size(0);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == features_out && bias->is_contiguous(),
                "small_linear: bias [out], contiguous");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "small_linear: bias and x differ in dtype");
  }
  at::Tensor out = at::empty({rows, features_out}, x.options());
  if (x.scalar_type() == at::kFloat) {
    dispatch_rows<float>(rows, x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(),
                         has_bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), features_out, in);
  } else {
    dispatch_rows<at::BFloat16>(rows, x.data_ptr<at::BFloat16>(), x.stride(0), weight.data_ptr<at::BFloat16>(),
                                has_bias ? bias->data_ptr<at::BFloat16>() : nullptr, out.data_ptr<at::BFloat16>(),
                                features_out, in);
  }
  return out;
}

}  // namespace

// Whether this build takes bf16 batches of four to eight rows through vdpbf16ps (faster there than
// oneDNN's packed path; the widening form is not, so without it bf16 stops at four rows).
bool small_linear_dot_bf16() { return kDotBf16; }

TORCH_LIBRARY_FRAGMENT(lorafleet, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("small_linear_dot_bf16() -> bool", &small_linear_dot_bf16);
}

TORCH_LIBRARY_IMPL(lorafleet, CPU, m) { m.impl("small_linear", &small_linear); }
