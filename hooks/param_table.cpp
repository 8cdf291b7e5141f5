// ParamTable (see param_table.h).
#include "param_table.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_set>

#include "../common/logging.h"
#include "interceptor.h"

namespace ferry {

ParamTable::ParamTable(const torch::nn::Module& module, at::ScalarType dtype) {
  std::unordered_set<const c10::TensorImpl*> seen;
  int64_t wider = 0;  // float64 parameters
  std::string first_wider;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!p.defined() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;  // tied: once
    TORCH_CHECK(p.layout() == at::kStrided && at::isFloatingType(p.scalar_type()), "ferry: parameter ",
                item.key(), " must be a dense floating-point tensor, got ", p.toString(),
                p.layout() == at::kStrided && !p.is_complex() && !p.requires_grad()
                    ? " (a tensor that is not trained, such as an index table, belongs in a buffer: "
                      "register_buffer, which ChunkedModel leaves to the module)"
                    : "");
    // A chunk of another ChunkedModel: both would bind, move and free the same tensors (seen: wrapping
    // twice, or a submodule and then its parent, ran without a word, each model's destructor then
    // giving the parameters plain memory under the other).
    TORCH_CHECK(!p.has_storage() || !storage_registered(p.storage().unsafeGetStorageImpl()), "ferry: parameter ",
                item.key(), " is held by another ChunkedModel already (a module wrapped twice, or a submodule "
                "wrapped and then its parent): wrap each module once, the outermost one you train; destroying "
                "the other ChunkedModel first gives its parameters plain memory again");
    if (p.scalar_type() == at::kDouble && wider++ == 0) first_wider = item.key();
    params_.push_back(p);
    names_.push_back(item.key());
    shapes_.push_back(p.sizes().vec());
    numels_.push_back(p.numel());
  }
  TORCH_CHECK(!params_.empty(), "ferry: the module has no parameters to manage");
  if (wider > 0) {
    log::warn("ferry: ", wider, " parameter(s) are float64 (", first_wider, " first); ferry holds them at ", dtype,
              " (config.precision) and an optimizer's masters in float32: they train in float32, not float64");
  }
  for (size_t p = 0; p < params_.size(); ++p) impl_index_.emplace_back(params_[p].unsafeGetTensorImpl(), p);
  std::sort(impl_index_.begin(), impl_index_.end());
}

int64_t ParamTable::index_of(const c10::TensorImpl* impl) const {
  const auto it = std::lower_bound(impl_index_.begin(), impl_index_.end(), impl,
                                   [](const auto& entry, const c10::TensorImpl* key) { return entry.first < key; });
  return it != impl_index_.end() && it->first == impl ? it->second : -1;
}

void ParamTable::check_module(const torch::nn::Module& module, const char* where) const {
  std::vector<char> seen(params_.size(), 0);
  bool foreign = false;
  for (const at::Tensor& t : module.parameters(/*recurse=*/true)) {
    if (!t.defined()) continue;
    const int64_t p = index_of(t.unsafeGetTensorImpl());
    if (p < 0) {
      foreign = true;  // and on: `seen` must be whole for the message
    } else {
      seen[p] = 1;
    }
  }
  const int64_t missing = std::count(seen.begin(), seen.end(), 0);
  if (!foreign && missing == 0) return;
  // The names, for the message (only now: named_parameters builds every name).
  std::string added, gone;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (item.value().defined() && index_of(item.value().unsafeGetTensorImpl()) < 0) {
      added += (added.empty() ? "" : ", ") + item.key();
    }
  }
  for (size_t p = 0; p < params_.size(); ++p) {
    if (!seen[p]) gone += (gone.empty() ? "" : ", ") + names_[p];
  }
  TORCH_CHECK(false, "ferry: ", where, ": the module's parameters are not the ones ChunkedModel wrapped (Note [The "
              "module's parameters]): ", added.empty() ? "" : "it has " + added + ", registered after it was wrapped",
              !added.empty() && missing > 0 ? "; " : "",
              missing > 0 ? "it no longer has " + gone + " (replaced or removed after it was wrapped)" : "",
              ". ferry holds only the parameters it wrapped in its chunks and trains only those: build the whole "
              "module (adapters, heads, replaced layers) before wrapping it, or wrap it again");
}

}  // namespace ferry
