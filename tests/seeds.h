#pragma once
// The seeds of a drawn (property) test: [0, count) by default, so that CI runs the same cases every
// time; FERRY_TEST_SEEDS=<first>:<count> draws others, for a soak run outside CI (a failure prints its
// seed, and the same setting reproduces it). A malformed setting fails the test binary at start, naming
// what was expected, rather than quietly running the default cases.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace ferry::test {

struct SeedRange {
  int first = 0;
  int count = 0;
};

// Parses "<first>:<count>" (first >= 0, count >= 1, first + count within int). False if malformed.
inline bool parse_seed_range(const char* text, SeedRange& out) {
  if (!text) return false;
  const std::string s(text);
  const size_t colon = s.find(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i != colon && (s[i] < '0' || s[i] > '9')) return false;
  }
  if (colon > 9 || s.size() - colon - 1 > 9) return false;  // each fits an int
  const long long first = std::atoll(s.substr(0, colon).c_str());
  const long long count = std::atoll(s.substr(colon + 1).c_str());
  if (count < 1 || first + count > 2147483647LL) return false;
  out = {static_cast<int>(first), static_cast<int>(count)};
  return true;
}

// [0, default_count), or FERRY_TEST_SEEDS's range; a malformed setting aborts, naming it.
inline SeedRange seed_range(int default_count) {
  SeedRange r{0, default_count};
  if (const char* env = std::getenv("FERRY_TEST_SEEDS")) {
    if (!parse_seed_range(env, r)) {
      std::fprintf(stderr, "ferry test: FERRY_TEST_SEEDS='%s': expected <first>:<count>, e.g. 1000:500\n", env);
      std::abort();
    }
  }
  return r;
}

// The seeds a parametrized suite instantiates (INSTANTIATE_TEST_SUITE_P(..., seeds(160))).
inline auto seeds(int default_count) -> decltype(::testing::Range(0, 1)) {
  const SeedRange r = seed_range(default_count);
  return ::testing::Range(r.first, r.first + r.count);
}

}  // namespace ferry::test
