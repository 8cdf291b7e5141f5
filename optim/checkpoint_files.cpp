// The checkpoint files: HybridAdam's training state in a directory, written atomically and durably,
// read back only after every check passed. The format and its guarantees are documented in
// docs/CHECKPOINT.md.
//
// Save is atomic and durable. The data files of a save carry a generation number that no file in the
// directory has yet (`master.<g>.f32`, ...); they are written, fsync'd and closed; then the manifest,
// which names them with their sizes and CRC-32C checksums, is written to a temporary name, fsync'd and
// renamed over `manifest.txt` (rename is atomic), and the directory is fsync'd. Only then are the
// previous generation's files removed. So at every instant the directory's manifest names a complete,
// durable set of files: the previous checkpoint until the rename, the new one after it — whatever kills
// the save (a signal, a full disk, a permission error). A failed save removes what it wrote.
//
// Load checks everything before it writes anything: every manifest number parsed whole and bounded
// (numel = product of the shape, ndim <= kMaxDims), names and shapes against the model, each file's
// size, then one read of every file for its checksum and for finite values. Only then a second read
// copies the values in. The price is reading the checkpoint twice (the page cache often serves the
// second read).
#include "checkpoint_files.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <limits>
#include <memory>
#include <sstream>

#include "../common/cli.h"
#include "../common/crc32c.h"
#include "../common/durable_file.h"
#include "../common/logging.h"

namespace ferry::optim {
namespace {

constexpr const char* kMagic = "ferry-checkpoint";
constexpr int kVersion = 4;  // 3: per-parameter step counts (D62); 4: the state format (D76)
constexpr const char* kRoleNames[] = {"master", "exp_avg", "exp_avg_sq"};
constexpr int kMaxDims = 64;                       // more than any torch op supports
constexpr int64_t kMaxDim = int64_t{1} << 40;      // per dimension
constexpr int64_t kMaxNumel = int64_t{1} << 48;    // per parameter and in total (1 PiB of fp32)
constexpr int64_t kMaxCount = 100'000'000;         // parameters, groups
constexpr size_t kBlockFloats = size_t{1} << 21;   // 8 MiB per read in the verify pass

// The generation of a data file name "<role>.<g>.f32", or -1.
int64_t generation_of(const std::string& name) {
  for (const char* role : kRoleNames) {
    const std::string prefix = std::string(role) + ".";
    if (name.rfind(prefix, 0) != 0 || name.size() <= prefix.size() + 4 || name.substr(name.size() - 4) != ".f32") {
      continue;
    }
    const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - 4);
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 15) continue;
    return std::stoll(digits);
  }
  return -1;
}

std::string data_file_name(int role, int64_t generation) {
  return std::string(kRoleNames[role]) + "." + std::to_string(generation) + ".f32";
}

// Index of the first value that may not be stored: non-finite, or negative for a second moment.
int64_t first_bad_value(const float* x, int64_t n, bool non_negative) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i]) || (non_negative && x[i] < 0)) return i;
  }
  return -1;
}

// A state slot as it is written: a contiguous CPU copy, refused (naming it) unless finite and, for a
// second moment, non-negative.
at::Tensor savable(const at::Tensor& slot, int role, bool second_moment, const std::string& param) {
  at::Tensor t = slot.to(at::kCPU).contiguous();
  const float* x = t.data_ptr<float>();
  const int64_t bad = first_bad_value(x, t.numel(), second_moment);
  TORCH_CHECK(bad < 0, "ferry: refusing to save a checkpoint with ", kRoleNames[role], " of parameter ", param, " = ",
              bad < 0 ? 0.0f : x[bad], " at element ", bad,
              " (the training state is not finite); the directory keeps its previous checkpoint");
  return t;
}

int64_t next_generation(const std::string& dir) {
  int64_t generation = 0;
  for (const std::string& name : list_dir(dir)) generation = std::max(generation, generation_of(name) + 1);
  return generation;
}

// ---- manifest --------------------------------------------------------------------------------

struct Manifest {
  int version = 0;
  int64_t generation = -1;
  std::string precision;
  std::string state_format = "fp32";  // the saving optimizer's (versions < 4: fp32)
  struct Param {
    int64_t numel = 0;
    std::vector<int64_t> shape;
    std::string name;
  };
  std::vector<Param> params;
  struct Group {
    int64_t step = 0;
    AdamOptions options;
  };
  std::vector<Group> groups;
  // Version 3: (parameter, its own step count) for each parameter whose count differs from its group's;
  // in increasing parameter order. Earlier versions: none (every parameter at its group's count).
  std::vector<std::pair<int64_t, int64_t>> param_steps;
  LossScalerState scaler;
  struct File {
    std::string name;
    int64_t bytes = -1;
    uint32_t crc = 0;
    bool has_crc = false;
  };
  File files[3];
  int64_t total_numel = 0;
};

// Reads the manifest one whitespace-separated line at a time; every number must parse whole.
class ManifestReader {
 public:
  explicit ManifestReader(const std::string& path) : path_(path), in_(path) {
    TORCH_CHECK(in_, "ferry: no checkpoint manifest at ", path, " (a directory without one holds no checkpoint)");
  }
  // The next line's tokens; its first must be `key` (when given).
  void next(const char* key = nullptr) {
    std::string text;
    TORCH_CHECK(std::getline(in_, text), "ferry: checkpoint manifest ", path_, " ends early at line ", line_ + 1,
                key ? std::string(" (expected '") + key + "')" : std::string());
    ++line_;
    std::istringstream ss(text);
    tokens_.clear();
    at_ = 0;
    for (std::string t; ss >> t;) tokens_.push_back(t);
    if (key) {
      const std::string got = tokens_.empty() ? "" : tokens_[0];
      fail_unless(got == key, std::string("expected '") + key + "', got '" + got + "'");
      at_ = 1;
    }
  }
  bool at_eof() {
    std::string rest;
    while (std::getline(in_, rest)) {
      if (rest.find_first_not_of(" \t\r") != std::string::npos) return false;
    }
    return true;
  }
  std::string word() {
    fail_unless(at_ < tokens_.size(), "line is too short");
    return tokens_[at_++];
  }
  void expect(const char* key) {
    const std::string w = word();
    fail_unless(w == key, std::string("expected '") + key + "', got '" + w + "'");
  }
  int64_t integer(int64_t min, int64_t max) {
    const std::string w = word();
    try {
      return cli::parse_int("value", w, min, max);
    } catch (const cli::UsageError& e) {
      fail_unless(false, e.what());
    }
    return 0;
  }
  double number() {
    const std::string w = word();
    try {
      return cli::parse_double("value", w);
    } catch (const cli::UsageError& e) {
      fail_unless(false, e.what());
    }
    return 0;
  }
  // A line `key N` (N in [min, kMaxCount]): how many entries follow.
  int64_t count(const char* key, int64_t min) {
    next(key);
    const int64_t n = integer(min, kMaxCount);
    done();
    return n;
  }
  // The next line starts `key i`: entry i of `count` (`what`, numbered from 0).
  void entry(const char* key, int64_t i, int64_t count, const char* what) {
    next(key);
    fail_unless(integer(0, kMaxCount) == i, std::string(what) + " must be numbered 0.." + std::to_string(count - 1));
  }
  void done() { fail_unless(at_ == tokens_.size(), "unexpected '" + (at_ < tokens_.size() ? tokens_[at_] : "") + "'"); }
  void fail_unless(bool ok, const std::string& what) const {
    TORCH_CHECK(ok, "ferry: checkpoint manifest ", path_, " line ", line_, ": ", what);
  }
  int line() const { return line_; }

 private:
  std::string path_;
  std::ifstream in_;
  std::vector<std::string> tokens_;
  size_t at_ = 0;
  int line_ = 0;
};

Manifest parse_manifest(const std::string& path) {
  ManifestReader r(path);
  Manifest m;
  r.next(kMagic);
  m.version = static_cast<int>(r.integer(1, 1'000'000));
  r.fail_unless(m.version <= kVersion, "this ferry reads checkpoint versions 1 to " + std::to_string(kVersion) +
                                          ", got " + std::to_string(m.version));
  r.done();
  if (m.version >= 2) {
    r.next("generation");
    m.generation = r.integer(0, int64_t{999'999'999'999'999});
    r.done();
  }
  r.next("precision");
  m.precision = r.word();
  r.fail_unless(m.precision == "Float" || m.precision == "BFloat16" || m.precision == "Half",
                "expected precision Float, BFloat16 or Half, got '" + m.precision + "'");
  r.done();
  if (m.version >= 4) {
    r.next("state_format");
    m.state_format = r.word();
    r.fail_unless(m.state_format == "fp32" || m.state_format == "compact",
                  "expected state_format fp32 or compact, got '" + m.state_format + "'");
    r.done();
  }
  const int64_t count = r.count("params", 0);
  for (int64_t i = 0; i < count; ++i) {
    r.entry("param", i, count, "parameters");
    Manifest::Param p;
    p.numel = r.integer(0, kMaxNumel);
    const int64_t ndim = r.integer(0, kMaxDims);
    int64_t product = 1;
    for (int64_t d = 0; d < ndim; ++d) {
      p.shape.push_back(r.integer(0, kMaxDim));
      r.fail_unless(p.shape.back() == 0 || product <= kMaxNumel / p.shape.back(), "shape too large");
      product *= p.shape.back();
    }
    r.fail_unless(product == p.numel, "numel " + std::to_string(p.numel) + " is not the product of the shape (" +
                                          std::to_string(product) + ")");
    p.name = r.word();
    r.done();
    m.total_numel += p.numel;
    r.fail_unless(m.total_numel <= kMaxNumel, "too many elements in total");
    m.params.push_back(std::move(p));
  }
  const int64_t groups = r.count("groups", 1);
  for (int64_t i = 0; i < groups; ++i) {
    r.entry("group", i, groups, "groups");
    Manifest::Group g;
    r.expect("step");
    g.step = r.integer(0, std::numeric_limits<int64_t>::max());
    r.expect("lr");
    g.options.lr = r.number();
    r.expect("beta1");
    g.options.beta1 = r.number();
    r.expect("beta2");
    g.options.beta2 = r.number();
    r.expect("eps");
    g.options.eps = r.number();
    r.expect("weight_decay");
    g.options.weight_decay = r.number();
    r.expect("mode");
    const std::string mode = r.word();
    r.fail_unless(mode == "adam" || mode == "adamw", "expected mode adam or adamw, got '" + mode + "'");
    g.options.mode = mode == "adam" ? AdamMode::kAdam : AdamMode::kAdamW;
    r.done();
    g.options.validate();
    m.groups.push_back(g);
  }
  if (m.version >= 3) {
    r.next("param_steps");
    const int64_t listed = r.integer(0, count);
    r.done();
    for (int64_t i = 0; i < listed; ++i) {
      r.next("param_step");
      const int64_t p = r.integer(0, std::max<int64_t>(count - 1, 0));
      r.fail_unless(m.param_steps.empty() || p > m.param_steps.back().first,
                    "parameters must be listed in increasing order");
      const int64_t step = r.integer(0, std::numeric_limits<int64_t>::max());
      r.done();
      m.param_steps.emplace_back(p, step);
    }
  }
  r.next("loss_scaler");
  r.expect("scale");
  m.scaler.scale = r.number();
  r.expect("clean_steps");
  m.scaler.clean_steps = r.integer(0, std::numeric_limits<int64_t>::max());
  r.expect("hysteresis_left");
  m.scaler.hysteresis_left = static_cast<int>(r.integer(0, 1'000'000));
  r.expect("overflows");
  m.scaler.overflows = r.integer(0, std::numeric_limits<int64_t>::max());
  r.done();
  if (m.version == 1) {
    for (int k = 0; k < 3; ++k) m.files[k].name = std::string(kRoleNames[k]) + ".f32";
    return m;
  }
  for (int k = 0; k < 3; ++k) {
    r.next("file");
    const std::string role = r.word();
    r.fail_unless(role == kRoleNames[k], std::string("expected the ") + kRoleNames[k] + " file, got '" + role + "'");
    Manifest::File& f = m.files[k];
    f.name = r.word();
    r.fail_unless(f.name == data_file_name(k, m.generation), "expected file name " + data_file_name(k, m.generation) +
                                                                 ", got '" + f.name + "'");
    r.expect("bytes");
    f.bytes = r.integer(0, kMaxNumel * 4);
    r.fail_unless(f.bytes == m.total_numel * 4, "file " + f.name + " is listed with " + std::to_string(f.bytes) +
                                                    " bytes, the parameters need " + std::to_string(m.total_numel * 4));
    r.expect("crc32c");
    const std::string hex = r.word();
    r.fail_unless(hex.size() == 8 && hex.find_first_not_of("0123456789abcdef") == std::string::npos,
                  "expected 8 lowercase hex digits of CRC-32C, got '" + hex + "'");
    f.crc = static_cast<uint32_t>(std::stoul(hex, nullptr, 16));
    f.has_crc = true;
    r.done();
  }
  r.next("end");
  r.done();
  r.fail_unless(r.at_eof(), "text after 'end'");
  return m;
}

// Steps 1 and 2 of a load: the manifest, names, shapes, group count and file sizes against the model,
// then one read of every file for its checksum and finite values. Changes nothing; throws on the first
// problem. `scaler`: the optimizer's loss scaler when it scales (its saved state is validated too).
Manifest verify_checkpoint(const std::string& dir, const ChunkedModel& model, const std::vector<int>& group_of_param,
                           int num_groups, const DynamicLossScaler* scaler) {
  const Manifest m = parse_manifest(join_path(dir, "manifest.txt"));

  // 1. Check everything before changing anything.
  TORCH_CHECK(static_cast<int64_t>(m.params.size()) == model.num_params(), "ferry: checkpoint ", dir, " has ",
              m.params.size(), " parameters, this model ", model.num_params());
  for (int64_t p = 0; p < model.num_params(); ++p) {
    const auto& want = model.param_shapes()[p];
    TORCH_CHECK(m.params[p].shape == want && m.params[p].name == model.param_name(p), "ferry: checkpoint ", dir,
                " parameter ", p, " is ", m.params[p].name, " ", c10::IntArrayRef(m.params[p].shape),
                ", this model has ", model.param_name(p), " ", c10::IntArrayRef(want));
  }
  TORCH_CHECK(static_cast<int>(m.groups.size()) == num_groups, "ferry: checkpoint ", dir, " has ",
              m.groups.size(), " param groups, this optimizer ", num_groups);
  for (const auto& [p, step] : m.param_steps) {
    const int g = group_of_param[p];
    TORCH_CHECK(step < m.groups[g].step, "ferry: checkpoint ", dir, " gives parameter ", m.params[p].name, " ", step,
                " updates, not fewer than its group's ", m.groups[g].step, " steps (group ", g, " of this optimizer; a "
                "parameter at its group's count is not listed): were the parameters grouped differently?");
  }
  const int64_t want_bytes = m.total_numel * static_cast<int64_t>(sizeof(float));
  for (const auto& f : m.files) {
    const int64_t size = file_size(join_path(dir, f.name));
    TORCH_CHECK(size == want_bytes, "ferry: checkpoint file ", join_path(dir, f.name),
                size < 0 ? " is missing" : " has " + std::to_string(size) + " bytes", ", expected ", want_bytes,
                " bytes");
  }
  if (scaler) {
    DynamicLossScaler probe(scaler->options());
    probe.set_state(m.scaler);  // validates
  }
  if (m.version == 1) {
    log::warn("ferry: checkpoint ", dir, " is version 1: it has no checksums, so corruption cannot be detected");
  }
  // 2. Read every file once: checksum, and values that training can use.
  {
    std::vector<float> block(kBlockFloats);
    for (int r = 0; r < 3; ++r) {
      const std::string path = join_path(dir, m.files[r].name);
      std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
      TORCH_CHECK(f, "ferry: cannot open ", path, ": ", errno_text());
      uint32_t crc = 0;
      for (int64_t done = 0; done < m.total_numel;) {
        const size_t n = static_cast<size_t>(std::min<int64_t>(kBlockFloats, m.total_numel - done));
        TORCH_CHECK(std::fread(block.data(), sizeof(float), n, f.get()) == n, "ferry: reading ", path, " failed");
        crc = crc32c_extend(crc, block.data(), n * sizeof(float));
        const int64_t bad = first_bad_value(block.data(), static_cast<int64_t>(n), /*exp_avg_sq*/ r == 2);
        if (bad >= 0) {
          int64_t at = done + bad;  // which parameter holds element `at`
          int64_t p = 0;
          while (p + 1 < static_cast<int64_t>(m.params.size()) && at >= m.params[p].numel) at -= m.params[p++].numel;
          TORCH_CHECK(false, "ferry: checkpoint file ", path, " holds ", block[bad], " in ", kRoleNames[r],
                      " of parameter ", m.params[p].name, " (element ", at, "); nothing was loaded");
        }
        done += static_cast<int64_t>(n);
      }
      TORCH_CHECK(!m.files[r].has_crc || crc == m.files[r].crc, "ferry: checkpoint file ", path,
                  " is corrupt: CRC-32C ", crc32c_hex(crc), ", the manifest says ", crc32c_hex(m.files[r].crc),
                  "; nothing was loaded");
    }
  }
  if (m.precision != c10::toString(model.compute_dtype())) {
    log::warn("ferry: checkpoint ", dir, " was saved with compute dtype ", m.precision, ", loading into ",
              c10::toString(model.compute_dtype()), " (the fp32 masters are exact; parameters are re-cast)");
  }
  return m;
}

}  // namespace

void check_checkpoint_target(const std::string& dir) {
  TORCH_CHECK(!dir.empty(), "ferry: the checkpoint directory is empty; name a directory to save into");
  make_dirs(dir);
  const std::string probe = join_path(dir, ".ferry-write-test." + std::to_string(::getpid()));
  {
    DurableFile f(probe);
    f.write("ok", 2);
    f.sync_and_close();
  }
  TORCH_CHECK(::unlink(probe.c_str()) == 0, "ferry: cannot remove ", probe, ": ", errno_text());
}

namespace {

std::string manifest_text(const ChunkedModel& model, const StateValues& state, const std::vector<int>& group_of_param,
                          const CheckpointCounters& counters, int64_t generation, const std::string& file_lines) {
  std::ostringstream m;
  m << std::setprecision(17) << kMagic << " " << kVersion << "\n";
  m << "generation " << generation << "\n";
  m << "precision " << c10::toString(model.compute_dtype()) << "\n";
  m << "state_format " << (state.compact() ? "compact" : "fp32") << "\n";
  m << "params " << model.num_params() << "\n";
  for (int64_t p = 0; p < model.num_params(); ++p) {
    const auto& shape = model.param_shapes()[p];
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    m << "param " << p << " " << numel << " " << shape.size();
    for (int64_t d : shape) m << " " << d;
    m << " " << model.param_name(p) << "\n";
  }
  const int groups = static_cast<int>(counters.options.size());
  m << "groups " << groups << "\n";
  for (int g = 0; g < groups; ++g) {
    const AdamOptions& o = counters.options[g];
    m << "group " << g << " step " << counters.steps[g] << " lr " << o.lr << " beta1 " << o.beta1 << " beta2 "
      << o.beta2 << " eps " << o.eps << " weight_decay " << o.weight_decay << " mode "
      << (o.mode == AdamMode::kAdam ? "adam" : "adamw") << "\n";
  }
  int64_t lagging = 0;
  for (int64_t lag : counters.lags) lagging += lag != 0;
  m << "param_steps " << lagging << "\n";
  for (int64_t p = 0; p < model.num_params(); ++p) {
    if (counters.lags[p] != 0) m << "param_step " << p << " " << counters.steps[group_of_param[p]] - counters.lags[p] << "\n";
  }
  const LossScalerState& s = counters.scaler;
  m << "loss_scaler scale " << s.scale << " clean_steps " << s.clean_steps << " hysteresis_left "
    << s.hysteresis_left << " overflows " << s.overflows << "\n";
  m << file_lines << "end\n";
  return m.str();
}

// Writes the manifest over the previous one (`written`: the files to remove if it fails), then removes
// the previous generation's files.
void publish_checkpoint(const std::string& dir, int64_t generation, const std::string& text,
                        std::vector<std::string>& written) {
  const std::string manifest_tmp = join_path(dir, "manifest.tmp." + std::to_string(generation));
  written.push_back(manifest_tmp);
  DurableFile f(manifest_tmp);
  f.write(text.data(), text.size());
  f.sync_and_close();
  // The switch: atomic on POSIX file systems; durable once the directory is synced.
  TORCH_CHECK(::rename(manifest_tmp.c_str(), join_path(dir, "manifest.txt").c_str()) == 0,
              "ferry: cannot rename the manifest in ", dir, ": ", errno_text());
  written.pop_back();
  fsync_dir(dir);
  written.clear();  // the new checkpoint stands: nothing to undo from here
  // The previous generations (and leftovers of interrupted saves) are garbage now.
  for (const std::string& name : list_dir(dir)) {
    const int64_t g = generation_of(name);
    const bool stale_v1 = name == "master.f32" || name == "exp_avg.f32" || name == "exp_avg_sq.f32";
    const bool stale_tmp = name.rfind("manifest.tmp", 0) == 0;
    if ((g >= 0 && g != generation) || stale_v1 || stale_tmp) {
      if (::unlink(join_path(dir, name).c_str()) != 0) {
        log::warn("ferry: cannot remove the stale checkpoint file ", join_path(dir, name), ": ", errno_text());
      }
    }
  }
}

}  // namespace

void save_checkpoint(const std::string& dir, const ChunkedModel& model, StateValues& state,
                     const std::vector<int>& group_of_param, const CheckpointCounters& counters) {
  make_dirs(dir);
  const int64_t generation = next_generation(dir);
  std::vector<std::string> written;
  int64_t bytes = 0;
  try {
    std::ostringstream files;
    for (int r = 0; r < 3; ++r) {
      const std::string name = data_file_name(r, generation);
      written.push_back(join_path(dir, name));
      DurableFile f(written.back());
      uint32_t crc = 0;
      int64_t role_bytes = 0;
      for (int64_t p = 0; p < model.num_params(); ++p) {
        // One parameter at a time: at most one slot is ever copied off the device.
        const at::Tensor t = savable(state.read(r, p), r, r == kExpAvgSqRole, model.param_name(p));
        const float* x = t.data_ptr<float>();
        const size_t n = static_cast<size_t>(t.numel()) * sizeof(float);
        crc = crc32c_extend(crc, x, n);
        f.write(x, n);
        role_bytes += static_cast<int64_t>(n);
      }
      f.sync_and_close();
      bytes += role_bytes;
      files << "file " << kRoleNames[r] << " " << name << " bytes " << role_bytes << " crc32c " << crc32c_hex(crc) << "\n";
    }
    publish_checkpoint(dir, generation, manifest_text(model, state, group_of_param, counters, generation, files.str()),
                       written);
  } catch (...) {
    for (const std::string& path : written) ::unlink(path.c_str());  // best effort; the old checkpoint stands
    throw;
  }
  log::info("ferry: saved training state (step ", counters.steps[0], ", ", format_bytes(bytes), ") to ", dir);
}

void save_checkpoint_across_ranks(const std::string& dir, const ChunkedModel& model, StateValues& state,
                                  const std::vector<int>& group_of_param, const CheckpointCounters& counters,
                                  const Ownership& ownership, dist::Communicator& comm) {
  const int world = ownership.world(), rank = ownership.rank();
  // The same files as one process's save. Rank 0 creates them; then every rank writes the parameters of
  // the chunks it owns at their offsets (pwrite, in parallel) and the CRC-32C of what it wrote. Rank 0
  // reads the files back once: the whole-file CRCs for the manifest, and per rank the CRC of its part,
  // which must equal the writer's, or the directory is not one directory shared by every rank.
  const int64_t np = model.num_params();
  std::vector<int64_t> offset(np + 1, 0);
  std::vector<int> owner(np);
  for (int64_t p = 0; p < np; ++p) {
    offset[p + 1] = offset[p] + model.layout().slots()[p].numel;
    owner[p] = ownership.owner(model.layout().slots()[p].chunk);
  }
  const int64_t bytes = offset[np] * static_cast<int64_t>(sizeof(float));
  std::string error;  // this rank's
  int64_t generation = 0;
  std::vector<std::string> paths;
  if (rank == 0) {
    try {
      make_dirs(dir);
      generation = next_generation(dir);
      for (int r = 0; r < 3; ++r) {
        DurableFile f(join_path(dir, data_file_name(r, generation)));
        f.truncate(bytes);
        f.sync_and_close();
      }
    } catch (const std::exception& e) {
      error = cli::message_of(e);
    }
  }
  at::Tensor created = at::tensor({static_cast<double>(generation), error.empty() ? 0.0 : 1.0}, at::kDouble);
  comm.broadcast(created, 0);
  generation = static_cast<int64_t>(created[0].item<double>());
  for (int r = 0; r < 3; ++r) paths.push_back(join_path(dir, data_file_name(r, generation)));
  auto fail_all = [&](const std::string& why) {
    if (rank == 0) {
      for (const std::string& path : paths) ::unlink(path.c_str());  // best effort; the old checkpoint stands
    }
    TORCH_CHECK(false, "ferry: rank ", rank, ": saving ", dir, " failed: ", why,
                "; the directory keeps its previous checkpoint");
  };
  if (created[1].item<double>() != 0.0) fail_all(rank == 0 ? error : "rank 0 could not create the files (its log says why)");
  // Every rank: its parts, and their CRCs (model order within the rank's parameters).
  std::vector<uint32_t> mine(3, 0);
  try {
    for (int r = 0; r < 3; ++r) {
      DurableFile f(paths[r], /*existing=*/true);
      for (int64_t p = 0; p < np; ++p) {
        if (owner[p] != rank) continue;
        const at::Tensor t = savable(state.read(r, p), r, r == kExpAvgSqRole, model.param_name(p));
        const float* x = t.data_ptr<float>();
        const size_t n = static_cast<size_t>(t.numel()) * sizeof(float);
        f.write_at(offset[p] * static_cast<int64_t>(sizeof(float)), x, n);
        mine[r] = crc32c_extend(mine[r], x, n);
      }
      f.sync_and_close();
    }
  } catch (const std::exception& e) {
    error = cli::message_of(e);
  }
  at::Tensor report = at::tensor({error.empty() ? 0.0 : 1.0, static_cast<double>(mine[0]), static_cast<double>(mine[1]),
                                  static_cast<double>(mine[2])}, at::kDouble);
  at::Tensor reports = at::empty({world * 4}, at::kDouble);
  comm.all_gather(reports, report);
  // Each parameter's lag from the rank that owns its state (D62); the others add zero.
  at::Tensor lags = at::zeros({np}, at::kDouble);  // exact up to 2^53 steps
  for (int64_t p = 0; p < np; ++p) {
    if (owner[p] == rank) lags.data_ptr<double>()[p] = static_cast<double>(counters.lags[p]);
  }
  comm.all_reduce(lags, dist::ReduceOp::kSum);
  for (int k = 0; k < world; ++k) {
    if (reports[k * 4].item<double>() != 0.0) {
      fail_all(k == rank ? error : "rank " + std::to_string(k) + " could not write its part (its log says why)");
    }
  }
  // Rank 0: one read of each file, the manifest, and the word to every rank.
  if (rank == 0) {
    try {
      std::ostringstream lines;
      std::vector<float> block(kBlockFloats);
      for (int r = 0; r < 3; ++r) {
        std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(paths[r].c_str(), "rb"), &std::fclose);
        TORCH_CHECK(f, "cannot open ", paths[r], ": ", errno_text());
        uint32_t whole = 0;
        std::vector<uint32_t> part(world, 0);
        for (int64_t p = 0; p < np; ++p) {
          for (int64_t done = offset[p]; done < offset[p + 1];) {
            const int64_t n = std::min<int64_t>(kBlockFloats, offset[p + 1] - done);
            const size_t nb = static_cast<size_t>(n) * sizeof(float);
            TORCH_CHECK(std::fread(block.data(), 1, nb, f.get()) == nb, "reading back ", paths[r], " failed");
            whole = crc32c_extend(whole, block.data(), nb);
            part[owner[p]] = crc32c_extend(part[owner[p]], block.data(), nb);
            done += n;
          }
        }
        for (int k = 0; k < world; ++k) {
          const auto wrote = static_cast<uint32_t>(reports[k * 4 + 1 + r].item<double>());
          TORCH_CHECK(part[k] == wrote, "rank ", k, "'s part of ", paths[r], " reads back with CRC-32C ",
                      crc32c_hex(part[k]), ", it wrote ", crc32c_hex(wrote), ": every rank must write into the same "
                      "directory (one host, or a file system shared by all ranks)");
        }
        lines << "file " << kRoleNames[r] << " " << data_file_name(r, generation) << " bytes " << bytes << " crc32c "
              << crc32c_hex(whole) << "\n";
      }
      CheckpointCounters all = counters;
      for (int64_t p = 0; p < np; ++p) all.lags[p] = static_cast<int64_t>(lags.data_ptr<double>()[p]);
      publish_checkpoint(dir, generation, manifest_text(model, state, group_of_param, all, generation, lines.str()), paths);
    } catch (const std::exception& e) {
      error = cli::message_of(e);
    }
  }
  at::Tensor failed = at::full({1}, error.empty() ? 0.0f : 1.0f, at::kFloat);
  comm.broadcast(failed, 0);
  if (failed.item<float>() != 0.0f) {
    fail_all(rank == 0 ? error : "on rank 0, which checks and publishes it (its log says why)");
  }
  log::info("ferry: saved training state (step ", counters.steps[0], ", ", world, " ranks, each writing its "
            "part) to ", dir);
}


CheckpointCounters load_checkpoint(const std::string& dir, const ChunkedModel& model, StateValues& state,
                                   const std::vector<int>& group_of_param, int num_groups,
                                   const DynamicLossScaler* scaler, const Ownership& ownership,
                                   dist::Communicator* comm) {
  // Every rank reads the checkpoint (it must see the directory: one host, or a shared file system) and
  // checks it; all ranks agree before any writes a value, so either every rank loads or none does.
  Manifest m;
  std::string error;
  const int world = ownership.world(), rank = ownership.rank();
  try {
    m = verify_checkpoint(dir, model, group_of_param, num_groups, scaler);
  } catch (const std::exception& e) {
    if (world == 1) throw;
    error = cli::message_of(e);
  }
  if (world > 1) {
    at::Tensor failed = at::full({1}, error.empty() ? 0.0f : static_cast<float>(rank + 1), at::kFloat);
    comm->all_reduce(failed, dist::ReduceOp::kMax);
    const int bad_rank = static_cast<int>(failed.item<float>()) - 1;
    TORCH_CHECK(bad_rank < 0, "ferry: rank ", rank, ": loading ", dir, " failed",
                error.empty() ? " on rank " + std::to_string(bad_rank) + " (its log says why)" : ": " + error,
                "; nothing was loaded on any rank");
  }
  // The files hold fp32 values in either format (StateValues): another format's converts as it loads.
  const std::string format = state.compact() ? "compact" : "fp32";
  if (m.state_format != format) {
    log::warn("ferry: checkpoint ", dir, " holds ", m.state_format, " optimizer state; loading it into ", format,
              " state converts it", format == "compact" ? " (rounded as the compact format stores it)" : " (exactly)");
  }
  // 3. Copy the values in: the state this rank holds (every chunk group before sharding, its own after).
  for (int r = 0; r < 3; ++r) {
    const std::string path = join_path(dir, m.files[r].name);
    std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
    TORCH_CHECK(f, "ferry: cannot open ", path, ": ", errno_text());
    for (int64_t p = 0; p < model.num_params(); ++p) {
      const int64_t n = m.params[p].numel;
      if (!state.state().held(r, model.layout().slots()[p].chunk)) {
        TORCH_CHECK(std::fseek(f.get(), static_cast<long>(n * sizeof(float)), SEEK_CUR) == 0, "ferry: seeking in ",
                    path, " failed");
        continue;
      }
      at::Tensor host = at::empty({n}, at::kFloat);
      TORCH_CHECK(std::fread(host.data_ptr<float>(), sizeof(float), static_cast<size_t>(n), f.get()) ==
                      static_cast<size_t>(n),
                  "ferry: reading ", path, " failed (it changed while loading?)");
      state.write(r, p, host);
    }
  }
  CheckpointCounters counters;
  for (const Manifest::Group& g : m.groups) {
    counters.options.push_back(g.options);
    counters.steps.push_back(g.step);
  }
  counters.lags.assign(model.num_params(), 0);
  for (const auto& [p, step] : m.param_steps) counters.lags[p] = m.groups[group_of_param[p]].step - step;
  counters.scaler = m.scaler;
  return counters;
}

}  // namespace ferry::optim
