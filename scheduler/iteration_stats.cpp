// IterationStats and IterationMeter (see iteration_stats.h).
#include "iteration_stats.h"

namespace ferry {

double IterationStats::moved_over_optimal() const {
  if (optimal_bytes < 0) return -1.0;
  const int64_t moved = moved_bytes();
  if (optimal_bytes == 0) return moved == 0 ? 1.0 : -1.0;
  return static_cast<double>(moved) / static_cast<double>(optimal_bytes);
}

void IterationMeter::begin(int64_t index, bool traced, int64_t optimal_bytes) {
  current_ = IterationStats{};
  current_.index = index;
  current_.traced = traced;
  current_.optimal_bytes = optimal_bytes;
}

void IterationMeter::baseline(ChunkStore& store) {
  at_begin_ = store.stats();
  if (have_end_) {
    between_h2d_ += at_begin_.moves.h2d_bytes - at_end_.moves.h2d_bytes;
    between_d2h_ += at_begin_.moves.d2h_bytes - at_end_.moves.d2h_bytes;
  }
  store.reset_peak_stats();
}

const IterationStats& IterationMeter::end(const ChunkStoreStats& now, bool aborted, bool forward_only) {
  current_.h2d_bytes = now.moves.h2d_bytes - at_begin_.moves.h2d_bytes;
  current_.prefetched_bytes = now.moves.prefetch_h2d_bytes - at_begin_.moves.prefetch_h2d_bytes;
  current_.d2h_bytes = now.moves.d2h_bytes - at_begin_.moves.d2h_bytes;
  current_.evictions = now.moves.evictions - at_begin_.moves.evictions;
  current_.wait_ns = now.moves.wait_ns - at_begin_.moves.wait_ns;
  current_.device_peak_bytes = now.device.peak_bytes;
  current_.working_set_peak_bytes = now.compute_peak_bytes;
  current_.aborted = aborted;
  current_.forward_only = forward_only;
  if (!forward_only) {
    current_.between_h2d_bytes = between_h2d_;
    current_.between_d2h_bytes = between_d2h_;
    between_h2d_ = between_d2h_ = 0;
  }
  at_end_ = now;
  have_end_ = true;
  last_ = current_;
  return last_;
}

}  // namespace ferry
