// Dense projections of any row count on CPU through a weight packed once into panels:
// out = T(x @ weight^T + bias), weight [out, in] (torch's Linear layout) packed by panel_pack into
// panels of 24 output features, [panels][in][24], in the weight's dtype, zero past the last feature.
//
// Why: at 9-64 rows (a decode batch past the small-row kernel) oneDNN's fp32 GEMM on an AVX2 CPU
// reaches about 80 GFLOP/s over SmolLM2's projections where the same CPU's 2048^3 GEMM reaches 130,
// and where oneDNN has no bf16 path (no AVX-512) torch's bf16 GEMM is its reference loop at about 16.
// Here each panel is multiplied by every row of x in 4 x 24 register tiles (twelve 8-lane fp32
// accumulators; per k three panel loads and four broadcasts of x feed twelve FMAs), the panel read
// from L1 in blocks of 256 k (24 KB of fp32) shared by all the row tiles, while the next panel of the
// thread's run is prefetched a line at a time. bf16 panels are widened in the register (a shift,
// exact); x is widened once per call. The fp32 sum plus bias is rounded once to the output's dtype,
// as a bf16 GEMM with an fp32 accumulator rounds it.
//
// Threads take runs of panels from a shared counter (the next run is claimed before the last panel
// of the current one, so it can be prefetched): the two vCPUs of the VMs this was measured on ran
// FMA loops at different speeds (64-93 GFLOP/s each), and a static split waits for the slower one.
// The kernel is AVX2 + FMA; elsewhere the same loops in portable C++ (correct, not fast: the engine
// takes this path only where the build is AVX2 without AVX-512, see kernels/native.py).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using namespace lorafleet;

constexpr int64_t kPanel = 24;       // output features per packed panel: three 8-lane vectors
constexpr int64_t kRowTile = 4;      // x rows per register tile (4 x 24 accumulators)
constexpr int64_t kDepth = 256;      // k per block: a panel's block (24 KB fp32) stays in L1 over the row tiles
constexpr int64_t kRowBlock = 128;   // rows per block at most (partial sums 12 KB)
constexpr int64_t kXBlockBytes = 256 * 1024;  // x's rows per block: about this much fp32 (L2)


// sums[r][0 .. 24) (+)= x[r] . panel over `depth` k, for R rows of x (fp32, row stride ldx); panel
// [depth][24] of T (the weight's dtype). `prefetch` .. + `lines` cache lines are fetched into L1 along the way.
template <typename T, int R, bool kFirst>
void tile(const float* x, int64_t ldx, const T* panel, int64_t depth, float* sums, const char* prefetch,
          int64_t lines) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[R][3];
  // Unrolled early on purpose: without the pragmas GCC kept the twelve accumulators in memory and
  // stored them every k (half speed).
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < 3; ++j) acc[r][j] = kFirst ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + r * kPanel + 8 * j);
  int64_t line = 0;
  for (int64_t k = 0; k < depth; ++k) {
    __m256 b0 = load8(panel + k * kPanel), b1 = load8(panel + k * kPanel + 8), b2 = load8(panel + k * kPanel + 16);
    // Held in registers: left to itself GCC folds the loads into every FMA, and the kernel is bound
    // by its loads.
    asm("" : "+x"(b0), "+x"(b1), "+x"(b2));
    if ((k & 3) == 0 && line < lines) {
      _mm_prefetch(prefetch + 64 * line, _MM_HINT_T0);
      ++line;
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(a, b2, acc[r][2]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < 3; ++j) _mm256_storeu_ps(sums + r * kPanel + 8 * j, acc[r][j]);
#else
  (void)prefetch;
  (void)lines;
  if (kFirst)
    for (int64_t i = 0; i < R * kPanel; ++i) sums[i] = 0.f;
  for (int64_t k = 0; k < depth; ++k)
    for (int r = 0; r < R; ++r) {
      const float a = x[r * ldx + k];
#pragma omp simd
      for (int64_t j = 0; j < kPanel; ++j) sums[r * kPanel + j] += a * widen(panel[k * kPanel + j]);
    }
#endif
}

template <typename T, bool kFirst>
void row_tile(int64_t rows, const float* x, int64_t ldx, const T* panel, int64_t depth, float* sums,
              const char* prefetch, int64_t lines) {
  switch (rows) {
    case 1: return tile<T, 1, kFirst>(x, ldx, panel, depth, sums, prefetch, lines);
    case 2: return tile<T, 2, kFirst>(x, ldx, panel, depth, sums, prefetch, lines);
    case 3: return tile<T, 3, kFirst>(x, ldx, panel, depth, sums, prefetch, lines);
    default: return tile<T, 4, kFirst>(x, ldx, panel, depth, sums, prefetch, lines);
  }
}

// out[m][0 .. valid) = T(sums[m] + bias) for `rows` rows (bias null: none).
template <typename T>
void finish(const float* sums, int64_t rows, const float* bias, int64_t valid, T* out, int64_t out_stride) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* s = sums + m * kPanel;
    T* o = out + m * out_stride;
    int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; j + 8 <= valid; j += 8) {
      const __m256 v = _mm256_loadu_ps(s + j);
      store8(o + j, bias ? _mm256_add_ps(v, _mm256_loadu_ps(bias + j)) : v);
    }
#endif
    for (; j < valid; ++j) store(o + j, bias ? s[j] + bias[j] : s[j]);
  }
}

struct Problem {
  const float* x;  // [rows][in] fp32, row stride ldx
  int64_t ldx, rows, in, features;
};

// The rows of x per block: a block (up to 256 KB of fp32) stays in L2 while a run's panels pass
// over it; a multiple of the row tile, at most kRowBlock.
int64_t row_block(int64_t in) {
  return std::clamp<int64_t>((kXBlockBytes / (in * int64_t(sizeof(float)))) / kRowTile * kRowTile, kRowTile,
                             kRowBlock);
}

// Rows [m0, m0 + rows) of x against one panel: k blocks of the panel, each over every row tile, with
// `lines` lines from `prefetch` on fetched along the way; then bias, rounding and the store.
template <typename T>
void panel_rows(const Problem& pr, int64_t m0, int64_t rows, const T* panel, const float* bias, int64_t valid, T* out,
                float* sums, const char* prefetch, int64_t lines) {
  const int64_t tiles = (rows + kRowTile - 1) / kRowTile;
  const int64_t blocks = (pr.in + kDepth - 1) / kDepth;
  const int64_t per_tile = (lines + tiles * blocks - 1) / (tiles * blocks);
  for (int64_t k0 = 0; k0 < pr.in; k0 += kDepth) {
    const int64_t depth = std::min(kDepth, pr.in - k0);
    for (int64_t t = 0; t < rows; t += kRowTile) {
      const int64_t n = std::min(per_tile, lines);
      const float* x = pr.x + (m0 + t) * pr.ldx + k0;
      const int64_t r = std::min(kRowTile, rows - t);
      if (k0 == 0)
        row_tile<T, true>(r, x, pr.ldx, panel + k0 * kPanel, depth, sums + t * kPanel, prefetch, n);
      else
        row_tile<T, false>(r, x, pr.ldx, panel + k0 * kPanel, depth, sums + t * kPanel, prefetch, n);
      prefetch += 64 * n;
      lines -= n;
    }
  }
  finish(sums, rows, bias, valid, out + m0 * pr.features, pr.features);
}

// Panels [first, last) against every row: for each block of rows, each panel of the run in turn,
// the panel after it (or `after`, the first panel of the worker's next run, or -1) prefetched.
template <typename T>
void panel_run(const Problem& pr, const T* packed, const float* bias, T* out, int64_t first, int64_t last, int64_t after,
               float* sums) {
  const int64_t block = row_block(pr.in), panel_elems = pr.in * kPanel;
  const int64_t lines = (panel_elems * int64_t(sizeof(T)) + 63) / 64;
  for (int64_t m0 = 0; m0 < pr.rows; m0 += block) {
    const int64_t rows = std::min(block, pr.rows - m0);
    const bool last_block = m0 + block >= pr.rows;
    for (int64_t p = first; p < last; ++p) {
      const int64_t next = p + 1 < last ? p + 1 : last_block ? after : first;
      const T* panel = packed + p * panel_elems;
      const char* prefetch = reinterpret_cast<const char*>(next >= 0 ? packed + next * panel_elems : panel);
      const int64_t n0 = p * kPanel;
      panel_rows<T>(pr, m0, rows, panel, bias ? bias + n0 : nullptr, std::min(kPanel, pr.features - n0), out + n0, sums, prefetch,
                       next >= 0 ? lines : 0);
    }
  }
}

template <typename T>
void run(const Problem& pr, const T* packed, const float* bias, T* out) {
  const int64_t n_panels = (pr.features + kPanel - 1) / kPanel;
  const int64_t threads = at::get_num_threads();
  // Runs of up to eight panels (a block of x's rows is read from L2 once per run), at least four runs
  // per thread where the panels allow (a faster thread takes more of them)
  const int64_t run_length = std::clamp<int64_t>(n_panels / (4 * threads), 1, 8);
  const int64_t runs = (n_panels + run_length - 1) / run_length;
  std::atomic<int64_t> counter{0};
  const int64_t workers = std::min(threads, runs);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(std::min(pr.rows, row_block(pr.in)) * kPanel);
    for (int64_t w = begin; w < end; ++w) {  // one worker per task; claims runs until none are left
      int64_t current = counter.fetch_add(1);
      while (current < runs) {
        const int64_t upcoming = counter.fetch_add(1);  // claimed now, so its first panel can be prefetched
        const int64_t first = current * run_length;
        panel_run<T>(pr, packed, bias, out, first, std::min(n_panels, first + run_length),
                        upcoming < runs ? upcoming * run_length : -1, sums.data());
        current = upcoming;
      }
    }
  });
}

template <typename T>
void pack(const T* w, int64_t features, int64_t in, T* packed) {
  const int64_t n_panels = (features + kPanel - 1) / kPanel;
  at::parallel_for(0, n_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      T* dst = packed + p * in * kPanel;
      const int64_t valid = std::min(kPanel, features - p * kPanel);
      for (int64_t j = 0; j < valid; ++j) {
        const T* row = w + (p * kPanel + j) * in;
        for (int64_t k = 0; k < in; ++k) dst[k * kPanel + j] = row[k];
      }
    }
  });
}

at::Tensor panel_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) >= 1 && weight.size(1) >= 1, "panel_pack: weight [out, in]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "panel_pack: fp32 or bf16");
  const at::Tensor w = weight.contiguous();
  const int64_t features = w.size(0), in = w.size(1);
  at::Tensor packed = at::zeros({(features + kPanel - 1) / kPanel, in, kPanel}, w.options());
  if (w.scalar_type() == at::kFloat)
    pack(w.data_ptr<float>(), features, in, packed.data_ptr<float>());
  else
    pack(w.data_ptr<at::BFloat16>(), features, in, packed.data_ptr<at::BFloat16>());
  return packed;
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                        int64_t features) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kPanel,
              "panel_linear: x [rows, in] and a weight from panel_pack");
  TORCH_CHECK(packed.is_contiguous(), "panel_linear: the packed weight must be contiguous");
  TORCH_CHECK(x.size(1) == packed.size(1), "panel_linear: x has ", x.size(1), " features, weight ", packed.size(1));
  TORCH_CHECK(features >= 1 && (features + kPanel - 1) / kPanel == packed.size(0),
              "panel_linear: ", features, " output features do not fit ", packed.size(0), " panels");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "panel_linear: x and weight differ in dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "panel_linear: fp32 or bf16");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == features, "panel_linear: bias [out]");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "panel_linear: bias and x differ in dtype");
  }
  const int64_t rows = x.size(0), in = x.size(1);
  at::Tensor out = at::empty({rows, features}, x.options());
  if (rows == 0) return out;
  // fp32 operands for the kernel: x and the bias read in place where they are contiguous fp32, else
  // widened (the epilogue reads the bias of a panel's valid features only)
  const at::Tensor xf = x.scalar_type() == at::kFloat && x.stride(1) == 1 ? x : x.to(at::kFloat).contiguous();
  const at::Tensor bias_f = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bias_p = has_bias ? bias_f.data_ptr<float>() : nullptr;
  const Problem pr{xf.data_ptr<float>(), xf.stride(0), rows, in, features};
  if (x.scalar_type() == at::kFloat)
    run<float>(pr, packed.data_ptr<float>(), bias_p, out.data_ptr<float>());
  else
    run<at::BFloat16>(pr, packed.data_ptr<at::BFloat16>(), bias_p, out.data_ptr<at::BFloat16>());
  return out;
}

bool panel_avx2() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lorafleet, m) {
  m.def("panel_pack(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor packed, Tensor? bias, int features) -> Tensor");
  m.def("panel_avx2() -> bool", &panel_avx2);
}

TORCH_LIBRARY_IMPL(lorafleet, CPU, m) {
  m.impl("panel_pack", &panel_pack);
  m.impl("panel_linear", &panel_linear);
}
