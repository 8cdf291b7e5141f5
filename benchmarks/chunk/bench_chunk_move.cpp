// bench_chunk_move: bandwidth of whole-chunk moves through the ChunkStore, host->device and
// device->host, against chunk size, with pinned and pageable host memory.
//
// Each repetition is one ChunkStore::move() plus wait() (the copy has completed when the clock
// stops), so the time includes what a real move costs beyond the copy: device allocation from the
// caching allocator, host buffers from the pool, stream ordering. On a machine without a GPU the
// simulated device is measured (host memcpy through the same code), and only pageable memory exists.
//
//   bench_chunk_move [--sizes=16M,32M,64M,128M,256M] [--min-time=0.3] [--device=auto|cuda|simulated]
//                    [--commit=SHA]
#include <algorithm>
#include <chrono>
#include <iostream>
#include <sstream>

#include "../../ferry.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Timing {
  double median_s = 0, best_s = 0;
  int reps = 0;
};

std::string json(const Timing& t, int64_t bytes) {
  std::ostringstream os;
  os.precision(6);
  os << "{\"median_s\":" << t.median_s << ",\"best_s\":" << t.best_s << ",\"reps\":" << t.reps
     << ",\"gbps\":" << bytes / t.median_s / 1e9 << ",\"gbps_best\":" << bytes / t.best_s / 1e9 << "}";
  return os.str();
}

}  // namespace

int run(int argc, char** argv) {
  std::vector<std::string> rest;
  const ferry::Config config = ferry::Config::from_args(argc, argv, &rest);  // --device among them
  ferry::log::configure(config.log_level, config.rank);
  std::string sizes_text = "16M,32M,64M,128M,256M", commit = "unknown";
  double min_time = 0.3;
  ferry::cli::Options opts("bench_chunk_move");
  opts.also_accepts("ferry options", ferry::Config::help());
  opts.add("sizes", &sizes_text, "chunk bytes per row, comma-separated (default 16M,32M,64M,128M,256M)")
      .add("min-time", &min_time, "seconds each row runs at least (default 0.3)", 0.0)
      .add("commit", &commit, "the commit to report");
  opts.parse(rest);
  std::vector<int64_t> sizes;
  std::stringstream ss(sizes_text);
  for (std::string item; std::getline(ss, item, ',');) sizes.push_back(ferry::parse_bytes(item));
  const ferry::DeviceKind device = ferry::resolve_device_kind(config.device);
  const bool cuda = device == ferry::DeviceKind::kCuda;
  std::vector<bool> pinned_modes = cuda ? std::vector<bool>{true, false} : std::vector<bool>{false};

  std::ostringstream results;
  bool first = true;
  for (bool pinned : pinned_modes) {
    for (int64_t bytes : sizes) {
      ferry::ChunkStoreOptions options;
      options.device = device;
      options.pin_host_memory = pinned;
      ferry::ChunkStore store(options);
      const ferry::ChunkId c = store.add_chunk(ferry::ChunkRole::kMaster, at::kFloat, bytes / 4, ferry::Location::kHost);
      store.payload(c).fill_(1.0f);
      const int64_t nbytes = store.chunk_info(c).nbytes;
      // One trip per repetition: host->device (timed until the copy completed), then back.
      std::vector<double> up, down;
      const auto start = Clock::now();
      while (up.size() < 5 || std::chrono::duration<double>(Clock::now() - start).count() < 2 * min_time) {
        auto a = Clock::now();
        store.move(c, ferry::Location::kDevice);
        store.wait(c);
        auto b = Clock::now();
        store.move(c, ferry::Location::kHost);  // waits: the host payload is usable on return
        auto d = Clock::now();
        up.push_back(std::chrono::duration<double>(b - a).count());
        down.push_back(std::chrono::duration<double>(d - b).count());
        if (up.size() >= 200) break;
      }
      auto summarize = [](std::vector<double> t) {
        std::sort(t.begin() + 1, t.end());  // the first trip warms up; keep it out of the median
        Timing r;
        r.median_s = t[1 + (t.size() - 1) / 2];
        r.best_s = t[1];
        r.reps = static_cast<int>(t.size()) - 1;
        return r;
      };
      const Timing up_t = summarize(up), down_t = summarize(down);
      const bool payload_ok = store.payload(c).eq(1.0f).all().item<bool>();
      std::cerr << "bench_chunk_move: " << store.engine_name() << " " << (pinned ? "pinned" : "pageable") << " "
                << ferry::format_bytes(nbytes) << ": h2d " << nbytes / up_t.median_s / 1e9 << " GB/s, d2h "
                << nbytes / down_t.median_s / 1e9 << " GB/s (" << up_t.reps << " trips)"
                << (payload_ok ? "" : "  PAYLOAD CORRUPTED") << "\n";
      if (!payload_ok) return 1;
      results << (first ? "" : ",") << "\n    {\"size_bytes\":" << nbytes << ",\"host_memory\":\""
              << (pinned ? "pinned" : "pageable") << "\",\"h2d\":" << json(up_t, nbytes)
              << ",\"d2h\":" << json(down_t, nbytes) << "}";
      first = false;
    }
  }
  std::cout << "{\n  \"benchmark\": \"chunk_move\",\n  \"commit\": \"" << commit << "\",\n  \"engine\": \""
            << (cuda ? "cuda" : "simulated") << "\",\n  \"env\": "
            << ferry::env_report_json(ferry::collect_env_report()) << ",\n  \"results\": [" << results.str()
            << "\n  ]\n}\n";
  return 0;
}

int main(int argc, char** argv) {
  return ferry::cli::run_main("bench_chunk_move", [&] { return run(argc, argv); });
}
