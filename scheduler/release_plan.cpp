// ReleasePlan (see release_plan.h).
#include "release_plan.h"

#include <algorithm>

namespace ferry {

const std::vector<std::vector<ChunkId>>& ReleasePlan::plan(const AccessTrace& trace, int64_t num_chunks,
                                                           RemoteChunks& remote) {
  if (!planned_) make_plan(trace, num_chunks, remote);
  return release_at_;
}

void ReleasePlan::make_plan(const AccessTrace& trace, int64_t num_chunks, RemoteChunks& remote) {
  // Per group: its last forward position and its next use after it; released at the first position after
  // the last forward use when that next use is far enough. Every rank computes the same from the same trace.
  planned_ = true;
  release_at_.assign(trace.size() + 1, {});
  if (!reshard_after_forward_) return;
  const int64_t start = trace.backward_start(), n = trace.size();
  std::vector<int64_t> last_forward(num_chunks, -1);  // per chunk, then per group (its first member)
  for (int64_t q = 0; q < start; ++q) last_forward[trace.chunk_at(q)] = q;
  std::vector<ChunkId> leader(num_chunks, -1);  // each chunk's group, named by its first member
  for (ChunkId c = 0; c < num_chunks; ++c) {
    if (leader[c] >= 0 || last_forward[c] < 0) continue;
    const std::vector<ChunkId> members = remote.group(c);
    for (ChunkId m : members) leader[m] = members.front();
    for (ChunkId m : members) last_forward[members.front()] = std::max(last_forward[members.front()], last_forward[m]);
  }
  std::vector<int64_t> next(num_chunks, AccessTrace::kNever);  // per group: first use after its forward
  for (int64_t q = n - 1; q >= 0; --q) {
    const ChunkId g = leader[trace.chunk_at(q)];
    if (g >= 0 && q > last_forward[g]) next[g] = q;
  }
  for (ChunkId g = 0; g < num_chunks; ++g) {
    if (leader[g] != g) continue;
    // A group with no later use is kept: its gradients land in its chunks at the end of backward, which
    // would fetch it again just for that.
    const int64_t at = last_forward[g] + 1;
    if (next[g] != AccessTrace::kNever && next[g] - at >= min_gap_) release_at_[at].push_back(g);
  }
}

void ReleasePlan::release_until(int64_t position, const AccessTrace& trace, int64_t num_chunks,
                                RemoteChunks& remote) {
  if (!planned_) make_plan(trace, num_chunks, remote);
  for (; released_upto_ <= std::min<int64_t>(position, trace.size()); ++released_upto_) {
    for (ChunkId c : release_at_[released_upto_]) remote.release(c);
  }
}

}  // namespace ferry
