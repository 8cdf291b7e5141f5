#include "memory_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <numeric>

namespace ferry {
namespace {

bool measured(const SegmentCost& s) { return s.saved_bytes >= 0; }

// The prefix sums of the held groups: state bytes and device seconds of the first m.
struct GroupPrefix {
  std::vector<int64_t> state_bytes{0};
  std::vector<double> device_s{0.0};

  explicit GroupPrefix(const std::vector<GroupCost>& groups) {
    for (const GroupCost& g : groups) {
      if (!g.held) continue;
      state_bytes.push_back(state_bytes.back() + g.state_bytes);
      device_s.push_back(device_s.back() + g.device_s);
    }
  }
  int64_t held() const { return static_cast<int64_t>(state_bytes.size()) - 1; }
};

// Note [The timeline of the host updates]
// Why a timeline and not a window (the model until 2026-11-28): measured on one H100 at 6b, the joint
// plan that put 40 of 80 groups' state on the host was predicted at 0.836 s, their host updates hidden
// behind backward + forward, and ran at 0.917 s, forward 0.24 s longer. The window lets host work hide
// wherever its sum fits; but backward finishes the groups in reverse layout order, so the host takes
// them in that order, and those it has not reached when backward ends are the first groups the next
// forward needs. (Its inputs were wrong too, Note [The joint placement]: from that call's steady
// backward and the host Adam at its rate inside a step, this timeline gives 0.913 s for that plan and
// the window 1.083 s: tests/scheduler/test_memory_plan.cpp.)
// A group's update can start no earlier than its chunk is final and has travelled, and the forward
// can pass a group no earlier than its update is done and has travelled back. The simulation below
// follows HybridAdam's eager step (optim/pipelined_step.h) and its carry-over (optim/engine_step.cpp);
// its costs are floors of moved bytes at measured rates (Note [The update costs of a state group]),
// not the kernels' timings.
class Timeline {
 public:
  explicit Timeline(const MemoryPlanInput& in) : in_(in) {
    const size_t n = in.groups.size();
    double total = 0;
    for (const GroupCost& g : in.groups) total += static_cast<double>(g.param_bytes);
    before_.assign(n + 1, 0.0);  // share of the groups before g
    for (size_t g = 0; g < n; ++g) {
      const double w = total > 0 ? static_cast<double>(in.groups[g].param_bytes) / total : 1.0 / static_cast<double>(n);
      before_[g + 1] = before_[g] + w;
    }
    for (size_t g = 0; g < n; ++g) {
      if (in.groups[g].held) held_.push_back(g);
    }
  }

  // T for a backward of `backward` seconds with the first m held groups on the device. Each direction
  // of the bus is one copy at a time: the gradients go down in the order backward finishes their
  // groups, the new values come up in the order forward needs them.
  double step(double backward, int64_t m, double device_updates) const {
    const std::vector<GroupCost>& groups = in_.groups;
    const size_t n = groups.size();
    const double end = backward + device_updates;  // E
    std::vector<double> on_host(n, -1.0), done(n, -1.0);
    double down = 0, free = 0;
    std::vector<size_t> carried;  // not started by E: in descending order, taken back
    for (size_t i = held_.size(); i-- > static_cast<size_t>(m);) {  // descending layout order
      const size_t g = held_[i];
      down = std::max(down, backward * (1.0 - before_[g])) + groups[g].trip_s;
      on_host[g] = down;
      const double start = std::max(free, on_host[g]);
      if (in_.host_behind_forward && start >= end) {
        carried.push_back(g);
        continue;
      }
      free = start + groups[g].host_s;
      done[g] = free;
    }
    for (auto it = carried.rbegin(); it != carried.rend(); ++it) {  // layout order, after the running one
      free = std::max(free, end);
      free = std::max(free, on_host[*it]) + groups[*it].host_s;
      done[*it] = free;
    }
    // The next forward: at E, or once every host update is done where the step waits for them.
    double now = in_.host_behind_forward ? end : std::max(end, free), up = 0;
    for (size_t g = 0; g < n; ++g) {
      if (done[g] >= 0) {
        up = std::max(up, done[g]) + groups[g].trip_s;
        now = std::max(now, up);
      }
      now += in_.forward_s * (before_[g + 1] - before_[g]);
    }
    return n == 0 ? now + in_.forward_s : now;  // no groups: no shares, the forward whole
  }

 private:
  const MemoryPlanInput& in_;
  std::vector<double> before_;
  std::vector<size_t> held_;  // the held groups' layout indices
};

double step_time(const MemoryPlanInput& in, const GroupPrefix& groups, const Timeline& timeline, double saved_s,
                 int64_t m) {
  return timeline.step(in.backward_s - saved_s, m, groups.device_s[static_cast<size_t>(m)]);
}

// One Pareto entry: a set of kept segments, its bytes and the recompute it saves.
struct Entry {
  int64_t bytes = 0;
  double saved_s = 0;
  std::vector<char> keep;
};

// The Pareto front of the measured segments (bytes ascending, saved strictly ascending), or empty when
// it grows past `max_front`.
std::vector<Entry> pareto_front(const std::vector<SegmentCost>& segments, int64_t max_front) {
  std::vector<Entry> front{{0, 0.0, std::vector<char>(segments.size(), 0)}};
  for (size_t k = 0; k < segments.size(); ++k) {
    const SegmentCost& s = segments[k];
    if (!measured(s) || s.recompute_s <= 0) continue;  // never worth keeping, or not known
    std::vector<Entry> with;
    with.reserve(front.size());
    for (const Entry& e : front) {
      Entry n = e;
      n.bytes += s.saved_bytes;
      n.saved_s += s.recompute_s;
      n.keep[k] = 1;
      with.push_back(std::move(n));
    }
    std::vector<Entry> merged;
    merged.reserve(front.size() + with.size());
    std::merge(std::make_move_iterator(front.begin()), std::make_move_iterator(front.end()),
               std::make_move_iterator(with.begin()), std::make_move_iterator(with.end()), std::back_inserter(merged),
               [](const Entry& a, const Entry& b) { return a.bytes < b.bytes || (a.bytes == b.bytes && a.saved_s > b.saved_s); });
    front.clear();
    for (Entry& e : merged) {  // keep only entries that save more than every cheaper one
      if (!front.empty() && e.saved_s <= front.back().saved_s) continue;
      front.push_back(std::move(e));
    }
    if (static_cast<int64_t>(front.size()) > max_front) return {};
  }
  return front;
}

// Greedy by saved seconds per byte within `cap`, or the best single segment if it saves more.
Entry greedy(const std::vector<SegmentCost>& segments, const std::vector<size_t>& by_density, int64_t cap) {
  Entry g{0, 0.0, std::vector<char>(segments.size(), 0)};
  for (size_t k : by_density) {
    if (g.bytes + segments[k].saved_bytes > cap) continue;
    g.bytes += segments[k].saved_bytes;
    g.saved_s += segments[k].recompute_s;
    g.keep[k] = 1;
  }
  Entry single{0, 0.0, std::vector<char>(segments.size(), 0)};
  for (size_t k : by_density) {
    if (segments[k].saved_bytes <= cap && segments[k].recompute_s > single.saved_s) {
      single = Entry{segments[k].saved_bytes, segments[k].recompute_s, std::vector<char>(segments.size(), 0)};
      single.keep[k] = 1;
    }
  }
  return single.saved_s > g.saved_s ? single : g;
}

// The fractional relaxation's saving within `cap`: no 0/1 choice saves more.
double fractional_saving(const std::vector<SegmentCost>& segments, const std::vector<size_t>& by_density, int64_t cap) {
  double saved = 0;
  int64_t left = cap;
  for (size_t k : by_density) {
    const SegmentCost& s = segments[k];
    if (s.saved_bytes <= left) {
      saved += s.recompute_s;
      left -= s.saved_bytes;
    } else {
      saved += s.recompute_s * static_cast<double>(left) / static_cast<double>(s.saved_bytes);
      break;
    }
  }
  return saved;
}

}  // namespace

void MemoryPlanInput::validate() const {
  double recompute = 0;
  for (size_t k = 0; k < segments.size(); ++k) {
    TORCH_CHECK(segments[k].recompute_s >= 0, "ferry: memory plan: segment ", k, " has a negative recompute time (",
                segments[k].recompute_s, " s)");
    if (measured(segments[k])) recompute += segments[k].recompute_s;
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    const GroupCost& c = groups[g];
    TORCH_CHECK(c.state_bytes >= 0 && c.param_bytes >= 0 && c.host_s >= 0 && c.device_s >= 0 && c.trip_s >= 0,
                "ferry: memory plan: state group ", g, " has a negative cost (", c.state_bytes, " B of state, ",
                c.param_bytes, " B of parameters, host ", c.host_s, " s, device ", c.device_s, " s, trip ",
                c.trip_s, " s)");
  }
  TORCH_CHECK(room_bytes >= -1, "ferry: memory plan: room must be >= 0 bytes, or -1 for no limit; got ", room_bytes);
  TORCH_CHECK(forward_s >= 0 && backward_s >= 0, "ferry: memory plan: forward and backward times must be >= 0; got ",
              forward_s, " s and ", backward_s, " s");
  // A measured backward is at least its recomputes; tolerate the two clocks' rounding.
  TORCH_CHECK(backward_s + 1e-9 >= recompute * (1 - 1e-6), "ferry: memory plan: backward (", backward_s,
              " s) is shorter than the recomputes it includes (", recompute, " s)");
}

int64_t MemoryPlan::kept() const { return std::count(keep.begin(), keep.end(), 1); }

double predicted_step_s(const MemoryPlanInput& input, const std::vector<char>& keep, int64_t groups_on_device) {
  TORCH_CHECK(keep.size() == input.segments.size(), "ferry: memory plan: ", keep.size(), " decisions for ",
              input.segments.size(), " segments");
  const GroupPrefix groups(input.groups);
  TORCH_CHECK(groups_on_device >= 0 && groups_on_device <= groups.held(), "ferry: memory plan: ", groups_on_device,
              " groups on the device, of ", groups.held(), " held");
  double saved = 0;
  for (size_t k = 0; k < keep.size(); ++k) {
    if (keep[k] != 0 && measured(input.segments[k])) saved += input.segments[k].recompute_s;
  }
  return step_time(input, groups, Timeline(input), saved, groups_on_device);
}

int64_t planned_device_bytes(const MemoryPlanInput& input, const std::vector<char>& keep, int64_t groups_on_device) {
  const GroupPrefix groups(input.groups);
  int64_t bytes = groups.state_bytes[static_cast<size_t>(groups_on_device)];
  for (size_t k = 0; k < keep.size(); ++k) {
    if (keep[k] != 0) bytes += std::max<int64_t>(input.segments[k].saved_bytes, 0);
  }
  return bytes;
}

MemoryPlan plan_memory(const MemoryPlanInput& input, const MemoryPlanOptions& options) {
  input.validate();
  const GroupPrefix groups(input.groups);
  const Timeline timeline(input);
  const int64_t unlimited = std::numeric_limits<int64_t>::max() / 4;
  const int64_t room = input.room_bytes < 0 ? unlimited : input.room_bytes;
  const std::vector<Entry> front = pareto_front(input.segments, options.max_front);

  std::vector<size_t> by_density;  // measured segments worth keeping, most saved seconds per byte first
  for (size_t k = 0; k < input.segments.size(); ++k) {
    if (measured(input.segments[k]) && input.segments[k].recompute_s > 0) by_density.push_back(k);
  }
  std::stable_sort(by_density.begin(), by_density.end(), [&](size_t a, size_t b) {
    const SegmentCost& x = input.segments[a];
    const SegmentCost& y = input.segments[b];  // x.r / x.a > y.r / y.a without dividing by 0
    return x.recompute_s * static_cast<double>(y.saved_bytes) > y.recompute_s * static_cast<double>(x.saved_bytes);
  });

  // Note [The timeline of the host updates]: waiting for every host update at the step's end, T is
  // non-decreasing in B(K) for a fixed m, so the front's last entry within the capacity is the best.
  // With the carry-over it need not be (which updates start before backward's end, and so in which
  // order the rest run, changes with its length: a list schedule's anomaly, a few percent on random
  // instances), so every entry within the capacity is weighed: the best Pareto set for each m. That is
  // the model's optimum when the Pareto sets are every set's savings, as for identical segments (a
  // transformer's blocks: j segments, every j); otherwise a set off the front may beat it by such an
  // anomaly, and the bound is the GPU's own work at the front's largest saving.
  const bool monotone = !input.host_behind_forward || groups.held() == 0;
  bool identical = true;  // every segment worth keeping costs the same
  const SegmentCost* first_kept = nullptr;
  for (size_t k : by_density) {
    const SegmentCost& c = input.segments[k];
    if (first_kept == nullptr) first_kept = &c;
    identical = identical && c.saved_bytes == first_kept->saved_bytes && c.recompute_s == first_kept->recompute_s;
  }
  const bool weigh_all = !monotone && static_cast<int64_t>(front.size()) * (groups.held() + 1) <= options.max_weighed;

  MemoryPlan best;
  best.keep.assign(input.segments.size(), 0);
  best.predicted_step_s = std::numeric_limits<double>::infinity();
  best.bound_s = std::numeric_limits<double>::infinity();
  best.pareto = !front.empty();
  best.exact = best.pareto && (monotone || (weigh_all && identical));
  auto consider = [&](const Entry& chosen, int64_t m) {
    const double t = step_time(input, groups, timeline, chosen.saved_s, m);
    if (t >= best.predicted_step_s) return;
    best.predicted_step_s = t;
    best.keep = chosen.keep;
    best.groups_on_device = m;
    best.kept_bytes = chosen.bytes;
    best.state_device_bytes = groups.state_bytes[static_cast<size_t>(m)];
    best.host_wait_s = std::max(0.0, t - input.forward_s - (input.backward_s - chosen.saved_s) -
                                         groups.device_s[static_cast<size_t>(m)]);
  };
  for (int64_t m = 0; m <= groups.held(); ++m) {
    const int64_t state = groups.state_bytes[static_cast<size_t>(m)];
    if (state > room) break;  // the prefix sums only grow
    const int64_t cap = room - state;
    double bound_saving = 0;
    if (best.pareto) {
      auto end = std::upper_bound(front.begin(), front.end(), cap, [](int64_t c, const Entry& e) { return c < e.bytes; });
      for (auto e = weigh_all ? front.begin() : std::prev(end); e != end; ++e) consider(*e, m);  // front[0]: 0 B
      bound_saving = std::prev(end)->saved_s;
    } else {
      consider(greedy(input.segments, by_density, cap), m);
      bound_saving = fractional_saving(input.segments, by_density, cap);
    }
    // No set within cap saves more than bound_saving; T is at least the GPU's own work.
    const double gpu_s = input.forward_s + (input.backward_s - bound_saving) + groups.device_s[static_cast<size_t>(m)];
    best.bound_s = std::min(best.bound_s, monotone ? step_time(input, groups, timeline, bound_saving, m) : gpu_s);
  }
  if (best.exact) best.bound_s = best.predicted_step_s;
  best.recompute_s = 0;
  for (size_t k = 0; k < input.segments.size(); ++k) {
    if (best.keep[k] == 0 && measured(input.segments[k])) best.recompute_s += input.segments[k].recompute_s;
  }
  return best;
}

}  // namespace ferry
