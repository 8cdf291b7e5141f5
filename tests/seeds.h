#pragma once
// The seeds of a drawn (property) test: [0, count) by default, so that CI runs the same cases every
// time; FERRY_TEST_SEEDS=<first>:<count> draws others, for a soak run outside CI (a failure prints its
// seed, and the same setting reproduces it). A malformed setting fails the test binary at start, naming
// what was expected, rather than quietly running the default cases.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include "../common/cli.h"

namespace ferry::test {

struct SeedRange {
  int first = 0;
  int count = 0;
};

// Parses "<first>:<count>" (first >= 0, count >= 1, first + count within int) with the options' strict
// integer parser; throws cli::UsageError naming what was expected.
inline SeedRange parse_seed_range(const std::string& text) {
  const size_t colon = text.find(':');
  if (colon == std::string::npos) throw cli::UsageError("expected <first>:<count>, got '" + text + "'");
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  const int64_t first = cli::parse_int("the first seed", text.substr(0, colon), 0, kMax - 1);
  const int64_t count = cli::parse_int("the count", text.substr(colon + 1), 1, kMax - first);
  return {static_cast<int>(first), static_cast<int>(count)};
}

// [0, default_count), or FERRY_TEST_SEEDS's range; a malformed setting aborts, naming it.
inline SeedRange seed_range(int default_count) {
  const char* env = std::getenv("FERRY_TEST_SEEDS");
  if (!env) return {0, default_count};
  try {
    return parse_seed_range(env);
  } catch (const cli::UsageError& e) {
    std::fprintf(stderr, "ferry test: FERRY_TEST_SEEDS='%s': %s (e.g. 1000:500)\n", env, e.what());
    std::abort();
  }
}

// The seeds a parametrized suite instantiates (INSTANTIATE_TEST_SUITE_P(..., seeds(160))).
inline auto seeds(int default_count) -> decltype(::testing::Range(0, 1)) {
  const SeedRange r = seed_range(default_count);
  return ::testing::Range(r.first, r.first + r.count);
}

}  // namespace ferry::test
