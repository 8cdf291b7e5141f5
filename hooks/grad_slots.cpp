// GradSlots (see grad_slots.h).
#include "grad_slots.h"

#include <algorithm>

namespace ferry {

int64_t GradSlots::first() const {
  if (count_ == 0) return -1;
  return std::find(in_slot_.begin(), in_slot_.end(), 1) - in_slot_.begin();
}

bool GradSlots::mark(int64_t p) {
  if (in_slot_[p]) return false;
  in_slot_[p] = 1;
  ++count_;
  return true;
}

void GradSlots::clear(int64_t p) {
  if (!in_slot_[p]) return;
  in_slot_[p] = 0;
  --count_;
}

void GradSlots::clear_all() {
  std::fill(in_slot_.begin(), in_slot_.end(), 0);
  count_ = 0;
}

void GradSlots::remember_trainable(const std::vector<at::Tensor>& params) {
  trainable_.resize(params.size());
  for (size_t p = 0; p < params.size(); ++p) trainable_[p] = params[p].requires_grad();
}

GradSlots::Changed GradSlots::trainable_changed(const std::vector<at::Tensor>& params) {
  Changed changed;
  for (size_t p = 0; p < params.size(); ++p) {
    const char now = params[p].requires_grad();
    if (now == trainable_[p]) continue;
    trainable_[p] = now;
    if (changed.count++ == 0) changed.first = static_cast<int64_t>(p);
  }
  return changed;
}

}  // namespace ferry
