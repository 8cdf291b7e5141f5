// ParamShards over ChunkStores on the simulated device, with an in-process Communicator: N "ranks" on N
// threads of this process, each with its own store, meeting in a rendezvous (an all-gather's input is
// copied when it is issued, its output written at the wait, as an asynchronous collective would).
// Checked: ownership of layout chunk i by rank i % N; release / release_all give up exactly the chunks
// another rank owns (FREE tensors, no payload) and make their whole group remote; fetch / prefetch /
// fetch_all gather a group by one all-gather and install the owners' current values (on the device when
// it has room, else on the host); a member in COMPUTE keeps its payload through a release and is
// rewritten by the next fetch; the send guard runs before the owned chunk is read (what it writes is
// what the others receive); ranks gathering different groups fail naming both; the stats; bad input.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../../chunk/chunk_store.h"
#include "../../dist/communicator.h"
#include "../../dist/param_shards.h"
#include "../test_util.h"

namespace ferry {
namespace {

using dist::ParamShards;
using test::error_of;

// ---- the in-process communicator

// Collective k of every rank (each counts its own calls) meets here: it completes once every rank
// issued its k-th. Fails (instead of hanging) when a rank does not come within the timeout.
class Rendezvous {
 public:
  explicit Rendezvous(int world) : world_(world) {}
  void deposit(int64_t seq, int rank, at::Tensor part) {
    std::lock_guard<std::mutex> lock(mutex_);
    Round& r = rounds_[seq];
    r.parts.resize(world_);
    r.parts[rank] = std::move(part);
    ++r.deposited;
    changed_.notify_all();
  }
  // Every rank's part of collective `seq`, in rank order, once all deposited.
  std::vector<at::Tensor> collect(int64_t seq) {
    std::unique_lock<std::mutex> lock(mutex_);
    const bool all = changed_.wait_for(lock, std::chrono::seconds(20), [&] { return rounds_[seq].deposited == world_; });
    TORCH_CHECK(all, "fake communicator: collective ", seq, " timed out: not every rank joined");
    Round& r = rounds_[seq];
    std::vector<at::Tensor> parts = r.parts;
    if (++r.collected == world_) rounds_.erase(seq);
    return parts;
  }

 private:
  struct Round {
    std::vector<at::Tensor> parts;
    int deposited = 0, collected = 0;
  };
  const int world_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<int64_t, Round> rounds_;
};

class GatherPending final : public dist::Pending {
 public:
  GatherPending(std::shared_ptr<Rendezvous> hub, int64_t seq, at::Tensor output)
      : hub_(std::move(hub)), seq_(seq), output_(std::move(output)) {}
  ~GatherPending() override {
    if (!waited_) {
      try {
        wait();
      } catch (...) {
      }
    }
  }
  void wait() override {
    if (waited_) return;
    waited_ = true;
    const std::vector<at::Tensor> parts = hub_->collect(seq_);
    const int64_t n = parts[0].numel();
    for (size_t r = 0; r < parts.size(); ++r) output_.slice(0, r * n, (r + 1) * n).copy_(parts[r]);
  }

 private:
  std::shared_ptr<Rendezvous> hub_;
  int64_t seq_;
  at::Tensor output_;
  bool waited_ = false;
};

class FakeCommunicator final : public dist::Communicator {
 public:
  FakeCommunicator(std::shared_ptr<Rendezvous> hub, int rank, int world)
      : hub_(std::move(hub)), rank_(rank), world_(world) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend() const override { return "fake"; }
  bool device_ok(const c10::Device& device) const override { return device.is_cpu(); }
  std::unique_ptr<dist::Pending> all_gather_async(const at::Tensor& output, const at::Tensor& input) override {
    TORCH_CHECK(output.numel() == world_ * input.numel(), "fake all_gather: sizes");
    ++all_gathers;
    hub_->deposit(next_++, rank_, input.clone());  // read now: the caller may reuse it
    return std::make_unique<GatherPending>(hub_, next_ - 1, output);
  }
  void all_gather(at::Tensor& output, const at::Tensor& input) override { all_gather_async(output, input)->wait(); }
  void all_reduce(at::Tensor&, dist::ReduceOp) override { unused("all_reduce"); }
  void broadcast(at::Tensor&, int) override { unused("broadcast"); }
  void reduce_scatter(at::Tensor&, const at::Tensor&) override { unused("reduce_scatter"); }
  std::unique_ptr<dist::Pending> reduce_scatter_async(const at::Tensor&, const at::Tensor&) override {
    unused("reduce_scatter_async");
    return nullptr;
  }
  void barrier() override { unused("barrier"); }
  int all_gathers = 0;

 private:
  [[noreturn]] static void unused(const char* op) { TORCH_CHECK(false, "fake communicator: ParamShards called ", op); }
  std::shared_ptr<Rendezvous> hub_;
  int rank_, world_;
  int64_t next_ = 0;
};

// Runs fn(rank, communicator) on `world` threads; returns each rank's error ("" if none).
std::vector<std::string> run_ranks(int world, const std::function<void(int, std::shared_ptr<FakeCommunicator>)>& fn) {
  auto hub = std::make_shared<Rendezvous>(world);
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, std::make_shared<FakeCommunicator>(hub, r, world));
      } catch (const c10::Error& e) {
        errors[r] = e.what_without_backtrace();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// ---- one rank's parameter chunks

// Layout chunk i holds value(i, rank) in every element on `rank` (so whose bytes a rank holds shows).
float value(int64_t i, int rank) { return static_cast<float>(100 * i + rank + 1); }

const std::vector<int64_t> kNumels = {64, 64, 32, 64, 48};  // 5 chunks: groups {0, 1}, {2, 3}, {4} at N = 2

struct RankChunks {
  RankChunks(int rank, int64_t device_budget = 0) {
    ChunkStoreOptions o;
    o.device = DeviceKind::kSimulated;
    o.device_budget_bytes = device_budget;
    store = std::make_unique<ChunkStore>(o);
    for (size_t i = 0; i < kNumels.size(); ++i) {
      // Some on the host: the owner's bytes are read wherever the scheduler keeps them.
      const Location at = device_budget == 0 && i % 3 != 0 ? Location::kDevice : Location::kHost;
      const ChunkId c = store->add_chunk(ChunkRole::kParam, at::kFloat, kNumels[i], at);
      const int64_t half = kNumels[i] / 2;
      tensors.push_back({store->add_tensor(c, 0, {half}), store->add_tensor(c, half, {kNumels[i] - half})});
      store->payload(c).fill_(value(static_cast<int64_t>(i), rank));
      chunks.push_back(c);
    }
    // One more chunk in the store that is not a parameter chunk of the shards.
    other = store->add_chunk(ChunkRole::kParam, at::kFloat, 16, Location::kHost);
  }
  int64_t nbytes(size_t i) const { return kNumels[i] * 4; }
  // Every element of layout chunk i equals v.
  bool holds(size_t i, float v) const { return torch::all(store->payload(chunks[i]) == v).item<bool>(); }
  std::unique_ptr<ChunkStore> store;
  std::vector<ChunkId> chunks;
  std::vector<std::vector<TensorId>> tensors;  // per layout chunk
  ChunkId other = -1;
};

// Throws (failing the rank) with what is wrong; the main thread reports it.
void require(bool ok, const std::string& what) { TORCH_CHECK(ok, what); }

TEST(ParamShards, OwnershipIsIndexModuloWorld) {
  const auto errors = run_ranks(3, [](int rank, std::shared_ptr<FakeCommunicator> comm) {
    RankChunks mine(rank);
    ParamShards shards(*mine.store, mine.chunks, comm);
    require(shards.num_groups() == 2, "5 chunks at N = 3: 2 groups");
    for (int64_t i = 0; i < 5; ++i) require(shards.owned(i) == (i % 3 == rank), "owned(" + std::to_string(i) + ")");
    require(shards.group(mine.chunks[4]) == std::vector<ChunkId>{mine.chunks[3], mine.chunks[4]}, "the last group");
    require(shards.group(mine.chunks[1]) ==
                std::vector<ChunkId>{mine.chunks[0], mine.chunks[1], mine.chunks[2]}, "the first group");
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// The whole cycle on two ranks: release_all, fetch, prefetch + fetch, fetch_all, and an owner's new
// values reaching the other rank.
TEST(ParamShards, ReleaseAndFetchMoveTheOwnersValues) {
  std::vector<dist::ParamShardStats> stats(2);
  const auto errors = run_ranks(2, [&](int rank, std::shared_ptr<FakeCommunicator> comm) {
    RankChunks mine(rank);
    ParamShards shards(*mine.store, mine.chunks, comm);
    const int other = 1 - rank;
    int64_t all_bytes = 0, owned_bytes = 0;
    for (size_t i = 0; i < kNumels.size(); ++i) {
      all_bytes += mine.nbytes(i);
      if (shards.owned(i)) owned_bytes += mine.nbytes(i);
    }
    require(!shards.any_remote() && shards.present_bytes() == all_bytes, "every chunk starts present");
    for (ChunkId c : mine.chunks) require(!shards.remote(c), "nothing remote at the start");
    require(!shards.remote(mine.other), "a chunk that is not a parameter chunk is never remote");

    shards.release_all();
    require(shards.any_remote(), "released");
    require(shards.present_bytes() == owned_bytes, "only the owned chunks are left");
    for (size_t i = 0; i < kNumels.size(); ++i) {
      const ChunkId c = mine.chunks[i];
      require(shards.remote(c), "every group is remote, the owned member's too (every rank decides alike)");
      if (shards.owned(i)) {
        require(mine.store->location(c) != Location::kNone && mine.holds(i, value(i, rank)), "owned chunks keep their values");
      } else {
        require(mine.store->location(c) == Location::kNone, "another rank's chunk has no payload");
        for (TensorId t : mine.tensors[i]) require(mine.store->tensor_info(t).state == TensorState::kFree, "FREE tensors");
      }
    }
    require(shards.stats().released_chunks == (rank == 0 ? 2 : 3), "released: the chunks another rank owns");
    require(comm->all_gathers == 0, "release is local");

    // One group by its second member: one all-gather; the other rank's chunk gets the owner's values.
    shards.fetch(mine.chunks[3]);
    require(comm->all_gathers == 1, "one all-gather per group");
    for (size_t i : {size_t{2}, size_t{3}}) {
      require(!shards.remote(mine.chunks[i]), "group 1 present");
      const int owner = static_cast<int>(i % 2);
      require(mine.holds(i, value(i, owner)), "chunk " + std::to_string(i) + " holds its owner's values");
      for (TensorId t : mine.tensors[i]) require(mine.store->tensor_info(t).state == TensorState::kHold, "HOLD tensors");
    }
    require(shards.remote(mine.chunks[0]) && shards.remote(mine.chunks[4]), "the other groups stay remote");
    auto s = shards.stats();
    require(s.gathers == 1 && s.prefetched == 0 && s.waited == 0, "stats after one fetch");
    require(s.gathered_bytes == mine.nbytes(rank == 0 ? 3 : 2), "the bytes of the one chunk received");
    require(s.landed_on_device == 1, "the device has room: installed there");
    const size_t received = rank == 0 ? 3 : 2;
    require(mine.store->location(mine.chunks[received]) == Location::kDevice, "on the device");

    shards.fetch(mine.chunks[2]);  // present already: no collective
    require(comm->all_gathers == 1, "a present group is not gathered again");

    // A prefetch starts the gather, a second one does nothing, the fetch finds it on its way.
    shards.prefetch(mine.chunks[0]);
    shards.prefetch(mine.chunks[1]);
    require(comm->all_gathers == 2, "one gather for the group however often prefetched");
    shards.fetch(mine.chunks[1]);
    s = shards.stats();
    require(s.gathers == 2 && s.prefetched == 1 && s.waited == 1, "the fetch waited for the prefetch's gather");
    require(mine.holds(0, value(0, 0)) && mine.holds(1, value(1, 1)), "group 0 holds its owners' values");

    // A prefetch no use claims (a part the step skipped): given up with its group, its bytes counted as
    // received for nothing. (Group 1 given up first: a present group is not prefetched.)
    shards.release(mine.chunks[2]);
    shards.prefetch(mine.chunks[2]);
    require(shards.remote(mine.chunks[2]), "a group on its way is still remote");
    shards.release(mine.chunks[2]);
    s = shards.stats();
    require(s.gathers == 3 && s.prefetched == 2 && s.unclaimed == 1, "one prefetch unclaimed");
    require(s.unclaimed_bytes == mine.nbytes(received), "the bytes the unclaimed gather received");
    require(s.gathered_bytes == mine.nbytes(received) * 2 + mine.nbytes(1 - rank), "counted as received too");
    require(mine.store->location(mine.chunks[received]) == Location::kNone, "nothing installed");

    // The last group has one member (chunk 4, rank 0's): rank 1 contributes nothing but joins.
    shards.fetch_all();
    require(!shards.any_remote() && shards.present_bytes() == all_bytes, "fetch_all: everything present");
    require(mine.holds(4, value(4, 0)), "chunk 4 is rank 0's");
    require(comm->all_gathers == 5, "fetch_all gathered the two remote groups left");

    // An owner's new values (an update) reach the other rank at the next gather.
    for (size_t i = 0; i < kNumels.size(); ++i) {
      if (shards.owned(i)) mine.store->payload(mine.chunks[i]).fill_(-value(i, rank));
    }
    shards.release_all();
    shards.fetch_all();
    for (size_t i = 0; i < kNumels.size(); ++i) {
      require(mine.holds(i, -value(i, static_cast<int>(i % 2))), "chunk " + std::to_string(i) + ": the owner's update");
    }
    (void)other;
    stats[rank] = shards.stats();
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  // Per rank: 8 gathers (fetch, prefetch, the unclaimed one, 2 + 3 by fetch_all); rank 0 received chunk
  // 1 twice and chunk 3 four times (once unclaimed); rank 1 chunks 0 and 4 twice, chunk 2 four times.
  EXPECT_EQ(stats[0].gathers, 8);
  EXPECT_EQ(stats[0].gathered_bytes, (2 * 64 + 4 * 64) * 4);
  EXPECT_EQ(stats[1].gathered_bytes, (2 * 64 + 2 * 48 + 4 * 32) * 4);
  EXPECT_EQ(stats[0].unclaimed, 1);
  EXPECT_EQ(stats[1].unclaimed, 1);
  // 2 + 1 chunks (rank 1: 3 + 1): the unclaimed gather installed nothing to give up.
  EXPECT_EQ(stats[0].released_chunks, 2 * 2 + 1);
  EXPECT_EQ(stats[1].released_chunks, 2 * 3 + 1);
}

// A gathered chunk goes to the device when it has room, else to the host (never an OutOfMemoryError).
TEST(ParamShards, AGatheredChunkLandsOnTheHostWhenTheDeviceHasNoRoom) {
  const auto errors = run_ranks(2, [](int rank, std::shared_ptr<FakeCommunicator> comm) {
    RankChunks mine(rank, /*device_budget=*/64);  // smaller than any chunk; every chunk starts on the host
    ParamShards shards(*mine.store, mine.chunks, comm);
    shards.release_all();
    shards.fetch_all();
    const auto s = shards.stats();
    require(s.landed_on_device == 0, "no room on the device");
    for (size_t i = 0; i < kNumels.size(); ++i) {
      require(mine.store->location(mine.chunks[i]) == Location::kHost, "on the host");
      require(mine.holds(i, value(i, static_cast<int>(i % 2))), "the owner's values");
    }
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// The send guard runs, with the layout index of this rank's member, before the gather reads that
// chunk: what the guard writes (an update finishing) is what the other rank receives. A rank without a
// member in a group (the last, short one) does not call it.
TEST(ParamShards, TheSendGuardRunsBeforeTheOwnedChunkIsRead) {
  std::vector<std::vector<int64_t>> guarded(2);
  const auto errors = run_ranks(2, [&](int rank, std::shared_ptr<FakeCommunicator> comm) {
    RankChunks mine(rank);
    ParamShards shards(*mine.store, mine.chunks, comm);
    shards.set_send_guard([&, rank](int64_t index) {
      guarded[rank].push_back(index);
      mine.store->payload(mine.chunks[index]).fill_(1000 + value(index, rank));  // the update lands now
    });
    shards.release_all();
    require(guarded[rank].empty(), "a release sends nothing");
    shards.prefetch(mine.chunks[0]);  // a prefetch is a gather too: it waits for the guard
    shards.fetch(mine.chunks[0]);
    shards.fetch_all();
    for (size_t i = 0; i < kNumels.size(); ++i) {
      require(mine.holds(i, 1000 + value(i, static_cast<int>(i % 2))), "chunk " + std::to_string(i) + ": sent after the guard");
    }
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  EXPECT_EQ(guarded[0], (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(guarded[1], (std::vector<int64_t>{1, 3})) << "no member in group 2";
}

// RemoteChunks::release: a member with a tensor in COMPUTE keeps its payload, and the next fetch
// rewrites it with the owner's values.
TEST(ParamShards, AMemberInComputeKeepsItsPayloadAndTheNextFetchRewritesIt) {
  const auto errors = run_ranks(2, [](int rank, std::shared_ptr<FakeCommunicator> comm) {
    RankChunks mine(rank);
    ParamShards shards(*mine.store, mine.chunks, comm);
    const size_t theirs = rank == 0 ? 1 : 0;  // the other rank's member of group 0
    const TensorId in_use = mine.tensors[theirs][0];
    mine.store->access(in_use);
    shards.release(mine.chunks[0]);  // every rank, the same point
    require(mine.store->location(mine.chunks[theirs]) != Location::kNone, "in COMPUTE: kept");
    require(shards.remote(mine.chunks[theirs]), "but its group is remote");
    require(shards.stats().released_chunks == 0, "nothing given up");
    // The owner updates its member; the user here writes garbage into the kept copy.
    mine.store->payload(mine.chunks[1 - theirs]).fill_(-1);
    mine.store->payload(mine.chunks[theirs]).fill_(12345);
    mine.store->release(in_use, TensorState::kHold);
    shards.fetch(mine.chunks[theirs]);
    require(mine.holds(theirs, -1), "rewritten with the owner's current values");
    require(mine.holds(1 - theirs, -1), "the owned one as the owner left it");
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Ranks that use the parameters in different orders gather different groups at the same collective:
// each rank fails naming both groups instead of installing another group's bytes.
TEST(ParamShards, RanksGatheringDifferentGroupsFailNamingBoth) {
  const auto errors = run_ranks(2, [](int rank, std::shared_ptr<FakeCommunicator> comm) {
    RankChunks mine(rank);
    ParamShards shards(*mine.store, mine.chunks, comm);
    shards.release_all();
    shards.fetch(mine.chunks[rank == 0 ? 0 : 2]);
  });
  EXPECT_NE(errors[0].find("rank 0 gathered the parameter chunks of group 0 while rank 1 gathered group 1"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("rank 1 gathered the parameter chunks of group 1 while rank 0 gathered group 0"),
            std::string::npos)
      << errors[1];
  EXPECT_NE(errors[0].find("different orders"), std::string::npos) << errors[0];
}

// The same where the mismatched gathers were prefetches that no use claimed (ranks that said different
// skips ahead, ferry::will_skip: one prefetched a group the other's step skips): the release that
// completes them finds the mismatch.
TEST(ParamShards, UnclaimedGathersOfDifferentGroupsFailNamingBoth) {
  const auto errors = run_ranks(2, [](int rank, std::shared_ptr<FakeCommunicator> comm) {
    RankChunks mine(rank);
    ParamShards shards(*mine.store, mine.chunks, comm);
    shards.release_all();
    const ChunkId prefetched = mine.chunks[rank == 0 ? 0 : 2];
    shards.prefetch(prefetched);
    shards.release(prefetched);
  });
  EXPECT_NE(errors[0].find("rank 0 gathered the parameter chunks of group 0 while rank 1 gathered group 1"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("said different skips ahead"), std::string::npos) << errors[1];
}

// At N = 1 every chunk is owned: a release gives nothing up (the group still counts as not gathered,
// so the next use joins a gather of one).
TEST(ParamShards, AWorldOfOneOwnsEverything) {
  const auto errors = run_ranks(1, [](int, std::shared_ptr<FakeCommunicator> comm) {
    RankChunks mine(0);
    ParamShards shards(*mine.store, mine.chunks, comm);
    require(shards.num_groups() == 5, "one chunk per group");
    for (int64_t i = 0; i < 5; ++i) require(shards.owned(i), "owned");
    require(shards.group(mine.chunks[2]) == std::vector<ChunkId>{mine.chunks[2]}, "a group of one");
    const int64_t bytes = shards.present_bytes();
    shards.release_all();
    require(shards.present_bytes() == bytes && shards.stats().released_chunks == 0, "nothing given up");
    shards.fetch_all();
    require(!shards.any_remote() && shards.stats().gathered_bytes == 0, "nothing received");
    for (size_t i = 0; i < kNumels.size(); ++i) require(mine.holds(i, value(i, 0)), "values unchanged");
  });
  EXPECT_EQ(errors[0], "");
}

TEST(ParamShards, BadInputIsRefusedNamingIt) {
  const auto errors = run_ranks(1, [](int, std::shared_ptr<FakeCommunicator> comm) {
    RankChunks mine(0);
    auto has = [](const std::string& msg, const std::string& what) {
      require(msg.find(what) != std::string::npos, "expected '" + what + "', got '" + msg + "'");
    };
    has(error_of([&] { ParamShards(*mine.store, mine.chunks, nullptr); }), "ParamShards needs a communicator");
    has(error_of([&] { ParamShards(*mine.store, {mine.chunks[0], mine.chunks[0]}, comm); }),
        "chunk id " + std::to_string(mine.chunks[0]) + " out of range or given twice");
    has(error_of([&] { ParamShards(*mine.store, {mine.chunks[0], 99}, comm); }), "chunk id 99 out of range or given twice");
    const ChunkId empty = mine.store->add_chunk(ChunkRole::kParam, at::kFloat, 16, Location::kNone);
    has(error_of([&] { ParamShards(*mine.store, {mine.chunks[0], empty}, comm); }),
        "parameter chunk 1 has no payload; every chunk must be present when sharding starts");
    ParamShards shards(*mine.store, mine.chunks, comm);
    has(error_of([&] { shards.fetch(mine.other); }), "chunk " + std::to_string(mine.other) + " is not a sharded parameter chunk");
    has(error_of([&] { shards.release(-1); }), "chunk -1 is not a sharded parameter chunk");
    has(error_of([&] { (void)shards.group(mine.other); }), "is not a sharded parameter chunk");
  });
  EXPECT_EQ(errors[0], "");
}

}  // namespace
}  // namespace ferry
