// One rank of a data-parallel run for tests/dist/test_dist.cpp (and, with world size 1, the
// single-process reference): a small language model on the simulated device with a budget that forces
// evictions, HybridAdam (AdamW) over a Communicator from dist::connect(Config from the environment).
// Rank r of N trains on rows [r B/N, (r+1) B/N) of every global batch of B rows.
//
// Options: --out=DIR (writes DIR/rank<R>.bin: every parameter, fp32, in state_dict order) --steps=K
// --batch=B --clip=NORM --micro=M (accumulate_grads over M micro-batches) --api=step|backward_step
// --die-at-step=S --die-rank=R (that rank exits at step S without a word, as a crash would)
// --discard-step=S: at step S, zero_grad() discards the gradients instead of a step
// --save=DIR (after the last step) --resume=DIR (before the first; training goes on to --steps)
// --rewind=K:S --rewind-dir=DIR: save into DIR before step K; before step S (> K) load it and train
// from step K again (a load into an optimizer whose state and parameters are already sharded).
// --save-per-rank=1: rank R saves into DIR/rankR (ranks that do not share the checkpoint directory)
// --frozen-rank=R: rank R's rows give the MLP no gradient (its parameters land on the other ranks only);
// with world size 1, --emulate-world=N makes the reference: the loss is the mean over the N ranks' rows,
// rank R's rows frozen.
// --frozen-until=K: the MLP (up, down) does not require grad before step K, on every rank (a parameter's
// own step count then lags its group's, D62).
// --freeze-spare=1: `spare` does not require grad (a parameter that never trains should not: at N > 1 a
// trainable one that no backward reached holds its chunk's update back to backward's end).
// --spare-from=K: from step K on, `spare` (otherwise never used) is added to the embedding's output, on
// every rank: a trainable parameter that no backward reached before (a task head or an expert used
// for the first time), packed with the head by the warm-up repack and landing after it in backward
// (Note [A gradient after its chunk's update]).
// --warmup-iterations=W: SchedulerOptions::warmup_iterations (the repack comes after W iterations).
// --hold-view-rank=R: rank R keeps a detach() of up.weight for the whole run (its warm-up repack waits
// for it: Note [A repack waits for held views]).
// --eval-every=K: after every K-th step an evaluation forward (no backward) on the rank's rows.
// --shard-params=0: every rank keeps every parameter chunk (Note [Sharded parameters] off).
// --reshard=0 / --reshard-gap=G (default 0: every group given up after forward):
// SchedulerOptions::reshard_after_forward / reshard_min_gap. --align=0: SchedulerOptions::align_to_trace
// off (the strict rule).
// --reorder-rank=R: from the second step on, rank R uses the head before the rest in forward (ranks with
// different use orders once the parameters are sharded).
// --state-format=compact: HybridAdamOptions::state_format (with --precision=bf16).
// --sync-update=1: HybridAdamOptions::update_behind_forward off (every host update written when the
// step returns). --stall-ms=T (--api=step): before every step, a job of T ms on the host updates' worker,
// ahead of the updates the step leaves running (a slow host: the next forward then meets them still running).
// --eval-without-optimizer=1: after everything above, the optimizer destroyed and one evaluation forward.
// --touch-between-steps=1: after every step, an op on every parameter of the module (a copy, as a user
// logging weights would): counted as read (touched_ok; with sharded parameters the value checked against
// the master) or refused with ferry's error (touched_refused).
// --write-between-steps=1: after every step, every parameter scaled by 0.9 in place (as a user's clamp
// or re-initialisation would write it; Note [Writes to parameters]): needs --shard-params=0 at N > 1.
// --loss-term-after-forward=1: after each model.forward(), an L2 term on up.weight added to the loss and
// head.weight read (Note [Between forward and backward]: uses, gathered on every rank as in forward).
// --forwards=F: each step's rows in F parts, each in a model.forward() of its own, then one backward of
// the sum of the parts' losses / F (Note [Several forwards]: one iteration).
// --copies=stream: the parameter stores copy on the stream-model engine (chunk/stream_model_engine.h:
// copies pending until waited for, as on CUDA) instead of the synchronous one.
// --nan-step=S --nan-rank=R: at step S, rank R's gradient of emb.weight (layout chunk 0, whose state is on
// the device) is NaN: the step skips that chunk (backward_step) or everything (step), as in one process.
// --checkpoint=1: the MLP as two ferry::checkpoint segments (with --activations=auto: the plan agreed
// across ranks; --device-capacity may differ per rank). Reports plans= and plan= (K kept, r recomputed).
// --drop-mlp=P: LayerDrop on the MLP: each step skips it with probability P, drawn from the step's index
// (the same draw on every rank and in the reference); --say-skips=1: the skip is said ahead
// (ferry::will_skip); --say-skips-rank=R: only rank R says it (ranks that disagree). Reports mlp_skipped=
// (steps), diverged= (iterations that gave the trace up), retraced= (iterations that recorded it after
// the warm-up), hinted= and hints_broken= (trace positions), demand_gathers= (group gathers not started
// ahead of their use), unclaimed= (prefetched gathers no use claimed).
// --precision=... and every other ferry option. Prints one line "FERRY_DIST_RESULT key=value ...".
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../../chunk/stream_model_engine.h"
#include "../../common/config.h"
#include "../../common/logging.h"
#include "../../dist/process_group.h"
#include "../../hooks/chunked_model.h"
#include "../../optim/hybrid_adam.h"
#include "small_lm.h"

namespace {

using ferry::test::kDim;
using ferry::test::kSeq;
using ferry::test::kVocab;
using ferry::test::SmallLm;

std::string option(const std::vector<std::string>& rest, const std::string& key, const std::string& fallback) {
  const std::string prefix = "--" + key + "=";
  for (const auto& a : rest) {
    if (a.rfind(prefix, 0) == 0) return a.substr(prefix.size());
  }
  return fallback;
}

// The activation plan as K (kept) and r (recomputed) per segment; "-" when none applies.
std::string plan_string(const std::vector<char>& keep) {
  std::string s;
  for (char k : keep) s += k != 0 ? 'K' : 'r';
  return s.empty() ? "-" : s;
}

int run(int argc, char** argv) {
  std::vector<std::string> rest;
  ferry::Config config = ferry::Config::from_args(argc, argv, &rest);
  config.device = ferry::DeviceKind::kSimulated;
  if (config.chunk_size_bytes == 0) config.chunk_size_bytes = 4096;
  if (config.device_budget_bytes == 0) config.device_budget_bytes = 6 * 4096;
  const std::string out = option(rest, "out", "");
  const int steps = std::stoi(option(rest, "steps", "4"));
  const int64_t batch = std::stoll(option(rest, "batch", "8"));
  const double clip = std::stod(option(rest, "clip", "0"));
  const int micro = std::stoi(option(rest, "micro", "1"));
  const std::string api = option(rest, "api", "step");
  const int die_at = std::stoi(option(rest, "die-at-step", "-1"));
  const int die_rank = std::stoi(option(rest, "die-rank", "-1"));
  const int frozen_rank = std::stoi(option(rest, "frozen-rank", "-1"));
  const int frozen_until = std::stoi(option(rest, "frozen-until", "0"));
  const int spare_from = std::stoi(option(rest, "spare-from", "-1"));
  const std::string save = option(rest, "save", ""), resume = option(rest, "resume", "");
  const std::string rewind = option(rest, "rewind", ""), rewind_dir = option(rest, "rewind-dir", "");
  const int rewind_to = rewind.empty() ? -1 : std::stoi(rewind.substr(0, rewind.find(':')));
  const int rewind_at = rewind.empty() ? -1 : std::stoi(rewind.substr(rewind.find(':') + 1));
  TORCH_CHECK(rewind.empty() || (rewind_to < rewind_at && !rewind_dir.empty()),
              "--rewind=K:S needs K < S and --rewind-dir, got --rewind=", rewind);
  bool rewound = false;
  const int discard_step = std::stoi(option(rest, "discard-step", "-1"));
  const int emulate = std::stoi(option(rest, "emulate-world", "1"));
  const int reorder_rank = std::stoi(option(rest, "reorder-rank", "-1"));
  const int eval_every = std::stoi(option(rest, "eval-every", "0"));
  const int stall_ms = std::stoi(option(rest, "stall-ms", "0"));
  const bool touch = option(rest, "touch-between-steps", "0") == "1";
  const bool write_between = option(rest, "write-between-steps", "0") == "1";
  const bool term_after_forward = option(rest, "loss-term-after-forward", "0") == "1";
  const int forwards = std::stoi(option(rest, "forwards", "1"));
  const int nan_step = std::stoi(option(rest, "nan-step", "-1"));
  const int nan_rank = std::stoi(option(rest, "nan-rank", "-1"));
  const double drop_mlp = std::stod(option(rest, "drop-mlp", "0"));
  const bool say_skips = option(rest, "say-skips", "0") == "1";
  const int say_skips_rank = std::stoi(option(rest, "say-skips-rank", "-1"));
  TORCH_CHECK(drop_mlp == 0 || (resume.empty() && rewind.empty() && nan_step < 0),
              "--drop-mlp counts the MLP's own steps from the first: no --resume, --rewind or --nan-step with it");
  TORCH_CHECK(emulate == 1 || config.world_size == 1, "--emulate-world is for the single-process reference");
  TORCH_CHECK(forwards == 1 || (emulate == 1 && micro == 1 && batch % (config.world_size * forwards) == 0),
              "--forwards needs --emulate-world=1, --micro=1 and a batch that splits over ranks and forwards");
  TORCH_CHECK(batch % (config.world_size * micro) == 0, "batch must split evenly over ranks and micro-batches");

  ferry::log::configure(config.log_level, config.rank);
  auto comm = ferry::dist::connect(config);
  torch::manual_seed(ferry::test::kRank0Seed + config.rank);  // different per rank on purpose: rank 0's values must win
  SmallLm net;
  if (option(rest, "freeze-spare", "0") == "1") net->spare.set_requires_grad(false);
  net->checkpointed = option(rest, "checkpoint", "0") == "1";
  ferry::ChunkedModelOptions model_options;
  model_options.scheduler.reshard_min_gap = std::stoll(option(rest, "reshard-gap", "0"));
  model_options.scheduler.reshard_after_forward = option(rest, "reshard", "1") == "1";
  model_options.scheduler.warmup_iterations = std::stoi(option(rest, "warmup-iterations", "1"));
  const int64_t model_warmup = model_options.scheduler.warmup_iterations;
  model_options.scheduler.align_to_trace = option(rest, "align", "1") == "1";
  const std::string copies = option(rest, "copies", "sync");
  TORCH_CHECK(copies == "sync" || copies == "stream", "--copies must be sync or stream, got ", copies);
  if (copies == "stream") model_options.copy_engine = [] { return std::make_unique<ferry::StreamModelCopyEngine>(); };
  ferry::ChunkedModel model(net.ptr(), config, std::move(model_options));
  ferry::AdamOptions adam_options;
  adam_options.lr = 1e-2;
  adam_options.weight_decay = 0.1;
  ferry::HybridAdamOptions options(adam_options);
  options.max_grad_norm = clip;
  options.accumulate_grads = micro > 1;
  options.device_state_chunks = 1;
  options.communicator = comm;
  options.shard_params = option(rest, "shard-params", "1") == "1";
  options.update_behind_forward = option(rest, "sync-update", "0") != "1";
  options.state_format = ferry::state_format_from_string(option(rest, "state-format", "fp32"));
  auto optimizer = std::make_unique<ferry::HybridAdam>(model, options);  // --eval-without-optimizer drops it
  ferry::HybridAdam& adam = *optimizer;
  const ferry::ChunkStoreStats built = adam.state_store().stats();
  const int64_t construct_state_bytes = built.host.current_bytes + built.device.current_bytes;
  torch::Tensor held_view;  // --hold-view-rank
  if (config.rank == std::stoi(option(rest, "hold-view-rank", "-1"))) held_view = net->up->weight.detach();
  bool poison = false;  // --nan-step
  if (config.rank == nan_rank) {
    net->emb->weight.register_hook([&poison](const torch::Tensor& g) { return poison ? g * NAN : g; });
  }
  int first_step = 0;
  if (!resume.empty()) {
    adam.load(resume);
    first_step = static_cast<int>(adam.step_count(0));
  }

  const int64_t rows = batch / config.world_size, micro_rows = rows / micro;
  double loss_sum = 0, grad_norm = 0, eval_loss = 0;
  std::string grad_norms;  // grad_norms=: every step's, as hex floats
  int64_t evictions = 0, overlapped = 0, deferred = 0, touched_ok = 0, touched_refused = 0;
  int64_t forward_end_bytes = 0;  // parameter chunk bytes present here at the end of the last forward
  auto present_param_bytes = [&] {
    int64_t bytes = 0;
    for (int64_t c = 0; c < model.layout().num_chunks(); ++c) {
      const ferry::ChunkInfo info = model.store().chunk_info(model.param_chunk(c));
      if (info.location != ferry::Location::kNone) bytes += info.nbytes;
    }
    return bytes;
  };
  int64_t ring_before_last = 0;  // ring bytes sent before the last step
  int64_t overflows = 0;
  // --drop-mlp: steps without the MLP (and those of them it would have trained in); the trace's counts.
  int64_t mlp_skipped = 0, mlp_skipped_trainable = 0, diverged = 0, retraced = 0, hinted = 0, hints_broken = 0;
  for (int step = first_step; step < steps; ++step) {
    if (!rewound && step == rewind_at) {
      adam.load(rewind_dir);
      TORCH_CHECK(adam.step_count(0) == rewind_to, "--rewind: loaded step count ", adam.step_count(0));
      rewound = true;
      step = rewind_to;
    } else if (!rewound && step == rewind_to) {
      adam.save(rewind_dir);
    }
    if (step == die_at && config.rank == die_rank) std::_Exit(3);
    poison = step == nan_step;
    if (step == steps - 1 && comm) ring_before_last = comm->stats().ring_bytes_sent;
    for (auto* layer : {&net->up, &net->down}) {
      for (auto& p : (*layer)->parameters()) p.set_requires_grad(step >= frozen_until);
    }
    net->use_spare = spare_from >= 0 && step >= spare_from;
    if (drop_mlp > 0) {  // the same draw on every rank: the uses stay the same on every rank
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
      net->skip_mlp = torch::rand({1}, gen).item<double>() < drop_mlp;
      net->say_skip = say_skips || config.rank == say_skips_rank;
      mlp_skipped += net->skip_mlp;
      mlp_skipped_trainable += net->skip_mlp && step >= frozen_until;  // a step the MLP's own count misses
    }
    const ferry::test::Batch global = ferry::test::global_batch(step, batch);
    const torch::Tensor idx = global.idx, target = global.target;
    ferry::StepResult r;
    for (int m = 0; m < micro; ++m) {
      const int64_t begin = config.rank * rows + m * micro_rows;
      const torch::Tensor x = idx.slice(0, begin, begin + micro_rows), y = target.slice(0, begin, begin + micro_rows);
      torch::Tensor loss;
      for (int f = 1; f < forwards; ++f) {  // the first F - 1 parts; the last one below
        const int64_t part = micro_rows / forwards;
        auto l = model.forward([&] {
          return torch::nn::functional::cross_entropy(
                     net->forward(x.slice(0, (f - 1) * part, f * part), config.rank == frozen_rank).reshape({-1, kVocab}),
                     y.slice(0, (f - 1) * part, f * part).reshape({-1})) / forwards;
        });
        loss = loss.defined() ? loss + l : l;
      }
      const torch::Tensor last_x = forwards == 1 ? x : x.slice(0, (forwards - 1) * (micro_rows / forwards));
      const torch::Tensor last_y = forwards == 1 ? y : y.slice(0, (forwards - 1) * (micro_rows / forwards));
      auto last = model.forward([&] {
        if (config.rank == reorder_rank && step >= 1) (void)net->head(torch::zeros({1, kDim}));  // after sharding
        auto ce = [&](const torch::Tensor& xs, const torch::Tensor& ys, bool frozen) {
          return torch::nn::functional::cross_entropy(net->forward(xs, frozen).reshape({-1, kVocab}), ys.reshape({-1}));
        };
        if (emulate == 1) return ce(last_x, last_y, config.rank == frozen_rank) / (micro * forwards);
        const int64_t part = x.size(0) / emulate;  // the rows the emulated ranks would have
        torch::Tensor sum;
        for (int v = 0; v < emulate; ++v) {
          auto l = ce(x.slice(0, v * part, (v + 1) * part), y.slice(0, v * part, (v + 1) * part), v == frozen_rank);
          sum = sum.defined() ? sum + l : l;
        }
        return sum / (emulate * micro);
      });
      loss = loss.defined() ? loss + last : last;
      forward_end_bytes = present_param_bytes();
      if (term_after_forward) {  // between forward() and backward(): uses, as in forward
        loss = loss + 1e-3 * net->up->weight.pow(2).sum() / micro;
        TORCH_CHECK(std::isfinite(net->head->weight.sum().item<double>()), "head.weight read between forward and backward");
      }
      loss_sum += loss.item<double>();
      if (m + 1 < micro) {
        model.backward(loss);
      } else if (step == discard_step) {
        model.backward(loss);
        adam.zero_grad();  // the parameters keep their values on every rank
        r.applied = true;
      } else if (api == "backward_step") {  // with micro-batches: the last one's backward and the step
        r = adam.backward_step(loss);
      } else {
        model.backward(loss);
        if (stall_ms > 0) {  // behind backward's jobs (the step waits for those), ahead of the step's
          (void)adam.run_on_worker([stall_ms] { std::this_thread::sleep_for(std::chrono::milliseconds(stall_ms)); });
        }
        r = adam.step();
      }
      const ferry::IterationStats it = model.last_iteration();
      evictions += it.evictions;
      diverged += it.diverged;
      retraced += it.traced && it.index >= model_warmup;
      hinted += it.trace_hinted;
      hints_broken += it.trace_hints_broken;
    }
    overflows += r.overflow;
    TORCH_CHECK(r.applied != (step == nan_step) && r.overflow == (step == nan_step), "step ", step,
                r.applied ? " was" : " was not", " applied", r.overflow ? " (overflow)" : "");
    if (eval_every > 0 && step % eval_every == 0) {  // an evaluation forward between steps (no backward)
      torch::NoGradGuard no_grad;
      const torch::Tensor x = idx.slice(0, config.rank * rows, (config.rank + 1) * rows);
      auto l = model.forward([&] {
        return torch::nn::functional::cross_entropy(net->forward(x).reshape({-1, kVocab}),
                                                    target.slice(0, config.rank * rows, (config.rank + 1) * rows).reshape({-1}));
      });
      model.end_iteration();
      eval_loss += l.item<double>();
    }
    if (touch) {  // Note [Ops outside the scopes]: another rank's chunk fails clearly, never crashes
      torch::NoGradGuard no_grad;
      std::vector<std::pair<int64_t, torch::Tensor>> read;
      for (int64_t p = 0; p < model.num_params(); ++p) {
        try {
          read.emplace_back(p, model.param(p).clone());
          ++touched_ok;
        } catch (const c10::Error& e) {
          const std::string what = e.what_without_backtrace();
          TORCH_CHECK(what.find("in a chunk another rank owns") != std::string::npos, "touching ",
                      model.param_name(p), ": ", what);
          ++touched_refused;
        }
      }
      // Sharded, what a read got is the owner's new value, round(master), although the update may still
      // have been running (the master view waits for every update).
      for (const auto& [p, v] : read) {
        if (!options.shard_params) break;
        TORCH_CHECK(torch::equal(v, adam.master(p).to(model.compute_dtype())), "touching ", model.param_name(p),
                    ": read a value other than the step's");
      }
    }
    if (write_between) {  // every rank writes alike; the owners' masters take it (Note [Writes to parameters])
      torch::NoGradGuard no_grad;
      for (int64_t p = 0; p < model.num_params(); ++p) model.param(p).mul_(0.9);
    }
    overlapped += r.overlapped_chunks;
    deferred += r.deferred_chunks;
    grad_norm = r.grad_norm;
    std::ostringstream bits;  // every step's norm, exactly
    bits << std::hexfloat << r.grad_norm;
    grad_norms += (grad_norms.empty() ? "" : ",") + bits.str();
    if (micro > 1) adam.zero_grad();
  }
  if (!save.empty()) {
    adam.save(option(rest, "save-per-rank", "0") == "1" ? save + "/rank" + std::to_string(config.rank) : save);
  }
  const ferry::ChunkStoreStats ss = adam.state_store().stats();
  int64_t param_chunk_bytes = 0;  // all parameter chunks
  for (int64_t c = 0; c < model.layout().num_chunks(); ++c) {
    param_chunk_bytes += model.store().chunk_info(model.param_chunk(c)).nbytes;
  }
  const int64_t param_held_bytes = present_param_bytes();  // those with a payload here after the last step
  // Reading a parameter of a chunk another rank owns, not fetched now, fails naming what to call.
  int remote_view_refused = 0;
  for (int64_t p = 0; p < model.num_params() && param_held_bytes < param_chunk_bytes; ++p) {
    if (model.store().location(model.param_chunk(model.layout().slots()[p].chunk)) != ferry::Location::kNone) continue;
    try {
      (void)model.param_values(p);
    } catch (const c10::Error& e) {
      remote_view_refused = std::string(e.what()).find("state_dict() gathers every parameter") != std::string::npos;
    }
    break;
  }
  // D62: each parameter's own step count is read on the rank that owns its state; another refuses,
  // naming the owner. The MLP's count lags its group's by the steps it was frozen (--frozen-until).
  // --nan-step under backward_step: the chunk of emb.weight missed that step (step() skips every chunk,
  // and the group's count with them).
  int64_t skipped_chunk = -1;
  if (api == "backward_step" && nan_step >= first_step && nan_step < steps) {
    for (int64_t p = 0; p < model.num_params(); ++p) {
      if (model.param_name(p) == "emb.weight") skipped_chunk = model.layout().slots()[p].chunk;
    }
  }
  int64_t own_step_counts = 0;
  for (int64_t p = 0; p < model.num_params(); ++p) {
    try {
      const int64_t count = adam.param_step_count(p);
      const std::string& name = model.param_name(p);
      const bool mlp = name.rfind("up.", 0) == 0 || name.rfind("down.", 0) == 0;
      const int64_t missed = model.layout().slots()[p].chunk == skipped_chunk ? 1 : 0;
      const int64_t mlp_missed = std::min(frozen_until, steps) + mlp_skipped_trainable;
      const int64_t want = name == "spare" ? (spare_from >= 0 ? std::max(0, steps - spare_from) : 0)
                           : mlp ? adam.step_count(0) - mlp_missed - missed
                                 : adam.step_count(0) - missed;
      TORCH_CHECK(count == want, "param_step_count of ", name, ": ", count, ", expected ", want);
      ++own_step_counts;
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      TORCH_CHECK(what.find("(ask the rank that owns it)") != std::string::npos, "param_step_count(", p, "): ", what);
    }
  }
  const auto shards = adam.param_shards();
  const ferry::dist::ParamShardStats ps = shards ? shards->stats() : ferry::dist::ParamShardStats{};
  const ferry::dist::CommStats cs = comm ? comm->stats() : ferry::dist::CommStats{};  // training's, not the checks'
  ferry::NamedTensors weights = adam.state_dict();  // gathers the masters from their owners
  ferry::NamedTensors compute = model.state_dict();  // the compute copy, every chunk fetched (a collective too)
  if (!out.empty()) {
    std::ofstream f(out + "/rank" + std::to_string(config.rank) + ".bin", std::ios::binary);
    for (int64_t p = 0; p < model.num_params(); ++p) {
      const torch::Tensor v = compute[p].second.to(torch::kFloat).contiguous();
      // The compute copy is its master rounded to the compute dtype (fp32: the master itself).
      const torch::Tensor rounded = weights[p].second.to(model.compute_dtype()).to(torch::kFloat);
      TORCH_CHECK(torch::equal(v, rounded), "parameter ", p, " differs from its master");
      f.write(static_cast<const char*>(v.data_ptr()), static_cast<std::streamsize>(v.nbytes()));
    }
    TORCH_CHECK(f.good(), "could not write ", out);
  }
  std::cout << "FERRY_DIST_RESULT rank=" << config.rank << " world=" << config.world_size
            << " chunks=" << model.layout().num_chunks() << " param_chunk_bytes=" << param_chunk_bytes << " param_held_bytes=" << param_held_bytes << " remote_view_refused=" << remote_view_refused
            << " forward_end_bytes=" << forward_end_bytes << " gathers=" << ps.gathers << " prefetched=" << ps.prefetched
            << " released=" << ps.released_chunks << " landed_on_device=" << ps.landed_on_device << " groups=" << (shards ? shards->num_groups() : 0)
            << " state_bytes=" << ss.host.current_bytes + ss.device.current_bytes
            << " state_device_bytes=" << ss.device.current_bytes << " construct_state_bytes=" << construct_state_bytes << " evictions=" << evictions
            << " ring_bytes=" << cs.ring_bytes_sent
            << " last_step_ring_bytes=" << cs.ring_bytes_sent - ring_before_last << " overlapped=" << overlapped << " deferred=" << deferred
            << " accumulation_jobs=" << (micro > 1 ? adam.pipelined_jobs_started() : 0)
            << " values_from_owners=" << adam.values_from_owners() << " steps=" << steps << " grad_norm=" << grad_norm
            << " grad_norms=" << grad_norms
            << " loss=" << loss_sum << " eval_loss=" << eval_loss << " touched_ok=" << touched_ok
            << " touched_refused=" << touched_refused << " own_step_counts=" << own_step_counts
            << " param_tensors=" << model.num_params() << " overflows=" << overflows
            << " mlp_skipped=" << mlp_skipped << " diverged=" << diverged << " retraced=" << retraced
            << " hinted=" << hinted << " hints_broken=" << hints_broken << " demand_gathers=" << ps.gathers - ps.prefetched
            << " unclaimed=" << ps.unclaimed
            << " plans=" << model.activations().plans() << " plan=" << plan_string(model.activations().keep()) << std::endl;
  if (option(rest, "eval-without-optimizer", "0") == "1") {
    // Training done, the optimizer dropped, the model evaluated: its sharded groups are still gathered
    // at their use (a collective), with nothing of the optimizer left to wait for.
    optimizer.reset();
    torch::NoGradGuard no_grad;
    const torch::Tensor idx = torch::randint(kVocab, {rows, kSeq}, torch::kLong), target = (idx * 5 + 1) % kVocab;
    auto l = model.forward([&] {
      return torch::nn::functional::cross_entropy(net->forward(idx).reshape({-1, kVocab}), target.reshape({-1}));
    });
    model.end_iteration();
    std::cout << "FERRY_DIST_EVAL_WITHOUT_OPTIMIZER loss=" << l.item<double>() << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    std::cerr << "dist_worker: " << e.what_without_backtrace() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "dist_worker: " << e.what() << std::endl;
  }
  return 1;
}
