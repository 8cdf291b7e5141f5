// The strict option parser every program uses: whole values only, ranges, booleans, unknown and
// repeated options, and messages that name the option, what was expected and what was given.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "../../common/cli.h"
#include "../../common/crc32c.h"

namespace ferry {
namespace {

struct Parsed {
  int64_t steps = 300, batch = 8;
  double lr = 3e-3;
  bool ckpt = false;
  std::string save, corpus = "default";
};

cli::Options options_for(Parsed& p) {
  cli::Options o("prog");
  o.add("steps", &p.steps, "optimizer steps", 1)
      .add("batch", &p.batch, "sequences per step", 1, 1 << 20)
      .add("lr", &p.lr, "learning rate", 0.0, 10.0)
      .add_flag("checkpoint-activations", &p.ckpt, "recompute blocks in backward")
      .add("save", &p.save, "save into DIR")
      .add("corpus", &p.corpus, "text", /*may_be_empty=*/true);
  return o;
}

std::string error_of(const std::vector<std::string>& args) {
  Parsed p;
  cli::Options o = options_for(p);
  try {
    o.parse(args);
  } catch (const cli::UsageError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Cli, ParsesGoodValues) {
  Parsed p;
  cli::Options o = options_for(p);
  o.parse({"--steps=12", "--batch=1000", "--lr=1e-4", "--checkpoint-activations", "--save=/tmp/x", "--corpus="});
  EXPECT_EQ(p.steps, 12);
  EXPECT_EQ(p.batch, 1000);
  EXPECT_DOUBLE_EQ(p.lr, 1e-4);
  EXPECT_TRUE(p.ckpt);
  EXPECT_EQ(p.save, "/tmp/x");
  EXPECT_EQ(p.corpus, "");
  EXPECT_TRUE(o.given("steps"));
  EXPECT_FALSE(cli::Options("x").given("steps"));
}

TEST(Cli, BooleansSayWhatTheyMean) {
  for (const auto& [arg, want] : std::vector<std::pair<std::string, bool>>{
           {"--checkpoint-activations=false", false}, {"--checkpoint-activations=0", false},
           {"--checkpoint-activations=true", true}, {"--checkpoint-activations=off", false}}) {
    Parsed p;
    p.ckpt = !want;
    cli::Options o = options_for(p);
    o.parse({arg});
    EXPECT_EQ(p.ckpt, want) << arg;
  }
  EXPECT_NE(error_of({"--checkpoint-activations=maybe"}).find("--checkpoint-activations: expected true or false, got 'maybe'"),
            std::string::npos);
}

TEST(Cli, RejectsWhatDoesNotParseWhole) {
  // Each once ran as something else: --batch=1e3 as 1, --steps=2x as 2.
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--batch=1e3"}, "--batch: expected an integer, got '1e3'"},
      {{"--steps=2x"}, "--steps: expected an integer, got '2x'"},
      {{"--steps=abc"}, "--steps: expected an integer, got 'abc'"},
      {{"--steps= 3"}, "--steps: expected an integer, got ' 3'"},
      {{"--steps="}, "--steps: expected an integer, got ''"},
      {{"--steps"}, "--steps: expected --steps=N"},
      {{"--steps=0"}, "--steps: expected an integer >= 1, got 0"},
      {{"--batch=2000000"}, "--batch: expected an integer in [1, 1048576], got 2000000"},
      {{"--steps=99999999999999999999"}, "--steps: expected an integer, got '99999999999999999999'"},
      {{"--lr=fast"}, "--lr: expected a finite number, got 'fast'"},
      {{"--lr=nan"}, "--lr: expected a finite number, got 'nan'"},
      {{"--lr=11"}, "--lr: expected a number in [0, 10], got 11"},
      {{"--save="}, "--save: expected a non-empty value"},
      {{"--sav=x"}, "unknown option --sav"},
      {{"steps=3"}, "expected options of the form --name=value, got 'steps=3'"},
      {{"--steps=3", "--steps=4"}, "--steps given twice"},
  };
  for (const auto& [args, message] : cases) {
    EXPECT_NE(error_of(args).find(message), std::string::npos) << args[0] << " -> " << error_of(args);
  }
}

TEST(Cli, RunMainPrintsWithoutBacktraceAndReturnsCodes) {
  testing::internal::CaptureStderr();
  EXPECT_EQ(cli::run_main("prog", [] () -> int { throw cli::UsageError("--steps: expected an integer, got 'x'"); }), 2);
  EXPECT_EQ(cli::run_main("prog", [] () -> int { TORCH_CHECK(false, "ferry: something went wrong"); }), 1);
  EXPECT_EQ(cli::run_main("prog", [] { return 0; }), 0);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("prog: --steps: expected an integer, got 'x' (try --help)"), std::string::npos) << err;
  EXPECT_NE(err.find("prog: ferry: something went wrong\n"), std::string::npos) << err;
  EXPECT_EQ(err.find("Exception raised from"), std::string::npos) << "no C++ backtrace at the default log level: " << err;
  EXPECT_EQ(err.find("prog: prog:"), std::string::npos) << err;
}

// --help (or -h) anywhere, even after a bad option, asks for the usage: the program's options, then each
// section it also accepts; run_main prints it on stdout and returns 0.
TEST(Cli, HelpGivesTheUsageOnStdoutAndSucceeds) {
  int64_t steps = 1;
  std::string save;
  cli::Options o("prog");
  o.add("steps", &steps, "optimizer steps", 1).add("save", &save, "where to save");
  o.also_accepts("ferry options", "  --device=VALUE   the device\n");
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--help"}, {"--steps=3", "-h"},
                                               {"--bogus", "--help"}}) {
    try {
      o.parse(args);
      ADD_FAILURE() << args.back() << " must ask for help";
    } catch (const cli::HelpRequested& e) {
      const std::string text = e.what();
      EXPECT_EQ(text.rfind("usage: prog [options] [ferry options]\n", 0), 0u) << text;
      EXPECT_NE(text.find("  --steps=N"), std::string::npos) << text;
      EXPECT_NE(text.find("optimizer steps\n"), std::string::npos) << text;
      EXPECT_NE(text.find("ferry options:\n  --device=VALUE   the device\n"), std::string::npos) << text;
      EXPECT_EQ(text, o.usage());
    }
  }
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  EXPECT_EQ(cli::run_main("prog", [&]() -> int {
    o.parse({"--help"});
    return 7;  // not reached
  }), 0);
  const std::string out = testing::internal::GetCapturedStdout(), err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(out, o.usage());
  EXPECT_EQ(err, "");
}

TEST(Cli, ExpandableSegmentsOnlyWhenTheUserConfiguredNothing) {
  const char* had = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
  const std::string saved = had ? had : "";
  ::unsetenv("PYTORCH_CUDA_ALLOC_CONF");
  ::setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:128", 1);
  EXPECT_FALSE(cli::prefer_expandable_segments()) << "the user's PYTORCH_ALLOC_CONF wins";
  EXPECT_EQ(std::getenv("PYTORCH_CUDA_ALLOC_CONF"), nullptr);
  ::unsetenv("PYTORCH_ALLOC_CONF");
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6", 1);
  EXPECT_FALSE(cli::prefer_expandable_segments());
  EXPECT_STREQ(std::getenv("PYTORCH_CUDA_ALLOC_CONF"), "garbage_collection_threshold:0.6");
  ::unsetenv("PYTORCH_CUDA_ALLOC_CONF");
  EXPECT_TRUE(cli::prefer_expandable_segments());
  EXPECT_STREQ(std::getenv("PYTORCH_CUDA_ALLOC_CONF"), "expandable_segments:True");
  if (had) {
    ::setenv("PYTORCH_CUDA_ALLOC_CONF", saved.c_str(), 1);
  } else {
    ::unsetenv("PYTORCH_CUDA_ALLOC_CONF");
  }
}

TEST(Crc32c, KnownVectorsAndBothImplementationsAgree) {
  EXPECT_EQ(crc32c_extend(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c_extend_portable(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c_extend(0, "", 0), 0u);
  std::vector<unsigned char> zeros(32, 0);
  EXPECT_EQ(crc32c_extend(0, zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720 B.4
  std::vector<unsigned char> data(100003);
  uint32_t x = 12345;
  for (auto& b : data) b = static_cast<unsigned char>((x = x * 1103515245u + 12345u) >> 24);
  const uint32_t whole = crc32c_extend_portable(0, data.data(), data.size());
  EXPECT_EQ(crc32c_extend(0, data.data(), data.size()), whole) << crc32c_implementation();
  // Streaming in uneven pieces gives the same checksum.
  uint32_t c = 0;
  for (size_t at = 0, n = 1; at < data.size(); at += n, n = n * 3 + 1) {
    c = crc32c_extend(c, data.data() + at, std::min(n, data.size() - at));
  }
  EXPECT_EQ(c, whole);
  EXPECT_EQ(crc32c_hex(0xE3069283u), "e3069283");
}

}  // namespace
}  // namespace ferry

namespace ferry::cli {
namespace {

TEST(Cli, OptionGivenMatchesEitherSpellingOnly) {
  const char* argv[] = {"prog", "--device_budget=1MiB", "--activations=keep", "--activationsx=1", "--steps"};
  EXPECT_TRUE(option_given(5, argv, "activations"));
  EXPECT_TRUE(option_given(5, argv, "device-budget"));
  EXPECT_TRUE(option_given(5, argv, "device_budget"));
  EXPECT_FALSE(option_given(5, argv, "steps"));  // no value: not an option of this form
  EXPECT_FALSE(option_given(5, argv, "activation"));
  EXPECT_FALSE(option_given(1, argv, "activations"));
}

}  // namespace
}  // namespace ferry::cli
