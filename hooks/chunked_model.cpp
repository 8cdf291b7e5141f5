#include "chunked_model.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full_like.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <cmath>
#include <unordered_map>
#include <unordered_set>

#include "../chunk/copy_engine.h"
#include "../chunk/repack.h"
#include "../common/logging.h"
#include "param_use_recorder.h"

namespace ferry {
namespace {

at::ScalarType dtype_of(Precision p) {
  switch (p) {
    case Precision::kFp32: return at::kFloat;
    case Precision::kBf16: return at::kBFloat16;
    case Precision::kFp16: return at::kHalf;
  }
  return at::kFloat;
}

bool legal(ModelPhase from, ModelPhase to) {
  using P = ModelPhase;
  switch (from) {
    case P::kIdle: return to == P::kForward;
    case P::kForward: return to == P::kForwardDone || to == P::kIdle;
    case P::kForwardDone: return to == P::kBackward || to == P::kIdle || to == P::kForward;
    case P::kBackward: return to == P::kIdle;
  }
  return false;
}

// How many ChunkedModel::backward() calls are running in this process (Note [A backward not through
// model.backward()]).
std::atomic<int> g_model_backwards{0};

struct CountedModelBackward {
  CountedModelBackward() { g_model_backwards.fetch_add(1); }
  ~CountedModelBackward() { g_model_backwards.fetch_sub(1); }
  CountedModelBackward(const CountedModelBackward&) = delete;
  CountedModelBackward& operator=(const CountedModelBackward&) = delete;
};

}  // namespace

// Runs after autograd accumulated a parameter's .grad: hands it to the model's sink.
struct GradLandingHook final : torch::autograd::PostAccumulateGradHook {
  GradLandingHook(ChunkedModel* model, int64_t param) : model(model), param(param) {}
  void operator()(const torch::autograd::Variable& tensor) override { model->land_grad(param, tensor); }
  ChunkedModel* model;
  int64_t param;
};

const char* to_string(ModelPhase phase) {
  switch (phase) {
    case ModelPhase::kIdle: return "idle";
    case ModelPhase::kForward: return "forward";
    case ModelPhase::kForwardDone: return "forward done";
    case ModelPhase::kBackward: return "backward";
  }
  return "?";
}

ChunkedModel::ChunkedModel(std::shared_ptr<torch::nn::Module> module, const Config& config,
                           ChunkedModelOptions options)
    : module_(std::move(module)), config_(config), options_(std::move(options)), dtype_(dtype_of(config.precision)) {
  TORCH_CHECK(module_, "ferry: ChunkedModel needs a module, got null");
  config_.validate();
  device_ = make_device(config_.device);
  // Host memory counts as the device's non-model memory only where the device's memory is host memory.
  const bool counts_host = options_.measure_host_non_model && device_->torch_device().is_cpu();
  const DeviceBudget budget = DeviceBudget::of(config_, *device_, counts_host);
  options_.scheduler.device_budget_bytes = budget.budget_bytes;
  options_.scheduler.device_capacity_bytes = budget.capacity_bytes;
  options_.scheduler.validate();  // the caller's scheduler options, before the module is touched
  const int64_t capacity = budget.capacity_bytes;
  std::unordered_set<const c10::TensorImpl*> seen;
  int64_t wider = 0;  // float64 parameters
  std::string first_wider;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!p.defined() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;  // tied: once
    TORCH_CHECK(p.layout() == at::kStrided && at::isFloatingType(p.scalar_type()), "ferry: parameter ",
                item.key(), " must be a dense floating-point tensor, got ", p.toString(),
                p.layout() == at::kStrided && !p.is_complex() && !p.requires_grad()
                    ? " (a tensor that is not trained, such as an index table, belongs in a buffer: "
                      "register_buffer, which ChunkedModel leaves to the module)"
                    : "");
    // A chunk of another ChunkedModel: both would bind, move and free the same tensors (seen: wrapping
    // twice, or a submodule and then its parent, ran without a word, each model's destructor then
    // giving the parameters plain memory under the other).
    TORCH_CHECK(!p.has_storage() || !storage_registered(p.storage().unsafeGetStorageImpl()), "ferry: parameter ",
                item.key(), " is held by another ChunkedModel already (a module wrapped twice, or a submodule "
                "wrapped and then its parent): wrap each module once, the outermost one you train; destroying "
                "the other ChunkedModel first gives its parameters plain memory again");
    if (p.scalar_type() == at::kDouble && wider++ == 0) first_wider = item.key();
    params_.push_back(p);
    names_.push_back(item.key());
    shapes_.push_back(p.sizes().vec());
    numels_.push_back(p.numel());
  }
  TORCH_CHECK(!params_.empty(), "ferry: the module has no parameters to manage");
  if (wider > 0) {
    log::warn("ferry: ", wider, " parameter(s) are float64 (", first_wider, " first); ferry holds them at ", dtype_,
              " (config.precision) and an optimizer's masters in float32: they train in float32, not float64");
  }
  for (size_t p = 0; p < params_.size(); ++p) impl_index_.emplace_back(params_[p].unsafeGetTensorImpl(), p);
  std::sort(impl_index_.begin(), impl_index_.end());
  grad_in_slot_.assign(params_.size(), 0);
  policy_ = std::make_shared<OptEvictionPolicy>();
  build({});
  for (auto& mark : marks_) mark = store_->make_mark();  // the device never changes (a repack keeps it)
  const c10::Device device = store_->device();
  for (auto& b : module_->buffers(/*recurse=*/true)) {
    if (b.defined() && b.device() != device) b.set_data(b.to(device));
  }
  std::unique_ptr<MemoryProbe> probe = std::move(options_.probe);
  if (!probe && counts_host) {
    probe = make_heap_probe([this] {
      const ChunkStoreStats s = store_->stats();
      return s.device.current_bytes + s.host.current_bytes + s.host_buffers.cached_bytes;
    });
  }
  if (!probe) probe = make_memory_probe(device_);
  scheduler_ = std::make_unique<Scheduler>(*store_, policy_, std::move(probe), options_.scheduler, tensor_of_param_,
                                           chunk_of_param_);
  int64_t bytes = 0;
  for (int64_t n : numels_) bytes += n * static_cast<int64_t>(c10::elementSize(dtype_));
  log::info("ferry: ChunkedModel manages ", params_.size(), " parameters (", format_bytes(bytes), " as ", dtype_,
            ") in ", layout_.num_chunks(), " chunks of ", format_bytes(chunk_size_bytes()), ", waste ",
            static_cast<int>(layout_.waste() * 1000) / 10.0, "%, device ", device.str(), " (", store_->engine_name(),
            "), device budget ", config_.device_budget_bytes ? format_bytes(config_.device_budget_bytes) : "unlimited",
            ", capacity ", capacity ? format_bytes(capacity) : "unknown");
}

ChunkedModel::~ChunkedModel() {
  try {
    materialize(/*fetch_remote=*/false);
  } catch (const std::exception& e) {
    log::error("ferry: ChunkedModel could not give parameters their memory back: ", e.what());
  }
  hold_remote_hazard(false);
  hold_forward_done_hazard(false);
}

void ChunkedModel::build(const std::vector<int64_t>& order) {
  int64_t chunk_bytes = config_.chunk_size_bytes;
  if (chunk_bytes == 0) {  // auto: the least packing waste for this order
    const AutoChunkSize choice = auto_chunk_size(numels_, order, static_cast<int64_t>(c10::elementSize(dtype_)));
    chunk_bytes = choice.chunk_bytes;
    log::info("ferry: chunk size ", format_bytes(chunk_bytes), " (auto: least packing waste between ",
              format_bytes(choice.lo_bytes), " and ", format_bytes(choice.hi_bytes), ", waste ",
              static_cast<int>(choice.waste * 1000) / 10.0, "%)");
  }
  const PackOptions pack = PackOptions::from_bytes(chunk_bytes, dtype_);
  ChunkLayout layout = ChunkLayout::pack(numels_, order, pack);
  ChunkStoreOptions store_options = ChunkStoreOptions::from(config_);
  store_options.device = device_;
  store_options.policy = policy_;
  store_options.name = "params";
  store_options.host_cache_bytes = options_.host_cache_bytes;
  store_options.accountant = accountant_;
  auto store = std::make_unique<ChunkStore>(store_options, options_.copy_engine ? options_.copy_engine() : nullptr);
  // A repack fills the new chunks one at a time and frees each old chunk as soon as all its parameters
  // have moved out, so host memory grows by about one chunk, not by a second copy of the model.
  // Chunks get their memory one at a time as they are filled (first build and repack alike): the
  // module's own tensor of each parameter is freed when it is bound (unless kept as its initial
  // value), so construction holds about one chunk beyond the module, not a second copy of it.
  const auto role = store->add_layout(ChunkRole::kParam, dtype_, layout, shapes_, Location::kNone);
  const bool first = store_ == nullptr;
  // A repack builds a chunk on the device where its parameters are (Note [Repack stays on the device]),
  // within the room the trace leaves chunks at its worst moment.
  FillPlacement placement;
  if (!first) {
    placement.keep_on_device = true;
    placement.device_room_bytes = scheduler_->device_room_bytes();
  }
  const int64_t peak = fill_layout(*store, layout, {role}, store_.get(), {tensor_of_param_},
                                   [&](int, int64_t p, TensorId slot) {
    // First build: the values are the parameter's own; a repack reads them from the old store.
    const at::Tensor values = first ? params_[p].detach() : store_->view(tensor_of_param_[p]);
    if (first && dtype_ != at::kFloat && params_[p].scalar_type() != dtype_) {
      // The compute copy rounds them; an optimizer's fp32 masters should start from these values.
      // Keeping them only delays freeing the module's own memory (no copy is made).
      initial_values_.resize(params_.size());
      initial_values_[p] = values;
    }
    store->set_state(slot, TensorState::kHold);
    store->bind(slot, params_[p], values);
  }, placement);
  if (!first) repack_peak_bytes_ = peak;
  std::vector<TensorId> tensor_of_param = role.tensors;
  std::vector<ChunkId> chunk_of_param(params_.size());
  for (int64_t p = 0; p < num_params(); ++p) chunk_of_param[p] = role.chunks[layout.slots()[p].chunk];
  param_chunks_ = role.chunks;
  ++layout_version_;
  unregister_storages();
  store_ = std::move(store);  // the old store goes; parameters already view the new one
  layout_ = std::move(layout);
  // The optimizer state follows in the same repack, with the same routine.
  states_.erase(std::remove_if(states_.begin(), states_.end(), [](const auto& w) { return w.expired(); }), states_.end());
  for (const auto& weak : states_) {
    if (auto state = weak.lock()) state->build(layout_, shapes_);
  }
  tensor_of_param_ = std::move(tensor_of_param);
  chunk_of_param_ = std::move(chunk_of_param);
  register_storages();
  remember_bindings();
}

// Note [A repack waits for held views]. A repack moves every parameter into a new chunk and frees the
// old ones. A tensor that views an old chunk's storage other than the parameter itself would then view
// no memory (a raw "setStorage ... out of bounds" in a backward, a crash in a CPU kernel that reads
// it), or, were the memory left to it, stale values (a host buffer goes to the new store for reuse:
// another chunk's values). Such views exist when a graph of this model outlives the iteration (a
// forward whose graph ferry cannot see, below D64's watch, saved `weight.t()`), or when the user keeps
// `weight.detach()` or a slice of a weight. So the warm-up repack runs only at an iteration end where
// each old chunk's memory is held by its parameters alone (reference counts, ChunkStore::
// storage_holders; the optimizer state chunks, which the same repack migrates, by nobody); else it
// waits, said once in the log, and the layout is not final meanwhile (the first sharded step refuses).
// The test is exact: a parameter's TensorImpl holds its chunk's storage once, however many handles to
// the parameter the module and the user keep, and ferry keeps no other view between iterations.
int64_t ChunkedModel::views_held_outside(int64_t* example) {
  std::vector<int64_t> bound(param_chunks_.size(), 0);
  std::unordered_map<ChunkId, size_t> index;
  for (size_t i = 0; i < param_chunks_.size(); ++i) index[param_chunks_[i]] = i;
  for (size_t p = 0; p < params_.size(); ++p) ++bound[index.at(chunk_of_param_[p])];
  int64_t held = 0;
  for (size_t i = 0; i < param_chunks_.size(); ++i) {
    const int64_t extra = store_->storage_holders(param_chunks_[i]) - bound[i];
    if (extra <= 0) continue;
    held += extra;
    if (example && *example < 0) {
      for (size_t p = 0; p < params_.size(); ++p) {
        if (chunk_of_param_[p] == param_chunks_[i]) {
          *example = static_cast<int64_t>(p);
          break;
        }
      }
    }
  }
  // The optimizer state migrates in the same repack: a kept view of it (adam.state_store()) counts too.
  for (const auto& weak : states_) {
    if (auto state = weak.lock()) held += state->views_held();
  }
  return held;
}

// Note [Writes to parameters]
void ChunkedModel::remember_bindings() {
  const size_t n = params_.size();
  bound_storage_.resize(n);
  bound_offset_.resize(n);
  bound_version_.resize(n);
  for (size_t p = 0; p < n; ++p) {
    const at::Tensor& t = params_[p];
    bound_storage_[p] = t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
    bound_offset_[p] = t.storage_offset();
    bound_version_[p] = t._version();
  }
}

void ChunkedModel::check_module_parameters(const char* where) const {
  // The index of the wrapped parameter whose TensorImpl is `impl`, or -1.
  auto index_of = [&](const c10::TensorImpl* impl) -> int64_t {
    const auto it = std::lower_bound(impl_index_.begin(), impl_index_.end(), impl,
                                     [](const auto& entry, const c10::TensorImpl* key) { return entry.first < key; });
    return it != impl_index_.end() && it->first == impl ? it->second : -1;
  };
  std::vector<char> seen(params_.size(), 0);
  bool foreign = false;
  for (const at::Tensor& t : module_->parameters(/*recurse=*/true)) {
    if (!t.defined()) continue;
    const int64_t p = index_of(t.unsafeGetTensorImpl());
    if (p < 0) {
      foreign = true;  // and on: `seen` must be whole for the message
    } else {
      seen[p] = 1;
    }
  }
  const int64_t missing = std::count(seen.begin(), seen.end(), 0);
  if (!foreign && missing == 0) return;
  // The names, for the message (only now: named_parameters builds every name).
  std::string added, gone;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    if (item.value().defined() && index_of(item.value().unsafeGetTensorImpl()) < 0) {
      added += (added.empty() ? "" : ", ") + item.key();
    }
  }
  for (size_t p = 0; p < params_.size(); ++p) {
    if (!seen[p]) gone += (gone.empty() ? "" : ", ") + names_[p];
  }
  TORCH_CHECK(false, "ferry: ", where, ": the module's parameters are not the ones ChunkedModel wrapped (Note [The "
              "module's parameters]): ", added.empty() ? "" : "it has " + added + ", registered after it was wrapped",
              !added.empty() && missing > 0 ? "; " : "",
              missing > 0 ? "it no longer has " + gone + " (replaced or removed after it was wrapped)" : "",
              ". ferry holds only the parameters it wrapped in its chunks and trains only those: build the whole "
              "module (adapters, heads, replaced layers) before wrapping it, or wrap it again");
}

void ChunkedModel::take_writes(const char* where) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  TORCH_CHECK(!materialized_, "ferry: take_writes() on a materialized ChunkedModel");
  std::vector<WrittenParam> written;
  int64_t recast = 0, first_recast = -1;  // replacements of another dtype
  at::ScalarType given = dtype_;
  for (int64_t p = 0; p < num_params(); ++p) {
    at::Tensor& t = params_[p];
    const bool replaced = !t.has_storage() || t.storage().unsafeGetStorageImpl() != bound_storage_[p] ||
                          t.storage_offset() != bound_offset_[p] || t.scalar_type() != dtype_ ||
                          t.device() != store_->device() || !t.is_contiguous();
    if (!replaced && t._version() == bound_version_[p]) continue;
    TORCH_CHECK(!grad_in_slot_[p], "ferry: ", where, ": parameter ", names_[p], " was written after backward(), "
                "while its slot held its gradient (Note [Gradient in the parameter slot]): the write went into the "
                "gradient. Write parameters before forward() or after the optimizer's step; zero_grad() discards "
                "the gradients (and the write)");
    if (!replaced) {
      written.push_back({p, at::Tensor()});
      continue;
    }
    TORCH_CHECK(t.sizes() == at::IntArrayRef(shapes_[p]), "ferry: ", where, ": parameter ", names_[p], " was given "
                "a tensor of shape ", t.sizes(), " (set_(), set_data() or torch::load); its shape is ",
                at::IntArrayRef(shapes_[p]), " (ChunkedModel's chunks hold every parameter at its shape: wrap the "
                "module again to change one)");
    TORCH_CHECK(at::isFloatingType(t.scalar_type()), "ferry: ", where, ": parameter ", names_[p], " was given a "
                "tensor of dtype ", t.scalar_type(), "; a floating dtype is needed");
    if (t.scalar_type() != dtype_ && recast++ == 0) {
      first_recast = p;
      given = t.scalar_type();
    }
    const at::Tensor replacement = t.detach();  // keeps the given storage; the parameter views its slot again
    store_->bind(tensor_of_param_[p], t, replacement);
    written.push_back({p, replacement});
  }
  if (written.empty()) return;
  if (recast > 0) {  // Note [The module's parameters]
    log::warn("ferry: ", where, ": ", recast, " parameter(s) were given tensors of another dtype (", names_[first_recast],
              ": ", given, "; module.to(dtype) or torch::load of another precision); their values were taken in at "
              "ferry's compute dtype, ", dtype_, ", which Config::precision sets: the parameters stay ", dtype_,
              grad_sink_ ? " (the optimizer's fp32 masters take the values at full precision)" : "");
  }
  // At info the first time only: a loop that writes every step (a torch optimizer over the module's
  // parameters, a WGAN critic's clamp) would otherwise log a line per step. Later ones at debug.
  const log::Level level = writes_taken_++ == 0 ? log::Level::kInfo : log::Level::kDebug;
  if (log::enabled(level)) {
    log::write(level, log::detail::concat("ferry: ", written.size(), " parameter(s) written (",
                                          names_[written.front().param], written.size() > 1 ? ", ..." : "",
                                          "), taken in before ", where,
                                          grad_sink_ ? ", into the optimizer's state too" : "",
                                          level == log::Level::kInfo ? " (later writes: at debug level)" : ""));
  }
  for (const WrittenParam& w : written) release_initial_value(w.param);  // the write is the value now
  if (grad_sink_) grad_sink_->values_written(written);
  remember_bindings();
}

void ChunkedModel::register_storages() {
  std::unordered_map<const c10::StorageImpl*, std::vector<ParamRange>> by_storage;
  for (size_t p = 0; p < params_.size(); ++p) {
    const c10::StorageImpl* s = params_[p].storage().unsafeGetStorageImpl();
    const int64_t begin = params_[p].storage_offset();
    by_storage[s].push_back({begin, begin + params_[p].numel(), static_cast<int64_t>(p)});
  }
  for (auto& [storage, ranges] : by_storage) {
    register_storage(storage, this, std::move(ranges));
    registered_.push_back(storage);
  }
}

void ChunkedModel::unregister_storages() {
  for (const c10::StorageImpl* s : registered_) unregister_storage(s);
  registered_.clear();
}

void ChunkedModel::set_loss_scale(double scale) {
  TORCH_CHECK(std::isfinite(scale) && scale > 0, "ferry: loss scale must be finite and > 0, got ", scale);
  loss_scale_ = scale;
}

std::shared_ptr<StateChunks> ChunkedModel::attach_state(std::vector<ChunkRole> roles, const StateChunks::Init& init,
                                                       std::vector<int> zero_roles) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  TORCH_CHECK(phase_.load() == ModelPhase::kIdle || phase_.load() == ModelPhase::kForwardDone,
              "ferry: attach_state() inside an iteration");
  take_writes("attach_state()");  // the state starts from what was written before it (Note [Writes to parameters])
  ChunkStoreOptions options;
  options.device = device_;  // no budget of its own: groups are placed by the optimizer, admitted by the scheduler
  options.name = "optimizer state";
  // Pinned memory only for what moves every iteration (the parameter chunks): state chunks either stay
  // on the host (CpuAdam reads them there) or move to the device once, at placement; pinning them would
  // lock 12 B/param of host memory for nothing and cost seconds of cudaHostAlloc.
  options.pin_host_memory = false;
  options.accountant = accountant_;  // one device budget for parameters and state
  auto state = std::make_shared<StateChunks>(std::move(options), std::move(roles), std::move(zero_roles));
  state->build(layout_, shapes_, init);
  states_.push_back(state);
  return state;
}

void ChunkedModel::set_remote_chunks(std::shared_ptr<RemoteChunks> remote) {
  TORCH_CHECK(phase_.load() == ModelPhase::kIdle, "ferry: set_remote_chunks() inside an iteration (phase ",
              to_string(phase_.load()), ")");
  TORCH_CHECK(!remote || layout_final(), "ferry: parameters can be sharded only once the warm-up repack is done");
  remote_ = std::move(remote);
  scheduler_->set_remote(remote_);
  hold_remote_hazard(remote_ != nullptr);
}

namespace {
// Note [Ops outside the scopes] (interceptor.h): one hazard, counted while `held`; while held, this thread
// (the one that drives the model) watches, also when asked again.
void hold_hazard(bool& held, bool hold) {
  if (hold != held) {
    held = hold;
    if (hold) {
      outside_hazard_begin();
    } else {
      outside_hazard_end();
    }
  }
  if (hold) watch_outside_uses();
}
}  // namespace

// While chunks may be given up (sharded parameters), an op between iterations on the driving thread is
// checked first (before_outside_use), never run on a storage with no memory.
void ChunkedModel::hold_remote_hazard(bool hold) { hold_hazard(remote_hazard_, hold); }

// Note [Between forward and backward] (below).
void ChunkedModel::hold_forward_done_hazard(bool hold) { hold_hazard(forward_done_hazard_, hold); }

at::Tensor ChunkedModel::param_values(int64_t index) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  TORCH_CHECK(index >= 0 && index < num_params(), "ferry: parameter index ", index, " out of range [0, ", num_params(),
              ")");
  if (grad_sink_) grad_sink_->await_param(index);
  const TensorId t = tensor_of_param_[index];
  TORCH_CHECK(!remote_ || !remote_->remote(chunk_of_param_[index]) || store_->tensor_info(t).state != TensorState::kFree,
              "ferry: parameter ", names_[index], " is in a chunk that another rank owns and that is not fetched "
              "now (sharded parameters); state_dict() gathers every parameter");
  return store_->view(t);
}

void ChunkedModel::set_layout_listener(LayoutListener* listener) {
  const ModelPhase phase = phase_.load();
  TORCH_CHECK(phase == ModelPhase::kIdle || (!listener && phase == ModelPhase::kForwardDone),
              "ferry: set_layout_listener() inside an iteration (phase ", to_string(phase), ")");
  layout_listener_ = listener;
}

void ChunkedModel::set_grad_sink(GradSink* sink) {
  const ModelPhase phase = phase_.load();
  TORCH_CHECK(phase == ModelPhase::kIdle || (!sink && phase == ModelPhase::kForwardDone),
              "ferry: set_grad_sink() inside an iteration (phase ", to_string(phase), ")");
  TORCH_CHECK(!materialized_, "ferry: set_grad_sink() on a materialized ChunkedModel");
  TORCH_CHECK(sink == nullptr || grad_sink_ == nullptr || sink == grad_sink_,
              "ferry: set_grad_sink(): the model's gradients go to another sink already; set null first");
  grad_sink_ = sink;
  install_grad_hooks(sink != nullptr);
}

// On every parameter, whether it requires grad now or not: one unfrozen later (requires_grad set
// after the optimizer attached) lands its gradients too, and detaching takes the hook off one frozen
// since (a hook left behind would call this object after it is gone).
void ChunkedModel::install_grad_hooks(bool on) {
  for (size_t p = 0; p < params_.size(); ++p) {
    std::unique_ptr<torch::autograd::PostAccumulateGradHook> hook;
    if (on) hook = std::make_unique<GradLandingHook>(this, static_cast<int64_t>(p));
    torch::autograd::impl::set_post_acc_grad_hooks(params_[p], std::move(hook));
  }
  trainable_.resize(params_.size());
  for (size_t p = 0; p < params_.size(); ++p) trainable_[p] = params_[p].requires_grad();
}

void ChunkedModel::check_trainable() {
  if (!grad_sink_) return;
  int64_t changed = 0, first = -1;
  for (int64_t p = 0; p < num_params(); ++p) {
    const char now = params_[p].requires_grad();
    if (now == trainable_[p]) continue;
    trainable_[p] = now;
    if (changed++ == 0) first = p;
  }
  if (changed == 0) return;
  log::info("ferry: ", changed, " parameter(s) changed requires_grad since the last forward (", names_[first],
            " now ", trainable_[first] ? "requires" : "does not require", " it); the optimizer is told");
  grad_sink_->trainable_changed();
}

// Note [A backward not through model.backward()]
// `loss.backward()` where the README says `model.backward(loss)` is the natural slip of a LibTorch user.
// It ran: on the CPU, the ops of that backward count as uses between forward and backward (D58), so
// the gradients came out right, but nothing else that model.backward() does happened. The loss was not
// multiplied by the loss scale, so with fp16 every gradient reached the step 65536 times too small
// (seen: the step's grad_norm 8.7e-6 for 0.57) and the step divided it by the scale again; the
// iteration never ended at backward, so the scheduler traced nothing and never repacked, and a loss
// still held at the next forward kept the iteration open for good (Note [Several forwards]). (Its ops
// did reach the chunks: the training thread watches between forward and backward, and autograd's
// threads inherit the key, Note [Ops outside the scopes].) So a gradient that reaches a parameter after a
// training forward while no model's backward() runs in this process is refused, before it lands, naming
// the call to make. Gradients from another model's backward() are not refused: a GAN's generator
// trains through its discriminator (D64's GAN test), whose gradients its zero_grad() discards. Nor are
// those of a backward between iterations or after an evaluation forward (no iteration awaits a
// backward then; the module is an ordinary module, D35). The check is one atomic load per landing. The
// refused iteration ends, as an aborted one, at the next forward() (which does not continue it even
// while its graph is alive) or end_iteration(): its trace is not kept.
void ChunkedModel::land_grad(int64_t param, const at::Tensor& variable) {
  if (phase_.load() == ModelPhase::kForwardDone && training_forward_ && g_model_backwards.load() == 0) {
    variable.mutable_grad().reset();  // nothing lands, nothing is left for autograd to add to
    backward_refused_ = true;         // the next forward() or end_iteration() ends the iteration, aborted
    TORCH_CHECK(false, "ferry: parameter ", names_[param], " got a gradient from a backward that did not go "
                "through model.backward(): call model.backward(loss) (or adam.backward_step(loss)) instead of "
                "loss.backward(); it applies the loss scale (fp16) and ends the iteration (trace, repack). No "
                "gradient of this backward landed; run forward() again");
  }
  if (!grad_sink_) return;
  // Taken out of .grad before anything can fail: a gradient left there after a refusal (a sparse one,
  // a failed fetch) would be summed into the next backward's by autograd, a failed step's gradient
  // leaking into the next one (seen with a sparse embedding made dense again).
  const at::Tensor grad = variable.grad();
  if (!grad.defined()) return;
  variable.mutable_grad().reset();
  if (!grad_sink_->grads_into_param_slots()) {
    grad_sink_->land_grad(param, grad);
    return;
  }
  // Note [Gradient in the parameter slot]: the gradient is written into the slot on the device, with
  // the chunk held in COMPUTE. The chunk is usually there (the parameter's last backward use just
  // ended); an evicted one is brought back (one chunk transfer, no host stall) rather than given this
  // one gradient by a device->host copy, which would stall the host once per parameter.
  TORCH_CHECK(grad.layout() == at::kStrided, "ferry: gradients must be dense; parameter ", names_[param], " got a ",
              grad.layout(), " one (an nn::Embedding built with sparse(true)? Adam, torch's too, takes dense "
              "gradients: build it with sparse(false))");
  grad_sink_->before_landing(param);
  // ferry's own ops here (the copy into the slot, moves the access makes) must not be intercepted.
  c10::impl::ExcludeDispatchKeyGuard no_intercept(kInterceptKey);
  at::NoGradGuard no_grad;
  const TensorId t = tensor_of_param_[param];
  // A sharded group given up after forward and not used in backward since: fetched for its gradients.
  if (remote_ && remote_->remote(chunk_of_param_[param])) remote_->fetch(chunk_of_param_[param]);
  at::Tensor slot = store_->access(t);
  try {
    if (grad_in_slot_[param]) {
      slot.add_(grad);  // a second accumulation in this backward (the graph reached the parameter twice)
    } else {
      slot.copy_(grad);
      grad_in_slot_[param] = 1;
      ++grads_in_slots_;
    }
    grad_sink_->land_grad(param, slot);
  } catch (...) {
    store_->release(t, TensorState::kHoldAfterBwd);
    throw;
  }
  store_->release(t, TensorState::kHoldAfterBwd);
  grad_sink_->after_landing(param);
}

void ChunkedModel::clear_grad_slots() {
  TORCH_CHECK(phase_.load() == ModelPhase::kIdle || phase_.load() == ModelPhase::kForwardDone,
              "ferry: clear_grad_slots() inside an iteration");
  std::fill(grad_in_slot_.begin(), grad_in_slot_.end(), 0);
  grads_in_slots_ = 0;
}

void ChunkedModel::clear_grad_slot(int64_t index) {
  // Backward too: a gradient sink that gave the slot its value back (on autograd's thread, or in
  // backward_finished) says so here.
  const ModelPhase phase = phase_.load();
  TORCH_CHECK(phase == ModelPhase::kIdle || phase == ModelPhase::kForwardDone || phase == ModelPhase::kBackward,
              "ferry: clear_grad_slot() inside a forward");
  TORCH_CHECK(index >= 0 && index < num_params(), "ferry: parameter index ", index, " out of range [0, ", num_params(), ")");
  if (!grad_in_slot_[index]) return;
  grad_in_slot_[index] = 0;
  --grads_in_slots_;
}

void ChunkedModel::check_no_grad_in_slots(const char* what) const {
  if (grads_in_slots_ == 0) return;
  int64_t p = 0;
  while (!grad_in_slot_[p]) ++p;
  TORCH_CHECK(false, "ferry: ", what, ": ", grads_in_slots_, " parameter(s), e.g. ", names_[p],
              ", hold their gradients in their chunks since backward (the optimizer step writes their values "
              "back); call the optimizer's step() or zero_grad() first");
}

void ChunkedModel::transition(ModelPhase to) {
  const ModelPhase from = phase_.load();
  TORCH_CHECK(legal(from, to), "ferry: ChunkedModel cannot go from ", to_string(from), " to ", to_string(to),
              to == ModelPhase::kBackward ? " (call backward() once after each forward())" : "");
  phase_.store(to);
  hold_forward_done_hazard(to == ModelPhase::kForwardDone && training_forward_ && !materialized_);
}

// Note [Between forward and backward]
// A loss term computed after forward() (`loss + 1e-4 * w.pow(2).sum()`), a parameter logged between
// forward() and backward(): ops outside ferry's scopes, inside an iteration. They used to run on the
// storage as they found it: on the host alias or, on CUDA, a chunk whose eviction copy was still in
// flight (no memory), and nothing traced them. While the model is between forward() and backward()
// (after a forward under grad mode: one under NoGradGuard, an evaluation, waits for no backward, and
// ops after it are as between iterations, D35 and D57, also where the thread watches for another
// hazard) it holds an outside-use hazard and the thread that ran forward() watches (Note [Ops outside
// the scopes], interceptor.h); an op there that uses a parameter is a use like those inside forward():
// pre_use brings the chunk to the device (at N > 1 gathers it: every rank must run the op, as every
// rank runs forward), the trace records it (the warm-up iteration's trace has it too), inputs are cast
// to the compute dtype, and post_use holds the chunk after forward. The hazard ends when the model
// leaves that phase (backward(), end_iteration(), the next forward()) or is materialized. Cost: while
// it lasts, every op of that thread goes through the fallback (a registry lookup per tensor argument,
// about 0.3 us: D57's measurement). A pre_use that reaches the model between iterations (a key an
// autograd worker inherited from a watching thread) is an op outside the scopes: checked, not used.
ChunkedModel::Outside ChunkedModel::before_outside_use(int64_t param) {
  const ModelPhase phase = phase_.load();
  if (phase == ModelPhase::kForwardDone && forward_done_hazard_) {
    // The user's ops are uses; ferry's own (an optimizer call's copies) run on what the store holds.
    return in_own_ops() ? Outside::kChecked : Outside::kUse;
  }
  // Inside forward() or backward() but outside their scope, the driving thread runs only ferry's own ops
  // (begin_forward before the scope, backward_finished's moves after it): the store's business, where a
  // chunk on its way (no memory yet) is no error.
  if (phase == ModelPhase::kForward || phase == ModelPhase::kBackward) return Outside::kChecked;
  // Between iterations, and after an evaluation forward (no backward comes): as between iterations.
  check_outside_use(param);
  return Outside::kChecked;
}

void ChunkedModel::check_outside_use(int64_t param) {
  // An op between iterations on a parameter chunk that an update left running may still write.
  if (grad_sink_) grad_sink_->await_param(param);
  // A chunk with no memory here (another rank's, given up between its uses): torch's kernels would read
  // a null pointer.
  if (params_[param].storage().data() != nullptr) return;
  const bool remote = remote_ && remote_->remote(chunk_of_param_[param]);
  TORCH_CHECK(!remote, "ferry: an op between iterations uses parameter ", names_[param], ", which is in a chunk "
              "another rank owns (sharded parameters, world size ", config_.world_size, "): between steps only "
              "its owner holds it. model.state_dict() gathers every parameter (a collective: every rank calls "
              "it); HybridAdamOptions::shard_params = false keeps every chunk on every rank");
  TORCH_CHECK(false, "ferry: an op between iterations uses parameter ", names_[param], ", whose chunk has no "
              "memory here now");
}

void ChunkedModel::pre_use(int64_t param) {
  if (phase_.load() == ModelPhase::kIdle) {  // Note [Between forward and backward]: not inside an iteration
    check_outside_use(param);
    return;
  }
  if (grad_sink_) grad_sink_->await_param(param);  // an update left running behind the step writes its chunk
  if (grad_in_slot_[param]) refuse_use_of_grad_slot(param);
  ParamUseRecorder::record(params_[param]);  // Note [Checkpoint parameters as inputs] (hooks/checkpoint.cpp)
  scheduler_->pre_use(param);
}

void ChunkedModel::refuse_use_of_grad_slot(int64_t param) const {
  const std::string head = "ferry: parameter " + names_[param] + " is used, but its chunk slot holds its gradient";
  // A use inside backward after the landing: a nested backward (an activation checkpoint of the user's
  // own, reentrant as ferry's used to be) accumulated the gradient, and a later recompute uses the value.
  TORCH_CHECK(phase_.load() != ModelPhase::kBackward, head, ", which landed earlier in this backward (Note "
              "[Gradient in the parameter slot]): a nested backward accumulated it (an activation checkpoint of "
              "one's own that recomputes in backward, or a ferry::checkpoint segment that captures a tensor "
              "requiring grad instead of taking it as an input: it warned), and the parameter is used again after; "
              "with ferry a parameter's gradient must land once per backward, after its last use: use "
              "ferry::checkpoint, passing captured tensors in its inputs (docs/ARCHITECTURE.md D64)");
  TORCH_CHECK(!last_backward_failed_, head, " since its backward (Note [Gradient in the parameter slot]), which "
              "failed: the optimizer's zero_grad() discards the gradients that landed before it failed (its step() "
              "would apply them: a partial step)");
  TORCH_CHECK(false, head, " since its backward (Note [Gradient in the parameter slot]): call the optimizer's step() "
              "(or zero_grad()) after backward, before the next forward. For gradient accumulation over micro-batches "
              "construct HybridAdam with accumulate_grads = true");
}

void ChunkedModel::post_use(int64_t param) {
  const ModelPhase phase = phase_.load();
  if (phase == ModelPhase::kIdle) return;  // pre_use checked it only
  const bool backward = phase == ModelPhase::kBackward;
  scheduler_->post_use(param, backward ? TensorState::kHoldAfterBwd : TensorState::kHoldAfterFwd);
  // Note [A chunk final before its last use] (optim/hybrid_adam.cpp).
  if (backward && grad_sink_) grad_sink_->used_in_backward(param);
}

// Note [Several forwards]
// A contrastive loss over two views, a distillation term from a second pass, a loss summed over two
// batches: several forward() calls, then one backward() through all their graphs, as with an unwrapped
// module. A forward() used to end the previous one's iteration as an evaluation: the warm-up's repack
// then moved every parameter, and the backward through the first graph met a saved parameter with no
// storage (a raw "setStorage ... out of bounds" error); later the scheduler traced each forward as an
// iteration of its own. Now a forward() after a training forward (under grad mode) continues the
// iteration while some graph of it can still reach a parameter: the backward that may follow needs the
// parameters as the forwards saw them. The test is the parameters' gradient accumulators: autograd keeps
// only a weak reference to them in the parameter, the graph holds them, so an accumulator is alive
// exactly while a graph that can push a gradient into its parameter is (ferry holds none: its gradient
// hooks live in the parameter's autograd meta). A validation loop that forgot NoGradGuard drops each
// output before the next forward(): no accumulator is left, and each forward ends the last one's
// iteration as before (one probe per parameter, only when a forward follows a training forward). The
// continued iteration is one to the scheduler: one trace position sequence (the warm-up records both
// forwards and the backward), one forward time from the first forward's start to the last one's end,
// and ops between the forwards are uses as between forward and backward (D58). A ferry::checkpoint
// segment holds its parameters' accumulators too (Note [Checkpoint parameters as inputs]). A graph that
// reaches parameters only through frozen ones holds none (a frozen feature network as a perceptual
// loss, run on the output and on the target): a later forward() ended its iteration, and in the
// warm-up a frozen weight's saved view met the repack ("setStorage ... out of bounds"). So the node of
// each tensor forward() returns (alone or in a vector, pair or tuple) is watched too: while it is alive
// and no backward has run through it (a pre-hook on it says so), a graph that saved views of the
// chunks may still be backwarded. The pre-hook is what keeps a loss the user holds past the next
// forward (a logging loop) from holding the iteration open for good once its backward ran, when that
// backward was not this model's (the user's own `loss.backward()` through a model without a gradient
// sink, or another model's backward()). Only a backward that frees the graph counts: one that keeps
// it (a gradient penalty's autograd::grad with create_graph, then more forwards before the backward,
// as a WGAN-GP critic does) leaves it to be backwarded again. Once a backward ran through one of them
// the accumulators are not asked: a held loss keeps its graph's accumulators alive too, and a trainable model without a
// sink backwarded by `loss.backward()` would otherwise never end an iteration either. A forward that
// returns something else (a struct) is seen only through its accumulators, and only while no returned
// node was backwarded. Cost: a weak pointer and a pre-hook per returned tensor.
bool ChunkedModel::graph_awaits_backward() const {
  bool ran = false;
  for (const ForwardOutput& o : forward_outputs_) {
    if (o.ran->load()) {
      ran = true;
    } else if (!o.node.expired()) {
      return true;
    }
  }
  // A backward ran through this iteration's graph: the accumulators a held loss keeps alive await none.
  if (ran) return false;
  for (const auto& p : params_) {
    if (p.requires_grad() && torch::autograd::impl::try_get_grad_accumulator(p)) return true;
  }
  return false;
}

namespace {
// Marks that a backward that frees the graph ran through a forward's output node (Note [Several
// forwards]). One that keeps it (autograd::grad with create_graph for a gradient penalty, or
// retain_graph) leaves the graph to a later backward: not marked.
struct BackwardRanHook final : torch::autograd::FunctionPreHook {
  explicit BackwardRanHook(std::shared_ptr<std::atomic<bool>> ran) : ran(std::move(ran)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (!torch::autograd::get_current_graph_task_keep_graph()) ran->store(true);
    return grads;
  }
  std::shared_ptr<std::atomic<bool>> ran;
};
}  // namespace

void ChunkedModel::note_output(const at::Tensor& out) {
  if (!c10::GradMode::is_enabled() || !out.defined()) return;
  const std::shared_ptr<torch::autograd::Node> node = out.grad_fn();
  if (!node) return;  // a leaf or no graph: nothing saved for a backward
  for (const ForwardOutput& o : forward_outputs_) {
    if (o.node.lock() == node) return;  // returned twice (a pair of one tensor)
  }
  auto ran = std::make_shared<std::atomic<bool>>(false);
  node->add_pre_hook(std::make_unique<BackwardRanHook>(ran));
  forward_outputs_.push_back({node, std::move(ran)});
}

void ChunkedModel::begin_forward() {
  TORCH_CHECK(!materialized_, "ferry: this ChunkedModel was materialized; wrap the module again");
  // Note [A backward not through model.backward()]: a refused backward ends its iteration, aborted.
  const bool refused = backward_refused_.exchange(false);
  const bool continued =
      !refused && phase_.load() == ModelPhase::kForwardDone && training_forward_ && graph_awaits_backward();
  if (phase_.load() == ModelPhase::kForwardDone && !continued) {
    transition(ModelPhase::kIdle);  // the previous forward had no backward (evaluation)
    finish_iteration(/*aborted=*/refused, /*forward_only=*/!refused);
  }
  check_module_parameters("forward()");  // Note [The module's parameters]
  take_writes("forward()");              // Note [Writes to parameters]
  check_trainable();
  transition(ModelPhase::kForward);
  if (continued) return;  // Note [Several forwards]: the same iteration, its forward marked from its start
  forward_outputs_.clear();
  scheduler_->begin_iteration();
  in_iteration_ = true;
  training_forward_ = false;
  forward_marked_ = backward_marked_ = false;
  marks_[kForwardBegin]->record();
}

void ChunkedModel::end_forward() {
  // Note [Between forward and backward]: only a forward that built a graph waits for a backward; an
  // evaluation forward continuing a training iteration (Note [Several forwards]) leaves it waiting.
  training_forward_ = training_forward_ || c10::GradMode::is_enabled();
  take_writes("the end of forward()");  // a write inside forward (Note [Writes to parameters])
  transition(ModelPhase::kForwardDone);
  marks_[kForwardEnd]->record();
  forward_marked_ = true;
  // After an evaluation, ops run unseen, as between iterations: every parameter must be readable now,
  // not when end_iteration() or the next forward settles (D35, D59: on CUDA a chunk evicted late in
  // the forward has no memory until its copy is done).
  if (!training_forward_) store_->settle();
}

PhaseSeconds ChunkedModel::last_phase_seconds() const {
  TORCH_CHECK(phase_.load() == ModelPhase::kIdle, "ferry: last_phase_seconds() between iterations only, not in ",
              to_string(phase_.load()), " (after an evaluation forward, call end_iteration() first)");
  PhaseSeconds s;
  if (forward_marked_) s.forward = marks_[kForwardEnd]->seconds_since(*marks_[kForwardBegin]);
  if (backward_marked_) s.backward = marks_[kBackwardEnd]->seconds_since(*marks_[kBackwardBegin]);
  return s;
}

void ChunkedModel::trace_last_phases() const {
  if (!trace::enabled()) return;
  TORCH_CHECK(phase_.load() == ModelPhase::kIdle, "ferry: trace_last_phases() between iterations only, not in ",
              to_string(phase_.load()));
  const ClockAnchor anchor(store_->make_mark());
  auto host_ns = [&](PhaseMark m) { return anchor.host_ns(*marks_[m]); };
  if (forward_marked_) trace::complete_on("device", "device", "forward", host_ns(kForwardBegin), host_ns(kForwardEnd));
  if (backward_marked_) {
    trace::complete_on("device", "device", "backward", host_ns(kBackwardBegin), host_ns(kBackwardEnd));
  }
  store_->trace_copies(anchor);
  for (const auto& weak : states_) {
    if (const auto state = weak.lock()) state->store().trace_copies(anchor);
  }
}

void ChunkedModel::backward(const at::Tensor& loss) {
  TORCH_CHECK(loss.defined() && loss.numel() == 1, "ferry: backward() needs a defined scalar loss, got ",
              loss.defined() ? loss.sizes().vec() : std::vector<int64_t>{});
  take_writes("backward()");  // a write between forward() and backward() (Note [Writes to parameters])
  transition(ModelPhase::kBackward);
  last_backward_failed_ = false;
  backward_refused_ = false;  // this backward is the iteration's own
  scheduler_->begin_backward();
  trace::Span span("model", "backward");
  marks_[kBackwardBegin]->record();
  try {
    InterceptionScope scope;
    CountedModelBackward counted;  // Note [A backward not through model.backward()]
    if (loss_scale_ == 1.0) {
      loss.backward();
    } else {
      loss.backward(at::full_like(loss, loss_scale_));
    }
    // Autograd has queued its last kernel (and synchronised its streams with this one).
    marks_[kBackwardEnd]->record();
  } catch (...) {
    last_backward_failed_ = true;
    if (grad_sink_) {
      try {
        grad_sink_->backward_finished(/*aborted=*/true);
      } catch (const std::exception& e) {
        log::error("ferry: after a failed backward, the gradient sink failed too: ", e.what());
      }
    }
    abort_iteration();
    throw;
  }
  if (grad_sink_) {
    try {
      grad_sink_->backward_finished(/*aborted=*/false);
    } catch (...) {
      last_backward_failed_ = true;
      abort_iteration();
      throw;
    }
  }
  backward_marked_ = true;
  transition(ModelPhase::kIdle);
  finish_iteration(false);
}

void ChunkedModel::end_iteration() {
  if (phase_.load() != ModelPhase::kForwardDone) return;
  const bool refused = backward_refused_.exchange(false);  // Note [A backward not through model.backward()]
  transition(ModelPhase::kIdle);
  finish_iteration(/*aborted=*/refused, /*forward_only=*/!refused);
}

void ChunkedModel::abort_iteration() {
  if (phase_.load() != ModelPhase::kIdle) transition(ModelPhase::kIdle);
  finish_iteration(true);
}

void ChunkedModel::finish_iteration(bool aborted, bool forward_only) {
  if (!in_iteration_) return;
  in_iteration_ = false;
  forward_outputs_.clear();
  // Chunks this iteration did not use may still be updated by the optimizer: done before the store
  // settles and the repack reads them. If one of those updates failed, the iteration still ends (as an
  // aborted one: no repack over a half-written chunk), and the error follows unless one already does.
  std::exception_ptr update_error;
  if (grad_sink_) {
    try {
      grad_sink_->await_params();
    } catch (...) {
      update_error = std::current_exception();
    }
  }
  const bool thrown = aborted;
  aborted = aborted || update_error != nullptr;
  scheduler_->end_iteration(aborted, forward_only);
  // An evaluation forward left no gradients in the groups it gathered: every rank gives them up now.
  if (remote_ && forward_only && !aborted) remote_->release_all();
  store_->settle();  // idle: every parameter readable, its chunk on the device or aliased on the host
  if (remote_hazard_) watch_outside_uses();  // this thread drives the model (Note [Ops outside the scopes])
  if (!aborted && !forward_only && !initial_values_.empty()) {
    log::debug("ferry: releasing the parameters' initial values (an optimizer attached from now on starts its "
               "fp32 masters from the ", dtype_, " compute copy)");
    release_initial_values();
  }
  int64_t held_by = -1;
  const int64_t held = !aborted && options_.repack_after_warmup && scheduler_->repack_wanted()
                           ? views_held_outside(&held_by) : 0;
  if (held > 0) {
    // Note [A repack waits for held views]
    if (repack_waits_++ == 0) {
      log::warn("ferry: the warm-up repack waits: views of parameter or optimizer state chunk memory are held "
                "outside ferry (", held, " references", held_by >= 0 ? ", one to '" + names_[held_by] + "'" : "", ")",
                ": a graph not yet backwarded, or a view or detach() of a parameter or of a state chunk "
                "(adam.state_store()) kept; it runs at the end of the first iteration after they are gone");
    }
  } else if (!aborted && scheduler_->repack_wanted()) {
    if (repack_waits_ > 0) {
      log::info("ferry: the held views are gone; the warm-up repack runs (it waited ", repack_waits_,
                " iteration end(s))");
    }
    if (options_.repack_after_warmup) {
      std::vector<int64_t> order = scheduler_->trace()->first_use_order(num_params());
      std::vector<char> used(params_.size(), 0);
      for (int64_t p : order) used[p] = 1;
      for (size_t p = 0; p < params_.size(); ++p) {
        if (!used[p]) order.push_back(static_cast<int64_t>(p));  // never used: at the end
      }
      const auto start = std::chrono::steady_clock::now();
      build(order);
      repack_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      log::info("ferry: repacked ", params_.size(), " parameters in call order into ", layout_.num_chunks(),
                " chunks (waste ", static_cast<int>(layout_.waste() * 1000) / 10.0, "%) in ",
                static_cast<int64_t>(repack_seconds_ * 1000), " ms");
    }
    scheduler_->relayout(*store_, tensor_of_param_, chunk_of_param_);
    if (options_.repack_after_warmup && layout_listener_) layout_listener_->layout_changed();
  }
  if (update_error && !thrown) std::rethrow_exception(update_error);
}

void ChunkedModel::materialize() {
  TORCH_CHECK(!grad_sink_, "ferry: materialize() while an optimizer (the model's gradient sink) is attached: destroy "
              "it first (adam.reset()), after adam.save() or adam.state_dict() if you need its fp32 masters");
  materialize(/*fetch_remote=*/true);
}

void ChunkedModel::materialize(bool fetch_remote) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  if (materialized_) return;
  TORCH_CHECK(phase_.load() == ModelPhase::kIdle || phase_.load() == ModelPhase::kForwardDone,
              "ferry: materialize() inside forward/backward");
  try {  // a parameter given new storage keeps those values (Note [Writes to parameters])
    take_writes("materialize()");
  } catch (const std::exception& e) {  // the parameters get their memory back all the same
    log::warn("ferry: materialize(): ", e.what());
  }
  if (grad_sink_) grad_sink_->await_params();
  if (remote_ && remote_->any_remote()) {
    if (fetch_remote) {
      remote_->fetch_all();  // a collective: every rank materializes
    } else {
      log::info("ferry: the ChunkedModel is destroyed while its parameters are sharded across ranks: the "
                "parameters in chunks of other ranks are left empty (0 elements); call materialize() on every "
                "rank first to keep them");
    }
  }
  if (grad_sink_) {  // only from the destructor: the public materialize() refuses
    log::error("ferry: a ChunkedModel is destroyed before its optimizer (gradient sink): destroy the optimizer "
               "first (declare it after the model); the optimizer refuses every call from now on, and its fp32 "
               "masters are lost (the parameters keep their ", dtype_, " values)");
    try {
      grad_sink_->model_gone();
    } catch (const std::exception& e) {
      log::error("ferry: the gradient sink failed to let go of its model: ", e.what());
    }
    install_grad_hooks(false);
    grad_sink_ = nullptr;
  }
  if (grads_in_slots_ > 0) {
    log::warn("ferry: materialize(): ", grads_in_slots_, " parameter(s) hold their gradients, not their values "
              "(backward without an optimizer step); they keep the gradients");
  }
  unregister_storages();
  hold_remote_hazard(false);  // plain tensors from here on
  hold_forward_done_hazard(false);
  const c10::Device device = store_->device();
  for (size_t p = 0; p < params_.size(); ++p) {
    const TensorId t = tensor_of_param_[p];
    at::Tensor fresh;
    if (store_->location(chunk_of_param_[p]) == Location::kNone) {
      // Remote, not fetched (see above): unusable, loudly (any use fails on its shape), and no memory for
      // a model that may not fit.
      fresh = at::empty({0}, at::TensorOptions().dtype(dtype_).device(device));
    } else {
      fresh = store_->view(t).to(device, /*non_blocking=*/false, /*copy=*/true);
    }
    params_[p].set_data(fresh);
  }
  store_->synchronize();
  materialized_ = true;
}

NamedTensors ChunkedModel::state_dict() {
  TORCH_CHECK(phase_.load() == ModelPhase::kIdle, "ferry: state_dict() is for between iterations (the model is in ",
              to_string(phase_.load()), ")");
  if (grad_sink_) grad_sink_->await_params();
  take_writes("state_dict()");  // Note [Writes to parameters]
  check_no_grad_in_slots("state_dict()");
  const bool fetched = remote_ && remote_->any_remote();
  if (fetched) remote_->fetch_all();  // a collective: every rank calls state_dict()
  NamedTensors out;
  for (int64_t p = 0; p < num_params(); ++p) out.emplace_back(names_[p], param_values(p).to(at::kCPU).clone());
  if (fetched) remote_->release_all();
  for (const auto& b : module_->named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) out.emplace_back(b.key(), b.value().to(at::kCPU).clone());
  }
  return out;
}

void ChunkedModel::load_state_dict(const NamedTensors& values) {
  TORCH_CHECK(phase_.load() == ModelPhase::kIdle, "ferry: load_state_dict() is for between iterations (the model "
              "is in ", to_string(phase_.load()), ")");
  std::unordered_map<std::string, const at::Tensor*> given;
  for (const auto& [name, t] : values) {
    TORCH_CHECK(given.emplace(name, &t).second, "ferry: load_state_dict: '", name, "' is given twice");
  }
  auto buffers = module_->named_buffers(/*recurse=*/true);
  auto check = [&](const std::string& name, at::IntArrayRef shape) {
    auto it = given.find(name);
    TORCH_CHECK(it != given.end(), "ferry: load_state_dict: '", name, "' is missing");
    TORCH_CHECK(it->second->defined() && it->second->sizes() == shape, "ferry: load_state_dict: '", name,
                "' has shape ", it->second->defined() ? it->second->sizes() : at::IntArrayRef{}, ", the model's is ",
                shape);
    return it->second;
  };
  // Check everything before writing anything.
  for (int64_t p = 0; p < num_params(); ++p) check(names_[p], shapes_[p]);
  size_t expected = static_cast<size_t>(num_params());
  for (const auto& b : buffers) {
    if (b.value().defined()) check(b.key(), b.value().sizes()), ++expected;
  }
  if (given.size() != expected) {
    std::unordered_set<std::string> known(names_.begin(), names_.end());
    for (const auto& b : buffers) known.insert(b.key());
    for (const auto& [name, t] : values) {
      TORCH_CHECK(known.count(name), "ferry: load_state_dict: '", name, "' is not a parameter or buffer of this model");
    }
  }
  at::NoGradGuard no_grad;
  if (grad_sink_) grad_sink_->await_params();
  take_writes("load_state_dict()");  // a parameter given new storage views its slot again, which is loaded
  if (remote_ && remote_->any_remote()) remote_->fetch_all();  // a collective: every rank loads
  for (int64_t p = 0; p < num_params(); ++p) param_values(p).copy_(*given.at(names_[p]));
  for (auto& b : buffers) {
    if (b.value().defined()) b.value().copy_(*given.at(b.key()));
  }
  clear_grad_slots();  // every slot holds its value now
}

}  // namespace ferry
