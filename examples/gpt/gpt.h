#pragma once
// A GPT-2-style decoder as an ordinary torch::nn::Module: nothing in it knows about ferry.
//
//   tokens [B, T] (int64) -> logits [B, T, vocab]
//   x = wte(tokens) + wpe(0..T-1); per block: x += attn(ln1(x)); x += mlp(ln2(x)); logits = ln_f(x) wte^T
//
// The attention is causal (scaled_dot_product_attention); the MLP is GELU (4x) or, for LLaMA-like
// shapes, SwiGLU. The output projection is tied to the token embedding. `run_block` lets a caller wrap
// each block's call (activation checkpointing, profiling) without the model depending on who does it.
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace gpt {

struct GptConfig {
  std::string name = "custom";
  int64_t vocab = 256;      // byte level
  int64_t seq = 1024;       // maximum sequence length (position table)
  int64_t hidden = 768;
  int64_t layers = 12;
  int64_t heads = 12;
  int64_t mlp_hidden = 0;   // 0: 4 * hidden
  bool swiglu = false;      // LLaMA-style gated MLP (three matrices) instead of GELU

  int64_t mlp_width() const { return mlp_hidden ? mlp_hidden : 4 * hidden; }
  // Parameter count, computed from the shapes (the module's numel sum equals it).
  int64_t num_params() const;
  // Element counts of the module's parameters in registration order (named_parameters()), without
  // building it: for layouts of models too large to construct here.
  std::vector<int64_t> param_numels() const;
  // Multiply-accumulate FLOPs of one forward per token, matrices and attention scores (2 per MAC).
  double forward_flops_per_token(int64_t seq_len) const;
  void validate() const;
};

// Presets: tiny, small, medium, 1b, 2b, 4b, 6b, 8b, 10b, 12b, 15b, 20b, 30b, llama7b. Unknown name: error
// listing them.
GptConfig preset(const std::string& name);
std::vector<std::string> preset_names();

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const GptConfig& c);
  torch::Tensor forward(const torch::Tensor& x);

  int64_t heads;
  bool swiglu;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, gate{nullptr}, out{nullptr};
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  explicit GptImpl(const GptConfig& c);
  torch::Tensor forward(const torch::Tensor& tokens);
  // Mean next-token cross entropy of logits [B, T, V] against targets [B, T].
  static torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets);

  GptConfig config;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  // How each block is called; default: block->forward(x).
  std::function<torch::Tensor(Block&, const torch::Tensor&)> run_block;
};
TORCH_MODULE(Gpt);

}  // namespace gpt
