#pragma once
// Reading safetensors files (the format common/safetensors.h writes; what Hugging Face publishes):
// one file memory-mapped read-only, its header checked whole before any tensor is handed out, each
// tensor a CPU tensor over the mapping (no copy; the pages are read when the tensor is).
//
// Checked at open(), each failure a c10::Error naming the file (and the tensor): the file holds the
// 8-byte header length and the header; the header is JSON (common/json.h), an object of tensors and an
// optional "__metadata__" of strings; each tensor has exactly "dtype" (one this reader knows), "shape"
// (non-negative integers) and "data_offsets" [begin, end] with end - begin = its bytes, within the data;
// no two tensors' bytes overlap. A file that passes cannot make a tensor read outside the mapping.
//
// Contract: thread-safe after open() (immutable). A tensor from tensor() keeps the mapping alive and is
// read-only memory: writing into it is a segmentation fault, so copy it first (every loader copies into
// its destination anyway). Tensors whose offset is not a multiple of their element size are copied
// into aligned memory.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ferry {

class SafetensorsFile {
 public:
  struct Entry {
    std::string name;
    at::ScalarType dtype = at::kFloat;
    std::vector<int64_t> shape;
    int64_t begin = 0, end = 0;  // byte offsets into the data (after the header)
    int64_t numel() const;
  };

  // Maps and checks `path`; fails naming the file and what is wrong.
  static std::shared_ptr<const SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<Entry>& entries() const { return entries_; }  // in the header's order
  const Entry* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  int64_t file_bytes() const { return size_; }
  // The tensor `name` over the mapping (see the contract); fails naming the file if absent.
  at::Tensor tensor(const std::string& name) const;
  // Drops the mapping's pages under `t` (every whole page its bytes touch, madvise MADV_DONTNEED) from
  // this process's resident memory: a loader that has copied a tensor calls it, so a load holds one
  // tensor of the file at a time, not the whole file. Reading `t` again reads the file again (from the
  // page cache). Returns false, doing nothing, for a tensor not over this mapping (an aligned copy).
  bool release(const at::Tensor& t) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  const uint8_t* base_ = nullptr;  // the mapping
  int64_t size_ = 0;
  int64_t data_start_ = 0;
  std::vector<Entry> entries_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
  std::weak_ptr<const SafetensorsFile> self_;  // what a tensor's deleter keeps alive
};

// The dtype of a safetensors dtype name ("F32", "BF16", ...); false if not one this reader knows.
bool safetensors_dtype(const std::string& name, at::ScalarType* out);

}  // namespace ferry
