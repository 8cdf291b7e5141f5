#pragma once
// safetensors files (https://huggingface.co/docs/safetensors): what a Python user loads with
// `safetensors.torch.load_file(path)` (or by hand: an 8-byte little-endian header length, a JSON header
// of {name: {"dtype", "shape", "data_offsets": [begin, end]}} and "__metadata__", then the raw bytes).
//
// write_safetensors writes atomically: into PATH.tmp.<pid>, fsync'd, then renamed over PATH; a
// failure leaves PATH as it was. Tensors are written in the given order, each contiguous and
// little-endian, from the CPU (others are copied there one at a time).
#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace ferry {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// dtypes: float32/64, bfloat16, float16, int8/16/32/64, uint8, bool.
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace ferry
