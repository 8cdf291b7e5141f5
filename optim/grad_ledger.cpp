#include "grad_ledger.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace ferry::optim {

GradLedger::GradLedger(std::vector<int> group_of_param)
    : group_of_(std::move(group_of_param)), landed_(group_of_.size(), 0), lag_(group_of_.size(), 0) {}

void GradLedger::land(int64_t param) {
  landed_[param] = 1;
  any_ = true;
}

void GradLedger::clear() {
  std::fill(landed_.begin(), landed_.end(), 0);
  any_ = false;
}

void GradLedger::recount() {
  any_ = std::any_of(landed_.begin(), landed_.end(), [](char l) { return l != 0; });
}

void GradLedger::set_landed(int64_t param, bool landed) { landed_[param] = landed ? 1 : 0; }

std::vector<Span> GradLedger::spans(const ChunkLayout& layout, int64_t chunk, const std::vector<char>* only) const {
  std::vector<Span> out;
  bool open = false;  // the last slot seen landed and extends out.back()
  for (int64_t t : layout.chunks()[chunk].tensors) {
    const Slot& slot = layout.slots()[t];
    if (slot.numel == 0) continue;
    const bool wanted = only == nullptr || (t < static_cast<int64_t>(only->size()) && (*only)[t]);
    if (!landed_[t] || !wanted) {
      open = false;
      continue;
    }
    const int g = group_of_[t];
    if (open && out.back().group == g && out.back().lag == lag_[t]) {
      out.back().end = slot.offset + slot.numel;
    } else {
      out.push_back({g, slot.offset, slot.offset + slot.numel, lag_[t]});
    }
    open = true;
  }
  return out;
}

std::vector<Span> GradLedger::slot_ranges(const ChunkLayout& layout, int64_t chunk, bool want) const {
  std::vector<Span> out;
  for (int64_t t : layout.chunks()[chunk].tensors) {
    const Slot& slot = layout.slots()[t];
    if (slot.numel == 0 || static_cast<bool>(landed_[t]) != want) continue;
    if (!out.empty() && out.back().end == slot.offset) {
      out.back().end = slot.offset + slot.numel;
    } else {
      out.push_back({0, slot.offset, slot.offset + slot.numel});
    }
  }
  return out;
}

void GradLedger::set_lags(std::vector<int64_t> lags) {
  TORCH_INTERNAL_ASSERT(lags.size() == lag_.size(), "lags for ", lags.size(), " parameters, the model has ",
                        lag_.size());
  lag_ = std::move(lags);
}

void GradLedger::count_missed_steps(const ChunkLayout& layout, const std::function<bool(int64_t)>& owned,
                                    const std::vector<char>* updated_chunks, const std::vector<char>* late_updated,
                                    const std::vector<char>* late) {
  for (int64_t c = 0; c < layout.num_chunks(); ++c) {
    if (!owned(c)) continue;
    const bool updated = updated_chunks == nullptr || (*updated_chunks)[c] != 0;
    const bool late_part = late_updated != nullptr && !late_updated->empty() && (*late_updated)[c] != 0;
    for (int64_t t : layout.chunks()[c].tensors) {
      const bool is_late = late != nullptr && t < static_cast<int64_t>(late->size()) && (*late)[t];
      if (!landed_[t] || !(is_late ? late_part : updated)) ++lag_[t];
    }
  }
}

}  // namespace ferry::optim
