// Packing (order, offsets, alignment, oversize tensors, waste), the chunk-size search, and the
// communication-group layout, against hand-computed cases and randomized invariants.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>

#include "../../chunk/layout.h"
#include "../test_util.h"

namespace ferry {
namespace {

PackOptions opts(int64_t chunk, int64_t align) {
  PackOptions o;
  o.chunk_numel = chunk;
  o.align_numel = align;
  return o;
}

TEST(Pack, OffsetsFollowOrderAndAlignment) {
  const auto layout = ChunkLayout::pack({10, 20, 5}, {}, opts(64, 16));
  ASSERT_EQ(layout.num_chunks(), 1);
  EXPECT_EQ(layout.slots()[0].offset, 0);
  EXPECT_EQ(layout.slots()[1].offset, 16);
  EXPECT_EQ(layout.slots()[2].offset, 48);  // 16 + 20 = 36 -> 48
  EXPECT_EQ(layout.chunks()[0].tensors, (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(layout.used_numel(), 35);
  EXPECT_EQ(layout.allocated_numel(), 64);
  EXPECT_DOUBLE_EQ(layout.waste(), 29.0 / 64.0);

  const auto reordered = ChunkLayout::pack({10, 20, 5}, {2, 0, 1}, opts(64, 16));
  EXPECT_EQ(reordered.slots()[2].offset, 0);
  EXPECT_EQ(reordered.slots()[0].offset, 16);
  EXPECT_EQ(reordered.slots()[1].offset, 32);
  EXPECT_EQ(reordered.chunks()[0].tensors, (std::vector<int64_t>{2, 0, 1}));
}

TEST(Pack, OpensANewChunkWhenATensorDoesNotFit) {
  const auto layout = ChunkLayout::pack({40, 30, 64, 1}, {}, opts(64, 16));
  ASSERT_EQ(layout.num_chunks(), 4);
  EXPECT_EQ(layout.slots()[0].chunk, 0);
  EXPECT_EQ(layout.slots()[1].chunk, 1);  // 48 + 30 > 64
  EXPECT_EQ(layout.slots()[2].chunk, 2);  // 32 + 64 > 64; exactly one chunk is not oversize
  EXPECT_FALSE(layout.chunks()[2].dedicated);
  EXPECT_EQ(layout.slots()[3].chunk, 3);
  EXPECT_EQ(layout.allocated_numel(), 4 * 64);
}

TEST(Pack, OversizeTensorGetsADedicatedChunkOfItsOwnSize) {
  const auto layout = ChunkLayout::pack({10, 100, 10}, {}, opts(64, 16));
  ASSERT_EQ(layout.num_chunks(), 3);
  EXPECT_EQ(layout.chunks()[1].numel, 112);  // 100 rounded up to the alignment
  EXPECT_TRUE(layout.chunks()[1].dedicated);
  EXPECT_EQ(layout.slots()[1].chunk, 1);
  EXPECT_EQ(layout.slots()[1].offset, 0);
  EXPECT_EQ(layout.slots()[2].chunk, 2);  // the dedicated chunk closed chunk 0: indices follow order
  EXPECT_EQ(layout.allocated_numel(), 64 + 112 + 64);
  EXPECT_EQ(layout.used_numel(), 120);
}

TEST(Pack, ZeroElementTensorsTakeNoSpace) {
  const auto layout = ChunkLayout::pack({0, 16, 0, 16}, {}, opts(32, 16));
  ASSERT_EQ(layout.num_chunks(), 1);
  EXPECT_EQ(layout.slots()[1].offset, 0);
  EXPECT_EQ(layout.slots()[3].offset, 16);
  EXPECT_DOUBLE_EQ(layout.waste(), 0.0);
  EXPECT_EQ(ChunkLayout::pack({}, {}, opts(32, 16)).num_chunks(), 0);
  EXPECT_DOUBLE_EQ(ChunkLayout::pack({}, {}, opts(32, 16)).waste(), 0.0);
}

TEST(Pack, BadInputIsRejected) {
  EXPECT_THROW(ChunkLayout::pack({1, 2}, {0}, opts(64, 16)), c10::Error);      // order too short
  EXPECT_THROW(ChunkLayout::pack({1, 2}, {0, 0}, opts(64, 16)), c10::Error);   // repeated
  EXPECT_THROW(ChunkLayout::pack({1, 2}, {0, 2}, opts(64, 16)), c10::Error);   // out of range
  EXPECT_THROW(ChunkLayout::pack({-1}, {}, opts(64, 16)), c10::Error);         // negative
  EXPECT_THROW(ChunkLayout::pack({1}, {}, opts(60, 16)), c10::Error);          // capacity not aligned
  EXPECT_THROW(ChunkLayout::pack({1}, {}, opts(64, 0)), c10::Error);
  try {
    ChunkLayout::pack({1, 2}, {1, 1}, opts(64, 16));
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("lists tensor 1 twice"), std::string::npos) << e.what();
  }
}

TEST(PackOptions, FromBytes) {
  const auto bf16 = PackOptions::from_bytes(int64_t{64} << 20, at::kBFloat16);
  EXPECT_EQ(bf16.chunk_numel, int64_t{32} << 20);
  EXPECT_EQ(bf16.align_numel, 32);  // 64 bytes of bf16
  const auto fp32 = PackOptions::from_bytes(int64_t{64} << 20, at::kFloat);
  EXPECT_EQ(fp32.chunk_numel, int64_t{16} << 20);
  EXPECT_EQ(fp32.align_numel, 16);
  EXPECT_EQ(PackOptions::from_bytes(100, at::kFloat).chunk_numel, 16);  // rounded down to alignment
  EXPECT_THROW(PackOptions::from_bytes(32, at::kFloat), c10::Error);
}

// Any numels, any order: slots are aligned, inside their chunk, disjoint, chunks appear in order and
// the waste is what the slots say.
TEST(Pack, RandomizedInvariants) {
  std::mt19937_64 rng(1234);
  for (int round = 0; round < 200; ++round) {
    const int n = std::uniform_int_distribution<int>(0, 40)(rng);
    const int64_t align = int64_t{1} << std::uniform_int_distribution<int>(0, 5)(rng);
    const int64_t chunk = align * std::uniform_int_distribution<int64_t>(1, 20)(rng);
    std::vector<int64_t> numels(n);
    for (auto& x : numels) x = std::uniform_int_distribution<int64_t>(0, chunk * 3 / 2)(rng);
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const auto layout = ChunkLayout::pack(numels, order, opts(chunk, align));
    int64_t used = 0, last_chunk = 0;
    for (int64_t index : order) {
      const Slot& s = layout.slots()[index];
      ASSERT_EQ(s.numel, numels[index]);
      ASSERT_GE(s.chunk, last_chunk) << "chunks must follow the order";
      last_chunk = s.chunk;
      ASSERT_EQ(s.offset % align, 0);
      ASSERT_LE(s.offset + s.numel, layout.chunks()[s.chunk].numel);
      used += s.numel;
    }
    for (const auto& c : layout.chunks()) {
      ASSERT_EQ(c.numel % align, 0);
      ASSERT_TRUE(c.dedicated ? c.numel >= chunk : c.numel == chunk);
      for (size_t a = 0; a < c.tensors.size(); ++a) {
        for (size_t b = a + 1; b < c.tensors.size(); ++b) {
          const Slot& x = layout.slots()[c.tensors[a]];
          const Slot& y = layout.slots()[c.tensors[b]];
          if (x.numel && y.numel) {
            ASSERT_TRUE(x.offset + x.numel <= y.offset || y.offset + y.numel <= x.offset);
          }
        }
      }
    }
    ASSERT_EQ(layout.used_numel(), used);
    if (layout.allocated_numel() > 0) {
      ASSERT_DOUBLE_EQ(layout.waste(), double(layout.allocated_numel() - used) / layout.allocated_numel());
    }
  }
}

TEST(ChunkSizeSearch, PicksLeastWaste) {
  // Three tensors of 48: chunk 48 packs one each (no waste), 96 packs two + one (waste 1/4),
  // 144 packs all three (no waste, one chunk: wins the tie on fewer chunks).
  const std::vector<int64_t> numels = {48, 48, 48};
  const auto search = search_chunk_size(numels, {}, 48, 160, 16, 16);
  EXPECT_EQ(search.best.chunk_numel, 144);
  EXPECT_EQ(search.best.num_chunks, 1);
  EXPECT_DOUBLE_EQ(search.best.waste, 0.0);
  ASSERT_EQ(search.tried.size(), 8u);  // 48, 64, ..., 160
  EXPECT_EQ(search.tried.front().chunk_numel, 48);
  EXPECT_EQ(search.tried.back().chunk_numel, 160);
  for (const auto& t : search.tried) {
    EXPECT_GE(t.waste, search.best.waste);
    if (t.chunk_numel == 96) {
      EXPECT_DOUBLE_EQ(t.waste, 48.0 / 192.0);  // two chunks of 96, 144 used
    }
  }
  EXPECT_THROW(search_chunk_size(numels, {}, 0, 10, 1, 1), c10::Error);
  EXPECT_THROW(search_chunk_size(numels, {}, 10, 5, 1, 1), c10::Error);
  EXPECT_THROW(search_chunk_size(numels, {}, 1, 10, 0, 1), c10::Error);
}

// D99: a device room caps the auto size so that it holds sixteen uses' worth of chunks; without a room
// (0) the choice is the uncapped one, and a room too large to bind changes nothing.
TEST(AutoChunkSize, TheDevicesRoomHoldsSixteenUses) {
  std::vector<int64_t> numels = {50304 * 64};  // an embedding, then GPT-2-shaped blocks of width 64
  for (int layer = 0; layer < 12; ++layer) {
    for (int64_t n : {64 * 192, 192, 64 * 64, 64, 64 * 256, 256, 256 * 64, 64, 64, 64}) numels.push_back(n);
  }
  const AutoChunkSize uncapped = auto_chunk_size(numels, {}, 4);
  EXPECT_FALSE(uncapped.capped);
  const AutoChunkSize no_room = auto_chunk_size(numels, {}, 4, auto_chunk_cap_bytes(0));
  EXPECT_EQ(auto_chunk_cap_bytes(0), 0);
  EXPECT_EQ(no_room.chunk_bytes, uncapped.chunk_bytes);
  for (const int64_t room : {int64_t{1} << 20, int64_t{4} << 20, int64_t{16} << 20, int64_t{1} << 30}) {
    for (const int64_t per_use : {1, 2, 8}) {
      const std::string what = "room " + std::to_string(room) + ", chunks per use " + std::to_string(per_use);
      const int64_t cap = auto_chunk_cap_bytes(room, per_use);
      EXPECT_EQ(cap, std::max<int64_t>(4096, room / kAutoChunksInRoom / per_use)) << what;
      const AutoChunkSize choice = auto_chunk_size(numels, {}, 4, cap);
      EXPECT_LE(choice.chunk_bytes, cap) << what;
      EXPECT_LE(choice.hi_bytes, cap) << what;
      EXPECT_GE(room / choice.chunk_bytes, kAutoChunksInRoom * per_use) << what;
      EXPECT_EQ(choice.capped, cap < uncapped.hi_bytes) << what;
      if (!choice.capped) {
        EXPECT_EQ(choice.chunk_bytes, uncapped.chunk_bytes) << what;
      }
      const PackOptions pack = PackOptions::from_bytes(choice.chunk_bytes, at::kFloat);
      EXPECT_NEAR(ChunkLayout::pack(numels, {}, pack).waste(), choice.waste, 1e-12) << what;
    }
  }
  // The room of a few KiB: 4 KiB chunks, the smallest Config allows; the embedding takes a dedicated one.
  EXPECT_EQ(auto_chunk_cap_bytes(16 << 10), 4096);
  EXPECT_EQ(auto_chunk_size(numels, {}, 4, 4096).chunk_bytes, 4096);
  EXPECT_THROW(auto_chunk_cap_bytes(-1), c10::Error);
  EXPECT_THROW(auto_chunk_cap_bytes(1 << 20, 0), c10::Error);
  EXPECT_THROW(auto_chunk_size(numels, {}, 4, -1), c10::Error);
}

TEST(CommGroups, LayoutForWorldSizesOneToEight) {
  for (int world = 1; world <= 8; ++world) {
    for (int64_t n = 0; n <= 20; ++n) {
      const CommGroups groups(n, world);
      ASSERT_EQ(groups.padded_num_chunks() % world, 0);
      ASSERT_GE(groups.padded_num_chunks(), n);
      ASSERT_LT(groups.padded_num_chunks() - n, world);
      std::vector<int> seen(groups.padded_num_chunks(), 0);
      for (int64_t g = 0; g < groups.num_groups(); ++g) {
        const auto members = groups.chunks_of_group(g);
        ASSERT_EQ(static_cast<int>(members.size()), world);
        for (int r = 0; r < world; ++r) {
          ASSERT_EQ(groups.group_of(members[r]), g);
          ASSERT_EQ(groups.owner_of(members[r]), r);
          ++seen[members[r]];
        }
      }
      for (int64_t c = 0; c < groups.padded_num_chunks(); ++c) {
        ASSERT_EQ(seen[c], 1);
        ASSERT_EQ(groups.is_padding(c), c >= n);
      }
      int64_t owned = 0;
      for (int r = 0; r < world; ++r) {
        const auto mine = groups.chunks_owned_by(r);
        ASSERT_EQ(static_cast<int64_t>(mine.size()), groups.num_groups());
        for (int64_t c : mine) ASSERT_EQ(groups.owner_of(c), r);
        owned += static_cast<int64_t>(mine.size());
      }
      ASSERT_EQ(owned, groups.padded_num_chunks());
    }
  }
  const CommGroups g(5, 4);  // hand-checked: 8 slots, groups {0,1,2,3} {4,5,6,7}, 5..7 padding
  EXPECT_EQ(g.chunks_of_group(1), (std::vector<int64_t>{4, 5, 6, 7}));
  EXPECT_EQ(g.chunks_owned_by(1), (std::vector<int64_t>{1, 5}));
  EXPECT_TRUE(g.is_padding(5));
  EXPECT_FALSE(g.is_padding(4));
  EXPECT_THROW(CommGroups(3, 0), c10::Error);
  EXPECT_THROW(g.owner_of(8), c10::Error);
  EXPECT_THROW(g.chunks_owned_by(4), c10::Error);
}

// derive(): the same chunks and tensors, each tensor's element count mapped, slots aligned, chunks as
// large as their tensors need (the compact state's scales, chunk/state_chunks.h).
TEST(ChunkLayout, DeriveKeepsChunksAndTensorsWithTheirOwnSizes) {
  PackOptions pack;
  pack.chunk_numel = 1024;
  pack.align_numel = 32;
  const ChunkLayout base = ChunkLayout::pack({500, 300, 0, 2000, 700, 10}, {}, pack);
  const ChunkLayout d = base.derive([](int64_t n) { return 2 * ((n + 255) / 256); }, 16);
  ASSERT_EQ(d.num_chunks(), base.num_chunks());
  for (int64_t c = 0; c < base.num_chunks(); ++c) {
    EXPECT_EQ(d.chunks()[c].tensors, base.chunks()[c].tensors) << c;
    EXPECT_EQ(d.chunks()[c].dedicated, base.chunks()[c].dedicated) << c;
    EXPECT_EQ(d.chunks()[c].numel % 16, 0) << c;
    EXPECT_GE(d.chunks()[c].numel, 16) << c;
  }
  const std::vector<int64_t> want = {4, 4, 0, 16, 6, 2};
  int64_t previous_end = 0, previous_chunk = -1;
  for (size_t j = 0; j < want.size(); ++j) {
    const Slot& s = d.slots()[j];
    EXPECT_EQ(s.numel, want[j]) << j;
    EXPECT_EQ(s.chunk, base.slots()[j].chunk) << j;
    EXPECT_EQ(s.offset % 16, 0) << j;
    if (s.chunk == previous_chunk) {
      EXPECT_GE(s.offset, previous_end) << j << " overlaps the tensor before it";
    }
    EXPECT_LE(s.offset + s.numel, d.chunks()[s.chunk].numel) << j;
    previous_end = s.offset + s.numel;
    previous_chunk = s.chunk;
  }
  EXPECT_ERROR_HAS(base.derive([](int64_t) { return -1; }, 16), "negative element count");
  EXPECT_ERROR_HAS(base.derive([](int64_t n) { return n; }, 0), "align_numel > 0");
}

// Slot::first_element names an element by the tensors laid end to end in index order: the same for
// every chunk size and packing order (the compact state's rounding stream, D86); a derived layout
// numbers its own element counts.
TEST(ChunkLayout, AnElementsNameDoesNotDependOnThePacking) {
  const std::vector<int64_t> numels = {500, 300, 0, 2000, 700, 10};
  const std::vector<int64_t> want = {0, 500, 800, 800, 2800, 3500};
  for (const int64_t chunk : {int64_t{1024}, int64_t{4096}}) {
    for (const std::vector<int64_t>& order : {std::vector<int64_t>{}, std::vector<int64_t>{5, 3, 1, 0, 4, 2}}) {
      PackOptions pack;
      pack.chunk_numel = chunk;
      pack.align_numel = 32;
      const ChunkLayout layout = ChunkLayout::pack(numels, order, pack);
      for (size_t j = 0; j < numels.size(); ++j) {
        EXPECT_EQ(layout.slots()[j].first_element, want[j]) << "chunk " << chunk << ", tensor " << j;
      }
    }
  }
  PackOptions pack;
  pack.chunk_numel = 1024;
  const ChunkLayout d = ChunkLayout::pack(numels, {}, pack).derive([](int64_t n) { return 2 * n; }, 16);
  for (size_t j = 0; j < numels.size(); ++j) EXPECT_EQ(d.slots()[j].first_element, 2 * want[j]) << j;
}

}  // namespace
}  // namespace ferry
