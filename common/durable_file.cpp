#include "durable_file.h"

#include <c10/util/Exception.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

namespace ferry {

std::string errno_text() { return std::strerror(errno); }

std::string join_path(const std::string& dir, const std::string& name) { return dir + "/" + name; }

DurableFile::DurableFile(std::string path, bool existing) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), existing ? O_WRONLY | O_CLOEXEC : O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "ferry: cannot ", existing ? "open " : "create ", path_, ": ", errno_text());
}

DurableFile::~DurableFile() {
  if (fd_ >= 0) ::close(fd_);
}

void DurableFile::write(const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0 && errno == EINTR) continue;
    TORCH_CHECK(w > 0, "ferry: writing ", path_, " failed: ", w < 0 ? errno_text() : "no progress");
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void DurableFile::write_at(int64_t offset, const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    TORCH_CHECK(w > 0, "ferry: writing ", path_, " failed: ", w < 0 ? errno_text() : "no progress");
    p += w;
    offset += w;
    n -= static_cast<size_t>(w);
  }
}

void DurableFile::truncate(int64_t bytes) {
  TORCH_CHECK(::ftruncate(fd_, static_cast<off_t>(bytes)) == 0, "ferry: sizing ", path_, " failed: ", errno_text());
}

void DurableFile::sync_and_close() {
  TORCH_CHECK(::fsync(fd_) == 0, "ferry: fsync of ", path_, " failed: ", errno_text());
  const int fd = fd_;
  fd_ = -1;
  TORCH_CHECK(::close(fd) == 0, "ferry: closing ", path_, " failed: ", errno_text());
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "ferry: cannot open directory ", dir, ": ", errno_text());
  const int rc = ::fsync(fd);
  const std::string err = rc == 0 ? "" : errno_text();
  ::close(fd);
  TORCH_CHECK(rc == 0, "ferry: fsync of directory ", dir, " failed: ", err);
}

// mkdir -p.
void make_dirs(const std::string& dir) {
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos < dir.size() && dir[pos] != '/') continue;
    const std::string prefix = dir.substr(0, pos);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      TORCH_CHECK(false, "ferry: cannot create directory ", prefix, ": ", errno_text());
    }
  }
  struct stat st {};
  TORCH_CHECK(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "ferry: checkpoint path ", dir,
              " is not a directory");
}

// -1 if it does not exist.
int64_t file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return names;
  while (const dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
  ::closedir(d);
  return names;
}

}  // namespace ferry
