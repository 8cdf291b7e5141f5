#include "event_trace.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "logging.h"

namespace ferry::trace {
namespace {

struct Event {
  char phase;  // 'X' complete, 'i' instant, 'C' counter, 'M' a track's name
  const char* cat;
  std::string name;
  int64_t ts_ns, dur_ns;
  uint64_t tid;
  std::string args;
};

std::atomic<bool> g_on{false};
std::atomic<int64_t> g_recording{0};
std::mutex g_mutex;
std::vector<Event> g_events;
int64_t g_max = 0;
int64_t g_origin = 0;
std::vector<std::string> g_tracks;  // named tracks of this recording; track i has tid kTrackTid + i
constexpr uint64_t kTrackTid = 100000;  // thread ids are below it

uint64_t thread_id() { return std::hash<std::thread::id>{}(std::this_thread::get_id()) % 100000; }

void push(Event e) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_on.load(std::memory_order_relaxed)) return;
  if (static_cast<int64_t>(g_events.size()) >= g_max) {
    g_on.store(false);
    log::warn("ferry: event trace full (", g_max, " events); recording stopped");
    return;
  }
  g_events.push_back(std::move(e));
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

bool enabled() { return g_on.load(std::memory_order_relaxed); }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void start(int64_t max_events) {
  TORCH_CHECK(max_events > 0, "ferry: trace::start needs max_events > 0, got ", max_events);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_events.clear();
  g_tracks.clear();
  g_max = max_events;
  g_origin = now_ns();
  g_recording.fetch_add(1);
  g_on.store(true);
}

int64_t recording() { return g_recording.load(); }

void stop() { g_on.store(false); }

void complete(const char* cat, const std::string& name, int64_t begin_ns, int64_t end_ns, const std::string& args) {
  if (!enabled()) return;
  push({'X', cat, name, begin_ns, end_ns - begin_ns, thread_id(), args});
}

void complete_on(const std::string& track, const char* cat, const std::string& name, int64_t begin_ns, int64_t end_ns,
                 const std::string& args) {
  if (!enabled()) return;
  uint64_t tid = 0;
  bool named = true;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    size_t i = 0;
    while (i < g_tracks.size() && g_tracks[i] != track) ++i;
    if (i == g_tracks.size()) {
      g_tracks.push_back(track);
      named = false;
    }
    tid = kTrackTid + i;
  }
  if (!named) push({'M', "__metadata", "thread_name", 0, 0, tid, "\"name\": \"" + escape(track) + "\""});
  push({'X', cat, name, begin_ns, end_ns - begin_ns, tid, args});
}

void instant(const char* cat, const std::string& name, const std::string& args) {
  if (!enabled()) return;
  push({'i', cat, name, now_ns(), 0, thread_id(), args});
}

void counter(const std::string& name, int64_t value) {
  if (!enabled()) return;
  push({'C', "memory", name, now_ns(), 0, 0, "\"bytes\": " + std::to_string(value)});
}

int64_t size() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return static_cast<int64_t>(g_events.size());
}

std::string chrome_json() {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::ostringstream os;
  os.precision(3);
  os << std::fixed << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [";
  const int pid = static_cast<int>(::getpid());
  for (size_t i = 0; i < g_events.size(); ++i) {
    const Event& e = g_events[i];
    os << (i ? ",\n" : "\n") << "{\"ph\": \"" << e.phase << "\", \"cat\": \"" << e.cat << "\", \"name\": \""
       << escape(e.name) << "\", \"pid\": " << pid << ", \"tid\": " << e.tid
       << ", \"ts\": " << (e.phase == 'M' ? 0.0 : (e.ts_ns - g_origin) / 1000.0);
    if (e.phase == 'X') os << ", \"dur\": " << e.dur_ns / 1000.0;
    if (e.phase == 'i') os << ", \"s\": \"t\"";
    os << ", \"args\": {" << e.args << "}}";
  }
  os << "\n]}\n";
  return os.str();
}

void write_chrome_json(const std::string& path) {
  const std::string json = chrome_json();
  std::ofstream out(path);
  out << json;
  out.close();
  TORCH_CHECK(out, "ferry: cannot write the trace to ", path);
  log::info("ferry: wrote ", size(), " trace events to ", path);
}

}  // namespace ferry::trace
