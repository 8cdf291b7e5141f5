// optim/capacity_estimate.h: the chunk and state bytes on paper are those HybridAdam builds (checked
// against a real one on the simulated device, both formats, with and without accumulation); the
// placement is the default policy's, worked out by hand; bad input is refused by name.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "../../chunk/role.h"
#include "../../hooks/chunked_model.h"
#include "../../optim/capacity_estimate.h"
#include "../../optim/hybrid_adam.h"
#include "../test_util.h"

namespace ferry {
namespace {

constexpr int64_t kChunk = 64 << 10;

struct Net : torch::nn::Module {
  Net() {
    emb = register_module("emb", torch::nn::Embedding(300, 48));
    fc1 = register_module("fc1", torch::nn::Linear(48, 200));
    fc2 = register_module("fc2", torch::nn::Linear(200, 48));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({48})));
  }
  torch::Tensor forward(const torch::Tensor& idx) { return ln(fc2(torch::gelu(fc1(emb(idx))))); }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm ln{nullptr};
};

int64_t payload_bytes(const ChunkStore& store) {
  const ChunkStoreStats s = store.stats();
  return s.device.current_bytes + s.host.current_bytes;
}

// The estimate's parameter chunk and state bytes are what ChunkedModel and HybridAdam allocate for the
// same parameters and chunk size, once a step has touched every role: chunk padding, the compact
// scales' derived layout and the accumulation role included.
TEST(CapacityEstimate, TheBytesAreThoseHybridAdamBuilds) {
  for (const StateFormat format : {StateFormat::kFp32, StateFormat::kCompact}) {
    for (const bool accumulate : {false, true}) {
      auto net = std::make_shared<Net>();
      std::vector<int64_t> numels;
      for (const auto& p : net->parameters()) numels.push_back(p.numel());
      Config config;
      config.device = DeviceKind::kSimulated;
      config.chunk_size_bytes = kChunk;
      config.precision = Precision::kBf16;
      config.validate();
      ChunkedModel model(net, config);
      HybridAdamOptions options;
      options.state_format = format;
      options.accumulate_grads = accumulate;
      HybridAdam adam(model, options);
      // Moments (and accumulation chunks) get their memory when first touched (D46): one step touches all.
      const torch::Tensor idx = torch::randint(300, {2, 5}, torch::kLong);
      torch::Tensor loss = model.forward([&] { return net->forward(idx).to(torch::kFloat).pow(2).mean(); });
      ASSERT_TRUE(adam.backward_step(loss).applied);

      CapacityQuery q;
      q.param_numels = numels;
      q.device_room_bytes = int64_t{1} << 30;
      q.state_format = format;
      q.accumulate_grads = accumulate;
      q.chunk_bytes = kChunk;
      const CapacityEstimate e = estimate_capacity(q);
      const std::string what = std::string(to_string(format)) + (accumulate ? " with accumulation" : "");
      EXPECT_EQ(e.chunk_bytes, kChunk) << what;
      EXPECT_EQ(e.num_chunks, model.layout().num_chunks()) << what;
      EXPECT_EQ(e.param_bytes, payload_bytes(model.store())) << what;
      EXPECT_EQ(e.state_bytes, payload_bytes(adam.state_store())) << what;
      EXPECT_EQ(e.params, 300 * 48 + 48 * 200 + 200 + 200 * 48 + 48 + 2 * 48) << what;
      // The room holds everything: every group's state on the device, nothing on the host.
      EXPECT_EQ(e.device_state_groups, e.num_chunks) << what;
      EXPECT_EQ(e.host_bytes(), 0) << what;
      EXPECT_EQ(e.device_bytes(), e.param_bytes + e.state_bytes) << what;
    }
  }
}

// Four parameters of one chunk each (bf16: P bytes per chunk), fp32 state (6 P per group), placed by
// hand as the default policy places them: first chunks first, while their state fits beside every
// parameter chunk.
TEST(CapacityEstimate, PlacesTheStateAsTheDefaultPolicyDoes) {
  const int64_t P = kChunk, elements = kChunk / 2;
  CapacityQuery q;
  q.param_numels = {elements, elements, elements, elements};
  q.chunk_bytes = kChunk;

  q.device_room_bytes = 4 * P + 6 * P + P / 2;  // the parameters and one group's state (and a half P spare)
  CapacityEstimate e = estimate_capacity(q);
  EXPECT_EQ(e.num_chunks, 4);
  EXPECT_EQ(e.param_bytes, 4 * P);
  EXPECT_EQ(e.state_bytes, 4 * 6 * P);
  EXPECT_DOUBLE_EQ(e.state_bytes_per_param(), 12.0);
  EXPECT_EQ(e.device_state_groups, 1);
  EXPECT_EQ(e.device_state_bytes, 6 * P);
  EXPECT_EQ(e.device_param_bytes, 4 * P);
  EXPECT_EQ(e.host_param_bytes, 0);
  EXPECT_EQ(e.host_state_bytes, 3 * 6 * P);
  EXPECT_EQ(e.round_trip_bytes, 3 * P + P);  // every travelling chunk and the largest
  EXPECT_EQ(e.host_bytes(), 18 * P + 4 * P);
  EXPECT_TRUE(e.fits_host(22 * P));
  EXPECT_FALSE(e.fits_host(22 * P - 1));
  // Round trips through K buffers (Note [Round trips through K buffers]): K of the largest chunk at most.
  q.round_trip_slots = 2;
  e = estimate_capacity(q);
  EXPECT_EQ(e.round_trip_slots, 2);
  EXPECT_EQ(e.round_trip_bytes, 2 * P);
  EXPECT_EQ(e.host_bytes(), 18 * P + 2 * P);
  q.round_trip_slots = 9;  // more slots than chunks travel: the unbounded sum
  EXPECT_EQ(estimate_capacity(q).round_trip_bytes, 3 * P + P);
  q.round_trip_slots = 0;

  // Room for three parameter chunks only: no state on the device, one parameter chunk on the host.
  q.device_room_bytes = 3 * P;
  e = estimate_capacity(q);
  EXPECT_EQ(e.device_state_groups, 0);
  EXPECT_EQ(e.device_param_bytes, 3 * P);
  EXPECT_EQ(e.host_param_bytes, P);
  EXPECT_EQ(e.host_state_bytes, 24 * P);
  EXPECT_EQ(e.round_trip_bytes, 4 * P + P);
  EXPECT_LE(e.device_bytes(), q.device_room_bytes);

  // With accumulation the gradients stay in the state (a fourth fp32 role): nothing makes a round trip.
  q.accumulate_grads = true;
  q.device_room_bytes = 4 * P + 8 * P;
  e = estimate_capacity(q);
  EXPECT_EQ(e.state_bytes, 4 * 8 * P);
  EXPECT_EQ(e.device_state_groups, 1);
  EXPECT_EQ(e.round_trip_bytes, 0);
  q.round_trip_slots = 2;  // HybridAdam bounds only the default mode's trips; there are none here
  EXPECT_EQ(estimate_capacity(q).round_trip_slots, 0);
}

// The compact format: a bf16 master, two 1-byte codes and 8 bytes of scales per 256 elements.
TEST(CapacityEstimate, TheCompactStateIsAboutFourBytesPerParameter) {
  CapacityQuery q;
  q.param_numels = {int64_t{1} << 22, int64_t{1} << 22};
  q.device_room_bytes = int64_t{1} << 30;
  q.state_format = StateFormat::kCompact;
  const CapacityEstimate compact = estimate_capacity(q);
  EXPECT_GE(compact.state_bytes_per_param(), 4.0 + 8.0 / 256);
  EXPECT_LT(compact.state_bytes_per_param(), 4.1);
  q.state_format = StateFormat::kFp32;
  EXPECT_GE(estimate_capacity(q).state_bytes_per_param(), 12.0);
  q.compute_dtype = at::kFloat;  // an fp32 compute copy: 4 B per parameter in the chunks
  EXPECT_GE(estimate_capacity(q).param_bytes, 4 * compact.params);
}

// The chunk size auto picks is ChunkedModel's (D99): at most a sixteenth of a small room, and the
// uncapped search's where the room is large.
TEST(CapacityEstimate, TheAutoChunkSizeIsCappedByTheRoomAsChunkedModelCapsIt) {
  CapacityQuery q;
  for (int i = 0; i < 48; ++i) q.param_numels.push_back(int64_t{1} << 16);
  const int64_t uncapped = auto_chunk_size(q.param_numels, {}, 2).chunk_bytes;
  q.device_room_bytes = int64_t{1} << 30;
  EXPECT_EQ(estimate_capacity(q).chunk_bytes, uncapped);
  q.device_room_bytes = int64_t{4} << 20;
  const CapacityEstimate small = estimate_capacity(q);
  EXPECT_LT(small.chunk_bytes, uncapped);
  EXPECT_EQ(small.chunk_bytes, auto_chunk_size(q.param_numels, {}, 2, auto_chunk_cap_bytes(q.device_room_bytes)).chunk_bytes);
  EXPECT_LE(small.chunk_bytes * kAutoChunksInRoom, q.device_room_bytes);
}

TEST(CapacityEstimate, RefusesBadInputByName) {
  CapacityQuery q;
  q.device_room_bytes = int64_t{1} << 30;
  EXPECT_ERROR_HAS(estimate_capacity(q), "got none");
  q.param_numels = {10, 0};
  EXPECT_ERROR_HAS(estimate_capacity(q), "parameter 1 has 0 elements");
  q.param_numels = {10};
  q.device_room_bytes = 0;
  EXPECT_ERROR_HAS(estimate_capacity(q), "room for chunks in bytes (> 0), got 0");
  q.device_room_bytes = int64_t{1} << 30;
  q.compute_dtype = at::kDouble;
  EXPECT_ERROR_HAS(estimate_capacity(q), "bf16, fp16 or fp32");
  q.compute_dtype = at::kFloat;
  q.state_format = StateFormat::kCompact;
  EXPECT_ERROR_HAS(estimate_capacity(q), "needs a 16-bit compute copy");
  q.state_format = StateFormat::kFp32;
  q.chunk_bytes = -1;
  EXPECT_ERROR_HAS(estimate_capacity(q), "chunk_bytes must be >= 0");
  q.chunk_bytes = 0;
  q.round_trip_slots = -1;
  EXPECT_ERROR_HAS(estimate_capacity(q), "round_trip_slots must be >= 0 (0: no bound), got -1");
}

}  // namespace
}  // namespace ferry
