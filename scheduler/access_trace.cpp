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

namespace {

// Belady's schedule over one iteration of a trace, from whatever is resident when it begins: the
// moves of belady_moves (repeated) and belady_moves_from (once) alike. Next uses run on into the next
// iteration (the trace repeats); over a sequence not repeated that only orders the chunks it does not
// use again, and any of those is as good a victim as another.
class BeladyPass {
 public:
  BeladyPass(const AccessTrace& trace, const std::vector<int64_t>& chunk_bytes, int64_t budget_bytes,
             const std::vector<char>& round_trips)
      : bytes_(chunk_bytes), budget_(budget_bytes), leaving_(trace.size()) {
    TORCH_CHECK(round_trips.empty() || round_trips.size() == chunk_bytes.size(), "ferry: belady_moves: ",
                round_trips.size(), " round-trip flags for ", chunk_bytes.size(), " chunks");
    // Indexed for next uses and pins (the trace given need not be finalized).
    const int64_t n = trace.size();
    for (int64_t p = 0; p < n; ++p) {
      const ChunkId c = trace.chunk_at(p);
      TORCH_CHECK(c >= 0 && c < static_cast<ChunkId>(chunk_bytes.size()), "ferry: belady_moves: position ", p,
                  " uses chunk ", c, ", expected one of the ", chunk_bytes.size(), " chunks");
      indexed_.record(trace.tensor_at(p), c, 0, trace.in_use_at(p));
    }
    indexed_.finalize(static_cast<int64_t>(chunk_bytes.size()));
    // The round-tripping chunks leave after the last position they are used or pinned at in an iteration.
    if (round_trips.empty()) return;
    std::vector<int64_t> last_need(chunk_bytes.size(), -1);
    for (int64_t p = 0; p < n; ++p) {
      if (round_trips[indexed_.chunk_at(p)]) last_need[indexed_.chunk_at(p)] = p;
      for (ChunkId c : indexed_.pinned_at(p)) {
        if (round_trips[c]) last_need[c] = p;
      }
    }
    for (ChunkId c = 0; c < static_cast<ChunkId>(last_need.size()); ++c) {
      if (last_need[c] >= 0) leaving_[last_need[c]].push_back(c);
    }
  }

  void make_resident(ChunkId c) {
    TORCH_CHECK(c >= 0 && c < static_cast<ChunkId>(bytes_.size()), "ferry: belady_moves_from: resident chunk ", c,
                ", expected one of the ", bytes_.size(), " chunks");
    if (resident_.insert(c).second) used_ += bytes_[c];
  }
  std::vector<ChunkId> resident() const { return {resident_.begin(), resident_.end()}; }

  // One iteration from the chunks resident now.
  MoveCount run() {
    MoveCount count;
    for (int64_t p = 0; p < indexed_.size(); ++p) {
      const ChunkId c = indexed_.chunk_at(p);
      if (!resident_.count(c)) {
        const int64_t need = bytes_[c];
        const AccessTrace::ChunkRange pinned = indexed_.pinned_at(p);
        while (budget_ > 0 && used_ + need > budget_) {
          ChunkId victim = -1;
          int64_t furthest = -1;
          for (ChunkId r : resident_) {
            if (std::find(pinned.begin(), pinned.end(), r) != pinned.end()) continue;
            const int64_t next = indexed_.next_use(r, p);
            if (next > furthest) {
              furthest = next;
              victim = r;
            }
          }
          if (victim < 0) break;  // all pinned: over the budget, as no schedule could avoid
          resident_.erase(victim);
          used_ -= bytes_[victim];
          count.d2h_bytes += bytes_[victim];
        }
        count.h2d_bytes += need;
        resident_.insert(c);
        used_ += need;
      }
      for (ChunkId x : leaving_[p]) {  // its last use or pin in this iteration: it goes now
        if (resident_.erase(x) == 0) continue;
        used_ -= bytes_[x];
        count.d2h_bytes += bytes_[x];
      }
    }
    return count;
  }

 private:
  const std::vector<int64_t>& bytes_;
  int64_t budget_;
  AccessTrace indexed_;
  std::vector<std::vector<ChunkId>> leaving_;  // per position: the round trips that leave after it
  std::set<ChunkId> resident_;
  int64_t used_ = 0;
};

}  // namespace

MoveCount belady_moves(const AccessTrace& trace, const std::vector<int64_t>& chunk_bytes, int64_t budget_bytes,
                       const std::vector<char>& round_trips) {
  if (trace.size() == 0) return {};
  BeladyPass pass(trace, chunk_bytes, budget_bytes, round_trips);
  // Belady's choices depend only on what is resident when an iteration begins, so from an empty device
  // those sets run into a cycle; its mean moves per iteration are the long-run count. (The count of the
  // second iteration alone, used before 2026-12-03, is off where the cycle is longer than one
  // iteration: 4 chunks used in turn with room for 2 move 8 of every 12 uses, 2.67 per iteration, where
  // the second iteration moves 2 and the third 3.)
  std::map<std::vector<ChunkId>, int> seen;  // resident set at an iteration's start -> that iteration
  std::vector<MoveCount> cumulative{MoveCount{}};
  int first = 1, last = kBeladyIterations;  // the mean is over iterations [first, last)
  for (int k = 0; k < kBeladyIterations; ++k) {
    const auto [at, fresh] = seen.emplace(pass.resident(), k);
    if (!fresh) {
      first = at->second;
      last = k;
      break;
    }
    const MoveCount m = pass.run();
    cumulative.push_back({cumulative.back().h2d_bytes + m.h2d_bytes, cumulative.back().d2h_bytes + m.d2h_bytes});
  }
  const int64_t iterations = last - first;
  auto mean = [&](int64_t total) { return (total + iterations / 2) / iterations; };  // to the byte
  return MoveCount{mean(cumulative[last].h2d_bytes - cumulative[first].h2d_bytes),
                   mean(cumulative[last].d2h_bytes - cumulative[first].d2h_bytes)};
}

MoveCount belady_moves_from(const AccessTrace& uses, const std::vector<int64_t>& chunk_bytes, int64_t budget_bytes,
                            const std::vector<ChunkId>& resident, const std::vector<char>& round_trips) {
  BeladyPass pass(uses, chunk_bytes, budget_bytes, round_trips);
  for (ChunkId c : resident) pass.make_resident(c);
  return pass.run();
}

}  // namespace ferry
