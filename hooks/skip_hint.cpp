// ferry::will_skip (see skip_hint.h).
#include "skip_hint.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_map>
#include <utility>

namespace ferry {
namespace {

thread_local SkipListener* current_listener = nullptr;

// How many times `module` registers each parameter tensor (by TensorImpl), over all its paths.
std::unordered_map<const c10::TensorImpl*, int64_t> registrations(const torch::nn::Module& module) {
  std::unordered_map<const c10::TensorImpl*, int64_t> count;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) ++count[p.value().unsafeGetTensorImpl()];
  return count;
}

}  // namespace

SkipListener::Scope::Scope(SkipListener* listener) : outer_(current_listener) { current_listener = listener; }
SkipListener::Scope::~Scope() { current_listener = outer_; }

void will_skip(const torch::nn::Module& module) {
  if (current_listener != nullptr) current_listener->will_skip(module);
}

std::vector<int64_t> params_only_in(const torch::nn::Module& root, const torch::nn::Module& module,
                                    const ParamTable& table) {
  std::vector<int64_t> out;
  const auto inside = registrations(module);
  if (inside.empty()) return out;
  const auto everywhere = registrations(root);
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    const c10::TensorImpl* impl = p.value().unsafeGetTensorImpl();
    const int64_t index = table.index_of(impl);
    TORCH_CHECK(index >= 0, "ferry::will_skip: parameter '", p.key(), "' of the module given is not one of the ",
                "wrapped model's (a module of another model, or one registered after the model was wrapped)");
    const auto all = everywhere.find(impl);
    // Registered outside `module` too (tied weights, a block registered twice): that part still uses it.
    if (all == everywhere.end() || all->second > inside.at(impl)) continue;
    out.push_back(index);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace ferry
