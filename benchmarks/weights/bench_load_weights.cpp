// bench_load_weights: loading a GPT preset's weights from a Hugging Face-style folder into a ChunkedModel
// trained by HybridAdam (hooks/weight_source.h, optim/load_weights.h), on the simulated device (the
// chunks and masters live in host memory), timed, with the process's resident memory around it.
//
//   bench_load_weights --preset=1b --dir=DIR --write [--shards=2]   writes DIR (the module's names, its
//       bf16 initial values, in that many shards plus model.safetensors.index.json) and exits
//   bench_load_weights --preset=1b --dir=DIR [--commit=SHA]         loads DIR; prints one JSON document
//
// The floor of what the loading process must hold is the chunks' bytes (bf16 compute copies) and the
// fp32 masters', both allocated before the load; the report gives RSS before the load, its peak during
// it (VmHWM) and after, against that floor and the folder's size. Run the two modes as two processes.
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "../../examples/gpt/gpt.h"
#include "../../ferry.h"

namespace {

int64_t status_kib(const char* key) {  // a line of /proc/self/status, in KiB
  std::ifstream in("/proc/self/status");
  std::string k;
  int64_t v = 0;
  std::string unit;
  while (in >> k) {
    if (k == key) {
      in >> v >> unit;
      return v;
    }
    std::getline(in, unit);
  }
  return -1;
}

}  // namespace

int run(int argc, char** argv) {
  std::vector<std::string> rest;
  ferry::Config config = ferry::Config::from_args(argc, argv, &rest);
  ferry::log::configure(config.log_level, config.rank);
  std::string preset = "1b", dir, commit = "unknown";
  bool write = false;
  int64_t shards = 2;
  ferry::cli::Options options("bench_load_weights");
  options.also_accepts("ferry options", ferry::Config::help());
  options.add("preset", &preset, "GPT preset (default 1b)")
      .add("dir", &dir, "the model folder to write or load")
      .add_flag("write", &write, "write the folder and exit")
      .add("shards", &shards, "shards to write (default 2)", 1)
      .add("commit", &commit, "commit id recorded in the JSON");
  options.parse(rest);
  TORCH_CHECK(!dir.empty(), "bench_load_weights: --dir is required");
  const gpt::GptConfig gc = gpt::preset(preset);
  torch::manual_seed(1);
  std::shared_ptr<gpt::GptImpl> net;
  {
    ferry::InitScope scope(at::kBFloat16);
    net = std::make_shared<gpt::GptImpl>(gc);
  }
  if (write) {
    ::mkdir(dir.c_str(), 0755);
    ferry::NamedTensors all;
    for (const auto& p : net->named_parameters()) all.emplace_back(p.key(), p.value().detach());
    std::ostringstream index;
    index << "{\"metadata\": {}, \"weight_map\": {";
    const size_t per = (all.size() + static_cast<size_t>(shards) - 1) / static_cast<size_t>(shards);
    for (int64_t s = 0; s < shards; ++s) {
      const std::string file = "model-" + std::to_string(s + 1) + "-of-" + std::to_string(shards) + ".safetensors";
      ferry::NamedTensors part;
      for (size_t k = s * per; k < std::min(all.size(), (s + 1) * per); ++k) {
        part.push_back(all[k]);
        index << (k ? ", " : "") << "\"" << all[k].first << "\": \"" << file << "\"";
      }
      ferry::write_safetensors(dir + "/" + file, part, {{"format", "pt"}});
    }
    index << "}}";
    std::ofstream(dir + "/model.safetensors.index.json") << index.str();
    std::cerr << "bench_load_weights: wrote " << all.size() << " tensors of the " << preset << " preset into " << dir
              << "\n";
    return 0;
  }
  config.device = ferry::DeviceKind::kSimulated;
  config.precision = ferry::Precision::kBf16;
  ferry::ChunkedModel model(net, config);
  ferry::HybridAdam adam(model, ferry::HybridAdamOptions{});
  net.reset();
  const ferry::ChunkStoreStats params = model.store().stats(), state = adam.state_store().stats();
  const int64_t floor = params.host.current_bytes + params.device.current_bytes + state.host.current_bytes +
                        state.device.current_bytes;
  const int64_t rss_before = status_kib("VmRSS:") * 1024, hwm_before = status_kib("VmHWM:") * 1024;
  const auto t0 = std::chrono::steady_clock::now();
  const ferry::WeightLoadPlan plan = ferry::load_safetensors(adam, model, dir);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t hwm_after = status_kib("VmHWM:") * 1024, rss_after = status_kib("VmRSS:") * 1024;
  const ferry::WeightSource source = ferry::WeightSource::open(dir);
  const int64_t file_bytes = source.file_bytes();
  std::cout << "{\n  \"benchmark\": \"load_weights\",\n  \"commit\": \"" << commit << "\",\n  \"env\": "
            << ferry::env_report_json(ferry::collect_env_report()) << ",\n  \"preset\": \"" << preset
            << "\", \"parameters\": " << gc.num_params() << ", \"shards\": " << source.files().size()
            << ", \"file_bytes\": " << file_bytes << ", \"tensor_bytes\": " << plan.bytes
            << ",\n  \"load_s\": " << seconds << ", \"load_gb_per_s\": " << plan.bytes / seconds / 1e9
            << ",\n  \"floor_bytes\": " << floor << ", \"floor_what\": \"parameter chunks (bf16) + fp32 masters, allocated before the load\""
            << ",\n  \"rss_before_bytes\": " << rss_before << ", \"rss_peak_during_bytes\": " << hwm_after
            << ", \"rss_peak_before_bytes\": " << hwm_before << ", \"rss_after_bytes\": " << rss_after
            << ",\n  \"rss_peak_over_floor\": " << static_cast<double>(hwm_after) / floor
            << ", \"rss_peak_minus_before_over_file\": " << static_cast<double>(hwm_after - rss_before) / file_bytes
            << "\n}\n";
  return 0;
}

int main(int argc, char** argv) {
  return ferry::cli::run_main("bench_load_weights", [&] { return run(argc, argv); });
}
