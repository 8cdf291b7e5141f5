#pragma once
// Helpers shared by ferry's tests.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "ferry/common/gpu_info.h"

namespace ferry::test {

// The message (without backtrace) of the c10::Error `fn` throws, or "(no error)".
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

}  // namespace ferry::test

// First statement of every `gpu`-labelled test: skips (reported as skipped, not passed) without a GPU.
#define FERRY_REQUIRE_GPU()                                                   \
  do {                                                                        \
    if (!::ferry::cuda_available()) GTEST_SKIP() << "no CUDA device present"; \
  } while (0)
