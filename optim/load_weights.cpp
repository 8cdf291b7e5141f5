#include "load_weights.h"

namespace ferry {

WeightLoadPlan load_safetensors(HybridAdam& adam, ChunkedModel& model, const std::string& path,
                                const WeightLoadOptions& options) {
  // A missing parameter keeps its master: the truth while training.
  ChunkedModelLoad load = prepare_load(model, path, options, [&](int64_t p) { return adam.master(p).clone(); });
  adam.load_state_dict(load.values, load.release());
  return std::move(load.plan);
}

}  // namespace ferry
