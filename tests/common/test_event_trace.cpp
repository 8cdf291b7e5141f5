// EventTrace: nothing is recorded when off; while on, a ChunkStore move, an eviction and the chunk
// byte counters show up in a Chrome trace that Python's json module can read back.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "chunk/deferred_copy_engine.h"
#include "ferry/chunk/chunk_store.h"
#include "ferry/common/event_trace.h"

namespace ferry {
namespace {

TEST(EventTrace, RecordsMovesEvictionsAndCountersOnlyWhenOn) {
  ChunkStoreOptions o;
  o.device = DeviceKind::kSimulated;
  o.device_budget_bytes = 4096;
  o.name = "test";
  ChunkStore store(o);
  const ChunkId a = store.add_chunk(ChunkRole::kParam, at::kFloat, 1024, Location::kHost);
  const ChunkId b = store.add_chunk(ChunkRole::kParam, at::kFloat, 1024, Location::kHost);
  trace::stop();
  store.move(a, Location::kDevice);
  EXPECT_FALSE(trace::enabled());
  trace::start();
  EXPECT_EQ(trace::size(), 0);
  store.move(b, Location::kDevice);  // evicts a: the budget holds one chunk
  trace::stop();
  store.move(a, Location::kDevice);  // not recorded
  const std::string json = trace::chrome_json();
  EXPECT_NE(json.find("\"h2d chunk 1\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"d2h chunk 0\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"evict chunk 0\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"test device bytes\""), std::string::npos) << json;
  EXPECT_EQ(json.find("\"h2d chunk 0\""), std::string::npos) << "recorded while off";
  const int64_t events = trace::size();
  EXPECT_GE(events, 4);

  // The file parses as JSON with one traceEvents entry per event.
  const std::string path = "/tmp/ferry_test_trace_" + std::to_string(::getpid()) + ".json";
  trace::write_chrome_json(path);
  const std::string cmd = "python3 -c \"import json,sys; d=json.load(open('" + path +
                          "')); sys.exit(0 if len(d['traceEvents'])==" + std::to_string(events) + " else 1)\"";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::remove(path.c_str());
  EXPECT_THROW(trace::start(0), c10::Error);
}

// On CUDA a move's span times only the enqueue; the copy itself is recorded as an "in flight" interval
// from issue to completion. The deferred engine (copies run only when waited on) shows it on the CPU.
TEST(EventTrace, RecordsCopiesInFlightUntilTheyComplete) {
  ChunkStoreOptions o;
  o.device = DeviceKind::kSimulated;
  auto engine = std::make_unique<test::DeferredCopyEngine>(3, /*poll_one_in=*/0);
  ChunkStore store(o, std::move(engine));
  const ChunkId a = store.add_chunk(ChunkRole::kParam, at::kFloat, 1024, Location::kHost);
  trace::start();
  store.move_async(a, Location::kDevice);
  EXPECT_EQ(trace::chrome_json().find("in flight"), std::string::npos) << "not complete yet";
  store.synchronize();
  trace::stop();
  const std::string json = trace::chrome_json();
  EXPECT_NE(json.find("\"h2d chunk 0 in flight\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"cat\": \"copy\""), std::string::npos) << json;
}

// Intervals that ran off the host's threads go on a named track: one name record per track, then
// the spans under its id, which no thread id takes.
TEST(EventTrace, NamedTracksGetTheirOwnRow) {
  trace::start();
  trace::complete_on("device", "device", "forward", trace::now_ns(), trace::now_ns() + 1000);
  trace::complete_on("device", "device", "backward", trace::now_ns(), trace::now_ns() + 2000);
  trace::complete_on("link", "copy", "h2d", trace::now_ns(), trace::now_ns() + 500);
  trace::complete("model", "forward", trace::now_ns(), trace::now_ns() + 1000);
  trace::stop();
  trace::complete_on("device", "device", "late", 0, 1);  // not recorded
  EXPECT_EQ(trace::size(), 6) << "two track names and four spans";
  const std::string path = "/tmp/ferry_test_tracks_" + std::to_string(::getpid()) + ".json";
  trace::write_chrome_json(path);
  const std::string check =
      "import json,sys\n"
      "ev=json.load(open('" + path + "'))['traceEvents']\n"
      "names={e['tid']:e['args']['name'] for e in ev if e['ph']=='M'}\n"
      "assert sorted(names.values())==['device','link'], names\n"
      "dev=[e['name'] for e in ev if e['ph']=='X' and names.get(e['tid'])=='device']\n"
      "assert dev==['forward','backward'], dev\n"
      "host=[e for e in ev if e['ph']=='X' and e['cat']=='model']\n"
      "assert len(host)==1 and host[0]['tid'] not in names, host\n";
  const std::string script = path + ".py";
  std::ofstream(script) << check;
  EXPECT_EQ(std::system(("python3 " + script).c_str()), 0) << check;
  std::remove(path.c_str());
  std::remove(script.c_str());
}

TEST(EventTrace, StopsWhenFull) {
  trace::start(3);
  for (int i = 0; i < 10; ++i) trace::instant("test", "e" + std::to_string(i));
  EXPECT_FALSE(trace::enabled());
  EXPECT_EQ(trace::size(), 3);
  trace::start();
  EXPECT_EQ(trace::size(), 0) << "start() clears";
  trace::stop();
}

}  // namespace
}  // namespace ferry
