// Helpers shared by the CPU kernels: bf16 widening (bf16 is the high half of an fp32, so widening is
// a shift and exact); where the compiler targets AVX-512, sixteen-lane loads and the lane sums of
// sixteen vectors at once; where it targets AVX2 with FMA, eight-lane loads and lane sums.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace lorafleet {

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) {
  const uint32_t wide = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

// v rounded to T and back: a no-op for fp32, bf16's round-to-nearest-even otherwise.
inline float round_as(float v, float*) { return v; }
inline float round_as(float v, at::BFloat16*) { return widen(at::BFloat16(v)); }
template <typename T>
inline float rnd(float v) {
  return round_as(v, static_cast<T*>(nullptr));
}

// v stored as T: as it is, or rounded to bf16 (to nearest even).
inline void store(float* dst, float v) { *dst = v; }
inline void store(at::BFloat16* dst, float v) { *dst = at::BFloat16(v); }

// A small-row projection's sums for `rows` rows and `width` features from f0 (sums[m * width + f]), each
// times its feature's scale (none: 1), plus its bias (none: 0), stored as T in out (row stride out_stride).
template <typename T>
inline void store_features(T* out, int64_t out_stride, const float* sums, int rows, int width, int64_t f0,
                           const T* scales, const T* bias) {
  for (int m = 0; m < rows; ++m)
    for (int f = 0; f < width; ++f) {
      const float s = scales != nullptr ? widen(scales[f0 + f]) : 1.f, b = bias != nullptr ? widen(bias[f0 + f]) : 0.f;
      store(out + m * out_stride + f0 + f, sums[m * width + f] * s + b);
    }
}

#if defined(__AVX512F__)
// Sixteen consecutive elements as fp32 lanes (bf16 widened in the register); the masked forms read
// only the lanes set in mask and zero the rest.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 mask) {
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The lane sums of sixteen vectors as one vector: out[i] = sum of v[i]'s sixteen lanes. 45 shuffles
// and adds in a tree, where reducing each vector on its own takes about eight dependent steps apiece.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 pairs[8];  // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3) of rows a = 2i, b = 2i + 1
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 quads[4];  // per 128-bit lane: the lane's partial sums of rows 4i .. 4i + 3
  for (int i = 0; i < 4; ++i) {
    const __m512 x = pairs[2 * i], y = pairs[2 * i + 1];
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // fold each quad's four 128-bit lanes into one, quad i landing in lane i
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Eight consecutive elements as fp32 lanes (bf16 widened in the register).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Eight fp32 lanes stored as they are, or rounded to bf16 (to nearest even, a NaN kept a quiet NaN,
// as at::BFloat16(float) rounds); round8 gives the bf16-rounded values back as fp32 lanes.
inline __m256i bf16_bits8(__m256 v) {  // each lane's rounded value, in the lane's high 16 bits
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i high = _mm256_srli_epi32(bf16_bits8(v), 16);  // eight 16-bit values in 32-bit lanes
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline __m256 round8(__m256 v, const float*) { return v; }
inline __m256 round8(__m256 v, const at::BFloat16*) {
  return _mm256_castsi256_ps(_mm256_and_si256(bf16_bits8(v), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The sum of v's eight lanes.
inline float sum_lanes8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

}  // namespace lorafleet
