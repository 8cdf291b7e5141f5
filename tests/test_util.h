#pragma once
// Helpers shared by ferry's tests.
#include <gtest/gtest.h>

#include "ferry/common/gpu_info.h"

// First statement of every `gpu`-labelled test: skips (reported as skipped, not passed) without a GPU.
#define FERRY_REQUIRE_GPU()                                                   \
  do {                                                                        \
    if (!::ferry::cuda_available()) GTEST_SKIP() << "no CUDA device present"; \
  } while (0)
