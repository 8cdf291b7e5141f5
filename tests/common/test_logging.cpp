// ferry's log: configure() sets the level and the rank prefix (last call wins), enabled() and write()
// follow the level (kOff silences everything), the operator<< helpers format their arguments,
// warn_once writes once per key (other keys still write), the names of the levels, and that the
// library's own default (configure_default) never overrides the program's configure() (a program
// that never calls configure() is tested in hooks/test_log_defaults).
// The lines are read back from stderr (gtest's CaptureStderr).
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "../../common/logging.h"
#include "../test_util.h"

namespace ferry {
namespace {

using test::LogLevelFor;
using test::occurrences;

// What `fn` writes to stderr.
template <class Fn>
std::string stderr_of(Fn fn) {
  testing::internal::CaptureStderr();
  fn();
  return testing::internal::GetCapturedStderr();
}

// Restores Info / rank 0 (the level before the test is whatever gtest's main set).
struct RestoreLog {
  log::Level before = log::level();
  ~RestoreLog() { log::configure(before, 0); }
};

TEST(Logging, ConfigureSetsTheLevelAndEnabledFollowsIt) {
  RestoreLog restore;
  const log::Level all[] = {log::Level::kTrace, log::Level::kDebug, log::Level::kInfo,
                            log::Level::kWarn,  log::Level::kError, log::Level::kOff};
  for (log::Level configured : all) {
    log::configure(configured, 0);
    EXPECT_EQ(log::level(), configured);
    for (log::Level asked : all) {
      const bool want = asked != log::Level::kOff && configured != log::Level::kOff &&
                        static_cast<int>(asked) >= static_cast<int>(configured);
      EXPECT_EQ(log::enabled(asked), want) << log::to_string(asked) << " at " << log::to_string(configured);
    }
  }
}

TEST(Logging, LinesCarryTheRankAndTheLevelAndOnlyAtOrAboveTheLevel) {
  RestoreLog restore;
  log::configure(log::Level::kInfo, 3);
  const std::string out = stderr_of([] {
    log::write(log::Level::kInfo, "an info line");
    log::write(log::Level::kDebug, "a debug line");  // below Info: nothing
    log::info("moved ", 42, " bytes in ", 1.5, " ms");
    log::debug("never ", 1);
    log::error("an error");
  });
  EXPECT_EQ(occurrences(out, "[ferry r3]"), 3u) << out;
  EXPECT_NE(out.find("[info] an info line"), std::string::npos) << out;
  EXPECT_NE(out.find("moved 42 bytes in 1.5 ms"), std::string::npos) << out;
  EXPECT_NE(out.find("[error] an error"), std::string::npos) << out;
  EXPECT_EQ(out.find("debug line"), std::string::npos) << out;
  EXPECT_EQ(out.find("never"), std::string::npos) << out;
  // configure again: the last call wins, for the rank too.
  log::configure(log::Level::kDebug, 7);
  const std::string again = stderr_of([] { log::debug("now shown"); });
  EXPECT_NE(again.find("[ferry r7]"), std::string::npos) << again;
  EXPECT_NE(again.find("now shown"), std::string::npos) << again;
  EXPECT_EQ(again.find("[ferry r3]"), std::string::npos) << again;
  // kOff silences even errors.
  log::configure(log::Level::kOff, 0);
  EXPECT_EQ(stderr_of([] {
              log::error("silenced");
              log::write(log::Level::kOff, "an Off line is never written");
            }),
            "");
}

TEST(Logging, WarnOnceWritesOncePerKey) {
  LogLevelFor level(log::Level::kWarn);
  bool first = false, second = false, other = false;
  const std::string out = stderr_of([&] {
    first = log::warn_once("test_logging: key A", "slow path A taken");
    second = log::warn_once("test_logging: key A", "slow path A taken again");
    other = log::warn_once("test_logging: key B", "slow path B taken");
  });
  EXPECT_TRUE(first);
  EXPECT_FALSE(second) << "the same key twice";
  EXPECT_TRUE(other) << "another key";
  EXPECT_EQ(occurrences(out, "slow path A taken"), 1u) << out;
  EXPECT_EQ(out.find("taken again"), std::string::npos) << out;
  EXPECT_EQ(occurrences(out, "slow path B taken"), 1u) << out;
  EXPECT_NE(out.find("[warning] slow path A taken"), std::string::npos) << "at Warn: " << out;
  // Still once later, whatever the message.
  EXPECT_FALSE(log::warn_once("test_logging: key A", "different text"));
}

// From many threads at once, one of them wins a key and writes it.
TEST(Logging, WarnOnceIsOnceAcrossThreads) {
  LogLevelFor level(log::Level::kWarn);
  std::atomic<int> wrote{0};
  const std::string out = stderr_of([&] {
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&] {
        for (int i = 0; i < 100; ++i) wrote += log::warn_once("test_logging: threads", "raced warning");
      });
    }
    for (auto& t : threads) t.join();
  });
  EXPECT_EQ(wrote.load(), 1);
  EXPECT_EQ(occurrences(out, "raced warning"), 1u) << out;
}

// The header says warn_once "returns whether it wrote". Below Warn it wrote nothing, yet returned true
// and used up the key, so the warning never appeared once the level was lowered again (found by this
// test, 2026-11-26): now the key is kept until the line is written.
TEST(Logging, WarnOnceBelowTheLevelReturnsFalseAndKeepsTheKey) {
  {
    LogLevelFor quiet(log::Level::kError);
    EXPECT_FALSE(log::warn_once("test_logging: quiet key", "not written")) << "nothing was written";
  }
  LogLevelFor level(log::Level::kWarn);
  EXPECT_TRUE(log::warn_once("test_logging: quiet key", "written now"));
}

TEST(Logging, NamesOfTheLevels) {
  EXPECT_STREQ(log::to_string(log::Level::kTrace), "trace");
  EXPECT_STREQ(log::to_string(log::Level::kDebug), "debug");
  EXPECT_STREQ(log::to_string(log::Level::kInfo), "info");
  EXPECT_STREQ(log::to_string(log::Level::kWarn), "warn");
  EXPECT_STREQ(log::to_string(log::Level::kError), "error");
  EXPECT_STREQ(log::to_string(log::Level::kOff), "off");
  // "major.minor.patch"
  const std::string v = log::spdlog_version();
  EXPECT_EQ(occurrences(v, "."), 2u) << v;
  EXPECT_NE(v.front(), '.');
}

TEST(Logging, AnExplicitConfigureWinsOverTheLibrarysDefault) {
  ASSERT_TRUE(log::configured()) << "test_main configures the log";
  test::LogLevelFor level(log::Level::kWarn);
  EXPECT_FALSE(log::configure_default(log::Level::kTrace, 3));
  EXPECT_EQ(log::level(), log::Level::kWarn);
  EXPECT_FALSE(log::enabled(log::Level::kInfo));
  log::configure(log::Level::kError, 0);  // the program may change it again at any time
  EXPECT_EQ(log::level(), log::Level::kError);
}

}  // namespace
}  // namespace ferry
