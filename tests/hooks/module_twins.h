#pragma once
// Helpers of the tests that run a module wrapped in a ChunkedModel beside its unwrapped twin.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../../chunk/layout.h"
#include "../../common/config.h"

namespace ferry::test {

// The simulated device with this chunk size and device budget (0: unlimited).
inline Config tiny_config(int64_t chunk_bytes, int64_t device_budget) {
  Config c;
  c.device = DeviceKind::kSimulated;
  c.chunk_size_bytes = chunk_bytes;
  c.device_budget_bytes = device_budget;
  return c;
}

// The largest parameter chunk (fp32) a module gets with this chunk size: budgets are set in multiples.
inline int64_t largest_chunk_bytes(torch::nn::Module& m, int64_t chunk_bytes) {
  std::vector<int64_t> numels;
  for (auto& p : m.parameters()) numels.push_back(p.numel());
  const auto layout = ChunkLayout::pack(numels, {}, PackOptions::from_bytes(chunk_bytes, at::kFloat));
  int64_t largest = 0;
  for (const auto& c : layout.chunks()) largest = std::max(largest, c.numel * 4);
  return largest;
}

// Both undefined, or equal within fp32 op-order noise.
inline void expect_close(const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.defined(), b.defined()) << what;
  if (!a.defined()) return;
  EXPECT_TRUE(torch::allclose(a, b, /*rtol=*/1e-6, /*atol=*/1e-7))
      << what << ": max |diff| " << (a - b).abs().max().item<double>();
}

}  // namespace ferry::test
