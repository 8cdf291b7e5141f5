#pragma once
// Interception of parameter use in unmodified LibTorch models (Note [Parameter interception]).
//
// LibTorch modules have no hooks and forward() is not virtual, so ferry watches the dispatcher: a
// boxed fallback is registered on a mode-style dispatch key (kInterceptKey) that sits above Autograd.
// The key is off everywhere except inside an InterceptionScope (thread-local), and on a thread that
// watches ops outside the scopes (Note [Ops outside the scopes], below); autograd's engine carries that
// thread-local state to the threads that run backward. For each op the
// fallback finds the tensor arguments whose storage is registered (a chunk's device storage) and maps
// each to its parameter by storage offset (views such as W.t() share the storage), calls the
// listener's pre_use for each, runs the op with the key excluded (so ops inside the op are not seen
// again), and calls post_use in reverse order, also when the op throws. Ops that only make views are
// hooked too: torch checks a view's bounds against the storage's current size, which is 0 while the
// chunk is off the device. The hooks' own ops (chunk copies) run with the key excluded.
//
// Contract: register/unregister are thread-safe and may not be called from inside a listener.
// Listeners are called on whatever thread runs the op, and must outlive their registrations.
#include <c10/core/DispatchKey.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <vector>

namespace ferry {

// DeferredInit: a functionality key above Autograd that LibTorch itself never registers kernels or
// fallbacks for (it belongs to the out-of-tree torchdistx). Checked at registration: if something
// else registered a fallback on it first, torch refuses ferry's when libferry loads (a loud error,
// never a silent double interception).
constexpr c10::DispatchKey kInterceptKey = c10::DispatchKey::DeferredInit;

class UseListener {
 public:
  virtual ~UseListener() = default;
  virtual void pre_use(int64_t param) = 0;
  virtual void post_use(int64_t param) = 0;
  // Note [Ops outside the scopes]: an op outside every InterceptionScope, on a watching thread, is
  // about to use the storage that holds `param` (the parameter at the tensor's offset, else the
  // storage's first). Returns kChecked once the op may use that storage as it is, or kUse when the op
  // is a use of `param` as inside a scope (the listener is inside an iteration: between forward and
  // backward); the fallback then calls pre_use/post_use around it and casts as in a scope. May throw
  // (the error of a write, or why the storage cannot be used): the op then does not run.
  enum class Outside { kChecked, kUse };
  virtual Outside before_outside_use(int64_t /*param*/) { return Outside::kChecked; }
};

// One parameter's element range in a registered storage.
struct ParamRange {
  int64_t begin = 0;  // storage offset, elements
  int64_t end = 0;    // one past the last element
  int64_t param = 0;  // the listener's parameter index
};

// Registers `storage` (ranges need not be sorted; must not overlap). Replaces an earlier registration.
void register_storage(const c10::StorageImpl* storage, UseListener* listener, std::vector<ParamRange> ranges);
void unregister_storage(const c10::StorageImpl* storage);
// How many storages are registered (tests).
int64_t registered_storages();
// Whether `storage` is registered (a chunk some listener holds parameters in).
bool storage_registered(const c10::StorageImpl* storage);

// Turns interception on for this thread (and the autograd work it starts) for its lifetime.
class InterceptionScope {
 public:
  InterceptionScope();
  ~InterceptionScope();
  InterceptionScope(const InterceptionScope&) = delete;
  InterceptionScope& operator=(const InterceptionScope&) = delete;
};

// Note [Ops outside the scopes]
// Between iterations the wrapped module is an ordinary module (D35): any op may read or write its
// parameters. Two things can make such an op unsafe, *hazards*:
//  - a chunk still being written on another thread: HybridAdam leaves its host updates running when
//    step() returns (Note [Update behind the next forward], optim/deferred_updates.h); an op would read
//    half-updated values, or have its own write overwritten;
//  - a chunk with no memory here: with sharded parameters (world size N > 1) a chunk another rank owns
//    is given up between its uses; torch's kernels do not check, so an op would crash the process.
// A third hazard is inside an iteration: a model between forward() and backward(), whose chunks may be
// off the device or on their way (Note [Between forward and backward], hooks/model_iteration.cpp); there
// the listener calls an op a use.
// Whoever creates a hazard counts it (outside_hazard_begin() before the write is queued or the chunks
// are sharded; outside_hazard_end() when the write is over, failed or not, or the sharding is gone) and
// makes the thread that drives the model watch: watch_outside_uses(). On a watching thread the fallback
// sees every op, also outside InterceptionScopes; for each registered storage among an op's tensors it
// calls the listener's before_outside_use (with the parameter at the tensor's offset, else the
// storage's first), which waits for that chunk's write, orders the caller after a copy still bringing
// the chunk's bytes (a chunk an update sent back up), and fails clearly if the chunk has no memory,
// then runs the op as usual (no pre/post use, no casts); or, if the listener says the op is a use
// (kUse: the third hazard), runs it as inside a scope. The thread stops watching at its first op
// that finds no hazard anywhere in the process: from then on its ops cost nothing again until the next
// watch. Inside an InterceptionScope nothing changes (pre_use waits and fetches itself).
// The key and torch's thread-local state: autograd runs each node of a backward with the thread-local
// state the backward started with, and puts it back after the node, so a key switched off inside a
// node (the watch ending in a plain backward on a watching thread) comes back on when the node ends,
// with nothing on this thread holding it. Such a key is *stale*: the thread remembers that it switched
// the key on (key ours), and the fallback switches a stale key off again at its next op and runs that
// op as if unseen. A key a thread did not switch on itself (autograd's workers inherit it from the
// thread that called backward) is used as in a scope; a listener that is not inside an iteration
// treats such a use as an op outside the scopes (ChunkedModel: pre_use between iterations).
// Not covered: other threads (for a write: they call HybridAdam::synchronize() first) and reads that
// are no op (a tensor's data_ptr(); torch::save of a CPU tensor copies its bytes directly).
// Thread-safe; the hazard count is process-wide, the watch is per thread.
void outside_hazard_begin();
// Ferry's own ops on the chunks (an optimizer step's copies, a checkpoint's reads) are never uses of a
// parameter, whatever the phase: a public entry point of ferry that may run between forward() and
// backward() holds an OwnOps (a count per thread), and a listener asks in_own_ops() before it calls an
// op outside the scopes a use. Scopes opened inside one (backward_step()'s backward()) intercept as
// usual: OwnOps switches nothing off.
class OwnOps {
 public:
  OwnOps();
  ~OwnOps();
  OwnOps(const OwnOps&) = delete;
  OwnOps& operator=(const OwnOps&) = delete;
};
bool in_own_ops();
void outside_hazard_end();
int64_t outside_hazards();
void watch_outside_uses();
bool watching_outside_uses();

// Note [Parallel initializers]: LibTorch modules initialize their parameters in their constructors
// with uniform_/normal_ (nn::Linear's kaiming_uniform_), on one thread: about 8 ns per element, 100 s
// and more for a 12B model, and torch's normal_ is 6x slower again in bf16. While a
// ParallelInitScope is alive on a thread, the interception key is on there too and the fallback
// replaces `uniform_` and `normal_` without an explicit generator, on contiguous CPU tensors of at
// least 2^16 elements, with a fill on every core: blocks of 2^20 elements, each drawn in fp32 by its
// own generator seeded from (one draw of the default CPU generator, block index), then rounded to the
// tensor's dtype. The values follow torch::manual_seed and do not depend on the thread count; they
// differ bit for bit from torch's serial stream (same distribution). Every other op runs as usual.
// InitScope holds one (ferry/hooks/init_scope.h).
class ParallelInitScope {
 public:
  ParallelInitScope();
  ~ParallelInitScope();
  ParallelInitScope(const ParallelInitScope&) = delete;
  ParallelInitScope& operator=(const ParallelInitScope&) = delete;
};
// Elements filled by the parallel initializers in this process (tests).
int64_t parallel_init_elements();

// Count of ops the fallback has seen in this process, of those that used a registered storage inside
// an InterceptionScope, and of those that did outside one while background writes ran (and waited).
struct InterceptionCounters {
  int64_t ops = 0;
  int64_t ops_with_params = 0;
  int64_t outside_uses = 0;
};
InterceptionCounters interception_counters();

}  // namespace ferry
