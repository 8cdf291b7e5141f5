// AccessTrace: what record() keeps, backward_start (unset: size()), clear(), first_use_order,
// non_model_at / non_model_peak windows, run_end, and next_use against a brute-force scan of the
// sequence (wrapping into the next iteration) on random traces, before and after remap_chunks.
// (Hand-computed cases of next_use and belady_moves are in test_scheduler.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "../../scheduler/access_trace.h"

namespace ferry {
namespace {

// The definition, by scanning: the first q >= position using `chunk`; else its first use + size();
// kNever if the trace never uses it.
int64_t next_use_by_scan(const std::vector<ChunkId>& chunks, ChunkId chunk, int64_t position) {
  const int64_t n = static_cast<int64_t>(chunks.size());
  for (int64_t q = std::max<int64_t>(position, 0); q < n; ++q) {
    if (chunks[q] == chunk) return q;
  }
  for (int64_t q = 0; q < n; ++q) {
    if (chunks[q] == chunk) return q + n;
  }
  return AccessTrace::kNever;
}

TEST(AccessTrace, RecordKeepsTensorChunkAndNonModelBytes) {
  AccessTrace t;
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.size(), 0);
  EXPECT_EQ(t.backward_start(), 0) << "unset: size()";
  t.record(5, 1, 100);
  t.record(6, 1, 300);
  t.record(2, 0, 200);
  EXPECT_FALSE(t.empty());
  EXPECT_EQ(t.size(), 3);
  EXPECT_EQ(t.tensor_at(0), 5);
  EXPECT_EQ(t.chunk_at(2), 0);
  EXPECT_EQ(t.non_model_at(1), 300);
  EXPECT_EQ(t.tensors(), (std::vector<TensorId>{5, 6, 2}));
  EXPECT_EQ(t.chunks(), (std::vector<ChunkId>{1, 1, 0}));
  EXPECT_EQ(t.backward_start(), 3) << "a forward-only iteration: backward starts at the end";
}

TEST(AccessTrace, BackwardStartIsTheNextPositionRecordedAndClearResetsIt) {
  AccessTrace t;
  t.record(0, 0, 0);
  t.record(1, 1, 0);
  t.mark_backward_start();
  EXPECT_EQ(t.backward_start(), 2);
  t.record(1, 1, 0);
  t.record(0, 0, 0);
  EXPECT_EQ(t.backward_start(), 2) << "the first use in backward, not the end";
  t.clear();
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.backward_start(), 0) << "cleared: unset again";
  t.record(3, 0, 0);
  EXPECT_EQ(t.backward_start(), 1);
  t.finalize(1);
  EXPECT_EQ(t.next_use(0, 0), 0);
  EXPECT_EQ(t.next_use(0, 1), 1) << "the next iteration's first use";
}

TEST(AccessTrace, FirstUseOrderListsEachTensorOnceInOrderOfFirstUse) {
  AccessTrace t;
  for (TensorId id : {4, 1, 4, 0, 1, 9, 2, -1}) t.record(id, 0, 0);
  EXPECT_EQ(t.first_use_order(5), (std::vector<TensorId>{4, 1, 0, 2})) << "9 and -1 are out of range; 3 unused";
  EXPECT_EQ(t.first_use_order(10), (std::vector<TensorId>{4, 1, 0, 9, 2}));
  EXPECT_TRUE(t.first_use_order(0).empty());
}

TEST(AccessTrace, NonModelPeakIsTheLargestInTheWindowClippedToTheTrace) {
  AccessTrace t;
  const std::vector<int64_t> non_model = {5, 1, 9, 3, 7, 2};
  for (size_t i = 0; i < non_model.size(); ++i) t.record(0, 0, non_model[i]);
  for (int64_t p = -2; p < 8; ++p) {
    for (int64_t w = 0; w < 9; ++w) {
      int64_t want = 0;
      for (int64_t q = std::max<int64_t>(p, 0); q < std::min<int64_t>(p + w, 6); ++q) want = std::max(want, non_model[q]);
      EXPECT_EQ(t.non_model_peak(p, w), want) << "position " << p << " window " << w;
    }
  }
}

// next_use and run_end on random traces against their definitions by scanning.
TEST(AccessTrace, NextUseAndRunEndEqualTheirDefinitionsOnRandomTraces) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int num_chunks = 1 + static_cast<int>(rng() % 6);
    const int length = 1 + static_cast<int>(rng() % 30);
    std::vector<ChunkId> chunks;
    AccessTrace t;
    for (int i = 0; i < length; ++i) {
      // Chunks 0 .. num_chunks - 1, the last one never used (kNever), runs of repeats now and then.
      const ChunkId c = (!chunks.empty() && rng() % 3 == 0) ? chunks.back()
                                                            : static_cast<ChunkId>(rng() % std::max(1, num_chunks - 1));
      chunks.push_back(c);
      t.record(i, c, 0);
    }
    t.finalize(num_chunks + 1);
    SCOPED_TRACE("trial " + std::to_string(trial));
    for (ChunkId c = -1; c <= num_chunks + 1; ++c) {
      for (int64_t p = 0; p <= length; ++p) {
        const int64_t want = c < 0 || c > num_chunks ? AccessTrace::kNever : next_use_by_scan(chunks, c, p);
        ASSERT_EQ(t.next_use(c, p), want) << "chunk " << c << " at " << p;
      }
    }
    for (int64_t p = 0; p < length; ++p) {
      int64_t end = p + 1;
      while (end < length && chunks[end] == chunks[p]) ++end;
      ASSERT_EQ(t.run_end(p), end) << "position " << p;
    }
  }
}

// With positions passed over in this iteration: the first q >= position not passed over, else the
// chunk's first use in the next iteration (which passes over nothing); from a position in the next
// iteration the mask does not apply.
TEST(AccessTrace, NextUseSkipsPassedOverPositionsOfThisIterationOnly) {
  std::mt19937_64 rng(12);
  for (int trial = 0; trial < 200; ++trial) {
    const int num_chunks = 1 + static_cast<int>(rng() % 5);
    const int length = 1 + static_cast<int>(rng() % 30);
    std::vector<ChunkId> chunks;
    std::vector<char> over(length, 0);
    AccessTrace t;
    for (int i = 0; i < length; ++i) {
      chunks.push_back(static_cast<ChunkId>(rng() % num_chunks));
      over[i] = rng() % 3 == 0 ? 1 : 0;
      t.record(i, chunks.back(), 0);
    }
    t.finalize(num_chunks);
    SCOPED_TRACE("trial " + std::to_string(trial));
    for (ChunkId c = 0; c < num_chunks; ++c) {
      for (int64_t p = 0; p <= 2 * length; ++p) {
        int64_t want = next_use_by_scan(chunks, c, p >= length ? p - length : p);
        if (p >= length && want != AccessTrace::kNever) want += length;
        if (p < length) {
          want = AccessTrace::kNever;
          for (int64_t q = p; q < length && want == AccessTrace::kNever; ++q) {
            if (chunks[q] == c && !over[q]) want = q;
          }
          if (want == AccessTrace::kNever) {
            for (int64_t q = 0; q < length && want == AccessTrace::kNever; ++q) {
              if (chunks[q] == c) want = q + length;
            }
          }
        }
        ASSERT_EQ(t.next_use(c, p, &over), want) << "chunk " << c << " at " << p;
      }
    }
  }
}

// The header: next_use is "the first position q >= position" with iterations repeating. For a position
// past the trace's end (in the next iteration; OptEvictionPolicy asks for them when a prefetch's
// incoming chunk is next used there) it answered the chunk's first use + size() even when that was
// before the position (found by this test, 2026-11-26; what it cost: test_opt_policy.cpp,
// APrefetchIntoTheNextIterationFollowsBeladyThere).
TEST(AccessTrace, NextUseFromAPositionInTheNextIterationIsNotBeforeIt) {
  AccessTrace t;
  for (ChunkId c : {0, 1, 0, 1}) t.record(c, c, 0);
  t.finalize(2);
  EXPECT_EQ(t.next_use(0, 4), 4);
  EXPECT_EQ(t.next_use(0, 5), 6) << "position 5 is position 1 of the next iteration: chunk 0 next at its 2";
  EXPECT_EQ(t.next_use(1, 6), 7);
}

// Never is never: next_use from kNever (OptEvictionPolicy asked it, for a prefetch whose incoming chunk
// is next used "never", until 2026-12-02: UBSan's signed overflow in CI) or from just below it answers
// kNever, not a position past what int64_t holds.
TEST(AccessTrace, NextUseFromNeverIsNever) {
  AccessTrace t;
  for (ChunkId c : {0, 1, 0, 1}) t.record(c, c, 0);
  t.finalize(2);
  EXPECT_EQ(t.next_use(1, AccessTrace::kNever), AccessTrace::kNever);
  EXPECT_EQ(t.next_use(0, AccessTrace::kNever), AccessTrace::kNever) << "its iteration after's first use";
  EXPECT_EQ(t.next_use(0, AccessTrace::kNever - 1), AccessTrace::kNever);
  EXPECT_EQ(t.next_use(1, AccessTrace::kNever - 8), AccessTrace::kNever - 8)
      << "two iterations below the edge a position still answers (there, position 3 of its iteration)";
  EXPECT_EQ(t.next_use(1, 1000), 1001);
}

// After a repack the tensors live in other chunks: remap_chunks rewrites every position's chunk from
// its tensor, and after finalize() next_use answers for the new chunks.
TEST(AccessTrace, RemapChunksFollowsTheTensorsIntoTheirNewChunks) {
  AccessTrace t;
  // tensors 0..3 in chunks 0, 0, 1, 1
  const std::vector<TensorId> tensors = {0, 2, 1, 3, 2, 0};
  const std::vector<ChunkId> old_chunk = {0, 0, 1, 1};
  for (TensorId id : tensors) t.record(id, old_chunk[id], 0);
  t.finalize(2);
  EXPECT_EQ(t.next_use(1, 0), 1);
  // Repacked: tensor 0 -> chunk 2, 1 -> chunk 0, 2 -> chunk 1, 3 -> chunk 0.
  const std::vector<ChunkId> new_chunk = {2, 0, 1, 0};
  t.remap_chunks(new_chunk);
  t.finalize(3);
  std::vector<ChunkId> want;
  for (TensorId id : tensors) want.push_back(new_chunk[id]);
  EXPECT_EQ(t.chunks(), want);
  EXPECT_EQ(t.tensors(), tensors) << "the tensors stay";
  for (ChunkId c = 0; c < 3; ++c) {
    for (int64_t p = 0; p <= t.size(); ++p) EXPECT_EQ(t.next_use(c, p), next_use_by_scan(want, c, p)) << c << " " << p;
  }
  EXPECT_EQ(t.run_end(2), 4) << "positions 2 and 3 (tensors 1 and 3) now share chunk 0";
}

}  // namespace
}  // namespace ferry
