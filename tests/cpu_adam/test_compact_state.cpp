// The compact state format (cpu_adam/compact_state.h) and CpuAdam's update over it: the codes' error
// bounds as the note writes them; one step against an fp64 Adam from the same decoded state, within
// the note's bound per stored quantity; every kernel this CPU runs bit for bit equal to the scalar one
// (grad and compute-copy types, decay modes, tails, thread splits, element offsets); stochastic
// rounding unbiased; a sqrt(v) > 0 never stored as 0; bad input refused.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "../../cpu_adam/cpu_adam.h"
#include "../../cpu_adam/thread_split.h"
#include "../../cpu_adam/kernels/kernel_abi.h"
#include "../test_util.h"
#include "adam_reference.h"
#include "compact_buffers.h"

namespace ferry {
namespace {

using test::Compact;
using test::error_of;

constexpr CpuIsa kAllIsas[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16};

// A span's compact state and grads, owned.
float bf16_value(uint16_t bits) { return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits())); }

TEST(CompactState, BytesPerParameterByRole) {
  const CompactStateBytes b = compact_state_bytes(1 << 20);
  EXPECT_EQ(b.master, 2 << 20);
  EXPECT_EQ(b.exp_avg, 1 << 20);
  EXPECT_EQ(b.exp_avg_sq, 1 << 20);
  EXPECT_EQ(b.scales, 8 * (1 << 20) / 256);
  EXPECT_LE(2.0 + static_cast<double>(b.total()) / (1 << 20), 6.04) << "with the bf16 compute copy";
  EXPECT_EQ(compact_state_bytes(257).scales, 16) << "a partial block has its scales";
}

// The codes, through the format's own conversion: a block whose maxima are 1 (scales exactly 1) holds
// values in [-1, 1]; each comes back within the note's bound.
TEST(CompactState, CodesRoundWithinTheirBounds) {
  const int64_t n = 256;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> decades(-7.f, 0.f), unit(0.f, 1.f);
  for (int trial = 0; trial < 200; ++trial) {
    Compact c(n, at::kBFloat16, at::ScalarType::Undefined);
    std::vector<float> p(n, 0.f), m(n), v(n);
    for (int64_t i = 0; i < n; ++i) {
      const float y = std::pow(10.f, decades(rng));
      m[i] = unit(rng) < 0.5f ? -y : y;
      const float u = std::pow(10.f, decades(rng));
      v[i] = u * u;
    }
    m[trial % n] = -1.f;  // the blocks' maxima: scale 1
    v[(trial * 7) % n] = 1.f;
    compact_from_fp32(c.span(), p.data(), m.data(), v.data());
    ASSERT_EQ(c.m_scale[0], 1.f);
    ASSERT_EQ(c.u_scale[0], 1.f);
    const Compact::Decoded d = c.decoded();
    for (int64_t i = 0; i < n; ++i) {
      const double em = std::fabs(static_cast<double>(d.m[i]) - m[i]);
      EXPECT_LE(em, std::max(std::ldexp(std::fabs(static_cast<double>(m[i])), -4), std::ldexp(1.0, -18))) << "m " << m[i];
      if (d.m[i] != 0) {
        EXPECT_EQ(std::signbit(d.m[i]), std::signbit(m[i])) << "m keeps its sign";
      }
      const double u = std::sqrt(static_cast<double>(v[i])), uq = std::sqrt(static_cast<double>(d.v[i]));
      EXPECT_LE(std::fabs(uq - u), std::max(std::ldexp(u, -5), std::ldexp(1.0, -18)) * (1 + 1e-6)) << "u " << u;
      EXPECT_GT(d.v[i], 0.f) << "a v > 0 is never stored as 0 (u " << u << ")";
    }
  }
  // Every code of a full block decodes to a value that encodes to it again (the codes are a float
  // format, not a table with holes), and the magnitudes are increasing.
  Compact c(256, at::kBFloat16, at::ScalarType::Undefined);
  c.m_scale[0] = 1.f;
  c.u_scale[0] = 1.f;
  for (int k = 0; k < 256; ++k) {
    c.m[k] = static_cast<uint8_t>((k & 127) <= 120 ? k : 0);
    c.u[k] = static_cast<uint8_t>(k <= 240 ? k : 0);
  }
  c.m[0] = 120;  // keep the maxima at 1
  c.u[1] = 240;
  const Compact::Decoded d = c.decoded();
  Compact again(256, at::kBFloat16, at::ScalarType::Undefined);
  compact_from_fp32(again.span(), d.p.data(), d.m.data(), d.v.data());
  EXPECT_EQ(again.m, c.m);
  EXPECT_EQ(again.u, c.u);
  for (int k = 2; k <= 120; ++k) EXPECT_LT(std::fabs(d.m[k - 1]), std::fabs(d.m[k])) << k;
}

TEST(CompactState, OneStepIsFp64AdamWithinTheNotesBound) {
  for (const AdamMode mode : {AdamMode::kAdamW, AdamMode::kAdam}) {
    for (const int64_t step : {1, 2, 1000}) {
      const int64_t n = 4096 + 77;
      Compact c(n, at::kBFloat16, at::kBFloat16);
      c.fill(static_cast<uint32_t>(11 + step));
      AdamOptions o;
      o.mode = mode;
      o.lr = 1e-3;
      o.weight_decay = 0.1;
      CpuAdam adam(o);
      adam.set_step_count(0, step - 1);
      adam.advance_step(0);
      Compact::Decoded before = c.decoded();
      std::vector<float> g(n);
      for (int64_t i = 0; i < n; ++i) g[i] = c.grad(i);
      const double grad_scale = 0.5;
      auto t = [&](std::vector<float>& x) { return at::from_blob(x.data(), {n}, at::kFloat); };
      const test::AdamStepFp64 ref = test::adam_step_fp64(t(before.p), t(g), t(before.m), t(before.v), o, step, grad_scale);
      UpdateOptions u;
      u.grad_scale = grad_scale;
      ASSERT_TRUE(adam.update(0, c.span(), u).applied);
      const Compact::Decoded after = c.decoded();
      const auto p64 = ref.param.accessor<double, 1>(), m64 = ref.exp_avg.accessor<double, 1>(),
                 v64 = ref.exp_avg_sq.accessor<double, 1>();
      const auto pt = ref.param_tol.accessor<double, 1>(), mt = ref.exp_avg_tol.accessor<double, 1>(),
                 vt = ref.exp_avg_sq_tol.accessor<double, 1>();
      for (int64_t b = 0; b < compact_blocks(n); ++b) {
        double max_m = 0, max_u = 0;
        for (int64_t i = b * 256; i < std::min(n, (b + 1) * 256); ++i) {
          max_m = std::max(max_m, std::fabs(m64[i]));
          max_u = std::max(max_u, std::sqrt(v64[i]));
        }
        EXPECT_NEAR(c.m_scale[b], max_m, 1e-6 * max_m + 1e-30) << "block " << b;
        EXPECT_NEAR(c.u_scale[b], max_u, 1e-6 * max_u + 1e-30) << "block " << b;
        const double s_m = c.m_scale[b], s_u = c.u_scale[b];
        for (int64_t i = b * 256; i < std::min(n, (b + 1) * 256); ++i) {
          // master: stochastic rounding is within one bf16 ulp (<= 2^-7 |p|) of the fp32 value.
          const double p_bound = std::ldexp(std::fabs(p64[i]) + pt[i], -7) + pt[i];
          ASSERT_LE(std::fabs(after.p[i] - p64[i]), p_bound) << "param " << i << " step " << step;
          ASSERT_EQ(c.lowp[i], c.master[i]) << "the bf16 compute copy is the master";
          // + the fp32 roundings of m / s_m and of the decoded code times s_m (a few 2^-24 of |m|)
          const double m_bound =
              std::ldexp(std::fabs(m64[i]) + mt[i], -4) + std::ldexp(s_m, -18) * (1 + 1e-6) + mt[i] + 1e-6 * std::fabs(m64[i]);
          ASSERT_LE(std::fabs(after.m[i] - m64[i]), m_bound) << "exp_avg " << i;
          const double u = std::sqrt(v64[i]), du = std::sqrt(vt[i]);
          const double u_bound = std::ldexp(u + du, -5) + std::ldexp(s_u, -18) + du;
          ASSERT_LE(std::fabs(std::sqrt(static_cast<double>(after.v[i])) - u), u_bound) << "sqrt(exp_avg_sq) " << i;
        }
      }
    }
  }
}

// Bit for bit across kernels: every grad type, compute copy, decay mode; lengths with tails; thread
// splits (at block starts) and element offsets.
TEST(CompactState, EveryKernelGivesTheScalarKernelsBits) {
  for (const at::ScalarType gd : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const at::ScalarType ld : {at::ScalarType::Undefined, at::kBFloat16, at::kHalf}) {
      for (const AdamMode mode : {AdamMode::kAdamW, AdamMode::kAdam}) {
        for (const double wd : {0.0, 0.01}) {
          for (const int64_t n : {int64_t{1}, int64_t{9}, int64_t{255}, int64_t{256}, int64_t{257}, int64_t{70001}}) {
            for (const int threads : {1, 3}) {
              AdamOptions o;
              o.mode = mode;
              o.weight_decay = wd;
              Compact ref(n, gd, ld);
              ref.fill(static_cast<uint32_t>(n));
              const Compact start = ref;
              CpuAdamConfig scalar_config;
              scalar_config.isa = CpuIsa::kScalar;
              scalar_config.threads = 1;
              CpuAdam scalar(o, scalar_config);
              scalar.advance_step(0);
              ASSERT_TRUE(scalar.update(0, ref.span(1234567)).applied);
              for (const CpuIsa isa : kAllIsas) {
                if (!cpu_supports(isa)) continue;
                CpuAdamConfig config;
                config.isa = isa;
                config.threads = threads;
                CpuAdam adam(o, config);
                adam.advance_step(0);
                Compact c = start;
                ASSERT_TRUE(adam.update(0, c.span(1234567)).applied);
                EXPECT_TRUE(c.same_bits(ref)) << to_string(isa) << " grad " << gd << " lowp " << ld << " n " << n
                                              << " threads " << threads << " wd " << wd;
              }
            }
          }
        }
      }
    }
  }
}

// The threads' split (cpu_adam/thread_split.h) changes no bit: dynamic or static, any thread count,
// over whole grains and a short last one that ends inside a block.
TEST(CompactState, EveryThreadSplitGivesTheSameBits) {
  const int64_t n = 5 * kGrainElements + 300;
  Compact start(n, at::kBFloat16, at::kBFloat16);
  start.fill(77);
  CpuAdamConfig one;
  one.threads = 1;
  CpuAdam ref_adam({}, one);
  ref_adam.advance_step(0);
  Compact ref = start;
  ASSERT_TRUE(ref_adam.update(0, ref.span(99)).applied);
  for (const CpuSplit split : {CpuSplit::kDynamic, CpuSplit::kStatic}) {
    for (const int threads : {2, 5}) {
      CpuAdamConfig config;
      config.threads = threads;
      config.split = split;
      CpuAdam adam({}, config);
      adam.advance_step(0);
      Compact c = start;
      ASSERT_TRUE(adam.update(0, c.span(99)).applied);
      EXPECT_TRUE(c.same_bits(ref)) << threads << " threads, " << to_string(split);
    }
  }
}

// The kernels store a block's codes right after its own update (the default) or beside the next block's
// update (CompactAdamArgs::overlap_blocks, bench_cpu_adam --compact-ab): the same bits either way, for
// every kernel, from ranges that start at a block inside the arrays and end in a partial block, or at a
// whole one.
TEST(CompactState, OverlappedBlocksGiveTheBitsOfOneBlockAtATime) {
  const int64_t n = 7 * 256 + 77;
  for (const CpuIsa isa : kAllIsas) {
    if (!cpu_supports(isa)) continue;
    for (const int64_t begin : {int64_t{0}, int64_t{2 * 256}}) {
      for (const int64_t end : {n, int64_t{6 * 256}}) {
        CpuAdamConfig config;
        config.isa = isa;
        config.threads = 1;
        CpuAdam adam({}, config);
        adam.advance_step(0);
        Compact start(n, at::kBFloat16, at::kBFloat16);
        start.fill(5);
        Compact overlapped = start, one_at_a_time = start;
        cpu_adam::CompactAdamArgs a = adam.compact_kernel_args(adam.freeze(0), overlapped.span(3), 1.0);
        a.overlap_blocks = true;
        adam.kernels().compact_adam(a, begin, end);
        a = adam.compact_kernel_args(adam.freeze(0), one_at_a_time.span(3), 1.0);
        ASSERT_FALSE(a.overlap_blocks) << "the default";
        adam.kernels().compact_adam(a, begin, end);
        EXPECT_TRUE(overlapped.same_bits(one_at_a_time)) << to_string(isa) << " [" << begin << ", " << end << ")";
        EXPECT_FALSE(overlapped.same_bits(start)) << "the update must have run";
      }
    }
  }
}

// Stochastic rounding: elements with the same fp32 result round up in the proportion of their
// distance to the bf16 below; the mean of the stored values is the fp32 value. Another step count
// draws other bits.
TEST(CompactState, StochasticRoundingIsUnbiased) {
  const int64_t n = 1 << 16;
  Compact c(n, at::kFloat, at::ScalarType::Undefined);
  const float p0 = bf16_value(c10::BFloat16(0.3f).x);
  std::vector<float> p(n, p0), m(n, 0.f), v(n, 0.f);
  compact_from_fp32(c.span(), p.data(), m.data(), v.data());
  for (int64_t i = 0; i < n; ++i) c.set_grad(i, 1.f);
  AdamOptions o;
  o.weight_decay = 0;
  o.lr = 1e-4;  // step 1: the update is lr * g / (|g| + eps) ~ lr, a fraction of 0.3's bf16 ulp (2^-9)
  CpuAdam adam(o);
  adam.advance_step(0);
  const Compact fresh = c;
  ASSERT_TRUE(adam.update(0, c.span()).applied);
  const double exact = p0 - 1e-4 / (1.0 + 1e-8);  // the fp32 update is within 1e-7 relative of it
  const double ulp = std::ldexp(1.0, -9);
  double sum = 0;
  int up = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = bf16_value(c.master[i]);
    ASSERT_TRUE(x == p0 || x == p0 - ulp) << x;
    sum += x;
    up += x == p0;
  }
  const double f = (exact - (p0 - ulp)) / ulp;  // the probability of rounding up
  const double sigma = ulp * std::sqrt(f * (1 - f) / n);
  EXPECT_NEAR(sum / n, exact, 5 * sigma + 1e-7 * ulp) << up << " of " << n << " rounded up; expected " << f * n;
  // Round-to-nearest would have stored p0 everywhere: the update would be lost.
  EXPECT_GT(up, 0);
  EXPECT_LT(up, n);
  // Another step count draws another stream; another offset, other bits of it.
  EXPECT_NE(adam.compact_kernel_args(CpuAdam::FrozenGroup{o, 1}, c.span(), 1.0).rounding_seed,
            adam.compact_kernel_args(CpuAdam::FrozenGroup{o, 2}, c.span(), 1.0).rounding_seed);
  Compact shifted = fresh;
  ASSERT_TRUE(adam.update(0, shifted.span(n)).applied);
  EXPECT_NE(shifted.master, c.master);
}

// A block whose largest sqrt(v) dwarfs another's: the small one still decodes > 0, so its next update
// is divided by its own (over-estimated) sqrt(v) + eps, never by eps alone.
TEST(CompactState, ASmallSecondMomentBesideAHugeOneIsNeverZero) {
  Compact c(256, at::kFloat, at::ScalarType::Undefined);
  c.set_grad(0, 1e3f);
  c.set_grad(1, 1e-12f);
  AdamOptions o;
  CpuAdam adam(o);
  adam.advance_step(0);
  ASSERT_TRUE(adam.update(0, c.span()).applied);
  const Compact::Decoded d = c.decoded();
  EXPECT_GT(d.v[1], 0.f);
  EXPECT_EQ(d.v[2], 0.f) << "a zero gradient leaves v at zero";
}

TEST(CompactState, NonFiniteGradsAndBadSpansAreRefused) {
  Compact c(300, at::kFloat, at::ScalarType::Undefined);
  c.fill(5);
  c.set_grad(123, NAN);
  const Compact before = c;
  CpuAdam adam;
  adam.advance_step(0);
  const UpdateResult r = adam.update(0, c.span());
  EXPECT_FALSE(r.applied);
  EXPECT_TRUE(r.nonfinite);
  EXPECT_TRUE(c.same_bits(before)) << "nothing written";
  CompactAdamSpan s = c.span();
  s.exp_avg_scale = nullptr;
  EXPECT_NE(error_of([&] { adam.update(0, s); }).find("their scales"), std::string::npos);
  s = c.span();
  s.grad_dtype = at::kDouble;
  EXPECT_NE(error_of([&] { adam.update(0, s); }).find("expected grad dtype"), std::string::npos);
  s = c.span();
  s.lowp_dtype = at::kBFloat16;
  EXPECT_NE(error_of([&] { adam.update(0, s); }).find("given together"), std::string::npos);
  CpuAdam fresh;
  EXPECT_NE(error_of([&] { fresh.update(0, c.span()); }).find("before advance_step()"), std::string::npos);
}

// The fp32 conversions need only the arrays of the roles they convert: one moment with its codes and
// scales alone (as HybridAdam's state views read it), and a null array of a converted role is refused.
TEST(CompactState, AConversionNeedsOnlyTheArraysOfItsRoles) {
  Compact c(300, at::kFloat, at::ScalarType::Undefined);
  c.fill(5);
  std::vector<float> full_m(300), full_v(300), only(300);
  compact_to_fp32(c.span(), nullptr, full_m.data(), full_v.data());
  CompactAdamSpan m_only = c.span();
  m_only.master = nullptr;
  m_only.exp_avg_sq = nullptr;
  m_only.exp_avg_sq_scale = nullptr;
  compact_to_fp32(m_only, nullptr, only.data(), nullptr);
  EXPECT_EQ(only, full_m);
  EXPECT_NE(error_of([&] { compact_to_fp32(m_only, nullptr, nullptr, only.data()); }).find("null array"),
            std::string::npos);
  EXPECT_NE(error_of([&] { compact_from_fp32(m_only, full_m.data(), nullptr, nullptr); }).find("null array"),
            std::string::npos);
}

// The format's bits, pinned: 20 steps of every kernel over state drawn without libm or <random> (whose
// outputs may differ between standard libraries), one FNV-1a hash of everything the update writes. A
// change to a kernel that changes a bit (faster code must give the same bits: checkpoints in this
// format and the CUDA kernel to come must agree with it) fails here with the hash it got.
TEST(CompactState, TheUpdatesBitsArePinned) {
  constexpr int64_t n = 3 * 256 + 77;  // whole blocks and a partial one
  uint64_t x = 0x9e3779b97f4a7c15ull;
  auto next = [&x] {  // xorshift64*
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    return static_cast<uint32_t>((x * 0x2545f4914f6cdd1dull) >> 32);
  };
  // A float of random sign and mantissa with exponent in [lo, lo + span) (powers of two only: exact).
  auto value = [&](int lo, int span) {
    const uint32_t r = next();
    const uint32_t exponent = static_cast<uint32_t>(127 + lo + static_cast<int>(r % static_cast<uint32_t>(span)));
    const uint32_t bits = (r & 0x80000000u) | (exponent << 23) | (next() & 0x7fffffu);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  };
  Compact start(n, at::kBFloat16, at::kBFloat16);
  std::vector<float> p(n), mm(n), vv(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = value(-8, 6);
    mm[i] = value(-20, 12);
    vv[i] = i % 61 == 3 ? 0.0f : std::fabs(value(-40, 24));
  }
  compact_from_fp32(start.span(), p.data(), mm.data(), vv.data());
  std::vector<std::vector<uint16_t>> grads(20, std::vector<uint16_t>(n));
  for (auto& g : grads) {
    for (int64_t i = 0; i < n; ++i) g[i] = i % 53 == 7 ? 0 : c10::BFloat16(value(-14, 8)).x;
  }
  for (const CpuIsa isa : kAllIsas) {
    if (!cpu_supports(isa)) continue;
    for (const AdamMode mode : {AdamMode::kAdamW, AdamMode::kAdam}) {
      AdamOptions o;
      o.mode = mode;
      o.weight_decay = 0.01;
      CpuAdamConfig config;
      config.isa = isa;
      config.threads = 2;
      CpuAdam adam(o, config);
      Compact c = start;
      uint64_t h = 0xcbf29ce484222325ull;
      auto mix = [&h](const void* data, size_t bytes) {
        const auto* b = static_cast<const uint8_t*>(data);
        for (size_t k = 0; k < bytes; ++k) h = (h ^ b[k]) * 0x100000001b3ull;
      };
      for (const auto& g : grads) {
        c.g16 = g;
        adam.advance_step(0);
        ASSERT_TRUE(adam.update(0, c.span(4242)).applied);
        mix(c.master.data(), c.master.size() * 2);
        mix(c.lowp.data(), c.lowp.size() * 2);
        mix(c.m.data(), c.m.size());
        mix(c.u.data(), c.u.size());
        mix(c.m_scale.data(), c.m_scale.size() * 4);
        mix(c.u_scale.data(), c.u_scale.size() * 4);
      }
      const uint64_t want = mode == AdamMode::kAdamW ? 12913185845383224373ull : 14830328159511916637ull;
      EXPECT_EQ(h, want) << to_string(isa) << (mode == AdamMode::kAdamW ? " AdamW" : " Adam");
    }
  }
}

}  // namespace
}  // namespace ferry
