#pragma once
// Which rank holds a layout chunk's optimizer state (and, with sharded parameters, its parameter
// chunk between steps): with N > 1 ranks, once sharded, rank r owns the chunks c with c % N == r (Note
// [Sharded optimizer state]); before sharding and at N = 1 every chunk is this process's. The world and
// rank are fixed at construction; sharding happens once (ShardedStep::shard) and is never undone.
#include <cstdint>

namespace ferry::optim {

class Ownership {
 public:
  Ownership() = default;
  Ownership(int world, int rank) : world_(world), rank_(rank) {}
  int world() const { return world_; }
  int rank() const { return rank_; }
  bool sharded() const { return sharded_; }
  bool owned(int64_t chunk) const { return !sharded_ || chunk % world_ == rank_; }
  // The rank that owns `chunk` once sharded.
  int owner(int64_t chunk) const { return static_cast<int>(chunk % world_); }
  void mark_sharded() { sharded_ = true; }

 private:
  int world_ = 1;
  int rank_ = 0;
  bool sharded_ = false;
};

}  // namespace ferry::optim
