#include "gpt.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>
#include <c10/util/Exception.h>

#include <map>
#include <mutex>
#include <sstream>

namespace gpt {

int64_t GptConfig::num_params() const {
  const int64_t h = hidden, m = mlp_width();
  const int64_t ln = 2 * h;
  const int64_t attn = h * 3 * h + 3 * h + h * h + h;
  const int64_t mlp = swiglu ? (2 * (h * m + m) + m * h + h) : (h * m + m + m * h + h);
  return vocab * h + seq * h + layers * (2 * ln + attn + mlp) + ln;
}

std::vector<int64_t> GptConfig::param_numels() const {
  const int64_t h = hidden, m = mlp_width();
  std::vector<int64_t> n{vocab * h, seq * h};
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t x : {h, h, 3 * h * h, 3 * h, h * h, h, h, h, h * m, m}) n.push_back(x);  // ln1 qkv proj ln2 fc
    if (swiglu) n.insert(n.end(), {h * m, m});                                              // gate
    n.insert(n.end(), {m * h, h});                                                          // out
  }
  n.insert(n.end(), {h, h});  // ln_f
  return n;
}

double GptConfig::forward_flops_per_token(int64_t seq_len) const {
  const double h = static_cast<double>(hidden), m = static_cast<double>(mlp_width());
  const double per_layer = 2.0 * (4 * h * h + (swiglu ? 3 : 2) * h * m) + 2.0 * 2.0 * seq_len * h;
  return layers * per_layer + 2.0 * h * vocab;
}

void GptConfig::validate() const {
  TORCH_CHECK(vocab > 0 && seq > 0 && hidden > 0 && layers > 0 && heads > 0 && mlp_width() > 0,
              "gpt: every size must be > 0, got vocab ", vocab, " seq ", seq, " hidden ", hidden, " layers ", layers,
              " heads ", heads, " mlp ", mlp_width());
  TORCH_CHECK(hidden % heads == 0, "gpt: hidden (", hidden, ") must be a multiple of heads (", heads, ")");
}

namespace {
const std::map<std::string, GptConfig>& presets() {
  static const std::map<std::string, GptConfig> table = [] {
    std::map<std::string, GptConfig> t;
    auto add = [&](const std::string& name, int64_t hidden, int64_t layers, int64_t heads, int64_t seq) {
      GptConfig c;
      c.name = name;
      c.hidden = hidden;
      c.layers = layers;
      c.heads = heads;
      c.seq = seq;
      t[name] = c;
    };
    add("tiny", 128, 4, 4, 128);        // the CPU demo: ~0.8M parameters
    add("small", 256, 6, 8, 256);       // ~4.8M
    add("medium", 768, 12, 12, 1024);   // GPT-2 small's shape
    add("1b", 2048, 20, 16, 1024);
    add("2b", 2560, 26, 16, 1024);
    add("4b", 2304, 64, 16, 1024);
    add("6b", 3072, 53, 16, 1024);
    add("8b", 3072, 72, 16, 1024);
    add("10b", 4096, 50, 16, 1024);
    add("12b", 4096, 60, 16, 1024);
    add("15b", 4096, 78, 16, 1024);
    add("20b", 8192, 25, 16, 1024);
    add("30b", 8192, 37, 16, 1024);
    GptConfig llama;
    llama.name = "llama7b";
    llama.hidden = 4096;
    llama.layers = 32;
    llama.heads = 32;
    llama.seq = 2048;
    llama.mlp_hidden = 11008;
    llama.swiglu = true;
    t["llama7b"] = llama;
    return t;
  }();
  return table;
}
}  // namespace

GptConfig preset(const std::string& name) {
  auto it = presets().find(name);
  if (it == presets().end()) {
    std::ostringstream names;
    for (const auto& n : preset_names()) names << " " << n;
    TORCH_CHECK(false, "gpt: unknown preset '", name, "'; known:", names.str());
  }
  return it->second;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, c] : presets()) names.push_back(name);
  return names;
}

namespace {

// N(mean, std) into `t` on every core: fixed blocks of 2^20 elements, each drawn by its own generator
// seeded from (seed, block), so the values do not depend on the thread count; drawn in fp32 (the
// vectorized kernel) and rounded to t's dtype. torch's own normal_ runs on one thread, and in bf16
// (an InitScope build) about 6x slower than in fp32: minutes for a 12B model. (ferry's
// ParallelInitScope does the same for any module, but this model stands for a user's existing one and
// knows nothing of ferry, gpt.h; it keeps its own.)
void parallel_normal_(const at::Tensor& t, double mean, double std, uint64_t seed) {
  TORCH_CHECK(t.is_contiguous(), "gpt: parallel_normal_ needs a contiguous tensor");
  const at::Tensor flat = t.detach().view({-1});  // the workers' grad mode is their own
  constexpr int64_t kBlock = int64_t{1} << 20;
  const int64_t n = flat.numel(), blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(b + 1));
      at::Tensor part = flat.narrow(0, b * kBlock, std::min(kBlock, n - b * kBlock));
      if (part.scalar_type() == at::kFloat) {
        part.normal_(mean, std, gen);
      } else {
        part.copy_(at::empty({part.numel()}, at::kFloat).normal_(mean, std, gen));
      }
    }
  });
}

}  // namespace

BlockImpl::BlockImpl(const GptConfig& c) : heads(c.heads), swiglu(c.swiglu) {
  const int64_t h = c.hidden, m = c.mlp_width();
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({h})));
  qkv = register_module("qkv", torch::nn::Linear(h, 3 * h));
  proj = register_module("proj", torch::nn::Linear(h, h));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({h})));
  fc = register_module("fc", torch::nn::Linear(h, m));
  if (swiglu) gate = register_module("gate", torch::nn::Linear(h, m));
  out = register_module("out", torch::nn::Linear(m, h));
}

namespace {

// Note [Linear on 3-d inputs]: LibTorch's nn::Linear::forward (torch::nn::functional::linear) runs a
// 3-d input as matmul followed by a separate in-place bias add, where Python's F.linear calls
// aten::linear, which folds the batch into one addmm with the bias fused (and its backward needs no
// separate pass for the bias add). Measured with bench_gpt --profile against the Python peer
// (benchmarks/profile_compare.py): that difference made the C++ baseline's forward slower than
// Python's. The blocks call aten::linear on the modules' own parameters.
torch::Tensor linear(const torch::nn::Linear& l, const torch::Tensor& x) { return at::linear(x, l->weight, l->bias); }

}  // namespace

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / heads;
  auto qkv_out = linear(qkv, ln1(x)).view({B, T, 3, heads, hd}).permute({2, 0, 3, 1, 4});  // [3, B, H, T, hd]
  auto y = at::scaled_dot_product_attention(qkv_out[0], qkv_out[1], qkv_out[2], /*attn_mask=*/{},
                                            /*dropout_p=*/0.0, /*is_causal=*/true);
  auto h = x + linear(proj, y.transpose(1, 2).reshape({B, T, C}));
  auto n = ln2(h);
  auto m = swiglu ? at::silu(linear(gate, n)) * linear(fc, n) : at::gelu(linear(fc, n), "tanh");
  return h + linear(out, m);
}

GptImpl::GptImpl(const GptConfig& c) : config(c) {
  c.validate();
  wte = register_module("wte", torch::nn::Embedding(c.vocab, c.hidden));
  wpe = register_module("wpe", torch::nn::Embedding(c.seq, c.hidden));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(Block(c));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden})));
  // GPT-2 initialization: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2L).
  torch::NoGradGuard no_grad;
  uint64_t seed = 0;
  {
    auto gen = at::detail::getDefaultCPUGenerator();  // torch::manual_seed still decides the values
    std::lock_guard<std::mutex> lock(gen.mutex());
    seed = gen.get<at::CPUGeneratorImpl>()->random64();
  }
  for (auto& p : named_parameters()) {
    const std::string& key = p.key();
    if (key.find("ln") != std::string::npos) continue;
    if (key.size() >= 4 && key.compare(key.size() - 4, 4, "bias") == 0) {
      p.value().zero_();
    } else {
      const bool residual = key.find("proj.weight") != std::string::npos || key.find("out.weight") != std::string::npos;
      parallel_normal_(p.value(), 0.0, residual ? 0.02 / std::sqrt(2.0 * c.layers) : 0.02, seed++ * 0x100000001B3ull);
    }
  }
}

torch::Tensor GptImpl::forward(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong, "gpt: tokens must be int64 [B, T], got ",
              tokens.toString(), " ", tokens.sizes());
  TORCH_CHECK(tokens.size(1) <= config.seq, "gpt: sequence length ", tokens.size(1), " exceeds the model's ",
              config.seq);
  auto pos = at::arange(tokens.size(1), tokens.options());
  auto x = wte(tokens) + wpe(pos);
  for (const auto& m : *blocks) {
    Block b(std::dynamic_pointer_cast<BlockImpl>(m));
    x = run_block ? run_block(b, x) : b->forward(x);
  }
  return at::matmul(ln_f(x), wte->weight.t());
}

torch::Tensor GptImpl::loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat), targets.reshape({-1}));
}

}  // namespace gpt
