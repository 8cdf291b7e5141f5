#pragma once
// EventTrace: a process-wide recorder of timed events (chunk moves, evictions, copy waits, Adam phases,
// forward/backward) and counters (device / host chunk bytes) for one or a few steps, written as a
// Chrome trace JSON (open in https://ui.perfetto.dev or chrome://tracing).
//
//   ferry::trace::start();            // clears, then records
//   ... one training step ...
//   ferry::trace::stop();
//   ferry::trace::write_chrome_json("step.json");
//
// When not recording, every call costs one relaxed atomic load. Thread-safe (a mutex while recording);
// events carry the recording thread's id. At most `max_events` are kept (then recording stops, with a
// warning), so a forgotten start() cannot eat the host memory.
#include <cstdint>
#include <string>

namespace ferry::trace {

bool enabled();
void start(int64_t max_events = 1'000'000);
void stop();
int64_t now_ns();  // steady clock
// Which recording this is: start() counts up, so data kept for one recording is not written into the next.
int64_t recording();
// A complete event [begin_ns, end_ns) in category `cat`; args: a JSON object's members ("\"k\": 1").
void complete(const char* cat, const std::string& name, int64_t begin_ns, int64_t end_ns, const std::string& args = {});
// The same on a track of its own (a named row in the viewer) instead of the recording thread's: for
// intervals that ran elsewhere, e.g. on the GPU (track "device").
void complete_on(const std::string& track, const char* cat, const std::string& name, int64_t begin_ns, int64_t end_ns,
                 const std::string& args = {});
void instant(const char* cat, const std::string& name, const std::string& args = {});
// A counter sample (Chrome "C" event): value of series `name` from now on.
void counter(const std::string& name, int64_t value);
int64_t size();
std::string chrome_json();
void write_chrome_json(const std::string& path);

// RAII complete event: begins at construction, recorded at destruction when tracing is on.
class Span {
 public:
  Span(const char* cat, std::string name) : cat_(cat), name_(std::move(name)), begin_(enabled() ? now_ns() : 0) {}
  ~Span() {
    if (begin_ && enabled()) complete(cat_, name_, begin_, now_ns(), args_);
  }
  void set_args(std::string args) { args_ = std::move(args); }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* cat_;
  std::string name_;
  int64_t begin_;
  std::string args_;
};

}  // namespace ferry::trace
