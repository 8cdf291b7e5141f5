// llama_logits: the logits a Hugging Face LLaMA folder gives for a token sequence, computed by ferry (the
// model built inside InitScope, wrapped by ChunkedModel, the weights loaded from the folder's
// safetensors into the chunks). The tool to check a conversion, and what the tests against transformers
// call.
//
//   llama_logits --model=DIR --tokens=1,2,3 [--precision=fp32|bf16] + ferry's options (--device ...)
//
// Prints {"logits": [[...], ...]} on stdout: one row per token, the vocabulary's logits as fp32 numbers
// (9 significant digits: an fp32 exactly). Default precision fp32.
#include "../../ferry.h"

#include <cstdio>
#include <sstream>

#include "llama.h"

namespace {

std::vector<int64_t> parse_tokens(const std::string& text, int64_t vocab) {
  std::vector<int64_t> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    int64_t v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || item.empty()) {
      throw ferry::cli::UsageError("--tokens: expected comma-separated integers, got '" + item + "'");
    }
    if (v < 0 || v >= vocab) {
      throw ferry::cli::UsageError("--tokens: token " + item + " is outside the vocabulary [0, " +
                                   std::to_string(vocab) + ")");
    }
    out.push_back(v);
  }
  if (out.empty()) throw ferry::cli::UsageError("--tokens: expected at least one token");
  return out;
}

int run(int argc, char** argv) {
  std::vector<std::string> rest;
  ferry::Config config = ferry::Config::from_args(argc, argv, &rest);
  if (!ferry::cli::option_given(argc, argv, "precision")) config.precision = ferry::Precision::kFp32;
  ferry::log::configure(config.log_level, config.rank);
  std::string dir, tokens_text;
  ferry::cli::Options options("llama_logits", "--model=DIR --tokens=1,2,3 [--precision=fp32|bf16]");
  options.also_accepts("ferry options", ferry::Config::help());
  options.add("model", &dir, "a Hugging Face LLaMA folder (config.json + safetensors)")
      .add("tokens", &tokens_text, "comma-separated token ids");
  options.parse(rest);
  if (dir.empty()) throw ferry::cli::UsageError("--model is required");
  if (tokens_text.empty()) throw ferry::cli::UsageError("--tokens is required");
  config.validate();

  const llama::LlamaConfig lc = llama::LlamaConfig::from_folder(dir);
  const std::vector<int64_t> tokens = parse_tokens(tokens_text, lc.vocab);
  std::shared_ptr<llama::LlamaImpl> net;
  {
    ferry::InitScope scope(config.precision);  // built in the compute dtype: no fp32 model first
    net = std::make_shared<llama::LlamaImpl>(lc);
  }
  ferry::ChunkedModel model(net, config);
  ferry::load_safetensors(model, dir);  // strict: every parameter from the folder
  at::Tensor logits;
  {
    torch::NoGradGuard no_grad;
    const at::Tensor x = at::tensor(tokens, at::kLong).unsqueeze(0).to(model.device());
    logits = model.forward([&] { return net->forward(x); });
  }
  logits = logits.squeeze(0).to(at::kCPU, at::kFloat).contiguous();
  const float* p = logits.data_ptr<float>();
  const int64_t rows = logits.size(0), cols = logits.size(1);
  std::string out = "{\"logits\": [";
  char buf[32];
  for (int64_t r = 0; r < rows; ++r) {
    out += r ? ",\n[" : "\n[";
    for (int64_t c = 0; c < cols; ++c) {
      std::snprintf(buf, sizeof buf, c ? ",%.9g" : "%.9g", static_cast<double>(p[r * cols + c]));
      out += buf;
    }
    out += "]";
  }
  out += "]}\n";
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return ferry::cli::run_main("llama_logits", [&] { return run(argc, argv); });
}
