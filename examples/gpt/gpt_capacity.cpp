// gpt_capacity: which GPT presets ferry can train on a given GPU and host, on paper, before building
// anything (ferry::estimate_capacity, optim/capacity_estimate.h). Prints one JSON document: per preset
// its parameters, chunk size, where its chunks and state would be, and whether the host's bytes fit;
// then the largest preset that fits. Presets smallest first.
//
//   gpt_capacity [--device-room=62GiB] [--host=117GiB] [--precision=bf16|fp16|fp32]
//                [--state-format=fp32|compact] [--accumulate-grads] [--round-trip-slots=K]
//                [--presets=tiny,...,30b]
//
// --device-room: the GPU's bytes for chunks once activations, workspace and the CUDA context have theirs
// (the default assumes an 80 GB H100, 78 GiB usable, 16 GiB of it for batch 8 x 1024 with every block
// checkpointed); --host: the host's bytes for chunks (default 117 GiB: a 125 GiB host less 8 for the
// OS and the process itself). Both are assumptions to adjust: bench_gpt measures the real ones.
#include <algorithm>
#include <iostream>
#include <sstream>

#include "../../ferry.h"
#include "gpt.h"

namespace {

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  return ferry::cli::run_main("gpt_capacity", [&] {
    // --precision is ferry's own option (Config, parsed as every program parses it); bf16 unless given.
    std::vector<std::string> rest;
    ferry::Config config = ferry::Config::from_args(argc, argv, &rest);
    if (!ferry::cli::option_given(argc, argv, "precision")) config.precision = ferry::Precision::kBf16;
    std::string device_room = "62GiB", host = "117GiB", state_format = "fp32", presets;
    bool accumulate = false;
    int64_t round_trip_slots = 0;
    ferry::cli::Options o("gpt_capacity", "[options] [--precision=bf16|fp16|fp32]");
    o.also_accepts("ferry options", ferry::Config::help());
    o.add("device-room", &device_room, "GPU bytes for chunks (default 62GiB)")
        .add("host", &host, "host bytes for chunks (default 117GiB)")
        .add("state-format", &state_format, "optimizer state: fp32 or compact (default fp32)")
        .add_flag("accumulate-grads", &accumulate, "fp32 gradient accumulation in the state")
        .add("round-trip-slots", &round_trip_slots, "HybridAdamOptions::round_trip_slots: host buffers for the "
             "parameter round trips, at most (default 0: one per host-state chunk)", int64_t{0})
        .add("presets", &presets, "comma-separated preset names (default: every preset)");
    o.parse(rest);
    ferry::CapacityQuery q;
    q.device_room_bytes = ferry::parse_bytes(device_room);
    const int64_t host_bytes = ferry::parse_bytes(host);
    q.compute_dtype = config.precision == ferry::Precision::kBf16   ? at::kBFloat16
                      : config.precision == ferry::Precision::kFp16 ? at::kHalf
                                                                    : at::kFloat;
    q.state_format = ferry::state_format_from_string(state_format);
    q.accumulate_grads = accumulate;
    q.round_trip_slots = round_trip_slots;
    std::vector<std::string> names = presets.empty() ? gpt::preset_names() : split_commas(presets);
    if (presets.empty()) {  // smallest first
      std::stable_sort(names.begin(), names.end(), [](const std::string& a, const std::string& b) {
        return gpt::preset(a).num_params() < gpt::preset(b).num_params();
      });
    }

    std::ostringstream out;
    out << "{\"device_room_bytes\": " << q.device_room_bytes << ", \"host_bytes_for_chunks\": " << host_bytes
        << ", \"precision\": \"" << ferry::to_string(config.precision) << "\", \"state_format\": \"" << ferry::to_string(q.state_format)
        << "\", \"accumulate_grads\": " << (accumulate ? "true" : "false") << ", \"round_trip_slots\": " << round_trip_slots
        << ",\n \"presets\": [";
    std::string largest;
    int64_t largest_params = 0;
    for (size_t i = 0; i < names.size(); ++i) {
      const gpt::GptConfig c = gpt::preset(names[i]);
      q.param_numels = c.param_numels();
      const ferry::CapacityEstimate e = ferry::estimate_capacity(q);
      const bool fits = e.fits_host(host_bytes);
      if (fits && e.params > largest_params) {
        largest = names[i];
        largest_params = e.params;
      }
      out << (i ? ",\n  " : "\n  ") << "{\"preset\": \"" << names[i] << "\", \"fits\": " << (fits ? "true" : "false")
          << ", \"estimate\": " << e.to_json() << "}";
      std::cerr << "gpt_capacity: " << names[i] << " (" << e.params / 1e9 << "B): host "
                << ferry::format_bytes(e.host_bytes()) << " of " << ferry::format_bytes(host_bytes) << ", "
                << e.device_state_groups << " of " << e.num_chunks << " groups' state on the device: "
                << (fits ? "fits" : "does not fit") << "\n";
    }
    out << "],\n \"largest_that_fits\": " << (largest.empty() ? "null" : "\"" + largest + "\"") << "}\n";
    std::cout << out.str();
    return 0;
  });
}
