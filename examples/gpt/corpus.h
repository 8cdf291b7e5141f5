#pragma once
// A byte-level text corpus and random training windows from it.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <random>
#include <string>

namespace gpt {

class ByteCorpus {
 public:
  // `path`: a text file, or a directory whose regular files (sorted by name) are concatenated.
  explicit ByteCorpus(const std::string& path);
  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }
  const std::string& path() const { return path_; }
  int64_t files() const { return files_; }
  // `batch` windows of seq+1 bytes at random offsets: inputs [batch, seq], targets shifted by one.
  std::pair<at::Tensor, at::Tensor> sample(int64_t batch, int64_t seq, std::mt19937_64& rng) const;

 private:
  std::string path_;
  std::string bytes_;
  int64_t files_ = 0;
};

}  // namespace gpt
