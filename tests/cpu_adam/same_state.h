#pragma once
// Test helper: two HybridAdams over two ChunkedModels hold the same bits: every parameter's fp32
// master, exp_avg, exp_avg_sq and compute-copy value (gtest fatal failures name the step and tensor).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "ferry/cpu_adam/hybrid_adam.h"
#include "ferry/hooks/chunked_model.h"

namespace ferry::test {

inline void expect_same_state(HybridAdam& a_adam, HybridAdam& b_adam, ChunkedModel& a, ChunkedModel& b,
                              const std::string& when) {
  for (int64_t p = 0; p < a.num_params(); ++p) {
    const auto& name = a.param_name(p);
    ASSERT_TRUE(torch::equal(a_adam.master(p), b_adam.master(p))) << when << ": master " << name;
    ASSERT_TRUE(torch::equal(a_adam.exp_avg(p), b_adam.exp_avg(p))) << when << ": exp_avg " << name;
    ASSERT_TRUE(torch::equal(a_adam.exp_avg_sq(p), b_adam.exp_avg_sq(p))) << when << ": exp_avg_sq " << name;
    ASSERT_TRUE(torch::equal(a.param_values(p).cpu(), b.param_values(p).cpu())) << when << ": " << name;
  }
}

}  // namespace ferry::test
