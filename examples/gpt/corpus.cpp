#include "corpus.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <vector>

namespace gpt {
namespace {

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string read_file(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  TORCH_CHECK(in, "gpt: cannot read corpus file ", p);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

ByteCorpus::ByteCorpus(const std::string& path) : path_(path) {
  // POSIX, not std::filesystem (libtorch.so's copy of it crashes; see docs/ARCHITECTURE.md D21).
  if (is_dir(path)) {
    DIR* dir = ::opendir(path.c_str());
    TORCH_CHECK(dir, "gpt: cannot open corpus directory ", path);
    std::vector<std::string> names;
    while (dirent* e = ::readdir(dir)) {
      const std::string full = path + "/" + e->d_name;
      struct stat st {};
      if (e->d_name[0] != '.' && ::stat(full.c_str(), &st) == 0 && S_ISREG(st.st_mode)) names.push_back(full);
    }
    ::closedir(dir);
    std::sort(names.begin(), names.end());
    for (const auto& n : names) {
      bytes_ += read_file(n);
      bytes_ += "\n";
      ++files_;
    }
  } else {
    bytes_ = read_file(path);
    files_ = 1;
  }
  TORCH_CHECK(bytes_.size() >= 1024, "gpt: corpus ", path, " has only ", bytes_.size(),
              " bytes; give --corpus=FILE|DIR with at least 1 KiB of text");
}

std::pair<at::Tensor, at::Tensor> ByteCorpus::sample(int64_t batch, int64_t seq, std::mt19937_64& rng) const {
  TORCH_CHECK(seq + 1 < size(), "gpt: sequence length ", seq, " does not fit the corpus (", size(), " bytes)");
  at::Tensor x = at::empty({batch, seq}, at::kLong), y = at::empty({batch, seq}, at::kLong);
  int64_t* xp = x.data_ptr<int64_t>();
  int64_t* yp = y.data_ptr<int64_t>();
  std::uniform_int_distribution<int64_t> start(0, size() - seq - 2);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t s = start(rng);
    for (int64_t t = 0; t < seq; ++t) {
      xp[b * seq + t] = static_cast<unsigned char>(bytes_[s + t]);
      yp[b * seq + t] = static_cast<unsigned char>(bytes_[s + t + 1]);
    }
  }
  return {x, y};
}

}  // namespace gpt
