#include "access_trace.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <set>

namespace ferry {

void AccessTrace::record(TensorId tensor, ChunkId chunk, int64_t non_model_bytes) {
  tensors_.push_back(tensor);
  chunks_.push_back(chunk);
  non_model_.push_back(non_model_bytes);
}

void AccessTrace::clear() {
  tensors_.clear();
  chunks_.clear();
  non_model_.clear();
  backward_start_ = -1;
  positions_of_chunk_.clear();
}

void AccessTrace::remap_chunks(const std::vector<ChunkId>& chunk_of_tensor) {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    TORCH_INTERNAL_ASSERT(tensors_[i] < static_cast<TensorId>(chunk_of_tensor.size()));
    chunks_[i] = chunk_of_tensor[tensors_[i]];
  }
}

void AccessTrace::finalize(int64_t num_chunks) {
  positions_of_chunk_.assign(num_chunks, {});
  for (size_t i = 0; i < chunks_.size(); ++i) {
    TORCH_INTERNAL_ASSERT(chunks_[i] >= 0 && chunks_[i] < num_chunks, "trace chunk out of range");
    positions_of_chunk_[chunks_[i]].push_back(static_cast<int64_t>(i));
  }
  const int64_t n = size();
  run_end_.assign(n, n);
  for (int64_t i = n - 2; i >= 0; --i) run_end_[i] = chunks_[i + 1] != chunks_[i] ? i + 1 : run_end_[i + 1];
}

int64_t AccessTrace::next_use(ChunkId chunk, int64_t position, const std::vector<char>* passed_over) const {
  if (chunk < 0 || chunk >= static_cast<ChunkId>(positions_of_chunk_.size())) return kNever;
  const auto& p = positions_of_chunk_[chunk];
  if (p.empty()) return kNever;
  // The trace repeats: a position past its end is in a later iteration (prefetching into the next
  // one asks so), whose uses are this iteration's shifted by a multiple of size().
  const int64_t n = size();
  // Never is never: within two iterations of kNever the answer (at most position + 2n) is past what
  // int64_t holds, so it is kNever too (OptEvictionPolicy asks from kNever for a chunk next used never).
  if (position > kNever - 2 * n) return kNever;
  const int64_t base = position > 0 ? position / n * n : 0;
  auto it = std::lower_bound(p.begin(), p.end(), position - base);
  // Positions passed over belong to this iteration only; a later one uses the whole trace.
  if (passed_over != nullptr && base == 0) {
    while (it != p.end() && (*passed_over)[*it]) ++it;
  }
  return base + (it != p.end() ? *it : p.front() + n);  // else the iteration after's first use
}

bool AccessTrace::run_passed_over(int64_t position, const std::vector<char>& passed_over) const {
  for (int64_t q = position, end = run_end(position); q < end; ++q) {
    if (!passed_over[q]) return false;
  }
  return true;
}

int64_t AccessTrace::non_model_peak(int64_t position, int64_t window) const {
  int64_t peak = 0;
  const int64_t end = std::min<int64_t>(size(), position + window);
  for (int64_t i = std::max<int64_t>(0, position); i < end; ++i) peak = std::max(peak, non_model_[i]);
  return peak;
}

std::vector<TensorId> AccessTrace::first_use_order(int64_t num_tensors) const {
  std::vector<char> seen(num_tensors, 0);
  std::vector<TensorId> order;
  for (TensorId t : tensors_) {
    if (t >= 0 && t < num_tensors && !seen[t]) {
      seen[t] = 1;
      order.push_back(t);
    }
  }
  return order;
}

MoveCount belady_moves(const AccessTrace& trace, const std::vector<int64_t>& chunk_bytes, int64_t budget_bytes,
                       const std::vector<char>& round_trips) {
  TORCH_CHECK(round_trips.empty() || round_trips.size() == chunk_bytes.size(), "ferry: belady_moves: ",
              round_trips.size(), " round-trip flags for ", chunk_bytes.size(), " chunks");
  // The position of each round-tripping chunk's last use in an iteration (-1: none or not used).
  std::vector<int64_t> last_use(chunk_bytes.size(), -1);
  if (!round_trips.empty()) {
    for (int64_t p = 0; p < trace.size(); ++p) {
      const ChunkId c = trace.chunk_at(p);
      if (round_trips[c]) last_use[c] = p;
    }
  }
  // Two iterations back to back; the second one's moves are the steady-state count.
  AccessTrace indexed;
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t p = 0; p < trace.size(); ++p) indexed.record(trace.tensor_at(p), trace.chunk_at(p), 0);
  }
  indexed.finalize(static_cast<int64_t>(chunk_bytes.size()));
  MoveCount count, first_pass;
  std::set<ChunkId> resident;
  int64_t used = 0;
  for (int64_t p = 0; p < indexed.size(); ++p) {
    if (p == trace.size()) first_pass = count;
    const ChunkId c = indexed.chunk_at(p);
    const bool leaves = last_use[c] == p % trace.size();  // its last use in this iteration: it goes now
    if (resident.count(c)) {
      if (leaves) {
        resident.erase(c);
        used -= chunk_bytes[c];
        count.d2h_bytes += chunk_bytes[c];
      }
      continue;
    }
    const int64_t need = chunk_bytes[c];
    while (budget_bytes > 0 && used + need > budget_bytes && !resident.empty()) {
      ChunkId victim = -1;
      int64_t furthest = -1;
      for (ChunkId r : resident) {
        const int64_t next = indexed.next_use(r, p);
        if (next > furthest) {
          furthest = next;
          victim = r;
        }
      }
      resident.erase(victim);
      used -= chunk_bytes[victim];
      count.d2h_bytes += chunk_bytes[victim];
    }
    count.h2d_bytes += need;
    if (leaves) {  // in for one use only
      count.d2h_bytes += need;
      continue;
    }
    resident.insert(c);
    used += need;
  }
  return MoveCount{count.h2d_bytes - first_pass.h2d_bytes, count.d2h_bytes - first_pass.d2h_bytes};
}

}  // namespace ferry
