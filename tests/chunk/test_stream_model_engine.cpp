// The stream-model copy engine (chunk/stream_model_engine.h): copies run in order only when the host
// waits or orders compute after one; with host_lags the host knows a copy is done only once it waited
// for it or a later one; device memory freed while copies are queued stays valid for them, whichever
// engine's store freed it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../../chunk/stream_model_engine.h"

namespace ferry {
namespace {

at::Tensor device_tensor(CopyEngine& engine, int64_t n) {
  c10::Allocator* a = engine.device_allocator();
  auto storage = c10::Storage(c10::Storage::use_byte_size_t(), n * 4, a->allocate(n * 4), a, /*resizable=*/false);
  return at::empty({0}, at::kFloat).set_(storage, 0, {n}, {1});
}

TEST(StreamModelCopyEngine, CopiesRunInOrderWhenNeededAndTheHostLearnsLate) {
  StreamModelCopyEngine engine;
  auto dev = device_tensor(engine, 64);
  auto a = torch::full({64}, 1.0f), b = torch::full({64}, 2.0f), back = torch::zeros({64});
  const int64_t run_before = StreamModelCopyEngine::copies_run();
  auto first = engine.copy(dev, a, CopyTiming::kUntimed);
  auto second = engine.copy(back, dev, CopyTiming::kUntimed);  // reads what the first wrote
  auto third = engine.copy(dev, b, CopyTiming::kUntimed);
  EXPECT_EQ(StreamModelCopyEngine::copies_run(), run_before) << "nothing runs until needed";
  EXPECT_FALSE(first->done());
  second->order_before_compute();  // compute needs the bytes: the first two run, in order
  EXPECT_EQ(StreamModelCopyEngine::copies_run(), run_before + 2);
  EXPECT_TRUE(torch::equal(back, a));
  EXPECT_FALSE(first->done()) << "ran, but the host has not waited for it or a later copy";
  EXPECT_FALSE(second->done());
  third->wait();
  EXPECT_TRUE(first->done()) << "one stream: a wait for a later copy covers the earlier ones";
  EXPECT_TRUE(second->done());
  EXPECT_TRUE(torch::equal(dev, b));
}

TEST(StreamModelCopyEngine, WithoutHostLagsARunCopyIsKnownDone) {
  StreamModelCopyEngine engine(StreamModelOptions{/*host_lags=*/false, /*poll_one_in=*/0, /*seed=*/0});
  auto dev = device_tensor(engine, 16);
  auto src = torch::full({16}, 3.0f);
  auto t = engine.copy(dev, src, CopyTiming::kUntimed);
  EXPECT_FALSE(t->done());
  t->order_before_compute();
  EXPECT_TRUE(t->done());
}

// A store's block freed while another engine's copy still reads it (a repack's old and new store; two
// models) stays valid until the process's stream has run it, as record_stream keeps a CUDA block.
TEST(StreamModelCopyEngine, AFreedBlockStaysValidForEveryQueuedCopy) {
  auto older = std::make_unique<StreamModelCopyEngine>();
  StreamModelCopyEngine newer;
  auto block = device_tensor(*older, 256);
  block.fill_(7.0f);
  auto out = torch::zeros({256});
  auto ticket = newer.copy(out, block, CopyTiming::kUntimed);
  block = at::Tensor();  // the block's last reference: freed now, but a copy is queued
  older.reset();          // its engine gone too: the stream is the process's
  ticket->wait();
  EXPECT_TRUE(torch::equal(out, torch::full({256}, 7.0f)));
}

TEST(StreamModelCopyEngine, RejectsANegativePollRate) {
  try {
    StreamModelCopyEngine engine(StreamModelOptions{/*host_lags=*/true, /*poll_one_in=*/-1, /*seed=*/0});
    ADD_FAILURE() << "a negative poll rate was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("poll_one_in must be >= 0 (0: never), got -1"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ferry
