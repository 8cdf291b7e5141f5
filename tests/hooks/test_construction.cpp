// Construction memory, measured by a CPU allocator that counts every live byte (the simulated device
// and the host chunks both allocate there): wrapping a module adds about one chunk to it, not a second
// copy; HybridAdam's state takes over from the fp32 initial values without holding them twice; and a
// module built inside an InitScope never exists in fp32 at all.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstring>

#include "../../hooks/chunked_model.h"
#include "../../hooks/init_scope.h"
#include "../../hooks/interceptor.h"
#include "../../optim/hybrid_adam.h"

namespace ferry {
namespace {

class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    auto* record = new Record{std::move(inner), static_cast<int64_t>(n), this};
    const int64_t now = live_.fetch_add(record->n) + record->n;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {data, record, &release, c10::Device(c10::kCPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

 private:
  struct Record {
    c10::DataPtr inner;
    int64_t n;
    TrackingAllocator* owner;
  };
  static void release(void* ctx) {
    auto* r = static_cast<Record*>(ctx);
    r->owner->live_.fetch_sub(r->n);
    delete r;
  }
  c10::Allocator* inner_;
  std::atomic<int64_t> live_{0}, peak_{0};
};

// Installs a tracker for the test's lifetime (it outlives every tensor: leaked on purpose).
class Tracked {
 public:
  Tracked() : previous_(c10::GetCPUAllocator()), tracker_(new TrackingAllocator(previous_)) {
    c10::SetCPUAllocator(tracker_, /*priority=*/255);
  }
  ~Tracked() { c10::SetCPUAllocator(previous_, 255); }
  TrackingAllocator& operator*() { return *tracker_; }
  TrackingAllocator* operator->() { return tracker_; }

 private:
  c10::Allocator* previous_;
  TrackingAllocator* tracker_;
};

struct StackImpl : torch::nn::Module {
  explicit StackImpl(int64_t layers) {
    for (int64_t i = 0; i < layers; ++i) fc.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(256, 256)));
  }
  std::vector<torch::nn::Linear> fc;
};
TORCH_MODULE(Stack);

constexpr int64_t kLayers = 16;
constexpr int64_t kLayerParams = 256 * 256 + 256;  // a multiple of the slot alignment
constexpr int64_t kParams = kLayers * kLayerParams;
constexpr int64_t kSlack = 64 << 10;  // small tensors: bookkeeping, views' metadata is not CPU-allocated

Config sim(Precision precision, int64_t chunk_bytes) {
  Config c;
  c.device = DeviceKind::kSimulated;
  c.precision = precision;
  c.chunk_size_bytes = chunk_bytes;
  return c;
}

TEST(Construction, WrappingAddsAboutOneChunkNotASecondCopy) {
  Tracked tracker;
  const int64_t base = tracker->live();
  auto net = Stack(kLayers);
  const int64_t module_bytes = tracker->live() - base;
  ASSERT_GE(module_bytes, kParams * 4);
  tracker->reset_peak();
  const int64_t chunk = 2 * kLayerParams * 4;  // two layers, no packing waste
  {
    ChunkedModel model(net.ptr(), sim(Precision::kFp32, chunk));
    const int64_t over = tracker->peak() - (base + module_bytes);
    EXPECT_LE(over, 2 * chunk + kSlack) << "fp32: the module's tensors are freed as their chunks fill";
    EXPECT_LE(tracker->live() - base, model.layout().allocated_numel() * 4 + kSlack) << "the module's memory is gone";
  }
}

TEST(Construction, MastersTakeOverFromTheInitialValuesWithoutAFourthCopy) {
  Tracked tracker;
  const int64_t base = tracker->live();
  auto net = Stack(kLayers);
  const int64_t fp32_bytes = tracker->live() - base;
  tracker->reset_peak();
  const int64_t chunk = 2 * kLayerParams * 2;  // of bf16: two layers
  ChunkedModel model(net.ptr(), sim(Precision::kBf16, chunk));
  // bf16 chunks beside the fp32 initial values (kept for the masters; the module holds nothing else).
  EXPECT_LE(tracker->peak() - base, fp32_bytes + fp32_bytes / 2 + 2 * chunk + kSlack);
  tracker->reset_peak();
  HybridAdam adam(model, AdamOptions());
  const int64_t elems = model.layout().allocated_numel();
  // At the end: bf16 chunks (2) + the masters (4); exp_avg and exp_avg_sq start at zero and get their 8
  // at the first step (D46). The fp32 initial values (4) were released as the masters took them over,
  // so the peak is about the end state, not 2 + 4 + 4.
  EXPECT_LE(tracker->live() - base, 6 * elems + kSlack);
  EXPECT_LE(tracker->peak() - base, 6 * elems + 4 * 2 * chunk + kSlack);
  EXPECT_EQ(adam.num_state_roles(), 3);
}

TEST(Construction, InitScopeBuildsInTheComputeDtypeAndNeverInFp32) {
  Tracked tracker;
  const int64_t base = tracker->live();
  const auto default_dtype = c10::get_default_dtype();
  std::shared_ptr<StackImpl> net;
  {
    InitScope scope(Precision::kBf16);
    net = std::make_shared<StackImpl>(kLayers);
  }
  EXPECT_EQ(c10::get_default_dtype(), default_dtype) << "the scope restores the default dtype";
  EXPECT_EQ(net->fc[0]->weight.scalar_type(), at::kBFloat16);
  EXPECT_LE(tracker->peak() - base, kParams * 2 + kSlack) << "no fp32 tensor of the model's size ever existed";
  std::vector<at::Tensor> values;
  for (const auto& p : net->parameters()) values.push_back(p.detach().clone());
  tracker->reset_peak();
  const int64_t before = tracker->live();
  const int64_t chunk = kLayerParams * 2;
  ChunkedModel model(net, sim(Precision::kBf16, chunk));
  EXPECT_LE(tracker->peak() - before, 2 * chunk + kSlack);
  for (int64_t p = 0; p < model.num_params(); ++p) {
    EXPECT_TRUE(torch::equal(model.param_values(p), values[p])) << model.param_name(p);
  }
  EXPECT_THROW({ InitScope scope(at::kLong); }, c10::Error);
}

}  // namespace
}  // namespace ferry
