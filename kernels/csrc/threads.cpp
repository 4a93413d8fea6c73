// The calling thread's intra-op thread count for this library's parallel loops (kernels/omp_threads.py).
//
// ATen's lazy per-thread initialisation (at::internal::lazy_init_num_threads, an inline function with a
// thread_local flag) is compiled into every library that calls at::parallel_for, this one included, and
// the first parallel_for of a thread in each library sets the thread's OpenMP count to torch's
// process-wide one. So a thread given its own count must have this library's initialisation done
// first, then the count set: both here.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <omp.h>

namespace {

void set_intraop_threads(int64_t threads) {
  TORCH_CHECK(threads >= 1, "set_intraop_threads: at least one thread");
  at::internal::lazy_init_num_threads();
  omp_set_num_threads(static_cast<int>(threads));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lorafleet, m) { m.def("set_intraop_threads(int threads) -> ()", &set_intraop_threads); }
