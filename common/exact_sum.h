#pragma once
// ExactSum: a sum of non-negative doubles held exactly and rounded once, when read (to nearest, ties
// to even). Any order or grouping of the same terms, added one by one or merged from partial sums
// (threads, chunks, ranks), reads as the same bits. ferry totals a step's gradient norm with it:
// one term per parameter, wherever its chunk is and however the chunks are cut (D87).
//
//   ExactSum s;
//   s.add(1.0); s.add(0x1p-53); s.add(0x1p-53);
//   s.value() == 1.0 + 0x1p-52      // fp64 left to right gives 1.0
//
// How: a fixed-point integer in units of 2^-1074 (the smallest subnormal) over 68 digits of 32 bits,
// each digit in a 64-bit word so that 2^30 additions fit before carries must move. Enough for every
// finite double (up to 2^1024 = 2^2098 units) and 2^77 more of them.
//
// Contract: terms are >= 0 or not finite (+inf: the value is +inf; NaN: NaN, -inf: NaN); a finite
// negative term is refused (TORCH_CHECK). value() is a correctly rounded double, +inf when the exact
// sum rounds beyond DBL_MAX. Not thread-safe: one object per thread, merged with add(ExactSum).
#include <array>
#include <cstdint>
#include <vector>

namespace ferry {

class ExactSum {
 public:
  static constexpr int kDigits = 68;

  void add(double term);
  void add(const ExactSum& other);
  ExactSum& operator+=(double term) {
    add(term);
    return *this;
  }
  ExactSum& operator+=(const ExactSum& other) {
    add(other);
    return *this;
  }

  // The sum, rounded once.
  double value() const;
  bool finite() const { return !inf_ && !nan_; }

  // For a sum over ranks (an all-reduce of int64 SUM): the digits, normalised (each < 2^32), then an
  // inf count and a NaN count; from_words() takes the element-wise sum of up to 2^30 ranks' words.
  std::vector<int64_t> words() const;
  static ExactSum from_words(const std::vector<int64_t>& words);
  static constexpr int kWords = kDigits + 2;

 private:
  void normalize() const;

  // mutable: value() and words() carry the digits (the same number, another representation).
  mutable std::array<uint64_t, kDigits> digits_{};
  mutable uint64_t pending_ = 0;  // additions since the digits were last carried (each < 2^32 per digit)
  bool inf_ = false;
  bool nan_ = false;
};

}  // namespace ferry
