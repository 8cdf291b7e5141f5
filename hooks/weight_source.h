#pragma once
// Published weights in: one safetensors file, or a Hugging Face model folder (model.safetensors, or the
// shards model.safetensors.index.json lists), opened and checked (common/safetensors_file.h), matched
// against what a model has, and loaded tensor by tensor from the memory-mapped files: nothing reads a
// whole-model copy into memory, each tensor's pages are read as it is copied into its destination.
//
// Matching (plan_weight_load) checks everything before anything is written, and reports every problem
// in one error: with `strict` (the default, as load_state_dict(strict=true)) a parameter or buffer no
// file tensor maps to (missing) and a file tensor that maps to none (unexpected); always a shape that
// differs, a dtype the destination cannot take (floating destinations take F64/F32/F16/BF16/F8 and are
// converted; integer and bool ones need their own kind), and two file tensors mapped to one name. The
// file's names reach the model's through `rename` (a table with name_table(), or any function; "" skips
// a tensor, as a checkpoint's rotary caches are skipped).
//
// Loading into a plain module copies into its parameters and buffers; into a ChunkedModel use
// ChunkedModel::load_safetensors (into the chunks, in the compute dtype) or HybridAdam::load_safetensors
// (also the fp32 masters, from the file's values up-cast: exact for bf16, fp16 and fp32 sources).
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../common/safetensors.h"
#include "../common/safetensors_file.h"
#include "chunked_model.h"

namespace ferry {

// The files of one checkpoint and where each tensor is.
class WeightSource {
 public:
  // `path`: a .safetensors file, or a folder with model.safetensors.index.json (its weight_map names
  // every tensor's shard; each shard must exist and hold exactly the tensors the index gives it) or
  // model.safetensors. Fails naming the file, the index, the shard or the tensor.
  static WeightSource open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::vector<std::shared_ptr<const SafetensorsFile>>& files() const { return files_; }
  // Every tensor name, in file order then header order.
  const std::vector<std::string>& names() const { return names_; }
  const SafetensorsFile::Entry& entry(const std::string& name) const;
  const SafetensorsFile& file_of(const std::string& name) const;
  at::Tensor tensor(const std::string& name) const { return file_of(name).tensor(name); }
  // Drops a copied tensor's pages from resident memory (SafetensorsFile::release) if it is over one of
  // these files' mappings.
  void release(const at::Tensor& t) const;
  int64_t file_bytes() const;

 private:
  std::string path_;
  std::vector<std::shared_ptr<const SafetensorsFile>> files_;
  std::vector<std::string> names_;
  std::map<std::string, size_t> file_of_;  // tensor -> files_ index
};

// A file tensor's name -> the destination's ("" skips the tensor).
using WeightNameMap = std::function<std::string(const std::string&)>;
// `table`'s names mapped as it says; others as they are (or, with others_as_is false, skipped).
WeightNameMap name_table(std::map<std::string, std::string> table, bool others_as_is = true);

struct WeightLoadOptions {
  bool strict = true;
  WeightNameMap rename;  // empty: the file's names are the model's
};

// What a destination has: a name, its shape and dtype.
struct WeightTarget {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
};

struct WeightLoadPlan {
  NamedTensors values;                  // destination name -> the file's tensor (a view of the mapping)
  std::vector<std::string> missing;     // destinations without a value (strict: none)
  std::vector<std::string> unexpected;  // file tensors mapped to no destination (strict: none)
  std::vector<std::string> skipped;     // file tensors `rename` skipped
  int64_t bytes = 0;                    // of the values, as stored in the files
};

// Matches `source` against `targets` (module `what` in messages); fails with every problem at once.
WeightLoadPlan plan_weight_load(const WeightSource& source, const std::vector<WeightTarget>& targets,
                                const WeightLoadOptions& options, const std::string& what);

// A plain module's parameters and buffers (recursively, named as named_parameters() names them).
std::vector<WeightTarget> weight_targets(const torch::nn::Module& module);

// Loads `path` into `module`'s parameters and buffers (checked first, then copied tensor by tensor,
// converting dtypes). Returns the plan that was loaded (its values released).
WeightLoadPlan load_safetensors(torch::nn::Module& module, const std::string& path, const WeightLoadOptions& options = {});

// A ChunkedModel's parameters (in its compute dtype) and its module's buffers.
std::vector<WeightTarget> weight_targets(ChunkedModel& model);

// What a load of `path` into `model` hands its load_state_dict (which wants every parameter and
// buffer): the file's values and, for those a non-strict load misses, `current(param)` for a
// parameter and the buffer's own value for a buffer.
struct ChunkedModelLoad {
  WeightSource source;  // the files the values are views of
  WeightLoadPlan plan;  // its values moved into `values`
  NamedTensors values;
  // For load_state_dict: drops each value's pages once it is in place, so the load's resident memory
  // grows by one tensor of the files, not by the files.
  ValueLoaded release() const {
    return [this](const at::Tensor& t) { source.release(t); };
  }
};
ChunkedModelLoad prepare_load(ChunkedModel& model, const std::string& path, const WeightLoadOptions& options,
                              const std::function<at::Tensor(int64_t param)>& current);

// Loads `path` into a ChunkedModel without an optimizer (ChunkedModel::load_state_dict: into the chunks,
// in the compute dtype; not strict: the missing keep their values). With a HybridAdam attached use
// load_safetensors(HybridAdam&, ...) (optim/load_weights.h), which also sets the fp32 masters.
WeightLoadPlan load_safetensors(ChunkedModel& model, const std::string& path, const WeightLoadOptions& options = {});

}  // namespace ferry
