// CpuAdam against an fp64 reference, against torch's fused Adam/AdamW, across every kernel this CPU
// runs (each forced in turn), every tail length and unaligned starts; inf/NaN handling; bad input.
#include <ATen/ATen.h>
#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <thread>

#include "../../cpu_adam/cpu_adam.h"
#include "../../cpu_adam/thread_split.h"

namespace ferry {
namespace {

constexpr CpuIsa kAllIsas[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16};
constexpr at::ScalarType kGradTypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
constexpr at::ScalarType kLowpTypes[] = {at::ScalarType::Undefined, at::kBFloat16, at::kHalf};

// Host buffers for one span, with `offset` elements of slack in front so starts can be unaligned.
struct Buffers {
  int64_t n = 0;
  int64_t offset = 0;
  at::ScalarType grad_dtype = at::kFloat;
  at::ScalarType lowp_dtype = at::ScalarType::Undefined;
  std::vector<float> p, m, v, g32;
  std::vector<uint16_t> g16, lowp;

  Buffers(int64_t n_, int64_t offset_, at::ScalarType gd, at::ScalarType ld, uint32_t seed)
      : n(n_), offset(offset_), grad_dtype(gd), lowp_dtype(ld) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    const size_t total = static_cast<size_t>(n + offset);
    p.resize(total);
    m.resize(total);
    v.resize(total);
    g32.resize(total);
    g16.resize(total);
    lowp.assign(total, 0);
    for (size_t i = 0; i < total; ++i) {
      p[i] = normal(rng);
      m[i] = 0.1f * normal(rng);
      v[i] = 0.01f * std::fabs(normal(rng));
    }
    fill_grads(seed + 1);
  }

  void fill_grads(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (size_t i = 0; i < g32.size(); ++i) set_grad(i, normal(rng));
  }
  void set_grad(size_t i, float x) {
    g32[i] = x;
    if (grad_dtype == at::kBFloat16) g16[i] = c10::BFloat16(x).x;
    if (grad_dtype == at::kHalf) g16[i] = c10::Half(x).x;
  }
  void set_grad_bits(size_t i, uint16_t bits16, float f32) {  // exact inf/NaN patterns
    g32[i] = f32;
    g16[i] = bits16;
  }
  // The grad value the kernel sees, as a double.
  double grad(size_t i) const {
    if (grad_dtype == at::kBFloat16) {
      c10::BFloat16 b;
      b.x = g16[i];
      return static_cast<float>(b);
    }
    if (grad_dtype == at::kHalf) {
      c10::Half h;
      h.x = g16[i];
      return static_cast<float>(h);
    }
    return g32[i];
  }

  AdamSpan span() {
    AdamSpan s;
    s.param = p.data() + offset;
    s.grad = grad_dtype == at::kFloat ? static_cast<const void*>(g32.data() + offset) : g16.data() + offset;
    s.grad_dtype = grad_dtype;
    s.exp_avg = m.data() + offset;
    s.exp_avg_sq = v.data() + offset;
    if (lowp_dtype != at::ScalarType::Undefined) {
      s.param_lowp = lowp.data() + offset;
      s.lowp_dtype = lowp_dtype;
    }
    s.numel = n;
    return s;
  }
};

struct Reference {
  std::vector<double> p, m, v;
  explicit Reference(const Buffers& b) {
    for (int64_t i = 0; i < b.n; ++i) {
      p.push_back(b.p[b.offset + i]);
      m.push_back(b.m[b.offset + i]);
      v.push_back(b.v[b.offset + i]);
    }
  }
  void step(const Buffers& b, const AdamOptions& o, int64_t t, double grad_scale) {
    const double bc1 = 1 - std::pow(o.beta1, t), bc2 = 1 - std::pow(o.beta2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      double g = b.grad(b.offset + i) * grad_scale;
      if (o.mode == AdamMode::kAdam) g += o.weight_decay * p[i];
      if (o.mode == AdamMode::kAdamW) p[i] *= 1 - o.lr * o.weight_decay;
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * g * g;
      p[i] -= o.lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + o.eps);
    }
  }
};

// Bitwise equality (distinguishes -0 from +0, compares NaN payloads); safe for empty vectors.
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

uint16_t narrow(float x, at::ScalarType t) {
  return t == at::kBFloat16 ? c10::BFloat16(x).x : c10::Half(x).x;
}

std::string combo(at::ScalarType g, at::ScalarType l, const AdamOptions& o) {
  std::ostringstream os;
  os << "grad " << g << ", lowp " << (l == at::ScalarType::Undefined ? "none" : c10::toString(l)) << ", "
     << to_string(o.mode) << ", wd " << o.weight_decay;
  return os.str();
}

class CpuAdamIsa : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    if (!cpu_supports(GetParam())) GTEST_SKIP() << "this CPU cannot run the " << to_string(GetParam()) << " kernel";
  }
  CpuAdamConfig config(int threads = 2) const {
    CpuAdamConfig c;
    c.threads = threads;
    c.isa = GetParam();
    return c;
  }
};

TEST_P(CpuAdamIsa, MatchesFp64ReferenceOverManySteps) {
  constexpr int kSteps = 25;
  constexpr double kGradScale = 0.5;
  for (at::ScalarType gd : kGradTypes) {
    for (at::ScalarType ld : kLowpTypes) {
      for (AdamMode mode : {AdamMode::kAdam, AdamMode::kAdamW}) {
        for (double wd : {0.0, 0.5}) {
          AdamOptions o;
          o.lr = 1e-2;
          o.mode = mode;
          o.weight_decay = wd;
          CpuAdam adam(o, config());
          Buffers b(1237, 3, gd, ld, 11);
          Reference ref(b);
          for (int t = 1; t <= kSteps; ++t) {
            b.fill_grads(100 + t);
            adam.advance_step(0);
            UpdateOptions u;
            u.grad_scale = kGradScale;
            const UpdateResult r = adam.update(0, b.span(), u);
            ASSERT_TRUE(r.applied && !r.nonfinite);
            ref.step(b, o, t, kGradScale);
          }
          double worst = 0;
          for (int64_t i = 0; i < b.n; ++i) {
            const size_t k = b.offset + i;
            const double tol = 4e-6 * (1 + std::fabs(ref.p[i]));
            worst = std::max(worst, std::fabs(b.p[k] - ref.p[i]) / tol);
            ASSERT_NEAR(b.p[k], ref.p[i], tol) << combo(gd, ld, o) << " at " << i;
            ASSERT_NEAR(b.m[k], ref.m[i], 1e-5 * (1 + std::fabs(ref.m[i]))) << combo(gd, ld, o) << " at " << i;
            ASSERT_NEAR(b.v[k], ref.v[i], 1e-5 * (1 + std::fabs(ref.v[i]))) << combo(gd, ld, o) << " at " << i;
            if (ld != at::ScalarType::Undefined) {
              ASSERT_EQ(b.lowp[k], narrow(b.p[k], ld)) << combo(gd, ld, o) << " at " << i;
            }
          }
          EXPECT_LT(worst, 1.0);
        }
      }
    }
  }
}

// Every kernel gives the scalar kernel's bits, for lengths 0, 1, ..., every tail up to two AVX-512
// vectors past a multiple, and unaligned starts.
TEST_P(CpuAdamIsa, BitIdenticalToScalarForEveryTailAndOffset) {
  std::vector<int64_t> lengths = {0, 1, 2, 3};
  for (int64_t k = 0; k <= 32; ++k) lengths.push_back(64 + k);
  for (at::ScalarType gd : kGradTypes) {
    for (at::ScalarType ld : kLowpTypes) {
      for (int64_t n : lengths) {
        for (int64_t offset : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{7}}) {
          AdamOptions o;
          o.lr = 3e-3;
          o.weight_decay = 0.1;
          o.mode = (n % 2) ? AdamMode::kAdam : AdamMode::kAdamW;
          CpuAdamConfig sc;
          sc.isa = CpuIsa::kScalar;
          CpuAdam scalar(o, sc), simd(o, config());
          Buffers a(n, offset, gd, ld, static_cast<uint32_t>(n * 31 + offset));
          Buffers b = a;
          for (int t = 0; t < 3; ++t) {
            scalar.advance_step(0);
            simd.advance_step(0);
            scalar.update(0, a.span());
            simd.update(0, b.span());
          }
          ASSERT_TRUE(same_bits(a.p, b.p)) << combo(gd, ld, o) << " n=" << n;
          ASSERT_TRUE(same_bits(a.m, b.m)) << combo(gd, ld, o) << " n=" << n;
          ASSERT_TRUE(same_bits(a.v, b.v)) << combo(gd, ld, o) << " n=" << n;
          ASSERT_TRUE(same_bits(a.lowp, b.lowp)) << combo(gd, ld, o) << " n=" << n;
        }
      }
    }
  }
}

TEST_P(CpuAdamIsa, MatchesTorchFusedAdamAndAdamW) {
  for (AdamMode mode : {AdamMode::kAdam, AdamMode::kAdamW}) {
    AdamOptions o;
    o.lr = 1e-3;
    o.weight_decay = 0.01;
    o.mode = mode;
    CpuAdam adam(o, config());
    const int64_t n = 4099;
    at::manual_seed(3);
    at::Tensor p = at::randn({n}), m = at::zeros({n}), v = at::zeros({n});
    at::Tensor tp = p.clone(), tm = m.clone(), tv = v.clone();
    at::Tensor steps = at::zeros({}, at::kFloat);
    for (int t = 1; t <= 10; ++t) {
      at::Tensor g = at::randn({n});
      adam.advance_step(0);
      adam.update(0, p, g, m, v);
      steps.fill_(t);
      if (mode == AdamMode::kAdamW) {
        at::_fused_adamw_({tp}, {g}, {tm}, {tv}, {}, {steps}, o.lr, o.beta1, o.beta2, o.weight_decay, o.eps, false,
                          false);
      } else {
        at::_fused_adam_({tp}, {g}, {tm}, {tv}, {}, {steps}, o.lr, o.beta1, o.beta2, o.weight_decay, o.eps, false,
                         false);
      }
    }
    EXPECT_TRUE(at::allclose(p, tp, 1e-6, 1e-6)) << to_string(mode) << " max diff " << (p - tp).abs().max().item<float>();
    EXPECT_TRUE(at::allclose(m, tm, 1e-6, 1e-7)) << to_string(mode);
    EXPECT_TRUE(at::allclose(v, tv, 1e-6, 1e-9)) << to_string(mode);
  }
}

TEST_P(CpuAdamIsa, NonFiniteGradWritesNothing) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Bad {
    float f32;
    uint16_t bf16, f16;
  };
  for (const Bad bad : {Bad{inf, 0x7f80, 0x7c00}, Bad{-inf, 0xff80, 0xfc00}, Bad{nan, 0x7fc0, 0x7e00}}) {
    for (at::ScalarType gd : kGradTypes) {
      for (int64_t where : {int64_t{0}, int64_t{500}, int64_t{1036}}) {  // first, middle, in the tail
        CpuAdam adam({}, config());
        adam.advance_step(0);
        Buffers b(1037, 1, gd, at::kBFloat16, 5);
        b.set_grad_bits(b.offset + where, gd == at::kBFloat16 ? bad.bf16 : bad.f16, bad.f32);
        const Buffers before = b;
        const UpdateResult r = adam.update(0, b.span());
        EXPECT_FALSE(r.applied);
        EXPECT_TRUE(r.nonfinite);
        EXPECT_TRUE(same_bits(b.p, before.p));
        EXPECT_TRUE(same_bits(b.m, before.m));
        EXPECT_TRUE(same_bits(b.v, before.v));
        EXPECT_TRUE(same_bits(b.lowp, before.lowp));
        EXPECT_TRUE(adam.grad_norm_sq(b.span().grad, gd, b.n).nonfinite);
      }
    }
  }
}

TEST_P(CpuAdamIsa, GradNormMatchesFp64) {
  CpuAdam adam({}, config());
  for (at::ScalarType gd : kGradTypes) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{17}, int64_t{100003}}) {
      Buffers b(n, 3, gd, at::ScalarType::Undefined, 9);
      double want = 0;
      for (int64_t i = 0; i < n; ++i) want += (b.grad(b.offset + i) * 0.25) * (b.grad(b.offset + i) * 0.25);
      const GradNorm got = adam.grad_norm_sq(b.span().grad, gd, n, 0.25);
      EXPECT_FALSE(got.nonfinite);
      // norm_body.h's bound: a lane's 64 fp32 fmas and the 4-level fold, (64 + 4) u of the exact sum of
      // the non-negative squares (the 0.25 scaling is exact); the fp64 sums add ~1e-16 per term.
      EXPECT_NEAR(got.sum_sq, want, (64 + 4) * 0x1p-24 * want + 1e-30) << gd << " n=" << n;
    }
  }
}

// Note [One norm wherever the gradient lives] (cpu_adam/kernels/norm_body.h), written out plainly: the
// gradient's squared norm in the one order every kernel (and the device's) must follow.
double norm_in_the_one_order(const Buffers& b, int64_t n, float scale) {
  constexpr int64_t kLanes = 16, kBlock = 1024, kGrain = 32768;
  double span = 0.0;
  for (int64_t grain_start = 0; grain_start < n; grain_start += kGrain) {
    double grain = 0.0;
    for (int64_t block = grain_start; block < std::min(n, grain_start + kGrain); block += kBlock) {
      float lane[kLanes] = {};
      for (int64_t row = block; row < block + kBlock; row += kLanes) {
        for (int64_t l = 0; l < kLanes && row + l < n; ++l) {
          const float x = static_cast<float>(b.grad(static_cast<size_t>(b.offset + row + l))) * scale;
          lane[l] = std::fma(x, x, lane[l]);
        }
      }
      for (int64_t h = kLanes / 2; h > 0; h /= 2) {
        for (int64_t l = 0; l < h; ++l) lane[l] += lane[l + h];
      }
      grain += static_cast<double>(lane[0]);
    }
    span += grain;
  }
  return span;
}

// Every kernel, at any thread count and split, sums the norm in that one order, to the bit, for every
// gradient dtype, lengths that end inside a row, a block and a grain, and an unaligned start: so a
// chunk's norm, and the clip coefficient, is the same on an AVX2 and an AVX-512 machine and on the
// device (D85). (The per-kernel orders before D85 fail it: scalar and AVX2 summed 64 and 512 elements
// per fp64 term.)
TEST_P(CpuAdamIsa, GradNormSumsInTheOneOrder) {
  int64_t order_sensitive = 0;
  for (at::ScalarType gd : kGradTypes) {
    for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{17}, int64_t{1023}, int64_t{1025}, int64_t{32767},
                      int64_t{32769}, 3 * kGrainElements + 1000 + 7}) {
      const Buffers b(n, 3, gd, at::ScalarType::Undefined, 31);
      const float scale = 0.37f;
      const double want = norm_in_the_one_order(b, n, scale);
      float run = 0.0f;  // one fp32 running sum: another order, to show the data tells orders apart
      for (int64_t i = 0; i < n; ++i) {
        const float x = static_cast<float>(b.grad(static_cast<size_t>(b.offset + i))) * scale;
        run = std::fma(x, x, run);
      }
      order_sensitive += static_cast<double>(run) != want;
      for (int threads : {1, 3}) {
        CpuAdam adam({}, config(threads));
        Buffers copy = b;
        const GradNorm got = adam.grad_norm_sq(copy.span().grad, gd, n, scale);
        EXPECT_FALSE(got.nonfinite);
        EXPECT_EQ(std::memcmp(&got.sum_sq, &want, sizeof(double)), 0)
            << gd << " n=" << n << ", " << threads << " threads: " << got.sum_sq << " vs " << want;
      }
    }
  }
  EXPECT_GT(order_sensitive, 10) << "the gradients should sum to other bits in another order";
}

// A gradient too large for its square sums to inf (not finite) without being inf itself: the flag
// says the gradients are finite, the sum that they overflow, on every kernel alike.
TEST_P(CpuAdamIsa, AnOverflowingNormIsInfWithFiniteGradients) {
  CpuAdam adam({}, config());
  Buffers b(2000, 0, at::kFloat, at::ScalarType::Undefined, 3);
  b.set_grad(1500, 3e19f);
  const GradNorm got = adam.grad_norm_sq(b.span().grad, at::kFloat, b.n);
  EXPECT_FALSE(got.nonfinite);
  EXPECT_TRUE(std::isinf(got.sum_sq)) << got.sum_sq;
}

// Every thread count and split (cpu_adam/thread_split.h) gives the same update and the same gradient
// norm, to the bit: the norm is summed per grain, in grain order, whoever ran each grain.
TEST_P(CpuAdamIsa, ThreadSplitDoesNotChangeBits) {
  const int64_t n = 10 * kGrainElements + 7;  // ten whole grains and a short one
  const Buffers start(n, 0, at::kBFloat16, at::kBFloat16, 21);
  Buffers single = start;
  CpuAdam a({}, config(1));
  a.advance_step(0);
  a.update(0, single.span());
  const GradNorm norm = a.grad_norm_sq(single.span().grad, at::kBFloat16, n, 0.5);
  for (const CpuSplit split : {CpuSplit::kDynamic, CpuSplit::kStatic}) {
    for (int threads : {2, 3, 7}) {
      Buffers many = start;
      CpuAdamConfig c = config(threads);
      c.split = split;
      CpuAdam b({}, c);
      b.advance_step(0);
      b.update(0, many.span());
      const std::string where = std::to_string(threads) + " threads, " + to_string(split);
      ASSERT_TRUE(same_bits(single.p, many.p)) << where;
      ASSERT_TRUE(same_bits(single.m, many.m)) << where;
      ASSERT_TRUE(same_bits(single.v, many.v)) << where;
      ASSERT_TRUE(same_bits(single.lowp, many.lowp)) << where;
      const GradNorm got = b.grad_norm_sq(many.span().grad, at::kBFloat16, n, 0.5);
      EXPECT_EQ(std::memcmp(&got.sum_sq, &norm.sum_sq, sizeof(double)), 0)
          << where << ": " << got.sum_sq << " vs " << norm.sum_sq;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryKernel, CpuAdamIsa, ::testing::ValuesIn(kAllIsas),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(CpuAdam, AsyncEqualsSyncAndKeepsOrder) {
  Buffers a(50000, 0, at::kHalf, at::kHalf, 1);
  Buffers b = a;
  CpuAdam sync, async;
  std::vector<std::future<UpdateResult>> futures;
  for (int t = 0; t < 4; ++t) {
    sync.advance_step(0);
    async.advance_step(0);
    sync.update(0, a.span());
    futures.push_back(async.update_async(0, b.span()));  // queued: each sees its own step count
  }
  for (auto& f : futures) EXPECT_TRUE(f.get().applied);
  EXPECT_TRUE(same_bits(a.p, b.p));
  EXPECT_TRUE(same_bits(a.lowp, b.lowp));
}

// A job's captures (views of chunks in HybridAdam's jobs) are gone when its future is ready: a waiter
// that then counts the references to a chunk (Note [A repack waits for held views]) must not race the
// worker's release. The witness, captured by the job, records whether the future was ready when it
// was destroyed; it used to be, always (packaged_task kept the job until the worker dropped it).
TEST(CpuAdam, RunAsyncReleasesAJobBeforeItsFutureIsReady) {
  struct Witness {
    Witness(std::shared_ptr<std::shared_future<void>> f, std::shared_ptr<std::atomic<int>> r)
        : future(std::move(f)), ready_at_release(std::move(r)) {}
    Witness(const Witness&) = delete;
    Witness& operator=(const Witness&) = delete;
    ~Witness() {
      ready_at_release->store(future->wait_for(std::chrono::seconds(0)) == std::future_status::ready ? 1 : 0);
    }
    std::shared_ptr<std::shared_future<void>> future;
    std::shared_ptr<std::atomic<int>> ready_at_release;  // -1 not yet released, 1 ready, 0 not ready
  };
  CpuAdam adam;
  for (const bool throws : {false, true}) {
    auto future = std::make_shared<std::shared_future<void>>();
    auto ready_at_release = std::make_shared<std::atomic<int>>(-1);
    std::promise<void> go;
    std::shared_future<void> started = go.get_future().share();
    *future = adam.run_async([witness = std::make_shared<Witness>(future, ready_at_release), started, throws] {
                    started.wait();  // until the test has stored the future the witness reads
                    if (throws) throw std::runtime_error("job failed");
                  }).share();
    go.set_value();
    if (throws) {
      EXPECT_THROW(future->get(), std::runtime_error);
    } else {
      future->get();
    }
    for (int i = 0; i < 1000 && ready_at_release->load() == -1; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(ready_at_release->load(), 0) << (throws ? "a job that throws" : "a job that returns")
                                           << ": released before its future was ready";
  }
}

// A frozen group updates with the options and step count it was frozen with, whatever the group has
// since (HybridAdam's updates left running behind a step while the caller sets the next lr).
TEST(CpuAdam, FrozenGroupKeepsItsOptionsAndStep) {
  Buffers now(5000, 0, at::kBFloat16, at::kBFloat16, 3);
  Buffers later = now;
  CpuAdam adam;
  adam.advance_step(0);
  adam.advance_step(0);
  const CpuAdam::FrozenGroup frozen = adam.freeze(0);
  EXPECT_EQ(frozen.step, 2);
  adam.update(0, now.span());
  adam.set_lr(0, adam.options(0).lr * 10);
  adam.advance_step(0);
  adam.update(frozen, later.span());
  EXPECT_TRUE(same_bits(now.p, later.p));
  EXPECT_TRUE(same_bits(now.lowp, later.lowp));
  CpuAdam fresh;
  EXPECT_THROW(fresh.update(fresh.freeze(0), later.span()), c10::Error) << "a group frozen before its first step";
}

TEST(CpuAdam, StepIsAllOrNothingAcrossSpans) {
  CpuAdam adam;
  Buffers good(1000, 0, at::kFloat, at::ScalarType::Undefined, 1);
  Buffers bad(1000, 0, at::kFloat, at::ScalarType::Undefined, 2);
  bad.set_grad(999, std::numeric_limits<float>::infinity());
  const Buffers good_before = good;
  const UpdateResult r = adam.step(0, {good.span(), bad.span()});
  EXPECT_FALSE(r.applied);
  EXPECT_TRUE(r.nonfinite);
  EXPECT_EQ(adam.step_count(0), 0);
  EXPECT_EQ(good.p, good_before.p);
  bad.set_grad(999, 1.0f);
  EXPECT_TRUE(adam.step(0, {good.span(), bad.span()}).applied);
  EXPECT_EQ(adam.step_count(0), 1);
  EXPECT_NE(good.p, good_before.p);
}

TEST(CpuAdam, ParamGroupsKeepTheirOwnStepsAndLr) {
  AdamOptions slow;
  slow.lr = 1e-4;
  CpuAdam adam(slow);
  AdamOptions fast = slow;
  fast.lr = 1e-1;
  const int g1 = adam.add_param_group(fast);
  EXPECT_EQ(g1, 1);
  adam.advance_step(0);
  adam.advance_step(g1);
  adam.advance_step(g1);
  EXPECT_EQ(adam.step_count(0), 1);
  EXPECT_EQ(adam.step_count(g1), 2);
  adam.set_lr(0, 5e-4);
  EXPECT_EQ(adam.options(0).lr, 5e-4);
  EXPECT_EQ(adam.options(g1).lr, 1e-1);
  Buffers a(100, 0, at::kFloat, at::ScalarType::Undefined, 4), b = a;
  adam.update(0, a.span());
  adam.update(g1, b.span());
  EXPECT_GT(std::fabs(b.p[0] - a.p[0]), 1e-3);  // the fast group moved much further
}

template <class F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    return;
  }
  ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
}

TEST(CpuAdam, BadOptionsAreRejectedWithWhatWasExpected) {
  auto with = [](auto change) {
    AdamOptions o;
    change(o);
    return o;
  };
  expect_error([&] { CpuAdam a(with([](AdamOptions& o) { o.lr = -1e-3; })); }, "expected lr >= 0, got -0.001");
  expect_error([&] { CpuAdam a(with([](AdamOptions& o) { o.beta1 = 1.0; })); }, "expected 0 <= beta1 < 1, got 1");
  expect_error([&] { CpuAdam a(with([](AdamOptions& o) { o.beta2 = -0.1; })); }, "0 <= beta2 < 1, got -0.1");
  expect_error([&] { CpuAdam a(with([](AdamOptions& o) { o.eps = 0; })); }, "expected eps > 0, got 0");
  expect_error([&] { CpuAdam a(with([](AdamOptions& o) { o.weight_decay = -1; })); }, "weight_decay >= 0");
  CpuAdam adam;
  expect_error([&] { adam.set_lr(0, -1.0); }, "expected lr >= 0");
  EXPECT_EQ(adam.options(0).lr, AdamOptions{}.lr);  // unchanged after the failed set
  expect_error([&] { adam.set_lr(3, 1.0); }, "param group in [0, 1), got 3");
}

TEST(CpuAdam, BadSpansAndTensorsAreRejected) {
  CpuAdam adam;
  Buffers b(10, 0, at::kFloat, at::ScalarType::Undefined, 1);
  expect_error([&] { adam.update(0, b.span()); }, "before advance_step()");
  adam.advance_step(0);
  AdamSpan s = b.span();
  s.grad_dtype = at::kInt;
  expect_error([&] { adam.update(0, s); }, "grad dtype Float, BFloat16 or Half, got Int");
  s = b.span();
  s.lowp_dtype = at::kFloat;
  s.param_lowp = b.lowp.data();
  expect_error([&] { adam.update(0, s); }, "param_lowp dtype BFloat16 or Half");
  s = b.span();
  s.param_lowp = b.lowp.data();
  expect_error([&] { adam.update(0, s); }, "must be given together");
  s = b.span();
  s.exp_avg = nullptr;
  expect_error([&] { adam.update(0, s); }, "non-null");
  s = b.span();
  UpdateOptions u;
  u.grad_scale = 0;
  expect_error([&] { adam.update(0, s, u); }, "grad_scale > 0, got 0");

  const at::Tensor p = at::zeros({8}), g = at::zeros({8}), m = at::zeros({8}), v = at::zeros({8});
  expect_error([&] { adam.update(0, p, at::zeros({9}), m, v); }, "grad with 8 elements (as param), got 9");
  expect_error([&] { adam.update(0, p.to(at::kDouble), g, m, v); }, "param of dtype Float, got Double");
  expect_error([&] { adam.update(0, p, g.to(at::kDouble), m, v); }, "got Double");
  expect_error([&] { adam.update(0, p, g, at::zeros({16}).slice(0, 0, 16, 2), v); }, "contiguous exp_avg");
  expect_error([&] { adam.update(0, p, g, m, v, at::zeros({8}, at::kFloat)); }, "BFloat16 or Half");
  expect_error([&] { adam.update(0, p, g, m, v, at::zeros({7}, at::kBFloat16)); }, "param_lowp with 8 elements");
}

TEST(CpuAdam, ForcingAKernelTheCpuLacksFails) {
  for (CpuIsa isa : kAllIsas) {
    CpuAdamConfig c;
    c.isa = isa;
    if (cpu_supports(isa)) {
      EXPECT_EQ(CpuAdam({}, c).isa(), isa);
    } else if (above_cap(cpu_features(), isa)) {  // test_cpu_adam_avx2
      expect_error([&] { CpuAdam a({}, c); }, std::string("is above FERRY_CPU_ISA_MAX=") + to_string(*cpu_features().cap));
    } else {
      expect_error([&] { CpuAdam a({}, c); }, "needs CPU features this machine lacks");
    }
  }
  // auto: the best level allowed, under a cap too
  EXPECT_EQ(CpuAdam({}, CpuAdamConfig{}).isa(), best_cpu_isa());
}

}  // namespace
}  // namespace ferry
