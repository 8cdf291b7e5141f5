#include "safetensors.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <sstream>

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
                       const std::map<std::string, std::string>& metadata) {
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
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    header << (first ? "" : ",") << json_string(name) << ":{\"dtype\":\"" << dtype_name(t.scalar_type())
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
      const at::Tensor c = t.to(at::kCPU).contiguous();
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

}  // namespace ferry
