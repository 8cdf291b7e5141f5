#include "config.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <sstream>

#include "cpu_features.h"
#include "hostlist.h"

namespace ferry {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

int parse_int(std::string_view key, std::string_view text) {
  std::string s(text);
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(s.c_str(), &end, 10);
  TORCH_CHECK(!s.empty() && end == s.c_str() + s.size() && errno == 0 && v >= INT32_MIN && v <= INT32_MAX,
              "ferry config: expected an integer for ", key, ", got '", s, "'");
  return static_cast<int>(v);
}

DeviceKind parse_device(std::string_view text) {
  const std::string s = lower(text);
  if (s == "auto") return DeviceKind::kAuto;
  if (s == "cuda" || s == "gpu") return DeviceKind::kCuda;
  if (s == "simulated" || s == "sim" || s == "cpu") return DeviceKind::kSimulated;
  TORCH_CHECK(false, "ferry config: expected device auto|cuda|simulated, got '", text, "'");
}

ActivationPolicy parse_activations(std::string_view text) {
  const std::string s = lower(text);
  if (s == "recompute") return ActivationPolicy::kRecompute;
  if (s == "keep") return ActivationPolicy::kKeep;
  if (s == "auto") return ActivationPolicy::kAuto;
  TORCH_CHECK(false, "ferry config: expected activations recompute|keep|auto, got '", text, "'");
}

CpuSplit parse_cpu_split(std::string_view text) {
  const std::string s = lower(text);
  if (s == "dynamic") return CpuSplit::kDynamic;
  if (s == "static") return CpuSplit::kStatic;
  TORCH_CHECK(false, "ferry config: expected cpu-split dynamic|static, got '", text, "'");
}

Precision parse_precision(std::string_view text) {
  const std::string s = lower(text);
  if (s == "fp32" || s == "float32") return Precision::kFp32;
  if (s == "bf16" || s == "bfloat16") return Precision::kBf16;
  if (s == "fp16" || s == "float16" || s == "half") return Precision::kFp16;
  TORCH_CHECK(false, "ferry config: expected precision fp32|bf16|fp16, got '", text, "'");
}

constexpr int kMaxCpuThreads = 1024;

const char* const kEnvKeys[] = {"RANK",
                                "WORLD_SIZE",
                                "LOCAL_RANK",
                                "SLURM_PROCID",
                                "SLURM_NTASKS",
                                "SLURM_LOCALID",
                                "SLURM_STEP_NUM_TASKS",
                                "SLURM_STEP_NODELIST",
                                "SLURM_JOB_NODELIST",
                                "SLURM_NODELIST",
                                "SLURM_JOB_ID",
                                "MASTER_ADDR",
                                "MASTER_PORT",
                                "TORCHELASTIC_USE_AGENT_STORE",
                                "CUDA_VISIBLE_DEVICES",
                                "GLOO_SOCKET_IFNAME",
                                "FERRY_DIST_TIMEOUT",
                                "FERRY_LOG_LEVEL"};

// The rendezvous port of a SLURM job that names none: one per job, so that two jobs sharing their
// first node do not both serve at 29500; below Linux's ephemeral ports (32768 and up by default),
// which outgoing connections take.
constexpr int kSlurmPortBase = 15000;
constexpr int kSlurmPortSpan = 10000;

// "a,b,,c" -> {"a", "b", "", "c"}; "" -> {""}.
std::vector<std::string> comma_items(const std::string& text) {
  std::vector<std::string> items;
  size_t start = 0;
  for (size_t comma; (comma = text.find(',', start)) != std::string::npos; start = comma + 1) {
    items.push_back(text.substr(start, comma - start));
  }
  items.push_back(text.substr(start));
  return items;
}

double parse_seconds(std::string_view key, std::string_view text) {
  std::string s(text);
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  TORCH_CHECK(!s.empty() && end == s.c_str() + s.size() && std::isfinite(v),
              "ferry config: expected a number of seconds for ", key, ", got '", s, "'");
  return v;
}

bool parse_bool(std::string_view key, std::string_view text) {
  const std::string s = lower(text);
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off") return false;
  TORCH_CHECK(false, "ferry config: expected true|false for ", key, ", got '", text, "'");
}

}  // namespace

int64_t parse_bytes(std::string_view text) {
  std::string s(text);
  size_t pos = 0;
  while (pos < s.size() && (std::isdigit(static_cast<unsigned char>(s[pos])) || s[pos] == '.')) ++pos;
  TORCH_CHECK(pos > 0, "ferry config: expected a size such as 64MiB or 4096, got '", s, "'");
  const std::string digits = s.substr(0, pos);
  char* end = nullptr;
  const double number = std::strtod(digits.c_str(), &end);
  TORCH_CHECK(end == digits.c_str() + digits.size(), "ferry config: expected a size such as 64MiB or 4096, got '",
              s, "' ('", digits, "' is not a number)");
  double scale = 0;
  const std::string u = lower(s.substr(pos));
  if (u.empty() || u == "b") scale = 1;
  else if (u == "k" || u == "kib" || u == "ki") scale = 1024.0;
  else if (u == "m" || u == "mib" || u == "mi") scale = 1024.0 * 1024;
  else if (u == "g" || u == "gib" || u == "gi") scale = 1024.0 * 1024 * 1024;
  else if (u == "t" || u == "tib" || u == "ti") scale = 1024.0 * 1024 * 1024 * 1024;
  else if (u == "kb") scale = 1e3;
  else if (u == "mb") scale = 1e6;
  else if (u == "gb") scale = 1e9;
  else if (u == "tb") scale = 1e12;
  TORCH_CHECK(scale > 0, "ferry config: expected a size unit of B, KiB, MiB, GiB, TiB, KB, MB, GB or TB, got '",
              s.substr(pos), "' in '", s, "'");
  const double bytes = number * scale;
  TORCH_CHECK(std::isfinite(bytes) && bytes < 9.0e18, "ferry config: size '", s, "' is out of range");
  return static_cast<int64_t>(std::llround(bytes));
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (std::fabs(v) >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  std::ostringstream os;
  if (u == 0) os << bytes << " B";
  else os << std::fixed << std::setprecision(1) << v << ' ' << units[u];
  return os.str();
}

log::Level parse_log_level(std::string_view text) {
  const std::string s = lower(text);
  for (log::Level l : {log::Level::kTrace, log::Level::kDebug, log::Level::kInfo, log::Level::kWarn,
                       log::Level::kError, log::Level::kOff}) {
    if (s == log::to_string(l)) return l;
  }
  if (s == "warning") return log::Level::kWarn;
  TORCH_CHECK(false, "ferry config: expected log level trace|debug|info|warn|error|off, got '", text, "'");
}

const char* to_string(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kAuto: return "auto";
    case DeviceKind::kCuda: return "cuda";
    case DeviceKind::kSimulated: return "simulated";
  }
  return "?";
}

const char* to_string(ActivationPolicy policy) {
  switch (policy) {
    case ActivationPolicy::kRecompute: return "recompute";
    case ActivationPolicy::kKeep: return "keep";
    case ActivationPolicy::kAuto: return "auto";
  }
  return "?";
}

const char* to_string(CpuSplit split) {
  switch (split) {
    case CpuSplit::kDynamic: return "dynamic";
    case CpuSplit::kStatic: return "static";
  }
  return "?";
}

const char* to_string(Launcher launcher) {
  switch (launcher) {
    case Launcher::kNone: return "none";
    case Launcher::kRankVariables: return "RANK/WORLD_SIZE";
    case Launcher::kSlurmStep: return "slurm-step";
    case Launcher::kSlurmBatch: return "slurm-batch";
    case Launcher::kArguments: return "arguments";
  }
  return "?";
}

const char* to_string(Precision precision) {
  switch (precision) {
    case Precision::kFp32: return "fp32";
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
  }
  return "?";
}

std::map<std::string, std::string> read_environment() {
  std::map<std::string, std::string> env;
  for (const char* key : kEnvKeys) {
    if (const char* v = std::getenv(key)) env[key] = v;
  }
  return env;
}

bool cuda_allocator_configured() {
  return std::getenv("PYTORCH_CUDA_ALLOC_CONF") != nullptr || std::getenv("PYTORCH_ALLOC_CONF") != nullptr;
}

void Config::set(std::string_view key, std::string_view value) {
  const std::string k = lower(key);
  if (k == "device") device = parse_device(value);
  else if (k == "precision") precision = parse_precision(value);
  else if (k == "activations") activations = parse_activations(value);
  else if (k == "chunk-size" || k == "chunk_size") chunk_size_bytes = value == "auto" ? 0 : parse_bytes(value);
  else if (k == "device-budget" || k == "device_budget") device_budget_bytes = parse_bytes(value);
  else if (k == "device-capacity" || k == "device_capacity") device_capacity_bytes = parse_bytes(value);
  else if (k == "host-budget" || k == "host_budget") host_budget_bytes = parse_bytes(value);
  else if (k == "cpu-threads" || k == "cpu_threads") cpu_threads = parse_int(key, value);
  else if (k == "cpu-isa" || k == "cpu_isa") cpu_isa = lower(value);
  else if (k == "cpu-split" || k == "cpu_split") cpu_split = parse_cpu_split(value);
  else if (k == "log-level" || k == "log_level") log_level = parse_log_level(value);
  else if (k == "rank") {
    rank = parse_int(key, value);
    launcher = Launcher::kArguments;
  } else if (k == "world-size" || k == "world_size") {
    world_size = parse_int(key, value);
    launcher = Launcher::kArguments;
  }
  else if (k == "local-rank" || k == "local_rank") local_rank = parse_int(key, value);
  else if (k == "master-addr" || k == "master_addr") {
    master_addr = std::string(value);
    master_addr_from.clear();
  }
  else if (k == "master-port" || k == "master_port") master_port = parse_int(key, value);
  else if (k == "agent-store" || k == "agent_store") agent_store = parse_bool(key, value);
  else if (k == "dist-backend" || k == "dist_backend") dist_backend = lower(value);
  else if (k == "dist-timeout" || k == "dist_timeout") dist_timeout_s = parse_seconds(key, value);
  else TORCH_CHECK(false, "ferry config: unknown option '", key, "' (=", value, "); known options:\n", help());
  validate();
}

Config Config::from_env(const std::map<std::string, std::string>& env) {
  Config c;
  auto get = [&](const char* k) -> const std::string* {
    auto it = env.find(k);
    return it == env.end() ? nullptr : &it->second;
  };
  // torchrun / mpirun-style variables first; SLURM's only when no launcher set RANK.
  if (auto v = get("RANK")) {
    c.launcher = Launcher::kRankVariables;
    c.rank = parse_int("RANK", *v);
    if (auto w = get("WORLD_SIZE")) c.world_size = parse_int("WORLD_SIZE", *w);
    if (auto l = get("LOCAL_RANK")) c.local_rank = parse_int("LOCAL_RANK", *l);
  } else if (auto s = get("SLURM_PROCID")) {
    c.rank = parse_int("SLURM_PROCID", *s);
    if (auto l = get("SLURM_LOCALID")) c.local_rank = parse_int("SLURM_LOCALID", *l);
    // srun sets SLURM_STEP_NUM_TASKS in each task it starts; sbatch sets SLURM_PROCID=0 and
    // SLURM_NTASKS (the job's task count) in the batch script too, which is one process.
    if (auto n = get("SLURM_STEP_NUM_TASKS")) {
      c.launcher = Launcher::kSlurmStep;
      c.world_size = parse_int("SLURM_STEP_NUM_TASKS", *n);
    } else {
      c.launcher = Launcher::kSlurmBatch;
      if (auto w = get("SLURM_NTASKS")) c.world_size = parse_int("SLURM_NTASKS", *w);
    }
  }
  if (auto v = get("MASTER_ADDR")) {
    c.master_addr = *v;
  } else if (c.launcher == Launcher::kSlurmStep) {
    for (const char* key : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
      if (auto list = get(key)) {
        c.master_addr = first_host(*list, key);
        c.master_addr_from = std::string(key) + "=" + *list;
        break;
      }
    }
  }
  if (auto v = get("MASTER_PORT")) {
    c.master_port = parse_int("MASTER_PORT", *v);
  } else if (c.launcher == Launcher::kSlurmStep) {
    if (auto id = get("SLURM_JOB_ID")) {
      // Job ids are unsigned 32-bit (federated clusters use the high bits).
      const bool digits = !id->empty() && id->size() <= 10 &&
                          id->find_first_not_of("0123456789") == std::string::npos;
      TORCH_CHECK(digits, "ferry config: expected a job number for SLURM_JOB_ID, got '", *id, "'");
      c.master_port = kSlurmPortBase + static_cast<int>(std::stoull(*id) % kSlurmPortSpan);
    }
  }
  if (auto v = get("CUDA_VISIBLE_DEVICES")) {
    // Entries as written (indices, GPU-/MIG- UUIDs); "" names none.
    const std::vector<std::string> entries = comma_items(*v);
    c.visible_gpus = static_cast<int>(
        std::count_if(entries.begin(), entries.end(), [](const std::string& e) { return !e.empty(); }));
  }
  if (auto v = get("GLOO_SOCKET_IFNAME")) {
    c.gloo_interfaces = comma_items(*v);
    for (const std::string& name : c.gloo_interfaces) {
      TORCH_CHECK(!name.empty(), "ferry config: expected GLOO_SOCKET_IFNAME as interface names separated by commas "
                  "(e.g. eth0 or ib0,ib1), got '", *v, "'");
    }
  }
  if (auto v = get("TORCHELASTIC_USE_AGENT_STORE")) c.agent_store = parse_bool("TORCHELASTIC_USE_AGENT_STORE", *v);
  if (auto v = get("FERRY_DIST_TIMEOUT")) c.dist_timeout_s = parse_seconds("FERRY_DIST_TIMEOUT", *v);
  if (auto v = get("FERRY_LOG_LEVEL")) c.log_level = parse_log_level(*v);
  c.validate();
  return c;
}

Config Config::from_args(int argc, const char* const* argv, std::vector<std::string>* rest) {
  Config c = from_env(read_environment());
  for (int i = 1; i < argc; ++i) {
    std::string_view arg(argv[i]);
    if (arg.rfind("--", 0) == 0) {
      const auto eq = arg.find('=');
      TORCH_CHECK(eq != std::string_view::npos || rest != nullptr,
                  "ferry config: expected --key=value, got '", arg, "'");
      if (eq != std::string_view::npos) {
        const std::string_view key = arg.substr(2, eq - 2);
        const std::string_view value = arg.substr(eq + 1);
        if (rest) {
          // Unknown keys belong to the program; known keys must still parse.
          try {
            c.set(key, value);
          } catch (const c10::Error& e) {
            if (std::string(e.what()).find("unknown option") == std::string::npos) throw;
            rest->emplace_back(arg);
          }
        } else {
          c.set(key, value);
        }
        continue;
      }
    }
    TORCH_CHECK(rest != nullptr, "ferry config: expected --key=value, got '", arg, "'");
    rest->emplace_back(arg);
  }
  return c;
}

void Config::validate() const {
  TORCH_CHECK(chunk_size_bytes == 0 || chunk_size_bytes >= 4096,
              "ferry config: expected chunk-size auto (0) or >= 4 KiB, got ", format_bytes(chunk_size_bytes));
  TORCH_CHECK(device_budget_bytes >= 0, "ferry config: expected device-budget >= 0 (0 = no limit), got ",
              device_budget_bytes);
  TORCH_CHECK(device_capacity_bytes >= 0, "ferry config: expected device-capacity >= 0 (0 = the GPU's), got ",
              device_capacity_bytes);
  TORCH_CHECK(host_budget_bytes >= 0, "ferry config: expected host-budget >= 0 (0 = no limit), got ",
              host_budget_bytes);
  TORCH_CHECK(cpu_threads >= 0 && cpu_threads <= kMaxCpuThreads, "ferry config: expected cpu-threads in [0, ",
              kMaxCpuThreads, "] (0 = all), got ", cpu_threads);
  TORCH_CHECK(cpu_isa == "auto" || parse_cpu_isa(cpu_isa).has_value(),
              "ferry config: expected cpu-isa auto|scalar|avx2|avx512|avx512_bf16, got '", cpu_isa, "'");
  TORCH_CHECK(world_size >= 1, "ferry config: expected world-size >= 1, got ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "ferry config: expected 0 <= rank < world-size (", world_size,
              "), got ", rank);
  TORCH_CHECK(local_rank >= 0, "ferry config: expected local-rank >= 0, got ", local_rank);
  TORCH_CHECK(!master_addr.empty(), "ferry config: expected a master-addr (host name or address), got ''");
  TORCH_CHECK(master_port > 0 && master_port < 65536, "ferry config: expected master-port in [1, 65535], got ",
              master_port);
  TORCH_CHECK(dist_backend == "auto" || dist_backend == "gloo" || dist_backend == "nccl",
              "ferry config: expected dist-backend auto|gloo|nccl, got '", dist_backend, "'");
  TORCH_CHECK(dist_timeout_s > 0 && dist_timeout_s <= 86400, "ferry config: expected dist-timeout in (0, 86400] "
              "seconds, got ", dist_timeout_s);
}

std::string Config::to_string() const {
  std::ostringstream os;
  os << "device=" << ferry::to_string(device) << " precision=" << ferry::to_string(precision) << " activations=" << ferry::to_string(activations)
     << " chunk-size=" << (chunk_size_bytes ? format_bytes(chunk_size_bytes) : "auto")
     << " device-budget=" << (device_budget_bytes ? format_bytes(device_budget_bytes) : "unlimited")
     << " device-capacity=" << (device_capacity_bytes ? format_bytes(device_capacity_bytes) : "auto")
     << " host-budget=" << (host_budget_bytes ? format_bytes(host_budget_bytes) : "unlimited")
     << " cpu-threads=" << cpu_threads << " cpu-isa=" << cpu_isa << " cpu-split=" << ferry::to_string(cpu_split)
     << " log-level=" << log::to_string(log_level)
     << " rank=" << rank << "/" << world_size << " local-rank=" << local_rank
     << " launcher=" << ferry::to_string(launcher);
  if (world_size > 1) {
    os << " master=" << master_addr << ":" << master_port << (agent_store ? " (agent store)" : "")
       << (master_addr_from.empty() ? "" : " (first node of " + master_addr_from + ")")
       << " dist-backend=" << dist_backend << " dist-timeout=" << dist_timeout_s << "s";
    for (size_t i = 0; i < gloo_interfaces.size(); ++i) os << (i ? "," : " gloo-interfaces=") << gloo_interfaces[i];
  }
  return os.str();
}

std::string Config::help() {
  return "  --device=auto|cuda|simulated   where device chunks live (default auto)\n"
         "  --precision=fp32|bf16|fp16     compute dtype of parameters (default fp32)\n"
         "  --activations=recompute|keep|auto   ferry::checkpoint segments: recompute in backward (default),\n"
         "                                 keep, or auto: planned after the warm-up within the device's room\n"
         "  --chunk-size=SIZE|auto         bytes per chunk, e.g. 64MiB (default auto: least packing waste)\n"
         "  --device-budget=SIZE           device bytes for chunks (parameters + optimizer state), 0 = no limit\n"
         "  --device-capacity=SIZE         device memory for chunks + activations, 0 = the GPU's less\n"
         "                                 max(2 GiB, 5%)\n"
         "  --host-budget=SIZE             host bytes for chunks, 0 = no limit\n"
         "  --cpu-threads=N                CPU Adam threads, 0 = all\n"
         "  --cpu-isa=auto|scalar|avx2|avx512|avx512_bf16   CPU Adam kernel\n"
         "  --cpu-split=dynamic|static     CPU Adam threads claim grains as they go (default) or split evenly\n"
         "  --log-level=trace|debug|info|warn|error|off\n"
         "  --rank=N --world-size=N --local-rank=N   (normally from RANK/WORLD_SIZE/LOCAL_RANK or srun's\n"
         "                                 SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID)\n"
         "  --master-addr=HOST --master-port=N   rendezvous of rank 0 (normally MASTER_ADDR/MASTER_PORT; under\n"
         "                                 srun without them: the step's first node, port 15000 + job id % 10000)\n"
         "  --agent-store=true|false       the launcher serves the store (torchrun sets it)\n"
         "  --dist-backend=auto|gloo|nccl  collectives of a multi-process run (auto: nccl on CUDA, else gloo)\n"
         "  --dist-timeout=SECONDS         how long to wait for other ranks before failing (default 300)\n";
}

}  // namespace ferry
