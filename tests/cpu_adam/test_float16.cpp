// The kernels' scalar conversions against c10's (the reference for what torch stores).
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "../../cpu_adam/kernels/float16.h"

namespace ferry::cpu_adam {
namespace {

TEST(Float16, EveryHalfWidensLikeC10) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    c10::Half ref;
    ref.x = static_cast<uint16_t>(h);
    const float want = static_cast<float>(ref);
    const float got = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << std::hex << h;
    } else {
      EXPECT_EQ(f32_bits(got), f32_bits(want)) << std::hex << h;
    }
  }
}

TEST(Float16, EveryBFloat16WidensLikeC10) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    c10::BFloat16 ref;
    ref.x = static_cast<uint16_t>(h);
    EXPECT_EQ(f32_bits(bf16_to_f32(static_cast<uint16_t>(h))), f32_bits(static_cast<float>(ref))) << std::hex << h;
  }
}

// Floats around every rounding boundary: each half/bf16 value, its neighbours, and random bits.
std::vector<float> narrowing_inputs() {
  std::vector<float> xs;
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    for (int64_t d : {-1, 0, 1}) {
      const uint32_t b16 = (h << 16) + static_cast<uint32_t>(d);
      xs.push_back(bits_f32(b16));
      xs.push_back(bits_f32(b16 + 0x8000u));  // exact ties of bf16
      c10::Half hv;
      hv.x = static_cast<uint16_t>(h);
      const float f = static_cast<float>(hv);
      xs.push_back(bits_f32(f32_bits(f) + static_cast<uint32_t>(d)));
      xs.push_back(bits_f32(f32_bits(f) + 0x1000u));  // exact ties of fp16 (normal range)
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) xs.push_back(bits_f32(rng()));
  for (float f : {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, 1e-8f, 2.9802322e-08f, 5.96e-8f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min()}) {
    xs.push_back(f);
  }
  return xs;
}

TEST(Float16, NarrowingRoundsToNearestEvenLikeC10) {
  for (float x : narrowing_inputs()) {
    if (std::isnan(x)) {
      EXPECT_EQ(f32_to_f16(x) & 0x7e00, 0x7e00) << x;
      EXPECT_EQ(f32_to_bf16(x) & 0x7fc0, 0x7fc0) << x;
      continue;
    }
    EXPECT_EQ(f32_to_bf16(x), c10::BFloat16(x).x) << std::hexfloat << x;
    EXPECT_EQ(f32_to_f16(x), c10::Half(x).x) << std::hexfloat << x;
  }
}

}  // namespace
}  // namespace ferry::cpu_adam
