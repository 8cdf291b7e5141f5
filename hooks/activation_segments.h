#pragma once
// ActivationSegments: a ChunkedModel's ferry::checkpoint segments as the memory plan's candidates
// (scheduler/memory_plan.h), and what each one does in the next forward. Segments are numbered by
// their order in a forward (top-level calls only: a segment inside another follows it). Under
// Config::activations
//  - recompute: every segment recomputes in backward (torch.utils.checkpoint's behaviour);
//  - keep: every segment runs as if not checkpointed (autograd keeps its activations);
//  - auto: segments recompute, and each recompute is measured (the bytes the recompute's graph holds,
//    from the device's allocated-bytes count; its time, the device synchronised around it), until a
//    plan is applied (apply()); then the kept ones run as under keep. A segment whose inputs grow past
//    what it was planned for recomputes again at once, and the plan is made again from new measurements
//    (re-plan wanted); inputs that shrink below half of it also re-plan, but keep the plan meanwhile
//    (hysteresis: a sequence length that alternates does not flip the plan every step).
// Results do not depend on the choice: a kept segment computes what its recompute would, with the
// same random draws and autocast state (hooks/checkpoint.h), so keep, recompute and auto give the same
// values bit for bit (tests/hooks/test_activation_segments.cpp).
//
// Contract: next() on the forward's thread (found through the Scope the model opens around forward);
// measured() from autograd's threads; the rest between iterations.
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "../common/config.h"
#include "../common/event_trace.h"
#include "../scheduler/memory_plan.h"

namespace ferry {

class ActivationSegments {
 public:
  // How a recompute is measured: the device's allocated bytes (-1: cannot tell) and a wait for its work.
  struct Probe {
    std::function<int64_t()> allocated_bytes;
    std::function<void()> synchronize;
  };
  ActivationSegments(ActivationPolicy policy, Probe probe);
  ActivationSegments(const ActivationSegments&) = delete;
  ActivationSegments& operator=(const ActivationSegments&) = delete;

  ActivationPolicy policy() const { return policy_; }

  // What checkpoint() does with one segment.
  struct Ticket {
    ActivationSegments* segments = nullptr;  // null: not a candidate (no model, nested): recompute, unmeasured
    int64_t index = -1;
    bool keep = false;
    bool measure = false;
  };
  // The model's forward runs on this thread while a Scope is alive: checkpoint() asks ticket().
  class Scope {
   public:
    explicit Scope(ActivationSegments* segments);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    ActivationSegments* outer_;
  };
  // The ticket of the next top-level segment of this thread's forward (`input_numel`: its inputs'
  // elements, for the shape check); a default Ticket outside a Scope or inside another segment.
  static Ticket ticket(int64_t input_numel);
  // Marks this thread as running inside a segment (its fn, first run or recompute): nested calls get
  // no ticket.
  class Inside {
   public:
    Inside();
    ~Inside();
    Inside(const Inside&) = delete;
    Inside& operator=(const Inside&) = delete;
  };

  // A forward begins (segment numbering starts over).
  void begin_forward();
  // Runs `fn` (a recompute) measured for segment `index` when `measure`: bytes its graph holds beyond
  // `output_bytes`, and its time.
  template <class F>
  auto run_measured(bool measure, int64_t index, F&& fn) -> decltype(fn());

  // The candidates of the last forward with their measured costs (unmeasured: saved_bytes -1).
  std::vector<SegmentCost> costs() const;
  int64_t count() const;
  // auto: whether a plan is wanted (a forward and backward measured every segment seen, and no plan
  // applies, or the shapes asked for one again).
  bool plan_wanted() const;
  // Applies a plan made from costs() (between iterations); returns whether any segment's behaviour
  // changed. `input` is what it was made from (for the report).
  bool apply(const MemoryPlan& plan, const MemoryPlanInput& input);
  const std::vector<char>& keep() const { return keep_; }
  // The plan that applies and its input (plans() == 0: none yet).
  const MemoryPlan& plan() const { return plan_; }
  const MemoryPlanInput& plan_input() const { return plan_input_; }
  int64_t plans() const { return plans_; }
  // How many applied plans changed what some segment does (a kept segment makes no recompute uses in
  // backward: whoever counts the parameters' uses in backward must learn them again).
  int64_t changes() const { return changes_; }
  // The plan as a table, one line per run of segments with the same decision: what is kept and
  // recomputed, the bytes and seconds, the state groups on the device, the predicted step.
  std::string table() const;
  int64_t replans() const { return replans_; }

 private:
  Ticket next(int64_t input_numel);
  void measured(int64_t index, int64_t saved_bytes, double seconds);
  int64_t allocated() const { return probe_.allocated_bytes ? probe_.allocated_bytes() : -1; }
  void synchronize() const {
    if (probe_.synchronize) probe_.synchronize();
  }

  const ActivationPolicy policy_;
  const Probe probe_;
  mutable std::mutex mutex_;            // costs_ (measured from autograd's threads)
  int64_t next_ = 0;                    // forward thread: the next segment's index
  std::vector<SegmentCost> costs_;      // per index: the last measurement
  std::vector<int64_t> input_numel_;    // per index: the inputs' elements the last forward saw
  std::vector<int64_t> planned_numel_;  // per index: what the plan was made for
  std::vector<char> keep_;              // per index: the plan (empty: none applies)
  MemoryPlan plan_;
  MemoryPlanInput plan_input_;
  int64_t plans_ = 0;
  int64_t changes_ = 0;
  bool replan_ = false;
  int64_t replans_ = 0;
};

template <class F>
auto ActivationSegments::run_measured(bool measure, int64_t index, F&& fn) -> decltype(fn()) {
  if (!measure) return fn();
  synchronize();
  const int64_t before = allocated();
  const int64_t start = trace::now_ns();
  auto out = fn();
  synchronize();
  const double seconds = static_cast<double>(trace::now_ns() - start) * 1e-9;
  const int64_t after = allocated();
  int64_t output_bytes = 0;
  for (const auto& t : out) {
    if (t.defined()) output_bytes += static_cast<int64_t>(t.nbytes());
  }
  measured(index, before < 0 || after < 0 ? -1 : std::max<int64_t>(0, after - before - output_bytes), seconds);
  return out;
}

}  // namespace ferry
