// TraceAlignment (see trace_alignment.h; Note [A run that departs from its trace]).
#include "trace_alignment.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace ferry {

TraceAlignment::TraceAlignment(const AccessTrace& trace)
    : trace_(&trace), used_(static_cast<size_t>(trace.size()), 0) {}

std::pair<std::vector<int64_t>::const_iterator, std::vector<int64_t>::const_iterator> TraceAlignment::positions_of(
    TensorId param) {
  if (by_param_.empty()) {  // at the first departure or hint: an iteration that follows exactly never sorts
    const AccessTrace& trace = *trace_;
    by_param_.resize(static_cast<size_t>(trace.size()));
    for (int64_t q = 0; q < trace.size(); ++q) by_param_[q] = q;
    std::sort(by_param_.begin(), by_param_.end(), [&](int64_t a, int64_t b) {
      return trace.tensor_at(a) != trace.tensor_at(b) ? trace.tensor_at(a) < trace.tensor_at(b) : a < b;
    });
  }
  const auto first = std::lower_bound(by_param_.cbegin(), by_param_.cend(), param,
                                      [&](int64_t q, TensorId p) { return trace_->tensor_at(q) < p; });
  const auto last = std::upper_bound(first, by_param_.cend(), param,
                                     [&](TensorId p, int64_t q) { return p < trace_->tensor_at(q); });
  return {first, last};
}

int64_t TraceAlignment::find_nearest(TensorId param) {
  // The parameter's positions, ascending: those at or after the cursor are ahead, the others behind.
  const auto [first, last] = positions_of(param);
  const auto split = std::lower_bound(first, last, cursor_);
  // Each side walks past at most kWalk positions used already (a parameter used many times, one loop
  // iteration after another): the search stays O(log n + kWalk) per departing use.
  int64_t ahead = -1, behind = -1;
  for (auto it = split; it != last && it - split < kWalk; ++it) {
    if (!used_[*it]) {
      ahead = *it;
      break;
    }
  }
  for (auto it = split; it != first && split - it < kWalk;) {
    --it;
    if (!used_[*it]) {
      behind = *it;
      break;
    }
  }
  if (ahead < 0) return behind;
  if (behind < 0) return ahead;
  // Ahead at equal distance: a branch not taken (a skip) is the common departure.
  return ahead - cursor_ <= cursor_ - behind ? ahead : behind;
}

void TraceAlignment::take(int64_t position) {
  if (!hinted_at_.empty() && hinted_at_[position]) ++hints_broken_;
  used_[position] = 1;
  ++matched_;
  cursor_ = position + 1;
}

std::shared_ptr<const std::vector<char>> TraceAlignment::begin_backward() {
  in_backward_ = true;
  const int64_t n = trace_->size();
  // A forward that used exactly the trace's forward positions departed in nothing: its backward is the
  // trace's.
  if (unforeseen_.empty() && matched_ == cursor_ && cursor_ == trace_->backward_start()) {
    passed_over_.reset();  // a hint forward proved wrong
    return nullptr;
  }
  TensorId largest = -1;
  for (TensorId t : trace_->tensors()) largest = std::max(largest, t);
  for (const Unforeseen& u : unforeseen_) largest = std::max(largest, u.param);
  std::vector<char> used_before(static_cast<size_t>(largest + 1), 0);
  for (int64_t q = 0; q < n; ++q) {
    if (used_[q]) used_before[trace_->tensor_at(q)] = 1;
  }
  for (const Unforeseen& u : unforeseen_) used_before[u.param] = 1;
  std::shared_ptr<std::vector<char>> passed_over;
  for (int64_t q = trace_->backward_start(); q < n; ++q) {
    if (used_[q] || used_before[trace_->tensor_at(q)]) continue;
    if (!passed_over) passed_over = std::make_shared<std::vector<char>>(static_cast<size_t>(n), 0);
    (*passed_over)[q] = 1;
  }
  passed_over_ = std::move(passed_over);
  return passed_over_;
}

std::shared_ptr<const std::vector<char>> TraceAlignment::pass_over(const std::vector<TensorId>& params) {
  if (in_backward_) return passed_over_;
  const auto n = static_cast<size_t>(trace_->size());
  std::shared_ptr<std::vector<char>> over;  // copied on the first position added: the policy holds the old one
  for (TensorId param : params) {
    const auto [first, last] = positions_of(param);
    // Used already in this iteration (matched, or unforeseen): its backward comes.
    if (std::any_of(first, last, [&](int64_t q) { return used_[q] != 0; }) ||
        std::any_of(unforeseen_.begin(), unforeseen_.end(), [&](const Unforeseen& u) { return u.param == param; })) {
      continue;
    }
    for (auto it = first; it != last; ++it) {
      const int64_t q = *it;
      if (over ? (*over)[q] != 0 : passed_over_ && (*passed_over_)[q] != 0) continue;  // said before
      if (!over) {
        over = passed_over_ ? std::make_shared<std::vector<char>>(*passed_over_)
                            : std::make_shared<std::vector<char>>(n, 0);
      }
      if (hinted_at_.empty()) hinted_at_.assign(n, 0);
      (*over)[q] = 1;
      hinted_at_[q] = 1;
      ++hinted_;
    }
  }
  if (over) passed_over_ = std::move(over);
  return passed_over_;
}

int64_t TraceAlignment::align(TensorId param, ChunkId chunk, const std::vector<TensorId>& in_use) {
  if (cursor_ < trace_->size() && trace_->tensor_at(cursor_) == param && !used_[cursor_]) {
    const int64_t at = cursor_;
    take(at);
    return at;
  }
  const int64_t at = find_nearest(param);
  if (at >= 0) {
    take(at);
    return at;
  }
  unforeseen_.push_back(Unforeseen{cursor_, param, chunk, in_backward_, in_use});
  const auto [first, last] = positions_of(param);
  if (first == last) ++unforeseen_absent_;  // a parameter the trace never had
  return -1;
}

TraceAlignment::Merged TraceAlignment::merged_trace(const std::vector<char>& keep) const {
  const int64_t n = trace_->size();
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(keep.size()) == n, "keep has ", keep.size(), " entries for ", n,
                        " positions");
  // Unforeseen uses by the position they came before; those at one position in the order they came.
  std::vector<Unforeseen> inserts = unforeseen_;
  std::stable_sort(inserts.begin(), inserts.end(),
                   [](const Unforeseen& a, const Unforeseen& b) { return a.before < b.before; });
  auto neighbours_non_model = [&](int64_t before) {
    int64_t bytes = 0;
    if (before > 0) bytes = std::max(bytes, trace_->non_model_at(before - 1));
    if (before < n) bytes = std::max(bytes, trace_->non_model_at(before));
    return bytes;
  };
  Merged out;
  out.trace = std::make_shared<AccessTrace>();
  AccessTrace& t = *out.trace;
  const int64_t old_backward = trace_->backward_start();
  bool backward_marked = false;
  auto mark = [&](bool backward) {
    if (backward && !backward_marked) {
      t.mark_backward_start();
      backward_marked = true;
    }
  };
  size_t next = 0;
  for (int64_t q = 0; q <= n; ++q) {
    for (; next < inserts.size() && inserts[next].before == q; ++next) {
      const Unforeseen& u = inserts[next];
      mark(u.backward);
      t.record(u.param, u.chunk, neighbours_non_model(q), u.in_use);
      out.origin.push_back(-1);
    }
    if (q == n || !keep[q]) continue;
    mark(q >= old_backward);
    t.record(trace_->tensor_at(q), trace_->chunk_at(q), trace_->non_model_at(q), trace_->in_use_at(q));
    out.origin.push_back(q);
  }
  TORCH_INTERNAL_ASSERT(next == inserts.size(), "an unforeseen use was not merged");
  return out;
}

}  // namespace ferry
