// common/durable_file.h in a fresh temporary directory: DurableFile's writes, out-of-order writes and
// sizes against an in-memory model of the file's bytes, read back after sync_and_close(); make_dirs()
// nested, repeated, and refused on a file; file_size(), list_dir(), join_path(), fsync_dir(); and every
// error names the path and errno's text.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "../../common/durable_file.h"
#include "../test_util.h"

namespace ferry {
namespace {

using test::error_of;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A fresh directory under /tmp, removed with everything in it at the end.
class TempDir {
 public:
  TempDir() {
    std::string templ = "/tmp/ferry_durable_XXXXXX";
    TORCH_CHECK(::mkdtemp(templ.data()), "mkdtemp failed");
    path = templ;
  }
  ~TempDir() { remove(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return join_path(path, name); }
  std::string path;

 private:
  static void remove(const std::string& p) {
    for (const std::string& name : list_dir(p)) {
      if (name == "." || name == "..") continue;
      const std::string child = join_path(p, name);
      struct stat st {};
      if (::lstat(child.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
        remove(child);
      } else {
        ::unlink(child.c_str());
      }
    }
    ::rmdir(p.c_str());
  }
};

TEST(DurableFile, WritesAppendAndSyncAndCloseKeepsThem) {
  TempDir dir;
  const std::string path = dir / "data";
  DurableFile f(path);
  EXPECT_EQ(file_size(path), 0) << "created empty";
  const std::string a = "hello, ", b(100000, 'x');  // b: larger than one write() may take at once
  f.write(a.data(), a.size());
  f.write(b.data(), b.size());
  f.write(nullptr, 0);
  f.sync_and_close();
  EXPECT_EQ(read_file(path), a + b);
  EXPECT_EQ(file_size(path), static_cast<int64_t>(a.size() + b.size()));
  // A new DurableFile over it truncates; one destroyed before sync_and_close() keeps what it wrote.
  {
    DurableFile again(path);
    again.write("abc", 3);
  }
  EXPECT_EQ(read_file(path), "abc");
}

// Out of order, as the ranks of a checkpoint fill one file: the file's bytes against a string written
// the same way.
TEST(DurableFile, WriteAtAndTruncateAsAnInMemoryModel) {
  TempDir dir;
  const std::string path = dir / "shards";
  std::string model;
  {
    DurableFile f(path);
    f.truncate(32);
    model.assign(32, '\0');
    EXPECT_EQ(file_size(path), 32);
    const std::vector<std::pair<int64_t, std::string>> writes = {{24, "rank3..."}, {0, "rank0..."}, {12, "mid"},
                                                                 {30, "past the end"}};
    for (const auto& [offset, bytes] : writes) {
      f.write_at(offset, bytes.data(), bytes.size());
      if (static_cast<int64_t>(model.size()) < offset + static_cast<int64_t>(bytes.size())) model.resize(offset + bytes.size(), '\0');
      std::copy(bytes.begin(), bytes.end(), model.begin() + offset);
    }
    f.sync_and_close();
  }
  EXPECT_EQ(read_file(path), model);
  {  // `existing`: opened for writing without truncating
    DurableFile f(path, /*existing=*/true);
    f.write_at(4, "XY", 2);
    model.replace(4, 2, "XY");
    f.truncate(20);  // shrinks
    model.resize(20);
    f.sync_and_close();
  }
  EXPECT_EQ(read_file(path), model);
  EXPECT_EQ(file_size(path), 20);
}

TEST(DurableFile, ErrorsNameThePathAndTheCause) {
  TempDir dir;
  const std::string missing_dir = dir / "no/such/dir/file";
  std::string err = error_of([&] { DurableFile f(missing_dir); });
  EXPECT_NE(err.find("ferry: cannot create " + missing_dir + ": " + std::strerror(ENOENT)), std::string::npos) << err;
  const std::string absent = dir / "absent";
  err = error_of([&] { DurableFile f(absent, /*existing=*/true); });
  EXPECT_NE(err.find("ferry: cannot open " + absent + ": " + std::strerror(ENOENT)), std::string::npos) << err;
  EXPECT_EQ(file_size(absent), -1) << "`existing` creates nothing";
  // After sync_and_close() the descriptor is gone: writes fail naming the file.
  const std::string closed = dir / "closed";
  DurableFile f(closed);
  f.sync_and_close();
  err = error_of([&] { f.write("a", 1); });
  EXPECT_NE(err.find("ferry: writing " + closed + " failed: " + std::strerror(EBADF)), std::string::npos) << err;
  err = error_of([&] { f.write_at(0, "a", 1); });
  EXPECT_NE(err.find("ferry: writing " + closed + " failed"), std::string::npos) << err;
  err = error_of([&] { f.truncate(4); });
  EXPECT_NE(err.find("ferry: sizing " + closed + " failed"), std::string::npos) << err;
  err = error_of([&] { fsync_dir(dir / "nowhere"); });
  EXPECT_NE(err.find("ferry: cannot open directory " + (dir / "nowhere")), std::string::npos) << err;
  EXPECT_EQ(error_of([&] { fsync_dir(dir.path); }), "(no error)");
  errno = ENOSPC;
  EXPECT_EQ(errno_text(), std::strerror(ENOSPC));
}

TEST(DurableFile, MakeDirsNestedRepeatedAndNotOverAFile) {
  TempDir dir;
  const std::string nested = dir / "a/b/c";
  make_dirs(nested);
  struct stat st {};
  ASSERT_EQ(::stat(nested.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(error_of([&] { make_dirs(nested); }), "(no error)") << "mkdir -p: existing is fine";
  EXPECT_EQ(error_of([&] { make_dirs(dir / "a/d/"); }), "(no error)") << "a trailing slash";
  EXPECT_EQ(::stat((dir / "a/d").c_str(), &st), 0);
  // A file where a directory should be.
  const std::string file = dir / "file";
  DurableFile(file).sync_and_close();
  std::string err = error_of([&] { make_dirs(file); });
  EXPECT_NE(err.find(file + " is not a directory"), std::string::npos) << err;
  const std::string below = file + "/sub";
  err = error_of([&] { make_dirs(below); });
  EXPECT_NE(err.find("ferry: cannot create directory " + below + ": " + std::strerror(ENOTDIR)), std::string::npos)
      << err;
}

TEST(DurableFile, FileSizeListDirAndJoinPath) {
  TempDir dir;
  EXPECT_EQ(join_path("a/b", "c"), "a/b/c");
  EXPECT_EQ(file_size(dir / "none"), -1);
  for (const std::string name : {"one", "two"}) {
    DurableFile f(dir / name);
    f.write(name.data(), name.size());
    f.sync_and_close();
  }
  make_dirs(dir / "sub");
  EXPECT_EQ(file_size(dir / "one"), 3);
  std::vector<std::string> names = list_dir(dir.path);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{".", "..", "one", "sub", "two"})) << "every entry, . and .. included";
  EXPECT_TRUE(list_dir(dir / "none").empty()) << "a directory that cannot be read: empty";
  EXPECT_TRUE(list_dir(dir / "one").empty()) << "a file: empty";
}

}  // namespace
}  // namespace ferry
