#include "rate_probe.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <chrono>
#include <limits>

namespace ferry::optim {
namespace {

template <class F>
double best_of_3(const Device& device, F&& run) {
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < 3; ++i) {
    device.synchronize();
    const auto start = std::chrono::steady_clock::now();
    run();
    device.synchronize();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return std::max(best, 1e-9);
}

}  // namespace

UpdateRates measure_update_rates(const CpuAdam& adam, const Device& device, bool pinned_host, int64_t bytes) {
  const int64_t n = std::max<int64_t>(bytes, int64_t{16} << 20) / 4;  // fp32 elements
  UpdateRates r;
  {  // host Adam: master, exp_avg, exp_avg_sq read and written, an fp32 gradient read
    const at::Tensor state = at::zeros({4, n}, at::kFloat);
    AdamSpan span;
    span.param = state[0].data_ptr<float>();
    span.exp_avg = state[1].data_ptr<float>();
    span.exp_avg_sq = state[2].data_ptr<float>();
    span.grad = state[3].data_ptr<float>();
    span.numel = n;
    const CpuAdam::FrozenGroup group{AdamOptions{}, 1};
    const double s = best_of_3(device, [&] { adam.update(group, span); });
    r.host_adam_bytes_per_s = static_cast<double>(n) * 28.0 / s;
  }
  const at::Tensor on_device = at::zeros({n}, at::TensorOptions().dtype(at::kFloat).device(device.torch_device()));
  const at::Tensor host = at::empty({n}, at::TensorOptions().dtype(at::kFloat).pinned_memory(pinned_host));
  const double round_trip = best_of_3(device, [&] {
    host.copy_(on_device);
    on_device.copy_(host);
  });
  r.copy_bytes_per_s = 2.0 * static_cast<double>(on_device.nbytes()) / round_trip;
  const at::Tensor other = at::empty_like(on_device);
  const double within = best_of_3(device, [&] { other.copy_(on_device); });
  r.device_bytes_per_s = 2.0 * static_cast<double>(on_device.nbytes()) / within;
  return r;
}

}  // namespace ferry::optim
