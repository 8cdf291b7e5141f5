#pragma once
// GradLedger: per parameter of the model (its index, stable across repacks), which param group it is
// in, whether a gradient the next step applies has landed since the last step or zero_grad(), and how
// many of its group's applied steps did not update it (its lag, D62: its own step count, torch's
// per-parameter `step`, is the group's minus the lag). And, from those, the spans a chunk's update
// covers: runs of landed slots of one group and one lag.
//
// Contract: not thread-safe; HybridAdam's engine calls it under its mutex (a host job reads spans it
// was given, never the ledger). Lags change only when a step ends or a checkpoint is loaded.
#include <cstdint>
#include <functional>
#include <vector>

#include "../chunk/layout.h"

namespace ferry::optim {

// A run of slots of one layout chunk, in elements of the chunk, updated with one group's options and
// one step count: the group's minus `lag` (spans merge only slots with the same group and lag).
struct Span {
  int group = 0;
  int64_t begin = 0, end = 0;
  int64_t lag = 0;
  bool operator==(const Span& o) const { return group == o.group && begin == o.begin && end == o.end && lag == o.lag; }
};

class GradLedger {
 public:
  explicit GradLedger(std::vector<int> group_of_param);

  int64_t num_params() const { return static_cast<int64_t>(group_of_.size()); }
  int group_of(int64_t param) const { return group_of_[param]; }
  const std::vector<int>& groups() const { return group_of_; }

  // Landings: a gradient landed for `param`; whether any did since clear().
  void land(int64_t param);
  bool landed(int64_t param) const { return landed_[param] != 0; }
  bool any() const { return any_; }
  // Per parameter, 1 where landed (the reduce-scatter's flags, the checkpoint's warning).
  const std::vector<char>& landed_mask() const { return landed_; }
  // Forgets every landing (the step consumed them, or zero_grad() discarded them).
  void clear();
  // Forgets one parameter's landing (its chunk's update consumed it while backward failed); recount()
  // after the last: any() then says whether another is left.
  void forget(int64_t param) { landed_[param] = 0; }
  void recount();
  // At N > 1 the owner updates the union of the ranks' landings: `param` landed on some rank or on none.
  void set_landed(int64_t param, bool landed);
  // The data-parallel step found landings on some rank: a step is due even if none landed here.
  void mark_any() { any_ = true; }

  // The spans chunk `chunk` of `layout` updates: its landed slots (zero-element ones skipped), merged
  // while consecutive, of one group and one lag; `only` (optional, per parameter): only those with
  // only[param] != 0 (the late ones, Note [A gradient after its chunk's update]).
  std::vector<Span> spans(const ChunkLayout& layout, int64_t chunk, const std::vector<char>* only = nullptr) const;
  // Slot ranges of `chunk` whose parameters have landed() == want, merged while adjacent (group 0, lag 0).
  std::vector<Span> slot_ranges(const ChunkLayout& layout, int64_t chunk, bool want) const;

  // Lags (D62).
  int64_t lag(int64_t param) const { return lag_[param]; }
  const std::vector<int64_t>& lags() const { return lag_; }
  void set_lags(std::vector<int64_t> lags);
  // After a step that advanced the groups' step counts: every parameter of a chunk `owned` says is
  // this rank's that the step did not update falls one step further behind. A parameter was updated
  // when it landed and its chunk was (updated_chunks null: every chunk; else updated_chunks[c] != 0);
  // a late one (`late`, per parameter, may be null) goes by late_updated[c] instead (null or empty:
  // not updated). Before clear().
  void count_missed_steps(const ChunkLayout& layout, const std::function<bool(int64_t)>& owned,
                          const std::vector<char>* updated_chunks, const std::vector<char>* late_updated,
                          const std::vector<char>* late);

 private:
  std::vector<int> group_of_;      // per parameter, fixed at construction
  std::vector<char> landed_;       // per parameter
  bool any_ = false;
  std::vector<int64_t> lag_;       // per parameter
};

}  // namespace ferry::optim
