#pragma once
// A LLaMA-architecture decoder (LlamaForCausalLM's shapes and names) as an ordinary torch::nn::Module:
// nothing in it knows about ferry.
//
//   tokens [B, T] (int64) -> logits [B, T, vocab]
//   x = embed_tokens(tokens); per layer: x += o_proj(attn(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))
//   with n = input_layernorm(x); x += down_proj(silu(gate_proj(m)) * up_proj(m)) with
//   m = post_attention_layernorm(x); logits = lm_head(norm(x)) (or norm(x) embed_tokens^T when tied)
//
// RMSNorm in fp32 (then the weight in the input's dtype), rotary position embeddings over the whole head
// ("default" or "llama3" frequencies), grouped-query attention (num_key_value_heads divides
// num_attention_heads; 1 = multi-query), causal, no biases unless the config asks for them. Each op is
// the one transformers' modeling_llama.py runs, in the same dtype, so fp32 logits agree to rounding.
//
// The parameters are named as a Hugging Face checkpoint names them ("model.layers.0.self_attn.q_proj.
// weight", "lm_head.weight"), so a folder loads with no name map. The rotary frequencies are computed in
// forward, not buffers: a checkpoint holds none.
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace llama {

struct LlamaConfig {
  std::string name = "custom";
  int64_t vocab = 32000;
  int64_t hidden = 4096;
  int64_t intermediate = 11008;
  int64_t layers = 32;
  int64_t heads = 32;
  int64_t kv_heads = 32;
  int64_t head_dim = 0;  // 0: hidden / heads
  int64_t max_positions = 4096;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  // "default" or "llama3" (then the four numbers below, as config.json's rope_scaling gives them).
  std::string rope_type = "default";
  double rope_factor = 1.0, rope_low_freq_factor = 1.0, rope_high_freq_factor = 4.0;
  int64_t rope_original_max_positions = 8192;
  bool tie_embeddings = false;
  bool attention_bias = false, mlp_bias = false;
  std::string dtype = "bfloat16";  // the checkpoint's (config.json "dtype" or "torch_dtype")

  int64_t head_size() const { return head_dim ? head_dim : hidden / heads; }
  int64_t num_params() const;
  // Multiply-accumulate FLOPs of one forward per token (2 per MAC): matrices and attention scores.
  double forward_flops_per_token(int64_t seq_len) const;
  // Fails naming the field and its value.
  void validate() const;
  // The rotary inverse frequencies [head_size / 2], fp32, as transformers computes them.
  at::Tensor rope_inv_freq() const;

  // A Hugging Face config.json (transformers 4 or 5 spelling). Refuses what this model is not: another
  // model_type, an activation other than silu, a rope_type other than default/llama3, naming it.
  static LlamaConfig from_json(const std::string& text, const std::string& what);
  static LlamaConfig from_folder(const std::string& dir);  // DIR/config.json
  // config.json that transformers' LlamaForCausalLM loads.
  std::string to_json() const;
};

// tinyllama-1.1b, llama2-7b, llama3-8b, llama2-13b (the published shapes) and tiny. Unknown: an error
// listing them.
LlamaConfig preset(const std::string& name);
std::vector<std::string> preset_names();

struct RmsNormImpl : torch::nn::Module {
  RmsNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  double eps;
  torch::Tensor weight;
};
TORCH_MODULE(RmsNorm);

struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(const LlamaConfig& c);
  // cos, sin: [T, head_size] in x's dtype.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  int64_t heads, kv_heads, head_size;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
};
TORCH_MODULE(Attention);

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const LlamaConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(Mlp);

struct DecoderLayerImpl : torch::nn::Module {
  explicit DecoderLayerImpl(const LlamaConfig& c);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  Attention self_attn{nullptr};
  Mlp mlp{nullptr};
  RmsNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
TORCH_MODULE(DecoderLayer);

// transformers' LlamaModel: the embedding, the layers, the final norm.
struct LlamaModelImpl : torch::nn::Module {
  explicit LlamaModelImpl(const LlamaConfig& c);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RmsNorm norm{nullptr};
};
TORCH_MODULE(LlamaModel);

// transformers' LlamaForCausalLM.
struct LlamaImpl : torch::nn::Module {
  explicit LlamaImpl(const LlamaConfig& c);
  torch::Tensor forward(const torch::Tensor& tokens);
  // Mean next-token cross entropy of logits [B, T, V] against targets [B, T], in fp32.
  static torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets);

  LlamaConfig config;
  LlamaModel model{nullptr};
  torch::nn::Linear lm_head{nullptr};  // null when tied to model.embed_tokens
  // How each layer is called (activation checkpointing); default: layer->forward(x, cos, sin).
  std::function<torch::Tensor(DecoderLayer&, const torch::Tensor& x, const torch::Tensor& cos,
                              const torch::Tensor& sin)>
      run_layer;
};
TORCH_MODULE(Llama);

}  // namespace llama
