#pragma once
// Test helper: two HybridAdams over two ChunkedModels hold the same bits: every parameter's fp32
// master, exp_avg, exp_avg_sq and compute-copy value (gtest fatal failures name the step and tensor).
// Compared on the CPU: HybridAdam's views are where the state lives, so one twin's may be CUDA tensors
// and the other's host tensors (seen on the H100: at::equal refuses tensors on two devices).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "../../hooks/chunked_model.h"
#include "../../optim/hybrid_adam.h"

namespace ferry::test {

inline void expect_same_state(HybridAdam& a_adam, HybridAdam& b_adam, ChunkedModel& a, ChunkedModel& b,
                              const std::string& when) {
  for (int64_t p = 0; p < a.num_params(); ++p) {
    const auto& name = a.param_name(p);
    ASSERT_TRUE(torch::equal(a_adam.master(p).cpu(), b_adam.master(p).cpu())) << when << ": master " << name;
    ASSERT_TRUE(torch::equal(a_adam.exp_avg(p).cpu(), b_adam.exp_avg(p).cpu())) << when << ": exp_avg " << name;
    ASSERT_TRUE(torch::equal(a_adam.exp_avg_sq(p).cpu(), b_adam.exp_avg_sq(p).cpu())) << when << ": exp_avg_sq " << name;
    ASSERT_TRUE(torch::equal(a.param_values(p).cpu(), b.param_values(p).cpu())) << when << ": " << name;
  }
}

}  // namespace ferry::test
