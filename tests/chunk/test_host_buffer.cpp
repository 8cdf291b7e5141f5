// HostBufferPool (unpinned: no GPU needed): buffers of exactly the size asked for, reuse by exact size
// only (the same memory comes back), the cache bounded by max_cached_bytes with the oldest released
// buffers going first, trim / set_max_cached_bytes / give_cached_to, every stats field against a count
// kept by hand, and the errors for bad sizes and foreign buffers.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "../../chunk/host_buffer.h"
#include "../test_util.h"

namespace ferry {
namespace {

using test::error_of;

void expect_stats(const HostBufferPool& pool, int64_t in_use, int64_t cached, int64_t peak, int64_t allocations,
                  int64_t reuses) {
  const HostBufferStats s = pool.stats();
  EXPECT_EQ(s.in_use_bytes, in_use);
  EXPECT_EQ(s.cached_bytes, cached);
  EXPECT_EQ(s.peak_reserved_bytes, peak);
  EXPECT_EQ(s.allocations, allocations);
  EXPECT_EQ(s.reuses, reuses);
}

TEST(HostBufferPool, BuffersHaveExactlyTheSizeAskedFor) {
  HostBufferPool pool(/*pinned=*/false, 1 << 20);
  EXPECT_FALSE(pool.pinned());
  for (int64_t n : {1, 7, 4096, 4097, (1 << 20) + 3}) {
    at::Tensor b = pool.acquire(n);
    EXPECT_EQ(b.numel(), n);
    EXPECT_EQ(b.scalar_type(), at::kByte);
    EXPECT_EQ(b.dim(), 1);
    EXPECT_TRUE(b.device().is_cpu());
    EXPECT_TRUE(b.is_contiguous());
    EXPECT_EQ(b.storage().nbytes(), static_cast<size_t>(n)) << "no rounding up";
    b.fill_(0xAB);  // writable over its whole length
    EXPECT_EQ(b[n - 1].item<uint8_t>(), 0xAB);
    pool.release(b);
    EXPECT_FALSE(b.defined()) << "release resets the caller's handle";
  }
  EXPECT_EQ(pool.stats().in_use_bytes, 0);
}

TEST(HostBufferPool, ReleasedBuffersAreReusedByExactSizeOnly) {
  HostBufferPool pool(false, 1 << 20);
  at::Tensor a = pool.acquire(1000);
  const void* mem = a.data_ptr();
  expect_stats(pool, 1000, 0, 1000, 1, 0);
  pool.release(a);
  expect_stats(pool, 0, 1000, 1000, 1, 0);
  at::Tensor other = pool.acquire(1001);  // another size: a fresh allocation, the 1000 stays cached
  EXPECT_NE(other.data_ptr(), mem);
  expect_stats(pool, 1001, 1000, 2001, 2, 0);
  at::Tensor again = pool.acquire(1000);
  EXPECT_EQ(again.data_ptr(), mem) << "the cached buffer of that size comes back";
  expect_stats(pool, 2001, 0, 2001, 2, 1);
  pool.release(again);
  pool.release(other);
  expect_stats(pool, 0, 2001, 2001, 2, 1);
}

// The cache keeps at most max_cached_bytes; over it, the buffers released longest ago go first. A
// buffer larger than the limit is freed at its release.
TEST(HostBufferPool, TheCacheIsBoundedAndDropsTheOldestFirst) {
  HostBufferPool pool(false, 1000);
  EXPECT_EQ(pool.max_cached_bytes(), 1000);
  at::Tensor a = pool.acquire(300), b = pool.acquire(400), c = pool.acquire(500);
  const void* b_mem = b.data_ptr();
  const void* c_mem = c.data_ptr();
  pool.release(a);  // cached 300
  pool.release(b);  // 700
  pool.release(c);  // 1200 > 1000: a (the oldest) goes -> 900
  expect_stats(pool, 0, 900, 1200, 3, 0);
  at::Tensor a2 = pool.acquire(300);
  expect_stats(pool, 300, 900, 1200, 4, 0);  // a was freed: a fresh allocation
  at::Tensor b2 = pool.acquire(400);
  EXPECT_EQ(b2.data_ptr(), b_mem);
  at::Tensor c2 = pool.acquire(500);
  EXPECT_EQ(c2.data_ptr(), c_mem);
  expect_stats(pool, 1200, 0, 1200, 4, 2);
  at::Tensor big = pool.acquire(1001);
  pool.release(big);  // larger than the whole cache: freed at once
  EXPECT_EQ(pool.stats().cached_bytes, 0);
  EXPECT_EQ(pool.stats().in_use_bytes, 1200);
  // Two buffers of one size: the older one is trimmed first, the newer one is handed out first.
  pool.release(b2);  // 400 (older)
  at::Tensor b3 = pool.acquire(400);
  EXPECT_EQ(b3.data_ptr(), b_mem);
  at::Tensor d = pool.acquire(400);
  const void* d_mem = d.data_ptr();
  pool.release(b3);  // cached: b (older), then d
  pool.release(d);
  pool.release(a2);  // 400 + 400 + 300 = 1100 > 1000: b goes
  EXPECT_EQ(pool.stats().cached_bytes, 700);
  at::Tensor e = pool.acquire(400);
  EXPECT_EQ(e.data_ptr(), d_mem) << "the newer 400-byte buffer was kept";
  pool.release(e);
  pool.release(c2);
}

TEST(HostBufferPool, TrimAndSetMaxCachedBytes) {
  HostBufferPool pool(false, 1 << 20);
  std::vector<at::Tensor> held;
  for (int64_t n : {100, 200, 300, 400}) held.push_back(pool.acquire(n));
  for (auto& t : held) pool.release(t);
  EXPECT_EQ(pool.stats().cached_bytes, 1000);
  pool.set_max_cached_bytes(750);  // trims at once, oldest first: 100 and 200 go
  EXPECT_EQ(pool.max_cached_bytes(), 750);
  EXPECT_EQ(pool.stats().cached_bytes, 700);
  const int64_t allocations = pool.stats().allocations;
  at::Tensor t = pool.acquire(100);
  EXPECT_EQ(pool.stats().allocations, allocations + 1) << "the 100-byte buffer was trimmed";
  pool.release(t);  // 800 > 750: 300 (the oldest left) goes -> 500
  EXPECT_EQ(pool.stats().cached_bytes, 500);
  pool.trim();
  EXPECT_EQ(pool.stats().cached_bytes, 0);
  EXPECT_EQ(pool.max_cached_bytes(), 750) << "trim empties the cache, not the limit";
  EXPECT_EQ(pool.stats().peak_reserved_bytes, 1000);
  EXPECT_ERROR_HAS(pool.set_max_cached_bytes(-1), "max_cached_bytes must be >= 0, got -1");
  EXPECT_EQ(pool.max_cached_bytes(), 750);
  pool.set_max_cached_bytes(0);  // caches nothing from now on
  at::Tensor u = pool.acquire(64);
  pool.release(u);
  EXPECT_EQ(pool.stats().cached_bytes, 0);
}

TEST(HostBufferPool, GiveCachedToMovesTheCacheIntoAnotherPool) {
  HostBufferPool from(false, 1 << 20), to(false, 600);
  at::Tensor a = from.acquire(200), b = from.acquire(300), c = from.acquire(400);
  const void* c_mem = c.data_ptr();
  from.release(a);
  from.release(b);
  from.release(c);
  EXPECT_EQ(from.give_cached_to(from), 0) << "not to itself";
  EXPECT_EQ(from.stats().cached_bytes, 900);
  EXPECT_EQ(from.give_cached_to(to), 900) << "the bytes moved (before the receiver trims)";
  EXPECT_EQ(from.stats().cached_bytes, 0);
  // The receiver keeps up to its own limit, the oldest released (a) going first: 300 + 400 > 600 too,
  // so b goes as well.
  EXPECT_EQ(to.stats().cached_bytes, 400);
  EXPECT_EQ(to.stats().peak_reserved_bytes, 900) << "it held all 900 before trimming";
  at::Tensor c2 = to.acquire(400);
  EXPECT_EQ(c2.data_ptr(), c_mem) << "the receiver hands out the giver's buffer";
  EXPECT_EQ(to.stats().reuses, 1);
  EXPECT_EQ(to.stats().allocations, 0);
  at::Tensor b2 = to.acquire(300);  // b was trimmed by the receiver: a fresh allocation
  EXPECT_EQ(to.stats().allocations, 1);
  to.release(c2);
  to.release(b2);
  EXPECT_EQ(from.give_cached_to(to), 0) << "nothing cached";
  // Pools that pin differently keep their buffers (a pinned pool allocates nothing until asked).
  HostBufferPool pinned_like(false, 1 << 20);
  at::Tensor d = pinned_like.acquire(128);
  pinned_like.release(d);
#ifdef FERRY_WITH_CUDA
  HostBufferPool pinned(/*pinned=*/true, 1 << 20);
  EXPECT_TRUE(pinned.pinned());
  EXPECT_EQ(pinned_like.give_cached_to(pinned), 0);
  EXPECT_EQ(pinned_like.stats().cached_bytes, 128) << "kept by the giver";
  EXPECT_EQ(pinned.stats().cached_bytes, 0);
#else
  EXPECT_ERROR_HAS(HostBufferPool(true, 0), "pinned host buffers need a CUDA build of ferry");
#endif
}

TEST(HostBufferPool, BadSizesAndForeignBuffersAreRefused) {
  EXPECT_ERROR_HAS(HostBufferPool(false, -1), "max_cached_bytes must be >= 0, got -1");
  HostBufferPool pool(false, 1 << 20);
  EXPECT_ERROR_HAS(pool.acquire(0), "host buffer size must be > 0, got 0");
  EXPECT_ERROR_HAS(pool.acquire(-5), "host buffer size must be > 0, got -5");
  at::Tensor undefined;
  EXPECT_ERROR_HAS(pool.release(undefined), "expects a buffer from acquire()");
  at::Tensor floats = torch::zeros({16});
  EXPECT_ERROR_HAS(pool.release(floats), "expects a buffer from acquire()");
  EXPECT_TRUE(floats.defined()) << "a refused buffer is left alone";
  at::Tensor matrix = torch::zeros({4, 4}, torch::kUInt8);
  EXPECT_ERROR_HAS(pool.release(matrix), "expects a buffer from acquire()");
  // A uint8 vector the pool never handed out, larger than what is in use: a broken invariant.
  at::Tensor mine = pool.acquire(16);
  at::Tensor foreign = torch::zeros({17}, torch::kUInt8);
  EXPECT_ERROR_HAS(pool.release(foreign), "released more host bytes than acquired");
  expect_stats(pool, 16, 0, 16, 1, 0);
  pool.release(mine);
  expect_stats(pool, 0, 16, 16, 1, 0);
}

}  // namespace
}  // namespace ferry
