// Software prefetch along a thread's whole sequence of reads, a fixed distance ahead of the compute.
//
// The LoRA and paged-attention kernels read many short runs that lie scattered in memory (a token's
// own adapter, part by part; a decode's K/V blocks, a few KB each, then the next task's), where the
// hardware prefetchers, which follow one page, keep starting over at every run and the next run's
// first lines are always a miss. A thread lists its runs up front in the order it will read them
// (`add`), then reports each read (`consumed`): the cursor asks for one more line per 64 bytes read,
// into L2, `distance` lines (64 bytes each) beyond what has been read. The lead builds up from a few
// lines, two per line read, rather than as one burst at the start, which would queue ahead of the
// first demand loads.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace lorafleet {

class Ahead {
 public:
  explicit Ahead(int64_t distance) : distance_(distance) {}

  // A run of `bytes` starting at `p`, read after the runs added before it.
  void add(const void* p, int64_t bytes) {
    if (bytes > 0) runs_.emplace_back(static_cast<const char*>(p), bytes);
  }

  // Before the first read: the first few lines.
  void start() {
    for (; lead_ < kStart && lead_ < distance_; ++lead_) next();
  }

  // `bytes` more of the runs were read.
  void consumed(int64_t bytes) {
    owed_ += bytes;
    while (owed_ >= 64) {
      owed_ -= 64;
      next();
      if (lead_ < distance_) {
        next();
        ++lead_;
      }
    }
  }

 private:
  static constexpr int64_t kStart = 16;

  void next() {
    if (at_ >= runs_.size()) return;
    __builtin_prefetch(runs_[at_].first + off_, 0, 2);  // prefetcht1: into L2
    off_ += 64;
    if (off_ >= runs_[at_].second) {
      ++at_;
      off_ = 0;
    }
  }

  std::vector<std::pair<const char*, int64_t>> runs_;
  int64_t distance_;
  size_t at_ = 0;
  int64_t off_ = 0, owed_ = 0, lead_ = 0;
};

}  // namespace lorafleet
