#pragma once
// Test helper: checks the event trace recorded so far with Python assertions. Writes the trace as
// Chrome JSON (trace::write_chrome_json) and runs `checks` after a prelude that defines
//   ev        the trace's events (list of dicts)
//   track(n)  the complete spans on the named track n (trace::complete_on)
//   end(e)    a span's end (ts + dur, microseconds)
// Returns python3's exit status (0: every assertion held); the files are removed after.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "../common/event_trace.h"

namespace ferry::test {

inline int check_trace(const std::string& checks) {
  static int calls = 0;
  const std::string path = "/tmp/ferry_test_trace_" + std::to_string(::getpid()) + "_" + std::to_string(++calls) + ".json";
  trace::write_chrome_json(path);
  const std::string script = path + ".py";
  std::ofstream(script) << "import json\n"
                        << "ev = json.load(open('" << path << "'))['traceEvents']\n"
                        << "def track(n):\n"
                        << "    ids = {e['tid'] for e in ev if e['ph'] == 'M' and e['args']['name'] == n}\n"
                        << "    return [e for e in ev if e['ph'] == 'X' and e['tid'] in ids]\n"
                        << "end = lambda e: e['ts'] + e['dur']\n"
                        << checks;
  const int status = std::system(("python3 " + script).c_str());
  std::remove(path.c_str());
  std::remove(script.c_str());
  return status;
}

}  // namespace ferry::test
