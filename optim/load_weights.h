#pragma once
// Published weights (a safetensors file or a Hugging Face model folder, hooks/weight_source.h) into a
// ChunkedModel trained by HybridAdam: matched and checked as plan_weight_load checks them (strict by
// default; every problem in one error, nothing loaded), then HybridAdam::load_state_dict: the compute
// copies in the chunks and the fp32 masters from the file's values, up-cast (exact for bf16, fp16 and
// fp32 sources). Not strict: the missing keep their masters. Between iterations.
#include <string>

#include "../hooks/weight_source.h"
#include "hybrid_adam.h"

namespace ferry {

WeightLoadPlan load_safetensors(HybridAdam& adam, ChunkedModel& model, const std::string& path,
                                const WeightLoadOptions& options = {});

}  // namespace ferry
