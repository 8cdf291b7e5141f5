#include "exact_sum.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstring>

namespace ferry {
namespace {

constexpr uint64_t kDigitMask = 0xffffffffull;
constexpr int kUnitExponent = -1074;  // a unit is 2^-1074
// Carry before a digit could pass 2^63: each addition adds < 2^32 to a digit.
constexpr uint64_t kMaxPending = uint64_t{1} << 30;
// 2^1024 is 2^2098 units: a sum whose top bit is there or above is beyond every double.
constexpr int kInfBit = 1024 - kUnitExponent;

int top_bit(uint64_t x) { return 63 - __builtin_clzll(x); }

}  // namespace

void ExactSum::add(double term) {
  if (!std::isfinite(term)) {
    (std::isnan(term) || term < 0 ? nan_ : inf_) = true;
    return;
  }
  TORCH_CHECK(term >= 0, "ferry: ExactSum adds non-negative terms, got ", term);
  if (term == 0) return;
  uint64_t bits;
  std::memcpy(&bits, &term, sizeof bits);
  const int biased = static_cast<int>(bits >> 52);
  uint64_t mantissa = bits & ((uint64_t{1} << 52) - 1);
  int shift = 0;  // term = mantissa * 2^(shift + kUnitExponent)
  if (biased != 0) {
    mantissa |= uint64_t{1} << 52;
    shift = biased - 1;
  }
  const int digit = shift / 32;
  const unsigned __int128 placed = static_cast<unsigned __int128>(mantissa) << (shift % 32);  // < 2^85
  digits_[digit] += static_cast<uint64_t>(placed) & kDigitMask;
  digits_[digit + 1] += static_cast<uint64_t>(placed >> 32) & kDigitMask;
  digits_[digit + 2] += static_cast<uint64_t>(placed >> 64);
  if (++pending_ >= kMaxPending) normalize();
}

void ExactSum::add(const ExactSum& other) {
  other.normalize();
  for (int i = 0; i < kDigits; ++i) digits_[i] += other.digits_[i];
  inf_ = inf_ || other.inf_;
  nan_ = nan_ || other.nan_;
  if (++pending_ >= kMaxPending) normalize();
}

void ExactSum::normalize() const {
  if (pending_ == 0) return;
  for (int i = 0; i + 1 < kDigits; ++i) {
    digits_[i + 1] += digits_[i] >> 32;
    digits_[i] &= kDigitMask;
  }
  pending_ = 0;
}

double ExactSum::value() const {
  if (nan_) return std::nan("");
  if (inf_) return HUGE_VAL;
  normalize();
  int h = kDigits - 1;
  while (h >= 0 && digits_[h] == 0) --h;
  if (h < 0) return 0.0;
  const int msb = h * 32 + top_bit(digits_[h]);
  if (msb >= kInfBit) return HUGE_VAL;
  if (msb < 53) {  // at most 53 bits: exact, also as a subnormal
    return std::ldexp(static_cast<double>(digits_[0] | (h > 0 ? digits_[1] << 32 : 0)), kUnitExponent);
  }
  // The top 64 bits, and a sticky bit for any below them: one conversion then rounds them correctly
  // (its rounding point, 11 bits up, lies above the sticky bit). The result is normal (>= 2^53 units),
  // so the scaling is exact.
  auto digit = [&](int i) -> unsigned __int128 { return i >= 0 ? digits_[i] : 0; };
  const unsigned __int128 window = (digit(h) << 64) | (digit(h - 1) << 32) | digit(h - 2);
  const int k = top_bit(digits_[h]);  // window's top bit is 64 + k
  uint64_t top = static_cast<uint64_t>(window >> (k + 1));
  bool sticky = (window & ((static_cast<unsigned __int128>(1) << (k + 1)) - 1)) != 0;
  for (int i = 0; !sticky && i < h - 2; ++i) sticky = digits_[i] != 0;
  top |= sticky ? 1 : 0;
  return std::ldexp(static_cast<double>(top), (h - 2) * 32 + k + 1 + kUnitExponent);
}

std::vector<int64_t> ExactSum::words() const {
  normalize();
  std::vector<int64_t> out(kWords);
  for (int i = 0; i < kDigits; ++i) out[i] = static_cast<int64_t>(digits_[i]);
  out[kDigits] = inf_ ? 1 : 0;
  out[kDigits + 1] = nan_ ? 1 : 0;
  return out;
}

ExactSum ExactSum::from_words(const std::vector<int64_t>& words) {
  TORCH_CHECK(static_cast<int>(words.size()) == kWords, "ferry: ExactSum::from_words expects ", kWords,
              " words, got ", words.size());
  ExactSum s;
  for (int i = 0; i < kWords; ++i) {
    TORCH_CHECK(words[i] >= 0 && words[i] <= (int64_t{1} << 62), "ferry: ExactSum::from_words: word ", i,
                " is ", words[i], ", not a sum of at most 2^30 ranks' words");
  }
  for (int i = 0; i < kDigits; ++i) s.digits_[i] = static_cast<uint64_t>(words[i]);
  s.pending_ = 1;
  s.inf_ = words[kDigits] != 0;
  s.nan_ = words[kDigits + 1] != 0;
  return s;
}

}  // namespace ferry
