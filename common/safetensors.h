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
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ferry {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// dtypes: float32/64, bfloat16, float16, int8/16/32/64, uint8, bool. `floating_as`: floating tensors are
// written in that dtype (each converted as it is written, never the whole set at once).
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {},
                       std::optional<at::ScalarType> floating_as = std::nullopt);

struct SafetensorsFolderOptions {
  int64_t max_shard_bytes = 5'000'000'000;  // transformers' "5GB"; a larger tensor gets a shard of its own
  std::optional<at::ScalarType> floating_as;
  std::map<std::string, std::string> metadata = {{"format", "pt"}};  // transformers wants format=pt
};

// A Hugging Face model folder's weights, as save_pretrained writes them: one model.safetensors, or
// model-0000i-of-0000N.safetensors shards (in `tensors`' order, each at most max_shard_bytes) and
// model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map"}). `dir` is created if needed.
// Each file is written atomically, the index after its shards; then the weight files of an earlier
// save that the new one does not name are removed. A crash in between leaves the old index naming
// shards that no longer hold what it says: WeightSource::open refuses such a folder, it never mixes.
// Returns the files written.
std::vector<std::string> write_safetensors_folder(const std::string& dir, const NamedTensors& tensors,
                                                  const SafetensorsFolderOptions& options = {});

}  // namespace ferry
