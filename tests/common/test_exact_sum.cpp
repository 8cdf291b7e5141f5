// ExactSum against sums worked out by hand (ties to even, overflow, subnormals), against an exact
// 128-bit integer sum over a range of exponents where one fits, and for what it is for: any order,
// grouping or split over ranks of the same terms gives the same bits, where fp64 in order does not.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "../../common/exact_sum.h"

namespace ferry {
namespace {

double sum_of(const std::vector<double>& terms) {
  ExactSum s;
  for (double t : terms) s.add(t);
  return s.value();
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

TEST(ExactSum, RoundsOnceToNearestEven) {
  EXPECT_EQ(sum_of({}), 0.0);
  EXPECT_EQ(sum_of({0.0, -0.0}), 0.0);
  EXPECT_EQ(sum_of({1.5}), 1.5);
  // In order, fp64 loses both halves of an ulp; held exactly they make one.
  EXPECT_EQ(1.0 + 0x1p-53 + 0x1p-53, 1.0);
  EXPECT_EQ(sum_of({1.0, 0x1p-53, 0x1p-53}), 1.0 + 0x1p-52);
  EXPECT_EQ(sum_of({0x1p-53, 1.0, 0x1p-53}), 1.0 + 0x1p-52);
  // Ties go to the even neighbour; anything above the tie, however small, goes up.
  EXPECT_EQ(sum_of({1.0, 0x1p-53}), 1.0);
  EXPECT_EQ(sum_of({1.0 + 0x1p-52, 0x1p-53}), 1.0 + 0x1p-51);
  EXPECT_EQ(sum_of({1.0, 0x1p-53, 0x1p-1000}), 1.0 + 0x1p-52);
  EXPECT_EQ(sum_of({1.0, 0x1p-53, 0x1p-1074}), 1.0 + 0x1p-52);
  EXPECT_EQ(sum_of({0x1p-1074, 0x1p-1074, 0x1p-1074}), 3 * 0x1p-1074);  // subnormals, exactly
  EXPECT_EQ(sum_of({DBL_MIN, 0x1p-1074}), DBL_MIN + 0x1p-1074);
  EXPECT_EQ(sum_of({std::ldexp(1.0, 60), 1.0, -0.0}), std::ldexp(1.0, 60));
  // The top of the range: half an ulp of DBL_MAX is a tie, and DBL_MAX is odd: it rounds to 2^1024.
  EXPECT_EQ(sum_of({DBL_MAX, 0x1p969}), DBL_MAX);
  EXPECT_EQ(sum_of({DBL_MAX, 0x1p970}), HUGE_VAL);
  EXPECT_EQ(sum_of({DBL_MAX, DBL_MAX, DBL_MAX}), HUGE_VAL);
  // A million tenths: exactly 0.1 * 2^20 (a power of two times a double), which fp64 in order is not.
  ExactSum tenths;
  double naive = 0;
  for (int i = 0; i < (1 << 20); ++i) {
    tenths.add(0.1);
    naive += 0.1;
  }
  EXPECT_EQ(tenths.value(), 0.1 * (1 << 20));
  EXPECT_NE(naive, 0.1 * (1 << 20));
}

TEST(ExactSum, NonFiniteTermsAndNegativeOnes) {
  EXPECT_EQ(sum_of({1.0, HUGE_VAL, 2.0}), HUGE_VAL);
  EXPECT_TRUE(std::isnan(sum_of({1.0, std::nan(""), HUGE_VAL})));
  EXPECT_TRUE(std::isnan(sum_of({-HUGE_VAL})));
  ExactSum s;
  s.add(HUGE_VAL);
  EXPECT_FALSE(s.finite());
  ExactSum t;
  t.add(1.0);
  EXPECT_TRUE(t.finite());
  EXPECT_THROW(t.add(-1e-300), c10::Error);
  t.add(s);
  EXPECT_EQ(t.value(), HUGE_VAL);
}

// Terms m * 2^e with e in [-40, 10]: in units of 2^-92 their sum fits 128 bits, where the compiler's
// conversion rounds it once to nearest even; the scaling back is exact (a normal result).
TEST(ExactSum, EqualsAnExactIntegerSumRoundedOnce) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int count = 1 + static_cast<int>(rng() % 1000);
    std::vector<double> terms;
    unsigned __int128 units = 0;
    for (int i = 0; i < count; ++i) {
      const uint64_t mantissa = (rng() >> 11) | (uint64_t{1} << 52);
      const int e = static_cast<int>(rng() % 51) - 40;  // term = mantissa * 2^(e - 52)
      terms.push_back(std::ldexp(static_cast<double>(mantissa), e - 52));
      units += static_cast<unsigned __int128>(mantissa) << (e - 52 + 92);
    }
    const double want = std::ldexp(static_cast<double>(units), -92);
    const double got = sum_of(terms);
    ASSERT_TRUE(same_bits(got, want)) << "trial " << trial << ": " << got << " vs " << want;
  }
}

// What ferry needs of it: the terms of a gradient norm, in any order and cut into any groups (chunks,
// threads) or ranks, read the same; fp64 in order does not, at these sizes.
TEST(ExactSum, NoOrderGroupingOrSplitOverRanksChangesTheBits) {
  std::mt19937_64 rng(11);
  std::vector<double> terms;
  for (int i = 0; i < 3000; ++i) {
    const double g = std::ldexp(static_cast<double>(rng() >> 11), -53 - static_cast<int>(rng() % 400));
    terms.push_back(g * g * (1 + static_cast<double>(rng() % 1000)));
  }
  terms.push_back(DBL_MIN / 3);  // a subnormal
  const double want = sum_of(terms);
  bool fp64_changed = false;
  double first_fp64 = 0;
  for (int trial = 0; trial < 20; ++trial) {
    std::shuffle(terms.begin(), terms.end(), rng);
    double fp64 = 0;
    for (double t : terms) fp64 += t;
    if (trial == 0) first_fp64 = fp64;
    fp64_changed = fp64_changed || !same_bits(fp64, first_fp64);
    // Cut into groups of random sizes, each summed on its own, then merged.
    ExactSum merged;
    size_t at = 0;
    while (at < terms.size()) {
      const size_t len = std::min(terms.size() - at, 1 + static_cast<size_t>(rng() % 200));
      ExactSum group;
      for (size_t i = at; i < at + len; ++i) group.add(terms[i]);
      merged.add(group);
      at += len;
    }
    ASSERT_TRUE(same_bits(merged.value(), want)) << "trial " << trial;
    // Split over 5 "ranks": their words summed element-wise, as an all-reduce does.
    std::vector<ExactSum> ranks(5);
    for (size_t i = 0; i < terms.size(); ++i) ranks[rng() % 5].add(terms[i]);
    std::vector<int64_t> words(ExactSum::kWords, 0);
    for (const ExactSum& r : ranks) {
      const std::vector<int64_t> w = r.words();
      for (int k = 0; k < ExactSum::kWords; ++k) words[k] += w[k];
    }
    ASSERT_TRUE(same_bits(ExactSum::from_words(words).value(), want)) << "trial " << trial;
  }
  EXPECT_TRUE(fp64_changed) << "the test's terms no longer show what exactness buys";
  // A rank's inf or NaN reaches every rank.
  ExactSum inf;
  inf.add(HUGE_VAL);
  std::vector<int64_t> w = inf.words();
  const std::vector<int64_t> one = ExactSum().words();
  for (int k = 0; k < ExactSum::kWords; ++k) w[k] += one[k];
  EXPECT_EQ(ExactSum::from_words(w).value(), HUGE_VAL);
  EXPECT_THROW(ExactSum::from_words(std::vector<int64_t>{1, 2}), c10::Error);
}

}  // namespace
}  // namespace ferry
