// bench_cpu_adam: the mixed-precision Adam step on the host (fp32 master/moments, bf16 grads, bf16
// param copy out), measured in one run against
//   roof         a streaming kernel with the same 4 read and 4 write streams and almost no arithmetic
//                (the machine's attainable bandwidth for this access pattern),
//   torch_fused  at::_fused_adamw_ on fp32 plus the casts torch needs (bf16 grad -> fp32 before,
//                fp32 param -> bf16 after), into preallocated buffers,
//   torch_optim  torch::optim::AdamW::step() with the same casts.
// Effective GB/s = 28 declared bytes per parameter / time (read master 4, grad 2, m 4, v 4; write
// master 4, m 4, v 4, bf16 copy 2), the same for every row so ratios are ratios of time.
// The compact state (cpu_adam/compact_state.h) in the same run: `compact` (its update, bf16 grads and
// copy) against `compact_roof` (a streaming kernel over the same streams), at its own declared bytes:
// read master 2, grad 2, m 1, v 1; write master 2, m 1, v 1, bf16 copy 2; the blocks' two fp32 scales
// read and written (16 B per 256): 12.0625 B per parameter. The two alternate rep by rep, and
// `compact_vs_roof_paired` is the median of their per-rep time ratios (`compact_vs_roof`: the ratio of
// their medians). `compact_in_cache` is the same update over 64K elements per thread (786 KB of state
// each, which stays in a core's L2): the kernel's arithmetic ceiling on this host at that thread count,
// memory out of the way. `compact_ceiling_vs_roof` divides it by the better of the two roofs: below 1,
// no memory system would let the kernel reach its roof here (it is bound by its instructions); above
// 1, what it loses to the roof is lost to memory.
// `--split-ab` adds `split_ab` to each row: the fp32 update with its threads' split dynamic and static
// (cpu_adam/thread_split.h; the same bits) alternated rep by rep, while `--contend=K` threads spin
// beside it (K = 0: alone), as autograd's, the training thread's and the copy engine's threads run
// beside the host Adam inside a step; `dynamic_speedup_paired` is the median per-rep time ratio
// static / dynamic.
// `grad_norm`: CpuAdam::grad_norm_sq of the bf16 gradients (2 B read per parameter; the norm's one
// order of summation, D85), the host's pass for a chunk whose norm was not taken on the device;
// `grad_norm_vs_roof`: its 2 B at the roof's rate (measured in the same run) over its time.
// `--compact-ab` adds `compact_ab`: the compact kernel with each block's codes stored beside the next
// block's update (CompactAdamArgs::overlap_blocks) and one block at a time (the default; the same
// bits), alternated rep by rep, streaming (N) and in cache; `speedup_paired` is the median per-rep
// time ratio one-at-a-time / overlapped (above 1: overlapping is faster).
//
//   bench_cpu_adam [--sizes=16M,64M,256M] [--threads=1,2,...] [--min-time=0.5] [--split-ab] [--contend=K]
//                  [--compact-ab] [--commit=SHA] [--config...]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ops/_fused_adamw.h>
#include <omp.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "../../cpu_adam/kernels/kernel_abi.h"
#include "../../cpu_adam/thread_split.h"
#include "../../ferry.h"

namespace {

constexpr double kDeclaredBytesPerParam = 28.0;
constexpr double kCompactBytesPerParam = ferry::kCompactUpdateBytesPerParam;
constexpr int64_t kInCachePerThread = int64_t{1} << 16;  // elements: 786 KB of compact state
constexpr int kInCacheBatch = 16;                        // updates per timed rep (each is ~50 us)
using Clock = std::chrono::steady_clock;

struct Timing {
  double median_s = 0, best_s = 0;
  int reps = 0;
};

// Runs f once to warm up, then until min_time has passed (at least 3 times).
template <class F>
Timing measure(F&& f, double min_time) {
  f();
  std::vector<double> t;
  const auto start = Clock::now();
  while (t.size() < 3 || std::chrono::duration<double>(Clock::now() - start).count() < min_time) {
    const auto a = Clock::now();
    f();
    t.push_back(std::chrono::duration<double>(Clock::now() - a).count());
    if (t.size() >= 50) break;
  }
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front(), static_cast<int>(t.size())};
}

// f and g alternated rep by rep (after a warm-up of each), so that both see the same drift of a shared
// machine's memory bandwidth; `ratio`: the median of the reps' time(g) / time(f).
struct PairedTiming {
  Timing f, g;
  double ratio = 0;
};
template <class F, class G>
PairedTiming measure_paired(F&& f, G&& g, double min_time) {
  f();
  g();
  std::vector<double> tf, tg, ratio;
  const auto start = Clock::now();
  while (tf.size() < 3 || std::chrono::duration<double>(Clock::now() - start).count() < 2 * min_time) {
    auto a = Clock::now();
    f();
    tf.push_back(std::chrono::duration<double>(Clock::now() - a).count());
    a = Clock::now();
    g();
    tg.push_back(std::chrono::duration<double>(Clock::now() - a).count());
    ratio.push_back(tg.back() / tf.back());
    if (tf.size() >= 50) break;
  }
  auto timing = [](std::vector<double> t) {
    std::sort(t.begin(), t.end());
    return Timing{t[t.size() / 2], t.front(), static_cast<int>(t.size())};
  };
  std::sort(ratio.begin(), ratio.end());
  return {timing(tf), timing(tg), ratio[ratio.size() / 2]};
}

// Same streams as the Adam step: reads p, g(bf16), m, v; writes p, m, v, lowp(bf16).
template <int>
void roof_body(float* __restrict p, const uint16_t* __restrict g, float* __restrict m, float* __restrict v,
               uint16_t* __restrict lowp, int64_t b, int64_t e) {
#pragma omp simd
  for (int64_t i = b; i < e; ++i) {
    uint32_t gb = static_cast<uint32_t>(g[i]) << 16;
    float gf;
    __builtin_memcpy(&gf, &gb, 4);
    const float pi = p[i] + gf;
    m[i] += gf;
    v[i] += gf;
    p[i] = pi;
    uint32_t pb;
    __builtin_memcpy(&pb, &pi, 4);
    lowp[i] = static_cast<uint16_t>(pb >> 16);
  }
}
__attribute__((target("avx2,fma,f16c"))) void roof_avx2(float* p, const uint16_t* g, float* m, float* v,
                                                         uint16_t* lowp, int64_t b, int64_t e) {
  roof_body<1>(p, g, m, v, lowp, b, e);
}
void roof_plain(float* p, const uint16_t* g, float* m, float* v, uint16_t* lowp, int64_t b, int64_t e) {
  roof_body<0>(p, g, m, v, lowp, b, e);
}

// The compact state's streams: reads master, g (bf16), m, v (bytes); writes master, m, v, lowp.
template <int>
void compact_roof_body(uint16_t* __restrict p, const uint16_t* __restrict g, uint8_t* __restrict m,
                       uint8_t* __restrict v, uint16_t* __restrict lowp, int64_t b, int64_t e) {
#pragma omp simd
  for (int64_t i = b; i < e; ++i) {
    const uint16_t pi = static_cast<uint16_t>(p[i] + g[i]);
    m[i] = static_cast<uint8_t>(m[i] + g[i]);
    v[i] = static_cast<uint8_t>(v[i] ^ g[i]);
    p[i] = pi;
    lowp[i] = pi;
  }
}
__attribute__((target("avx2,fma,f16c"))) void compact_roof_avx2(uint16_t* p, const uint16_t* g, uint8_t* m,
                                                                 uint8_t* v, uint16_t* lowp, int64_t b, int64_t e) {
  compact_roof_body<1>(p, g, m, v, lowp, b, e);
}
void compact_roof_plain(uint16_t* p, const uint16_t* g, uint8_t* m, uint8_t* v, uint16_t* lowp, int64_t b, int64_t e) {
  compact_roof_body<0>(p, g, m, v, lowp, b, e);
}
void compact_roof(uint16_t* p, const uint16_t* g, uint8_t* m, uint8_t* v, uint16_t* lowp, int64_t n, int threads,
                  bool avx2) {
#pragma omp parallel num_threads(threads)
  {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    int64_t per = ((n + nt - 1) / nt + 255) / 256 * 256;
    const int64_t b = std::min(n, id * per), e = std::min(n, b + per);
    if (b < e) (avx2 ? compact_roof_avx2 : compact_roof_plain)(p, g, m, v, lowp, b, e);
  }
}

void roof(float* p, const uint16_t* g, float* m, float* v, uint16_t* lowp, int64_t n, int threads, bool avx2) {
#pragma omp parallel num_threads(threads)
  {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    int64_t per = ((n + nt - 1) / nt + 15) / 16 * 16;
    const int64_t b = std::min(n, id * per), e = std::min(n, b + per);
    if (b < e) (avx2 ? roof_avx2 : roof_plain)(p, g, m, v, lowp, b, e);
  }
}

std::string timing_json(const Timing& t, int64_t n, double bytes_per_param = kDeclaredBytesPerParam) {
  std::ostringstream os;
  os << "{\"median_s\":" << t.median_s << ",\"best_s\":" << t.best_s << ",\"reps\":" << t.reps
     << ",\"params_per_s\":" << n / t.median_s << ",\"gb_per_s\":" << bytes_per_param * n / t.median_s / 1e9
     << "}";
  return os.str();
}

// "16M,64M" or "1,2,4": positive counts, M = 2^20. `what` names the option in errors.
std::vector<int64_t> parse_counts(const std::string& what, const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    const bool mebi = !item.empty() && (item.back() == 'M' || item.back() == 'm');
    if (mebi) item.pop_back();
    out.push_back(ferry::cli::parse_int(what, item, 1, mebi ? int64_t{1} << 40 : int64_t{1} << 60) << (mebi ? 20 : 0));
  }
  return out;
}

int64_t available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return int64_t{8} << 30;
}

// K threads that keep a core busy each (plain arithmetic, no memory traffic) while it lives.
class Spinners {
 public:
  explicit Spinners(int k) {
    for (int i = 0; i < k; ++i) {
      threads_.emplace_back([this] {
        volatile double x = 1.0;
        while (!stop_.load(std::memory_order_relaxed)) x = x * 1.0000001 + 1e-9;
      });
    }
  }
  ~Spinners() {
    stop_ = true;
    for (auto& t : threads_) t.join();
  }
  Spinners(const Spinners&) = delete;
  Spinners& operator=(const Spinners&) = delete;

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

}  // namespace

int run(int argc, char** argv) {
  std::vector<std::string> rest;
  const ferry::Config config = ferry::Config::from_args(argc, argv, &rest);
  ferry::log::configure(config.log_level, config.rank);
  std::string sizes_text = "16M,64M,256M", threads_text, commit = "unknown";
  double min_time = 0.5;
  bool split_ab = false, compact_ab = false;
  int64_t contenders = 0;
  ferry::cli::Options options("bench_cpu_adam");
  options.also_accepts("ferry options", ferry::Config::help());
  options.add("sizes", &sizes_text, "parameters per row, comma-separated, M = 2^20 (default 16M,64M,256M)")
      .add("threads", &threads_text, "OpenMP threads per row, comma-separated (default 1, 2, 4, ... and all)", true)
      .add("min-time", &min_time, "seconds each variant runs at least (default 0.5)", 0.0)
      .add_flag("split-ab", &split_ab, "add split_ab: the fp32 update's dynamic and static thread splits")
      .add("contend", &contenders, "threads spinning beside split_ab (default 0)", 0, 1024)
      .add_flag("compact-ab", &compact_ab, "add compact_ab: the compact kernel's blocks overlapped and not")
      .add("commit", &commit, "the commit to report");
  options.parse(rest);
  const std::vector<int64_t> sizes = parse_counts("--sizes", sizes_text);
  std::vector<int64_t> threads = threads_text.empty() ? std::vector<int64_t>{} : parse_counts("--threads", threads_text);
  const int max_threads = omp_get_max_threads();
  if (threads.empty()) {
    for (int t = 1; t < max_threads; t *= 2) threads.push_back(t);
    threads.push_back(max_threads);
  }
  // Largest footprint: torch_optim holds p, grad, m, v fp32 + bf16 grad + bf16 copy = 20 B/param beside
  // ferry's 16 B/param buffers. Keep everything under 60% of available memory.
  const int64_t budget = available_memory_bytes() * 6 / 10;
  const bool avx2 = ferry::cpu_supports(ferry::CpuIsa::kAvx2);

  std::ostringstream results;
  bool first = true;
  for (int64_t n : sizes) {
    if (n * 36 > budget) {
      ferry::log::warn("skipping N=", n, ": needs ", ferry::format_bytes(n * 36), ", budget ",
                       ferry::format_bytes(budget));
      continue;
    }
    at::manual_seed(0);
    at::Tensor p = at::randn({n}), m = at::zeros({n}), v = at::zeros({n});
    at::Tensor g16 = (at::randn({n}) * 1e-2).to(at::kBFloat16), lowp = at::empty({n}, at::kBFloat16);
    for (int64_t t : threads) {
      const int nt = static_cast<int>(t);
      at::set_num_threads(nt);
      ferry::log::info("N=", n, " threads=", nt);
      // ferry
      ferry::AdamOptions o;
      o.lr = 1e-4;
      o.weight_decay = 0.01;
      ferry::CpuAdamConfig cc = ferry::CpuAdamConfig::from(config);
      cc.threads = nt;
      ferry::CpuAdam adam(o, cc);
      ferry::AdamSpan span{p.data_ptr<float>(), g16.data_ptr(), at::kBFloat16, m.data_ptr<float>(),
                           v.data_ptr<float>(), lowp.data_ptr(), at::kBFloat16, n};
      ferry::UpdateOptions checked;
      checked.grads_checked = true;
      const Timing ferry_t = measure([&] { adam.advance_step(0); adam.update(0, span, checked); }, min_time);
      const Timing ferry_checked_t = measure([&] { adam.advance_step(0); adam.update(0, span); }, min_time);
      double norm_sink = 0.0;
      const Timing norm_t = measure([&] { norm_sink += adam.grad_norm_sq(g16).sum_sq; }, min_time);
      std::string split_json;
      if (split_ab) {
        ferry::CpuAdamConfig dc = cc, sc = cc;
        dc.split = ferry::CpuSplit::kDynamic;
        sc.split = ferry::CpuSplit::kStatic;
        ferry::CpuAdam dynamic_adam(o, dc), static_adam(o, sc);
        PairedTiming ab;
        {
          const Spinners spin(static_cast<int>(contenders));
          ab = measure_paired([&] { dynamic_adam.advance_step(0); dynamic_adam.update(0, span, checked); },
                              [&] { static_adam.advance_step(0); static_adam.update(0, span, checked); }, min_time);
        }
        split_json = ",\"split_ab\":{\"contenders\":" + std::to_string(contenders) + ",\"dynamic\":" +
                     timing_json(ab.f, n) + ",\"static\":" + timing_json(ab.g, n) +
                     ",\"dynamic_speedup_paired\":" + std::to_string(ab.ratio) + "}";
        ferry::log::info("  split: dynamic ", kDeclaredBytesPerParam * n / ab.f.median_s / 1e9, " GB/s, static ",
                         kDeclaredBytesPerParam * n / ab.g.median_s / 1e9, " GB/s with ", contenders,
                         " spinning threads beside them (paired static/dynamic ", ab.ratio, ")");
      }
      // roof
      const Timing roof_t = measure([&] {
        roof(p.data_ptr<float>(), reinterpret_cast<const uint16_t*>(g16.data_ptr()), m.data_ptr<float>(),
             v.data_ptr<float>(), reinterpret_cast<uint16_t*>(lowp.data_ptr()), n, nt, avx2);
      }, min_time);
      // torch fused + casts
      Timing fused_t, optim_t;
      {
        at::Tensor g32 = at::empty({n});
        at::Tensor steps = at::zeros({});
        int step = 0;
        fused_t = measure([&] {
          g32.copy_(g16);
          steps.fill_(++step);
          at::_fused_adamw_({p}, {g32}, {m}, {v}, {}, {steps}, o.lr, o.beta1, o.beta2, o.weight_decay, o.eps, false,
                            false);
          lowp.copy_(p);
        }, min_time);
      }
      {
        at::Tensor param = p.clone().requires_grad_(false);
        param.mutable_grad() = at::empty({n});
        torch::optim::AdamW optim({param}, torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay));
        optim_t = measure([&] {
          param.mutable_grad().copy_(g16);
          optim.step();
          lowp.copy_(param);
        }, min_time);
      }
      // the compact state, from the same values
      Timing compact_t, compact_roof_t, in_cache_t;
      std::string compact_ab_json;
      double compact_vs_roof_paired = 0;
      const int64_t in_cache_n = std::min(n, nt * kInCachePerThread);
      {
        const int64_t blocks = ferry::compact_blocks(n);
        at::Tensor cm = at::empty({n}, at::kByte), cv = at::empty({n}, at::kByte), cmaster = at::empty({n}, at::kBFloat16);
        at::Tensor scales = at::empty({2 * blocks});
        ferry::CompactAdamSpan cs;
        cs.master = reinterpret_cast<uint16_t*>(cmaster.data_ptr());
        cs.grad = g16.data_ptr();
        cs.grad_dtype = at::kBFloat16;
        cs.exp_avg = cm.data_ptr<uint8_t>();
        cs.exp_avg_scale = scales.data_ptr<float>();
        cs.exp_avg_sq = cv.data_ptr<uint8_t>();
        cs.exp_avg_sq_scale = scales.data_ptr<float>() + blocks;
        cs.param_lowp = lowp.data_ptr();
        cs.lowp_dtype = at::kBFloat16;
        cs.numel = n;
        ferry::compact_from_fp32(cs, p.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>());
        // The roof streams through arrays of its own: what it writes is no state to update.
        at::Tensor roof_m = cm.clone(), roof_v = cv.clone(), roof_master = cmaster.clone(), roof_lowp = lowp.clone();
        // The update and its roof alternated, their ratio per pair of reps: this VM's bandwidth drifts
        // by 1.5x between minutes, which a ratio of two separately measured medians carries whole.
        const PairedTiming paired = measure_paired(
            [&] { adam.advance_step(0); adam.update(0, cs, checked); },
            [&] {
              compact_roof(reinterpret_cast<uint16_t*>(roof_master.data_ptr()),
                           reinterpret_cast<const uint16_t*>(g16.data_ptr()), roof_m.data_ptr<uint8_t>(),
                           roof_v.data_ptr<uint8_t>(), reinterpret_cast<uint16_t*>(roof_lowp.data_ptr()), n, nt, avx2);
            },
            min_time);
        compact_t = paired.f;
        compact_roof_t = paired.g;
        compact_vs_roof_paired = paired.ratio;
        // The arithmetic ceiling: the first in_cache_n elements (whole blocks, one range per thread),
        // kInCacheBatch updates per rep.
        ferry::CompactAdamSpan head = cs;
        head.numel = in_cache_n;
        in_cache_t = measure([&] {
          for (int k = 0; k < kInCacheBatch; ++k) {
            adam.advance_step(0);
            adam.update(0, head, checked);
          }
        }, min_time);
        in_cache_t.median_s /= kInCacheBatch;
        in_cache_t.best_s /= kInCacheBatch;
        if (compact_ab) {
          // The kernel called directly, as CpuAdam calls it (its threads' split), with the order set.
          const ferry::cpu_adam::CompactAdamFn fn = adam.kernels().compact_adam;
          auto run = [&](const ferry::CompactAdamSpan& s, bool overlap, int reps) {
            ferry::cpu_adam::CompactAdamArgs args = adam.compact_kernel_args(adam.freeze(0), s, 1.0);
            args.overlap_blocks = overlap;
            for (int k = 0; k < reps; ++k) {
              ferry::for_each_grain(s.numel, nt, adam.split(), [&](int64_t b, int64_t e, int64_t) { fn(args, b, e); });
            }
          };
          const PairedTiming streaming = measure_paired([&] { run(cs, true, 1); }, [&] { run(cs, false, 1); }, min_time);
          PairedTiming cached =
              measure_paired([&] { run(head, true, kInCacheBatch); }, [&] { run(head, false, kInCacheBatch); }, min_time);
          for (Timing* t : {&cached.f, &cached.g}) {
            t->median_s /= kInCacheBatch;
            t->best_s /= kInCacheBatch;
          }
          compact_ab_json = ",\"compact_ab\":{\"overlapped\":" + timing_json(streaming.f, n, kCompactBytesPerParam) +
                            ",\"one_block_at_a_time\":" + timing_json(streaming.g, n, kCompactBytesPerParam) +
                            ",\"speedup_paired\":" + std::to_string(streaming.ratio) +
                            ",\"in_cache_overlapped\":" + timing_json(cached.f, in_cache_n, kCompactBytesPerParam) +
                            ",\"in_cache_one_block_at_a_time\":" +
                            timing_json(cached.g, in_cache_n, kCompactBytesPerParam) +
                            ",\"in_cache_speedup_paired\":" + std::to_string(cached.ratio) + "}";
          ferry::log::info("  compact blocks overlapped / one at a time: ", streaming.ratio, "x streaming, ",
                           cached.ratio, "x in cache");
        }
      }
      const double best_roof_gb_per_s = std::max(kDeclaredBytesPerParam * n / roof_t.median_s,
                                                 kCompactBytesPerParam * n / compact_roof_t.median_s) / 1e9;
      const double ceiling_gb_per_s = kCompactBytesPerParam * in_cache_n / in_cache_t.median_s / 1e9;
      if (!first) results << ",";
      first = false;
      results << "\n    {\"n\":" << n << ",\"threads\":" << nt << ",\"ferry\":" << timing_json(ferry_t, n)
              << ",\"ferry_with_finite_check\":" << timing_json(ferry_checked_t, n)
              << ",\"grad_norm\":" << timing_json(norm_t, n, 2.0)
              << ",\"grad_norm_vs_roof\":" << (2.0 * n / (kDeclaredBytesPerParam * n / roof_t.median_s)) / norm_t.median_s
              << ",\"roof\":" << timing_json(roof_t, n) << ",\"torch_fused\":" << timing_json(fused_t, n)
              << ",\"torch_optim_adamw\":" << timing_json(optim_t, n)
              << ",\"ferry_vs_roof\":" << roof_t.median_s / ferry_t.median_s
              << ",\"ferry_vs_torch_fused\":" << fused_t.median_s / ferry_t.median_s
              << ",\"ferry_vs_torch_optim\":" << optim_t.median_s / ferry_t.median_s
              << ",\"compact\":" << timing_json(compact_t, n, kCompactBytesPerParam)
              << ",\"compact_roof\":" << timing_json(compact_roof_t, n, kCompactBytesPerParam)
              << ",\"compact_vs_roof\":" << compact_roof_t.median_s / compact_t.median_s
              << ",\"compact_vs_roof_paired\":" << compact_vs_roof_paired
              << ",\"compact_vs_fp32_state\":" << ferry_t.median_s / compact_t.median_s
              << ",\"compact_in_cache\":" << timing_json(in_cache_t, in_cache_n, kCompactBytesPerParam)
              << ",\"compact_in_cache_n\":" << in_cache_n << ",\"best_roof_gb_per_s\":" << best_roof_gb_per_s
              << ",\"compact_ceiling_vs_roof\":" << ceiling_gb_per_s / best_roof_gb_per_s << split_json
              << compact_ab_json << "}";
      ferry::log::info("  ferry ", kDeclaredBytesPerParam * n / ferry_t.median_s / 1e9, " GB/s, roof ",
                       kDeclaredBytesPerParam * n / roof_t.median_s / 1e9, " GB/s, torch fused ",
                       kDeclaredBytesPerParam * n / fused_t.median_s / 1e9, " GB/s, torch optim ",
                       kDeclaredBytesPerParam * n / optim_t.median_s / 1e9, " GB/s; compact ",
                       kCompactBytesPerParam * n / compact_t.median_s / 1e9, " GB/s, its roof ",
                       kCompactBytesPerParam * n / compact_roof_t.median_s / 1e9, " GB/s (paired ratio ",
                       compact_vs_roof_paired, "); compact in cache ", ceiling_gb_per_s, " GB/s (",
                       ceiling_gb_per_s / best_roof_gb_per_s, " of the better roof); grad norm ",
                       2.0 * n / norm_t.median_s / 1e9, " GB/s (sum ", norm_sink > 0 ? "> 0" : "0", ")");
    }
  }
  const ferry::CpuAdam probe(ferry::AdamOptions{}, ferry::CpuAdamConfig::from(config));  // the kernel the runs used
  std::cout << "{\n  \"benchmark\": \"cpu_adam\",\n  \"commit\": \"" << commit << "\",\n  \"kernel\": \""
            << ferry::to_string(probe.isa()) << "\",\n  \"declared_bytes_per_param\": " << kDeclaredBytesPerParam
            << ",\n  \"bytes_per_param\": {\"fp32_state\": " << kDeclaredBytesPerParam << ", \"compact_state\": "
            << kCompactBytesPerParam << "}"
            << ",\n  \"env\": " << ferry::env_report_json(ferry::collect_env_report()) << ",\n  \"results\": ["
            << results.str() << "\n  ]\n}\n";
  return 0;
}

int main(int argc, char** argv) {
  return ferry::cli::run_main("bench_cpu_adam", [&] { return run(argc, argv); });
}
