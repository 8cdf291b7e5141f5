// HybridAdam::save / load: the checkpoint directory format is documented in docs/CHECKPOINT.md.
//
// Plain POSIX file calls, no std::filesystem: libtorch.so (the PyPI wheel) exports its own
// std::filesystem symbols, which the dynamic linker binds first and which crash (ARCHITECTURE D21).
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <iomanip>
#include <memory>
#include <sstream>

#include "ferry/common/logging.h"
#include "ferry/cpu_adam/hybrid_adam.h"

namespace ferry {
namespace {

constexpr const char* kMagic = "ferry-checkpoint";
constexpr int kVersion = 1;
constexpr const char* kFiles[] = {"master.f32", "exp_avg.f32", "exp_avg_sq.f32"};

struct FileCloser {
  void operator()(std::FILE* f) const {
    if (f) std::fclose(f);
  }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

File open_file(const std::string& path, const char* mode) {
  File f(std::fopen(path.c_str(), mode));
  TORCH_CHECK(f, "ferry: cannot open ", path, " (", mode[0] == 'r' ? "read" : "write", "): ", std::strerror(errno));
  return f;
}

// mkdir -p.
void make_dirs(const std::string& dir) {
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos < dir.size() && dir[pos] != '/') continue;
    const std::string prefix = dir.substr(0, pos);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      TORCH_CHECK(false, "ferry: cannot create directory ", prefix, ": ", std::strerror(errno));
    }
  }
  struct stat st {};
  TORCH_CHECK(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "ferry: ", dir, " is not a directory");
}

// -1 if it does not exist.
int64_t file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

std::string join(const std::string& dir, const std::string& name) { return dir + "/" + name; }

struct Manifest {
  std::string precision;
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
  LossScalerState scaler;
};

std::string expect_word(std::istringstream& in, const std::string& word, int line) {
  std::string w;
  in >> w;
  TORCH_CHECK(w == word, "ferry: checkpoint manifest line ", line, ": expected '", word, "', got '", w, "'");
  return w;
}

Manifest parse_manifest(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in, "ferry: no checkpoint manifest at ", path);
  Manifest m;
  std::string text;
  int line_no = 0;
  auto next = [&]() -> std::istringstream {
    TORCH_CHECK(std::getline(in, text), "ferry: checkpoint manifest ", path, " ends early at line ",
                line_no + 1);
    ++line_no;
    return std::istringstream(text);
  };
  {
    auto l = next();
    std::string magic;
    int version = 0;
    l >> magic >> version;
    TORCH_CHECK(magic == kMagic && version == kVersion, "ferry: ", path, " is not a ferry checkpoint v",
                kVersion, " (first line: '", text, "')");
  }
  {
    auto l = next();
    expect_word(l, "precision", line_no);
    l >> m.precision;
  }
  int64_t count = 0;
  {
    auto l = next();
    expect_word(l, "params", line_no);
    l >> count;
    TORCH_CHECK(l && count >= 0, "ferry: bad parameter count in ", path);
  }
  for (int64_t i = 0; i < count; ++i) {
    auto l = next();
    expect_word(l, "param", line_no);
    int64_t index = -1, ndim = -1;
    Manifest::Param p;
    l >> index >> p.numel >> ndim;
    TORCH_CHECK(l && index == i && ndim >= 0, "ferry: bad param line ", line_no, " in ", path);
    p.shape.resize(ndim);
    for (auto& d : p.shape) l >> d;
    l >> p.name;
    TORCH_CHECK(l, "ferry: bad param line ", line_no, " in ", path);
    m.params.push_back(std::move(p));
  }
  {
    auto l = next();
    expect_word(l, "groups", line_no);
    l >> count;
    TORCH_CHECK(l && count >= 1, "ferry: bad group count in ", path);
  }
  for (int64_t i = 0; i < count; ++i) {
    auto l = next();
    expect_word(l, "group", line_no);
    int64_t index = -1;
    Manifest::Group g;
    std::string mode, k;
    l >> index;
    l >> k >> g.step >> k >> g.options.lr >> k >> g.options.beta1 >> k >> g.options.beta2 >> k >> g.options.eps >> k >>
        g.options.weight_decay >> k >> mode;
    TORCH_CHECK(l && index == i && g.step >= 0 && (mode == "adam" || mode == "adamw"), "ferry: bad group line ",
                line_no, " in ", path);
    g.options.mode = mode == "adam" ? AdamMode::kAdam : AdamMode::kAdamW;
    g.options.validate();
    m.groups.push_back(g);
  }
  {
    auto l = next();
    std::string k;
    expect_word(l, "loss_scaler", line_no);
    l >> k >> m.scaler.scale >> k >> m.scaler.clean_steps >> k >> m.scaler.hysteresis_left >> k >> m.scaler.overflows;
    TORCH_CHECK(l, "ferry: bad loss_scaler line ", line_no, " in ", path);
  }
  return m;
}

}  // namespace

void HybridAdam::save(const std::string& dir) {
  check_idle("save()");
  std::lock_guard<std::mutex> lock(mutex_);
  sync_layout_locked();
  TORCH_CHECK(!dir.empty(), "ferry: save() needs a directory");
  const std::string& root = dir;
  make_dirs(root);
  // The manifest goes last (written, then renamed): a directory without one is no checkpoint.
  ::unlink(join(root, "manifest.txt").c_str());
  int64_t bytes = 0;
  for (int r = 0; r < 3; ++r) {
    File f = open_file(join(root, kFiles[r]), "wb");
    for (int64_t p = 0; p < model_.num_params(); ++p) {
      // One parameter at a time: at most one slot is ever copied off the device.
      at::Tensor t = store_->view(roles_[r].tensors[p]).to(at::kCPU).contiguous();
      const size_t n = static_cast<size_t>(t.numel());
      TORCH_CHECK(std::fwrite(t.data_ptr<float>(), sizeof(float), n, f.get()) == n, "ferry: writing ",
                  join(root, kFiles[r]), " failed: ", std::strerror(errno));
      bytes += static_cast<int64_t>(n * sizeof(float));
    }
    TORCH_CHECK(std::fflush(f.get()) == 0, "ferry: writing ", join(root, kFiles[r]), " failed");
  }
  std::ostringstream m;
  m << std::setprecision(17) << kMagic << " " << kVersion << "\n";
  m << "precision " << c10::toString(model_.compute_dtype()) << "\n";
  m << "params " << model_.num_params() << "\n";
  for (int64_t p = 0; p < model_.num_params(); ++p) {
    const auto& shape = model_.param_shapes()[p];
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    m << "param " << p << " " << numel << " " << shape.size();
    for (int64_t d : shape) m << " " << d;
    m << " " << model_.param_name(p) << "\n";
  }
  m << "groups " << num_param_groups() << "\n";
  for (int g = 0; g < num_param_groups(); ++g) {
    const AdamOptions& o = cpu_adam_.options(g);
    m << "group " << g << " step " << cpu_adam_.step_count(g) << " lr " << o.lr << " beta1 " << o.beta1 << " beta2 "
      << o.beta2 << " eps " << o.eps << " weight_decay " << o.weight_decay << " mode "
      << (o.mode == AdamMode::kAdam ? "adam" : "adamw") << "\n";
  }
  const LossScalerState& s = scaler_.state();
  m << "loss_scaler scale " << s.scale << " clean_steps " << s.clean_steps << " hysteresis_left "
    << s.hysteresis_left << " overflows " << s.overflows << "\n";
  {
    std::ofstream out(join(root, "manifest.tmp"));
    out << m.str();
    out.close();
    TORCH_CHECK(out, "ferry: writing ", join(root, "manifest.tmp"), " failed");
  }
  TORCH_CHECK(::rename(join(root, "manifest.tmp").c_str(), join(root, "manifest.txt").c_str()) == 0,
              "ferry: cannot rename the manifest in ", root, ": ", std::strerror(errno));
  log::info("ferry: saved training state (step ", cpu_adam_.step_count(0), ", ", format_bytes(bytes), ") to ", dir);
}

void HybridAdam::load(const std::string& dir) {
  check_idle("load()");
  std::lock_guard<std::mutex> lock(mutex_);
  sync_layout_locked();
  const std::string& root = dir;
  const Manifest m = parse_manifest(join(root, "manifest.txt"));
  // Check everything before changing anything.
  TORCH_CHECK(static_cast<int64_t>(m.params.size()) == model_.num_params(), "ferry: checkpoint ", dir, " has ",
              m.params.size(), " parameters, this model ", model_.num_params());
  int64_t total = 0;
  for (int64_t p = 0; p < model_.num_params(); ++p) {
    const auto& want = model_.param_shapes()[p];
    TORCH_CHECK(m.params[p].shape == want && m.params[p].name == model_.param_name(p), "ferry: checkpoint ", dir,
                " parameter ", p, " is ", m.params[p].name, " ", c10::IntArrayRef(m.params[p].shape),
                ", this model has ", model_.param_name(p), " ", c10::IntArrayRef(want));
    total += m.params[p].numel;
  }
  TORCH_CHECK(static_cast<int>(m.groups.size()) == num_param_groups(), "ferry: checkpoint ", dir, " has ",
              m.groups.size(), " param groups, this optimizer ", num_param_groups());
  for (const char* name : kFiles) {
    const int64_t size = file_size(join(root, name));
    TORCH_CHECK(size == total * static_cast<int64_t>(sizeof(float)), "ferry: checkpoint file ", join(root, name),
                size < 0 ? " is missing" : " has " + std::to_string(size) + " bytes", ", expected ",
                total * sizeof(float), " bytes");
  }
  if (scaling_) {
    DynamicLossScaler probe(scaler_.options());
    probe.set_state(m.scaler);  // validates
  }
  if (m.precision != c10::toString(model_.compute_dtype())) {
    log::warn("ferry: checkpoint ", dir, " was saved with compute dtype ", m.precision, ", loading into ",
              c10::toString(model_.compute_dtype()), " (the fp32 masters are exact; parameters are re-cast)");
  }
  for (int r = 0; r < 3; ++r) {
    File f = open_file(join(root, kFiles[r]), "rb");
    for (int64_t p = 0; p < model_.num_params(); ++p) {
      at::Tensor host = at::empty({m.params[p].numel}, at::kFloat);
      const size_t n = static_cast<size_t>(host.numel());
      TORCH_CHECK(std::fread(host.data_ptr<float>(), sizeof(float), n, f.get()) == n, "ferry: reading ",
                  join(root, kFiles[r]), " failed");
      at::Tensor slot = store_->view(roles_[r].tensors[p]);
      slot.copy_(host.view(slot.sizes()));
    }
  }
  for (int g = 0; g < num_param_groups(); ++g) {
    cpu_adam_.set_options(g, m.groups[g].options);
    cpu_adam_.set_step_count(g, m.groups[g].step);
  }
  if (scaling_) {
    scaler_.set_state(m.scaler);
    model_.set_loss_scale(scaler_.scale());
  }
  for (ChunkId c : roles_[kGradRole].chunks) store_->payload(c).zero_();
  grads_landed_ = false;
  write_back_locked();
  log::info("ferry: resumed training state from ", dir, " at step ", cpu_adam_.step_count(0));
}

}  // namespace ferry
