// The device kernels' logic (adam_cuda.cu) run on the host: CudaOps (cuda_ops.h) compiled by the host
// compiler is the same IEEE arithmetic as the intrinsics, the compact kernel's warp steps
// (compact_cuda_block.h) run one lane after another and the fp32 kernel's threads (fp32_cuda_thread.h)
// one after another, over several grids. Both must give the scalar CPU kernel's bits,
// for every gradient and compute-copy dtype, Adam and AdamW, with and without decay, partial blocks,
// grad scales, and the skipped update of a non-finite step. What is left to a GPU (test_device_adam_gpu,
// test_hybrid_adam_gpu) is whether the intrinsics, the shuffles and the barriers do what they say.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <utility>
#include <vector>

#include "../../cpu_adam/compact_state.h"
#include "../../cpu_adam/cpu_adam.h"
#include "../../cpu_adam/kernels/float16.h"
#include "../../cpu_adam/kernels/kernel_abi.h"
#include "compact_buffers.h"

namespace ferry::cpu_adam {
namespace {
#include "../../cpu_adam/kernels/adam_body.h"
#include "../../cpu_adam/kernels/compact_body.h"
#include "../../cpu_adam/kernels/cuda_ops.h"
#include "../../cpu_adam/kernels/compact_cuda_block.h"
#include "../../cpu_adam/kernels/fp32_cuda_thread.h"
#include "../../cpu_adam/kernels/norm_cuda_grain.h"
}  // namespace

namespace {

// What the device's compact kernel writes for these arguments (skip: a non-finite step's).
void compact_as_the_device_does(const CompactAdamArgs& a, int64_t n, bool skip) {
  for_kernel_mode(a.hyper, [&](auto g, auto l, auto decoupled, auto decay) {
    CompactWarpSteps<decltype(g)::value, decltype(l)::value, decltype(decoupled)::value,
                     decltype(decay)::value>::run_on_host(a, n, skip);
  });
}

// What the device's fp32 kernel (adam_kernel) writes with a grid of `threads` threads: each thread's
// elements loaded, updated by AdamLoop::one and stored, or on a skipped step the compute copy from the
// master.
void fp32_as_the_device_does(const AdamKernelArgs& a, int64_t n, bool skip, int64_t threads) {
  for_kernel_mode(a, [&](auto g, auto l, auto decoupled, auto decay) {
    Fp32ThreadSteps<decltype(g)::value, decltype(l)::value, decltype(decoupled)::value,
                    decltype(decay)::value>::run_on_host(a, n, threads, skip);
  });
}

// What the device's norm kernels (norm_grain_kernel, norm_range_kernel) write for n elements.
double norm_as_the_device_does(const void* grad, GradType type, float scale, int64_t n) {
  switch (type) {
    case GradType::kF32: return NormGrainSteps<GradType::kF32>::run_on_host(grad, scale, n);
    case GradType::kBf16: return NormGrainSteps<GradType::kBf16>::run_on_host(grad, scale, n);
    case GradType::kF16: return NormGrainSteps<GradType::kF16>::run_on_host(grad, scale, n);
  }
  return 0.0;
}

// What launch_grad_norms_cuda writes for several ranges of one bf16 array: kNormRanges per launch pair,
// each launch's grains over a grid of `grid` blocks.
std::vector<double> bf16_norms_as_the_device_does(const void* grad, const std::vector<int64_t>& begins,
                                                  const std::vector<int64_t>& ends, int grid) {
  const int64_t count = static_cast<int64_t>(begins.size());
  std::vector<double> out(static_cast<size_t>(count));
  for (int64_t first = 0; first < count; first += kNormRanges) {
    const NormRanges r = NormRanges::batch(begins.data(), ends.data(), count, first);
    NormGrainSteps<GradType::kBf16>::run_ranges_on_host(grad, 1.0f, r, grid, out.data() + first);
  }
  return out;
}

// What the range kernel (norm_range_kernel) writes for a range of `grains` grain totals: its tiles
// staged by every thread and added by one.
double range_total_as_the_device_does(const double* totals, int64_t grains) {
  return NormGrainSteps<GradType::kBf16>::range_on_host(totals, grains);
}
constexpr int64_t kRangeTile = NormGrainSteps<GradType::kBf16>::kRangeTile;

}  // namespace
}  // namespace ferry::cpu_adam

namespace ferry {
namespace {

const at::ScalarType kGradTypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
const at::ScalarType kLowpTypes[] = {at::ScalarType::Undefined, at::kBFloat16, at::kHalf};

uint16_t narrow(float x, at::ScalarType t) { return t == at::kBFloat16 ? c10::BFloat16(x).x : c10::Half(x).x; }

struct Grads {
  std::vector<float> f32;
  std::vector<uint16_t> h16;
  at::ScalarType dtype;
  Grads(int64_t n, at::ScalarType t, std::mt19937& rng) : f32(n), h16(n), dtype(t) {
    std::normal_distribution<float> normal(0.f, 1.f);
    for (int64_t i = 0; i < n; ++i) {
      f32[i] = 1e-3f * normal(rng);
      if (t != at::kFloat) h16[i] = narrow(f32[i], t);
    }
  }
  const void* data() const { return dtype == at::kFloat ? static_cast<const void*>(f32.data()) : h16.data(); }
};

CpuAdam scalar_adam(const AdamOptions& o) {
  CpuAdamConfig c;
  c.isa = CpuIsa::kScalar;
  c.threads = 1;
  return CpuAdam(o, c);
}

std::string where(at::ScalarType g, at::ScalarType l, const AdamOptions& o, int64_t n, double scale) {
  std::ostringstream os;
  os << "grad " << g << ", copy " << (l == at::ScalarType::Undefined ? "none" : c10::toString(l)) << ", "
     << to_string(o.mode) << ", wd " << o.weight_decay << ", n " << n << ", grad scale " << scale;
  return os.str();
}

TEST(CudaKernelsOnHost, TheCompactKernelGivesTheCpuKernelsBits) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const int64_t n : {int64_t{1}, int64_t{255}, int64_t{256}, int64_t{257}, int64_t{2000}}) {
    for (const at::ScalarType gd : kGradTypes) {
      for (const at::ScalarType ld : kLowpTypes) {
        for (const AdamMode mode : {AdamMode::kAdamW, AdamMode::kAdam}) {
          for (const double wd : {0.0, 0.01}) {
            const double scale = n % 2 ? 0.37 : 1.0;
            AdamOptions o;
            o.mode = mode;
            o.weight_decay = wd;
            o.lr = 1e-3;
            CpuAdam adam = scalar_adam(o);
            test::Compact cpu(n, gd, ld);
            cpu.fill(static_cast<uint32_t>(rng()));  // moments over five decades: subnormal codes too
            test::Compact device = cpu;
            for (int step = 0; step < 3; ++step) {  // from the codes the step before wrote
              if (step > 0) {
                for (int64_t i = 0; i < n; ++i) cpu.set_grad(i, 1e-3f * normal(rng) * (i % 61 == 3 ? 1e-4f : 1.f));
                device.g16 = cpu.g16;
                device.g32 = cpu.g32;
              }
              adam.advance_step(0);
              const cpu_adam::CompactAdamArgs args = adam.compact_kernel_args(adam.freeze(0), device.span(777), scale);
              cpu_adam::compact_as_the_device_does(args, n, /*skip=*/false);
              UpdateOptions u;
              u.grad_scale = scale;
              ASSERT_TRUE(adam.update(0, cpu.span(777), u).applied);
              ASSERT_TRUE(device.same_bits(cpu)) << where(gd, ld, o, n, scale) << ", step " << step + 1;
            }
          }
        }
      }
    }
  }
}

TEST(CudaKernelsOnHost, ASkippedCompactStepOnlyGivesTheCopyTheMastersValue) {
  const int64_t n = 600;
  for (const at::ScalarType ld : {at::kBFloat16, at::kHalf}) {
    CpuAdam adam = scalar_adam({});
    test::Compact before(n, at::kBFloat16, ld);
    before.fill(6);
    test::Compact device = before;
    adam.advance_step(0);
    cpu_adam::compact_as_the_device_does(adam.compact_kernel_args(adam.freeze(0), device.span(0), 1.0), n, true);
    test::Compact want = before;
    for (int64_t i = 0; i < n; ++i) {
      const float master = static_cast<float>(c10::BFloat16(before.master[i], c10::BFloat16::from_bits()));
      want.lowp[i] = ld == at::kBFloat16 ? before.master[i] : narrow(master, at::kHalf);
    }
    EXPECT_TRUE(device.same_bits(want)) << ld;
  }
}

TEST(CudaKernelsOnHost, TheFp32KernelGivesTheCpuKernelsBits) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const int64_t n : {int64_t{1}, int64_t{17}, int64_t{1000}}) {
    for (const at::ScalarType gd : kGradTypes) {
      for (const at::ScalarType ld : kLowpTypes) {
        for (const AdamMode mode : {AdamMode::kAdamW, AdamMode::kAdam}) {
          for (const double wd : {0.0, 0.1}) {
            for (const bool skip : {false, true}) {
              const double scale = n % 2 ? 0.5 : 1.0;
              AdamOptions o;
              o.mode = mode;
              o.weight_decay = wd;
              CpuAdam adam = scalar_adam(o);
              std::vector<float> p(n), m(n), v(n);
              std::vector<uint16_t> lowp(n, 0xdead);
              for (int64_t i = 0; i < n; ++i) {
                p[i] = normal(rng);
                m[i] = 1e-3f * normal(rng);
                v[i] = 1e-6f * std::fabs(normal(rng));
              }
              const Grads g(n, gd, rng);
              const bool copy = ld != at::ScalarType::Undefined;
              adam.advance_step(0);
              // The device's grid: one thread (every element in its turns), a few (turns with a
              // partial last one), more threads than elements.
              struct DeviceRun {
                int64_t threads;
                std::vector<float> p, m, v;
                std::vector<uint16_t> lowp;
              };
              std::vector<DeviceRun> runs;
              for (const int64_t threads : {int64_t{1}, int64_t{7}, int64_t{256}}) {
                DeviceRun r{threads, p, m, v, lowp};
                AdamSpan device{r.p.data(), g.data(), gd, r.m.data(), r.v.data(), copy ? r.lowp.data() : nullptr, ld, n};
                cpu_adam::fp32_as_the_device_does(adam.kernel_args(0, device, scale), n, skip, threads);
                runs.push_back(std::move(r));
              }
              AdamSpan cpu{p.data(), g.data(), gd, m.data(), v.data(), copy ? lowp.data() : nullptr, ld, n};
              if (skip) {  // the CPU's skipped update writes nothing; the device's writes the copy
                for (int64_t i = 0; i < n && copy; ++i) lowp[i] = narrow(p[i], ld);
              } else {
                UpdateOptions u;
                u.grad_scale = scale;
                ASSERT_TRUE(adam.update(0, cpu, u).applied);
              }
              for (const DeviceRun& r : runs) {
                const std::string w = where(gd, ld, o, n, scale) + (skip ? ", skipped" : "") + ", " +
                                      std::to_string(r.threads) + " device threads";
                ASSERT_EQ(std::memcmp(p.data(), r.p.data(), n * 4), 0) << w;
                ASSERT_EQ(std::memcmp(m.data(), r.m.data(), n * 4), 0) << w;
                ASSERT_EQ(std::memcmp(v.data(), r.v.data(), n * 4), 0) << w;
                ASSERT_EQ(lowp, r.lowp) << w;
              }
            }
          }
        }
      }
    }
  }
}

// The norm (Note [One norm wherever the gradient lives]): the device's lanes, shuffles and grain sums
// give the bits of every CPU kernel this machine runs, at any thread count, for lengths that end inside
// a row, a block and a grain, with and without a grad scale; and a non-finite gradient a non-finite sum.
TEST(CudaKernelsOnHost, TheNormKernelGivesTheCpuKernelsBits) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> binade(-12, 12);
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{15}, int64_t{1030}, int64_t{32768}, int64_t{70001}}) {
    for (const at::ScalarType gd : kGradTypes) {
      Grads g(n, gd, rng);
      for (int64_t i = 0; i < n; ++i) {  // magnitudes over many binades: other orders give other bits
        g.f32[i] = std::ldexp(normal(rng), binade(rng));
        if (gd != at::kFloat) g.h16[i] = narrow(g.f32[i], gd);
      }
      for (const float scale : {1.0f, 0.37f}) {
        const double device = cpu_adam::norm_as_the_device_does(
            g.data(), gd == at::kFloat ? cpu_adam::GradType::kF32
                      : gd == at::kBFloat16 ? cpu_adam::GradType::kBf16 : cpu_adam::GradType::kF16,
            scale, n);
        for (const CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
          if (!cpu_supports(isa)) continue;
          for (const int threads : {1, 3}) {
            CpuAdamConfig c;
            c.isa = isa;
            c.threads = threads;
            const CpuAdam adam({}, c);
            const double host = adam.grad_norm_sq(g.data(), gd, n, scale).sum_sq;
            EXPECT_EQ(std::memcmp(&host, &device, sizeof(double)), 0)
                << gd << ", n " << n << ", scale " << scale << ", " << to_string(isa) << ", " << threads
                << " threads: " << host << " vs " << device;
          }
        }
      }
    }
  }
  Grads bad(40000, at::kBFloat16, rng);
  bad.h16[33000] = 0x7fc0;  // NaN, in the second grain
  EXPECT_TRUE(std::isnan(cpu_adam::norm_as_the_device_does(bad.data(), cpu_adam::GradType::kBf16, 1.0f, 40000)));
}

// Several ranges in one launch pair, as a chunk's spans are (and more than one launch's 64): each
// grain finds its range (empty ones have none), each block its grains grid apart, and each range's
// value is what the host gives for it alone.
TEST(CudaKernelsOnHost, TheNormKernelSumsEachRangeOfALaunchAsTheHostDoes) {
  std::mt19937 rng(13);
  const int64_t n = 5 * 32768 + 300;
  Grads g(n, at::kBFloat16, rng);
  std::vector<int64_t> begins, ends;
  std::uniform_int_distribution<int64_t> at(0, n);
  for (int k = 0; k < 70; ++k) {
    int64_t a = at(rng), b = at(rng);
    if (k % 9 == 0) b = a;        // empty
    if (k == 3) a = 0, b = n;     // all of it
    if (k == 4) a = 7, b = 40000;  // over a grain boundary
    begins.push_back(std::min(a, b));
    ends.push_back(std::max(a, b));
  }
  const CpuAdam adam;
  for (const int grid : {1, 3, 1000}) {
    const std::vector<double> device = cpu_adam::bf16_norms_as_the_device_does(g.data(), begins, ends, grid);
    for (size_t k = 0; k < begins.size(); ++k) {
      const double host =
          adam.grad_norm_sq(g.h16.data() + begins[k], at::kBFloat16, ends[k] - begins[k]).sum_sq;
      EXPECT_EQ(std::memcmp(&host, &device[k], sizeof(double)), 0)
          << "grid " << grid << ", range " << k << " [" << begins[k] << ", " << ends[k] << "): " << host << " vs "
          << device[k];
    }
  }
}

// The range kernel's tiles: a range of more grains than a tile holds (64M elements: 2,048 grains) is
// added in order (the span total of norm_body.h's note) across its tiles, to the bit; the totals'
// magnitudes make another order give other bits (checked), so a tile added twice, skipped or restarted
// from zero would show.
TEST(CudaKernelsOnHost, TheRangeKernelAddsItsGrainTotalsInOrderAcrossTiles) {
  std::mt19937 rng(17);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::uniform_int_distribution<int> binade(-30, 30);
  for (const int64_t grains : {int64_t{0}, int64_t{1}, cpu_adam::kRangeTile - 1, cpu_adam::kRangeTile,
                               cpu_adam::kRangeTile + 1, 2 * cpu_adam::kRangeTile + 977}) {
    std::vector<double> totals(static_cast<size_t>(grains));
    for (double& t : totals) t = std::ldexp(unit(rng), binade(rng));
    double in_order = 0.0, reversed = 0.0;
    for (int64_t q = 0; q < grains; ++q) in_order += totals[q];
    for (int64_t q = grains; q-- > 0;) reversed += totals[q];
    const double device = cpu_adam::range_total_as_the_device_does(totals.data(), grains);
    EXPECT_EQ(std::memcmp(&device, &in_order, sizeof(double)), 0) << grains << " grains: " << device << " vs " << in_order;
    if (grains > cpu_adam::kRangeTile) {
      EXPECT_NE(in_order, reversed) << "the data must tell orders apart for the test to mean anything";
    }
  }
}

}  // namespace
}  // namespace ferry
