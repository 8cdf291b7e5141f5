// AdamOptions: the defaults are torch::optim::AdamWOptions' (a default AdamOptions is torch's AdamW),
// the setters chain on the same object, validate() accepts the edges of every range and refuses every
// bad value (negative, out of range, infinite, NaN) with a message naming the field and the value.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>

#include "../../cpu_adam/adam_options.h"
#include "../test_util.h"

namespace ferry {
namespace {

using test::error_of;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

TEST(AdamOptions, DefaultsAreTorchsAdamW) {
  const AdamOptions o;
  const torch::optim::AdamWOptions torch_o;
  EXPECT_EQ(o.lr, torch_o.lr());
  EXPECT_EQ(o.beta1, std::get<0>(torch_o.betas()));
  EXPECT_EQ(o.beta2, std::get<1>(torch_o.betas()));
  EXPECT_EQ(o.eps, torch_o.eps());
  EXPECT_EQ(o.weight_decay, torch_o.weight_decay());
  EXPECT_EQ(o.mode, AdamMode::kAdamW);
  EXPECT_EQ(error_of([&] { o.validate(); }), "(no error)");
}

TEST(AdamOptions, SettersChainOnTheSameObject) {
  AdamOptions o;
  AdamOptions& same = o.with_lr(3e-4).with_betas(0.8, 0.95).with_eps(1e-6).with_weight_decay(0.1).with_mode(AdamMode::kAdam);
  EXPECT_EQ(&same, &o);
  EXPECT_EQ(o.lr, 3e-4);
  EXPECT_EQ(o.beta1, 0.8);
  EXPECT_EQ(o.beta2, 0.95);
  EXPECT_EQ(o.eps, 1e-6);
  EXPECT_EQ(o.weight_decay, 0.1);
  EXPECT_EQ(o.mode, AdamMode::kAdam);
  // On a temporary, as in the header's example.
  const AdamOptions t = AdamOptions().with_lr(1.0).with_weight_decay(0);
  EXPECT_EQ(t.lr, 1.0);
  EXPECT_EQ(t.weight_decay, 0.0);
  EXPECT_EQ(t.beta2, 0.999) << "the fields not set keep their defaults";
}

TEST(AdamOptions, TheEdgesOfEveryRangeAreValid) {
  for (const AdamOptions& o : {AdamOptions().with_lr(0), AdamOptions().with_betas(0, 0),
                               AdamOptions().with_betas(std::nextafter(1.0, 0.0), std::nextafter(1.0, 0.0)),
                               AdamOptions().with_weight_decay(0), AdamOptions().with_eps(1e-300)}) {
    EXPECT_EQ(error_of([&] { o.validate(); }), "(no error)");
  }
}

// Each bad value is refused naming its field and the value given.
TEST(AdamOptions, ValidateRefusesEachBadValueNamingIt) {
  struct Case {
    AdamOptions options;
    std::string message;
  };
  const Case cases[] = {
      {AdamOptions().with_lr(-1e-3), "Adam: expected lr >= 0, got -0.001"},
      {AdamOptions().with_lr(kInf), "Adam: expected lr >= 0, got inf"},
      {AdamOptions().with_lr(kNaN), "Adam: expected lr >= 0, got nan"},
      {AdamOptions().with_betas(-0.1, 0.999), "Adam: expected 0 <= beta1 < 1, got -0.1"},
      {AdamOptions().with_betas(1.0, 0.999), "Adam: expected 0 <= beta1 < 1, got 1"},
      {AdamOptions().with_betas(kNaN, 0.999), "Adam: expected 0 <= beta1 < 1, got nan"},
      {AdamOptions().with_betas(0.9, 1.0), "Adam: expected 0 <= beta2 < 1, got 1"},
      {AdamOptions().with_betas(0.9, -0.5), "Adam: expected 0 <= beta2 < 1, got -0.5"},
      {AdamOptions().with_betas(0.9, kInf), "Adam: expected 0 <= beta2 < 1, got inf"},
      {AdamOptions().with_eps(0), "Adam: expected eps > 0, got 0"},
      {AdamOptions().with_eps(-1e-8), "Adam: expected eps > 0, got -1e-08"},
      {AdamOptions().with_eps(kInf), "Adam: expected eps > 0, got inf"},
      {AdamOptions().with_eps(kNaN), "Adam: expected eps > 0, got nan"},
      {AdamOptions().with_weight_decay(-0.01), "Adam: expected weight_decay >= 0, got -0.01"},
      {AdamOptions().with_weight_decay(kInf), "Adam: expected weight_decay >= 0, got inf"},
      {AdamOptions().with_weight_decay(kNaN), "Adam: expected weight_decay >= 0, got nan"},
  };
  for (const Case& c : cases) {
    const std::string msg = error_of([&] { c.options.validate(); });
    EXPECT_NE(msg.find(c.message), std::string::npos) << "expected '" << c.message << "', got '" << msg << "'";
  }
  // The first bad field is the one named.
  const std::string msg = error_of([] { AdamOptions().with_lr(-1).with_eps(0).validate(); });
  EXPECT_NE(msg.find("lr"), std::string::npos) << msg;
}

TEST(AdamOptions, ModeNames) {
  EXPECT_STREQ(to_string(AdamMode::kAdam), "adam");
  EXPECT_STREQ(to_string(AdamMode::kAdamW), "adamw");
}

}  // namespace
}  // namespace ferry
