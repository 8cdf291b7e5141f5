#pragma once
// Files written so that a crash leaves the old version or the new one, never a mix: a file descriptor
// written whole, fsync'd and closed with every error checked (DurableFile), the directory fsync'd after
// a rename, mkdir -p, sizes and listings. Plain POSIX calls, no std::filesystem: libtorch.so (the PyPI
// wheel) exports its own std::filesystem symbols, which the dynamic linker binds first and which crash
// (docs/ARCHITECTURE.md D21). Errors are TORCH_CHECK failures naming the path and errno's text.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry {

// strerror(errno), for messages.
std::string errno_text();

// A file written whole, fsync'd and closed with every error checked; closed (not synced) if destroyed
// before sync_and_close().
class DurableFile {
 public:
  // Creates (truncates) the file; with `existing`, opens one another process created for writing.
  explicit DurableFile(std::string path, bool existing = false);
  ~DurableFile();
  DurableFile(const DurableFile&) = delete;
  DurableFile& operator=(const DurableFile&) = delete;
  void write(const void* data, size_t n);
  // At byte `offset` (files written out of order: the checkpoint of several ranks).
  void write_at(int64_t offset, const void* data, size_t n);
  // Sets the file's size (a file the ranks then fill at their offsets).
  void truncate(int64_t bytes);
  void sync_and_close();

 private:
  std::string path_;
  int fd_ = -1;
};

// fsync of a directory (a rename in it becomes durable).
void fsync_dir(const std::string& dir);
// mkdir -p; fails unless `dir` is a directory afterwards.
void make_dirs(const std::string& dir);
// Bytes of the file, or -1 if it does not exist.
int64_t file_size(const std::string& path);
// The names in `dir` (empty if it cannot be read).
std::vector<std::string> list_dir(const std::string& dir);
// dir + "/" + name.
std::string join_path(const std::string& dir, const std::string& name);

}  // namespace ferry
