#include "machine_rates.h"

#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <memory>

namespace bench_gpt {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void sync(bool cuda) {
  if (cuda) torch::cuda::synchronize();
}

}  // namespace

InterceptionNs interception_ns(ferry::Config config, int64_t n) {
  auto lin = std::make_shared<torch::nn::LinearImpl>(8, 8);
  config.device_budget_bytes = 0;
  config.precision = ferry::Precision::kFp32;
  config.chunk_size_bytes = 4096;
  ferry::ChunkedModel model(lin, config);
  const at::Tensor plain = torch::randn({8, 8}, model.store().device());
  torch::NoGradGuard no_grad;
  auto time_loop = [&](const at::Tensor& w) {
    at::Tensor acc;
    auto t0 = Clock::now();
    for (int64_t i = 0; i < n; ++i) acc = at::add(w, 1.0);
    return since(t0) * 1e9 / n;
  };
  InterceptionNs r;
  for (int rep = 0; rep < 2; ++rep) model.forward([&] { return time_loop(lin->weight); });  // warm-up + trace
  r.managed = model.forward([&] { return time_loop(lin->weight); });
  model.end_iteration();
  r.plain = time_loop(plain);
  ferry::outside_hazard_begin();
  ferry::watch_outside_uses();
  r.watched_plain = time_loop(plain);
  r.watched_managed = time_loop(lin->weight);
  ferry::outside_hazard_end();
  (void)at::add(plain, 1.0);  // the watch ends at the first op after the hazard
  return r;
}

Rates measure_rates(const ferry::Config& config, bool cuda) {
  Rates r;
  const int64_t bytes = int64_t{256} << 20;
  const c10::Device dev = cuda ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU);
  at::Tensor host = at::empty({bytes}, at::kByte);
  if (cuda) host = host.pin_memory();
  host.fill_(1);
  at::Tensor device = at::empty({bytes}, at::TensorOptions(at::kByte).device(dev));
  auto copy_rate = [&](at::Tensor& dst, const at::Tensor& src) {
    dst.copy_(src);  // warm
    sync(cuda);
    auto t0 = Clock::now();
    for (int i = 0; i < 3; ++i) dst.copy_(src, /*non_blocking=*/cuda);
    sync(cuda);
    return 3.0 * static_cast<double>(bytes) / since(t0);
  };
  r.h2d_bytes_per_s = copy_rate(device, host);
  r.d2h_bytes_per_s = copy_rate(host, device);
  {
    // 64M parameters, 1 GiB of state: far beyond any last-level cache. With 16M (256 MiB) the H100
    // box's runs of 2026-11-26 read 147 to 201 GB/s from one run to the next, above the 145 GB/s
    // that bench_cpu_adam measures there at 64M and 256M: part of it was served from the cache. The
    // best of five passes: a roof is the rate the memory can give, not an average of disturbances.
    const int64_t n = int64_t{64} << 20;
    ferry::CpuAdam adam(ferry::AdamOptions{}, ferry::CpuAdamConfig::from(config));
    at::Tensor p = at::randn({n}), m = at::zeros({n}), v = at::zeros({n});
    at::Tensor g = at::randn({n}).to(at::kBFloat16), lowp = at::empty({n}, at::kBFloat16);
    adam.advance_step(0);
    adam.update(0, p, g, m, v, lowp);  // warm
    double best = 0;
    for (int i = 0; i < 5; ++i) {
      auto t0 = Clock::now();
      adam.update(0, p, g, m, v, lowp);
      best = std::max(best, 28.0 * static_cast<double>(n) / since(t0));
    }
    r.adam_bytes_per_s = best;
  }
  {
    const int64_t k = cuda ? 8192 : 1024;
    const auto opts = at::TensorOptions(cuda ? at::kBFloat16 : at::kFloat).device(dev);
    at::Tensor x = at::randn({k, k}, opts), w = at::randn({k, k}, opts);
    at::matmul(x, w);
    sync(cuda);
    auto t0 = Clock::now();
    const int reps = cuda ? 10 : 3;
    for (int i = 0; i < reps; ++i) at::matmul(x, w);
    sync(cuda);
    r.gemm_flops_per_s = reps * 2.0 * static_cast<double>(k * k * k) / since(t0);
  }
  return r;
}

}  // namespace bench_gpt
