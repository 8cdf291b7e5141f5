#pragma once
// CpuAdam: Adam/AdamW over flat host buffers (chunks), one fused pass per chunk, vectorized with the
// best instruction set this CPU has (chosen at run time) and parallel over OpenMP threads.
//
// Per element it reads the fp32 master param, the grad (fp32, bf16 or fp16), exp_avg and exp_avg_sq,
// and writes master, moments and optionally a bf16/fp16 copy of the param for the device: 28 bytes of
// DRAM traffic per parameter with bf16 grads and a bf16 copy. Grads are multiplied by grad_scale
// (clip coefficient / loss scale) in the same pass.
//
// Contract
//  - Spans are non-owning; their memory must stay valid and untouched by others until update()
//    returns, or until the future of update_async() is ready.
//  - No partial update: update() first checks the grads for inf/NaN (a grad-only read) unless the
//    caller says it already did (UpdateOptions::grads_checked, e.g. after grad_norm_sq() for clipping);
//    with a non-finite grad nothing is written and the result says so.
//  - Step counts are per parameter group: advance_step(g) once per optimizer step, before that step's
//    update()s of group g; the bias corrections use the count at the time update() is called.
//  - Not thread-safe: call from one thread. update_async() runs updates one at a time, in submission
//    order, on a oneTBB arena owned by this object; the destructor waits for them. The exception:
//    update(), kernel_args() and grad_norm_sq() only read the object (options, step counts), so they may
//    run on several threads at once (HybridAdam: the worker's host jobs beside autograd's thread's
//    device updates on the simulated device) while nothing changes those; update(FrozenGroup, ...)
//    reads nothing of the object's groups, so those may change meanwhile.
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <vector>

#include "../common/config.h"
#include "../common/cpu_features.h"
#include "adam_options.h"
#include "compact_state.h"

namespace ferry {
namespace cpu_adam {
struct KernelTable;
struct AdamKernelArgs;
struct CompactAdamArgs;
}

// One contiguous range of a chunk's optimizer state. All arrays have `numel` elements.
struct AdamSpan {
  float* param = nullptr;                       // fp32 master, updated in place
  const void* grad = nullptr;                   // grad_dtype: kFloat, kBFloat16 or kHalf
  at::ScalarType grad_dtype = at::kFloat;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* param_lowp = nullptr;                   // optional copy of the updated param
  at::ScalarType lowp_dtype = at::ScalarType::Undefined;  // kBFloat16 or kHalf when param_lowp is set
  int64_t numel = 0;
};

struct UpdateOptions {
  double grad_scale = 1.0;     // grads are multiplied by this (clip_coef / loss_scale); finite, > 0
  bool grads_checked = false;  // caller guarantees finite grads: skip the inf/NaN pre-check
};

struct UpdateResult {
  bool applied = false;    // the update was written
  bool nonfinite = false;  // a grad was inf or NaN (then applied == false)
};

struct GradNorm {
  double sum_sq = 0.0;     // sum of (grad * grad_scale)^2, accumulated in fp64 across blocks
  bool nonfinite = false;  // any inf/NaN in the grads
};

struct CpuAdamConfig {
  int threads = 0;              // OpenMP threads per update; 0 = omp_get_max_threads()
  CpuSplit split = CpuSplit::kDynamic;  // how an update is shared among them (thread_split.h)
  std::optional<CpuIsa> isa;    // force a kernel (tests, benchmarks); must be supported by this CPU

  // threads, split and isa from ferry's Config (cpu_threads, cpu_split, cpu_isa).
  static CpuAdamConfig from(const Config& config);
};

class CpuAdam {
 public:
  // Group 0 gets `defaults`.
  explicit CpuAdam(const AdamOptions& defaults = {}, const CpuAdamConfig& config = {});
  ~CpuAdam();
  CpuAdam(const CpuAdam&) = delete;
  CpuAdam& operator=(const CpuAdam&) = delete;

  // Returns the new group's index.
  int add_param_group(const AdamOptions& options);
  int num_param_groups() const { return static_cast<int>(groups_.size()); }
  const AdamOptions& options(int group) const;
  void set_options(int group, const AdamOptions& options);
  void set_lr(int group, double lr);
  int64_t step_count(int group) const;
  // Advances group's step count by one and returns it.
  int64_t advance_step(int group);
  // For resuming from a checkpoint.
  void set_step_count(int group, int64_t step);

  UpdateResult update(int group, const AdamSpan& span, const UpdateOptions& options = {});
  // A group's options and step count as they are now. update(frozen, span) gives the bits update(group,
  // span) gives now, whenever it runs: for an update left running while the caller goes on to change the
  // lr or advance the step (HybridAdam, Note [Update behind the next forward]). A caller may set `step`
  // (>= 1) to a count of its own: HybridAdam's per-parameter step counts (D62).
  struct FrozenGroup {
    AdamOptions options;
    int64_t step = 0;
  };
  FrozenGroup freeze(int group) const;
  UpdateResult update(const FrozenGroup& group, const AdamSpan& span, const UpdateOptions& options = {}) const;
  // Tensor form: contiguous CPU tensors with equal numel; param, exp_avg, exp_avg_sq fp32; grad fp32,
  // bf16 or fp16; param_lowp undefined or bf16/fp16.
  UpdateResult update(int group, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                      const at::Tensor& exp_avg_sq, const at::Tensor& param_lowp = {},
                      const UpdateOptions& options = {});
  // The same over compact state (Note [The compact state format], compact_state.h): checked as the
  // fp32 spans are, and the grads' finiteness likewise; the step count also picks the rounding bits.
  UpdateResult update(int group, const CompactAdamSpan& span, const UpdateOptions& options = {});
  UpdateResult update(const FrozenGroup& group, const CompactAdamSpan& span, const UpdateOptions& options = {}) const;
  cpu_adam::CompactAdamArgs compact_kernel_args(const FrozenGroup& group, const CompactAdamSpan& span,
                                                double grad_scale) const;
  // Queues update(group, span, options) with the group's current options and step count.
  std::future<UpdateResult> update_async(int group, const AdamSpan& span, const UpdateOptions& options = {});
  // Runs `job` on the same queue, after everything queued before it; its exception lands in the
  // future. A job may call update() and grad_norm_sq(): they read the group's options and step count
  // when the job runs, so do not change those while jobs are queued. The job, and everything it
  // captured (views of chunks), is destroyed before its future is ready: whoever waited for it finds
  // no reference of the job's left (Note [A repack waits for held views] counts them).
  std::future<void> run_async(std::function<void()> job);

  // One optimizer step of `group` over all its spans, all or nothing: if any grad is non-finite,
  // nothing is written and the step count is unchanged; otherwise advance_step + update each span.
  UpdateResult step(int group, const std::vector<AdamSpan>& spans, double grad_scale = 1.0);

  // The arguments update(group, span, {grad_scale}) hands its kernel, checked as update() checks them:
  // what a kernel running elsewhere needs to give the same bits (the device update, D53).
  cpu_adam::AdamKernelArgs kernel_args(int group, const AdamSpan& span, double grad_scale) const;
  // The same for update(frozen, span, {grad_scale}): a frozen group's options with a step count of the
  // caller's (HybridAdam: a parameter's own count, D62).
  cpu_adam::AdamKernelArgs kernel_args(const FrozenGroup& group, const AdamSpan& span, double grad_scale) const;

  GradNorm grad_norm_sq(const void* grad, at::ScalarType dtype, int64_t numel, double grad_scale = 1.0) const;
  GradNorm grad_norm_sq(const at::Tensor& grad, double grad_scale = 1.0) const;

  CpuIsa isa() const { return isa_; }
  // The kernels of isa() (cpu_adam/kernels/kernel_abi.h): for benchmarks and tests that call them with
  // arguments of their own (compact_kernel_args and a field changed).
  const cpu_adam::KernelTable& kernels() const { return *kernels_; }
  int threads() const { return threads_; }
  CpuSplit split() const { return split_; }

 private:
  struct Group {
    AdamOptions options;
    int64_t step = 0;
  };
  struct Async;

  const Group& group_at(int group) const;
  UpdateResult run_update(const AdamOptions& options, int64_t step, const AdamSpan& span,
                          const UpdateOptions& update_options) const;
  UpdateResult run_compact(const FrozenGroup& group, const CompactAdamSpan& span,
                           const UpdateOptions& update_options) const;

  std::vector<Group> groups_;
  CpuIsa isa_;
  int threads_;
  CpuSplit split_;
  const cpu_adam::KernelTable* kernels_;
  std::unique_ptr<Async> async_;
};

}  // namespace ferry
