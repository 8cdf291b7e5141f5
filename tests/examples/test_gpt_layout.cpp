// The GPT presets' parameter lists without building them (GptConfig::param_numels, checked against
// built modules), and ferry's default chunk size on them: packing waste <= 5% on every preset, in
// bf16 and fp32 (<= 10% on the CPU toy presets), where a fixed 64 MiB wasted up to a third of the
// memory.
#include <gtest/gtest.h>

#include <iostream>

#include "../../chunk/layout.h"
#include "../../examples/gpt/gpt.h"

namespace ferry {
namespace {

TEST(GptLayout, ParamNumelsMatchTheModule) {
  gpt::GptConfig swiglu = gpt::preset("tiny");
  swiglu.swiglu = true;
  swiglu.mlp_hidden = 200;
  for (const gpt::GptConfig& c : {gpt::preset("tiny"), gpt::preset("small"), swiglu}) {
    gpt::Gpt net(c);
    std::vector<int64_t> built;
    for (const auto& p : net->named_parameters()) built.push_back(p.value().numel());
    EXPECT_EQ(c.param_numels(), built) << c.name;
    int64_t sum = 0;
    for (int64_t n : built) sum += n;
    EXPECT_EQ(sum, c.num_params()) << c.name;
  }
}

TEST(GptLayout, AutoChunkSizeWastesAtMostFivePercentOnEveryPreset) {
  for (const std::string& name : gpt::preset_names()) {
    const gpt::GptConfig c = gpt::preset(name);
    const std::vector<int64_t> numels = c.param_numels();
    for (int64_t elem : {2, 4}) {
      const AutoChunkSize choice = auto_chunk_size(numels, {}, elem);
      const ChunkLayout fixed = ChunkLayout::pack(numels, {}, PackOptions::from_bytes(int64_t{64} << 20,
                                                                                       elem == 2 ? at::kBFloat16 : at::kFloat));
      std::cout << name << " (" << c.num_params() / 1e6 << "M, " << elem << " B): auto " << choice.chunk_bytes
                << " B, waste " << choice.waste * 100 << "% (64 MiB: " << fixed.waste() * 100 << "%)\n";
      // The CPU toy presets (< 10M parameters) are bounded by the quarter-of-the-model cap on the chunk
      // size (so that the demos' half-the-model budget holds any op's two chunks): small wastes 7.6%.
      const double limit = c.num_params() < 10'000'000 ? 0.10 : 0.05;
      EXPECT_LE(choice.waste, limit) << name << " at " << elem << " B/elem: chunk " << choice.chunk_bytes;
      EXPECT_GE(choice.chunk_bytes, choice.lo_bytes);
      EXPECT_LE(choice.chunk_bytes, choice.hi_bytes);
      // The layout really is that waste.
      const PackOptions options = PackOptions::from_bytes(choice.chunk_bytes, elem == 2 ? at::kBFloat16 : at::kFloat);
      EXPECT_DOUBLE_EQ(ChunkLayout::pack(numels, {}, options).waste(), choice.waste) << name;
    }
  }
}

}  // namespace
}  // namespace ferry
