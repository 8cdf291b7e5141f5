#pragma once
// ParamTable: the module's parameters as ChunkedModel wrapped them, tied ones once, in the order of
// named_parameters(): index -> tensor, name, shape, element count; and the check that the module still
// has exactly these (Note [The module's parameters]).
//
// Contract: made once, at the model's construction; the table never changes (a repack rebinds the
// tensors, keeping their TensorImpls: Note [Chunk identity], chunk/chunk.h). The tensors are handles
// to the module's own parameters: binding one (set_data) changes what it views, not the table.
// Const methods may be called from any thread.
//
// Note [The module's parameters]
// ChunkedModel takes the module's parameters when it wraps it. A submodule or parameter registered
// afterwards (an adapter, a new head, replace_module) was not in any chunk: on the simulated device it
// ran, got its .grad from autograd every step and was never updated, silently (on CUDA it would have
// stayed in host memory). So before each forward the model walks the module's parameters and compares
// them, by tensor identity, with those it wrapped (check_module_parameters): one it does not hold, or
// one it holds that the module no longer has, is refused, naming it. Cost: the module's parameters()
// and a binary search per parameter tensor, before each forward (370 ns per tensor on the 2-core
// CPU, bench_gpt's "check_parameters_us", D63). A parameter given another dtype (module.to(dtype), or torch::load of
// another precision) is taken in at the compute dtype (Note [Writes to parameters]), with a warning
// that says so: the compute dtype is Config::precision's.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ferry {

class ParamTable {
 public:
  // Takes `module`'s parameters. Each must be a dense floating-point tensor that no other ChunkedModel
  // holds (fails naming it; a module wrapped twice, or a submodule and its parent). Float64 ones are
  // held at `dtype`: said once, at warn. Fails for a module without parameters.
  ParamTable(const torch::nn::Module& module, at::ScalarType dtype);

  int64_t size() const { return static_cast<int64_t>(params_.size()); }
  const at::Tensor& param(int64_t p) const { return params_[p]; }
  const std::vector<at::Tensor>& params() const { return params_; }
  const std::string& name(int64_t p) const { return names_[p]; }
  const std::vector<std::string>& names() const { return names_; }
  const std::vector<std::vector<int64_t>>& shapes() const { return shapes_; }
  const std::vector<int64_t>& numels() const { return numels_; }
  // The index of the parameter whose TensorImpl is `impl`, or -1.
  int64_t index_of(const c10::TensorImpl* impl) const;
  // Note [The module's parameters]: fails, naming them, if `module` has a parameter this table does not
  // hold or lacks one it holds (`where` names the caller in the message).
  void check_module(const torch::nn::Module& module, const char* where) const;

 private:
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<int64_t> numels_;
  // Each parameter's TensorImpl and index, sorted by address (Note [The module's parameters]).
  std::vector<std::pair<const c10::TensorImpl*, int64_t>> impl_index_;
};

}  // namespace ferry
