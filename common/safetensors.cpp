#include "safetensors.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <regex>
#include <set>
#include <sstream>

#include "durable_file.h"

namespace ferry {
namespace {

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "F32";
    case at::kDouble: return "F64";
    case at::kBFloat16: return "BF16";
    case at::kHalf: return "F16";
    case at::kChar: return "I8";
    case at::kShort: return "I16";
    case at::kInt: return "I32";
    case at::kLong: return "I64";
    case at::kByte: return "U8";
    case at::kBool: return "BOOL";
    default: TORCH_CHECK(false, "ferry: safetensors has no dtype for ", t);
  }
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
      continue;
    }
    out += c;
  }
  return out + "\"";
}

// The dtype `t` is written in: `floating_as` for a floating tensor when given, else its own.
at::ScalarType stored_dtype(const at::Tensor& t, std::optional<at::ScalarType> floating_as) {
  return floating_as && at::isFloatingType(t.scalar_type()) ? *floating_as : t.scalar_type();
}

int64_t stored_bytes(const at::Tensor& t, std::optional<at::ScalarType> floating_as) {
  return t.numel() * static_cast<int64_t>(c10::elementSize(stored_dtype(t, floating_as)));
}

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    TORCH_CHECK(w > 0, "ferry: writing ", path, " failed: ", std::strerror(errno));
    p += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata, std::optional<at::ScalarType> floating_as) {
  TORCH_CHECK(!floating_as || at::isFloatingType(*floating_as), "ferry: write_safetensors: floating_as must be a "
              "floating dtype, got ", *floating_as);
  TORCH_CHECK(!path.empty(), "ferry: write_safetensors needs a path");
  std::set<std::string> names;
  std::ostringstream header;
  header << "{";
  int64_t offset = 0;
  bool first = true;
  if (!metadata.empty()) {
    header << "\"__metadata__\":{";
    for (auto it = metadata.begin(); it != metadata.end(); ++it) {
      header << (it == metadata.begin() ? "" : ",") << json_string(it->first) << ":" << json_string(it->second);
    }
    header << "}";
    first = false;
  }
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(t.defined(), "ferry: safetensors tensor ", name, " is undefined");
    TORCH_CHECK(!name.empty() && name != "__metadata__" && names.insert(name).second, "ferry: safetensors names "
                "must be unique and not empty or __metadata__, got '", name, "'");
    const int64_t bytes = stored_bytes(t, floating_as);
    header << (first ? "" : ",") << json_string(name) << ":{\"dtype\":\"" << dtype_name(stored_dtype(t, floating_as))
           << "\",\"shape\":[";
    for (int64_t d = 0; d < t.dim(); ++d) header << (d ? "," : "") << t.size(d);
    header << "],\"data_offsets\":[" << offset << "," << offset + bytes << "]}";
    offset += bytes;
    first = false;
  }
  header << "}";
  std::string h = header.str();
  h.append((8 - h.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "ferry: cannot create ", tmp, ": ", std::strerror(errno));
  bool closed = false;
  try {
    uint64_t n = h.size();
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
    write_all(fd, len, 8, tmp);
    write_all(fd, h.data(), h.size(), tmp);
    for (const auto& [name, t] : tensors) {
      const at::Tensor c = t.to(at::kCPU, stored_dtype(t, floating_as)).contiguous();
      write_all(fd, c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size(), tmp);
    }
    TORCH_CHECK(::fsync(fd) == 0, "ferry: fsync of ", tmp, " failed: ", std::strerror(errno));
    closed = true;
    TORCH_CHECK(::close(fd) == 0, "ferry: closing ", tmp, " failed: ", std::strerror(errno));
    TORCH_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "ferry: cannot rename ", tmp, " to ", path, ": ",
                std::strerror(errno));
  } catch (...) {
    if (!closed) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
}

std::vector<std::string> write_safetensors_folder(const std::string& dir, const NamedTensors& tensors,
                                                  const SafetensorsFolderOptions& options) {
  TORCH_CHECK(!dir.empty(), "ferry: write_safetensors_folder needs a directory");
  TORCH_CHECK(options.max_shard_bytes > 0, "ferry: max_shard_bytes must be > 0, got ", options.max_shard_bytes);
  TORCH_CHECK(!tensors.empty(), "ferry: write_safetensors_folder(", dir, ") got no tensors");
  // Shards in order, each closed when the next tensor would pass the limit (as save_pretrained does).
  std::vector<NamedTensors> shards(1);
  int64_t shard_bytes = 0, total = 0;
  for (const auto& nt : tensors) {
    TORCH_CHECK(nt.second.defined(), "ferry: write_safetensors_folder: tensor ", nt.first, " is undefined");
    const int64_t b = stored_bytes(nt.second, options.floating_as);
    if (!shards.back().empty() && shard_bytes + b > options.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(nt);
    shard_bytes += b;
    total += b;
  }
  make_dirs(dir);
  const size_t n = shards.size();
  std::vector<std::string> files;
  for (size_t i = 0; i < n; ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, n);
    files.push_back(n == 1 ? std::string("model.safetensors") : std::string(name));
  }
  for (size_t i = 0; i < n; ++i) {
    write_safetensors(dir + "/" + files[i], shards[i], options.metadata, options.floating_as);
  }
  const std::string index = dir + "/model.safetensors.index.json";
  if (n > 1) {
    std::ostringstream j;
    j << "{\n  \"metadata\": {\"total_size\": " << total << "},\n  \"weight_map\": {";
    bool first = true;
    for (size_t i = 0; i < n; ++i) {
      for (const auto& nt : shards[i]) {
        j << (first ? "\n    " : ",\n    ") << json_string(nt.first) << ": " << json_string(files[i]);
        first = false;
      }
    }
    j << "\n  }\n}\n";
    const std::string text = j.str();
    const std::string tmp = index + ".tmp." + std::to_string(::getpid());
    DurableFile f(tmp);
    f.write(text.data(), text.size());
    f.sync_and_close();
    TORCH_CHECK(::rename(tmp.c_str(), index.c_str()) == 0, "ferry: cannot rename ", tmp, " to ", index, ": ",
                std::strerror(errno));
  }
  // An earlier save's weight files this one does not name.
  static const std::regex weight_file(R"(model(-[0-9]+-of-[0-9]+)?\.safetensors(\.index\.json)?)");
  const std::set<std::string> keep(files.begin(), files.end());
  for (const std::string& f : list_dir(dir)) {  // no std::filesystem (D21)
    const bool ours = keep.count(f) || (n > 1 && f == "model.safetensors.index.json");
    if (!ours && std::regex_match(f, weight_file)) {
      TORCH_CHECK(::unlink((dir + "/" + f).c_str()) == 0, "ferry: cannot remove the earlier save's ", dir, "/", f,
                  ": ", std::strerror(errno));
    }
  }
  fsync_dir(dir);
  return files;
}

}  // namespace ferry
