// Data parallelism over c10d Gloo, with processes started by the test (tests/dist/dist_worker.cpp): after
// K AdamW steps with forced evictions, every rank's parameters equal one process trained on the
// concatenated batch; after the first step they equal the unwrapped module trained by
// torch::optim::AdamW on that batch (a reference that is not ferry); the optimizer state per rank is
// 1/N of it; a dead rank, ranks that disagree on the world size and an unreachable master fail with
// clear errors within the timeout, never hang.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "../cpu_adam/adam_reference.h"
#include "../seeds.h"
#include "../test_util.h"
#include "free_port.h"
#include "small_lm.h"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

using ferry::test::free_port;
using ferry::test::free_port_in;

std::string temp_dir() {
  std::string tmpl = (std::getenv("TMPDIR") ? std::string(std::getenv("TMPDIR")) : "/tmp") + "/ferry-dist-XXXXXX";
  char* made = ::mkdtemp(tmpl.data());
  EXPECT_NE(made, nullptr);
  return tmpl;
}

// The worker is built beside this test (tests/dist/CMakeLists.txt) and found from this executable's
// path at run time: a build path compiled in would differ per clone, and the object would miss the
// compiler cache in every fresh clone (D102).
const std::string& worker_path() {
  static const std::string path = [] {
    std::error_code error;
    const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
    if (error) throw std::runtime_error("test_dist: cannot read /proc/self/exe: " + error.message());
    const std::filesystem::path worker = self.parent_path() / FERRY_DIST_WORKER_NAME;
    if (!std::filesystem::exists(worker)) {
      throw std::runtime_error("test_dist: expected the worker " + worker.string() + " beside " + self.string() +
                               " (built with this test); it is not there");
    }
    return worker.string();
  }();
  return path;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct Proc {
  int exit_code = -1;  // -1: killed (timed out)
  std::string out, err;
  double seconds = 0;
};

// Starts one worker per entry of `envs` (each: extra environment), waits at most `timeout_s` for all.
// per_rank[i] (if given): more arguments for process i.
std::vector<Proc> launch(const std::vector<std::map<std::string, std::string>>& envs,
                         const std::vector<std::string>& args, double timeout_s = 120,
                         const std::vector<std::vector<std::string>>& per_rank = {}) {
  const std::string dir = temp_dir();
  std::vector<pid_t> pids;
  for (size_t i = 0; i < envs.size(); ++i) {
    std::vector<std::string> env_strings;
    for (char** e = environ; *e; ++e) {
      const std::string s(*e);
      const std::string key = s.substr(0, s.find('='));
      if (!envs[i].count(key)) env_strings.push_back(s);
    }
    for (const auto& [k, v] : envs[i]) env_strings.push_back(k + "=" + v);
    std::vector<std::string> argv_strings{worker_path()};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    if (i < per_rank.size()) argv_strings.insert(argv_strings.end(), per_rank[i].begin(), per_rank[i].end());
    const std::string out = dir + "/" + std::to_string(i) + ".out", err = dir + "/" + std::to_string(i) + ".err";
    const pid_t pid = ::fork();
    if (pid == 0) {
      if (!std::freopen(out.c_str(), "w", stdout) || !std::freopen(err.c_str(), "w", stderr)) std::_Exit(127);
      std::vector<char*> av, ev;
      for (auto& s : argv_strings) av.push_back(s.data());
      av.push_back(nullptr);
      for (auto& s : env_strings) ev.push_back(s.data());
      ev.push_back(nullptr);
      ::execve(av[0], av.data(), ev.data());
      std::_Exit(127);
    }
    pids.push_back(pid);
  }
  std::vector<Proc> procs(envs.size());
  std::vector<bool> done(envs.size(), false);
  const auto t0 = Clock::now();
  size_t left = envs.size();
  while (left > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      if (::waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        done[i] = true;
        --left;
        procs[i].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        procs[i].seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      }
    }
    if (std::chrono::duration<double>(Clock::now() - t0).count() > timeout_s) {
      for (size_t i = 0; i < pids.size(); ++i) {
        if (done[i]) continue;
        ::kill(pids[i], SIGKILL);
        ::waitpid(pids[i], nullptr, 0);
        procs[i].exit_code = -1;
        procs[i].seconds = timeout_s;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (size_t i = 0; i < envs.size(); ++i) {
    procs[i].out = slurp(dir + "/" + std::to_string(i) + ".out");
    procs[i].err = slurp(dir + "/" + std::to_string(i) + ".err");
  }
  return procs;
}

std::map<std::string, std::string> rank_env(int rank, int world, int port, double timeout_s = 30) {
  return {{"RANK", std::to_string(rank)},      {"WORLD_SIZE", std::to_string(world)},
          {"LOCAL_RANK", std::to_string(rank)}, {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(port)}, {"FERRY_DIST_TIMEOUT", std::to_string(timeout_s)},
          {"FERRY_LOG_LEVEL", "warn"},          {"OMP_NUM_THREADS", "1"}};
}

std::vector<Proc> run_world(int world, const std::vector<std::string>& args, double timeout_s = 30) {
  const int port = free_port();
  std::vector<std::map<std::string, std::string>> envs;
  for (int r = 0; r < world; ++r) envs.push_back(rank_env(r, world, port, timeout_s));
  return launch(envs, args);
}

std::map<std::string, double> result_of(const Proc& p) {
  std::map<std::string, double> kv;
  const auto at = p.out.find("FERRY_DIST_RESULT");
  if (at == std::string::npos) return kv;
  std::istringstream line(p.out.substr(at, p.out.find('\n', at) - at));
  std::string word;
  line >> word;
  while (line >> word) {  // the numbers (plan=, a word, is read by text_of)
    const auto eq = word.find('=');
    const std::string value = word.substr(eq + 1);
    char* end = nullptr;
    const double v = std::strtod(value.c_str(), &end);
    if (!value.empty() && *end == '\0') kv[word.substr(0, eq)] = v;
  }
  return kv;
}

// The value of `key` on the worker's result line, as written ("" if absent).
std::string text_of(const Proc& p, const std::string& key) {
  const auto at = p.out.find("FERRY_DIST_RESULT");
  if (at == std::string::npos) return "";
  std::istringstream line(p.out.substr(at, p.out.find('\n', at) - at));
  std::string word;
  while (line >> word) {
    if (word.rfind(key + "=", 0) == 0) return word.substr(key.size() + 1);
  }
  return "";
}

std::vector<float> read_params(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  const auto bytes = static_cast<size_t>(f.tellg());
  std::vector<float> v(bytes / sizeof(float));
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(bytes));
  return v;
}

// max |a - b| / max |b|, as the single-process tests measure it.
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

std::string describe(const std::vector<Proc>& procs) {
  std::ostringstream os;
  for (size_t i = 0; i < procs.size(); ++i) {
    os << "--- process " << i << " exit " << procs[i].exit_code << " after " << procs[i].seconds << " s\n"
       << procs[i].out << procs[i].err;
  }
  return os.str();
}

// Trains at world size `world` and alone on the whole batch with the same arguments; checks the
// parameters and the per-rank state.
void expect_equals_one_process(int world, const std::vector<std::string>& extra,
                               const std::vector<std::string>& reference_only = {}) {
  const std::string dir = temp_dir();
  std::vector<std::string> args{"--out=" + dir, "--steps=5", "--batch=8"};
  args.insert(args.end(), extra.begin(), extra.end());
  std::vector<std::string> single_args = args;
  single_args.insert(single_args.end(), reference_only.begin(), reference_only.end());
  const std::vector<Proc> single = launch({{{"FERRY_LOG_LEVEL", "warn"}, {"OMP_NUM_THREADS", "1"}}}, single_args);
  ASSERT_EQ(single[0].exit_code, 0) << describe(single);
  const std::vector<float> reference = read_params(dir + "/rank0.bin");
  const double single_state = result_of(single[0])["state_bytes"];
  const std::vector<Proc> ranks = run_world(world, args);
  for (const Proc& p : ranks) ASSERT_EQ(p.exit_code, 0) << describe(ranks);
  // fp32 chunks per layout chunk: master, exp_avg, exp_avg_sq (sharded), + the accumulation chunk
  // (with micro-batches: on every rank, each accumulating its own).
  const bool accumulate = std::find(extra.begin(), extra.end(), std::string("--micro=2")) != extra.end();
  const double roles = accumulate ? 4 : 3;
  const double sharded = single_state * 3 / roles, replicated = single_state - sharded;
  double held = 0, params_held = 0;
  const bool shard_params = std::find(extra.begin(), extra.end(), std::string("--shard-params=0")) == extra.end();
  for (int r = 0; r < world; ++r) {
    const std::vector<float> mine = read_params(dir + "/rank" + std::to_string(r) + ".bin");
    ASSERT_EQ(mine.size(), reference.size());
    // Tolerance: the summed gradients differ from the one-process ones by a few ulps (another summation
    // order). Adam's step lr * m / (sqrt(v) + eps) barely moves with such a relative change (~lr x 1e-7),
    // so what differs is each parameter's rounding: at most an ulp per step, 5 steps x 6.8e-8 (the
    // ulp of the largest parameter, 3.5, relative to it) = 3.4e-7. Measured: 3.4e-8 at 2 ranks, 6.8e-8 at
    // 4. A missing 1/N (Adam is nearly scale-invariant) shows as 8.9e-6.
    EXPECT_LE(rel_err(mine, reference), 1e-6) << "rank " << r << " of " << world;
    if (r > 0) {
      EXPECT_EQ(mine, read_params(dir + "/rank0.bin")) << "ranks 0 and " << r << " hold different parameters";
    }
    auto res = result_of(ranks[r]);
    EXPECT_GT(res["evictions"], 0) << "the budget must force evictions";
    if (accumulate) {
      // Note [Accumulation per chunk] at N > 1: the slots are emptied per chunk (host-state chunks by
      // jobs on CpuAdam's worker, not one add per parameter), and after every backward once sharded (all
      // but the first step's, two micro-batches each; under backward_step not the last one's, whose
      // step writes new values) the other ranks' values come back from them.
      const bool fused = std::find(extra.begin(), extra.end(), std::string("--api=backward_step")) != extra.end();
      EXPECT_GT(res["accumulation_jobs"], 0) << "rank " << r;
      EXPECT_EQ(res["values_from_owners"], (fused ? 1 : 2) * (res["steps"] - 1)) << "rank " << r;
    }
    EXPECT_GT(res["ring_bytes"], 0);
    held += res["state_bytes"];
    params_held += res["param_held_bytes"];
    if (shard_params) {  // after the last step: only its own parameter chunks (Note [Sharded parameters])
      EXPECT_LT(res["param_held_bytes"], res["param_chunk_bytes"]) << "rank " << r;
      EXPECT_EQ(res["remote_view_refused"], 1) << "rank " << r << ": a remote parameter's view must fail clearly";
    } else {
      EXPECT_EQ(res["param_held_bytes"], res["param_chunk_bytes"]) << "rank " << r;
    }
    // Rank r holds the state of member r of each group of `world` chunks, nothing more.
    const double chunks = res["chunks"];
    const double groups_held = std::ceil((chunks - r) / world);
    EXPECT_NEAR(res["state_bytes"], sharded * groups_held / chunks + replicated, 1) << "rank " << r;
    // Before the first step a rank holds every master but no moment or accumulation chunk (D46).
    EXPECT_NEAR(res["construct_state_bytes"], single_state / roles, 1) << "rank " << r;
  }
  // Every sharded state byte exists once across the ranks; so does every parameter chunk byte.
  EXPECT_NEAR(held, sharded + replicated * world, 1) << describe(ranks);
  const double param_bytes = result_of(ranks[0])["param_chunk_bytes"];
  EXPECT_EQ(params_held, shard_params ? param_bytes : param_bytes * world) << describe(ranks);
}

TEST(Dist, TwoRanksEqualOneProcessOnTheConcatenatedBatch) { expect_equals_one_process(2, {}); }

// A reference that is not ferry: the same module (small_lm.h), unwrapped, from rank 0's initial values,
// one torch::optim::AdamW step (the worker's hyper-parameters: lr 1e-2, weight decay 0.1, betas
// (0.9, 0.999), eps 1e-8, one group) on the concatenated batch of every rank, fp32. Every rank's
// parameters after ferry's first step must equal it within
//     tol = 2 x 16 u (|p| + lr)  +  2 lr (|g_dp - g| + 8 u S) / (|g| + eps),     u = 2^-24,
// per element, where g is torch's gradient on the whole batch, g_dp the mean over ranks of torch's
// gradient on each rank's rows (what data parallelism sums, computed here) and S the mean of their
// magnitudes. Why: at step 1 AdamW's update is p (1 - lr wd) - lr f(g) with f(g) = g / (|g| + eps) (the
// bias corrections cancel); each side's fp32 evaluation is within 16 u (|p| + lr) of it
// (cpu_adam/adam_reference.h); and |f(g') - f(g)| <= 2 |g' - g| / (|g| + eps) for any g, g' (same signs:
// it is eps |g' - g| / ((|g| + eps)(|g'| + eps)); opposite signs: |f(g)| + |f(g')| with |g' - g| =
// |g| + |g'|, within the bound in both cases |g'| < eps and |g'| >= eps / 2), where g' = ferry's
// gradient differs from g by the summation order only: the rows summed per rank and then across the
// ranks instead of in one pass (|g_dp - g|, measured here), and ferry's cross-rank sum and division in
// its own order rather than this test's (a few ulps of the summed terms: 8 u S). Elements whose
// gradient cancels to near 0 get the loose bound they need (their f(g) is decided by rounding) and no
// others do. spare has no gradient: both leave it as it was.
TEST(Dist, TheFirstStepEqualsTorchAdamWOnTheConcatenatedBatch) {
  constexpr double lr = 1e-2, weight_decay = 0.1, eps = 1e-8;
  constexpr int64_t batch = 8;
  for (const int world : {2, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const std::string dir = temp_dir();
    const std::vector<Proc> ranks = run_world(world, {"--out=" + dir, "--steps=1", "--batch=" + std::to_string(batch)});
    for (const Proc& p : ranks) ASSERT_EQ(p.exit_code, 0) << describe(ranks);

    // The reference, in this process, on one thread as the workers run (OMP_NUM_THREADS=1).
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    torch::manual_seed(ferry::test::kRank0Seed);
    ferry::test::SmallLm ref;
    const auto params = ref->named_parameters();
    std::vector<torch::Tensor> before, grad_dp, grad_mag;
    for (const auto& item : params) {
      before.push_back(item.value().detach().clone());
      grad_dp.push_back(torch::zeros_like(item.value()));
      grad_mag.push_back(torch::zeros_like(item.value()));
    }
    const ferry::test::Batch b = ferry::test::global_batch(0, batch);
    const int64_t rows = batch / world;
    for (int r = 0; r < world; ++r) {  // each rank's rows, as the rank's backward sees them
      for (const auto& item : params) item.value().mutable_grad().reset();
      ferry::test::lm_loss(ref, b.idx.slice(0, r * rows, (r + 1) * rows), b.target.slice(0, r * rows, (r + 1) * rows))
          .backward();
      for (size_t i = 0; i < params.size(); ++i) {
        const torch::Tensor& g = params[i].value().grad();
        if (!g.defined()) continue;
        grad_dp[i] += g / world;
        grad_mag[i] += g.abs() / world;
      }
    }
    for (const auto& item : params) item.value().mutable_grad().reset();
    ferry::test::lm_loss(ref, b.idx, b.target).backward();  // the concatenated batch
    torch::optim::AdamW adamw(ref->parameters(), torch::optim::AdamWOptions(lr).weight_decay(weight_decay).eps(eps));
    adamw.step();
    at::set_num_threads(threads);

    double largest = 0, largest_abs = 0;  // of excess and of |ferry - torch|, reported
    for (int r = 0; r < world; ++r) {
      const std::vector<float> mine = read_params(dir + "/rank" + std::to_string(r) + ".bin");
      int64_t offset = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        const torch::Tensor want = params[i].value().detach().to(torch::kDouble);
        const int64_t n = want.numel();
        ASSERT_LE(offset + n, static_cast<int64_t>(mine.size())) << "rank " << r << ": fewer values than parameters";
        const torch::Tensor got =
            torch::from_blob(const_cast<float*>(mine.data() + offset), want.sizes(), torch::kFloat).to(torch::kDouble);
        offset += n;
        const torch::Tensor& g32 = params[i].value().grad();
        if (!g32.defined()) {  // no gradient anywhere (spare): AdamW skips it, ferry leaves it alone
          EXPECT_TRUE(torch::equal(got.to(torch::kFloat), before[i])) << params[i].key() << " on rank " << r;
          continue;
        }
        const torch::Tensor g = g32.to(torch::kDouble);
        const torch::Tensor delta = (grad_dp[i].to(torch::kDouble) - g).abs() +
                                    8 * ferry::test::kUnitRoundoff * grad_mag[i].to(torch::kDouble);
        const torch::Tensor tol =
            2 * 16 * ferry::test::kUnitRoundoff * (before[i].to(torch::kDouble).abs() + lr) + 2 * lr * delta / (g.abs() + eps);
        const double excess = ferry::test::excess(got, want, tol);
        largest = std::max(largest, excess);
        largest_abs = std::max(largest_abs, (got - want).abs().max().item<double>());
        EXPECT_LE(excess, 1.0) << params[i].key() << " on rank " << r << ": max |ferry - torch| / tol";
        // The first step moved it (a reference that had not stepped would not pass).
        EXPECT_GT((want - before[i].to(torch::kDouble)).abs().max().item<double>(), 0.5 * lr) << params[i].key();
      }
      EXPECT_EQ(offset, static_cast<int64_t>(mine.size())) << "rank " << r << ": one value per parameter element";
    }
    std::cout << "[ measured ] " << world << " ranks vs torch::optim::AdamW: largest |difference| " << largest_abs
              << ", largest difference / tolerance " << largest << std::endl;  // flushed: launch() forks
  }
}

// A NaN in one rank's gradient of a chunk whose state is on the device (D70). In fp32, backward_step
// skips that chunk on its owner and step() skips everything, either way as one process with the same
// NaN does, and every rank reports the overflow (the worker checks it). In bf16, where the skipped
// chunk's slots held the summed gradients in place of the values: before D70 the owner kept the NaN
// there and the all-gather spread it to every rank (each rank's check that every compute copy is its
// master rounded then fails); now both ranks end with the same finite parameters.
TEST(Dist, ANonFiniteGradientOnOneRankSkipsAsInOneProcess) {
  for (const std::string api : {"backward_step", "step"}) {
    SCOPED_TRACE(api);
    std::vector<std::string> args{"--nan-step=2", "--nan-rank=0", "--api=" + api};
    if (api == "backward_step") args.push_back("--device-budget=20480");  // evictions, as in the test below
    expect_equals_one_process(2, args);
  }
  const std::string dir = temp_dir();
  const std::vector<Proc> ranks = run_world(2, {"--out=" + dir, "--steps=4", "--batch=8", "--nan-step=2", "--nan-rank=0",
                                                "--api=backward_step", "--precision=bf16", "--device-budget=40960"});
  for (const Proc& p : ranks) ASSERT_EQ(p.exit_code, 0) << describe(ranks);
  const std::vector<float> rank0 = read_params(dir + "/rank0.bin");
  EXPECT_EQ(rank0, read_params(dir + "/rank1.bin"));
  for (float v : rank0) ASSERT_TRUE(std::isfinite(v));
  for (const Proc& p : ranks) EXPECT_EQ(result_of(p)["overflows"], 1) << describe(ranks);
}

// Replicated parameter chunks (the step all-gathers the new values) give the same result.
TEST(Dist, TwoRanksWithReplicatedParametersEqualOneProcess) { expect_equals_one_process(2, {"--shard-params=0"}); }

// The state and the parameters are sharded by the final layout: a first step before the warm-up
// repack (more than one warm-up iteration) fails on every rank, saying why, instead of sharding a
// layout that is about to change.
TEST(Dist, AFirstStepBeforeTheWarmupRepackFailsClearly) {
  const auto ranks = run_world(2, {"--steps=2", "--warmup-iterations=2"});
  for (const Proc& p : ranks) {
    EXPECT_EQ(p.exit_code, 1) << describe(ranks);
    EXPECT_NE(p.err.find("came before the warm-up repack"), std::string::npos) << describe(ranks);
  }
}

// A rank whose warm-up repack waits for a view of a parameter it keeps (Note [A repack waits for held
// views]) has no final layout at the first step: every rank fails, saying why, instead of rank 0 going
// on into a collective the other never joins.
TEST(Dist, AFirstStepWhileOneRanksRepackWaitsFailsOnEveryRank) {
  const auto ranks = run_world(2, {"--steps=2", "--hold-view-rank=1"});
  for (const Proc& p : ranks) {
    EXPECT_EQ(p.exit_code, 1) << describe(ranks);
    EXPECT_NE(p.err.find("came before the warm-up repack"), std::string::npos) << describe(ranks);
  }
  EXPECT_NE(ranks[0].err.find("repack of another rank"), std::string::npos) << describe(ranks);
  EXPECT_NE(ranks[1].err.find("repack here"), std::string::npos) << describe(ranks);
  EXPECT_NE(ranks[1].err.find("the warm-up repack waits"), std::string::npos) << describe(ranks);
}

// Evaluation forwards (no backward) between steps gather the sharded groups they use like training
// forwards do, and change nothing.
TEST(Dist, EvaluationForwardsBetweenStepsLeaveTheTrainingAsInOneProcess) {
  expect_equals_one_process(2, {"--eval-every=2"});
}

// Note [Between forward and backward] at N > 1: a loss term on a sharded weight added after forward()
// and a weight read there are uses: each rank gathers the group again (every group was given up after
// forward), and the training equals one process's with the same term.
TEST(Dist, LossTermsAfterForwardGatherAndEqualOneProcess) {
  expect_equals_one_process(2, {"--loss-term-after-forward=1"});
}

// Every rank's parameter copies on the stream-model engine (copies pending until waited for, the host
// learning late that they are done, as on CUDA): gathers, evictions late in forward, evaluation
// forwards and clipping still train as one process does. (The whole suite passed this way once, by
// hand, on 2026-11-24; this case keeps the combination in it.)
TEST(Dist, CopiesPendingAsOnCudaLeaveTheTrainingAsInOneProcess) {
  expect_equals_one_process(2, {"--copies=stream", "--eval-every=2", "--clip=0.5"});
}

// Note [Writes to parameters]: every rank scales every parameter after each step (replicated parameter
// chunks, state sharded): each group's owner takes the write into its masters, and the training is the
// one process's with the same writes. (Lost writes differ by 10% a step.)
TEST(Dist, WritesBetweenStepsReachTheOwnersMastersAsInOneProcess) {
  expect_equals_one_process(2, {"--write-between-steps=1", "--shard-params=0", "--clip=0.5"});
}

// The options above drawn together (D92): each drawn combination of the step's API, clipping,
// micro-batches, sharded or replicated parameters, copies pending as on CUDA, evaluation forwards, a
// layer frozen for the first steps, updates written in the step, forwards per step, a loss term after
// forward and writes between steps (with replicated parameters) trains every rank as one process on
// the concatenated batch. The combination is printed; a failure names it.
TEST(Dist, DrawnCombinationsOfOptionsEqualOneProcess) {
  std::mt19937 rng(4747);
  const ferry::test::SeedRange seeds = ferry::test::seed_range(10);  // draws [first, first + count)
  for (int draw = 0; draw < seeds.first + seeds.count; ++draw) {
    std::vector<std::string> args;
    const bool replicated = rng() % 2;
    if (rng() % 2) args.push_back("--api=backward_step");
    if (rng() % 2) args.push_back("--clip=0.5");
    const bool micro = rng() % 3 == 0;  // --forwards needs one micro-batch
    if (micro) args.push_back("--micro=2");
    if (replicated) args.push_back("--shard-params=0");
    if (rng() % 2) args.push_back("--copies=stream");
    if (rng() % 2) args.push_back("--eval-every=2");
    if (rng() % 3 == 0) args.push_back("--frozen-until=2");
    if (rng() % 3 == 0) args.push_back("--sync-update=1");
    if (!micro && rng() % 3 == 0) args.push_back("--forwards=2");
    if (rng() % 3 == 0) args.push_back("--loss-term-after-forward=1");
    if (replicated && rng() % 2) args.push_back("--write-between-steps=1");
    const int world = rng() % 3 == 0 ? 4 : 2;  // the batch of 8 rows splits over them (and 2 micro-batches)
    if (draw < seeds.first) continue;  // drawn, to reach the later draws' bits of the generator
    std::string drawn = "draw " + std::to_string(draw) + ": " + std::to_string(world) + " ranks";
    for (const std::string& a : args) drawn += " " + a;
    std::cout << "[ drawn    ] " << drawn << std::endl;  // flushed: the workers are forked from here
    SCOPED_TRACE(drawn);
    expect_equals_one_process(world, args);
  }
}

// zero_grad() after backward discards the gradients: the chunks this rank does not own get their
// values back from their owners.
TEST(Dist, DiscardedGradientsLeaveTheParametersAsTheyWere) {
  expect_equals_one_process(2, {"--discard-step=2"});
  expect_equals_one_process(2, {"--discard-step=2", "--shard-params=0"});  // replicated: the owners' values
}

TEST(Dist, FourRanksWithClippingEqualOneProcess) { expect_equals_one_process(4, {"--clip=0.5"}); }

// D87: the step's gradient norm is an exact sum of per-parameter terms, over the chunks and over the
// ranks (ExactSum's words all-reduced), so at two ranks (where a gradient's sum over the ranks is one
// addition, the same bits whatever owns it) a clipped run is the same bits whatever the chunk size,
// though the chunks, and so which rank owns which parameters, differ. Before, each rank summed its own
// chunks' norms in fp64 and the ranks' totals were added: other groupings, other last bits.
TEST(Dist, TwoRanksClippedGiveTheSameBitsWhateverTheChunkSize) {
  std::vector<std::vector<float>> params;
  std::vector<double> chunks;
  std::vector<std::string> norms;
  for (const int64_t size : {4096, 16384}) {
    const std::string dir = temp_dir();
    const std::vector<Proc> ranks =
        run_world(2, {"--out=" + dir, "--steps=4", "--batch=8", "--clip=0.05", "--chunk-size=" + std::to_string(size),
                      "--device-budget=" + std::to_string(6 * size)});
    for (const Proc& p : ranks) ASSERT_EQ(p.exit_code, 0) << describe(ranks);
    params.push_back(read_params(dir + "/rank0.bin"));
    chunks.push_back(result_of(ranks[0])["chunks"]);
    EXPECT_GT(result_of(ranks[0])["grad_norm"], 0.05) << "the threshold must clip";
    norms.push_back(text_of(ranks[0], "grad_norms"));
    EXPECT_EQ(norms.back(), text_of(ranks[1], "grad_norms"));
    EXPECT_EQ(params.back(), read_params(dir + "/rank1.bin"));
  }
  ASSERT_NE(chunks[0], chunks[1]) << "the chunk sizes must cut the model differently";
  ASSERT_EQ(params[0].size(), params[1].size());
  EXPECT_EQ(norms[0], norms[1]) << "every step's norm, exactly";
  EXPECT_EQ(params[0], params[1]) << "max relative difference " << rel_err(params[0], params[1]);
}

// The MLP's parameters get gradients on rank 0 only: on rank 1 their slots hold values,
// which must not enter the sums.
TEST(Dist, AParameterWithoutGradientOnSomeRanksEqualsOneProcess) {
  expect_equals_one_process(2, {"--frozen-rank=1"}, {"--emulate-world=2"});
}

// D62: the MLP frozen on every rank for the first steps, then trained: its parameters' own step counts
// lag their group's, counted by the owners of their state (in the pipelined step, by its owner jobs
// too), as one process counts them; also with two accumulated micro-batches, whose chunks become final
// on the landings and uses that earlier backwards had (D71, D72). Then frozen for the whole run: a frozen
// layer between trained ones under the pipelined step across ranks (D71; the never-used spare frozen too,
// so that the head's chunk, which holds it, is final early), also with micro-batches and beside a
// parameter first used late (D73).
TEST(Dist, ALayerFrozenForTheFirstStepsEqualsOneProcess) {
  expect_equals_one_process(2, {"--frozen-until=2"});
  expect_equals_one_process(2, {"--frozen-until=2", "--api=backward_step"});
  expect_equals_one_process(2, {"--frozen-until=2", "--api=backward_step", "--micro=2"});
  expect_equals_one_process(2, {"--frozen-until=9", "--api=backward_step", "--freeze-spare=1"});
  expect_equals_one_process(2, {"--frozen-until=9", "--api=backward_step", "--freeze-spare=1", "--micro=2"});
  expect_equals_one_process(2, {"--frozen-until=9", "--api=backward_step", "--spare-from=2"});
}

// Note [A gradient after its chunk's update] across ranks: `spare`, trainable but used by no step
// before step 2 (a task head or an expert used for the first time), is packed with the head and lands
// after it. In one process the late landing is taken; across ranks it could not be (the group's
// reduce-scatter has left), so under backward_step a chunk with a trainable parameter that no backward
// has reached waits for backward's end, the same on every rank: nothing is refused and the training is
// one process's. (Before: every rank threw at step 2.) Also beside the other modes of the step.
TEST(Dist, AParameterFirstUsedLateEqualsOneProcess) {
  expect_equals_one_process(2, {"--spare-from=2", "--api=backward_step"});
  expect_equals_one_process(2, {"--spare-from=2"});
  // With micro-batches, with clipping, with the MLP unfrozen after spare's first use, and with a rank
  // whose rows give the MLP no gradient (the ranks' landings differ: not pipelined).
  expect_equals_one_process(2, {"--spare-from=2", "--api=backward_step", "--micro=2", "--batch=16"});
  expect_equals_one_process(2, {"--spare-from=2", "--api=backward_step", "--clip=0.5"});
  expect_equals_one_process(2, {"--spare-from=1", "--api=backward_step", "--frozen-until=3"});
  expect_equals_one_process(2, {"--spare-from=3", "--api=backward_step", "--frozen-rank=1"}, {"--emulate-world=2"});
}

// Note [An activation plan agreed across ranks] (dist/plan_agreement.h): under activations=auto the
// ranks plan at the same iteration from the same numbers. With room everywhere both keep both segments
// of the MLP, and train as one process; bit for bit as with every segment recomputed. With room on
// rank 0 only (rank 1's capacity leaves none past its chunks), rank 0 alone would keep both (the first
// run shows it) but plans with rank 1's room: the first segment (up + gelu: 64 KiB of activations at
// 32 rows a rank) is recomputed on both. (The second, down, saves nothing beyond its input; measured
// on the host heap of the simulated device it may show a few bytes or none, so its decision is left
// open here; that it is the same on both ranks is not.)
TEST(Dist, TheActivationPlanIsTheSameOnEveryRank) {
  expect_equals_one_process(2, {"--checkpoint=1", "--activations=auto", "--device-capacity=1G"});
  auto run = [](const std::vector<std::string>& args, const std::vector<std::vector<std::string>>& per_rank) {
    const std::string dir = temp_dir();
    std::vector<std::string> all{"--out=" + dir, "--steps=5", "--batch=64", "--checkpoint=1"};
    all.insert(all.end(), args.begin(), args.end());
    const int port = free_port();
    std::vector<Proc> ranks = launch({rank_env(0, 2, port), rank_env(1, 2, port)}, all, 120, per_rank);
    return std::make_pair(ranks, dir);
  };
  const auto [roomy, roomy_dir] = run({"--activations=auto", "--device-capacity=1G"}, {});
  const auto [recomputed, recomputed_dir] = run({"--activations=recompute"}, {});
  const auto [uneven, uneven_dir] = run({"--activations=auto"}, {{"--device-capacity=1G"}, {"--device-capacity=24576"}});
  for (const auto* ranks : {&roomy, &recomputed, &uneven}) {
    for (const Proc& p : *ranks) ASSERT_EQ(p.exit_code, 0) << describe(*ranks);
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(text_of(roomy[r], "plan"), "KK") << describe(roomy);
    EXPECT_EQ(result_of(roomy[r])["plans"], 1) << describe(roomy);
    EXPECT_EQ(text_of(uneven[r], "plan"), text_of(uneven[0], "plan")) << describe(uneven);
    // Under a sanitizer's allocator (invisible to glibc's mallinfo2) the simulated device measures no
    // saved bytes, and everything fits.
    if (ferry::test::kGlibcSeesTheHeap) {
      EXPECT_EQ(text_of(uneven[r], "plan").substr(0, 1), "r") << describe(uneven);
    }
    EXPECT_EQ(result_of(uneven[r])["plans"], 1) << describe(uneven);
    EXPECT_EQ(text_of(recomputed[r], "plan"), "-");
    const std::string file = "/rank" + std::to_string(r) + ".bin";
    EXPECT_EQ(read_params(roomy_dir + file), read_params(recomputed_dir + file)) << "rank " << r;
    EXPECT_EQ(read_params(uneven_dir + file), read_params(recomputed_dir + file)) << "rank " << r;
  }
}

// Note [Several forwards] across ranks: each rank's rows in two forward() calls, one backward (groups
// gathered, given up after forward and reduce-scattered within the one iteration), as one process.
TEST(Dist, TwoForwardsPerStepEqualOneProcess) {
  expect_equals_one_process(2, {"--forwards=2"});
  expect_equals_one_process(2, {"--forwards=2", "--api=backward_step"});
}

// (A tighter budget: with groups given up after forward, the default one leaves room for every chunk.)
TEST(Dist, TwoRanksBackwardStepEqualsOneProcess) {
  expect_equals_one_process(2, {"--api=backward_step", "--device-budget=20480"});
}

// backward_step pipelines the step into backward across ranks (each group's reduce-scatter and its
// owner's host Adam start when the group is final): the same parameters as backward() + step(), bit
// for bit, on every rank. With a rank whose landings differ it must not pipeline (groups would complete
// in different orders), and stays right. (`spare`, which never trains, does not require grad here: a
// trainable parameter no backward reached holds its chunk, the head's, back to backward's end;
// AParameterFirstUsedLateEqualsOneProcess.)
TEST(Dist, PipelinedBackwardStepEqualsBackwardThenStepBitForBit) {
  for (const std::vector<std::string>& extra : {std::vector<std::string>{}, {"--frozen-rank=1"}}) {
    const std::string stepped = temp_dir(), pipelined = temp_dir();
    auto args = [&](const std::string& dir, const std::string& api) {
      std::vector<std::string> a{"--out=" + dir, "--steps=6", "--batch=8", "--api=" + api, "--freeze-spare=1"};
      a.insert(a.end(), extra.begin(), extra.end());
      return a;
    };
    const auto a = run_world(4, args(stepped, "step"));
    for (const Proc& p : a) ASSERT_EQ(p.exit_code, 0) << describe(a);
    const auto b = run_world(4, args(pipelined, "backward_step"));
    for (const Proc& p : b) ASSERT_EQ(p.exit_code, 0) << describe(b);
    double overlapped = 0;  // owner updates of host-state chunks that ran as pipeline jobs
    for (int r = 0; r < 4; ++r) {
      const std::string name = "/rank" + std::to_string(r) + ".bin";
      EXPECT_EQ(read_params(pipelined + name), read_params(stepped + name)) << "rank " << r << describe(b);
      overlapped += result_of(b[r])["overlapped"];
    }
    // 5 chunks over 4 ranks, one state group per rank on the device: rank 0's chunk 0 is host-state.
    if (extra.empty()) {
      EXPECT_GT(overlapped, 0) << "no owner update ran as a pipeline job\n" << describe(b);
    } else {
      EXPECT_EQ(overlapped, 0) << "pipelined although the ranks' landings differ\n" << describe(b);
    }
  }
}

// The compact state format (D76) sharded like the fp32 state: each rank holds its groups' codes and
// scales, nothing twice; backward_step equals backward() + step() bit for bit on every rank; and the
// training follows one process's within the format's rounding (the ranks' summed gradients differ by
// a few ulps, which can move a stochastically rounded bf16 master by an ulp: at most 2^-7 of a value).
TEST(Dist, CompactStateShardsAndFollowsOneProcess) {
  const std::vector<std::string> common{"--steps=5", "--batch=8", "--precision=bf16", "--state-format=compact",
                                        "--freeze-spare=1", "--device-budget=61440"};
  auto with = [&](const std::string& dir, const std::string& api) {
    std::vector<std::string> a{"--out=" + dir, "--api=" + api};
    a.insert(a.end(), common.begin(), common.end());
    return a;
  };
  const std::string single_dir = temp_dir(), stepped = temp_dir(), pipelined = temp_dir();
  const std::vector<Proc> single =
      launch({{{"FERRY_LOG_LEVEL", "warn"}, {"OMP_NUM_THREADS", "1"}}}, with(single_dir, "step"));
  ASSERT_EQ(single[0].exit_code, 0) << describe(single);
  const auto a = run_world(2, with(stepped, "step"));
  for (const Proc& p : a) ASSERT_EQ(p.exit_code, 0) << describe(a);
  const auto b = run_world(2, with(pipelined, "backward_step"));
  for (const Proc& p : b) ASSERT_EQ(p.exit_code, 0) << describe(b);
  const std::vector<float> reference = read_params(single_dir + "/rank0.bin");
  double held = 0;
  for (int r = 0; r < 2; ++r) {
    const std::string name = "/rank" + std::to_string(r) + ".bin";
    EXPECT_EQ(read_params(pipelined + name), read_params(stepped + name)) << "rank " << r << describe(b);
    const std::vector<float> mine = read_params(stepped + name);
    ASSERT_EQ(mine.size(), reference.size());
    std::cout << "[ measured ] rank " << r << " against one process: relative difference " << rel_err(mine, reference)
              << "\n";
    // At most one bf16 ulp (<= 2^-7 of a value) per step and parameter: 5 steps. Measured 0.011.
    EXPECT_LE(rel_err(mine, reference), 5 * std::ldexp(1.0, -7)) << "rank " << r;
    held += result_of(a[r])["state_bytes"];
    EXPECT_LT(result_of(a[r])["state_bytes"], result_of(single[0])["state_bytes"]) << "rank " << r;
  }
  EXPECT_EQ(read_params(stepped + "/rank0.bin"), read_params(stepped + "/rank1.bin"));
  // Every state byte (master, codes, scales) exists once across the ranks.
  EXPECT_NEAR(held, result_of(single[0])["state_bytes"], 1) << describe(a);
}

// Note [Update behind the next forward] at N > 1 (sharded parameters): step() leaves the owners' host
// updates running, and the next forward's gathers send an owned chunk only once its update has written
// it. A stall queued ahead of the updates on every step (--stall-ms) makes the next forward meet them
// still running, so a gather that did not wait would send the old values. Against every update written
// before step() returns: the same parameters on every rank, bit for bit, without and with clipping,
// with evaluation forwards between steps, with micro-batches, with a rank that lands fewer gradients,
// and through backward_step's two-phase step.
TEST(Dist, HostUpdatesBehindTheNextForwardEqualUpdatesWrittenInTheStepBitForBit) {
  const std::vector<std::vector<std::string>> cases{
      {},
      {"--clip=0.5"},
      {"--clip=0.5", "--eval-every=2"},
      {"--clip=0.5", "--micro=2", "--batch=16"},
      {"--clip=0.5", "--frozen-rank=1"},              // landings that differ: the union is updated
      {"--clip=0.5", "--api=backward_step"}};  // the two-phase step (--stall-ms has no point to stall there)
  for (const std::vector<std::string>& extra : cases) {
    std::string label;
    for (const std::string& e : extra) label += e + " ";
    const std::string behind = temp_dir(), written = temp_dir();
    auto args = [&](const std::string& dir, const std::string& mode) {
      std::vector<std::string> a{"--out=" + dir, "--steps=5", "--batch=8", mode};
      a.insert(a.end(), extra.begin(), extra.end());
      return a;
    };
    const auto a = run_world(2, args(behind, "--stall-ms=150"));
    for (const Proc& p : a) ASSERT_EQ(p.exit_code, 0) << label << describe(a);
    const auto b = run_world(2, args(written, "--sync-update=1"));
    for (const Proc& p : b) ASSERT_EQ(p.exit_code, 0) << label << describe(b);
    for (int r = 0; r < 2; ++r) {
      const std::string name = "/rank" + std::to_string(r) + ".bin";
      EXPECT_EQ(read_params(behind + name), read_params(written + name)) << label << "rank " << r << describe(a);
      // Every step but the first (placed and sharded there) leaves host-state owned chunks running.
      EXPECT_GT(result_of(a[r])["deferred"], 0) << label << "rank " << r << describe(a);
      EXPECT_EQ(result_of(b[r])["deferred"], 0) << label << "rank " << r;
      EXPECT_EQ(result_of(a[r])["loss"], result_of(b[r])["loss"]) << label << "rank " << r;
    }
  }
}

// The model outlives its optimizer: after training the optimizer is destroyed and the model evaluated.
// Its sharded groups are still gathered at their use, and the gathers' send guard, which waited on the
// optimizer's updates, is gone with it (the sanitizer build catches a guard left pointing at it).
TEST(Dist, AModelEvaluatesAfterItsOptimizerIsGone) {
  const auto ranks = run_world(2, {"--steps=3", "--clip=0.5", "--eval-without-optimizer=1"});
  for (const Proc& p : ranks) {
    ASSERT_EQ(p.exit_code, 0) << describe(ranks);
    const size_t at = p.out.find("FERRY_DIST_EVAL_WITHOUT_OPTIMIZER loss=");
    ASSERT_NE(at, std::string::npos) << describe(ranks);
    const double loss = std::stod(p.out.substr(at + std::string("FERRY_DIST_EVAL_WITHOUT_OPTIMIZER loss=").size()));
    EXPECT_TRUE(std::isfinite(loss) && loss > 0) << loss;
  }
}

// Note [Ops outside the scopes]: between steps an op on a parameter (a copy, as a user logging weights
// would) reads the step's new value where this rank holds its chunk (the updates held back by a stall,
// dist_worker checks it against the master) and fails with ferry's error, naming what to call,
// where another rank owns it (it crashed the process: torch's kernels read the chunk's null storage),
// with the updates left running behind the step (--clip) and without (--sync-update). With replicated
// parameters every op reads. The training is that of an untouched run.
TEST(Dist, OpsOnParametersBetweenStepsReadOrFailClearly) {
  for (const bool sync : {false, true}) {
    std::vector<std::string> args{"--steps=4", "--clip=0.5", "--touch-between-steps=1"};
    // Behind: a 100 ms job ahead of each step's updates, so the reads meet them still running.
    args.push_back(sync ? "--sync-update=1" : "--stall-ms=100");
    const auto touched = run_world(2, args);
    std::vector<std::string> plain{"--steps=4", "--clip=0.5"};  // the same run, untouched
    if (sync) plain.push_back("--sync-update=1");
    const auto untouched = run_world(2, plain);
    const auto replicated = run_world(2, {"--steps=4", "--clip=0.5", "--touch-between-steps=1", "--shard-params=0"});
    for (const auto* run : {&touched, &untouched, &replicated}) {
      for (const Proc& p : *run) ASSERT_EQ(p.exit_code, 0) << (sync ? "sync: " : "behind: ") << describe(*run);
    }
    for (int r = 0; r < 2; ++r) {
      auto t = result_of(touched[r]), u = result_of(untouched[r]), rep = result_of(replicated[r]);
      EXPECT_GT(t["touched_ok"], 0) << "rank " << r << ": its own chunks are readable";
      EXPECT_GT(t["touched_refused"], 0) << "rank " << r << ": other ranks' chunks are refused";
      EXPECT_EQ(t["touched_ok"] + t["touched_refused"], 4 * 10) << "4 steps x 10 parameters";
      EXPECT_EQ(rep["touched_refused"], 0);
      EXPECT_EQ(t["loss"], u["loss"]) << "rank " << r;
      EXPECT_EQ(t["grad_norm"], u["grad_norm"]) << "rank " << r;
      if (!sync) {
        EXPECT_GT(t["deferred"], 0) << "rank " << r << ": updates left running";
      }
    }
  }
}

// Note [Sharded parameters]: between steps a rank keeps only its own parameter chunks; each group is
// gathered ahead of its use (prefetched from the trace after the first one), given up after forward and
// gathered again for backward (reshard after forward), or kept until the step (--reshard=0): then each
// parameter byte is gathered once and reduced once per step, as many bytes as replicated chunks send.
TEST(Dist, ShardedParametersAreGatheredAheadAndGivenUpAfterUse) {
  const std::vector<std::string> common{"--steps=6", "--batch=8"};
  auto with = [&](std::vector<std::string> args) {
    args.insert(args.end(), common.begin(), common.end());
    return args;
  };
  const auto reshard = run_world(2, with({}));
  const auto kept = run_world(2, with({"--reshard=0"}));
  const auto replicated = run_world(2, with({"--shard-params=0"}));
  for (const auto* run : {&reshard, &kept, &replicated}) {
    for (const Proc& p : *run) ASSERT_EQ(p.exit_code, 0) << describe(*run);
  }
  for (int r = 0; r < 2; ++r) {
    auto a = result_of(reshard[r]), k = result_of(kept[r]), rep = result_of(replicated[r]);
    const double groups = a["groups"], gathered_steps = 5;  // the first step shards; 5 steps gather
    ASSERT_GT(groups, 1);
    EXPECT_EQ(a["gathers"], 2 * groups * gathered_steps) << "rank " << r << ": once for forward, once for backward";
    EXPECT_EQ(k["gathers"], groups * gathered_steps) << "rank " << r;
    EXPECT_GT(a["prefetched"], 0) << "no gather was started ahead of its use";
    // Gloo serves the simulated device's memory, so gathers run there and chunks land in device
    // payloads where the budget has room (NCCL on CUDA takes the same path).
    EXPECT_GT(a["landed_on_device"], 0) << "rank " << r;
    EXPECT_GT(k["landed_on_device"], 0) << "rank " << r;
    EXPECT_GT(k["prefetched"], 0);
    // At the end of forward, reshard keeps the rank's own chunks and at most the other members of the
    // last group used (given up as backward begins); kept, every chunk.
    const double chunk_bytes = 4096;  // the worker's chunk size
    EXPECT_LE(a["forward_end_bytes"], a["param_held_bytes"] + chunk_bytes) << "rank " << r;
    EXPECT_LT(a["forward_end_bytes"], a["param_chunk_bytes"]);
    EXPECT_EQ(k["forward_end_bytes"], k["param_chunk_bytes"]) << "rank " << r;
    // Bytes of one step: kept sends what replicated chunks send (one all-gather + one reduce-scatter per
    // group; + 8 bytes per chunk of group index), reshard one more all-gather.
    EXPECT_NEAR(k["last_step_ring_bytes"], rep["last_step_ring_bytes"], 0.01 * rep["last_step_ring_bytes"]);
    EXPECT_GT(a["last_step_ring_bytes"], 1.3 * k["last_step_ring_bytes"]);
    EXPECT_LT(a["last_step_ring_bytes"], 1.6 * k["last_step_ring_bytes"]);
  }
}

// Ranks that use the parameters in different orders would gather different groups at once: every rank
// fails with a message that says so, never mixing parameters up.
TEST(Dist, RanksUsingParametersInDifferentOrdersFailClearly) {
  const auto ranks = run_world(2, {"--steps=3", "--reorder-rank=1"});
  for (const Proc& p : ranks) {
    EXPECT_EQ(p.exit_code, 1) << describe(ranks);
    EXPECT_NE(p.err.find("the ranks use the parameters in different orders"), std::string::npos) << describe(ranks);
  }
}

// D108: LayerDrop across ranks. The MLP is skipped in steps 2 and 3 of 5 (drawn from the step: the
// same on every rank), its parameters sharded. Under the aligning rule (the default), with the skips
// said ahead (ferry::will_skip), through the pipelined step, and under the strict rule, every rank's
// parameters are one process's.
TEST(Dist, LayerDropEqualsOneProcessUnderEveryRule) {
  expect_equals_one_process(2, {"--drop-mlp=0.3"});
  expect_equals_one_process(2, {"--drop-mlp=0.3", "--say-skips=1", "--api=backward_step"});
  expect_equals_one_process(2, {"--drop-mlp=0.3", "--align=0"});
}

// D108: the same LayerDrop over 8 steps (the MLP skipped in 3), three ways. Strict, each skip gives the
// trace up and the next step re-traces. Aligned, no step does, but the skipped MLP's group is gathered
// ahead for nothing (unclaimed). Said ahead, nothing is gathered for nothing: fewer gathers, none of
// them waited for more often. The parameters are the same bits under every rule.
TEST(Dist, ShardedLayerDropFollowsItsTraceAndSkipsSaidAheadAreNotGathered) {
  auto run = [](const std::vector<std::string>& rule) {
    const std::string dir = temp_dir();
    std::vector<std::string> args{"--out=" + dir, "--steps=8", "--batch=8", "--drop-mlp=0.3"};
    args.insert(args.end(), rule.begin(), rule.end());
    std::vector<Proc> ranks = run_world(2, args);
    for (const Proc& p : ranks) EXPECT_EQ(p.exit_code, 0) << describe(ranks);
    return std::make_pair(ranks, dir);
  };
  const auto [strict, strict_dir] = run({"--align=0"});
  const auto [aligned, aligned_dir] = run({});
  const auto [said, said_dir] = run({"--say-skips=1"});
  for (int r = 0; r < 2; ++r) {
    auto s = result_of(strict[r]), a = result_of(aligned[r]), h = result_of(said[r]);
    EXPECT_EQ(s["mlp_skipped"], 3) << describe(strict);
    EXPECT_EQ(s["diverged"], 3) << "rank " << r << ": every skip after the warm-up gives the trace up";
    EXPECT_EQ(s["retraced"], 3) << "rank " << r;
    EXPECT_EQ(a["diverged"] + a["retraced"] + h["diverged"] + h["retraced"], 0) << describe(aligned) << describe(said);
    EXPECT_GT(a["prefetched"], s["prefetched"]) << "rank " << r;
    EXPECT_GT(a["unclaimed"], 0) << "rank " << r << ": the skipped MLP's group, learnt only as it is skipped";
    EXPECT_EQ(a["hinted"], 0);
    EXPECT_GT(h["hinted"], 0) << "rank " << r;
    EXPECT_EQ(h["hints_broken"], 0) << "rank " << r;
    EXPECT_EQ(h["unclaimed"], 0) << "rank " << r << ": said ahead, never gathered";
    EXPECT_LT(h["gathers"], a["gathers"]) << "rank " << r;
    EXPECT_LE(h["demand_gathers"], a["demand_gathers"]) << "rank " << r;
    const std::string file = "/rank" + std::to_string(r) + ".bin";
    EXPECT_EQ(read_params(aligned_dir + file), read_params(strict_dir + file)) << "rank " << r;
    EXPECT_EQ(read_params(said_dir + file), read_params(strict_dir + file)) << "rank " << r;
  }
}

// A rank that says a skip the others do not say prefetches differently: the ranks' gathers differ, and
// every rank fails within the timeout (the first to see it naming both groups and the hint), none hangs.
TEST(Dist, RanksThatSayDifferentSkipsAheadFailClearly) {
  const auto ranks = run_world(2, {"--steps=5", "--drop-mlp=0.3", "--say-skips-rank=1"});
  bool named = false;
  for (const Proc& p : ranks) {
    EXPECT_EQ(p.exit_code, 1) << describe(ranks);
    named = named || p.err.find("or said different skips ahead (ferry::will_skip)") != std::string::npos;
  }
  EXPECT_TRUE(named) << describe(ranks);
}

TEST(Dist, FourRanksWithGradientAccumulationEqualOneProcess) {
  expect_equals_one_process(4, {"--micro=2", "--batch=16"});
}

// Replicated parameters with accumulation: the other ranks' values come back by an all-gather after
// each backward (sharded ones by the next use's gather, above).
TEST(Dist, TwoRanksWithGradientAccumulationAndReplicatedParametersEqualOneProcess) {
  expect_equals_one_process(2, {"--micro=2", "--batch=16", "--shard-params=0"});
}

// backward_step for the last micro-batch: its backward leaves the other ranks' chunks holding gradients
// for the step to overwrite with the new values (replicated: the step's all-gather).
TEST(Dist, TwoRanksAccumulatingIntoBackwardStepEqualOneProcess) {
  expect_equals_one_process(2, {"--micro=2", "--batch=16", "--shard-params=0", "--api=backward_step"});
  expect_equals_one_process(2, {"--micro=2", "--batch=16", "--api=backward_step"});
}

// save() at world size 2 writes one checkpoint; resumed at 2 the run continues bit for bit as if
// uninterrupted; resumed at 1 (another world size) it continues too, equal to one process to the
// rounding of the summed gradients. The MLP is frozen until step 4, after the save: its parameters'
// own step counts (D62), which the owners hold, must come back from the checkpoint.
TEST(Dist, SaveAtTwoResumeAtTwoEqualsAnUninterruptedRunAndAtOneToo) {
  const std::string whole = temp_dir(), parts = temp_dir(), ckpt = temp_dir() + "/ckpt", single = temp_dir();
  const std::vector<std::string> common{"--batch=8", "--clip=0.5", "--frozen-until=4"};
  auto with = [&](std::vector<std::string> args) {
    args.insert(args.end(), common.begin(), common.end());
    return args;
  };
  const auto uninterrupted = run_world(2, with({"--out=" + whole, "--steps=5"}));
  for (const Proc& p : uninterrupted) ASSERT_EQ(p.exit_code, 0) << describe(uninterrupted);
  const auto first = run_world(2, with({"--steps=3", "--save=" + ckpt}));
  for (const Proc& p : first) ASSERT_EQ(p.exit_code, 0) << describe(first);
  const auto second = run_world(2, with({"--out=" + parts, "--steps=5", "--resume=" + ckpt}));
  for (const Proc& p : second) ASSERT_EQ(p.exit_code, 0) << describe(second);
  // Each parameter's own step count on the rank that owns it, as the worker expects it (the MLP's
  // lagging by its 4 frozen steps); every other rank refused it (D62).
  double own = 0;
  for (const Proc& p : second) {
    EXPECT_LT(result_of(p)["own_step_counts"], result_of(p)["param_tensors"]) << describe(second);
    own += result_of(p)["own_step_counts"];
  }
  EXPECT_EQ(own, result_of(second[0])["param_tensors"]) << describe(second);
  for (int r = 0; r < 2; ++r) {
    const std::string name = "/rank" + std::to_string(r) + ".bin";
    EXPECT_EQ(read_params(parts + name), read_params(whole + name)) << "rank " << r << " after resume";
  }
  // Another world size reads the same checkpoint: one process continues from it.
  const auto alone = launch({{{"FERRY_LOG_LEVEL", "warn"}, {"OMP_NUM_THREADS", "1"}}},
                            with({"--out=" + single, "--steps=5", "--resume=" + ckpt}));
  ASSERT_EQ(alone[0].exit_code, 0) << describe(alone);
  EXPECT_LE(rel_err(read_params(single + "/rank0.bin"), read_params(whole + "/rank0.bin")), 1e-6);
}

// load() in the middle of a run at world size 2, when the state and (sharded) the parameter chunks are
// already spread over the ranks: each rank reads only the state it owns, and the chunks it does not
// own get the loaded values from their owners. Saved before step 1, loaded before step 3, trained from
// step 1 again: bit for bit the uninterrupted run, with sharded and with replicated parameters. The MLP
// is frozen until step 2: its own step counts go back too.
TEST(Dist, LoadingAnEarlierCheckpointMidRunGoesOnAsFromThere) {
  for (const bool replicated : {false, true}) {
    SCOPED_TRACE(replicated ? "replicated parameters" : "sharded parameters");
    const std::string whole = temp_dir(), rewound = temp_dir(), ckpt = temp_dir() + "/ckpt";
    std::vector<std::string> common{"--steps=5", "--clip=0.5", "--frozen-until=2"};
    if (replicated) common.push_back("--shard-params=0");
    auto with = [&](std::vector<std::string> args) {
      args.insert(args.end(), common.begin(), common.end());
      return args;
    };
    const auto uninterrupted = run_world(2, with({"--out=" + whole}));
    for (const Proc& p : uninterrupted) ASSERT_EQ(p.exit_code, 0) << describe(uninterrupted);
    const auto again = run_world(2, with({"--out=" + rewound, "--rewind=1:3", "--rewind-dir=" + ckpt}));
    for (const Proc& p : again) ASSERT_EQ(p.exit_code, 0) << describe(again);
    for (int r = 0; r < 2; ++r) {
      const std::string name = "/rank" + std::to_string(r) + ".bin";
      EXPECT_EQ(read_params(rewound + name), read_params(whole + name)) << "rank " << r;
    }
  }
}

// Every rank writes its own part of the checkpoint; rank 0 reads the files back and compares each part
// with what its writer wrote. Ranks that do not share the directory (here: rank 1 writes into files
// of the same names in another one) fail, and no checkpoint is published.
TEST(Dist, SavingIntoDirectoriesThatAreNotSharedFailsClearly) {
  const std::string ckpt = temp_dir();
  ASSERT_EQ(::mkdir((ckpt + "/rank0").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((ckpt + "/rank1").c_str(), 0755), 0);
  for (const char* role : {"master", "exp_avg", "exp_avg_sq"}) {
    std::ofstream(ckpt + "/rank1/" + role + ".0.f32").flush();  // what rank 1 opens for writing
  }
  const auto ranks = run_world(2, {"--steps=2", "--save=" + ckpt, "--save-per-rank=1"});
  for (const Proc& p : ranks) {
    EXPECT_EQ(p.exit_code, 1) << describe(ranks);
    EXPECT_NE(p.err.find("saving " + ckpt + "/rank"), std::string::npos) << describe(ranks);
  }
  EXPECT_NE(ranks[0].err.find("every rank must write into the same directory"), std::string::npos) << describe(ranks);
  std::ifstream manifest(ckpt + "/rank0/manifest.txt");
  EXPECT_FALSE(manifest.good()) << "a checkpoint was published";
  std::ifstream data(ckpt + "/rank0/master.0.f32");
  EXPECT_FALSE(data.good()) << "the failed save's files were left behind";
}

TEST(Dist, ADeadRankFailsTheOthersWithinTheTimeout) {
  const auto t0 = Clock::now();
  const std::vector<Proc> ranks = run_world(2, {"--steps=5", "--die-at-step=2", "--die-rank=1"}, /*timeout_s=*/10);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(ranks[1].exit_code, 3) << describe(ranks);
  EXPECT_EQ(ranks[0].exit_code, 1) << "the survivor must fail, not hang or succeed\n" << describe(ranks);
  EXPECT_NE(ranks[0].err.find("a rank died, or did not take part within dist-timeout"), std::string::npos)
      << describe(ranks);
  EXPECT_LT(seconds, 60) << describe(ranks);
}

TEST(Dist, RanksThatDisagreeOnTheWorldSizeFailClearly) {
  const int port = free_port();
  auto r0 = rank_env(0, 2, port, 10), r1 = rank_env(1, 3, port, 10);
  const std::vector<Proc> ranks = launch({r0, r1}, {"--steps=1", "--batch=12"});
  for (const Proc& p : ranks) {
    EXPECT_EQ(p.exit_code, 1) << describe(ranks);
    const bool clear = p.err.find("ranks disagree on the world size") != std::string::npos ||
                       p.err.find("not every rank of world size 3 joined") != std::string::npos;
    EXPECT_TRUE(clear) << describe(ranks);
  }
}

TEST(Dist, RanksWithDifferentChunkLayoutsFailClearlyBeforeAnyCollectiveOnChunks) {
  const int port = free_port();
  const std::vector<Proc> ranks = launch({rank_env(0, 2, port, 10), rank_env(1, 2, port, 10)}, {"--steps=2"}, 120,
                                         {{}, {"--chunk-size=8KiB"}});
  for (const Proc& p : ranks) {
    EXPECT_EQ(p.exit_code, 1) << describe(ranks);
    EXPECT_NE(p.err.find("the ranks' chunk layouts differ"), std::string::npos) << describe(ranks);
  }
}

TEST(Dist, AskingForNcclWithoutCudaChunksFailsClearly) {
  const std::vector<Proc> ranks = run_world(2, {"--steps=1", "--dist-backend=nccl"}, 10);
  for (const Proc& p : ranks) {
    EXPECT_EQ(p.exit_code, 1) << describe(ranks);
    EXPECT_NE(p.err.find("dist-backend 'nccl' needs the chunks on CUDA devices, but this run's device is simulated"),
              std::string::npos)
        << describe(ranks);
  }
}

// The environment srun gives each task, and nothing else: no MASTER_ADDR, MASTER_PORT or RANK.
std::map<std::string, std::string> srun_env(int rank, int world, const std::string& nodelist, long long job_id) {
  return {{"SLURM_PROCID", std::to_string(rank)},    {"SLURM_STEP_NUM_TASKS", std::to_string(world)},
          {"SLURM_NTASKS", std::to_string(world)},   {"SLURM_LOCALID", std::to_string(rank)},
          {"SLURM_STEP_NODELIST", nodelist},         {"SLURM_JOB_NODELIST", nodelist},
          {"SLURM_JOB_ID", std::to_string(job_id)},  {"FERRY_DIST_TIMEOUT", "30"},
          {"FERRY_LOG_LEVEL", "info"},               {"OMP_NUM_THREADS", "1"}};
}

bool launcher_variables_inherited() {
  for (const char* key : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
    if (std::getenv(key)) return true;
  }
  return false;
}

TEST(Dist, SrunTasksRendezvousAtTheStepsFirstNodeWithoutExports) {
  if (launcher_variables_inherited()) GTEST_SKIP() << "this test's own environment sets RANK or MASTER_*";
  // The job id that gives a free port: ferry's port for a SLURM job is 15000 + id % 10000.
  const int port = free_port_in(15000, 25000);
  const long long job = 3'000'000LL + (port - 15000);
  const std::vector<Proc> ranks =
      launch({srun_env(0, 2, "127.0.0.[1-2]", job), srun_env(1, 2, "127.0.0.[1-2]", job)}, {"--steps=2"});
  const std::string joining =
      "joining 127.0.0.1:" + std::to_string(port) + " (the first node of SLURM_STEP_NODELIST=127.0.0.[1-2])";
  for (const Proc& p : ranks) {
    EXPECT_EQ(p.exit_code, 0) << describe(ranks);
    EXPECT_NE((p.out + p.err).find(joining), std::string::npos) << describe(ranks);
  }
}

TEST(Dist, ABatchScriptOfSeveralTasksFailsAtOnceNamingSrun) {
  if (launcher_variables_inherited()) GTEST_SKIP() << "this test's own environment sets RANK or MASTER_*";
  // What sbatch --ntasks=2 gives the script itself: SLURM_PROCID=0 and SLURM_NTASKS=2, no step.
  std::map<std::string, std::string> batch = srun_env(0, 2, "127.0.0.1", 12);
  batch.erase("SLURM_STEP_NUM_TASKS");
  batch.erase("SLURM_STEP_NODELIST");
  const std::vector<Proc> ran = launch({batch}, {"--steps=1"});
  EXPECT_EQ(ran[0].exit_code, 1) << describe(ran);
  EXPECT_NE(ran[0].err.find("SLURM gave this job 2 tasks (SLURM_NTASKS), but this process was not started by srun"),
            std::string::npos)
      << describe(ran);
  EXPECT_LT(ran[0].seconds, 20) << "failed at once, not after dist-timeout (30 s)\n" << describe(ran);
  const std::vector<Proc> alone = launch({batch}, {"--steps=1", "--world-size=1"});
  EXPECT_EQ(alone[0].exit_code, 0) << "--world-size=1 runs it alone\n" << describe(alone);
}

// GLOO_SOCKET_IFNAME is honoured: the loopback interface by name trains; an interface this host lacks
// fails on every rank naming the variable (ignored, it would train over the loopback).
TEST(Dist, GlooBindsTheInterfacesGlooSocketIfnameNames) {
  const int port = free_port();
  std::vector<std::map<std::string, std::string>> envs;
  for (int r = 0; r < 2; ++r) {
    envs.push_back(rank_env(r, 2, port, 10));
    envs.back()["GLOO_SOCKET_IFNAME"] = "lo";
  }
  const std::vector<Proc> named = launch(envs, {"--steps=1"});
  for (const Proc& p : named) EXPECT_EQ(p.exit_code, 0) << describe(named);
  const int other_port = free_port();
  for (int r = 0; r < 2; ++r) {
    envs[r] = rank_env(r, 2, other_port, 10);
    envs[r]["GLOO_SOCKET_IFNAME"] = "ferrynone0";
  }
  const std::vector<Proc> missing = launch(envs, {"--steps=1"});
  for (const Proc& p : missing) {
    EXPECT_EQ(p.exit_code, 1) << describe(missing);
    EXPECT_NE(p.err.find("GLOO_SOCKET_IFNAME names the network interface 'ferrynone0'"), std::string::npos)
        << describe(missing);
  }
}

TEST(Dist, AnUnreachableMasterFailsClearlyWithinTheTimeout) {
  const std::vector<Proc> ranks = launch({rank_env(1, 2, free_port(), 3)}, {"--steps=1"});
  EXPECT_EQ(ranks[0].exit_code, 1) << describe(ranks);
  EXPECT_NE(ranks[0].err.find("could not reach the rendezvous store at 127.0.0.1:"), std::string::npos)
      << describe(ranks);
  EXPECT_LT(ranks[0].seconds, 30) << describe(ranks);
}

}  // namespace
