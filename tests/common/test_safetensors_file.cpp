// common/safetensors_file.h: files written by write_safetensors and files built byte by byte here
// (independent of ferry's writer) read back: every dtype, empty and 0-dim tensors, metadata, tensors
// over the mapping without a copy, an unaligned tensor copied; and every malformed file refused at
// open() with the file and the tensor named: truncated files, a header longer than the file, headers
// that are not JSON, a name given twice, unknown dtypes and keys, missing keys, negative dimensions,
// offsets past the end, overlapping or leaving holes, bytes after the last tensor, sizes that do not
// match the shape; and mutated files (header and length) opened and read whole, or refused: never a
// crash or a read outside the file.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../../common/safetensors.h"
#include "../../common/safetensors_file.h"
#include "../mutate.h"
#include "../test_util.h"

namespace ferry {
namespace {

using test::error_of;

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "ferry_st_" + std::to_string(::getpid()) + "_" + name + ".safetensors";
}

// A file of the 8-byte little-endian length of `header`, `header`, then `data`.
std::string write_raw(const std::string& name, const std::string& header, const std::string& data,
                      int64_t claimed_header_len = -1) {
  const std::string path = temp_path(name);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  uint64_t n = claimed_header_len >= 0 ? static_cast<uint64_t>(claimed_header_len) : header.size();
  for (int k = 0; k < 8; ++k) f.put(static_cast<char>((n >> (8 * k)) & 0xff));
  f << header << data;
  return path;
}

std::string floats(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

TEST(SafetensorsFile, ReadsWhatWriteSafetensorsWrote) {
  torch::manual_seed(3);
  NamedTensors tensors = {
      {"w.f32", torch::randn({3, 5})},
      {"w.bf16", torch::randn({7}).to(torch::kBFloat16)},
      {"w.f16", torch::randn({2, 2}).to(torch::kHalf)},
      {"w.f64", torch::randn({4}, torch::kDouble)},
      {"i64", torch::arange(6, torch::kLong).reshape({2, 3})},
      {"i32", torch::arange(3, torch::kInt)},
      {"i16", torch::arange(3, torch::kShort)},
      {"i8", torch::arange(-2, 2, torch::kChar)},
      {"u8", torch::arange(5, torch::kByte)},
      {"flags", torch::tensor({true, false, true})},
      {"scalar", torch::tensor(2.5f)},
      {"empty", torch::empty({0, 4})},
      {"strided", torch::randn({4, 6}).t()},
  };
  const std::string path = temp_path("roundtrip");
  write_safetensors(path, tensors, {{"format", "pt"}, {"who", "ferry"}});
  const auto f = SafetensorsFile::open(path);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->metadata().at("who"), "ferry");
  ASSERT_EQ(f->entries().size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    const at::Tensor r = f->tensor(name);
    EXPECT_EQ(r.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(r.sizes(), t.sizes()) << name;
    EXPECT_TRUE(torch::equal(r, t.contiguous())) << name;
  }
  // Over the mapping: the same bytes each time, no copy.
  EXPECT_EQ(f->tensor("w.f32").data_ptr(), f->tensor("w.f32").data_ptr());
  // The tensor keeps the file mapped after the handle is gone.
  at::Tensor kept = f->tensor("w.bf16");
  std::weak_ptr<const SafetensorsFile> weak = f;
  const_cast<std::shared_ptr<const SafetensorsFile>&>(f).reset();
  EXPECT_FALSE(weak.expired());
  EXPECT_TRUE(torch::equal(kept, tensors[1].second));
  kept = at::Tensor();
  EXPECT_TRUE(weak.expired()) << "the last tensor gone, the file is unmapped";
  ::unlink(path.c_str());
}

// The resident KiB of the mapping that holds `p` (its /proc/self/smaps entry's Rss): exact, whatever
// else the process allocates (AddressSanitizer's shadow and quarantine included).
int64_t mapping_rss_kib(const void* p) {
  std::ifstream in("/proc/self/smaps");
  const auto addr = reinterpret_cast<uintptr_t>(p);
  std::string line;
  bool inside = false;
  while (std::getline(in, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      inside = addr >= lo && addr < hi;
    } else if (inside && line.rfind("Rss:", 0) == 0) {
      return std::stoll(line.substr(4));
    }
  }
  return -1;
}

// release() drops a read tensor's pages from this process's resident memory (what keeps a load's RSS
// at one tensor of the file), and reading it again reads the same values from the file.
TEST(SafetensorsFile, ReleaseDropsATensorsPagesAndRereadsThem) {
  const at::Tensor big = torch::arange(int64_t{16} << 20, torch::kFloat);  // 64 MiB
  const std::string path = temp_path("release");
  write_safetensors(path, {{"small", torch::ones({3})}, {"big", big}});
  const auto f = SafetensorsFile::open(path);
  const at::Tensor t = f->tensor("big");
  const int64_t before = mapping_rss_kib(t.data_ptr());
  ASSERT_GE(before, 0) << "the mapping is not in /proc/self/smaps";
  EXPECT_EQ(t.sum(at::kDouble).item<double>(), big.sum(at::kDouble).item<double>());  // every page read
  const int64_t read = mapping_rss_kib(t.data_ptr());
  EXPECT_GE(read - before, 60 * 1024) << "reading 64 MiB of the mapping made it resident";
  EXPECT_TRUE(f->release(t));
  const int64_t released = mapping_rss_kib(t.data_ptr());
  EXPECT_LE(released, 8) << "resident KiB of the mapping: " << before << " before, " << read << " read, "
                         << released << " released (at most the header's and the small tensor's page)";
  EXPECT_TRUE(torch::equal(t, big)) << "read again from the file";
  EXPECT_TRUE(torch::equal(f->tensor("small"), torch::ones({3})));
  EXPECT_FALSE(f->release(big)) << "not over the mapping: nothing to drop";
  EXPECT_FALSE(f->release(at::Tensor()));
  ::unlink(path.c_str());
}

TEST(SafetensorsFile, ReadsAFileBuiltByHandIncludingAnUnalignedTensor) {
  // "b" at data offset 2: its floats are not 4-byte aligned in the mapping, so it is copied; so is the
  // empty "z" at offset 2 (no bytes to copy into a tensor without storage: the sanitizer build's
  // fuzzing found the memcpy given a null pointer there).
  std::string header =
      R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"z":{"dtype":"F32","shape":[0,3],"data_offsets":[2,2]},)"
      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[2,10]}})";
  header.append((8 - header.size() % 8) % 8, ' ');  // the data 8-aligned in the file, as writers pad it
  const std::string path = write_raw("byhand", header, std::string("\x07\x09", 2) + floats({1.5f, -3.0f}));
  const auto f = SafetensorsFile::open(path);
  EXPECT_TRUE(f->metadata().empty());
  EXPECT_EQ(f->tensor("a")[1].item<int>(), 9);
  const at::Tensor b = f->tensor("b");
  EXPECT_EQ(b[0].item<float>(), 1.5f);
  EXPECT_EQ(b[1].item<float>(), -3.0f);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data_ptr()) % 4, 0u);
  EXPECT_FALSE(f->release(b)) << "a copy, not the mapping: release must not drop (zero) its memory";
  EXPECT_EQ(b[1].item<float>(), -3.0f);
  EXPECT_NE(error_of([&] { f->tensor("c"); }).find("has no tensor 'c'"), std::string::npos);
  EXPECT_EQ(f->tensor("z").sizes(), at::IntArrayRef({0, 3}));
  ::unlink(path.c_str());
}

TEST(SafetensorsFile, MalformedFilesAreRefusedNamingFileAndTensor) {
  const std::string ok_a = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  struct Case {
    const char* name;
    std::string header, data;
    int64_t claimed;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"short", "", "", -2, "less than the 8-byte header length"},
      {"header_past_end", "{}", "", 100, "its header needs 100 bytes"},
      {"huge_header", "{}", "", int64_t{1} << 40, "more than the format's limit"},
      {"not_json", "{\"a\":", "", -1, "is not valid JSON"},
      {"not_object", "[1]", "", -1, "expected an object, got an array"},
      {"twice", "{" + ok_a + "," + ok_a + "}", floats({1, 2}), -1, "appears twice"},
      {"dtype", R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", floats({1, 2}), -1,
       "tensor 'a' has dtype Q4, which ferry cannot read"},
      {"unknown_key", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", floats({1, 2}), -1,
       "unknown key \"x\""},
      {"missing", R"({"a":{"dtype":"F32","shape":[2]}})", floats({1, 2}), -1, "tensor 'a' lacks data_offsets"},
      {"negative", R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", floats({1, 2}), -1,
       "negative dimension"},
      {"past_end", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})", floats({1, 2}), -1,
       "run past the end of the data (8 bytes)"},
      {"size", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", floats({1, 2}), -1,
       "needs 12 bytes; its data_offsets [0, 8] hold 8"},
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       floats({1, 2}), -1, "overlap"},
      {"hole",
       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
       floats({1, 2, 3}), -1, "belong to no tensor"},
      {"trailing", "{" + ok_a + "}", floats({1, 2, 3}), -1, "4 bytes after its last tensor"},
      {"offsets_order", R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", floats({1, 2}), -1,
       "expected 0 <= begin <= end"},
      {"metadata", R"({"__metadata__":{"k":1}})", "", -1, "__metadata__ \"k\": expected a string"},
  };
  for (const Case& c : cases) {
    std::string path;
    if (c.claimed == -2) {  // fewer than 8 bytes in all
      path = temp_path(c.name);
      std::ofstream(path, std::ios::binary) << "abc";
    } else {
      path = write_raw(c.name, c.header, c.data, c.claimed);
    }
    const std::string e = error_of([&] { SafetensorsFile::open(path); });
    EXPECT_NE(e.find(c.expect), std::string::npos) << c.name << ": " << e;
    EXPECT_NE(e.find(path), std::string::npos) << c.name << ": the error names the file: " << e;
    ::unlink(path.c_str());
  }
  // A valid file cut short: its last tensor runs past the end.
  const std::string path = temp_path("cut");
  write_safetensors(path, {{"x", torch::randn({16})}, {"y", torch::randn({16})}});
  uint64_t header_len = 0;
  {
    std::ifstream in(path, std::ios::binary);
    unsigned char b[8];
    in.read(reinterpret_cast<char*>(b), 8);
    for (int k = 7; k >= 0; --k) header_len = (header_len << 8) | b[k];
  }
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(8 + header_len + 40)), 0);  // inside x's 64 bytes
  EXPECT_NE(error_of([&] { SafetensorsFile::open(path); }).find("run past the end"), std::string::npos);
  ::unlink(path.c_str());
  EXPECT_NE(error_of([] { SafetensorsFile::open("/nonexistent/x.safetensors"); }).find("cannot open"), std::string::npos);
}

// Mutations of a valid file: 2,000 of its header (the length prefix kept right, so that the JSON and
// the entries are what is tested) and 500 of its bytes as they are (the prefix too). A file that opens
// is read whole, tensor by tensor (a read outside the mapping would crash, or be caught by the sanitizer
// build); one that does not is refused with a c10::Error naming the file.
TEST(SafetensorsFile, MutatedFilesOpenAndReadWholeOrAreRefused) {
  const std::string base_path = temp_path("fuzz_base");
  write_safetensors(base_path, {{"w", torch::randn({3, 5})},
                                {"h", torch::randn({7}).to(torch::kBFloat16)},
                                {"i", torch::arange(4, torch::kLong)},
                                {"s", torch::tensor(2.5)},
                                {"e", torch::empty({0, 3})}},
                    {{"format", "pt"}});
  std::string file;
  {
    std::ifstream in(base_path, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    file = ss.str();
  }
  ::unlink(base_path.c_str());
  ASSERT_GT(file.size(), 8u);
  uint64_t header_len = 0;
  for (int k = 7; k >= 0; --k) header_len = (header_len << 8) | static_cast<unsigned char>(file[k]);
  ASSERT_LE(8 + header_len, file.size());
  const std::string header = file.substr(8, header_len), data = file.substr(8 + header_len);
  std::mt19937 rng(48);
  const std::string path = temp_path("fuzz");
  int64_t opened = 0, refused = 0;
  for (int i = 0; i < 2500; ++i) {
    if (i < 2000) {
      const std::string h = test::mutate(header, rng);
      write_raw("fuzz", h, data);
    } else {
      std::ofstream(path, std::ios::binary | std::ios::trunc) << test::mutate(file, rng);
    }
    try {
      const auto f = SafetensorsFile::open(path);
      for (const SafetensorsFile::Entry& e : f->entries()) {
        const at::Tensor t = f->tensor(e.name);
        EXPECT_EQ(t.numel(), e.numel()) << "iteration " << i << ": " << e.name;
        t.to(torch::kDouble).sum().item<double>();  // every byte read
        f->release(t);
      }
      ++opened;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find(path), std::string::npos)
          << "iteration " << i << ": the error names the file: " << e.what_without_backtrace();
      ++refused;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << i << ": not a c10::Error: " << e.what();
    }
  }
  ::unlink(path.c_str());
  std::printf("mutated safetensors files: %lld opened and read, %lld refused\n", static_cast<long long>(opened),
              static_cast<long long>(refused));
  EXPECT_GT(opened, 0);
  EXPECT_GT(refused, 0);
}

}  // namespace
}  // namespace ferry
