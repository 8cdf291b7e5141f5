#pragma once
// The recorded order of parameter uses of one iteration, and what OPT needs from it.
//
// One entry per pre-use event: the tensor used and its chunk at recording time, the device's non-model
// bytes at that moment (activations, temporaries: what the memory probe saw minus the chunk payloads),
// and the other tensors in use then (in COMPUTE: an op that needs two chunks at once, a weight ending one
// and its bias opening the next). Positions are indices into this sequence; "next use" of a chunk at
// position p is the smallest q >= p whose entry is that chunk, and iterations repeat: a chunk not used
// again in this iteration is next used at (its first position + size()), in the next one.
#include <cstdint>
#include <limits>
#include <vector>

#include "../chunk/role.h"

namespace ferry {

class AccessTrace {
 public:
  static constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

  void record(TensorId tensor, ChunkId chunk, int64_t non_model_bytes, const std::vector<TensorId>& in_use = {});
  // The backward pass begins at the next position recorded (the first use in backward). Unset (a
  // forward-only iteration): backward_start() is size().
  void mark_backward_start() { backward_start_ = size(); }
  int64_t backward_start() const { return backward_start_ < 0 ? size() : backward_start_; }
  void clear();
  int64_t size() const { return static_cast<int64_t>(tensors_.size()); }
  bool empty() const { return tensors_.empty(); }
  TensorId tensor_at(int64_t position) const { return tensors_[position]; }
  ChunkId chunk_at(int64_t position) const { return chunks_[position]; }
  // The first position after `position` whose chunk differs from chunk_at(position); size() if none.
  // Valid after finalize(); lets the prefetcher skip a chunk's run of uses in one step.
  int64_t run_end(int64_t position) const { return run_end_[position]; }
  int64_t non_model_at(int64_t position) const { return non_model_[position]; }
  // The other tensors in use when `position` was recorded.
  std::vector<TensorId> in_use_at(int64_t position) const;
  // Their chunks other than chunk_at(position), each once (valid after finalize(); a tensor the trace
  // does not use, whose chunk it cannot know, is left out): they stay on the device through that use.
  struct ChunkRange {
    const ChunkId* first;
    const ChunkId* last;
    const ChunkId* begin() const { return first; }
    const ChunkId* end() const { return last; }
    bool empty() const { return first == last; }
  };
  ChunkRange pinned_at(int64_t position) const {
    return {pinned_.data() + pinned_begin_[position], pinned_.data() + pinned_begin_[position + 1]};
  }
  const std::vector<TensorId>& tensors() const { return tensors_; }
  const std::vector<ChunkId>& chunks() const { return chunks_; }

  // Rewrites chunk ids after a repack: chunk_of_tensor[t] is tensor t's new chunk.
  void remap_chunks(const std::vector<ChunkId>& chunk_of_tensor);
  // Builds the next-use index; call after recording or remapping, before next_use().
  void finalize(int64_t num_chunks);
  // The first position q >= position where `chunk` is used (wrapping into the next iteration), or
  // kNever if the trace never uses it. `passed_over` (null: none; else one entry per position): this
  // iteration's positions known not to come (TraceAlignment::passed_over), never a next use in it.
  int64_t next_use(ChunkId chunk, int64_t position, const std::vector<char>* passed_over = nullptr) const;
  // Whether every position of the run starting at `position` (up to run_end) is passed over.
  bool run_passed_over(int64_t position, const std::vector<char>& passed_over) const;
  // The largest non-model bytes in positions [position, position + window).
  int64_t non_model_peak(int64_t position, int64_t window) const;
  // Tensors in order of first use (each once): the packing order.
  std::vector<TensorId> first_use_order(int64_t num_tensors) const;

 private:
  std::vector<TensorId> tensors_;
  std::vector<ChunkId> chunks_;
  std::vector<int64_t> non_model_;
  std::vector<int64_t> in_use_begin_;  // per position: where its tensors in use start in in_use_
  std::vector<TensorId> in_use_;
  std::vector<int64_t> pinned_begin_;  // per position and one more (finalize)
  std::vector<ChunkId> pinned_;
  int64_t backward_start_ = -1;
  std::vector<std::vector<int64_t>> positions_of_chunk_;  // ascending
  std::vector<int64_t> run_end_;
};

// Bytes moved per iteration by a Belady (furthest next use) schedule of `trace` repeated, under a
// device budget (0: no limit), in the long run: from an empty device the iterations run until the set
// of chunks resident at an iteration's start repeats, and the moves of that cycle are averaged (to the
// byte; at most kBeladyIterations iterations, else the mean of all but the first). Every use of a
// non-resident chunk moves it in; making room moves the resident chunk with the furthest next use out,
// except the chunks pinned at that use (pinned_at: in use with it, so on the device in any schedule;
// none left to move: the use goes over the budget, as no run could). With equal chunk sizes this is
// the minimum (Belady is optimal over every prefix, so also per iteration in the long run, whatever
// the start; a pin holds a chunk from one of its uses on, so a chunk free to go stays free until its
// next use, and the exchange argument holds); with mixed sizes it is the Belady schedule's count, a
// reference rather than a proven minimum.
//
// `round_trips` (empty: none; else one entry per chunk): the chunks that leave the device once per
// iteration right after their last use in it (or the last use they are pinned at, if later), whatever
// the budget, and come back for their first use in the next (their update runs on the host: Note [The
// step's round trips in the reference]). Each such departure is a move out; it also frees the chunk's
// room for the rest of the iteration. Belady's choice stays optimal with those departures fixed: they
// are moves no schedule can avoid.
struct MoveCount {
  int64_t h2d_bytes = 0;
  int64_t d2h_bytes = 0;
  int64_t total() const { return h2d_bytes + d2h_bytes; }
};
constexpr int kBeladyIterations = 64;
MoveCount belady_moves(const AccessTrace& trace, const std::vector<int64_t>& chunk_bytes, int64_t budget_bytes,
                       const std::vector<char>& round_trips = {});

// Bytes moved by one Belady pass over `uses` (once, not repeated) from the chunks in `resident` on the
// device, under the budget, with the round trips as above (they leave after their last use or pin in
// `uses`). With chunks of one size this is the fewest moves of that sequence from that start (Belady is
// optimal over every prefix, whatever the start; a chunk `uses` does not need again is as good a
// victim as another): an iteration's own floor, given where it began (SchedulerOptions::step_floor).
// A start over the budget gives up its furthest chunks at the first use that needs room.
MoveCount belady_moves_from(const AccessTrace& uses, const std::vector<int64_t>& chunk_bytes, int64_t budget_bytes,
                            const std::vector<ChunkId>& resident, const std::vector<char>& round_trips = {});

}  // namespace ferry
