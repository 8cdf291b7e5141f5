// The interception fallback on its own (hooks/interceptor.h), with a listener that records its calls:
// which ops it sees inside an InterceptionScope, and Note [Ops outside the scopes]: a watching thread's ops
// outside scopes are checked for the storage they use (or are uses, where the listener says so), other
// threads' are not, the watch ends at the first op after the hazards are over (also inside a backward,
// which puts the key back when its node ends), and a scope never switches off a key it did not switch on.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../../hooks/interceptor.h"

namespace ferry {
namespace {

struct Recorder final : UseListener {
  void pre_use(int64_t param) override { calls.push_back("pre " + std::to_string(param)); }
  void post_use(int64_t param) override { calls.push_back("post " + std::to_string(param)); }
  Outside before_outside_use(int64_t param) override {
    calls.push_back("outside " + std::to_string(param));
    if (fail) throw std::runtime_error("the background write failed");
    return in_iteration ? Outside::kUse : Outside::kChecked;
  }
  std::vector<std::string> calls;
  bool fail = false;
  bool in_iteration = false;  // before_outside_use says kUse
};

using Calls = std::vector<std::string>;

// Calls of the listener, each distinct one once, in order of first appearance (how many calls an
// expression makes depends on which of its ops have kernels of their own: a view may be one).
Calls distinct(const Calls& calls) {
  Calls out;
  for (const auto& c : calls) {
    if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  }
  return out;
}

bool key_included() { return c10::impl::tls_is_dispatch_key_included(kInterceptKey); }

// A 16-element buffer registered as a "chunk": parameter 7 at [2, 6), parameter 9 at [8, 12).
struct Registered {
  Registered() : buffer(torch::zeros({16})) {
    register_storage(buffer.storage().unsafeGetStorageImpl(), &recorder, {{8, 12, 9}, {2, 6, 7}});
  }
  ~Registered() { unregister_storage(buffer.storage().unsafeGetStorageImpl()); }
  torch::Tensor buffer;
  Recorder recorder;
};

TEST(Interceptor, ScopesSeeParameterUsesByOffset) {
  Registered r;
  r.buffer.narrow(0, 8, 4).add_(1);  // no scope: not seen
  EXPECT_TRUE(r.recorder.calls.empty());
  EXPECT_FALSE(key_included());
  {
    InterceptionScope scope;
    EXPECT_TRUE(key_included());
    r.buffer.narrow(0, 8, 4).add_(1);
    (void)r.buffer.narrow(0, 0, 2).sum();  // padding: no parameter there
  }
  EXPECT_FALSE(key_included());
  EXPECT_EQ(distinct(r.recorder.calls), (Calls{"pre 9", "post 9"}));
}

TEST(Interceptor, AWatchingThreadsOpsAreCheckedUntilNoHazardIsLeft) {
  Registered r;
  const torch::Tensor w9 = r.buffer.narrow(0, 8, 4), padding = r.buffer.narrow(0, 0, 2);  // made unwatched
  ASSERT_EQ(outside_hazards(), 0);
  outside_hazard_begin();
  watch_outside_uses();
  EXPECT_TRUE(watching_outside_uses());
  EXPECT_TRUE(key_included());
  // Outside any scope a tensor of the storage is checked: as the parameter at its offset, or, anywhere
  // else in the storage (padding), as the storage's first (a hazard covers the whole chunk). No
  // pre/post use.
  (void)w9.sum();
  EXPECT_EQ(r.recorder.calls, (Calls{"outside 9"}));
  r.recorder.calls.clear();
  (void)padding.sum();
  EXPECT_EQ(r.recorder.calls, (Calls{"outside 7"}));
  r.recorder.calls.clear();
  // Ops on other tensors are seen but wait for nothing.
  (void)torch::ones({3}).sum();
  EXPECT_TRUE(r.recorder.calls.empty());
  // Inside a scope the usual hooks, no outside waits; the scope leaves the watch's key on.
  {
    InterceptionScope scope;
    r.buffer.narrow(0, 2, 4).add_(1);
  }
  EXPECT_EQ(distinct(r.recorder.calls), (Calls{"pre 7", "post 7"}));
  EXPECT_TRUE(key_included());
  r.recorder.calls.clear();
  // Another thread does not watch: its ops are not seen at all.
  std::thread([&] {
    EXPECT_FALSE(watching_outside_uses());
    (void)r.buffer.sum();
  }).join();
  EXPECT_TRUE(r.recorder.calls.empty());
  // The listener's error (a failed write, a chunk with no memory) reaches the op, which does not run.
  r.recorder.fail = true;
  EXPECT_THROW(r.buffer.fill_(5), std::exception);
  r.recorder.fail = false;
  EXPECT_EQ(r.buffer.narrow(0, 8, 4).max().item<float>(), 0.0f) << "the op must not have run";
  r.recorder.calls.clear();
  // Over: the next op ends the watch and waits for nothing; later ops are not seen.
  outside_hazard_end();
  EXPECT_EQ(outside_hazards(), 0);
  EXPECT_TRUE(watching_outside_uses()) << "the watch ends at the thread's next op";
  (void)r.buffer.sum();
  EXPECT_FALSE(watching_outside_uses());
  EXPECT_FALSE(key_included());
  const int64_t ops = interception_counters().ops;
  (void)r.buffer.sum();
  EXPECT_EQ(interception_counters().ops, ops);
  EXPECT_TRUE(r.recorder.calls.empty());
}

TEST(Interceptor, TheWatchEndingInsideAScopeKeepsTheScopesKey) {
  Registered r;
  outside_hazard_begin();
  watch_outside_uses();
  {
    InterceptionScope scope;
    outside_hazard_end();
    (void)r.buffer.narrow(0, 8, 4).sum();  // inside the scope: its hooks, and the scope's key stays on
    EXPECT_TRUE(key_included());
    EXPECT_EQ(distinct(r.recorder.calls), (Calls{"pre 9", "post 9"}));
  }
  EXPECT_TRUE(key_included()) << "still watching until the next op outside";
  r.recorder.calls.clear();
  (void)r.buffer.sum();
  EXPECT_TRUE(r.recorder.calls.empty());
  EXPECT_FALSE(key_included());
}

// A listener inside an iteration (ChunkedModel between forward() and backward()) calls a watching
// thread's op on its storage a use: pre/post use around it, as in a scope.
TEST(Interceptor, AnOpOutsideTheScopesIsAUseWhereTheListenerSaysSo) {
  Registered r;
  const torch::Tensor w7 = r.buffer.narrow(0, 2, 4), w9 = r.buffer.narrow(0, 8, 4);  // made unwatched
  r.recorder.in_iteration = true;
  outside_hazard_begin();
  watch_outside_uses();
  (void)w9.sum();
  EXPECT_EQ(r.recorder.calls, (Calls{"outside 9", "pre 9", "post 9"}));
  r.recorder.calls.clear();
  (void)torch::ones({3}).sum();  // no parameter: nothing to ask
  EXPECT_TRUE(r.recorder.calls.empty());
  r.recorder.in_iteration = false;
  (void)w7.sum();
  EXPECT_EQ(r.recorder.calls, (Calls{"outside 7"}));
  outside_hazard_end();
  (void)r.buffer.sum();
  EXPECT_FALSE(key_included());
}

// Autograd runs each node of a backward with the thread-local state the backward started with and puts
// it back after the node. A watch that ends inside a plain backward (its hazard ends while the backward
// runs) had its key put back on with nothing holding it: every later op of the thread went through the
// fallback as if in a scope, so ferry's own copies in the next step() ran its pre_use hooks (and failed).
struct EndTheHazard : torch::autograd::Function<EndTheHazard> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    outside_hazard_end();
    return {g[0] * 2};  // the thread's first op with no hazard left: the watch ends inside this node
  }
};

TEST(Interceptor, AWatchEndingInsideABackwardLeavesNoKeyBehind) {
  Registered r;
  outside_hazard_begin();
  watch_outside_uses();
  const torch::Tensor x = torch::ones({4}, torch::requires_grad());
  (EndTheHazard::apply(x * 3) * 5).sum().backward();
  EXPECT_FALSE(watching_outside_uses());
  EXPECT_TRUE(torch::equal(x.grad(), torch::full({4}, 30.0f)));
  r.recorder.calls.clear();
  (void)r.buffer.narrow(0, 8, 4).sum();  // the key torch put back is stale: switched off, the op unseen
  EXPECT_TRUE(r.recorder.calls.empty());
  EXPECT_FALSE(key_included());
  // A scope afterwards has its hooks and takes its key with it.
  {
    InterceptionScope scope;
    (void)r.buffer.narrow(0, 8, 4).sum();
  }
  EXPECT_EQ(distinct(r.recorder.calls), (Calls{"pre 9", "post 9"}));
  EXPECT_FALSE(key_included());
}

// Autograd's workers start with the key included (the state of the thread that called backward): a
// scope opened and closed there leaves it on, as it came.
TEST(Interceptor, AScopeLeavesAnInheritedKeyOn) {
  std::thread([] {
    c10::impl::tls_set_dispatch_key_included(kInterceptKey, true);
    { InterceptionScope scope; }
    EXPECT_TRUE(key_included());
    c10::impl::tls_set_dispatch_key_included(kInterceptKey, false);
  }).join();
}

}  // namespace
}  // namespace ferry
