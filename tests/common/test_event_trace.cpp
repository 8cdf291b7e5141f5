// EventTrace: nothing is recorded when off; while on, a ChunkStore move, an eviction and the chunk
// byte counters show up in a Chrome trace that Python's json module can read back.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "../../chunk/chunk_store.h"
#include "../../chunk/stream_model_engine.h"
#include "../../common/event_trace.h"
#include "../trace_check.h"
#include "../trace_spans.h"

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
  EXPECT_EQ(test::check_trace("assert len(ev) == " + std::to_string(events) + ", len(ev)\n"), 0);
  EXPECT_THROW(trace::start(0), c10::Error);
}

// On CUDA a move's span times only the enqueue; the copy itself is recorded as an "in flight" interval
// from issue to completion. The stream-model engine (copies run only when waited on) shows it on the CPU.
TEST(EventTrace, RecordsCopiesInFlightUntilTheyComplete) {
  ChunkStoreOptions o;
  o.device = DeviceKind::kSimulated;
  auto engine = std::make_unique<StreamModelCopyEngine>();
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
  // An engine that cannot time its copies leaves nothing for the copy stream's track.
  trace::start();
  store.move_async(a, Location::kHost);
  store.trace_copies(ClockAnchor(store.make_mark()));
  store.synchronize();
  trace::stop();
  EXPECT_EQ(trace::chrome_json().find("copy stream"), std::string::npos) << trace::chrome_json();
  EXPECT_NE(trace::chrome_json().find("\"d2h chunk 0 in flight\""), std::string::npos) << trace::chrome_json();
}

// An engine that times its copies (the simulated one, on the host's clock, which is its device's) gives
// each copy of the recording one span on the "copy stream" track when trace_copies is called: where the
// copy ran, inside the host's call that queued it (a synchronous engine copies within the call), with
// its bytes and role; none of another recording, none twice, no "in flight" guess.
TEST(EventTrace, TimedCopiesGoOnTheCopyStreamTrack) {
  ChunkStoreOptions o;
  o.device = DeviceKind::kSimulated;
  o.device_budget_bytes = 1 << 20;
  ChunkStore store(o);
  const ChunkId a = store.add_chunk(ChunkRole::kParam, at::kFloat, 1 << 18, Location::kHost);
  const ChunkId b = store.add_chunk(ChunkRole::kParam, at::kFloat, 1 << 18, Location::kHost);
  trace::start();
  store.move(a, Location::kDevice);  // kept for this recording, which ends without trace_copies
  trace::stop();
  trace::start();
  store.move(b, Location::kDevice);  // evicts a: the budget holds one chunk
  store.move(b, Location::kHost);
  EXPECT_EQ(trace::chrome_json().find("copy stream"), std::string::npos) << "written by trace_copies only";
  store.trace_copies(ClockAnchor(store.make_mark()));
  store.trace_copies(ClockAnchor(store.make_mark()));  // nothing left to write
  trace::stop();
  EXPECT_EQ(trace::chrome_json().find("in flight"), std::string::npos) << trace::chrome_json();
  const std::string check =
      "link = track('copy stream')\n"
      "assert [e['name'] for e in link] == ['d2h chunk 0', 'h2d chunk 1', 'd2h chunk 1'], link\n"
      "assert all(e['cat'] == 'link' and e['args'] == {'bytes': 1 << 20, 'role': 'param'} for e in link), link\n"
      "moves = [e for e in ev if e['ph'] == 'X' and e['cat'] == 'move']\n"
      "for l in link:\n"
      "    assert l['dur'] > 0, l\n"
      "    assert any(m['name'] == l['name'] and m['ts'] <= l['ts'] and end(l) <= end(m) + 1e-3 for m in moves), (l, moves)\n";
  EXPECT_EQ(test::check_trace(check), 0) << check;
}

// A recording that never writes its copies keeps at most a bounded number of them timed (their marks
// are kept until trace_copies); beyond the bound copies go untimed and leave their in-flight span.
TEST(EventTrace, TimedCopiesAreBounded) {
  ChunkStoreOptions o;
  o.device = DeviceKind::kSimulated;
  ChunkStore store(o);
  const ChunkId a = store.add_chunk(ChunkRole::kParam, at::kFloat, 16, Location::kHost);
  const int copies = 70000;  // above the store's bound (65,536)
  trace::start(8 * copies);
  for (int i = 0; i < copies; ++i) store.move(a, i % 2 == 0 ? Location::kDevice : Location::kHost);
  store.trace_copies(ClockAnchor(store.make_mark()));
  trace::stop();
  const std::string json = trace::chrome_json();
  auto count = [&](const std::string& what) {
    int64_t n = 0;
    for (size_t at = json.find(what); at != std::string::npos; at = json.find(what, at + 1)) ++n;
    return n;
  };
  const int64_t timed = count("\"cat\": \"link\""), untimed = count(" in flight\"");
  EXPECT_EQ(timed + untimed, copies);
  EXPECT_GE(timed, 60000);
  EXPECT_GT(untimed, 0);
}

// Where the device's clock is the host's (the simulated engine), a mark is placed exactly where it was
// recorded, on either side of the anchor.
TEST(ClockAnchor, PlacesMarksOnTheHostClock) {
  const auto engine = make_simulated_copy_engine();
  const auto pause = [] { std::this_thread::sleep_for(std::chrono::milliseconds(5)); };
  auto before = engine->make_mark();
  const int64_t before_lo = trace::now_ns();
  before->record();
  const int64_t before_hi = trace::now_ns();
  pause();
  EXPECT_THROW(ClockAnchor(nullptr), c10::Error);
  const ClockAnchor anchor(engine->make_mark());
  pause();
  auto after = engine->make_mark();
  const int64_t after_lo = trace::now_ns();
  after->record();
  const int64_t after_hi = trace::now_ns();
  const int64_t b = anchor.host_ns(*before), a = anchor.host_ns(*after);
  EXPECT_GE(b, before_lo);
  EXPECT_LE(b, before_hi);
  EXPECT_GE(a, after_lo);
  EXPECT_LE(a, after_hi);
}

// Intervals that ran off the host's threads go on a named track: one name record per track, then
// the spans under its id, which no thread id takes.
// tests/trace_spans.h reads the spans back in C++ (what the GPU test of prefetch overlap asserts on):
// each with its track's name (host threads' spans: none), its times in microseconds, names unescaped;
// overlap_us and covered_us on synthetic intervals with known answers.
TEST(EventTrace, SpansReadBackWithTheirTracksAndTheirOverlaps) {
  trace::start();
  const int64_t t0 = trace::now_ns() + 1'000'000;
  trace::complete_on("device", "device", "forward", t0, t0 + 4'000'000);                    // [0, 4] ms
  trace::complete_on("copy stream", "link", "h2d chunk 1", t0 + 3'000'000, t0 + 5'000'000);   // [3, 5]: 1 ms in forward
  trace::complete_on("copy stream", "link", "d2h \"x\"", t0 + 5'000'000, t0 + 6'000'000);  // [5, 6]: touches only
  trace::complete_on("device", "device", "backward", t0 + 5'200'000, t0 + 5'700'000);       // inside the d2h
  trace::complete("model", "forward", t0 - 500'000, t0 + 4'500'000);                         // a host thread's
  trace::instant("test", "not a span");
  trace::stop();
  const std::vector<test::TraceSpan> spans = test::trace_spans(trace::chrome_json());
  ASSERT_EQ(spans.size(), 5u) << trace::chrome_json();
  const auto device = test::spans_on(spans, "device");
  const auto copies = test::spans_on(spans, "copy stream");
  const auto h2d = test::spans_on(spans, "copy stream", "h2d");
  const auto host = test::spans_on(spans, "");
  ASSERT_EQ(device.size(), 2u);
  ASSERT_EQ(copies.size(), 2u);
  ASSERT_EQ(h2d.size(), 1u);
  ASSERT_EQ(host.size(), 1u);
  EXPECT_EQ(device[0].name, "forward");
  EXPECT_EQ(device[0].cat, "device");
  EXPECT_EQ(copies[1].name, "d2h \"x\"") << "unescaped";
  EXPECT_EQ(copies[1].cat, "link");
  EXPECT_EQ(host[0].cat, "model");
  EXPECT_NEAR(device[0].duration_us(), 4000, 0.002);
  EXPECT_NEAR(h2d[0].begin_us - device[0].begin_us, 3000, 0.002) << "one clock for every track";
  EXPECT_NEAR(device[0].begin_us - host[0].begin_us, 500, 0.002);
  EXPECT_NEAR(test::overlap_us(device[0], h2d[0]), 1000, 0.002);
  EXPECT_NEAR(test::overlap_us(h2d[0], device[0]), 1000, 0.002) << "symmetric";
  EXPECT_EQ(test::overlap_us(device[0], copies[1]), 0.0) << "disjoint";
  EXPECT_NEAR(test::overlap_us(h2d[0], copies[1]), 0.0, 0.002) << "touching is not overlapping (to a nanosecond)";
  EXPECT_NEAR(test::overlap_us(device[1], copies[1]), 500, 0.002) << "one inside the other: the inner one";
  EXPECT_NEAR(test::overlap_us(host[0], device[0]), 4000, 0.002);
  EXPECT_NEAR(test::covered_us(device, copies), 1000 + 500, 0.004);
  EXPECT_EQ(test::covered_us(device, {}), 0.0);
  EXPECT_TRUE(test::trace_spans("").empty());
}

TEST(EventTrace, NamedTracksGetTheirOwnRow) {
  trace::start();
  trace::complete_on("device", "device", "forward", trace::now_ns(), trace::now_ns() + 1000);
  trace::complete_on("device", "device", "backward", trace::now_ns(), trace::now_ns() + 2000);
  trace::complete_on("link", "copy", "h2d", trace::now_ns(), trace::now_ns() + 500);
  trace::complete("model", "forward", trace::now_ns(), trace::now_ns() + 1000);
  trace::stop();
  trace::complete_on("device", "device", "late", 0, 1);  // not recorded
  EXPECT_EQ(trace::size(), 6) << "two track names and four spans";
  const std::string check =
      "names = {e['tid']: e['args']['name'] for e in ev if e['ph'] == 'M'}\n"
      "assert sorted(names.values()) == ['device', 'link'], names\n"
      "assert [e['name'] for e in track('device')] == ['forward', 'backward'], ev\n"
      "host = [e for e in ev if e['ph'] == 'X' and e['cat'] == 'model']\n"
      "assert len(host) == 1 and host[0]['tid'] not in names, host\n";
  EXPECT_EQ(test::check_trace(check), 0) << check;
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
