#include "llama.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/where.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "../../common/json.h"

namespace llama {

int64_t LlamaConfig::num_params() const {
  const int64_t d = head_size(), q = heads * d, kv = kv_heads * d;
  int64_t layer = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * intermediate + 2 * hidden;
  if (attention_bias) layer += q + 2 * kv + hidden;
  if (mlp_bias) layer += 2 * intermediate + hidden;
  return vocab * hidden + layers * layer + hidden + (tie_embeddings ? 0 : vocab * hidden);
}

double LlamaConfig::forward_flops_per_token(int64_t seq_len) const {
  const double h = static_cast<double>(hidden), d = static_cast<double>(head_size());
  const double q = heads * d, kv = kv_heads * d, m = static_cast<double>(intermediate);
  const double per_layer = 2.0 * (h * q + 2 * h * kv + q * h + 3 * h * m) + 2.0 * 2.0 * seq_len * q;
  return layers * per_layer + 2.0 * h * vocab;
}

void LlamaConfig::validate() const {
  TORCH_CHECK(vocab > 0 && hidden > 0 && intermediate > 0 && layers > 0 && heads > 0 && kv_heads > 0 &&
                  max_positions > 0,
              "llama: every size must be > 0, got vocab_size ", vocab, " hidden_size ", hidden, " intermediate_size ",
              intermediate, " num_hidden_layers ", layers, " num_attention_heads ", heads, " num_key_value_heads ",
              kv_heads, " max_position_embeddings ", max_positions);
  TORCH_CHECK(head_dim > 0 || hidden % heads == 0, "llama: hidden_size (", hidden,
              ") must be a multiple of num_attention_heads (", heads, ") when head_dim is not given");
  TORCH_CHECK(head_size() % 2 == 0, "llama: the head size must be even for rotary embeddings, got ", head_size());
  TORCH_CHECK(heads % kv_heads == 0, "llama: num_key_value_heads (", kv_heads,
              ") must divide num_attention_heads (", heads, ")");
  TORCH_CHECK(rms_norm_eps > 0 && rope_theta > 0, "llama: rms_norm_eps and rope_theta must be > 0, got ",
              rms_norm_eps, " and ", rope_theta);
  TORCH_CHECK(rope_type == "default" || rope_type == "llama3", "llama: rope_type '", rope_type,
              "' is not supported (default, llama3)");
  if (rope_type == "llama3") {
    TORCH_CHECK(rope_factor > 0 && rope_low_freq_factor > 0 && rope_high_freq_factor > rope_low_freq_factor &&
                    rope_original_max_positions > 0,
                "llama: llama3 rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
                "original_max_position_embeddings > 0, got ",
                rope_factor, ", ", rope_low_freq_factor, ", ", rope_high_freq_factor, ", ", rope_original_max_positions);
  }
}

at::Tensor LlamaConfig::rope_inv_freq() const {
  // transformers: 1.0 / (base ** (arange(0, dim, 2, int64).float() / dim)), in fp32.
  const int64_t d = head_size();
  const at::Tensor exps = at::arange(0, d, 2, at::kLong).to(at::kFloat) / static_cast<double>(d);
  at::Tensor inv = at::pow(rope_theta, exps).reciprocal();
  if (rope_type == "llama3") {  // _compute_llama3_parameters, op for op
    const double old_len = static_cast<double>(rope_original_max_positions);
    const double low_wavelen = old_len / rope_low_freq_factor, high_wavelen = old_len / rope_high_freq_factor;
    const at::Tensor wavelen = inv.reciprocal() * (2 * M_PI);
    at::Tensor scaled = at::where(wavelen > low_wavelen, inv / rope_factor, inv);
    const at::Tensor smooth = (old_len / wavelen - rope_low_freq_factor) / (rope_high_freq_factor - rope_low_freq_factor);
    const at::Tensor smoothed = (1 - smooth) * scaled / rope_factor + smooth * scaled;
    const at::Tensor medium = (wavelen < high_wavelen).logical_not().logical_and((wavelen > low_wavelen).logical_not());
    inv = at::where(medium, smoothed, scaled);
  }
  return inv;
}

namespace {

int64_t int_field(const ferry::JsonValue& j, const std::string& key, const std::string& what, int64_t fallback,
                  bool required) {
  const ferry::JsonValue* v = j.find(key);
  if (v == nullptr || v->is_null()) {
    TORCH_CHECK(!required, "llama: ", what, " has no '", key, "'");
    return fallback;
  }
  return v->int64(what + " '" + key + "'");
}

double number_field(const ferry::JsonValue& j, const std::string& key, const std::string& what, double fallback) {
  const ferry::JsonValue* v = j.find(key);
  return v == nullptr || v->is_null() ? fallback : v->number(what + " '" + key + "'");
}

bool bool_field(const ferry::JsonValue& j, const std::string& key, const std::string& what, bool fallback) {
  const ferry::JsonValue* v = j.find(key);
  return v == nullptr || v->is_null() ? fallback : v->boolean(what + " '" + key + "'");
}

std::string string_field(const ferry::JsonValue& j, const std::string& key, const std::string& what,
                         const std::string& fallback) {
  const ferry::JsonValue* v = j.find(key);
  return v == nullptr || v->is_null() ? fallback : v->string(what + " '" + key + "'");
}

// rope_scaling (transformers 4) or rope_parameters (5): the type and, for llama3, its numbers.
void read_rope(const ferry::JsonValue& r, const std::string& what, LlamaConfig& c) {
  c.rope_type = string_field(r, "rope_type", what, string_field(r, "type", what, "default"));
  c.rope_theta = number_field(r, "rope_theta", what, c.rope_theta);
  if (c.rope_type == "llama3") {
    c.rope_factor = number_field(r, "factor", what, c.rope_factor);
    c.rope_low_freq_factor = number_field(r, "low_freq_factor", what, c.rope_low_freq_factor);
    c.rope_high_freq_factor = number_field(r, "high_freq_factor", what, c.rope_high_freq_factor);
    c.rope_original_max_positions =
        int_field(r, "original_max_position_embeddings", what, c.rope_original_max_positions, false);
  }
}

std::string json_number(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  std::string s(buf);
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

}  // namespace

LlamaConfig LlamaConfig::from_json(const std::string& text, const std::string& what) {
  const ferry::JsonValue j = ferry::parse_json(text, what);
  TORCH_CHECK(j.is_object(), "llama: ", what, " is not a JSON object");
  const std::string type = string_field(j, "model_type", what, "llama");
  TORCH_CHECK(type == "llama", "llama: ", what, " has model_type '", type, "'; this model is 'llama'");
  const std::string act = string_field(j, "hidden_act", what, "silu");
  TORCH_CHECK(act == "silu", "llama: ", what, " has hidden_act '", act, "'; this model runs silu");
  LlamaConfig c;
  c.name = what;
  c.vocab = int_field(j, "vocab_size", what, 0, true);
  c.hidden = int_field(j, "hidden_size", what, 0, true);
  c.intermediate = int_field(j, "intermediate_size", what, 0, true);
  c.layers = int_field(j, "num_hidden_layers", what, 0, true);
  c.heads = int_field(j, "num_attention_heads", what, 0, true);
  c.kv_heads = int_field(j, "num_key_value_heads", what, c.heads, false);
  c.head_dim = int_field(j, "head_dim", what, 0, false);
  c.max_positions = int_field(j, "max_position_embeddings", what, 2048, false);
  c.rms_norm_eps = number_field(j, "rms_norm_eps", what, 1e-6);
  c.rope_theta = number_field(j, "rope_theta", what, 10000.0);
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    const ferry::JsonValue* r = j.find(key);
    if (r != nullptr && !r->is_null()) {
      TORCH_CHECK(r->is_object(), "llama: ", what, " '", key, "' is not an object");
      read_rope(*r, what + " '" + key + "'", c);
    }
  }
  c.tie_embeddings = bool_field(j, "tie_word_embeddings", what, false);
  c.attention_bias = bool_field(j, "attention_bias", what, false);
  c.mlp_bias = bool_field(j, "mlp_bias", what, false);
  c.dtype = string_field(j, "dtype", what, string_field(j, "torch_dtype", what, "float32"));
  c.validate();
  return c;
}

LlamaConfig LlamaConfig::from_folder(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "llama: cannot read ", path, " (a Hugging Face model folder has a config.json)");
  std::stringstream text;
  text << in.rdbuf();
  LlamaConfig c = from_json(text.str(), path);
  c.name = dir;
  return c;
}

std::string LlamaConfig::to_json() const {
  validate();
  std::ostringstream o;
  o << "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"model_type\": \"llama\",\n"
    << "  \"hidden_act\": \"silu\",\n  \"vocab_size\": " << vocab << ",\n  \"hidden_size\": " << hidden
    << ",\n  \"intermediate_size\": " << intermediate << ",\n  \"num_hidden_layers\": " << layers
    << ",\n  \"num_attention_heads\": " << heads << ",\n  \"num_key_value_heads\": " << kv_heads
    << ",\n  \"head_dim\": " << head_size() << ",\n  \"max_position_embeddings\": " << max_positions
    << ",\n  \"rms_norm_eps\": " << json_number(rms_norm_eps) << ",\n  \"rope_theta\": " << json_number(rope_theta)
    << ",\n  \"rope_scaling\": ";
  if (rope_type == "default") {
    o << "null";
  } else {
    o << "{\"rope_type\": \"" << rope_type << "\", \"factor\": " << json_number(rope_factor)
      << ", \"low_freq_factor\": " << json_number(rope_low_freq_factor)
      << ", \"high_freq_factor\": " << json_number(rope_high_freq_factor)
      << ", \"original_max_position_embeddings\": " << rope_original_max_positions << "}";
  }
  o << ",\n  \"tie_word_embeddings\": " << (tie_embeddings ? "true" : "false")
    << ",\n  \"attention_bias\": " << (attention_bias ? "true" : "false")
    << ",\n  \"mlp_bias\": " << (mlp_bias ? "true" : "false") << ",\n  \"torch_dtype\": \"" << dtype << "\"\n}\n";
  return o.str();
}

namespace {

const std::map<std::string, LlamaConfig>& presets() {
  static const std::map<std::string, LlamaConfig> table = [] {
    std::map<std::string, LlamaConfig> t;
    auto add = [&](const std::string& name, int64_t vocab, int64_t hidden, int64_t inter, int64_t layers,
                   int64_t heads, int64_t kv, double theta, int64_t max_pos) {
      LlamaConfig c;
      c.name = name;
      c.vocab = vocab;
      c.hidden = hidden;
      c.intermediate = inter;
      c.layers = layers;
      c.heads = heads;
      c.kv_heads = kv;
      c.rope_theta = theta;
      c.max_positions = max_pos;
      t[name] = c;
    };
    add("tiny", 256, 64, 160, 2, 4, 2, 10000.0, 256);
    add("tinyllama-1.1b", 32000, 2048, 5632, 22, 32, 4, 10000.0, 2048);
    add("llama2-7b", 32000, 4096, 11008, 32, 32, 32, 10000.0, 4096);
    add("llama3-8b", 128256, 4096, 14336, 32, 32, 8, 500000.0, 8192);
    add("llama2-13b", 32000, 5120, 13824, 40, 40, 40, 10000.0, 4096);
    return t;
  }();
  return table;
}

}  // namespace

LlamaConfig preset(const std::string& name) {
  const auto it = presets().find(name);
  if (it == presets().end()) {
    std::ostringstream names;
    for (const auto& n : preset_names()) names << " " << n;
    TORCH_CHECK(false, "llama: unknown preset '", name, "'; known:", names.str());
  }
  return it->second;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> out;
  for (const auto& [name, c] : presets()) out.push_back(name);
  return out;
}

RmsNormImpl::RmsNormImpl(int64_t dim, double eps_) : eps(eps_) {
  weight = register_parameter("weight", at::ones({dim}));
}

torch::Tensor RmsNormImpl::forward(const torch::Tensor& x) {
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor normed = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * normed.to(x.scalar_type());
}

namespace {
torch::nn::Linear linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

// transformers' rotate_half: cat(-x2, x1) over the last dimension's halves.
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}
}  // namespace

AttentionImpl::AttentionImpl(const LlamaConfig& c) : heads(c.heads), kv_heads(c.kv_heads), head_size(c.head_size()) {
  q_proj = register_module("q_proj", linear(c.hidden, heads * head_size, c.attention_bias));
  k_proj = register_module("k_proj", linear(c.hidden, kv_heads * head_size, c.attention_bias));
  v_proj = register_module("v_proj", linear(c.hidden, kv_heads * head_size, c.attention_bias));
  o_proj = register_module("o_proj", linear(heads * head_size, c.hidden, c.attention_bias));
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t b = x.size(0), t = x.size(1);
  at::Tensor q = q_proj(x).view({b, t, heads, head_size}).transpose(1, 2);
  at::Tensor k = k_proj(x).view({b, t, kv_heads, head_size}).transpose(1, 2);
  at::Tensor v = v_proj(x).view({b, t, kv_heads, head_size}).transpose(1, 2);
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  if (kv_heads != heads) {  // transformers' repeat_kv: each key/value head serves heads / kv_heads queries
    k = k.repeat_interleave(heads / kv_heads, 1);
    v = v.repeat_interleave(heads / kv_heads, 1);
  }
  const at::Tensor y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                        /*is_causal=*/t > 1, 1.0 / std::sqrt(double(head_size)));
  return o_proj(y.transpose(1, 2).reshape({b, t, heads * head_size}));
}

MlpImpl::MlpImpl(const LlamaConfig& c) {
  gate_proj = register_module("gate_proj", linear(c.hidden, c.intermediate, c.mlp_bias));
  up_proj = register_module("up_proj", linear(c.hidden, c.intermediate, c.mlp_bias));
  down_proj = register_module("down_proj", linear(c.intermediate, c.hidden, c.mlp_bias));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  return down_proj(at::silu(gate_proj(x)) * up_proj(x));
}

DecoderLayerImpl::DecoderLayerImpl(const LlamaConfig& c) {
  self_attn = register_module("self_attn", Attention(c));
  mlp = register_module("mlp", Mlp(c));
  input_layernorm = register_module("input_layernorm", RmsNorm(c.hidden, c.rms_norm_eps));
  post_attention_layernorm = register_module("post_attention_layernorm", RmsNorm(c.hidden, c.rms_norm_eps));
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const at::Tensor h = x + self_attn(input_layernorm(x), cos, sin);
  return h + mlp(post_attention_layernorm(h));
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& c) {
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(c.vocab, c.hidden));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.layers; ++i) layers->push_back(DecoderLayer(c));
  norm = register_module("norm", RmsNorm(c.hidden, c.rms_norm_eps));
}

LlamaImpl::LlamaImpl(const LlamaConfig& c) : config(c) {
  config.validate();
  model = register_module("model", LlamaModel(config));
  if (!config.tie_embeddings) lm_head = register_module("lm_head", linear(config.hidden, config.vocab, false));
}

torch::Tensor LlamaImpl::forward(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, "llama: tokens must be [batch, sequence], got ", tokens.sizes());
  const int64_t t = tokens.size(1);
  at::Tensor x = model->embed_tokens(tokens);
  // The rotary tables in fp32 (positions x inverse frequencies, both halves), then in x's dtype.
  const at::Tensor inv = config.rope_inv_freq().to(x.device());
  const at::Tensor freqs = at::arange(t, at::TensorOptions().dtype(at::kFloat).device(x.device())).unsqueeze(1) *
                           inv.unsqueeze(0);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  const at::Tensor cos = emb.cos().to(x.scalar_type()), sin = emb.sin().to(x.scalar_type());
  for (auto& m : *model->layers) {
    DecoderLayer layer(std::dynamic_pointer_cast<DecoderLayerImpl>(m));
    x = run_layer ? run_layer(layer, x, cos, sin) : layer->forward(x, cos, sin);
  }
  x = model->norm(x);
  return lm_head ? lm_head(x) : at::linear(x, model->embed_tokens->weight);
}

torch::Tensor LlamaImpl::loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat), targets.reshape({-1}));
}

}  // namespace llama
