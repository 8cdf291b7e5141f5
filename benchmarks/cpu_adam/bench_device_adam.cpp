// bench_device_adam: the mixed-precision Adam update of device-resident state (fp32 master and
// moments, bf16 gradients, the bf16 value written over the gradient), measured in one run as
//   roof         a device-to-device copy (read + write): the attainable memory bandwidth,
//   ferry        device_adam_update (D53): one pass, 28 B per parameter,
//   torch_fused  what HybridAdam ran before D53: the bf16 gradient cast to an fp32 temporary,
//                at::_fused_adamw_, then the fp32 master copied into the bf16 slot (40 B per parameter
//                actually moved: 6 + 28 + 6).
//   compact      the same update over the compact state (D76, compact_state.h): 12.0625 B per parameter
//                (bf16 grad read, bf16 master and two 1-byte codes read and written, the bf16 value
//                written over the gradient, two fp32 scales per 256).
//   norm         device_grad_norms_sq (D85) of the bf16 gradients, one span: 2 B read per parameter,
//                against torch_norm, at::linalg_vector_norm with fp32 accumulation (what ferry ran
//                before D85; its own order, so not the host's bits).
// Floor = declared B x N / roof bandwidth (28 B for the fp32 rows, 12.0625 for compact); every row
// reports time / its floor. GB/s use the row's declared bytes.
//
//   bench_device_adam [--device=cuda|simulated] [--small=N] [--large=N] [--min-time=0.5] [--commit=SHA]
// On the simulated device (CPU tensors: CpuAdam's kernel) it is a smoke test of the benchmark itself:
// torch's copy there is no roof for the host's memory (bench_cpu_adam measures that one).
#include <ATen/ATen.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/linalg_vector_norm.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <sstream>

#include "../../ferry.h"

#ifdef FERRY_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace {

constexpr double kDeclaredBytesPerParam = 28.0;
constexpr double kCompactBytesPerParam = ferry::kCompactUpdateBytesPerParam;
using Clock = std::chrono::steady_clock;

void sync(const at::Device& d) {
#ifdef FERRY_WITH_CUDA
  if (d.is_cuda()) c10::cuda::device_synchronize();
#endif
}

struct Timing {
  double median_s = 0, best_s = 0;
  int reps = 0;
};

// f once to warm up, then until min_time has passed (at least 5 times); each rep synchronized.
template <class F>
Timing measure(const at::Device& d, F&& f, double min_time) {
  f();
  sync(d);
  std::vector<double> t;
  const auto start = Clock::now();
  while (t.size() < 5 || std::chrono::duration<double>(Clock::now() - start).count() < min_time) {
    const auto a = Clock::now();
    f();
    sync(d);
    t.push_back(std::chrono::duration<double>(Clock::now() - a).count());
    if (t.size() >= 200) break;
  }
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front(), static_cast<int>(t.size())};
}

std::string row(const Timing& t, int64_t n, double floor_s, double bytes_per_param = kDeclaredBytesPerParam) {
  std::ostringstream os;
  os << "{\"median_s\":" << t.median_s << ",\"best_s\":" << t.best_s << ",\"reps\":" << t.reps
     << ",\"gb_per_s\":" << bytes_per_param * n / t.median_s / 1e9 << ",\"over_floor\":" << t.median_s / floor_s
     << "}";
  return os.str();
}

int run(int argc, char** argv) {
  std::vector<std::string> rest;
  const ferry::Config config = ferry::Config::from_args(argc, argv, &rest);
  ferry::log::configure(config.log_level, config.rank);
  int64_t small = int64_t{64} << 20, large = int64_t{256} << 20;
  double min_time = 0.5;
  std::string commit = "unknown";
  ferry::cli::Options options("bench_device_adam");
  options.also_accepts("ferry options", ferry::Config::help());
  options.add("small", &small, "parameters of the first size (default 67108864 = 64Mi)", 1)
      .add("large", &large, "parameters of the second size (default 268435456 = 256Mi)", 1)
      .add("min-time", &min_time, "seconds each variant runs at least (default 0.5)", 0.0)
      .add("commit", &commit, "commit id recorded in the JSON");
  options.parse(rest);
  const std::vector<int64_t> sizes = {small, large};
  const bool cuda = ferry::resolve_device_kind(config.device) == ferry::DeviceKind::kCuda;
  TORCH_CHECK(!cuda || ferry::cuda_available(), "--device=cuda needs a GPU, this machine has "
              "none (--device=simulated runs the smoke test)");
  const at::Device device = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const auto f32 = at::TensorOptions(at::kFloat).device(device);

  std::ostringstream results;
  bool first = true;
  for (int64_t n : sizes) {
    ferry::log::info("N=", n, " on ", device);
    at::manual_seed(0);
    at::Tensor p = at::randn({n}, f32), m = at::zeros({n}, f32), v = at::zeros({n}, f32);
    const at::Tensor g_values = (at::randn({n}, f32) * 1e-2).to(at::kBFloat16);
    at::Tensor g = g_values.clone();
    // Roof: a copy of 16 B per parameter each way, the size of the Adam's streams.
    at::Tensor src = at::empty({4 * n}, f32), dst = at::empty({4 * n}, f32);
    const Timing roof_t = measure(device, [&] { dst.copy_(src); }, min_time);
    const double roof_bw = 2.0 * 16.0 * n / roof_t.median_s;  // bytes read + written per second
    src.reset();
    dst.reset();
    const double floor_s = kDeclaredBytesPerParam * n / roof_bw;

    ferry::AdamOptions o;
    o.lr = 1e-4;
    o.weight_decay = 0.01;
    ferry::CpuAdam adam(o);
    // The bf16 value written over the gradient is the next rep's gradient: restoring one would add
    // 4 B per parameter to the timed bytes, and any finite bf16 value is as good a gradient.
    const ferry::AdamSpan span{p.data_ptr<float>(), g.data_ptr(), at::kBFloat16, m.data_ptr<float>(),
                               v.data_ptr<float>(), g.data_ptr(), at::kBFloat16, n};
    const Timing ferry_t = measure(device, [&] {
      adam.advance_step(0);
      ferry::device_adam_update(adam, 0, span, 1.0, device);
    }, min_time);

    at::Tensor g32 = at::empty({n}, f32);
    at::Tensor steps = at::zeros({}, f32);
    int step = 0;
    const Timing fused_t = measure(device, [&] {
      g32.copy_(g);
      steps.fill_(++step);
      at::_fused_adamw_({p}, {g32}, {m}, {v}, {}, {steps}, o.lr, o.beta1, o.beta2, o.weight_decay, o.eps, false, false);
      g.copy_(p);
    }, min_time);

    // The compact state: a bf16 master, zero moments (their codes and scales), the same gradients.
    p.reset();
    m.reset();
    v.reset();
    g32.reset();
    at::Tensor master = at::randn({n}, f32).to(at::kBFloat16);
    at::Tensor codes = at::zeros({2, n}, at::TensorOptions(at::kByte).device(device));
    at::Tensor scales = at::zeros({2, ferry::compact_blocks(n)}, f32);
    g.copy_(g_values);
    ferry::CompactAdamSpan cspan;
    cspan.master = static_cast<uint16_t*>(master.data_ptr());
    cspan.grad = g.data_ptr();
    cspan.grad_dtype = at::kBFloat16;
    cspan.exp_avg = codes[0].data_ptr<uint8_t>();
    cspan.exp_avg_sq = codes[1].data_ptr<uint8_t>();
    cspan.exp_avg_scale = scales[0].data_ptr<float>();
    cspan.exp_avg_sq_scale = scales[1].data_ptr<float>();
    cspan.param_lowp = g.data_ptr();
    cspan.lowp_dtype = at::kBFloat16;
    cspan.numel = n;
    const double compact_floor_s = kCompactBytesPerParam * n / roof_bw;
    const Timing compact_t = measure(device, [&] {
      adam.advance_step(0);
      ferry::device_adam_update(adam, adam.freeze(0), cspan, 1.0, device);
    }, min_time);

    // The gradient norm (2 B read per parameter; the floor: reading at half the copy's read + write rate).
    const double norm_floor_s = 2.0 * n / roof_bw;
    const Timing norm_t = measure(device, [&] { ferry::device_grad_norms_sq(adam, g, {{0, n}}); }, min_time);
    const Timing torch_norm_t = measure(
        device, [&] { at::linalg_vector_norm(g, 2, c10::nullopt, false, at::kFloat); }, min_time);

    if (!first) results << ",";
    first = false;
    results << "\n    {\"n\":" << n << ",\"roof_gb_per_s\":" << roof_bw / 1e9 << ",\"floor_s\":" << floor_s
            << ",\"ferry\":" << row(ferry_t, n, floor_s) << ",\"torch_fused\":" << row(fused_t, n, floor_s)
            << ",\"ferry_vs_torch_fused\":" << fused_t.median_s / ferry_t.median_s
            << ",\"compact_floor_s\":" << compact_floor_s
            << ",\"compact\":" << row(compact_t, n, compact_floor_s, kCompactBytesPerParam)
            << ",\"compact_vs_ferry\":" << ferry_t.median_s / compact_t.median_s
            << ",\"norm_floor_s\":" << norm_floor_s << ",\"norm\":" << row(norm_t, n, norm_floor_s, 2.0)
            << ",\"torch_norm\":" << row(torch_norm_t, n, norm_floor_s, 2.0) << "}";
    ferry::log::info("  roof ", roof_bw / 1e9, " GB/s; ferry ", ferry_t.median_s * 1e3, " ms (",
                     ferry_t.median_s / floor_s, "x floor), torch fused + casts ", fused_t.median_s * 1e3, " ms (",
                     fused_t.median_s / floor_s, "x floor); compact ", compact_t.median_s * 1e3, " ms (",
                     compact_t.median_s / compact_floor_s, "x its floor); norm ", norm_t.median_s * 1e3, " ms (",
                     norm_t.median_s / norm_floor_s, "x floor), torch's ", torch_norm_t.median_s * 1e3, " ms");
  }
  std::cout << "{\n  \"benchmark\": \"device_adam\",\n  \"commit\": \"" << commit << "\",\n  \"device\": \""
            << device.str() << "\",\n  \"declared_bytes_per_param\": " << kDeclaredBytesPerParam
            << ",\n  \"env\": " << ferry::env_report_json(ferry::collect_env_report()) << ",\n  \"results\": ["
            << results.str() << "\n  ]\n}\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return ferry::cli::run_main("bench_device_adam", [&] { return run(argc, argv); });
}
