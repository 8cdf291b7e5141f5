#include "safetensors_file.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <numeric>
#include <string_view>

#include "json.h"

namespace ferry {

namespace {

constexpr int64_t kMaxHeaderBytes = int64_t{100} << 20;  // as the reference implementation

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

bool safetensors_dtype(const std::string& name, at::ScalarType* out) {
  static const std::pair<const char*, at::ScalarType> kTypes[] = {
      {"F64", at::kDouble},  {"F32", at::kFloat},  {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},    {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},     {"BOOL", at::kBool},  {"F8_E4M3", at::kFloat8_e4m3fn},
      {"F8_E5M2", at::kFloat8_e5m2}};
  for (const auto& [n, t] : kTypes) {
    if (name == n) {
      *out = t;
      return true;
    }
  }
  return false;
}

int64_t SafetensorsFile::Entry::numel() const {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

std::shared_ptr<const SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  const std::string where = "safetensors file " + path;
  Fd fd;
  fd.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd.fd >= 0, "ferry: cannot open ", where, ": ", std::strerror(errno));
  struct stat st {};
  TORCH_CHECK(::fstat(fd.fd, &st) == 0, "ferry: cannot stat ", where, ": ", std::strerror(errno));
  TORCH_CHECK(S_ISREG(st.st_mode), "ferry: ", where, " is not a regular file");
  f->size_ = static_cast<int64_t>(st.st_size);
  TORCH_CHECK(f->size_ >= 8, "ferry: ", where, " is truncated: ", f->size_, " bytes, less than the 8-byte header length");
  void* map = ::mmap(nullptr, static_cast<size_t>(f->size_), PROT_READ, MAP_PRIVATE, fd.fd, 0);
  TORCH_CHECK(map != MAP_FAILED, "ferry: cannot map ", where, ": ", std::strerror(errno));
  f->base_ = static_cast<const uint8_t*>(map);

  uint64_t header_len = 0;
  for (int k = 7; k >= 0; --k) header_len = (header_len << 8) | f->base_[k];  // little-endian
  TORCH_CHECK(header_len <= static_cast<uint64_t>(kMaxHeaderBytes), "ferry: ", where, " says its header has ",
              header_len, " bytes, more than the format's limit of ", kMaxHeaderBytes, " (not a safetensors file?)");
  TORCH_CHECK(static_cast<int64_t>(header_len) <= f->size_ - 8, "ferry: ", where, " is truncated: its header needs ",
              header_len, " bytes after the length, the file has ", f->size_ - 8);
  f->data_start_ = 8 + static_cast<int64_t>(header_len);
  const int64_t data_bytes = f->size_ - f->data_start_;
  const JsonValue header = parse_json(
      std::string_view(reinterpret_cast<const char*>(f->base_ + 8), static_cast<size_t>(header_len)), "the header of " + where);
  for (const auto& [name, v] : header.object("the header of " + where)) {
    if (name == "__metadata__") {
      for (const auto& [k, s] : v.object(where + ": __metadata__")) {
        f->metadata_[k] = s.string(where + ": __metadata__ \"" + k + "\"");
      }
      continue;
    }
    const std::string what = where + ": tensor '" + name + "'";
    Entry e;
    e.name = name;
    for (const auto& [key, _] : v.object(what)) {
      TORCH_CHECK(key == "dtype" || key == "shape" || key == "data_offsets", "ferry: ", what, " has an unknown key \"",
                  key, "\" (expected dtype, shape, data_offsets)");
    }
    const JsonValue* dtype = v.find("dtype");
    const JsonValue* shape = v.find("shape");
    const JsonValue* offsets = v.find("data_offsets");
    TORCH_CHECK(dtype && shape && offsets, "ferry: ", what, " lacks ", !dtype ? "dtype" : !shape ? "shape" : "data_offsets");
    const std::string& dname = dtype->string(what + " dtype");
    TORCH_CHECK(safetensors_dtype(dname, &e.dtype), "ferry: ", what, " has dtype ", dname, ", which ferry cannot read "
                "(F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U8, BOOL)");
    int64_t elements = 1;
    for (const JsonValue& d : shape->array(what + " shape")) {
      const int64_t n = d.int64(what + " shape");
      TORCH_CHECK(n >= 0, "ferry: ", what, " has a negative dimension ", n);
      TORCH_CHECK(n == 0 || elements <= std::numeric_limits<int64_t>::max() / n, "ferry: ", what, "'s shape overflows");
      elements *= n;
      e.shape.push_back(n);
    }
    const std::vector<JsonValue>& range = offsets->array(what + " data_offsets");
    TORCH_CHECK(range.size() == 2, "ferry: ", what, " has ", range.size(), " data_offsets, expected [begin, end]");
    e.begin = range[0].int64(what + " data_offsets");
    e.end = range[1].int64(what + " data_offsets");
    TORCH_CHECK(e.begin >= 0 && e.begin <= e.end, "ferry: ", what, " has data_offsets [", e.begin, ", ", e.end,
                "], expected 0 <= begin <= end");
    TORCH_CHECK(e.end <= data_bytes, "ferry: ", what, "'s data_offsets [", e.begin, ", ", e.end,
                "] run past the end of the data (", data_bytes, " bytes): the file is truncated or the header wrong");
    const int64_t item = static_cast<int64_t>(c10::elementSize(e.dtype));
    TORCH_CHECK(elements <= std::numeric_limits<int64_t>::max() / item && e.end - e.begin == elements * item, "ferry: ",
                what, " of shape ", c10::IntArrayRef(e.shape), " and dtype ", dname, " needs ", elements * item,
                " bytes; its data_offsets [", e.begin, ", ", e.end, "] hold ", e.end - e.begin);
    f->index_[name] = f->entries_.size();
    f->entries_.push_back(std::move(e));
  }
  // The data is exactly the tensors' bytes, back to back (the format has no holes and no overlaps).
  std::vector<size_t> order(f->entries_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const Entry& x = f->entries_[a];
    const Entry& y = f->entries_[b];
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  int64_t covered = 0;
  const Entry* previous = nullptr;
  for (size_t k : order) {
    const Entry& e = f->entries_[k];
    TORCH_CHECK(e.begin >= covered || e.begin == e.end, "ferry: ", where, ": the bytes of tensors '",
                previous ? previous->name : "", "' and '", e.name, "' overlap ([", previous ? previous->begin : 0, ", ",
                covered, ") and [", e.begin, ", ", e.end, "))");
    TORCH_CHECK(e.begin <= covered || e.begin == e.end, "ferry: ", where, ": data bytes [", covered, ", ", e.begin,
                ") before tensor '", e.name, "' belong to no tensor (safetensors data has no holes)");
    if (e.end > covered) {
      covered = e.end;
      previous = &e;
    }
  }
  TORCH_CHECK(covered == data_bytes, "ferry: ", where, " has ", data_bytes - covered, " bytes after its last tensor's data ",
              "(safetensors data has no holes; a file written over a longer one?)");
  f->self_ = f;
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (base_ != nullptr) ::munmap(const_cast<uint8_t*>(base_), static_cast<size_t>(size_));
}

const SafetensorsFile::Entry* SafetensorsFile::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

bool SafetensorsFile::release(const at::Tensor& t) const {
  if (!t.defined() || base_ == nullptr) return false;
  const auto* begin = static_cast<const uint8_t*>(t.const_data_ptr());
  const uint8_t* end = begin + t.nbytes();
  if (begin < base_ || end > base_ + size_) return false;
  // Whole pages, rounded outwards but kept inside the mapping: a neighbour's page dropped too is read
  // again when the neighbour is (the mapping is read-only and private: nothing of ours is lost).
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = std::max(reinterpret_cast<uintptr_t>(begin) & ~(page - 1), reinterpret_cast<uintptr_t>(base_));
  const uintptr_t hi = std::min((reinterpret_cast<uintptr_t>(end) + page - 1) & ~(page - 1),
                                reinterpret_cast<uintptr_t>(base_) + static_cast<uintptr_t>(size_));
  if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);  // advice: a failure costs memory only
  return true;
}

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const Entry* e = find(name);
  TORCH_CHECK(e != nullptr, "ferry: safetensors file ", path_, " has no tensor '", name, "'");
  const uint8_t* data = base_ + data_start_ + e->begin;
  const auto options = at::TensorOptions().dtype(e->dtype).device(at::kCPU);
  const size_t item = c10::elementSize(e->dtype);
  if (reinterpret_cast<uintptr_t>(data) % item != 0) {  // unaligned for its type: a copy
    at::Tensor t = at::empty(e->shape, options);
    // An empty tensor has no storage (a null pointer, which memcpy must not get even for 0 bytes).
    if (e->end > e->begin) std::memcpy(t.data_ptr(), data, static_cast<size_t>(e->end - e->begin));
    return t;
  }
  std::shared_ptr<const SafetensorsFile> keep = self_.lock();
  return at::from_blob(const_cast<uint8_t*>(data), e->shape, [keep](void*) {}, options);
}

}  // namespace ferry
