#include "chunk_finality.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace ferry::optim {
namespace {

// Note [Expectations only grow]: `seen` merged into `expected` by maximum (or taken whole, the first time).
void grow(std::vector<int64_t>& expected, const std::vector<int64_t>& seen) {
  if (expected.size() != seen.size()) {
    expected = seen;
    return;
  }
  for (size_t i = 0; i < seen.size(); ++i) expected[i] = std::max(expected[i], seen[i]);
}

}  // namespace

void ChunkFinality::follow_layout(int64_t num_params) {
  landings_.resize(num_params, 0);
  uses_.resize(num_params, 0);
  expected_uses_.resize(num_params, 0);
}

void ChunkFinality::begin(const ChunkLayout& layout, bool count_down, bool sized) {
  const int64_t n = layout.num_chunks();
  std::fill(landings_.begin(), landings_.end(), 0);
  if (sized && expected_.size() != landings_.size()) expected_.assign(landings_.size(), 0);
  remaining_.assign(n, 0);
  if (!count_down) return;
  remaining_ = final_counts(layout);
  for (int64_t c = 0; c < n; ++c) {
    if (remaining_[c] == 0) remaining_[c] = -1;  // expects nothing: never reaches 0 by counting down
  }
}

std::vector<int64_t> ChunkFinality::final_counts(const ChunkLayout& layout) const {
  const int64_t n = layout.num_chunks();
  const auto& slots = layout.slots();
  std::vector<int64_t> counts(n, 0), uses(n, 0);
  for (size_t p = 0; p < landings_.size(); ++p) {
    counts[slots[p].chunk] += expected(static_cast<int64_t>(p));
    uses[slots[p].chunk] += std::max<int64_t>(0, expected_uses_[p] - uses_[p]);
  }
  for (int64_t c = 0; c < n; ++c) {
    if (counts[c] > 0) counts[c] += uses[c];
  }
  return counts;
}

bool ChunkFinality::final_after_landing(int64_t param, int64_t chunk) {
  return landings_[param] <= expected(param) && --remaining_[chunk] == 0;
}

bool ChunkFinality::use(int64_t param, int64_t chunk, bool counting) {
  if (++uses_[param] > expected_uses_[param] || !counting) return false;
  return remaining_[chunk] > 0 && --remaining_[chunk] == 0;
}

void ChunkFinality::end_uses() {
  grow(expected_uses_, uses_);
  std::fill(uses_.begin(), uses_.end(), 0);
}

void ChunkFinality::learn_landings(bool complete) {
  if (!complete && expected_.size() != landings_.size()) return;
  grow(expected_, landings_);
}

int64_t ChunkFinality::expect(int64_t param, int64_t landings) {
  // A late landing is one a counting backward did not expect: counting needs expectations.
  TORCH_INTERNAL_ASSERT(param < static_cast<int64_t>(expected_.size()), "an expectation for parameter ", param,
                        " before any backward set them");
  const int64_t saw = expected_[param];
  expected_[param] = std::max(saw, landings);
  return saw;
}

void ChunkFinality::forget() {
  expected_.clear();
  std::fill(expected_uses_.begin(), expected_uses_.end(), 0);
}

}  // namespace ferry::optim
