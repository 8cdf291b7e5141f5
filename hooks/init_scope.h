#pragma once
// InitScope: build a module whose fp32 copy would not fit in host memory.
//
//   std::shared_ptr<MyNet> net;
//   {
//     ferry::InitScope scope(config.precision);     // bf16: every parameter is created in bf16
//     net = std::make_shared<MyNet>(...);
//   }
//   ferry::ChunkedModel model(net, config);        // packs them tensor by tensor, freeing each
//
// A LibTorch module creates its parameters with the default dtype (torch::empty/zeros/randn without
// a dtype) and initializes them in place. Inside the scope the default dtype is the compute dtype, so
// the module is built at 2 bytes per parameter (bf16/fp16) instead of 4, and ChunkedModel then moves
// each tensor into its chunk and frees it: construction peaks at the compute copy plus one chunk,
// never at an fp32 model. The price: HybridAdam's fp32 masters start from the bf16-rounded initial
// values (as PatrickStar's fp16 model-init context does), and initializers run in bf16 (their
// distribution is the same; their bits differ from an fp32 initialization).
//
// The scope also runs the modules' random initializers (uniform_, normal_: nn::Linear's kaiming init)
// on every core instead of one (Note [Parallel initializers], interceptor.h): the values follow
// torch::manual_seed and not the thread count, but differ bit for bit from torch's serial stream.
// `parallel_init = false` keeps torch's own.
//
// Contract: the default dtype is process-global in LibTorch; do not create tensors on other threads
// while a scope is open. The parallel initializers apply to the thread that opened the scope. Scopes
// nest (each restores what it found). Modules that name fp32 explicitly (dtype(at::kFloat)) are not
// affected by the dtype.
#include <c10/core/ScalarType.h>
#include <c10/util/typeid.h>

#include <optional>

#include "../common/config.h"
#include "interceptor.h"

namespace ferry {

class InitScope {
 public:
  explicit InitScope(at::ScalarType dtype, bool parallel_init = true);
  explicit InitScope(Precision precision, bool parallel_init = true);
  ~InitScope();
  InitScope(const InitScope&) = delete;
  InitScope& operator=(const InitScope&) = delete;

 private:
  caffe2::TypeMeta previous_;
  std::optional<ParallelInitScope> parallel_;
};

}  // namespace ferry
