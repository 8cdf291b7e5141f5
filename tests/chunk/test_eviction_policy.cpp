// LRU picks least recently used first, ties by id, and stops once enough bytes are chosen.
#include <gtest/gtest.h>

#include "../../chunk/eviction_policy.h"

namespace ferry {
namespace {

TEST(LruEvictionPolicy, OldestFirstUntilEnough) {
  LruEvictionPolicy lru;
  EvictionRequest r;
  r.bytes_needed = 150;
  r.candidates = {{0, 100, 9}, {1, 100, 3}, {2, 100, 3}, {3, 100, 1}, {4, 100, 0}};
  EXPECT_EQ(lru.choose(r), (std::vector<ChunkId>{4, 3}));
  r.bytes_needed = 250;
  EXPECT_EQ(lru.choose(r), (std::vector<ChunkId>{4, 3, 1}));  // 1 before 2: same tick, lower id
  r.bytes_needed = 0;
  EXPECT_TRUE(lru.choose(r).empty());
  r.bytes_needed = 10000;
  EXPECT_EQ(lru.choose(r).size(), 5u);  // all it has; the store then reports out of memory
}

}  // namespace
}  // namespace ferry
