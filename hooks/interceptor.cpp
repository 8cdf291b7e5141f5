// Note [Parameter interception]: see interceptor.h.
#include "interceptor.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <ATen/ops/empty.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "../common/logging.h"

namespace ferry {
namespace {

struct Entry {
  UseListener* listener = nullptr;
  std::vector<ParamRange> ranges;  // sorted by begin
};

std::shared_mutex& registry_mutex() {
  static std::shared_mutex m;
  return m;
}
std::unordered_map<const c10::StorageImpl*, Entry>& registry() {
  static std::unordered_map<const c10::StorageImpl*, Entry> r;
  return r;
}
std::atomic<int64_t> registry_size{0};
std::atomic<int64_t> op_count{0};
std::atomic<int64_t> param_op_count{0};
std::atomic<int64_t> outside_use_count{0};

// Who holds the interception key on this thread: InterceptionScopes, ParallelInitScopes and the watch
// (Note [Ops outside the scopes]). The key is switched on when the first holder needs it and off when the
// last lets go, but only where ferry switched it on: on a thread that inherited it (autograd's
// workers get the state of the thread that started backward) it is left as it came.
thread_local int scope_depth = 0;
thread_local int parallel_init_depth = 0;  // Note [Parallel initializers]
thread_local bool watching = false;
thread_local bool key_ours = false;

void hold_key() {
  if (c10::impl::tls_is_dispatch_key_included(kInterceptKey)) return;
  c10::impl::tls_set_dispatch_key_included(kInterceptKey, true);
  key_ours = true;
}

void drop_key_if_unheld() {
  if (!key_ours || scope_depth > 0 || parallel_init_depth > 0 || watching) return;
  c10::impl::tls_set_dispatch_key_included(kInterceptKey, false);
  key_ours = false;
}

// Inside an op, where torch may put the key back when the op's autograd node ends (Note [Ops outside the
// scopes], the key and torch's thread-local state): switched off, but still ours, so that a key put
// back is known as stale.
void switch_key_off_inside_an_op() {
  if (key_ours) c10::impl::tls_set_dispatch_key_included(kInterceptKey, false);
}

std::atomic<int64_t> hazards{0};  // Note [Ops outside the scopes]

struct Use {
  UseListener* listener;
  int64_t param;
  at::ScalarType dtype;  // of the managed tensor (a model's parameters share the compute dtype)
  bool operator==(const Use& o) const { return listener == o.listener && param == o.param; }
};

// Mixed precision without hand casts: in an op that uses a managed parameter held in a reduced
// precision (bf16/fp16), every other fp32/fp64 tensor argument the op does not write is cast to the
// parameter's dtype first, as a user of a bf16 model would cast inputs by hand (torch's autocast
// does the same for its lower-precision ops). Written arguments (BatchNorm's running statistics, an
// out= tensor) are left alone: a cast copy would lose the write.
bool needs_cast(const at::Tensor& t, at::ScalarType to) {
  return t.defined() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble) && t.scalar_type() != to;
}

void cast_inputs(const c10::OperatorHandle& op, torch::jit::Stack* stack, at::ScalarType to) {
  // Backward ops get their dtypes from autograd, not from a user: their fp32 arguments are meant
  // (e.g. CUDA's layer norm saves fp32 mean/rstd for bf16 input).
  if (op.schema().name().find("_backward") != std::string::npos) return;
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const auto* alias = args[i].alias_info();
    if (alias && alias->isWrite()) continue;
    c10::IValue& v = (*stack)[first + i];
    if (v.isTensor()) {
      if (needs_cast(v.toTensor(), to)) v = v.toTensor().to(to);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      bool any = false;
      for (const at::Tensor& t : list.vec()) any = any || needs_cast(t, to);
      if (!any) continue;
      std::vector<at::Tensor> cast;
      for (const at::Tensor& t : list.vec()) cast.push_back(needs_cast(t, to) ? t.to(to) : t);
      v = c10::IValue(c10::List<at::Tensor>(cast));
    }
  }
}

using Uses = c10::SmallVector<Use, 4>;  // no heap allocation for the usual op (a few parameters)

// The parameter whose range holds the tensor's offset. `any_offset`: a tensor elsewhere in a registered
// storage (padding, a whole-storage view) counts too, as a use of the storage's first parameter (a
// hazard covers a whole storage: a chunk).
void find_use(const at::Tensor& t, Uses& uses, bool any_offset) {
  // An empty tensor reads no memory. An empty parameter's range is empty, so its offset used to fall
  // into the range of the parameter packed after it, a use of that one (a trace that changed with the
  // repack: a divergence after the warm-up).
  if (!t.defined() || !t.has_storage() || t.numel() == 0) return;
  const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  std::shared_lock<std::shared_mutex> lock(registry_mutex());
  auto it = registry().find(storage);
  if (it == registry().end()) return;
  const auto& ranges = it->second.ranges;
  if (ranges.empty()) return;
  const int64_t offset = t.storage_offset();
  auto r = std::upper_bound(ranges.begin(), ranges.end(), offset,
                            [](int64_t off, const ParamRange& range) { return off < range.begin; });
  int64_t param = -1;
  if (r != ranges.begin() && offset < std::prev(r)->end) param = std::prev(r)->param;
  if (param < 0 && any_offset) param = ranges.front().param;
  if (param < 0) return;
  const Use use{it->second.listener, param, t.scalar_type()};
  if (std::find(uses.begin(), uses.end(), use) == uses.end()) uses.push_back(use);
}

void collect(const c10::IValue& v, Uses& uses, bool any_offset) {
  if (v.isTensor()) {
    find_use(v.toTensor(), uses, any_offset);
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList().vec()) find_use(t, uses, any_offset);
  } else if (v.isList()) {  // generic lists, optional-tensor lists (index) included
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor()) find_use(e.toTensor(), uses, any_offset);
    }
  }
}

void run_excluded(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard exclude(kInterceptKey);
  op.callBoxed(stack);
}

// Runs the op between its uses' pre_use and post_use (in reverse order, also when the op throws), with
// the inputs cast to the parameters' reduced precision.
void run_as_uses(const c10::OperatorHandle& op, torch::jit::Stack* stack, const Uses& uses) {
  param_op_count.fetch_add(1, std::memory_order_relaxed);
  // The hooks themselves run ops (chunk copies, zero fills): never intercept those.
  c10::impl::ExcludeDispatchKeyGuard no_reentry(kInterceptKey);
  size_t started = 0;
  auto release = [&] {
    for (size_t i = started; i-- > 0;) {
      try {
        uses[i].listener->post_use(uses[i].param);
      } catch (const std::exception& e) {
        log::error("ferry: post-use hook of parameter ", uses[i].param, " failed: ", e.what());
      }
    }
  };
  const at::ScalarType param_dtype = uses.front().dtype;
  try {
    for (; started < uses.size(); ++started) uses[started].listener->pre_use(uses[started].param);
    if (param_dtype == at::kBFloat16 || param_dtype == at::kHalf) cast_inputs(op, stack, param_dtype);
    op.callBoxed(stack);
  } catch (...) {
    release();
    throw;
  }
  release();
}

// Note [Ops outside the scopes] (interceptor.h): an op outside every scope on a watching thread.
void outside_use(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (hazards.load(std::memory_order_acquire) == 0) {
    // Every hazard is over, and every write published (end() releases): nothing to check until a new
    // hazard starts and its owner makes this thread watch again.
    watching = false;
    switch_key_off_inside_an_op();
    run_excluded(op, stack);
    return;
  }
  Uses uses;
  if (registry_size.load(std::memory_order_acquire) > 0) {
    const size_t num_args = op.schema().arguments().size();
    for (size_t i = stack->size() - num_args; i < stack->size(); ++i) collect((*stack)[i], uses, /*any_offset=*/true);
  }
  if (uses.empty()) {
    run_excluded(op, stack);
    return;
  }
  outside_use_count.fetch_add(1, std::memory_order_relaxed);
  Uses as_uses;  // the listener is inside an iteration: the op is one of its uses
  {
    c10::impl::ExcludeDispatchKeyGuard no_reentry(kInterceptKey);  // the listener's own ops
    for (const Use& use : uses) {
      if (use.listener->before_outside_use(use.param) == UseListener::Outside::kUse) as_uses.push_back(use);
    }
  }
  if (!as_uses.empty()) {
    run_as_uses(op, stack, as_uses);
    return;
  }
  run_excluded(op, stack);
}

// Note [Parallel initializers] (interceptor.h).
std::atomic<int64_t> parallel_init_count{0};
constexpr int64_t kParallelInitMin = int64_t{1} << 16;
constexpr int64_t kParallelInitBlock = int64_t{1} << 20;
constexpr int64_t kParallelInitPiece = int64_t{1} << 13;  // 32 KiB of fp32 scratch per thread

// uniform_(self, from, to, generator) / normal_(self, mean, std, generator) on the stack: fills in
// parallel and leaves the result, or returns false (the op then runs as usual).
bool parallel_init(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& name = op.schema().operator_name();
  const bool uniform = name.name == "aten::uniform_", normal = name.name == "aten::normal_";
  if ((!uniform && !normal) || !name.overload_name.empty() || stack->size() < 4) return false;
  const size_t first = stack->size() - 4;
  const c10::IValue& self_v = (*stack)[first];
  if (!self_v.isTensor() || !(*stack)[first + 3].isNone()) return false;  // an explicit generator: its stream
  const at::Tensor self = self_v.toTensor();
  // A leaf that requires grad under grad mode: the op runs as usual, for autograd's error.
  if (!self.device().is_cpu() || !self.is_contiguous() || self.numel() < kParallelInitMin ||
      !at::isFloatingType(self.scalar_type()) || (self.requires_grad() && c10::GradMode::is_enabled())) {
    return false;
  }
  const double a = (*stack)[first + 1].toDouble(), b = (*stack)[first + 2].toDouble();
  uint64_t seed = 0;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    seed = gen.get<at::CPUGeneratorImpl>()->random64();
  }
  c10::impl::ExcludeDispatchKeyGuard exclude(kInterceptKey);
  const at::Tensor flat = self.detach().view({-1});  // the workers' grad mode is their own
  const int64_t n = flat.numel(), blocks = (n + kParallelInitBlock - 1) / kParallelInitBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(seed ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(k + 1)));
      const at::Tensor block = flat.narrow(0, k * kParallelInitBlock, std::min(kParallelInitBlock, n - k * kParallelInitBlock));
      // Drawn in fp32 (torch's vectorized kernels), in pieces through a small scratch for other dtypes.
      const bool fp32 = block.scalar_type() == at::kFloat;
      const int64_t piece = fp32 ? block.numel() : kParallelInitPiece;
      at::Tensor scratch = fp32 ? at::Tensor() : at::empty({std::min(piece, block.numel())}, at::kFloat);
      for (int64_t at = 0; at < block.numel(); at += piece) {
        const int64_t len = std::min(piece, block.numel() - at);
        at::Tensor fill = fp32 ? block.narrow(0, at, len) : scratch.narrow(0, 0, len);
        if (uniform) {
          fill.uniform_(a, b, gen);
        } else {
          fill.normal_(a, b, gen);
        }
        if (!fp32) block.narrow(0, at, len).copy_(fill);
      }
    }
  });
  parallel_init_count.fetch_add(n, std::memory_order_relaxed);
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
  stack->emplace_back(self);
  return true;
}

void intercept(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  op_count.fetch_add(1, std::memory_order_relaxed);
  if (parallel_init_depth > 0 && parallel_init(op, stack)) return;
  if (scope_depth == 0 && parallel_init_depth == 0) {
    if (watching) {
      outside_use(op, stack);
      return;
    }
    if (key_ours) {
      // Stale (Note [Ops outside the scopes], the key and torch's thread-local state): this thread
      // switched the key on, nothing here holds it now, and torch put it back.
      switch_key_off_inside_an_op();
      run_excluded(op, stack);
      return;
    }
    // Else inherited (an autograd worker of a thread in a scope): as in a scope.
  }
  if (registry_size.load(std::memory_order_acquire) == 0) {
    run_excluded(op, stack);
    return;
  }
  Uses uses;
  const size_t num_args = op.schema().arguments().size();
  for (size_t i = stack->size() - num_args; i < stack->size(); ++i) collect((*stack)[i], uses, /*any_offset=*/false);
  if (uses.empty()) {
    run_excluded(op, stack);
    return;
  }
  run_as_uses(op, stack, uses);
}

}  // namespace

ParallelInitScope::ParallelInitScope() {
  hold_key();
  ++parallel_init_depth;
}

ParallelInitScope::~ParallelInitScope() {
  --parallel_init_depth;
  drop_key_if_unheld();
}
int64_t parallel_init_elements() { return parallel_init_count.load(std::memory_order_relaxed); }

TORCH_LIBRARY_IMPL(_, DeferredInit, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&intercept>()); }

void register_storage(const c10::StorageImpl* storage, UseListener* listener, std::vector<ParamRange> ranges) {
  TORCH_CHECK(storage && listener, "ferry: register_storage needs a storage and a listener");
  std::sort(ranges.begin(), ranges.end(), [](const ParamRange& a, const ParamRange& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < ranges.size(); ++i) {
    TORCH_CHECK(ranges[i - 1].end <= ranges[i].begin, "ferry: parameter ranges overlap in one storage");
  }
  std::unique_lock<std::shared_mutex> lock(registry_mutex());
  registry()[storage] = Entry{listener, std::move(ranges)};
  registry_size.store(static_cast<int64_t>(registry().size()), std::memory_order_release);
}

void unregister_storage(const c10::StorageImpl* storage) {
  std::unique_lock<std::shared_mutex> lock(registry_mutex());
  registry().erase(storage);
  registry_size.store(static_cast<int64_t>(registry().size()), std::memory_order_release);
}

int64_t registered_storages() { return registry_size.load(); }

bool storage_registered(const c10::StorageImpl* storage) {
  std::shared_lock<std::shared_mutex> lock(registry_mutex());
  return registry().count(storage) > 0;
}

InterceptionScope::InterceptionScope() {
  hold_key();
  ++scope_depth;
}

InterceptionScope::~InterceptionScope() {
  --scope_depth;
  drop_key_if_unheld();
}

namespace {
thread_local int own_ops_depth = 0;
}
OwnOps::OwnOps() { ++own_ops_depth; }
OwnOps::~OwnOps() { --own_ops_depth; }
bool in_own_ops() { return own_ops_depth > 0; }

void outside_hazard_begin() { hazards.fetch_add(1, std::memory_order_relaxed); }

void outside_hazard_end() {
  // Called from destructors: a mismatch is logged, never thrown (the count then stays at 0).
  int64_t now = hazards.load(std::memory_order_relaxed);
  while (now > 0 && !hazards.compare_exchange_weak(now, now - 1, std::memory_order_release)) {
  }
  if (now <= 0) log::error("ferry: outside_hazard_end() without a hazard begun");
}

int64_t outside_hazards() { return hazards.load(std::memory_order_acquire); }

void watch_outside_uses() {
  hold_key();
  watching = true;
}

bool watching_outside_uses() { return watching; }

InterceptionCounters interception_counters() {
  return {op_count.load(), param_op_count.load(), outside_use_count.load()};
}

}  // namespace ferry
