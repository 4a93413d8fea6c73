// The threaded driver shared by the AVX-512 panel kernels (panel_dot_bf16.cpp, panel_wide.cpp): every
// panel of a packed weight against every register tile of x's rows, runs of panels claimed from a
// shared counter by whichever thread is free (the two vCPUs of the VMs this was measured on ran FMA
// loops at different speeds, and a static split waits for the slower one), and the panel after the
// current one (or the first of the worker's next run, claimed early for this) fetched into L2 a few
// lines at a time by the row tiles of the current one. A panel that is its own only row tile (up to 8
// rows) has two lines to fetch per step of its loop: a tile spreading only one per step, the rest in
// a burst at its end, took 1.3x the time over SmolLM2's projections at 5-8 rows (fp32 and bf16).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

namespace lorafleet {

// f(std::integral_constant<int, R>{}) for R = rows, 1 <= rows <= 8: a register tile's row count as a
// compile-time constant.
template <typename F>
void with_tile_rows(int64_t rows, const F& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// tile(p, m, r, prefetch, lines): panel p against rows [m, m + r) (r <= row_tile), fetching `lines`
// cache lines from `prefetch` on along the way. Panels are `panel_bytes` apart from `packed`.
template <typename Tile>
void for_each_panel_tile(int64_t n_panels, int64_t rows, int64_t row_tile, const void* packed, int64_t panel_bytes,
                         const Tile& tile) {
  const int64_t threads = at::get_num_threads();
  // runs of up to eight panels, at least four runs per thread where the panels allow
  const int64_t run_length = std::clamp<int64_t>(n_panels / (4 * threads), 1, 8);
  const int64_t runs = (n_panels + run_length - 1) / run_length;
  const int64_t panel_lines = (panel_bytes + 63) / 64;
  const int64_t tiles = (rows + row_tile - 1) / row_tile, per_tile = (panel_lines + tiles - 1) / tiles;
  const char* base = static_cast<const char*>(packed);
  std::atomic<int64_t> counter{0};
  at::parallel_for(0, std::min(threads, runs), 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {  // one worker per task; claims runs until none are left
      int64_t current = counter.fetch_add(1);
      while (current < runs) {
        const int64_t upcoming = counter.fetch_add(1);  // claimed now, so its first panel can be prefetched
        const int64_t last = std::min(n_panels, (current + 1) * run_length);
        for (int64_t p = current * run_length; p < last; ++p) {
          const int64_t next = p + 1 < last ? p + 1 : upcoming < runs ? upcoming * run_length : -1;
          const char* prefetch = base + std::max<int64_t>(next, 0) * panel_bytes;
          int64_t lines = next >= 0 ? panel_lines : 0;
          for (int64_t m = 0; m < rows; m += row_tile) {
            const int64_t n = std::min(per_tile, lines);
            tile(p, m, std::min(row_tile, rows - m), prefetch, n);
            prefetch += 64 * n;
            lines -= n;
          }
        }
        current = upcoming;
      }
    }
  });
}

}  // namespace lorafleet
