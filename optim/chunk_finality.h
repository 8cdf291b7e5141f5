#pragma once
// ChunkFinality: when a layout chunk is final in a backward — every gradient it will get has landed and
// backward no longer uses it — so that its work (its update, or emptying its slots into the
// accumulation chunk) can start while backward goes on. Counted, not guessed: per parameter, the
// landings and uses of this backward, and the most any earlier backward had (Note [Expectations only
// grow]); per chunk, what is still expected before it is final. One instance serves the pipelined step
// (Note [Pipelined step]) and accumulation (Note [Accumulation per chunk]).
//
// Note [Expectations only grow]
// The pipeline decides that a chunk is final from what earlier backwards had: each parameter's
// landings and uses. Taken from the last backward alone, a model whose backward varies (a layer skipped
// in some steps, stochastic depth; a parameter used only in some) found a chunk final at a step after
// one without that layer, the layer's gradient was refused ("after its chunk's update had started"),
// and every later step failed so: a refused backward taught nothing. Now the expectations only grow:
// each backward's counts are merged in by maximum, an aborted one's too (they are a part of what it
// would have had), and a refused landing is added. A step that lacks what was expected leaves those
// chunks to backward's end (correct, not overlapped); a landing no earlier backward had comes after
// its chunk's update started, once (Note [A gradient after its chunk's update]). A change of
// requires_grad starts the counts anew (forget()).
//
// Note [A chunk final before its last use]
// A chunk's gradients can all have landed while backward still needs the chunk: a frozen layer's
// weight, in the chunk of a trainable layer after it, carries the gradient to trainable layers below
// it. Final on its landings alone, the chunk went to the host and was locked there for its update or
// accumulation, and the frozen weight's use failed ("locked on the host"): every backward_step after
// the first, and every accumulating backward, of a model fine-tuned with such a layer. So a chunk is
// final once its parameters have had the landings and the uses (in this model's backward) that earlier
// backwards had (Note [Expectations only grow]); a chunk that expects no landing is never final early,
// as before. A use beyond them (a loop that ran longer) waits for the chunk's job in this backward
// (await_param): the value it reads is not one the job writes, since a parameter is not used after its
// own landing (that is refused, D64). (At N > 1 an owner's job waits for the ranks' sums, and such a use
// still fails on the lock.) A use fewer leaves the chunk to backward's end.
//
// Contract: not thread-safe (HybridAdam's engine calls it under its mutex, from autograd's thread during
// backward and from the training thread between iterations). Parameters are the model's indices.
#include <cstdint>
#include <vector>

#include "../chunk/layout.h"

namespace ferry::optim {

class ChunkFinality {
 public:
  // The model's parameter count: this backward's counts are kept across a repack (they are per
  // parameter); the expectations too.
  void follow_layout(int64_t num_params);

  // A backward starts counting: this backward's landings are forgotten. With `count_down`, each chunk
  // expects the landings its parameters had at most in earlier backwards and, if it expects any, the
  // uses not yet seen in this one; it is final when both are in (a chunk that expects no landing never
  // is). Without, no chunk becomes final early. `sized`: give every parameter an expectation of 0 first
  // where there is none yet (accumulation arms at the first landing of every backward; the pipelined
  // step only once a backward_step has completed).
  void begin(const ChunkLayout& layout, bool count_down, bool sized = false);
  // Chunk `chunk` is not final early in this backward, whatever lands (N > 1: a trainable parameter no
  // backward reached yet, Note [A gradient after its chunk's update]).
  void hold(int64_t chunk) { remaining_[chunk] = -1; }

  // A landing of `param` (counted always, as it lands).
  void count_landing(int64_t param) { ++landings_[param]; }
  // After that landing, its chunk no longer held: whether it made `chunk` final (call once per landing,
  // while counting down).
  bool final_after_landing(int64_t param, int64_t chunk);
  // A use of `param` in `chunk` inside this model's backward (counted always); true when it makes the
  // chunk final. `counting`: the caller counts chunks down in this backward.
  bool use(int64_t param, int64_t chunk, bool counting);
  // The backward ended (or stopped): its uses join the expected ones and are forgotten.
  void end_uses();
  // This backward's landings join the expectations (`complete`: it ran to its end; one that stopped
  // part-way adds what it had, but does not start the expectations).
  void learn_landings(bool complete);
  // A landing no earlier backward had (Note [A gradient after its chunk's update]): expected from now
  // on, `landings` of them. Returns how many the expectations held before.
  int64_t expect(int64_t param, int64_t landings);
  // requires_grad changed: what backwards had no longer says what the next ones will have.
  void forget();

  int64_t landings(int64_t param) const { return landings_[param]; }
  bool has_expectations() const { return !expected_.empty(); }
  int64_t expected(int64_t param) const { return param < static_cast<int64_t>(expected_.size()) ? expected_[param] : 0; }
  // What the ranks compare before they pipeline across ranks (the same chunks final at the same moments).
  const std::vector<int64_t>& expected_landings() const { return expected_; }
  const std::vector<int64_t>& expected_uses() const { return expected_uses_; }

 private:
  // Per layout chunk: the landings `landings` expects of its parameters and, for a chunk that expects
  // some, the uses its parameters had in earlier backwards not yet seen in this one.
  std::vector<int64_t> final_counts(const ChunkLayout& layout) const;

  std::vector<int64_t> landings_;       // per parameter, this backward
  std::vector<int64_t> expected_;       // per parameter, the most landings earlier backwards had (empty: none yet)
  std::vector<int64_t> uses_;           // per parameter, this backward
  std::vector<int64_t> expected_uses_;  // per parameter, the most uses earlier backwards had
  std::vector<int64_t> remaining_;      // per layout chunk: landings and uses still expected (< 0: never final early)
};

}  // namespace ferry::optim
