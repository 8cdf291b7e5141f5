#include "memory_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <numeric>

namespace ferry {
namespace {

bool measured(const SegmentCost& s) { return s.saved_bytes >= 0; }

// The prefix sums of the held groups: state bytes, device seconds and host seconds of the first m.
struct GroupPrefix {
  std::vector<int64_t> state_bytes{0};
  std::vector<double> device_s{0.0};
  std::vector<double> host_s{0.0};
  double host_total_s = 0;

  explicit GroupPrefix(const std::vector<GroupCost>& groups) {
    for (const GroupCost& g : groups) {
      if (!g.held) continue;
      state_bytes.push_back(state_bytes.back() + g.state_bytes);
      device_s.push_back(device_s.back() + g.device_s);
      host_s.push_back(host_s.back() + g.host_s);
      host_total_s += g.host_s;
    }
  }
  int64_t held() const { return static_cast<int64_t>(state_bytes.size()) - 1; }
};

double step_time(const MemoryPlanInput& in, const GroupPrefix& groups, double saved_s, int64_t m) {
  const double backward = in.backward_s - saved_s;
  const double window = backward + (in.host_behind_forward ? in.forward_s : 0.0);
  const double host = groups.host_total_s - groups.host_s[static_cast<size_t>(m)];
  return in.forward_s + backward + groups.device_s[static_cast<size_t>(m)] + std::max(0.0, host - window);
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
    TORCH_CHECK(groups[g].state_bytes >= 0 && groups[g].host_s >= 0 && groups[g].device_s >= 0,
                "ferry: memory plan: state group ", g, " has a negative cost (", groups[g].state_bytes, " B, host ",
                groups[g].host_s, " s, device ", groups[g].device_s, " s)");
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
  return step_time(input, groups, saved, groups_on_device);
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

  MemoryPlan best;
  best.keep.assign(input.segments.size(), 0);
  best.predicted_step_s = std::numeric_limits<double>::infinity();
  best.bound_s = std::numeric_limits<double>::infinity();
  best.exact = !front.empty();
  for (int64_t m = 0; m <= groups.held(); ++m) {
    const int64_t state = groups.state_bytes[static_cast<size_t>(m)];
    if (state > room) break;  // the prefix sums only grow
    const int64_t cap = room - state;
    Entry chosen;
    double bound_saving = 0;
    if (best.exact) {  // the front's last entry within cap saves the most
      auto it = std::upper_bound(front.begin(), front.end(), cap, [](int64_t c, const Entry& e) { return c < e.bytes; });
      chosen = *std::prev(it);  // front[0] is the empty set, 0 bytes
      bound_saving = chosen.saved_s;
    } else {
      chosen = greedy(input.segments, by_density, cap);
      bound_saving = fractional_saving(input.segments, by_density, cap);
    }
    const double t = step_time(input, groups, chosen.saved_s, m);
    best.bound_s = std::min(best.bound_s, step_time(input, groups, bound_saving, m));
    if (t < best.predicted_step_s) {
      best.predicted_step_s = t;
      best.keep = std::move(chosen.keep);
      best.groups_on_device = m;
      best.kept_bytes = chosen.bytes;
      best.state_device_bytes = state;
      best.recompute_s = 0;
    }
  }
  for (size_t k = 0; k < input.segments.size(); ++k) {
    if (best.keep[k] == 0 && measured(input.segments[k])) best.recompute_s += input.segments[k].recompute_s;
  }
  if (best.exact) best.bound_s = best.predicted_step_s;
  return best;
}

}  // namespace ferry
