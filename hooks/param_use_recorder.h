#pragma once
// ParamUseRecorder: the parameters ChunkedModel brings in for the ops run while it is alive, on its
// thread, each once, in order of first use. ferry::checkpoint records the parameters its segment uses
// (hooks/checkpoint.h): they become inputs of its autograd Function, so their gradients flow through
// the outer graph and land once per backward, after every segment has recomputed.
//
// Contract
//  - RAII, one thread: construct and destroy on the thread that runs the ops; recorders nest, and an
//    inner one's parameters are added to the outer one's when it ends (an outer segment recomputes the
//    inner one's ops too).
//  - Records only what ChunkedModel::pre_use sees: ops inside model.forward()/backward() (or between
//    them) on managed parameters. Without a ChunkedModel nothing is recorded.
//  - No cost without a recorder: one thread-local read per parameter use.
#include <ATen/core/Tensor.h>

#include <unordered_set>
#include <vector>

namespace ferry {

class ParamUseRecorder {
 public:
  ParamUseRecorder();
  ~ParamUseRecorder();
  ParamUseRecorder(const ParamUseRecorder&) = delete;
  ParamUseRecorder& operator=(const ParamUseRecorder&) = delete;

  // Adds `param` to the innermost recorder of this thread, if any (ChunkedModel::pre_use calls it).
  static void record(const at::Tensor& param);
  // The parameters recorded so far, in order of first use.
  const std::vector<at::Tensor>& params() const { return params_; }

 private:
  void add(const at::Tensor& param);

  ParamUseRecorder* outer_;
  std::vector<at::Tensor> params_;
  std::unordered_set<const c10::TensorImpl*> seen_;
};

}  // namespace ferry
