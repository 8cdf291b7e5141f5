#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "../../common/config.h"
#include "../test_util.h"

namespace ferry {
namespace {

TEST(ParseBytes, UnitsBinaryAndDecimal) {
  EXPECT_EQ(parse_bytes("4096"), 4096);
  EXPECT_EQ(parse_bytes("12B"), 12);
  EXPECT_EQ(parse_bytes("64MiB"), int64_t{64} << 20);
  EXPECT_EQ(parse_bytes("64M"), int64_t{64} << 20);
  EXPECT_EQ(parse_bytes("1.5GiB"), int64_t{3} << 29);
  EXPECT_EQ(parse_bytes("2gib"), int64_t{2} << 30);
  EXPECT_EQ(parse_bytes("512MB"), 512000000);
  EXPECT_EQ(parse_bytes("1TB"), 1000000000000);
  EXPECT_EQ(parse_bytes("3KiB"), 3072);
}

TEST(ParseBytes, RejectsGarbage) {
  for (const char* bad : {"", "MiB", "-5", "12 parsecs", "1e400GiB", "99999999TiB", "1.2.3MiB", ".", "1..5GiB"}) {
    EXPECT_THROW(parse_bytes(bad), c10::Error) << bad;
  }
  try {
    parse_bytes("7furlongs");
    FAIL() << "expected a throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("furlongs"), std::string::npos) << e.what();
  }
}

TEST(FormatBytes, Readable) {
  EXPECT_EQ(format_bytes(100), "100 B");
  EXPECT_EQ(format_bytes(int64_t{64} << 20), "64.0 MiB");
  EXPECT_EQ(format_bytes(int64_t{3} << 29), "1.5 GiB");
}

TEST(Config, DefaultsAreValid) {
  Config c;
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.chunk_size_bytes, 0) << "auto: the chunk-size search";
  EXPECT_EQ(c.world_size, 1);
  const char* argv[] = {"prog", "--chunk-size=8MiB", "--chunk-size=auto"};
  EXPECT_EQ(Config::from_args(3, argv).chunk_size_bytes, 0);
}

TEST(Config, EnvironmentTorchrunThenSlurm) {
  Config c = Config::from_env({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"SLURM_PROCID", "5"}});
  EXPECT_EQ(c.rank, 3);
  EXPECT_EQ(c.world_size, 8);
  EXPECT_EQ(c.local_rank, 1);
  EXPECT_EQ(c.launcher, Launcher::kRankVariables);
  Config s = Config::from_env(
      {{"SLURM_PROCID", "5"}, {"SLURM_STEP_NUM_TASKS", "6"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "2"}});
  EXPECT_EQ(s.rank, 5);
  EXPECT_EQ(s.world_size, 6) << "the step's tasks, not the job's";
  EXPECT_EQ(s.local_rank, 2);
  EXPECT_EQ(s.launcher, Launcher::kSlurmStep);
  EXPECT_EQ(Config::from_env({}).launcher, Launcher::kNone);
  Config l = Config::from_env({{"FERRY_LOG_LEVEL", "DEBUG"}});
  EXPECT_EQ(l.log_level, log::Level::kDebug);
}

TEST(Config, EnvironmentRendezvousOfTorchrunAndByHand) {
  Config t = Config::from_env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "29411"},
                               {"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"FERRY_DIST_TIMEOUT", "45"}});
  EXPECT_EQ(t.master_addr, "node7");
  EXPECT_EQ(t.master_port, 29411);
  EXPECT_TRUE(t.agent_store);
  EXPECT_EQ(t.dist_timeout_s, 45);
  Config d = Config::from_env({});
  EXPECT_EQ(d.master_addr, "127.0.0.1");
  EXPECT_EQ(d.master_port, 29500);
  EXPECT_FALSE(d.agent_store);
  EXPECT_EQ(d.dist_backend, "auto");
  d.set("dist-backend", "GLOO");
  EXPECT_EQ(d.dist_backend, "gloo");
  d.set("master-port", "1234");
  EXPECT_EQ(d.master_port, 1234);
  auto error = [](const std::map<std::string, std::string>& env) {
    try {
      Config::from_env(env);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(error({{"MASTER_PORT", "70000"}}).find("expected master-port in [1, 65535], got 70000"), std::string::npos);
  EXPECT_NE(error({{"MASTER_PORT", "x"}}).find("expected an integer for MASTER_PORT"), std::string::npos);
  EXPECT_NE(error({{"FERRY_DIST_TIMEOUT", "0"}}).find("expected dist-timeout in (0, 86400]"), std::string::npos);
  EXPECT_NE(error({{"TORCHELASTIC_USE_AGENT_STORE", "maybe"}}).find("expected true|false"), std::string::npos);
  Config c;
  EXPECT_THROW(c.set("dist-backend", "mpi"), c10::Error);
}

// srun's tasks find the rendezvous without MASTER_ADDR / MASTER_PORT: the step's first node (the job's
// when the step's list is missing) at a port of the job's; what is given still wins.
TEST(Config, ASlurmStepFindsItsRendezvousWithoutExports) {
  const std::map<std::string, std::string> step = {
      {"SLURM_PROCID", "3"},          {"SLURM_STEP_NUM_TASKS", "8"},
      {"SLURM_LOCALID", "3"},         {"SLURM_STEP_NODELIST", "gpu[07-08]"},
      {"SLURM_JOB_NODELIST", "gpu[01-08]"}, {"SLURM_JOB_ID", "4817293"}};
  const Config c = Config::from_env(step);
  EXPECT_EQ(c.master_addr, "gpu07");
  EXPECT_EQ(c.master_addr_from, "SLURM_STEP_NODELIST=gpu[07-08]");
  EXPECT_EQ(c.master_port, 15000 + 4817293 % 10000);
  EXPECT_NE(c.to_string().find("master=gpu07:22293 (first node of SLURM_STEP_NODELIST=gpu[07-08])"),
            std::string::npos)
      << c.to_string();
  auto with = [&](std::map<std::string, std::string> env) {
    for (const auto& [k, v] : step) env.emplace(k, v);
    return Config::from_env(env);
  };
  std::map<std::string, std::string> job_only = step;
  job_only.erase("SLURM_STEP_NODELIST");
  EXPECT_EQ(Config::from_env(job_only).master_addr, "gpu01");
  const Config given = with({{"MASTER_ADDR", "10.0.0.9"}, {"MASTER_PORT", "29411"}});
  EXPECT_EQ(given.master_addr, "10.0.0.9");
  EXPECT_EQ(given.master_port, 29411);
  EXPECT_TRUE(given.master_addr_from.empty());
  std::map<std::string, std::string> no_job = step;
  no_job.erase("SLURM_JOB_ID");
  EXPECT_EQ(Config::from_env(no_job).master_port, 29500);
  Config by_hand = c;
  by_hand.set("master-addr", "node3");
  EXPECT_TRUE(by_hand.master_addr_from.empty()) << "the address is the user's now";
  // Outside a step (the batch script, or RANK set by torchrun inside srun) nothing is derived.
  const Config batch = Config::from_env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_JOB_ID", "12"},
                                         {"SLURM_JOB_NODELIST", "gpu[01-02]"}});
  EXPECT_EQ(batch.launcher, Launcher::kSlurmBatch);
  EXPECT_EQ(batch.world_size, 4);
  EXPECT_EQ(batch.master_addr, "127.0.0.1");
  EXPECT_EQ(batch.master_port, 29500);
  const Config torchrun = with({{"RANK", "1"}, {"WORLD_SIZE", "2"}});
  EXPECT_EQ(torchrun.launcher, Launcher::kRankVariables);
  EXPECT_EQ(torchrun.master_addr, "127.0.0.1");
  // --world-size (or --rank) takes the launch over: dist::connect then trusts it.
  const char* argv[] = {"prog", "--world-size=1"};
  Config alone = batch;
  alone.set("world-size", "1");
  EXPECT_EQ(alone.launcher, Launcher::kArguments);
  EXPECT_EQ(Config::from_args(2, argv).launcher, Launcher::kArguments);
  // A list that is not one fails naming the variable.
  std::map<std::string, std::string> bad = step;
  bad["SLURM_STEP_NODELIST"] = "gpu[07-";
  EXPECT_NE(test::error_of([&] { Config::from_env(bad); }).find("SLURM_STEP_NODELIST='gpu[07-' is not a SLURM host list"),
            std::string::npos);
  bad = step;
  bad["SLURM_JOB_ID"] = "12x";
  EXPECT_NE(test::error_of([&] { Config::from_env(bad); }).find("expected a job number for SLURM_JOB_ID, got '12x'"),
            std::string::npos);
  bad["SLURM_JOB_ID"] = "4294967295";  // federated job ids use all 32 bits
  EXPECT_EQ(Config::from_env(bad).master_port, 15000 + 7295);
}

TEST(Config, VisibleGpusAreCountedAsWritten) {
  EXPECT_EQ(Config::from_env({}).visible_gpus, -1);
  EXPECT_EQ(Config::from_env({{"CUDA_VISIBLE_DEVICES", ""}}).visible_gpus, 0);
  EXPECT_EQ(Config::from_env({{"CUDA_VISIBLE_DEVICES", "3"}}).visible_gpus, 1);
  EXPECT_EQ(Config::from_env({{"CUDA_VISIBLE_DEVICES", "GPU-8f3a2c1e-0b9d-4c55-a1e2-7d6b5c4a3f21"}}).visible_gpus, 1);
  EXPECT_EQ(Config::from_env({{"CUDA_VISIBLE_DEVICES", "0,1,2,3"}}).visible_gpus, 4);
  EXPECT_EQ(Config::from_env({{"CUDA_VISIBLE_DEVICES", "0,,1,"}}).visible_gpus, 2);
}

TEST(Config, GlooInterfacesAreReadAsTorchReadsThem) {
  EXPECT_TRUE(Config::from_env({}).gloo_interfaces.empty());
  EXPECT_EQ(Config::from_env({{"GLOO_SOCKET_IFNAME", "eth0"}}).gloo_interfaces, std::vector<std::string>{"eth0"});
  const Config two = Config::from_env({{"GLOO_SOCKET_IFNAME", "ib0,ib1"}, {"RANK", "0"}, {"WORLD_SIZE", "2"}});
  EXPECT_EQ(two.gloo_interfaces, (std::vector<std::string>{"ib0", "ib1"}));
  EXPECT_NE(two.to_string().find(" gloo-interfaces=ib0,ib1"), std::string::npos) << two.to_string();
  for (const char* bad : {"", "eth0,", ",eth0", "a,,b"}) {
    EXPECT_NE(test::error_of([&] { Config::from_env({{"GLOO_SOCKET_IFNAME", bad}}); })
                  .find("expected GLOO_SOCKET_IFNAME as interface names separated by commas"),
              std::string::npos)
        << "'" << bad << "'";
  }
}

TEST(Config, EnvironmentInconsistentRankFails) {
  EXPECT_THROW(Config::from_env({{"RANK", "8"}, {"WORLD_SIZE", "8"}}), c10::Error);
  EXPECT_THROW(Config::from_env({{"RANK", "two"}}), c10::Error);
}

TEST(Config, ArgumentsOverrideAndValidate) {
  const char* argv[] = {"prog", "--chunk-size=32MiB", "--device=simulated", "--precision=bf16",
                        "--device-budget=1GiB", "--cpu-isa=avx2", "--log-level=error", "--cpu-threads=3",
                        "--cpu-split=static"};
  Config c = Config::from_args(9, argv);
  EXPECT_EQ(c.chunk_size_bytes, int64_t{32} << 20);
  EXPECT_EQ(c.device, DeviceKind::kSimulated);
  EXPECT_EQ(c.precision, Precision::kBf16);
  EXPECT_EQ(c.device_budget_bytes, int64_t{1} << 30);
  EXPECT_EQ(c.cpu_isa, "avx2");
  EXPECT_EQ(c.log_level, log::Level::kError);
  EXPECT_EQ(c.cpu_threads, 3);
  EXPECT_EQ(c.cpu_split, CpuSplit::kStatic);
  EXPECT_EQ(Config{}.cpu_split, CpuSplit::kDynamic);
}

TEST(Config, BadArgumentsNameWhatWasExpected) {
  auto fails_with = [](std::vector<const char*> args, const std::string& needle) {
    args.insert(args.begin(), "prog");
    try {
      Config::from_args(static_cast<int>(args.size()), args.data());
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "no error for " << args[1];
  };
  fails_with({"--chunk-size=1KiB"}, "chunk-size auto (0) or >= 4 KiB");
  fails_with({"--device=tpu"}, "auto|cuda|simulated, got 'tpu'");
  fails_with({"--precision=fp8"}, "fp32|bf16|fp16, got 'fp8'");
  fails_with({"--cpu-isa=neon"}, "got 'neon'");
  fails_with({"--cpu-threads=-1"}, "cpu-threads in [0, 1024]");
  fails_with({"--cpu-threads=1000000"}, "cpu-threads in [0, 1024]");
  fails_with({"--cpu-split=guided"}, "cpu-split dynamic|static, got 'guided'");
  fails_with({"--no-such-option=1"}, "unknown option 'no-such-option'");
  fails_with({"positional"}, "expected --key=value, got 'positional'");
}

TEST(Config, UnknownArgumentsGoToRestWhenAsked) {
  const char* argv[] = {"prog", "--json", "--steps=10", "--chunk-size=8MiB", "file.txt"};
  std::vector<std::string> rest;
  Config c = Config::from_args(5, argv, &rest);
  EXPECT_EQ(c.chunk_size_bytes, int64_t{8} << 20);
  EXPECT_EQ(rest, (std::vector<std::string>{"--json", "--steps=10", "file.txt"}));
  // A known key with a bad value is still an error, not "rest".
  const char* bad[] = {"prog", "--chunk-size=lots"};
  EXPECT_THROW(Config::from_args(2, bad, &rest), c10::Error);
}

TEST(Config, ToStringNamesEveryField) {
  const std::string s = Config{}.to_string();
  for (const char* key : {"device=", "precision=", "chunk-size=", "device-budget=", "host-budget=", "cpu-threads=",
                          "cpu-isa=", "cpu-split=", "log-level=", "rank="}) {
    EXPECT_NE(s.find(key), std::string::npos) << key;
  }
}

}  // namespace
}  // namespace ferry
