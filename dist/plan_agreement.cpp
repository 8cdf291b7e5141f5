#include "plan_agreement.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

namespace ferry::dist {

namespace {
constexpr int64_t kHead = 5;  // -room, forward, backward, not behind forward, segments
constexpr int64_t kPerSegment = 3;  // unmeasured, saved bytes, recompute seconds
}  // namespace

PlanVotes vote_on_plan(Communicator& comm, const PlanVote& mine) {
  TORCH_CHECK(mine.segments >= 0, "ferry: a plan vote with ", mine.segments, " segments");
  at::Tensor v = at::empty({4}, at::TensorOptions().dtype(at::kDouble));
  double* p = v.data_ptr<double>();
  p[0] = mine.ready ? 0 : 1;  // max: 0 only if every rank is ready
  p[1] = mine.wanted ? 1 : 0;
  p[2] = static_cast<double>(mine.segments);
  p[3] = -static_cast<double>(mine.segments);
  comm.all_reduce(v, ReduceOp::kMax);
  PlanVotes votes;
  votes.all_ready = p[0] == 0;
  votes.any_wanted = p[1] != 0;
  votes.max_segments = static_cast<int64_t>(p[2]);
  votes.min_segments = static_cast<int64_t>(-p[3]);
  return votes;
}

at::Tensor encode_for_max(const MemoryPlanInput& input) {
  TORCH_CHECK(input.groups.empty(), "ferry: the ranks agree on the activation plan's input without state groups; got ",
              input.groups.size());
  input.validate();
  const auto n = static_cast<int64_t>(input.segments.size());
  at::Tensor e = at::empty({kHead + kPerSegment * n}, at::TensorOptions().dtype(at::kDouble));
  double* p = e.data_ptr<double>();
  p[0] = input.room_bytes < 0 ? -std::numeric_limits<double>::infinity() : -static_cast<double>(input.room_bytes);
  p[1] = input.forward_s;
  p[2] = input.backward_s;
  p[3] = input.host_behind_forward ? 0 : 1;
  p[4] = static_cast<double>(n);
  for (int64_t k = 0; k < n; ++k) {
    const SegmentCost& s = input.segments[static_cast<size_t>(k)];
    double* q = p + kHead + kPerSegment * k;
    q[0] = s.saved_bytes < 0 ? 1 : 0;
    q[1] = static_cast<double>(std::max<int64_t>(s.saved_bytes, 0));
    q[2] = s.recompute_s;
  }
  return e;
}

MemoryPlanInput decode_max(const at::Tensor& encoded) {
  TORCH_CHECK(encoded.dtype() == at::kDouble && encoded.dim() == 1 && encoded.numel() >= kHead &&
                  (encoded.numel() - kHead) % kPerSegment == 0,
              "ferry: an encoded plan input is a 1-d double tensor of ", kHead, " + ", kPerSegment,
              " x segments numbers; got ", encoded.sizes(), " ", encoded.dtype());
  const at::Tensor e = encoded.cpu().contiguous();
  const double* p = e.data_ptr<double>();
  const int64_t n = (e.numel() - kHead) / kPerSegment;
  TORCH_CHECK(p[4] == static_cast<double>(n), "ferry: an encoded plan input says ", p[4], " segments and holds ", n);
  MemoryPlanInput input;
  input.room_bytes = p[0] == -std::numeric_limits<double>::infinity() ? -1 : static_cast<int64_t>(-p[0]);
  input.forward_s = p[1];
  input.host_behind_forward = p[3] == 0;
  double recompute = 0;
  input.segments.resize(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) {
    const double* q = p + kHead + kPerSegment * k;
    SegmentCost& s = input.segments[static_cast<size_t>(k)];
    s.saved_bytes = q[0] != 0 ? -1 : static_cast<int64_t>(q[1]);
    s.recompute_s = q[2];
    if (s.saved_bytes >= 0) recompute += s.recompute_s;
  }
  // Each rank's backward includes its own recomputes; the slowest of each may come from different
  // ranks, so the agreed backward is at least their sum.
  input.backward_s = std::max(p[2], recompute);
  return input;
}

MemoryPlanInput agree_plan_input(Communicator& comm, const MemoryPlanInput& mine) {
  at::Tensor e = encode_for_max(mine);
  comm.all_reduce(e, ReduceOp::kMax);
  return decode_max(e);
}

}  // namespace ferry::dist
