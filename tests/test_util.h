#pragma once
// Helpers shared by ferry's tests.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>

#include "../common/gpu_info.h"
#include "../common/logging.h"

namespace ferry::test {

// Whether glibc's mallinfo2, which ferry's host heap probe reads, sees this process's allocations: not
// under AddressSanitizer or ThreadSanitizer, whose allocators are their own (the probe reads about 0).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kGlibcSeesTheHeap = false;
#else
constexpr bool kGlibcSeesTheHeap = true;
#endif

// The message (without backtrace) of the c10::Error `fn` throws, or "(no error)".
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

// Logs at `level` while it lives, then at the level before (single-process tests: the rank shown is 0).
class LogLevelFor {
 public:
  explicit LogLevelFor(log::Level level) : before_(log::level()) { log::configure(level, 0); }
  ~LogLevelFor() { log::configure(before_, 0); }
  LogLevelFor(const LogLevelFor&) = delete;
  LogLevelFor& operator=(const LogLevelFor&) = delete;

 private:
  log::Level before_;
};

// The index of the parameter named `name` in a ChunkedModel (or anything with num_params() and
// param_name(p)), or -1.
template <class Model>
int64_t param_index(const Model& model, const std::string& name) {
  for (int64_t p = 0; p < model.num_params(); ++p) {
    if (model.param_name(p) == name) return p;
  }
  return -1;
}

// How many times `what` occurs in `text`.
inline size_t occurrences(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

}  // namespace ferry::test

// First statement of every `gpu`-labelled test: skips (reported as skipped, not passed) without a GPU.
// The error `stmt` throws (a c10::Error) names `text`; the message is shown when it does not.
#define EXPECT_ERROR_HAS(stmt, text)                                                           \
  do {                                                                                         \
    const std::string msg_ = ::ferry::test::error_of([&] { stmt; });                           \
    EXPECT_NE(msg_.find(text), std::string::npos) << "message: " << msg_;                      \
  } while (0)

#define FERRY_REQUIRE_GPU()                                                   \
  do {                                                                        \
    if (!::ferry::cuda_available()) GTEST_SKIP() << "no CUDA device present"; \
  } while (0)
