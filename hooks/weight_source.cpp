#include "weight_source.h"

#include <c10/util/Exception.h>
#include <sys/stat.h>

#include <fstream>
#include <set>
#include <sstream>
#include <unordered_map>

#include "../common/json.h"

namespace ferry {

namespace {

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool is_file(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}
std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "ferry: cannot read ", path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// "a, b, c and 3 more" for an error.
std::string listed(const std::vector<std::string>& names, size_t show = 8) {
  std::ostringstream os;
  for (size_t k = 0; k < names.size() && k < show; ++k) os << (k ? ", " : "") << names[k];
  if (names.size() > show) os << " and " << names.size() - show << " more";
  return os.str();
}

bool floating(at::ScalarType t) { return at::isFloatingType(t); }

}  // namespace

WeightSource WeightSource::open(const std::string& path) {
  WeightSource s;
  s.path_ = path;
  auto add = [&](std::shared_ptr<const SafetensorsFile> f) {
    for (const auto& e : f->entries()) {
      TORCH_CHECK(s.file_of_.emplace(e.name, s.files_.size()).second, "ferry: tensor '", e.name, "' is in both ",
                  s.files_[s.file_of_[e.name]]->path(), " and ", f->path());
      s.names_.push_back(e.name);
    }
    s.files_.push_back(std::move(f));
  };
  if (!is_dir(path)) {
    TORCH_CHECK(is_file(path), "ferry: no safetensors file or model folder at ", path);
    add(SafetensorsFile::open(path));
    return s;
  }
  const std::string index = path + "/model.safetensors.index.json";
  if (!is_file(index)) {
    const std::string single = path + "/model.safetensors";
    TORCH_CHECK(is_file(single), "ferry: model folder ", path, " has neither model.safetensors.index.json nor ",
                "model.safetensors");
    add(SafetensorsFile::open(single));
    return s;
  }
  const JsonValue doc = parse_json(slurp(index), index);
  const JsonValue* map = doc.find("weight_map");
  TORCH_CHECK(map != nullptr, "ferry: ", index, " has no weight_map");
  std::map<std::string, std::vector<std::string>> by_shard;  // shard -> its tensors, per the index
  for (const auto& [tensor, shard] : map->object(index + " weight_map")) {
    const std::string& file = shard.string(index + ": the shard of '" + tensor + "'");
    TORCH_CHECK(!file.empty() && file.find('/') == std::string::npos, "ferry: ", index, " puts '", tensor,
                "' in shard \"", file, "\", expected a file name inside the folder");
    by_shard[file].push_back(tensor);
  }
  for (const auto& [file, tensors] : by_shard) {
    const std::string shard_path = path + "/" + file;
    TORCH_CHECK(is_file(shard_path), "ferry: ", index, " names shard ", file, " (for '", tensors.front(), "'",
                tensors.size() > 1 ? " and " + std::to_string(tensors.size() - 1) + " more" : std::string(),
                "), which is not in ", path);
    std::shared_ptr<const SafetensorsFile> f = SafetensorsFile::open(shard_path);
    std::set<std::string> want(tensors.begin(), tensors.end());
    std::vector<std::string> absent, extra;
    for (const std::string& t : tensors) {
      if (!f->find(t)) absent.push_back(t);
    }
    for (const auto& e : f->entries()) {
      if (!want.count(e.name)) extra.push_back(e.name);
    }
    TORCH_CHECK(absent.empty(), "ferry: ", index, " puts ", listed(absent), " in ", file, ", which does not hold ",
                absent.size() == 1 ? "it" : "them");
    TORCH_CHECK(extra.empty(), "ferry: ", shard_path, " holds ", listed(extra), ", which ", index,
                " does not list there");
    add(std::move(f));
  }
  return s;
}

const SafetensorsFile::Entry& WeightSource::entry(const std::string& name) const { return *file_of(name).find(name); }

const SafetensorsFile& WeightSource::file_of(const std::string& name) const {
  const auto it = file_of_.find(name);
  TORCH_CHECK(it != file_of_.end(), "ferry: ", path_, " has no tensor '", name, "'");
  return *files_[it->second];
}

int64_t WeightSource::file_bytes() const {
  int64_t n = 0;
  for (const auto& f : files_) n += f->file_bytes();
  return n;
}

void WeightSource::release(const at::Tensor& t) const {
  for (const auto& f : files_) {
    if (f->release(t)) return;
  }
}

WeightNameMap name_table(std::map<std::string, std::string> table, bool others_as_is) {
  return [table = std::move(table), others_as_is](const std::string& name) -> std::string {
    const auto it = table.find(name);
    if (it != table.end()) return it->second;
    return others_as_is ? name : std::string();
  };
}

WeightLoadPlan plan_weight_load(const WeightSource& source, const std::vector<WeightTarget>& targets,
                                const WeightLoadOptions& options, const std::string& what) {
  std::unordered_map<std::string, const WeightTarget*> by_name;
  for (const WeightTarget& t : targets) by_name.emplace(t.name, &t);
  WeightLoadPlan plan;
  std::unordered_map<std::string, std::string> source_of;  // destination -> file tensor
  std::vector<std::pair<std::string, std::string>> accepted;  // (destination, file tensor), in file order
  std::vector<std::string> twice, shapes, dtypes;
  for (const std::string& name : source.names()) {
    const std::string dest = options.rename ? options.rename(name) : name;
    if (dest.empty()) {
      plan.skipped.push_back(name);
      continue;
    }
    const auto target = by_name.find(dest);
    if (target == by_name.end()) {
      plan.unexpected.push_back(name == dest ? name : name + " (as " + dest + ")");
      continue;
    }
    const auto [it, first] = source_of.emplace(dest, name);
    if (!first) {
      twice.push_back(it->second + " and " + name + " (both as " + dest + ")");
      continue;
    }
    accepted.emplace_back(dest, name);
    const SafetensorsFile::Entry& e = source.entry(name);
    const WeightTarget& t = *target->second;
    if (e.shape != t.shape) {
      shapes.push_back(name + ": the file's " + c10::str(c10::IntArrayRef(e.shape)) + ", " + what + "'s " +
                       c10::str(c10::IntArrayRef(t.shape)));
    }
    const bool takes = floating(t.dtype) ? floating(e.dtype)
                                         : (t.dtype == at::kBool ? e.dtype == at::kBool
                                                                 : at::isIntegralType(e.dtype, /*includeBool=*/false));
    if (!takes) dtypes.push_back(name + ": the file's " + c10::str(e.dtype) + " into " + c10::str(t.dtype));
    plan.bytes += e.end - e.begin;
  }
  for (const WeightTarget& t : targets) {
    if (!source_of.count(t.name)) plan.missing.push_back(t.name);
  }
  std::ostringstream problems;
  auto report = [&](const char* title, const std::vector<std::string>& list) {
    if (!list.empty()) problems << "\n  " << title << " (" << list.size() << "): " << listed(list);
  };
  report("two file tensors for one destination", twice);
  report("shapes that differ", shapes);
  report("dtypes the destination cannot take", dtypes);
  if (options.strict) {
    report("missing from the file (the model has them)", plan.missing);
    report("unexpected (the file has them, the model does not)", plan.unexpected);
  }
  TORCH_CHECK(problems.str().empty(), "ferry: cannot load ", source.path(), " into ", what, "; nothing was loaded:",
              problems.str());
  for (const auto& [dest, name] : accepted) plan.values.emplace_back(dest, source.tensor(name));
  return plan;
}

std::vector<WeightTarget> weight_targets(const torch::nn::Module& module) {
  std::vector<WeightTarget> out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    out.push_back({p.key(), p.value().sizes().vec(), p.value().scalar_type()});
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) out.push_back({b.key(), b.value().sizes().vec(), b.value().scalar_type()});
  }
  return out;
}

WeightLoadPlan load_safetensors(torch::nn::Module& module, const std::string& path, const WeightLoadOptions& options) {
  const WeightSource source = WeightSource::open(path);
  WeightLoadPlan plan = plan_weight_load(source, weight_targets(module), options, "module " + module.name());
  std::unordered_map<std::string, at::Tensor> dest;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) dest.emplace(p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/true)) dest.emplace(b.key(), b.value());
  at::NoGradGuard no_grad;
  for (auto& [name, value] : plan.values) {
    dest.at(name).copy_(value);
    source.release(value);  // its pages leave resident memory: the load holds one tensor of the files
    value = at::Tensor();
  }
  return plan;
}

std::vector<WeightTarget> weight_targets(ChunkedModel& model) {
  std::vector<WeightTarget> out;
  for (int64_t p = 0; p < model.num_params(); ++p) {
    out.push_back({model.param_name(p), model.param_shapes()[p], model.compute_dtype()});
  }
  for (const auto& b : model.module().named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) out.push_back({b.key(), b.value().sizes().vec(), b.value().scalar_type()});
  }
  return out;
}

ChunkedModelLoad prepare_load(ChunkedModel& model, const std::string& path, const WeightLoadOptions& options,
                              const std::function<at::Tensor(int64_t param)>& current) {
  ChunkedModelLoad load;
  load.source = WeightSource::open(path);
  load.plan = plan_weight_load(load.source, weight_targets(model), options, "the ChunkedModel");
  load.values = std::move(load.plan.values);  // views of the mapping: they keep it alive
  load.plan.values.clear();
  if (load.plan.missing.empty()) return load;
  std::unordered_map<std::string, int64_t> param_index;
  for (int64_t p = 0; p < model.num_params(); ++p) param_index.emplace(model.param_name(p), p);
  std::unordered_map<std::string, at::Tensor> buffers;
  for (const auto& b : model.module().named_buffers(/*recurse=*/true)) buffers.emplace(b.key(), b.value());
  for (const std::string& name : load.plan.missing) {
    const auto it = param_index.find(name);
    load.values.emplace_back(name, it != param_index.end() ? current(it->second) : buffers.at(name).clone());
  }
  return load;
}

WeightLoadPlan load_safetensors(ChunkedModel& model, const std::string& path, const WeightLoadOptions& options) {
  ChunkedModelLoad load = prepare_load(model, path, options, [&](int64_t p) { return model.param_values(p).clone(); });
  model.load_state_dict(load.values, load.release());
  return std::move(load.plan);
}

}  // namespace ferry
