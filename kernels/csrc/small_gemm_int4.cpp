// Weight-only int4 projections of a few rows on CPU (services/worker/engine/quant.py's int4 format):
// out[m, n] = sum over groups g of s[n, g] * (x[m, g] . (q[n, g] - z[n, g])) (+ bias[n]): q two 4-bit
// codes a byte [out, in / 2] (even inputs in the low nibble), s [out, groups] per group of `group`
// input features, z [out, groups] uint8 (asymmetric checkpoints) or 8 for every group (the engine's
// own symmetric codes), the whole weight read once for all the rows.
//
// As small_gemm_int8.cpp does for int8, at one to a few rows a projection is a pass over its codes, here
// an eighth of fp32's bytes: each task takes a run of output features and streams their code rows F at a
// time against every input row held in L1, with the AVX-512 prefetch cursor of ahead.h running ahead
// along the run. x is widened to fp32 (bf16: exactly) and its inputs split once per call into the order
// the codes unpack in: per block of 2L inputs (L fp32 lanes), the L even inputs, then the L odd ones, so
// that a byte's low nibbles meet the even half and its high nibbles the odd half, with no shuffle in the
// loop. A block's L bytes are widened to int32 lanes, split into their nibbles (a mask and a shift), z
// subtracted and the difference converted to fp32 (exact: |q - z| <= 16); each group's products are
// summed in fp32 and the sum scaled once by the group's s, so the values are x @ ((q - z) * s).T in
// fp32 up to the order of the additions. The bias is added and the result rounded once to x's dtype.
//
// The group must be a multiple of 32 inputs (a block never spans two groups): quant.py's group sizes
// 32 / 64 / 128 are, and a checkpoint with another one keeps torch's kernels.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "ahead.h"
#include "panel_run.h"
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
constexpr int64_t kGrainFeatures = 128;  // output features per task at least (~36 KB of codes at in=576)
constexpr int64_t kGroupMultiple = 32;

#if defined(__AVX512F__)
constexpr int L = 16;
#else
constexpr int L = 8;
#endif

// F rows of codes: the first, and the bytes from one to the next.
struct Codes {
  const uint8_t* w;  // the first of F code rows, in / 2 bytes each
  int64_t row_bytes;
};

#if defined(__AVX512F__)
// out[m * F + f] = sum_g s[f, g] * (x[m, g] . (q[f, g] - z[f, g])) for F code rows, M rows of split x.
template <typename T, int M, int F>
inline void dots(const float* xs, int64_t in, Codes c, const T* s, const uint8_t* z, int64_t groups, int64_t group,
                 float* out, Ahead& ahead) {
  static_assert(M * F <= 8, "eight accumulators and eight group sums");
  __m512 acc[M * F], part[M * F];
  for (int i = 0; i < M * F; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(0xF);
  for (int64_t g = 0; g < groups; ++g) {
    for (int i = 0; i < M * F; ++i) part[i] = _mm512_setzero_ps();
    __m512i zero[F];
    for (int f = 0; f < F; ++f) zero[f] = _mm512_set1_epi32(z != nullptr ? z[f * groups + g] : 8);
    for (int64_t k = g * group; k < (g + 1) * group; k += 2 * L) {
      for (int f = 0; f < F; ++f) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c.w + f * c.row_bytes + k / 2));
        const __m512i wide = _mm512_cvtepu8_epi32(bytes);
        const __m512 even = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(wide, low), zero[f]));
        const __m512 odd = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(wide, 4), zero[f]));
        for (int m = 0; m < M; ++m) {
          part[m * F + f] = _mm512_fmadd_ps(_mm512_loadu_ps(xs + m * in + k), even, part[m * F + f]);
          part[m * F + f] = _mm512_fmadd_ps(_mm512_loadu_ps(xs + m * in + k + L), odd, part[m * F + f]);
        }
      }
      ahead.consumed(F * L);
    }
    for (int f = 0; f < F; ++f) {
      const __m512 scale = _mm512_set1_ps(widen(s[f * groups + g]));
      for (int m = 0; m < M; ++m) acc[m * F + f] = _mm512_fmadd_ps(part[m * F + f], scale, acc[m * F + f]);
    }
  }
  for (int i = 0; i < M * F; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
}

#elif defined(__AVX2__) && defined(__FMA__)
// dots on AVX2: eight lanes, the next block's code rows prefetched.
template <typename T, int M, int F>
inline void dots(const float* xs, int64_t in, Codes c, const T* s, const uint8_t* z, int64_t groups, int64_t group,
                 float* out, Ahead&) {
  __m256 acc[M * F], part[M * F];
  for (int i = 0; i < M * F; ++i) acc[i] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi32(0xF);
  for (int64_t g = 0; g < groups; ++g) {
    for (int i = 0; i < M * F; ++i) part[i] = _mm256_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += 2 * L) {
      for (int f = 0; f < F; ++f) {
        const uint8_t* p = c.w + f * c.row_bytes + k / 2;
        _mm_prefetch(reinterpret_cast<const char*>(p + F * c.row_bytes), _MM_HINT_T0);
        const __m256i zero = _mm256_set1_epi32(z != nullptr ? z[f * groups + g] : 8);
        const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        const __m256 even = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(wide, low), zero));
        const __m256 odd = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(wide, 4), zero));
        for (int m = 0; m < M; ++m) {
          part[m * F + f] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + m * in + k), even, part[m * F + f]);
          part[m * F + f] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + m * in + k + L), odd, part[m * F + f]);
        }
      }
    }
    for (int f = 0; f < F; ++f) {
      const __m256 scale = _mm256_set1_ps(widen(s[f * groups + g]));
      for (int m = 0; m < M; ++m) acc[m * F + f] = _mm256_fmadd_ps(part[m * F + f], scale, acc[m * F + f]);
    }
  }
  for (int i = 0; i < M * F; ++i) out[i] = sum_lanes8(acc[i]);
}
#else
template <typename T, int M, int F>
inline void dots(const float* xs, int64_t in, Codes c, const T* s, const uint8_t* z, int64_t groups, int64_t group,
                 float* out, Ahead&) {
  for (int m = 0; m < M; ++m) {
    for (int f = 0; f < F; ++f) {
      float sum = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const float zero = static_cast<float>(z != nullptr ? z[f * groups + g] : 8);
        float part = 0.f;
        for (int64_t k = g * group; k < (g + 1) * group; k += 2 * L) {
          for (int i = 0; i < L; ++i) {
            const uint8_t byte = c.w[f * c.row_bytes + k / 2 + i];
            part += xs[m * in + k + i] * (static_cast<float>(byte & 0xF) - zero);
            part += xs[m * in + k + L + i] * (static_cast<float>(byte >> 4) - zero);
          }
        }
        sum += part * widen(s[f * groups + g]);
      }
      out[m * F + f] = sum;
    }
  }
}
#endif

// Features [begin, end) for all M rows, F at a time (M * F <= 8), the last few one at a time.
template <typename T, int M>
void features(const float* xs, int64_t in, const uint8_t* w, const T* scales, const uint8_t* zeros, int64_t group,
              const T* bias, T* out, int64_t out_stride, int64_t begin, int64_t end) {
  constexpr int F = M == 1 ? 8 : M == 2 ? 4 : M <= 4 ? 2 : 1;
  const int64_t groups = in / group, row_bytes = in / 2;
  float sums[M * F];
  Ahead ahead(kAheadLines);
  ahead.add(w + begin * row_bytes, (end - begin) * row_bytes);
  ahead.start();
  auto block = [&](auto width, int64_t f0) {
    constexpr int W = decltype(width)::value;
    dots<T, M, W>(xs, in, Codes{w + f0 * row_bytes, row_bytes}, scales + f0 * groups,
                  zeros != nullptr ? zeros + f0 * groups : nullptr, groups, group, sums, ahead);
    store_features<T>(out, out_stride, sums, M, W, f0, nullptr, bias);
  };
  int64_t f0 = begin;
  for (; f0 + F <= end; f0 += F) block(std::integral_constant<int, F>{}, f0);
  for (; f0 < end; ++f0) block(std::integral_constant<int, 1>{}, f0);
}

// x [rows, in] (row stride x_stride) widened to fp32 and split block by block: even inputs, then odd.
template <typename T>
std::vector<float> split_rows(const T* x, int64_t x_stride, int64_t rows, int64_t in) {
  std::vector<float> xs(rows * in);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t k = 0; k < in; k += 2 * L)
      for (int i = 0; i < L; ++i) {
        xs[m * in + k + i] = widen(x[m * x_stride + k + 2 * i]);
        xs[m * in + k + L + i] = widen(x[m * x_stride + k + 2 * i + 1]);
      }
  return xs;
}

template <typename T>
void dispatch(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const uint8_t* zeros,
              int64_t group, const T* bias, at::Tensor& out) {
  const int64_t rows = x.size(0), in = x.size(1), features_out = codes.size(0);
  const std::vector<float> xs = split_rows(x.data_ptr<T>(), x.stride(0), rows, in);
  const uint8_t* w = codes.data_ptr<uint8_t>();
  const T* s = scales.data_ptr<T>();
  T* o = out.data_ptr<T>();
  with_tile_rows(rows, [&](auto tile) {
    constexpr int M = decltype(tile)::value;
    at::parallel_for(0, features_out, kGrainFeatures, [&](int64_t begin, int64_t end) {
      features<T, M>(xs.data(), in, w, s, zeros, group, bias, o, features_out, begin, end);
    });
  });
}

at::Tensor small_linear_int4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& bias,
                             int64_t group) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2, "small_linear_int4: x [rows, in] and codes [out, in / 2]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "small_linear_int4: 1 to ", kMaxRows, " rows, got ",
              x.size(0));
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "small_linear_int4: fp32 or bf16");
  TORCH_CHECK(x.stride(1) == 1, "small_linear_int4: x needs contiguous rows");
  const int64_t in = x.size(1), out_features = codes.size(0);
  TORCH_CHECK(group >= kGroupMultiple && group % kGroupMultiple == 0 && in % group == 0,
              "small_linear_int4: the group size must be a multiple of ", kGroupMultiple, " dividing the ", in,
              " input features, got ", group);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(1) * 2 == in,
              "small_linear_int4: codes uint8 [out, in / 2], contiguous");
  const int64_t groups = in / group;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == out_features && scales.size(1) == groups &&
                  scales.is_contiguous() && scales.scalar_type() == x.scalar_type(),
              "small_linear_int4: scales [out, in / group], contiguous, in x's dtype");
  const bool has_zeros = zeros.has_value() && zeros->defined();
  if (has_zeros) {
    TORCH_CHECK(zeros->dim() == 2 && zeros->size(0) == out_features && zeros->size(1) == groups &&
                    zeros->is_contiguous() && zeros->scalar_type() == at::kByte,
                "small_linear_int4: zeros uint8 [out, in / group], contiguous");
  }
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "small_linear_int4: bias [out], contiguous, in x's dtype");
  }
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  const uint8_t* z = has_zeros ? zeros->data_ptr<uint8_t>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    dispatch<float>(x, codes, scales, z, group, has_bias ? bias->data_ptr<float>() : nullptr, out);
  } else {
    dispatch<at::BFloat16>(x, codes, scales, z, group, has_bias ? bias->data_ptr<at::BFloat16>() : nullptr, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lorafleet, m) {
  m.def("small_linear_int4(Tensor x, Tensor codes, Tensor scales, Tensor? zeros, Tensor? bias, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(lorafleet, CPU, m) { m.impl("small_linear_int4", &small_linear_int4); }
