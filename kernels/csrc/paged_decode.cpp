// Paged decode attention on CPU: each decode's K/V read where it lies in the block-paged cache.
//
// out[s, h*d:(h+1)*d] = softmax(softcap(q[s, h] . K[s, :len]^T * scale) over the window) . V[s, :len]
// for each decode row s and query head h, K/V of head h / group from cache [2, kv_heads, slots, d].
// One task per (row, kv head): the group's query heads share every K and V row it reads, so each
// is read once per step. Scores, softmax and the weighted sum of V are fp32 whatever the cache's
// dtype (bf16 K/V are widened on load), as transformers' eager attention computes them.
// With AVX-512 and head_dim 64 or 128, scores come sixteen K rows at a time (one vector accumulator
// per row, the sixteen reduced together rather than each on its own) and the weighted sum of V keeps
// each query head's accumulator in registers over a block's rows; other head dims take the generic
// loops. 32 decodes of 150 tokens on scattered blocks, per layer call: fp32 260 -> 200 us, bf16
// 225 -> 175 us (with the cache warm; cold, as in a step, the reads are what the prefetch cursor
// below is for). With AVX2 (no AVX-512) the same in eight lanes: eight K rows
// at a time, sixty-four elements of a head's accumulator in registers.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "ahead.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

using namespace lorafleet;

constexpr int64_t kMaxHeadDim = 256;
// Prefetch distance (ahead.h): 256 lines (16 KB) into L2, across blocks and from one task's K and V
// to the next task's. Measured (paged fp32 caches of 30 layers, another 24 MB read between layer
// calls as the weights' stream does, 2 threads, paired in one process): 32 decodes of 50-100 tokens
// 9.30 -> 6.72 ms, 8 of 100-200 4.69 -> 3.60 ms, 1 of 300 1.44 -> 1.32 ms, against prefetching only
// each next block (into L1) and the V pass's block during the K pass.
constexpr int64_t kAheadLines = 256;

// K or V row j of one head, widened to fp32 (bf16 is the high half of an fp32: a shift).
inline const float* row_f32(const float* src, float*) { return src; }
inline const float* row_f32(const at::BFloat16* src, float* buf, int64_t d) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t e = 0; e < d; ++e) {
    uint32_t wide = static_cast<uint32_t>(bits[e]) << 16;
    float f;
    std::memcpy(&f, &wide, sizeof(f));
    buf[e] = f;
  }
  return buf;
}
inline const float* row_f32(const float* src, float* buf, int64_t) { return row_f32(src, buf); }
// n consecutive elements (whole rows), widened like row_f32.
template <typename T>
inline const float* rows_f32(const T* src, float* buf, int64_t n) { return row_f32(src, buf, n); }

// exp(x) for x <= 0 (a score minus its row's maximum), to about 2 ulp, in a loop the compiler
// vectorises: 2^n * p(r) with n = round(x / ln 2) and a degree-6 polynomial on |r| <= ln 2 / 2.
inline void exp_nonpositive(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float v = std::max(x[i], -87.3f);
    float k = std::nearbyint(v * 1.44269504088896341f);
    float r = v - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    x[i] = p * scale;
  }
}

#if defined(__AVX512F__)
// scores[g * span + r] = (q_g . k_r) * scale for sixteen contiguous fp32 K rows k (D floats each) and every
// query head g of the group: one vector accumulator per row, the sixteen reduced together.
template <int64_t D>
inline void scores16(const float* qf, int64_t group, const float* k, float fscale, float* scores, int64_t span) {
  constexpr int64_t kVecs = D / 16;
  const __m512 vscale = _mm512_set1_ps(fscale);
  for (int64_t g = 0; g < group; ++g) {
    __m512 qv[kVecs];
    for (int64_t c = 0; c < kVecs; ++c) qv[c] = _mm512_loadu_ps(qf + g * D + c * 16);
    __m512 acc[16];
    for (int64_t r = 0; r < 16; ++r) {
      __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k + r * D));
      for (int64_t c = 1; c < kVecs; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + r * D + c * 16), a);
      acc[r] = a;
    }
    _mm512_storeu_ps(scores + g * span, _mm512_mul_ps(sum_lanes16(acc), vscale));
  }
}

// acc[g] += sum_r p[g][r] * v_r for count contiguous V rows (D elements each) and every query head g: each
// head's accumulator stays in registers over the rows, which are read from L1 once per head.
template <typename T, int64_t D>
inline void pv_rows(const float* p, int64_t span, int64_t group, const T* v, int64_t count, float* acc) {
  constexpr int64_t kVecs = D / 16;
  for (int64_t g = 0; g < group; ++g) {
    __m512 a[kVecs];
    float* ag = acc + g * D;
    for (int64_t c = 0; c < kVecs; ++c) a[c] = _mm512_loadu_ps(ag + c * 16);
    const float* pg = p + g * span;
    for (int64_t r = 0; r < count; ++r) {
      const __m512 pr = _mm512_set1_ps(pg[r]);
      for (int64_t c = 0; c < kVecs; ++c) a[c] = _mm512_fmadd_ps(pr, load16(v + r * D + c * 16), a[c]);
    }
    for (int64_t c = 0; c < kVecs; ++c) _mm512_storeu_ps(ag + c * 16, a[c]);
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// The AVX2 forms of the two above, eight lanes at a time.

// The lane sums of eight vectors as one vector: out[i] = the sum of v[i]'s eight lanes.
inline __m256 sum_lanes8x8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: rows 0-3, 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// scores[g * span + r] = (q_g . k_r) * scale for eight contiguous fp32 K rows k (D floats each) and
// every query head g of the group: one accumulator per row, the eight reduced together.
template <int64_t D>
inline void scores8(const float* qf, int64_t group, const float* k, float fscale, float* scores, int64_t span) {
  const __m256 vscale = _mm256_set1_ps(fscale);
  for (int64_t g = 0; g < group; ++g) {
    __m256 acc[8];
    for (int64_t r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 qc = _mm256_loadu_ps(qf + g * D + c);
      for (int64_t r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + r * D + c), acc[r]);
    }
    _mm256_storeu_ps(scores + g * span, _mm256_mul_ps(sum_lanes8x8(acc), vscale));
  }
}

// acc[g] += sum_r p[g][r] * v_r for count contiguous V rows (D elements each) and every query head g:
// sixty-four elements of a head's accumulator in registers over the rows at a time.
template <typename T, int64_t D>
inline void pv_rows(const float* p, int64_t span, int64_t group, const T* v, int64_t count, float* acc) {
  for (int64_t g = 0; g < group; ++g) {
    const float* pg = p + g * span;
    for (int64_t half = 0; half < D; half += 64) {
      __m256 a[8];
      float* ag = acc + g * D + half;
      for (int64_t c = 0; c < 8; ++c) a[c] = _mm256_loadu_ps(ag + c * 8);
      for (int64_t r = 0; r < count; ++r) {
        const __m256 pr = _mm256_set1_ps(pg[r]);
        for (int64_t c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(pr, load8(v + r * D + half + c * 8), a[c]);
      }
      for (int64_t c = 0; c < 8; ++c) _mm256_storeu_ps(ag + c * 8, a[c]);
    }
  }
}
#endif

// fn(j, rows, count) for the runs of positions [j, j + count) within [first, len) of one head's K or
// V, block by block: a block's rows are contiguous, so the table is read once per block and no
// position is divided.
template <typename T, typename Fn>
inline void walk_runs(const int64_t* table, int64_t first, int64_t len, int64_t block_size, int64_t d, const T* head,
                      Fn&& fn) {
  for (int64_t j = first; j < len;) {
    const int64_t in_block = j % block_size;
    const int64_t stop = std::min(len, j - in_block + block_size);
    fn(j, head + (table[j / block_size] * block_size + in_block) * d, stop - j);
    j = stop;
  }
}

// walk_runs, each run reported to the thread's prefetch cursor once read.
template <typename T, typename Fn>
inline void for_each_run(const int64_t* table, int64_t first, int64_t len, int64_t block_size, int64_t d,
                         const T* head, Ahead& ahead, Fn&& fn) {
  walk_runs(table, first, len, block_size, d, head, [&](int64_t j, const T* rows, int64_t count) {
    fn(j, rows, count);
    ahead.consumed(count * d * static_cast<int64_t>(sizeof(T)));
  });
}

// One (decode row, kv head) task. D > 0: head_dim known at compile time (fully unrolled rows);
// D == 0: head_dim d at run time.
template <typename T, int64_t D>
void decode_task(const float* qf, int64_t group, int64_t head_dim, const int64_t* table, int64_t first, int64_t len,
                 int64_t block_size, const T* k_head, const T* v_head, float fscale, float fcap,
                 float* scores, float* acc, float* buf, Ahead& ahead) {
  const int64_t d = D > 0 ? D : head_dim;
  const int64_t span = len - first;
  // scores[g][j - first] = q_g . k_j * scale, four rows at a time: four independent sums per query
  // head, each K row loaded once for the whole group
  for_each_run(table, first, len, block_size, d, k_head, ahead, [&](int64_t j0, const T* rows, int64_t count) {
    int64_t r = 0;
#if defined(__AVX512F__)
    if constexpr (D == 64 || D == 128) {
      for (; r + 16 <= count; r += 16) {  // sixteen rows widened once (bf16), read by every query head
        const float* tile = rows_f32(rows + r * d, buf, 16 * d);
        scores16<D>(qf, group, tile, fscale, scores + (j0 + r - first), span);
      }
    }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    if constexpr (D == 64 || D == 128) {
      for (; r + 8 <= count; r += 8) {  // eight rows widened once (bf16), read by every query head
        const float* tile = rows_f32(rows + r * d, buf, 8 * d);
        scores8<D>(qf, group, tile, fscale, scores + (j0 + r - first), span);
      }
    }
#endif
    for (; r + 4 <= count; r += 4) {
      const float* k0 = row_f32(rows + r * d, buf, d);
      const float* k1 = row_f32(rows + (r + 1) * d, buf + kMaxHeadDim, d);
      const float* k2 = row_f32(rows + (r + 2) * d, buf + 2 * kMaxHeadDim, d);
      const float* k3 = row_f32(rows + (r + 3) * d, buf + 3 * kMaxHeadDim, d);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf + g * d;
        float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
        for (int64_t e = 0; e < d; ++e) {
          const float qe = qg[e];
          d0 += qe * k0[e];
          d1 += qe * k1[e];
          d2 += qe * k2[e];
          d3 += qe * k3[e];
        }
        float* sc = scores + g * span + (j0 + r - first);
        sc[0] = d0 * fscale;
        sc[1] = d1 * fscale;
        sc[2] = d2 * fscale;
        sc[3] = d3 * fscale;
      }
    }
    for (; r < count; ++r) {
      const float* kf = row_f32(rows + r * d, buf, d);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf + g * d;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t e = 0; e < d; ++e) dot += qg[e] * kf[e];
        scores[g * span + (j0 + r - first)] = dot * fscale;
      }
    }
  });
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * span;
    if (fcap > 0.f) {
      for (int64_t j = 0; j < span; ++j) row[j] = std::tanh(row[j] / fcap) * fcap;
    }
    float top = row[0];
    for (int64_t j = 1; j < span; ++j) top = std::max(top, row[j]);
#pragma omp simd
    for (int64_t j = 0; j < span; ++j) row[j] -= top;
    exp_nonpositive(row, span);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < span; ++j) sum += row[j];
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t j = 0; j < span; ++j) row[j] *= inv;
  }
  std::fill(acc, acc + group * d, 0.f);
  // acc[g] += p[g][j] * v_j, four rows per pass over each query head's accumulator
  for_each_run(table, first, len, block_size, d, v_head, ahead,
               [&](int64_t j0, const T* rows, int64_t count) {
                 int64_t r = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
                 if constexpr (D == 64 || D == 128) {
                   pv_rows<T, D>(scores + (j0 - first), span, group, rows, count, acc);
                   r = count;
                 }
#endif
                 for (; r + 4 <= count; r += 4) {
                   const float* v0 = row_f32(rows + r * d, buf, d);
                   const float* v1 = row_f32(rows + (r + 1) * d, buf + kMaxHeadDim, d);
                   const float* v2 = row_f32(rows + (r + 2) * d, buf + 2 * kMaxHeadDim, d);
                   const float* v3 = row_f32(rows + (r + 3) * d, buf + 3 * kMaxHeadDim, d);
                   for (int64_t g = 0; g < group; ++g) {
                     const float* p = scores + g * span + (j0 + r - first);
                     const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
                     float* a = acc + g * d;
#pragma omp simd
                     for (int64_t e = 0; e < d; ++e) a[e] += (p0 * v0[e] + p1 * v1[e]) + (p2 * v2[e] + p3 * v3[e]);
                   }
                 }
                 for (; r < count; ++r) {
                   const float* vf = row_f32(rows + r * d, buf, d);
                   for (int64_t g = 0; g < group; ++g) {
                     const float p = scores[g * span + (j0 + r - first)];
                     float* a = acc + g * d;
#pragma omp simd
                     for (int64_t e = 0; e < d; ++e) a[e] += p * vf[e];
                   }
                 }
               });
}

template <typename T>
void decode(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& tables,
            const torch::Tensor& lengths, torch::Tensor& out, int64_t block_size, double scale,
            double softcap, int64_t window) {
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = cache.size(1), slots = cache.size(2), width = tables.size(1);
  const int64_t group = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = cache.data_ptr<T>();
  const T* vp = kp + kv_heads * slots * d;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1), o_row = out.stride(0);
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  const auto first_of = [window](int64_t len) { return window > 0 ? std::max<int64_t>(0, len - window) : int64_t{0}; };
  auto task_fn = d == 64 ? &decode_task<T, 64> : d == 128 ? &decode_task<T, 128> : &decode_task<T, 0>;
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), scores;
    float buf[16 * kMaxHeadDim];  // up to sixteen K or V rows widened to fp32 (bf16)
    Ahead ahead(kAheadLines);  // every task's K then V runs, in the order they are read
    const auto add = [&](int64_t, const T* rows, int64_t count) {
      ahead.add(rows, count * d * static_cast<int64_t>(sizeof(T)));
    };
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads;
      walk_runs(tp + s * width, first_of(lp[s]), lp[s], block_size, d, kp + h * slots * d, add);
      walk_runs(tp + s * width, first_of(lp[s]), lp[s], block_size, d, vp + h * slots * d, add);
    }
    ahead.start();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads;
      const int64_t len = lp[s];
      const int64_t first = first_of(len);
      scores.resize(group * (len - first));
      for (int64_t g = 0; g < group; ++g) {
        const float* src = row_f32(qp + s * q_row + (h * group + g) * q_head, buf, d);
        std::copy(src, src + d, qf.begin() + g * d);
      }
      task_fn(qf.data(), group, d, tp + s * width, first, len, block_size, kp + h * slots * d, vp + h * slots * d,
              fscale, fcap, scores.data(), acc.data(), buf, ahead);
      for (int64_t g = 0; g < group; ++g) {
        T* dst = op + s * o_row + (h * group + g) * d;
        for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<T>(acc[g * d + e]);
      }
    }
  });
}

}  // namespace

// q [n, heads, d] (rows of contiguous head_dim); cache [2, kv_heads, slots, d] contiguous; tables
// [n, width] int64 block ids; lengths [n] int64 (each >= 1); out [n, heads * d] (contiguous rows).
// softcap <= 0: none; window <= 0: none (else the last `window` positions).
void paged_decode(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& tables,
                  const torch::Tensor& lengths, torch::Tensor out, int64_t block_size, double scale,
                  double softcap, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "paged_decode runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [n, heads, head_dim] with contiguous head_dim");
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == 2 && cache.is_contiguous(), "cache must be a contiguous [2, kv_heads, slots, head_dim]");
  TORCH_CHECK(cache.size(3) == q.size(2) && q.size(1) % cache.size(1) == 0, "q's heads and head_dim must fit the cache's");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type() && out.scalar_type() == q.scalar_type(), "q, cache and out share a dtype");
  TORCH_CHECK(tables.scalar_type() == torch::kInt64 && tables.dim() == 2 && tables.is_contiguous() && tables.size(0) == q.size(0), "tables must be a contiguous int64 [n, width]");
  TORCH_CHECK(lengths.scalar_type() == torch::kInt64 && lengths.is_contiguous() && lengths.numel() == q.size(0), "lengths must be a contiguous int64 [n]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == q.size(0) && out.size(1) == q.size(1) * q.size(2) && out.stride(1) == 1, "out must be [n, heads * head_dim] with contiguous rows");
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  TORCH_CHECK(q.size(2) <= kMaxHeadDim, "head_dim above ", kMaxHeadDim, " is not supported");
  switch (q.scalar_type()) {
    case torch::kFloat: decode<float>(q, cache, tables, lengths, out, block_size, scale, softcap, window); break;
    case torch::kBFloat16: decode<at::BFloat16>(q, cache, tables, lengths, out, block_size, scale, softcap, window); break;
    default: TORCH_CHECK(false, "paged_decode supports float32 and bfloat16, not ", q.scalar_type());
  }
}

TORCH_LIBRARY(lorafleet, m) {
  m.def("paged_decode(Tensor q, Tensor cache, Tensor tables, Tensor lengths, Tensor(a!) out, int block_size, float scale, float softcap, int window) -> ()");
}

TORCH_LIBRARY_IMPL(lorafleet, CPU, m) { m.impl("paged_decode", &paged_decode); }
