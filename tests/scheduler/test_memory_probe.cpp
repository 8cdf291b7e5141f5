// MemoryProbe: the default non_model_bytes is max(0, allocated - chunk bytes) and 0 when the probe cannot
// tell (-1); make_function_probe answers with its function; the heap probe (glibc mallinfo2) counts what
// was allocated since begin_iteration, minus the growth of ferry's own bytes. Only what is robust is
// asserted about the heap: a 64 MiB tensor is at least 60 MiB of growth, and nearly nothing once ferry
// claims it. (make_memory_probe(DeviceKind) is not tested here: its signature is being changed.)
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "../../scheduler/memory_probe.h"
#include "../test_util.h"

namespace ferry {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(MemoryProbe, AFunctionProbeAnswersWithItsFunction) {
  int64_t allocated = 1000;
  int calls = 0;
  auto probe = make_function_probe([&] {
    ++calls;
    return allocated;
  });
  EXPECT_STREQ(probe->name(), "function");
  EXPECT_EQ(probe->device_allocated_bytes(), 1000);
  allocated = 5000;
  EXPECT_EQ(probe->device_allocated_bytes(), 5000) << "asked every time, not cached";
  probe->begin_iteration();  // the default: nothing
  EXPECT_EQ(calls, 2);
}

// non_model_bytes(chunk bytes) = max(0, allocated - chunk bytes); -1 (cannot tell) means 0.
TEST(MemoryProbe, NonModelBytesIsAllocatedMinusChunkBytesNeverNegative) {
  int64_t allocated = 0;
  auto probe = make_function_probe([&] { return allocated; });
  struct Case {
    int64_t allocated, chunks, want;
  };
  for (const Case& c : {Case{1000, 300, 700}, Case{1000, 1000, 0}, Case{1000, 1500, 0}, Case{0, 0, 0},
                        Case{-1, 0, 0}, Case{-1, 500, 0}, Case{int64_t{80} << 30, int64_t{60} << 30, int64_t{20} << 30}}) {
    allocated = c.allocated;
    EXPECT_EQ(probe->non_model_bytes(c.chunks), c.want) << "allocated " << c.allocated << ", chunks " << c.chunks;
  }
}

// A probe that overrides only device_allocated_bytes gets the same default.
TEST(MemoryProbe, TheDefaultAppliesToEveryProbe) {
  struct Fixed final : MemoryProbe {
    const char* name() const override { return "fixed"; }
    int64_t device_allocated_bytes() override { return 4096; }
  } fixed;
  EXPECT_EQ(fixed.non_model_bytes(1024), 3072);
  EXPECT_EQ(fixed.non_model_bytes(8192), 0);
}

TEST(HeapProbe, CountsTheHeapGrowthSinceTheIterationBeganMinusFerrysOwn) {
  if (!test::kGlibcSeesTheHeap) GTEST_SKIP() << "a sanitizer's allocator is not glibc's: mallinfo2 reports about 0";
  int64_t ferry_bytes = 123 * kMiB;  // whatever it is at the start: only its growth counts
  auto probe = make_heap_probe([&] { return ferry_bytes; });
  EXPECT_STREQ(probe->name(), "glibc-heap-growth");
  EXPECT_EQ(probe->device_allocated_bytes(), -1) << "no absolute number";
  probe->begin_iteration();
  const int64_t heap_before = host_heap_in_use_bytes();
  EXPECT_GT(heap_before, 0);
  EXPECT_LT(probe->non_model_bytes(0), 8 * kMiB) << "nothing allocated yet";
  at::Tensor activations = torch::ones({64 * kMiB / 4});  // 64 MiB, written (every page touched)
  EXPECT_GE(host_heap_in_use_bytes() - heap_before, 60 * kMiB);
  EXPECT_GE(probe->non_model_bytes(0), 60 * kMiB) << "an activation allocated during the iteration";
  EXPECT_GE(probe->non_model_bytes(7 * kMiB), 60 * kMiB) << "ferry's bytes come from ferry_bytes, not from the argument";
  // The same bytes, were they ferry's (a chunk payload): not non-model memory.
  ferry_bytes += 64 * kMiB;
  EXPECT_LT(probe->non_model_bytes(0), 8 * kMiB);
  ferry_bytes -= 64 * kMiB;
  activations = at::Tensor();  // freed: the growth is gone
  EXPECT_LT(probe->non_model_bytes(0), 8 * kMiB);
  // ferry's bytes growing by more than the heap did (memory it took from elsewhere): 0, never negative.
  probe->begin_iteration();
  ferry_bytes += 256 * kMiB;
  EXPECT_EQ(probe->non_model_bytes(0), 0);
  ferry_bytes -= 256 * kMiB;
  // A new iteration takes a new baseline: what was allocated before it does not count.
  at::Tensor kept = torch::ones({32 * kMiB / 4});
  EXPECT_GE(probe->non_model_bytes(0), 28 * kMiB);
  probe->begin_iteration();
  EXPECT_LT(probe->non_model_bytes(0), 8 * kMiB) << "allocated before this iteration began";
}

}  // namespace
}  // namespace ferry
