// CpuAdam: argument checks, the OpenMP split, the async worker. The arithmetic lives in kernels/.
//
// Threads: one `omp parallel` region per update() covering the whole span, in the grains of
// thread_split.h (claimed as threads go, or split evenly: CpuAdamConfig::split). Spans of fewer grains
// than threads use fewer threads (a fork/join costs more than it saves on small spans).
#include "cpu_adam.h"

#include <c10/util/Exception.h>
#include <omp.h>
#include <oneapi/tbb/task_arena.h>

#include <cmath>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>

#include "../common/logging.h"
#include "kernel_types.h"
#include "kernels/kernel_abi.h"
#include "thread_split.h"

namespace ferry {

cpu_adam::GradType grad_type_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cpu_adam::GradType::kF32;
    case at::kBFloat16: return cpu_adam::GradType::kBf16;
    case at::kHalf: return cpu_adam::GradType::kF16;
    default: break;
  }
  TORCH_CHECK(false, "ferry: CpuAdam: expected grad dtype Float, BFloat16 or Half, got ", t);
}

cpu_adam::LowpType lowp_type_of(at::ScalarType t) {
  switch (t) {
    case at::ScalarType::Undefined: return cpu_adam::LowpType::kNone;
    case at::kBFloat16: return cpu_adam::LowpType::kBf16;
    case at::kHalf: return cpu_adam::LowpType::kF16;
    default: break;
  }
  TORCH_CHECK(false, "ferry: CpuAdam: expected param_lowp dtype BFloat16 or Half (or none), got ", t);
}

namespace {

const cpu_adam::KernelTable& kernels_for(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return cpu_adam::kScalarKernels;
    case CpuIsa::kAvx2: return cpu_adam::kAvx2Kernels;
    case CpuIsa::kAvx512: return cpu_adam::kAvx512Kernels;
    case CpuIsa::kAvx512Bf16: return cpu_adam::kAvx512Bf16Kernels;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown CpuIsa");
}

// What every span (fp32 or compact state) must be: a size, known dtypes, a compute copy and its dtype
// given together. Then the span's own arrays, non-null unless it is empty (`arrays_set`, `arrays`).
void check_span_common(int64_t numel, at::ScalarType grad_dtype, const void* param_lowp, at::ScalarType lowp_dtype,
                       bool arrays_set, const char* arrays) {
  TORCH_CHECK(numel >= 0, "ferry: CpuAdam: expected numel >= 0, got ", numel);
  grad_type_of(grad_dtype);
  lowp_type_of(lowp_dtype);
  if (numel == 0) return;  // empty spans may carry null pointers
  TORCH_CHECK(arrays_set, "ferry: CpuAdam: expected non-null ", arrays, " for a span of ", numel, " elements");
  TORCH_CHECK((param_lowp != nullptr) == (lowp_dtype != at::ScalarType::Undefined),
              "ferry: CpuAdam: param_lowp and lowp_dtype must be given together, got pointer ", param_lowp ? "set" : "null",
              " and dtype ", lowp_dtype);
}

void check_span(const AdamSpan& s) {
  check_span_common(s.numel, s.grad_dtype, s.param_lowp, s.lowp_dtype, s.param && s.grad && s.exp_avg && s.exp_avg_sq,
                    "param, grad, exp_avg and exp_avg_sq");
}

void check_grad_scale(double grad_scale) {
  TORCH_CHECK(std::isfinite(grad_scale) && grad_scale > 0.0, "ferry: CpuAdam: expected a finite grad_scale > 0, got ",
              grad_scale);
}

}  // namespace

// ---- async worker ------------------------------------------------------------------------------

// ThreadSanitizer (scripts/tsan.sh) does not see oneTBB hand a task to its worker (libtbb is not
// built with it), so it would call the worker's first touch of anything the submitter wrote a race.
// Said explicitly: what the submitter did before the hand-off happens before the task runs.
#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
static void handed_off(void* p) { __tsan_release(p); }
static void taken_over(void* p) { __tsan_acquire(p); }
#else
static void handed_off(void*) {}
static void taken_over(void*) {}
#endif

// Updates of one chunk must apply in submission order, and task_arena::enqueue promises only roughly
// FIFO: so jobs go into our own queue, and one drain task at a time (enqueued when the queue goes from
// empty to non-empty) runs them in order on a oneTBB worker.
struct CpuAdam::Async {
  tbb::task_arena arena{1, 0};  // one slot, none reserved for callers: runs on a oneTBB worker
  std::mutex mutex;
  std::condition_variable idle;
  std::deque<std::function<void()>> queue;
  bool draining = false;

  void submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      queue.push_back(std::move(job));
      if (draining) return;
      draining = true;
    }
    handed_off(this);
    arena.enqueue([this] {
      taken_over(this);
      drain();
    });
  }

  void drain() {
    for (;;) {
      std::function<void()> job;
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (queue.empty()) {
          draining = false;
          idle.notify_all();
          return;
        }
        job = std::move(queue.front());
        queue.pop_front();
      }
      job();  // packaged tasks: exceptions land in their futures
    }
  }

  ~Async() {
    std::unique_lock<std::mutex> lock(mutex);
    idle.wait(lock, [&] { return !draining; });
  }
};

// ---- CpuAdamConfig ----------------------------------------------------------------------------

CpuAdamConfig CpuAdamConfig::from(const Config& config) {
  CpuAdamConfig c;
  c.threads = config.cpu_threads;
  c.split = config.cpu_split;
  if (config.cpu_isa != "auto") c.isa = parse_cpu_isa(config.cpu_isa);
  return c;
}

// ---- CpuAdam ----------------------------------------------------------------------------------

CpuAdam::CpuAdam(const AdamOptions& defaults, const CpuAdamConfig& config)
    : isa_(config.isa.value_or(best_cpu_isa())),
      threads_(config.threads > 0 ? config.threads : omp_get_max_threads()),
      split_(config.split),
      kernels_(nullptr),
      async_(std::make_unique<Async>()) {
  TORCH_CHECK(config.threads >= 0, "ferry: CpuAdam: expected threads >= 0 (0 = all), got ", config.threads);
  if (!cpu_supports(isa_)) {
    const CpuFeatures& f = cpu_features();
    TORCH_CHECK(false, "ferry: CpuAdam: the ", to_string(isa_), " kernel ",
                above_cap(f, isa_) ? std::string("is above FERRY_CPU_ISA_MAX=") + to_string(*f.cap)
                                   : std::string("needs CPU features this machine lacks"),
                " (best available: ", to_string(best_cpu_isa()), "; Config::cpu_isa or --cpu-isa=auto picks it)");
  }
  kernels_ = &kernels_for(isa_);
  add_param_group(defaults);
  static std::once_flag logged;
  std::call_once(logged, [&] {
    log::info("cpu_adam: ", to_string(isa_), " kernel (", kernels_->vector_width, " fp32 lanes), ", threads_,
              " threads", config.isa ? " (forced)" : "");
  });
}

CpuAdam::~CpuAdam() = default;

int CpuAdam::add_param_group(const AdamOptions& options) {
  options.validate();
  groups_.push_back({options, 0});
  return num_param_groups() - 1;
}

const CpuAdam::Group& CpuAdam::group_at(int group) const {
  TORCH_CHECK(group >= 0 && group < num_param_groups(), "ferry: CpuAdam: expected a param group in [0, ",
              num_param_groups(), "), got ", group);
  return groups_[group];
}

const AdamOptions& CpuAdam::options(int group) const { return group_at(group).options; }

void CpuAdam::set_options(int group, const AdamOptions& options) {
  group_at(group);
  options.validate();
  groups_[group].options = options;
}

void CpuAdam::set_lr(int group, double lr) {
  AdamOptions o = options(group);
  o.lr = lr;
  set_options(group, o);
}

int64_t CpuAdam::step_count(int group) const { return group_at(group).step; }

int64_t CpuAdam::advance_step(int group) {
  group_at(group);
  return ++groups_[group].step;
}

void CpuAdam::set_step_count(int group, int64_t step) {
  group_at(group);
  TORCH_CHECK(step >= 0, "ferry: CpuAdam: expected step count >= 0, got ", step);
  groups_[group].step = step;
}

GradNorm CpuAdam::grad_norm_sq(const void* grad, at::ScalarType dtype, int64_t numel, double grad_scale) const {
  const cpu_adam::GradType type = grad_type_of(dtype);
  TORCH_CHECK(numel >= 0, "ferry: CpuAdam: expected numel >= 0, got ", numel);
  TORCH_CHECK(numel == 0 || grad, "ferry: CpuAdam: expected a non-null grad for ", numel, " elements");
  check_grad_scale(grad_scale);
  // One part per grain, summed in grain order: the same bits whatever the threads (thread_split.h).
  std::vector<cpu_adam::GradStats> parts(static_cast<size_t>(grain_count(numel)));
  const float scale = static_cast<float>(grad_scale);
  for_each_grain(numel, threads_, split_, [&](int64_t b, int64_t e, int64_t g) {
    parts[static_cast<size_t>(g)] = kernels_->grad_stats(grad, type, scale, b, e);
  });
  GradNorm out;
  for (const auto& p : parts) {
    out.sum_sq += p.sum_sq;
    out.nonfinite = out.nonfinite || p.nonfinite;
  }
  return out;
}

GradNorm CpuAdam::grad_norm_sq(const at::Tensor& grad, double grad_scale) const {
  TORCH_CHECK(grad.defined() && grad.device().is_cpu() && grad.is_contiguous(),
              "ferry: CpuAdam: expected a contiguous CPU grad tensor, got ", grad.defined() ? grad.toString() : "undefined");
  return grad_norm_sq(grad.data_ptr(), grad.scalar_type(), grad.numel(), grad_scale);
}

namespace {

cpu_adam::AdamKernelArgs make_kernel_args(const AdamOptions& o, int64_t step, const AdamSpan& s, double grad_scale) {
  cpu_adam::AdamKernelArgs a;
  a.param = s.param;
  a.grad = s.grad;
  a.exp_avg = s.exp_avg;
  a.exp_avg_sq = s.exp_avg_sq;
  a.param_lowp = s.param_lowp;
  a.grad_type = grad_type_of(s.grad_dtype);
  a.lowp_type = lowp_type_of(s.lowp_dtype);
  a.decoupled_decay = o.mode == AdamMode::kAdamW;
  a.grad_scale = static_cast<float>(grad_scale);
  a.beta1 = static_cast<float>(o.beta1);
  a.one_minus_beta1 = static_cast<float>(1.0 - o.beta1);
  a.beta2 = static_cast<float>(o.beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
  a.eps = static_cast<float>(o.eps);
  a.weight_decay = a.decoupled_decay ? 0.0f : static_cast<float>(o.weight_decay);
  a.decay_factor = a.decoupled_decay ? static_cast<float>(1.0 - o.lr * o.weight_decay) : 1.0f;
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step));
  a.step_size = static_cast<float>(o.lr / bc1);
  a.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  return a;
}

}  // namespace

cpu_adam::AdamKernelArgs CpuAdam::kernel_args(int group, const AdamSpan& span, double grad_scale) const {
  const Group& g = group_at(group);
  TORCH_CHECK(g.step >= 1, "ferry: CpuAdam: kernel_args() of group ", group, " before advance_step() (step count is 0)");
  check_span(span);
  check_grad_scale(grad_scale);
  return make_kernel_args(g.options, g.step, span, grad_scale);
}

cpu_adam::AdamKernelArgs CpuAdam::kernel_args(const FrozenGroup& group, const AdamSpan& span, double grad_scale) const {
  TORCH_CHECK(group.step >= 1, "ferry: CpuAdam: kernel_args() of a frozen group with step count ", group.step,
              " (freeze it after advance_step())");
  check_span(span);
  check_grad_scale(grad_scale);
  return make_kernel_args(group.options, group.step, span, grad_scale);
}

UpdateResult CpuAdam::run_update(const AdamOptions& o, int64_t step, const AdamSpan& s,
                                 const UpdateOptions& u) const {
  if (!u.grads_checked && s.numel > 0) {
    if (grad_norm_sq(s.grad, s.grad_dtype, s.numel, u.grad_scale).nonfinite) return {false, true};
  }
  const cpu_adam::AdamKernelArgs a = make_kernel_args(o, step, s, u.grad_scale);
  const cpu_adam::AdamFn fn = kernels_->adam;
  for_each_grain(s.numel, threads_, split_, [&](int64_t b, int64_t e, int64_t) { fn(a, b, e); });
  return {true, false};
}

UpdateResult CpuAdam::update(int group, const AdamSpan& span, const UpdateOptions& options) {
  const Group& g = group_at(group);
  TORCH_CHECK(g.step >= 1, "ferry: CpuAdam: update() of group ", group, " before advance_step() (step count is 0)");
  check_span(span);
  check_grad_scale(options.grad_scale);
  return run_update(g.options, g.step, span, options);
}

CpuAdam::FrozenGroup CpuAdam::freeze(int group) const {
  const Group& g = group_at(group);
  return FrozenGroup{g.options, g.step};
}

UpdateResult CpuAdam::update(const FrozenGroup& group, const AdamSpan& span, const UpdateOptions& options) const {
  TORCH_CHECK(group.step >= 1, "ferry: CpuAdam: update() of a frozen group with step count ", group.step,
              " (freeze it after advance_step())");
  check_span(span);
  check_grad_scale(options.grad_scale);
  return run_update(group.options, group.step, span, options);
}

namespace {

void check_compact_span(const CompactAdamSpan& s) {
  check_span_common(s.numel, s.grad_dtype, s.param_lowp, s.lowp_dtype,
                    s.master && s.grad && s.exp_avg && s.exp_avg_scale && s.exp_avg_sq && s.exp_avg_sq_scale,
                    "master, grad, exp_avg, exp_avg_sq and their scales (compact state)");
}

// The step's stream of rounding bits: murmur3's finaliser of the step count.
uint32_t rounding_seed(int64_t step) {
  auto k = static_cast<uint32_t>(static_cast<uint64_t>(step) * 0x9e3779b97f4a7c15ull >> 32);
  k ^= k >> 16;
  k *= 0x85ebca6bu;
  k ^= k >> 13;
  k *= 0xc2b2ae35u;
  return k ^ (k >> 16);
}

}  // namespace

cpu_adam::CompactAdamArgs CpuAdam::compact_kernel_args(const FrozenGroup& group, const CompactAdamSpan& span,
                                                       double grad_scale) const {
  TORCH_CHECK(group.step >= 1, "ferry: CpuAdam: compact_kernel_args() of a frozen group with step count ", group.step,
              " (freeze it after advance_step())");
  check_compact_span(span);
  check_grad_scale(grad_scale);
  AdamSpan fp32;  // the hyper-parameters' half of the fp32 arguments
  fp32.grad_dtype = span.grad_dtype;
  fp32.lowp_dtype = span.lowp_dtype;
  cpu_adam::CompactAdamArgs a;
  a.hyper = make_kernel_args(group.options, group.step, fp32, grad_scale);
  a.master = span.master;
  a.grad = span.grad;
  a.exp_avg = span.exp_avg;
  a.exp_avg_scale = span.exp_avg_scale;
  a.exp_avg_sq = span.exp_avg_sq;
  a.exp_avg_sq_scale = span.exp_avg_sq_scale;
  a.param_lowp = span.param_lowp;
  a.rounding_seed = rounding_seed(group.step);
  a.element_offset = static_cast<uint32_t>(span.element_offset);
  return a;
}

UpdateResult CpuAdam::run_compact(const FrozenGroup& group, const CompactAdamSpan& s, const UpdateOptions& u) const {
  const cpu_adam::CompactAdamArgs a = compact_kernel_args(group, s, u.grad_scale);
  if (!u.grads_checked && s.numel > 0) {
    if (grad_norm_sq(s.grad, s.grad_dtype, s.numel, u.grad_scale).nonfinite) return {false, true};
  }
  const cpu_adam::CompactAdamFn fn = kernels_->compact_adam;
  for_each_grain(s.numel, threads_, split_, [&](int64_t b, int64_t e, int64_t) { fn(a, b, e); });
  return {true, false};
}

UpdateResult CpuAdam::update(int group, const CompactAdamSpan& span, const UpdateOptions& options) {
  const Group& g = group_at(group);
  TORCH_CHECK(g.step >= 1, "ferry: CpuAdam: update() of group ", group, " before advance_step() (step count is 0)");
  return run_compact(FrozenGroup{g.options, g.step}, span, options);
}

UpdateResult CpuAdam::update(const FrozenGroup& group, const CompactAdamSpan& span, const UpdateOptions& options) const {
  return run_compact(group, span, options);
}

UpdateResult CpuAdam::update(int group, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                             const at::Tensor& exp_avg_sq, const at::Tensor& param_lowp,
                             const UpdateOptions& options) {
  auto check = [](const at::Tensor& t, const char* name, bool fp32) {
    TORCH_CHECK(t.defined(), "ferry: CpuAdam: expected a tensor for ", name, ", got undefined");
    TORCH_CHECK(t.device().is_cpu(), "ferry: CpuAdam: expected ", name, " on the CPU, got ", t.device());
    TORCH_CHECK(t.is_contiguous(), "ferry: CpuAdam: expected a contiguous ", name);
    TORCH_CHECK(!fp32 || t.scalar_type() == at::kFloat, "ferry: CpuAdam: expected ", name, " of dtype Float, got ",
                t.scalar_type());
  };
  check(param, "param", true);
  check(grad, "grad", false);
  check(exp_avg, "exp_avg", true);
  check(exp_avg_sq, "exp_avg_sq", true);
  const int64_t n = param.numel();
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{grad, "grad"}, {exp_avg, "exp_avg"},
                                {exp_avg_sq, "exp_avg_sq"}}) {
    TORCH_CHECK(t.numel() == n, "ferry: CpuAdam: expected ", name, " with ", n, " elements (as param), got ", t.numel());
  }
  AdamSpan s{param.data_ptr<float>(), grad.data_ptr(), grad.scalar_type(), exp_avg.data_ptr<float>(),
             exp_avg_sq.data_ptr<float>(), nullptr, at::ScalarType::Undefined, n};
  if (param_lowp.defined()) {
    check(param_lowp, "param_lowp", false);
    TORCH_CHECK(param_lowp.numel() == n, "ferry: CpuAdam: expected param_lowp with ", n, " elements (as param), got ",
                param_lowp.numel());
    s.param_lowp = param_lowp.data_ptr();
    s.lowp_dtype = param_lowp.scalar_type();
  }
  return update(group, s, options);
}

std::future<UpdateResult> CpuAdam::update_async(int group, const AdamSpan& span, const UpdateOptions& options) {
  const Group& g = group_at(group);
  TORCH_CHECK(g.step >= 1, "ferry: CpuAdam: update_async() of group ", group, " before advance_step() (step count is 0)");
  check_span(span);
  check_grad_scale(options.grad_scale);
  auto task = std::make_shared<std::packaged_task<UpdateResult()>>(
      [this, o = g.options, step = g.step, span, options] { return run_update(o, step, span, options); });
  std::future<UpdateResult> result = task->get_future();
  async_->submit([task] { (*task)(); });
  return result;
}

std::future<void> CpuAdam::run_async(std::function<void()> job) {
  TORCH_CHECK(job, "ferry: CpuAdam: run_async() needs a job");
  // The captures go when the job returns or throws, before packaged_task makes the future ready: a
  // waiter that then counts the references to a chunk (a repack) must not race the worker's release.
  auto task = std::make_shared<std::packaged_task<void()>>([job = std::move(job)]() mutable {
    std::function<void()> run;
    run.swap(job);
    run();
  });
  std::future<void> result = task->get_future();
  async_->submit([task] { (*task)(); });
  return result;
}

UpdateResult CpuAdam::step(int group, const std::vector<AdamSpan>& spans, double grad_scale) {
  group_at(group);
  check_grad_scale(grad_scale);
  for (const AdamSpan& s : spans) {
    check_span(s);
    if (s.numel > 0 && grad_norm_sq(s.grad, s.grad_dtype, s.numel, grad_scale).nonfinite) return {false, true};
  }
  advance_step(group);
  UpdateOptions u;
  u.grad_scale = grad_scale;
  u.grads_checked = true;
  for (const AdamSpan& s : spans) update(group, s, u);
  return {true, false};
}

}  // namespace ferry
