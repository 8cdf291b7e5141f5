// cpu_adam/thread_split.h: every grain once, at grain boundaries, whatever the threads and split; a
// dynamic split lets the other threads take a stalled thread's share, a static one does not.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <vector>

#include "../../cpu_adam/thread_split.h"

namespace ferry {
namespace {

TEST(ThreadSplit, EveryGrainOnceAtGrainBoundaries) {
  const int64_t g = kGrainElements;
  for (const int64_t n : {int64_t{0}, int64_t{1}, g - 1, g, g + 1, 10 * g + 5}) {
    for (const int threads : {1, 2, 3, 8}) {
      for (const CpuSplit split : {CpuSplit::kDynamic, CpuSplit::kStatic}) {
        const int64_t grains = grain_count(n);
        ASSERT_EQ(grains, (n + g - 1) / g);
        std::vector<std::atomic<int>> visits(static_cast<size_t>(grains));
        std::atomic<int64_t> covered{0};
        std::atomic<bool> misplaced{false};
        for_each_grain(n, threads, split, [&](int64_t b, int64_t e, int64_t k) {
          if (k < 0 || k >= grains || b != k * g || e != std::min(n, b + g) || b >= e) misplaced = true;
          else visits[static_cast<size_t>(k)]++;
          covered += e - b;
        });
        const std::string where = "n=" + std::to_string(n) + " threads=" + std::to_string(threads) + " " + to_string(split);
        EXPECT_FALSE(misplaced.load()) << where;
        EXPECT_EQ(covered.load(), n) << where;
        for (int64_t k = 0; k < grains; ++k) EXPECT_EQ(visits[static_cast<size_t>(k)].load(), 1) << where << " grain " << k;
      }
    }
  }
}

// Thread 0 stalls in its first grain until the other threads have done all they will do without it
// (a thread that shares its core with a busy one, at the extreme); then it goes on. The others start
// only once thread 0 holds a grain, so that they cannot take every grain before it starts. Returns how
// many grains thread 0 ran; -1 if a wait gave up after a minute, -2 if the team was not `threads`
// strong (a machine's OpenMP limits).
int64_t grains_of_a_stalled_thread(CpuSplit split, int threads, int64_t grains, int64_t others_can_do) {
  std::mutex mutex;
  std::condition_variable cv;
  int64_t done_by_others = 0, by_thread0 = 0;
  bool stalled = false, wrong_team = false, gave_up = false;
  for_each_grain(grains * kGrainElements, threads, split, [&](int64_t, int64_t, int64_t) {
    std::unique_lock<std::mutex> lock(mutex);
    auto wait = [&](auto until) {
      if (!cv.wait_for(lock, std::chrono::seconds(60), [&] { return wrong_team || gave_up || until(); })) gave_up = true;
      cv.notify_all();
    };
    if (omp_get_num_threads() != threads) wrong_team = true;
    if (omp_get_thread_num() != 0) {
      wait([&] { return stalled; });
      ++done_by_others;
      cv.notify_all();
      return;
    }
    ++by_thread0;
    if (stalled) return;
    stalled = true;
    cv.notify_all();
    wait([&] { return done_by_others >= others_can_do; });
  });
  return wrong_team ? -2 : gave_up ? -1 : by_thread0;
}

TEST(ThreadSplit, ADynamicSplitGivesAStalledThreadsShareToTheOthers) {
  const int threads = 4;
  const int64_t grains = 64;
  // Dynamic: the other three run every grain but the one thread 0 holds.
  const int64_t dynamic = grains_of_a_stalled_thread(CpuSplit::kDynamic, threads, grains, grains - 1);
  if (dynamic == -2) GTEST_SKIP() << "OpenMP gives fewer than 4 threads here";
  EXPECT_EQ(dynamic, 1);
  // Static: the others stop at their own quarters; thread 0 still runs its 16 grains after the stall.
  EXPECT_EQ(grains_of_a_stalled_thread(CpuSplit::kStatic, threads, grains, grains - grains / threads), grains / threads);
}

}  // namespace
}  // namespace ferry
