// The only translation unit that includes spdlog (see logging.h).
#include "logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <spdlog/version.h>

#include <atomic>
#include <mutex>
#include <set>

namespace ferry::log {
namespace {

std::atomic<Level> g_level{Level::kInfo};

spdlog::level::level_enum to_spdlog(Level level) {
  switch (level) {
    case Level::kTrace: return spdlog::level::trace;
    case Level::kDebug: return spdlog::level::debug;
    case Level::kInfo: return spdlog::level::info;
    case Level::kWarn: return spdlog::level::warn;
    case Level::kError: return spdlog::level::err;
    case Level::kOff: return spdlog::level::off;
  }
  return spdlog::level::info;
}

std::shared_ptr<spdlog::logger> make_logger(int rank) {
  auto logger = std::make_shared<spdlog::logger>(
      "ferry", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  logger->set_pattern("[%H:%M:%S.%e] [ferry r" + std::to_string(rank) + "] [%^%l%$] %v");
  logger->set_level(to_spdlog(g_level.load()));
  logger->flush_on(spdlog::level::warn);
  return logger;
}

struct State {
  std::mutex mutex;
  std::shared_ptr<spdlog::logger> logger = make_logger(0);
  std::set<std::string, std::less<>> warned;
  bool configured = false;  // configure() was called (configure_default then applies nothing)
};

State& state() {
  static State s;  // constructed on first use, thread-safe
  return s;
}

std::shared_ptr<spdlog::logger> logger() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.logger;
}

}  // namespace

void configure(Level level, int rank) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.configured = true;
  g_level = level;
  s.logger = make_logger(rank);
}

bool configure_default(Level level, int rank) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.configured) return false;
  g_level = level;
  s.logger = make_logger(rank);
  return true;
}

bool configured() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.configured;
}

Level level() { return g_level.load(); }

bool enabled(Level lvl) { return lvl != Level::kOff && lvl >= g_level.load(); }

void write(Level lvl, std::string_view message) {
  if (!enabled(lvl)) return;
  logger()->log(to_spdlog(lvl), "{}", message);
}

bool warn_once(std::string_view key, std::string_view message) { return write_once(Level::kWarn, key, message); }

bool write_once(Level level, std::string_view key, std::string_view message) {
  // Below the level nothing is written and the key is kept: the line appears once the level allows.
  if (!enabled(level)) return false;
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.warned.emplace(key).second) return false;
  }
  write(level, message);
  return true;
}

std::string spdlog_version() {
  return std::to_string(SPDLOG_VER_MAJOR) + "." + std::to_string(SPDLOG_VER_MINOR) + "." +
         std::to_string(SPDLOG_VER_PATCH);
}

const char* to_string(Level lvl) {
  switch (lvl) {
    case Level::kTrace: return "trace";
    case Level::kDebug: return "debug";
    case Level::kInfo: return "info";
    case Level::kWarn: return "warn";
    case Level::kError: return "error";
    case Level::kOff: return "off";
  }
  return "?";
}

}  // namespace ferry::log
