#pragma once
// ferry's log: spdlog underneath, one logger named "ferry", every line prefixed with the rank.
//
// Contract
//  - Call sites format with operator<< (log::info("moved ", n, " bytes")); this header includes no
//    spdlog or fmt, on purpose: torch ships its own fmt headers (12.x) that would otherwise meet the
//    fmt spdlog was built against (Debian: 9.x) in one translation unit. logging.cpp is the only file
//    that sees spdlog, and it is compiled without torch's include paths (docs/ARCHITECTURE.md, D3).
//  - Thread-safe: spdlog's _mt logger; configure() may be called again at any time (last one wins).
//  - Before configure() the level is Info and the rank prefix is 0, unless ferry configured itself
//    (configure_default: a ChunkedModel applies its Config's log level and rank), which an explicit
//    configure() call, earlier or later, always overrides.
#include <sstream>
#include <string>
#include <string_view>

namespace ferry::log {

enum class Level { kTrace, kDebug, kInfo, kWarn, kError, kOff };

// Sets the level and the rank shown in every line's prefix. The program's call: from then on
// configure_default() changes nothing.
void configure(Level level, int rank);
// The library's own default (ChunkedModel's constructor passes Config::log_level and Config::rank, so
// that --log-level and FERRY_LOG_LEVEL work in a program that never calls configure()): applies them as
// configure() does, unless configure() was ever called in this process. Returns whether it applied.
bool configure_default(Level level, int rank);
// Whether configure() was called in this process.
bool configured();
Level level();
bool enabled(Level level);
// Writes one line at `level` (no-op below the configured level).
void write(Level level, std::string_view message);
// Writes `message` at Warn the first time `key` is seen in this process while Warn is enabled; returns
// whether it wrote (below Warn the key is not used up).
bool warn_once(std::string_view key, std::string_view message);
// The same at any level: the first time `key` is seen while `level` is enabled (keys are shared by levels).
bool write_once(Level level, std::string_view key, std::string_view message);
// "1.10.0": the spdlog this binary runs with (for the environment report).
std::string spdlog_version();
const char* to_string(Level level);

namespace detail {
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

template <class... Args> void trace(const Args&... a) { if (enabled(Level::kTrace)) write(Level::kTrace, detail::concat(a...)); }
template <class... Args> void debug(const Args&... a) { if (enabled(Level::kDebug)) write(Level::kDebug, detail::concat(a...)); }
template <class... Args> void info(const Args&... a) { if (enabled(Level::kInfo)) write(Level::kInfo, detail::concat(a...)); }
template <class... Args> void warn(const Args&... a) { if (enabled(Level::kWarn)) write(Level::kWarn, detail::concat(a...)); }
template <class... Args> void error(const Args&... a) { if (enabled(Level::kError)) write(Level::kError, detail::concat(a...)); }

}  // namespace ferry::log
