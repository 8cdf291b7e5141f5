#include "activation_segments.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <iomanip>
#include <sstream>

#include "../common/logging.h"

namespace ferry {
namespace {

thread_local ActivationSegments* current_segments = nullptr;
thread_local int inside_segment = 0;

}  // namespace

ActivationSegments::ActivationSegments(ActivationPolicy policy, Probe probe)
    : policy_(policy), probe_(std::move(probe)) {}

ActivationSegments::Scope::Scope(ActivationSegments* segments) : outer_(current_segments) {
  current_segments = segments;
}
ActivationSegments::Scope::~Scope() { current_segments = outer_; }

ActivationSegments::Inside::Inside() { ++inside_segment; }
ActivationSegments::Inside::~Inside() { --inside_segment; }

ActivationSegments::Ticket ActivationSegments::ticket(int64_t input_numel) {
  if (current_segments == nullptr || inside_segment > 0) return {};
  return current_segments->next(input_numel);
}

void ActivationSegments::begin_forward() { next_ = 0; }

ActivationSegments::Ticket ActivationSegments::next(int64_t input_numel) {
  const int64_t index = next_++;
  const std::lock_guard<std::mutex> lock(mutex_);
  if (static_cast<int64_t>(costs_.size()) <= index) {
    costs_.resize(static_cast<size_t>(index) + 1);
    input_numel_.resize(static_cast<size_t>(index) + 1, 0);
  }
  input_numel_[static_cast<size_t>(index)] = input_numel;
  Ticket t{this, index, false, false};
  switch (policy_) {
    case ActivationPolicy::kRecompute: return t;
    case ActivationPolicy::kKeep: t.keep = true; return t;
    case ActivationPolicy::kAuto: break;
  }
  const bool planned = index < static_cast<int64_t>(keep_.size());
  if (planned) {
    const int64_t was = planned_numel_[static_cast<size_t>(index)];
    if (input_numel > was) {  // grew: what was kept may no longer fit; recompute until the next plan
      if (!replan_) {
        log::info("ferry: activation plan: segment ", index, "'s inputs grew from ", was, " to ", input_numel,
                  " elements; recomputing every segment and planning again");
      }
      replan_ = true;
      keep_.clear();
    } else if (2 * input_numel < was) {
      replan_ = true;  // hysteresis: the plan stays safe meanwhile
    }
  }
  if (index < static_cast<int64_t>(keep_.size()) && keep_[static_cast<size_t>(index)] != 0) {
    t.keep = true;
  } else {
    t.measure = keep_.empty() || replan_;
  }
  return t;
}

void ActivationSegments::measured(int64_t index, int64_t saved_bytes, double seconds) {
  const std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(index >= 0 && index < static_cast<int64_t>(costs_.size()), "a measurement for segment ",
                        index, " of ", costs_.size());
  costs_[static_cast<size_t>(index)] = SegmentCost{saved_bytes, seconds};
}

std::vector<SegmentCost> ActivationSegments::costs() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return std::vector<SegmentCost>(costs_.begin(), costs_.begin() + next_);
}

int64_t ActivationSegments::count() const { return next_; }

bool ActivationSegments::plan_wanted() const {
  if (policy_ != ActivationPolicy::kAuto || next_ == 0) return false;
  if (!keep_.empty() && !replan_) return false;
  const std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t k = 0; k < next_; ++k) {  // every segment of the last forward measured in its backward
    if (costs_[static_cast<size_t>(k)].saved_bytes < 0) return false;
  }
  return true;
}

bool ActivationSegments::apply(const MemoryPlan& plan, const MemoryPlanInput& input) {
  const std::vector<char>& keep = plan.keep;
  TORCH_CHECK(policy_ == ActivationPolicy::kAuto, "ferry: an activation plan applies under activations=auto only; "
              "this model's policy is ", to_string(policy_));
  TORCH_CHECK(static_cast<int64_t>(keep.size()) == next_, "ferry: an activation plan of ", keep.size(),
              " decisions for ", next_, " segments");
  bool changed = false;  // what a segment does: no plan (keep_ empty) recomputes every one
  for (size_t k = 0; k < keep.size(); ++k) changed = changed || keep[k] != (k < keep_.size() ? keep_[k] : 0);
  keep_ = keep;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    planned_numel_.assign(input_numel_.begin(), input_numel_.begin() + next_);
  }
  if (replan_) ++replans_;
  replan_ = false;
  plan_ = plan;
  plan_input_ = input;
  ++plans_;
  if (changed) ++changes_;
  return changed;
}

std::string ActivationSegments::table() const {
  std::ostringstream os;
  if (plans_ == 0) return "no activation plan yet";
  os << "activation plan (" << plan_.solver() << "), " << plan_.kept() << " of " << plan_.keep.size()
     << " segments kept:\n  segments   | decision  | saved activations | recompute\n";
  const std::vector<SegmentCost>& c = plan_input_.segments;
  for (size_t b = 0; b < plan_.keep.size();) {  // runs of one decision
    size_t e = b;
    int64_t bytes = 0;
    double secs = 0;
    for (; e < plan_.keep.size() && plan_.keep[e] == plan_.keep[b]; ++e) {
      bytes += std::max<int64_t>(c[e].saved_bytes, 0);
      secs += c[e].recompute_s;
    }
    os << "  " << std::setw(4) << b << "-" << std::setw(4) << std::left << e - 1 << std::right << "  | "
       << (plan_.keep[b] != 0 ? "kept     " : "recompute") << " | " << std::setw(17) << format_bytes(bytes) << " | "
       << std::fixed << std::setprecision(4) << secs << " s\n";
    b = e;
  }
  os << "  room " << (plan_input_.room_bytes < 0 ? std::string("unlimited") : format_bytes(plan_input_.room_bytes))
     << ", kept " << format_bytes(plan_.kept_bytes) << ", state groups on the device " << plan_.groups_on_device
     << " (" << format_bytes(plan_.state_device_bytes) << ")\n"
     << "  predicted step " << std::setprecision(4) << plan_.predicted_step_s << " s (forward "
     << plan_input_.forward_s << " s + backward " << plan_input_.backward_s << " s with every recompute, "
     << plan_.recompute_s << " s of recompute left";
  if (!plan_input_.groups.empty()) os << ", " << plan_.host_wait_s << " s waiting for host updates";
  os << ")";
  return os.str();
}

}  // namespace ferry
