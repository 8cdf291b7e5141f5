// write_safetensors against the format (https://huggingface.co/docs/safetensors): the file read back
// byte by byte here, its header parsed by a small JSON parser of the test's own: an 8-byte little-endian
// header length, a JSON object of {name: {dtype, shape, data_offsets}} and __metadata__ (strings
// escaped), the data starting 8-byte aligned, the tensors' bytes in the given order with no holes, each
// contiguous whatever the tensor's strides. Every dtype the header lists, empty and 0-dim tensors. Bad
// input fails naming it and leaves an existing file as it was, with no temporary file behind. Then the
// same file read by the torch wheel's python3 (and by the safetensors package where installed).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../../common/json.h"
#include "../../common/safetensors.h"
#include "../../common/safetensors_file.h"
#include "../test_util.h"

namespace ferry {
namespace {

using test::error_of;

// ---- a small strict JSON parser (objects keep their members' order)
struct Json {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool boolean = false;
  std::string text;  // a string's value, or a number as written
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> members;

  const Json& at(const std::string& key) const {
    for (const auto& [k, v] : members) {
      if (k == key) return v;
    }
    throw std::runtime_error("no member " + key);
  }
  int64_t integer() const {
    if (kind != Kind::kNumber || text.find_first_not_of("-0123456789") != std::string::npos) {
      throw std::runtime_error("not an integer: " + text);
    }
    return std::stoll(text);
  }
  std::vector<int64_t> integers() const {
    if (kind != Kind::kArray) throw std::runtime_error("not an array");
    std::vector<int64_t> v;
    for (const auto& i : items) v.push_back(i.integer());
    return v;
  }
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& s) : s_(s) {}
  // The value at the start; `end` gets the offset after it.
  Json parse(size_t* end) {
    Json v = value();
    *end = i_;
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("JSON: " + what + " at offset " + std::to_string(i_));
  }
  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  char peek() {
    skip_ws();
    if (i_ >= s_.size()) fail("unexpected end");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++i_;
  }
  // After an opening bracket: item() for each comma-separated item until `close` (none: empty).
  template <class Item>
  void items_until(char close, Item item) {
    ++i_;
    if (peek() == close) {
      ++i_;
      return;
    }
    for (item(); peek() == ','; item()) ++i_;
    expect(close);
  }
  Json value() {
    const char c = peek();
    Json v;
    if (c == '{') {
      v.kind = Json::Kind::kObject;
      items_until('}', [&] {
        if (peek() != '"') fail("expected a key");
        std::string key = string();
        expect(':');
        v.members.emplace_back(std::move(key), value());
      });
      return v;
    }
    if (c == '[') {
      v.kind = Json::Kind::kArray;
      items_until(']', [&] { v.items.push_back(value()); });
      return v;
    }
    if (c == '"') {
      v.kind = Json::Kind::kString;
      v.text = string();
      return v;
    }
    if (s_.compare(i_, 4, "true") == 0 || s_.compare(i_, 5, "false") == 0) {
      v.kind = Json::Kind::kBool;
      v.boolean = s_[i_] == 't';
      i_ += v.boolean ? 4 : 5;
      return v;
    }
    if (s_.compare(i_, 4, "null") == 0) {
      i_ += 4;
      return v;
    }
    const size_t start = i_;
    while (i_ < s_.size() && std::strchr("-+.eE0123456789", s_[i_]) != nullptr) ++i_;
    if (i_ == start) fail("unexpected character");
    v.kind = Json::Kind::kNumber;
    v.text = s_.substr(start, i_ - start);
    return v;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("unterminated string");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unterminated escape");
      const char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          if (i_ + 4 > s_.size()) fail("short \\u escape");
          const unsigned code = std::stoul(s_.substr(i_, 4), nullptr, 16);
          i_ += 4;
          if (code >= 0x80) fail("only ASCII \\u escapes are expected here");
          out += static_cast<char>(code);
          break;
        }
        default: fail("bad escape");
      }
    }
  }

  const std::string& s_;
  size_t i_ = 0;
};

// ---- the file as the format describes it
struct Parsed {
  uint64_t header_len = 0;
  std::string header_text;  // the header's bytes, padding included
  Json header;
  std::string data;         // everything after the header
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

Parsed parse_file(const std::string& path) {
  const std::string bytes = read_file(path);
  Parsed p;
  if (bytes.size() < 8) throw std::runtime_error("shorter than the length field");
  for (int i = 0; i < 8; ++i) p.header_len |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  if (8 + p.header_len > bytes.size()) throw std::runtime_error("header length past the end");
  p.header_text = bytes.substr(8, p.header_len);
  size_t end = 0;
  p.header = JsonParser(p.header_text).parse(&end);
  // The format allows trailing spaces (padding) after the JSON, nothing else.
  if (p.header_text.find_first_not_of(' ', end) != std::string::npos) throw std::runtime_error("junk after the header");
  p.data = bytes.substr(8 + p.header_len);
  return p;
}

std::string bytes_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
}

std::string temp_dir() {
  std::string tmpl = "/tmp/ferry-safetensors-XXXXXX";
  EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    ::closedir(d);
  }
  return names;
}

void remove_dir(const std::string& dir) {
  for (const auto& f : files_in(dir)) ::unlink((dir + "/" + f).c_str());
  ::rmdir(dir.c_str());
}

// One tensor of every dtype the header lists, plus a transposed (non-contiguous) one, an empty one and
// a 0-dim one, in this order.
NamedTensors every_kind() {
  const at::Tensor w = torch::arange(6, torch::kFloat).reshape({2, 3}) * 0.5;
  return {
      {"w", w},
      {"f64", torch::tensor({1.0 / 3.0, -2.5}, torch::kDouble)},
      {"b16", torch::tensor({1.0f, -2.0f, 0.5f, 3.0f}).to(torch::kBFloat16)},
      {"f16", torch::tensor({0.25f, -65504.0f}).to(torch::kHalf)},
      {"i8", torch::tensor({-128, 127, 0}, torch::kChar)},
      {"i16", torch::tensor({-32768, 1234}, torch::kShort)},
      {"i32", torch::tensor({-7, 1 << 30}, torch::kInt)},
      {"ids", torch::tensor({int64_t{-1}, int64_t{1} << 40, int64_t{3}, int64_t{4}}, torch::kLong).reshape({2, 2})},
      {"u8", torch::tensor({0, 255, 17}, torch::kByte)},
      {"mask", torch::tensor({true, false, true})},
      {"w.T", w.t()},  // strides (1, 3): written as the contiguous [3, 2]
      {"empty", torch::zeros({0, 3})},
      {"scalar", torch::tensor(2.75f)},
  };
}

const std::map<std::string, std::string>& metadata() {
  static const std::map<std::string, std::string> m = {
      {"format", "pt"}, {"note", "a \"quoted\" \\ value\nwith a newline and a\ttab"}, {"k\"ey", "v"}};
  return m;
}

// The format's dtype names (https://huggingface.co/docs/safetensors), as the spec lists them.
const std::map<at::ScalarType, std::string> kSpecDtype = {
    {at::kFloat, "F32"}, {at::kDouble, "F64"}, {at::kBFloat16, "BF16"}, {at::kHalf, "F16"},
    {at::kChar, "I8"},   {at::kShort, "I16"},  {at::kInt, "I32"},       {at::kLong, "I64"},
    {at::kByte, "U8"},   {at::kBool, "BOOL"},
};

TEST(Safetensors, TheFileIsTheFormatByteForByte) {
  const std::string dir = temp_dir();
  const std::string path = dir + "/t.safetensors";
  const NamedTensors tensors = every_kind();
  write_safetensors(path, tensors, metadata());
  Parsed p;
  ASSERT_NO_THROW(p = parse_file(path));
  EXPECT_EQ((8 + p.header_len) % 8, 0u) << "the data starts 8-byte aligned";
  ASSERT_EQ(p.header.kind, Json::Kind::kObject);
  // __metadata__: strings to strings, escapes undone.
  const Json& meta = p.header.at("__metadata__");
  ASSERT_EQ(meta.kind, Json::Kind::kObject);
  std::map<std::string, std::string> read_meta;
  for (const auto& [k, v] : meta.members) {
    ASSERT_EQ(v.kind, Json::Kind::kString) << k;
    read_meta[k] = v.text;
  }
  EXPECT_EQ(read_meta, metadata());
  // Every tensor, in order; offsets from 0, each one's end the next one's begin, the last the data's end.
  ASSERT_EQ(p.header.members.size(), tensors.size() + 1) << p.header_text;
  int64_t offset = 0;
  size_t i = 0;
  for (const auto& [name, entry] : p.header.members) {
    if (name == "__metadata__") continue;
    ASSERT_LT(i, tensors.size());
    const auto& [want_name, t] = tensors[i++];
    EXPECT_EQ(name, want_name) << "written in the given order";
    EXPECT_EQ(entry.at("dtype").text, kSpecDtype.at(t.scalar_type())) << name;
    EXPECT_EQ(entry.at("shape").integers(), t.sizes().vec()) << name;
    const std::vector<int64_t> range = entry.at("data_offsets").integers();
    ASSERT_EQ(range.size(), 2u) << name;
    EXPECT_EQ(range[0], offset) << name << ": no hole before it";
    EXPECT_EQ(range[1] - range[0], t.numel() * static_cast<int64_t>(t.element_size())) << name;
    ASSERT_LE(range[1], static_cast<int64_t>(p.data.size())) << name;
    EXPECT_EQ(p.data.substr(range[0], range[1] - range[0]), bytes_of(t)) << name << ": its bytes, row-major";
    offset = range[1];
  }
  EXPECT_EQ(offset, static_cast<int64_t>(p.data.size())) << "nothing after the last tensor";
  // The transposed tensor was written as its values in row-major order, not as its storage.
  const std::string wt = bytes_of(tensors[10].second);
  const float* f = reinterpret_cast<const float*>(wt.data());
  EXPECT_EQ(std::vector<float>(f, f + 6), (std::vector<float>{0.0f, 1.5f, 0.5f, 2.0f, 1.0f, 2.5f}));
  // Only the file is left: no temporary beside it.
  EXPECT_EQ(files_in(dir), std::vector<std::string>{"t.safetensors"});
  remove_dir(dir);
}

TEST(Safetensors, WithoutMetadataTheHeaderHasNoMetadataEntry) {
  const std::string dir = temp_dir();
  const std::string path = dir + "/t.safetensors";
  write_safetensors(path, {{"x", torch::ones({3})}});
  const Parsed p = parse_file(path);
  ASSERT_EQ(p.header.members.size(), 1u) << p.header_text;
  EXPECT_EQ(p.header.members[0].first, "x");
  EXPECT_EQ(p.data.size(), 12u);
  // No tensors at all: an empty object, still a valid file.
  write_safetensors(path, {});
  const Parsed empty = parse_file(path);
  EXPECT_TRUE(empty.header.members.empty()) << empty.header_text;
  EXPECT_TRUE(empty.data.empty());
  remove_dir(dir);
}

// A write that fails leaves PATH as it was (written to PATH.tmp.<pid> and renamed only at the end) and
// removes its temporary; the checks name what is wrong.
TEST(Safetensors, BadInputFailsNamingItAndLeavesTheFileAsItWas) {
  const std::string dir = temp_dir();
  const std::string path = dir + "/t.safetensors";
  write_safetensors(path, {{"kept", torch::ones({2})}});
  const std::string before = read_file(path);
  EXPECT_ERROR_HAS(write_safetensors(path, {{"a", torch::ones({1})}, {"a", torch::ones({1})}}),
                   "names must be unique and not empty or __metadata__, got 'a'");
  EXPECT_ERROR_HAS(write_safetensors(path, {{"", torch::ones({1})}}), "got ''");
  EXPECT_ERROR_HAS(write_safetensors(path, {{"__metadata__", torch::ones({1})}}), "got '__metadata__'");
  EXPECT_ERROR_HAS(write_safetensors(path, {{"u", at::Tensor()}}), "safetensors tensor u is undefined");
  EXPECT_ERROR_HAS(write_safetensors(path, {{"ok", torch::ones({1})}, {"c", torch::ones({2}, torch::kComplexFloat)}}),
                   "safetensors has no dtype for ComplexFloat");
  EXPECT_ERROR_HAS(write_safetensors("", {{"x", torch::ones({1})}}), "write_safetensors needs a path");
  EXPECT_ERROR_HAS(write_safetensors(dir + "/no/such/dir/t.safetensors", {{"x", torch::ones({1})}}), "cannot create");
  EXPECT_EQ(read_file(path), before) << "every failure left the file alone";
  EXPECT_EQ(files_in(dir), std::vector<std::string>{"t.safetensors"}) << "no temporary left behind";
  remove_dir(dir);
}

// The torch wheel's python reads the file by the format (json + struct + torch.frombuffer) and, where
// the safetensors package is installed, with safetensors.torch.load_file; it saves what it read with
// torch.save, which this test loads back and compares.
TEST(Safetensors, PythonReadsWhatWasWritten) {
#ifndef FERRY_TEST_PYTHON
  GTEST_SKIP() << "built without a python3 that imports torch";
#else
  const std::string python = FERRY_TEST_PYTHON;
  if (python.empty() || std::system((python + " -c 'import torch' > /dev/null 2>&1").c_str()) != 0) {
    GTEST_SKIP() << "no python3 with torch at '" << python << "'";
  }
  const std::string dir = temp_dir();
  const NamedTensors tensors = every_kind();
  write_safetensors(dir + "/t.safetensors", tensors, metadata());
  std::ofstream(dir + "/read.py") << R"PY(
import json, struct, sys, torch
path, out = sys.argv[1], sys.argv[2]
data = open(path, "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
meta = header.pop("__metadata__")
assert meta == {"format": "pt", "note": "a \"quoted\" \\ value\nwith a newline and a\ttab", "k\"ey": "v"}, meta
dtypes = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16,
          "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8,
          "BOOL": torch.bool}
tensors = {}
for name, info in header.items():
    b, e = info["data_offsets"]
    raw = bytearray(data[8 + n + b: 8 + n + e])
    dt = dtypes[info["dtype"]]
    t = torch.frombuffer(raw, dtype=dt) if raw else torch.empty(0, dtype=dt)
    tensors[name] = t.reshape(info["shape"])
try:
    from safetensors.torch import load_file
    other = load_file(path)
    assert other.keys() == tensors.keys()
    assert all(torch.equal(other[k], v) for k, v in tensors.items())
    print("safetensors: read by the package too")
except ImportError:
    print("safetensors: package not installed, read by the format only")
torch.save(tensors, out)
)PY";
  const std::string cmd = python + " " + dir + "/read.py " + dir + "/t.safetensors " + dir + "/t.pt 2>" + dir + "/err.txt";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd << "\n" << read_file(dir + "/err.txt");
  const std::string pt = read_file(dir + "/t.pt");
  const c10::Dict<c10::IValue, c10::IValue> loaded =
      torch::pickle_load(std::vector<char>(pt.begin(), pt.end())).toGenericDict();
  EXPECT_EQ(loaded.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(loaded.contains(name)) << name;
    const at::Tensor read = loaded.at(name).toTensor();
    EXPECT_EQ(read.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(read.sizes(), t.sizes()) << name;
    EXPECT_TRUE(torch::equal(read, t)) << name;
  }
  remove_dir(dir);
#endif
}


// A Hugging Face folder: shards closed when the next tensor would pass the limit, the index naming each
// tensor's shard and the total, floating tensors converted (integers kept), and an earlier save's
// weight files the new one does not name removed (other files kept).
TEST(Safetensors, AFolderIsShardedIndexedAndReplacesAnEarlierSave) {
  const std::string dir = temp_dir();
  for (const char* stale : {"model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors", "model.safetensors"}) {
    write_safetensors(dir + "/" + stale, {{"old", torch::ones({1})}});
  }
  std::ofstream(dir + "/tokenizer.json") << "{}";
  const NamedTensors tensors = {{"a", torch::randn({1000})},
                                {"b", torch::randn({30, 100})},
                                {"c", torch::randn({10}).to(torch::kBFloat16)},
                                {"d", torch::arange(5, torch::kLong)}};
  SafetensorsFolderOptions options;
  options.max_shard_bytes = 8000;  // a + b in bf16 = 8000 bytes exactly; c and d in the second shard
  options.floating_as = at::kBFloat16;
  const std::vector<std::string> files = write_safetensors_folder(dir, tensors, options);
  const std::vector<std::string> want_files = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
  EXPECT_EQ(files, want_files);
  std::vector<std::string> in_dir = files_in(dir);
  std::sort(in_dir.begin(), in_dir.end());
  EXPECT_EQ(in_dir, (std::vector<std::string>{"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                              "model.safetensors.index.json", "tokenizer.json"}));
  const JsonValue index = parse_json(read_file(dir + "/model.safetensors.index.json"), "index");
  EXPECT_EQ(index.find("metadata")->find("total_size")->int64("total_size"), 2000 + 6000 + 20 + 40);
  const JsonValue& map = *index.find("weight_map");
  const std::map<std::string, std::string> want_map = {
      {"a", want_files[0]}, {"b", want_files[0]}, {"c", want_files[1]}, {"d", want_files[1]}};
  ASSERT_EQ(map.object("weight_map").size(), want_map.size());
  for (const auto& [name, file] : want_map) {
    EXPECT_EQ(map.find(name)->string(name), file) << name;
    const auto f = SafetensorsFile::open(dir + "/" + file);
    EXPECT_EQ(f->metadata().at("format"), "pt");
    const at::Tensor t = f->tensor(name);
    const at::Tensor& given = std::find_if(tensors.begin(), tensors.end(), [&name = name](const auto& nt) { return nt.first == name; })->second;
    EXPECT_EQ(t.scalar_type(), name == "d" ? at::kLong : at::kBFloat16) << name;
    EXPECT_TRUE(torch::equal(t, name == "d" ? given : given.to(at::kBFloat16))) << name;
  }
  // One shard: model.safetensors alone; the shards and the index of the save before are gone.
  EXPECT_EQ(write_safetensors_folder(dir, tensors), std::vector<std::string>{"model.safetensors"});
  in_dir = files_in(dir);
  std::sort(in_dir.begin(), in_dir.end());
  EXPECT_EQ(in_dir, (std::vector<std::string>{"model.safetensors", "tokenizer.json"}));
  EXPECT_TRUE(torch::equal(SafetensorsFile::open(dir + "/model.safetensors")->tensor("b"), tensors[1].second));
  EXPECT_ERROR_HAS(write_safetensors_folder(dir, {}), "got no tensors");
  SafetensorsFolderOptions zero;
  zero.max_shard_bytes = 0;
  EXPECT_ERROR_HAS(write_safetensors_folder(dir, tensors, zero), "max_shard_bytes must be > 0, got 0");
  remove_dir(dir);
}

}  // namespace
}  // namespace ferry
