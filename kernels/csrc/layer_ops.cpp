// The element-wise steps between a decoder layer's matmuls, one call each on CPU: RMSNorm, the
// residual add fused with the next RMSNorm, and rotary embedding fused with the K/V cache write.
//
// Each replaces a chain of eager ops (RMSNorm alone is about ten: pow, mean, add, rsqrt, two muls and
// dtype copies), whose launches, not their arithmetic, cost a decode step most of its time outside
// the matmuls. Every result is rounded where the eager chain rounds it, so a bf16 model gets the
// eager path's values (up to the order of one fp32 sum):
//   rms_norm     out = T(x * r * w), r = 1 / sqrt(mean(x^2) + eps), all in fp32 (torch's F.rms_norm;
//                w of x's dtype, or fp32: Gemma's (1 + w))
//   add_rms_norm h = T(h + T(delta * residual_mul)) in place, then out = rms_norm(h)
//   rope_write_kv x = T(T(x * cos) + roll(x, d / 2) * signed_sin) per q and k head, in place; then
//                the step's rotated K and its V written to their cache slots
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "vec.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace lorafleet;

constexpr int64_t kRowWork = 1 << 15;  // elements per thread below which rows stay on one thread
constexpr int64_t kMaxHeadDim = 512;

int64_t grain_of(int64_t row) { return std::max<int64_t>(1, kRowWork / std::max<int64_t>(1, row)); }

// out[0:d] = RMSNorm(x[0:d]) * w; W is T, or float (Gemma's fp32 (1 + w)).
template <typename T, typename W>
inline void norm_row(const T* x, const W* w, T* out, int64_t d, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t e = 0; e < d; ++e) {
    const float v = widen(x[e]);
    sum += v * v;
  }
  const float r = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
  for (int64_t e = 0; e < d; ++e) out[e] = static_cast<T>(widen(x[e]) * r * widen(w[e]));
}

// row += T(delta * mul), rounded to T: two roundings, as the eager mul and add, never one fused
// multiply-add (the build contracts elsewhere).
template <typename T>
__attribute__((noinline, optimize("fp-contract=off"))) void add_row(T* row, const T* delta, int64_t d, float mul) {
  for (int64_t e = 0; e < d; ++e) row[e] = static_cast<T>(widen(row[e]) + rnd<T>(widen(delta[e]) * mul));
}

template <typename T, typename W>
void norm_rows(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& out, double eps,
               const torch::Tensor* delta, double residual_mul) {
  const int64_t n = x.size(0), d = x.size(1), x_row = x.stride(0);
  T* xp = x.data_ptr<T>();
  const W* wp = weight.data_ptr<W>();
  T* op = out.data_ptr<T>();
  const T* dp = delta ? delta->data_ptr<T>() : nullptr;
  const int64_t d_row = delta ? delta->stride(0) : 0;
  const float feps = static_cast<float>(eps), mul = static_cast<float>(residual_mul);
  at::parallel_for(0, n, grain_of(d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* row = xp + i * x_row;
      if (dp) add_row<T>(row, dp + i * d_row, d, mul);
      norm_row<T, W>(row, wp, op + i * d, d, feps);
    }
  });
}

void check_norm(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "the layer ops run on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, d] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16,
              "the layer ops support float32 and bfloat16, not ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1), "weight must be a contiguous [d]");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat || weight.scalar_type() == x.scalar_type(),
              "weight must be fp32 or x's dtype");
}

template <typename T>
void norm_dispatch(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& out, double eps,
                   const torch::Tensor* delta, double residual_mul) {
  if (weight.scalar_type() == torch::kFloat) {
    norm_rows<T, float>(x, weight, out, eps, delta, residual_mul);
  } else {
    norm_rows<T, T>(x, weight, out, eps, delta, residual_mul);
  }
}

}  // namespace

// x [rows, d] (contiguous rows), weight [d] (x's dtype or fp32) -> a new contiguous [rows, d] of x's dtype.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_norm(x, weight);
  torch::Tensor out = torch::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == torch::kFloat) {
    norm_dispatch<float>(x, weight, out, eps, nullptr, 1.0);
  } else {
    norm_dispatch<at::BFloat16>(x, weight, out, eps, nullptr, 1.0);
  }
  return out;
}

// h [rows, d] += delta * residual_mul in place (the residual stream), then -> rms_norm(h, weight).
torch::Tensor add_rms_norm(torch::Tensor h, const torch::Tensor& delta, const torch::Tensor& weight, double eps,
                           double residual_mul) {
  check_norm(h, weight);
  TORCH_CHECK(delta.device().is_cpu() && delta.dim() == 2 && delta.stride(1) == 1 && delta.size(0) == h.size(0) &&
                  delta.size(1) == h.size(1) && delta.scalar_type() == h.scalar_type(),
              "delta must be h's shape and dtype with contiguous rows");
  torch::Tensor out = torch::empty({h.size(0), h.size(1)}, h.options());
  if (h.scalar_type() == torch::kFloat) {
    norm_dispatch<float>(h, weight, out, eps, &delta, residual_mul);
  } else {
    norm_dispatch<at::BFloat16>(h, weight, out, eps, &delta, residual_mul);
  }
  return out;
}

namespace {

// Rotate one head in place: x = x * cos + roll(x, half) * signed_sin, rounded as the eager ops round:
// x * cos rounded (a mul), then roll * sin added to it in one fused multiply-add (torch's addcmul).
template <typename T>
__attribute__((noinline, optimize("fp-contract=off"))) void rotate(T* x, const T* cos, const T* sin, int64_t d, float* buf) {
  const int64_t half = d / 2;
  for (int64_t e = 0; e < d; ++e) buf[e] = widen(x[e]);
  for (int64_t e = 0; e < d; ++e) {
    const float rolled = buf[e < half ? e + half : e - half];
    x[e] = static_cast<T>(std::fma(rolled, widen(sin[e]), rnd<T>(buf[e] * widen(cos[e]))));
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// rotate's arithmetic on eight lanes at a time, where half the head is whole vectors: the same
// product, rounding and fused multiply-add per element, so the same values.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate8(T* x, const T* cos, const T* sin, int64_t d) {
  const int64_t half = d / 2;
  const T* tag = nullptr;
  for (int64_t e = 0; e < half; e += 8) {
    const __m256 a = load8(x + e), b = load8(x + e + half);
    const __m256 na = _mm256_fmadd_ps(b, load8(sin + e), round8(_mm256_mul_ps(a, load8(cos + e)), tag));
    const __m256 nb = _mm256_fmadd_ps(a, load8(sin + e + half), round8(_mm256_mul_ps(b, load8(cos + e + half)), tag));
    store8(x + e, na);
    store8(x + e + half, nb);
  }
}
#endif

template <typename T>
void rope_kv(torch::Tensor& qk, const torch::Tensor& v, const torch::Tensor& cos_sin, const torch::Tensor& slots,
             torch::Tensor& cache) {
  const int64_t n = qk.size(0), heads = qk.size(1), d = qk.size(2), kv_heads = v.size(1);
  const int64_t q_heads = heads - kv_heads, num_slots = cache.size(2);
  T* qp = qk.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* cp = cos_sin.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  T* kc = cache.data_ptr<T>();
  T* vc = kc + kv_heads * num_slots * d;
  const int64_t qk_row = qk.stride(0), qk_head = qk.stride(1), v_row = v.stride(0), v_head = v.stride(1);
  at::parallel_for(0, n, grain_of(heads * d), [&](int64_t begin, int64_t end) {
    float buf[kMaxHeadDim];
    for (int64_t t = begin; t < end; ++t) {
      const T* cos = cp + t * 2 * d;
      const T* sin = cos + d;
      const int64_t slot = sp[t];
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qp + t * qk_row + h * qk_head;
#if defined(__AVX2__) && defined(__FMA__)
        if (d % 16 == 0) {
          rotate8<T>(x, cos, sin, d);
        } else {
          rotate<T>(x, cos, sin, d, buf);
        }
#else
        rotate<T>(x, cos, sin, d, buf);
#endif
        if (h >= q_heads) {
          const int64_t kv = h - q_heads;
          std::memcpy(kc + (kv * num_slots + slot) * d, x, d * sizeof(T));
          std::memcpy(vc + (kv * num_slots + slot) * d, vp + t * v_row + kv * v_head, d * sizeof(T));
        }
      }
    }
  });
}

}  // namespace

// qk [n, heads + kv_heads, d] (q heads then k heads, contiguous head_dim): rotated in place by
// cos_sin [n, 2, d] (cos, signed sin); then each token's k heads and v [n, kv_heads, d] are written
// to slot slots[t] of cache [2, kv_heads, num_slots, d].
void rope_write_kv(torch::Tensor qk, const torch::Tensor& v, const torch::Tensor& cos_sin, const torch::Tensor& slots,
                   torch::Tensor cache) {
  TORCH_CHECK(qk.device().is_cpu() && v.device().is_cpu() && cache.device().is_cpu(), "rope_write_kv runs on CPU tensors");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1, "qk must be [n, heads, d] with contiguous head_dim");
  TORCH_CHECK(v.dim() == 3 && v.stride(2) == 1 && v.size(0) == qk.size(0) && v.size(2) == qk.size(2) && v.size(1) < qk.size(1),
              "v must be [n, kv_heads, d] with contiguous head_dim, fewer heads than qk");
  TORCH_CHECK(qk.size(2) % 2 == 0 && qk.size(2) <= kMaxHeadDim, "head_dim must be even and at most ", kMaxHeadDim);
  TORCH_CHECK(cos_sin.dim() == 3 && cos_sin.is_contiguous() && cos_sin.size(0) == qk.size(0) && cos_sin.size(1) == 2 &&
                  cos_sin.size(2) == qk.size(2),
              "cos_sin must be a contiguous [n, 2, d]");
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == 2 && cache.is_contiguous() && cache.size(1) == v.size(1) &&
                  cache.size(3) == qk.size(2),
              "cache must be a contiguous [2, kv_heads, slots, d]");
  TORCH_CHECK(qk.scalar_type() == v.scalar_type() && cos_sin.scalar_type() == qk.scalar_type() &&
                  cache.scalar_type() == qk.scalar_type(),
              "qk, v, cos_sin and cache share a dtype");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == qk.size(0),
              "slots must be a contiguous int64 [n]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < cache.size(2), "slot ", sp[t], " out of range");
  }
  switch (qk.scalar_type()) {
    case torch::kFloat: rope_kv<float>(qk, v, cos_sin, slots, cache); break;
    case torch::kBFloat16: rope_kv<at::BFloat16>(qk, v, cos_sin, slots, cache); break;
    default: TORCH_CHECK(false, "rope_write_kv supports float32 and bfloat16, not ", qk.scalar_type());
  }
}

TORCH_LIBRARY_FRAGMENT(lorafleet, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) h, Tensor delta, Tensor weight, float eps, float residual_mul) -> Tensor");
  m.def("rope_write_kv(Tensor(a!) qk, Tensor v, Tensor cos_sin, Tensor slots, Tensor(b!) cache) -> ()");
}

TORCH_LIBRARY_IMPL(lorafleet, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_write_kv", &rope_write_kv);
}
