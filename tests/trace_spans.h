#pragma once
// Test helper: the complete spans ("X" events) of the event trace read back in C++, each with the name
// of its track (trace::complete_on; "" for a host thread's), in microseconds from the recording's start
// as trace::chrome_json() writes them; and the time two intervals share. For tests that reason about
// intervals the device ran (copies beside compute) without leaving C++ (trace_check.h runs Python).
//
// Reads the layout trace::chrome_json() writes: one event per line, its fields in a fixed order
// ("ph", "cat", "name", "pid", "tid", "ts", ["dur"], "args"), a track's name in an "M" event's args.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace ferry::test {

struct TraceSpan {
  std::string track;  // the named track (trace::complete_on), or "" for a host thread's span
  std::string cat, name;
  double begin_us = 0, end_us = 0;
  double duration_us() const { return end_us - begin_us; }
};

namespace detail {

// The JSON string value after `key` (e.g. "\"name\": \"") from `from` on, escapes undone; `found` false
// if absent.
inline std::string string_after(const std::string& line, const std::string& key, size_t from, bool* found,
                                size_t* end = nullptr) {
  const size_t at = line.find(key, from);
  *found = at != std::string::npos;
  if (!*found) return {};
  std::string out;
  size_t i = at + key.size();
  for (; i < line.size() && line[i] != '"'; ++i) {
    if (line[i] == '\\' && i + 1 < line.size()) ++i;
    out += line[i];
  }
  if (end) *end = i;
  return out;
}

inline double number_after(const std::string& line, const std::string& key, bool* found) {
  const size_t at = line.find(key);
  *found = at != std::string::npos;
  return *found ? std::strtod(line.c_str() + at + key.size(), nullptr) : 0.0;
}

}  // namespace detail

// Every complete span of `json` (trace::chrome_json()), in recording order.
inline std::vector<TraceSpan> trace_spans(const std::string& json) {
  std::map<long long, std::string> track_of_tid;
  struct Raw {
    long long tid;
    TraceSpan span;
  };
  std::vector<Raw> raw;
  std::istringstream lines(json);
  std::string line;
  while (std::getline(lines, line)) {
    bool ok = false;
    const std::string ph = detail::string_after(line, "\"ph\": \"", 0, &ok);
    if (!ok) continue;
    const long long tid = static_cast<long long>(detail::number_after(line, "\"tid\": ", &ok));
    if (!ok) continue;
    if (ph == "M") {
      const size_t args = line.find("\"args\": {");
      bool named = false;
      const std::string track = detail::string_after(line, "\"name\": \"", args == std::string::npos ? 0 : args, &named);
      if (args != std::string::npos && named) track_of_tid[tid] = track;
      continue;
    }
    if (ph != "X") continue;
    Raw r{tid, {}};
    size_t after_cat = 0;
    r.span.cat = detail::string_after(line, "\"cat\": \"", 0, &ok, &after_cat);
    r.span.name = detail::string_after(line, "\"name\": \"", after_cat, &ok);
    bool has_ts = false, has_dur = false;
    r.span.begin_us = detail::number_after(line, "\"ts\": ", &has_ts);
    r.span.end_us = r.span.begin_us + detail::number_after(line, "\"dur\": ", &has_dur);
    if (has_ts && has_dur) raw.push_back(std::move(r));
  }
  std::vector<TraceSpan> spans;
  for (Raw& r : raw) {
    const auto it = track_of_tid.find(r.tid);
    r.span.track = it == track_of_tid.end() ? std::string() : it->second;
    spans.push_back(std::move(r.span));
  }
  return spans;
}

// The spans on track `track` whose name starts with `prefix`.
inline std::vector<TraceSpan> spans_on(const std::vector<TraceSpan>& spans, const std::string& track,
                                       const std::string& prefix = "") {
  std::vector<TraceSpan> out;
  for (const TraceSpan& s : spans) {
    if (s.track == track && s.name.compare(0, prefix.size(), prefix) == 0) out.push_back(s);
  }
  return out;
}

// Microseconds the two intervals share (0 if they are disjoint or only touch).
inline double overlap_us(const TraceSpan& a, const TraceSpan& b) {
  return std::max(0.0, std::min(a.end_us, b.end_us) - std::max(a.begin_us, b.begin_us));
}

// The time of `of` covered by any interval of `by`, summed over `of` (the intervals of `by` taken as
// disjoint, as one stream's are: a copy stream runs one copy at a time).
inline double covered_us(const std::vector<TraceSpan>& of, const std::vector<TraceSpan>& by) {
  double total = 0;
  for (const TraceSpan& a : of) {
    for (const TraceSpan& b : by) total += overlap_us(a, b);
  }
  return total;
}

}  // namespace ferry::test
