#include "access_trace.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <set>

namespace ferry {

void AccessTrace::record(TensorId tensor, ChunkId chunk, int64_t non_model_bytes,
                         const std::vector<TensorId>& in_use) {
  tensors_.push_back(tensor);
  chunks_.push_back(chunk);
  non_model_.push_back(non_model_bytes);
  in_use_begin_.push_back(static_cast<int64_t>(in_use_.size()));
  // The other tensors in use: `tensor` itself, in the list when in use twice at once, is not beside itself.
  for (TensorId t : in_use) {
    if (t != tensor) in_use_.push_back(t);
  }
}

std::vector<TensorId> AccessTrace::in_use_at(int64_t position) const {
  const int64_t end = position + 1 < size() ? in_use_begin_[position + 1] : static_cast<int64_t>(in_use_.size());
  return std::vector<TensorId>(in_use_.begin() + in_use_begin_[position], in_use_.begin() + end);
}

void AccessTrace::clear() {
  tensors_.clear();
  chunks_.clear();
  non_model_.clear();
  in_use_begin_.clear();
  in_use_.clear();
  pinned_begin_.clear();
  pinned_.clear();
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
  // Pinned chunks: the tensors in use, by the chunk the trace has them in.
  std::vector<ChunkId> chunk_of_tensor;
  for (int64_t i = 0; i < n; ++i) {
    const TensorId t = tensors_[i];
    if (t >= static_cast<TensorId>(chunk_of_tensor.size())) chunk_of_tensor.resize(t + 1, -1);
    chunk_of_tensor[t] = chunks_[i];
  }
  pinned_begin_.assign(1, 0);
  pinned_.clear();
  for (int64_t i = 0; i < n; ++i) {
    const auto first = static_cast<std::ptrdiff_t>(pinned_.size());
    for (TensorId t : in_use_at(i)) {
      const ChunkId c = t >= 0 && t < static_cast<TensorId>(chunk_of_tensor.size()) ? chunk_of_tensor[t] : -1;
      if (c < 0 || c == chunks_[i] || std::find(pinned_.begin() + first, pinned_.end(), c) != pinned_.end()) continue;
      pinned_.push_back(c);
    }
    pinned_begin_.push_back(static_cast<int64_t>(pinned_.size()));
  }
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
  const int64_t n = trace.size();
  if (n == 0) return {};
  // Indexed for next uses and pins (the trace given need not be finalized); next uses run on into the
  // next iteration: the trace repeats.
  AccessTrace indexed;
  for (int64_t p = 0; p < n; ++p) indexed.record(trace.tensor_at(p), trace.chunk_at(p), 0, trace.in_use_at(p));
  indexed.finalize(static_cast<int64_t>(chunk_bytes.size()));
  // The round-tripping chunks that leave after each position: after the last one they are used or
  // pinned at in an iteration.
  std::vector<int64_t> last_need(chunk_bytes.size(), -1);
  if (!round_trips.empty()) {
    for (int64_t p = 0; p < n; ++p) {
      if (round_trips[indexed.chunk_at(p)]) last_need[indexed.chunk_at(p)] = p;
      for (ChunkId c : indexed.pinned_at(p)) {
        if (round_trips[c]) last_need[c] = p;
      }
    }
  }
  std::vector<std::vector<ChunkId>> leaving(n);
  for (ChunkId c = 0; c < static_cast<ChunkId>(last_need.size()); ++c) {
    if (last_need[c] >= 0) leaving[last_need[c]].push_back(c);
  }
  // One iteration from `resident`.
  std::set<ChunkId> resident;
  int64_t used = 0;
  auto iteration = [&] {
    MoveCount count;
    for (int64_t p = 0; p < n; ++p) {
      const ChunkId c = indexed.chunk_at(p);
      if (!resident.count(c)) {
        const int64_t need = chunk_bytes[c];
        const AccessTrace::ChunkRange pinned = indexed.pinned_at(p);
        while (budget_bytes > 0 && used + need > budget_bytes) {
          ChunkId victim = -1;
          int64_t furthest = -1;
          for (ChunkId r : resident) {
            if (std::find(pinned.begin(), pinned.end(), r) != pinned.end()) continue;
            const int64_t next = indexed.next_use(r, p);
            if (next > furthest) {
              furthest = next;
              victim = r;
            }
          }
          if (victim < 0) break;  // all pinned: over the budget, as no schedule could avoid
          resident.erase(victim);
          used -= chunk_bytes[victim];
          count.d2h_bytes += chunk_bytes[victim];
        }
        count.h2d_bytes += need;
        resident.insert(c);
        used += need;
      }
      for (ChunkId x : leaving[p]) {  // its last use or pin in this iteration: it goes now
        if (resident.erase(x) == 0) continue;
        used -= chunk_bytes[x];
        count.d2h_bytes += chunk_bytes[x];
      }
    }
    return count;
  };
  // Belady's choices depend only on what is resident when an iteration begins, so from an empty device
  // those sets run into a cycle; its mean moves per iteration are the long-run count. (The count of the
  // second iteration alone, used before 2026-12-03, is off where the cycle is longer than one
  // iteration: 4 chunks used in turn with room for 2 move 8 of every 12 uses, 2.67 per iteration, where
  // the second iteration moves 2 and the third 3.)
  std::map<std::vector<ChunkId>, int> seen;  // resident set at an iteration's start -> that iteration
  std::vector<MoveCount> cumulative{MoveCount{}};
  int first = 1, last = kBeladyIterations;  // the mean is over iterations [first, last)
  for (int k = 0; k < kBeladyIterations; ++k) {
    const auto [at, fresh] = seen.emplace(std::vector<ChunkId>(resident.begin(), resident.end()), k);
    if (!fresh) {
      first = at->second;
      last = k;
      break;
    }
    const MoveCount m = iteration();
    cumulative.push_back({cumulative.back().h2d_bytes + m.h2d_bytes, cumulative.back().d2h_bytes + m.d2h_bytes});
  }
  const int64_t iterations = last - first;
  auto mean = [&](int64_t total) { return (total + iterations / 2) / iterations; };  // to the byte
  return MoveCount{mean(cumulative[last].h2d_bytes - cumulative[first].h2d_bytes),
                   mean(cumulative[last].d2h_bytes - cumulative[first].d2h_bytes)};
}

}  // namespace ferry
