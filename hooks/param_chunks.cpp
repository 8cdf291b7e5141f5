// ParamChunks (see param_chunks.h).
#include "param_chunks.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <unordered_map>

#include "../chunk/repack.h"
#include "../common/logging.h"

namespace ferry {

ParamChunks::ParamChunks(const ParamTable& params, UseListener* listener, std::shared_ptr<const Device> device,
                         at::ScalarType dtype, ParamChunksOptions options)
    : params_(params), listener_(listener), device_(std::move(device)), dtype_(dtype), options_(std::move(options)) {
  TORCH_CHECK(device_ != nullptr, "ferry: ParamChunks needs a device, got none");
  build({}, /*device_room_bytes=*/0);
}

ParamChunks::~ParamChunks() { unregister_storages(); }

void ParamChunks::build(const std::vector<int64_t>& order, int64_t device_room_bytes) {
  const bool first = store_ == nullptr;
  int64_t chunk_bytes = options_.chunk_size_bytes;
  if (chunk_bytes == 0) {  // auto: the least packing waste for this order
    const AutoChunkSize choice = auto_chunk_size(params_.numels(), order, static_cast<int64_t>(c10::elementSize(dtype_)),
                                                 options_.auto_chunk_max_bytes);
    chunk_bytes = choice.chunk_bytes;
    // Said once at info, at construction; the repack's choice (for the order of first use) at debug.
    const log::Level level = first ? log::Level::kInfo : log::Level::kDebug;
    if (log::enabled(level)) {
      log::write(level, log::detail::concat("ferry: chunk size ", format_bytes(chunk_bytes), first ? "" : " for the "
                                            "repack", " (auto: least packing waste between ", format_bytes(choice.lo_bytes),
                                            " and ", format_bytes(choice.hi_bytes),
                                            choice.capped ? ", at most a sixteenth of the device's room for chunks" : "",
                                            ", waste ", static_cast<int>(choice.waste * 1000) / 10.0, "%)"));
    }
  }
  const PackOptions pack = PackOptions::from_bytes(chunk_bytes, dtype_);
  ChunkLayout layout = ChunkLayout::pack(params_.numels(), order, pack);
  ChunkStoreOptions store_options;
  store_options.device = device_;
  store_options.device_budget_bytes = options_.device_budget_bytes;
  store_options.host_budget_bytes = options_.host_budget_bytes;
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
  const auto role = store->add_layout(ChunkRole::kParam, dtype_, layout, params_.shapes(), Location::kNone);
  // A repack builds a chunk on the device where its parameters are (Note [Repack stays on the device]),
  // within the room the trace leaves chunks at its worst moment.
  FillPlacement placement;
  if (!first) {
    placement.keep_on_device = true;
    placement.device_room_bytes = device_room_bytes;
  }
  const int64_t peak = fill_layout(*store, layout, {role}, store_.get(), {tensor_of_param_},
                                   [&](int, int64_t p, TensorId slot) {
    // First build: the values are the parameter's own; a repack reads them from the old store.
    at::Tensor param = params_.param(p);  // a handle: binding changes what the parameter views
    const at::Tensor values = first ? param.detach() : store_->view(tensor_of_param_[p]);
    if (first && dtype_ != at::kFloat && param.scalar_type() != dtype_) {
      // The compute copy rounds them; an optimizer's fp32 masters should start from these values.
      // Keeping them only delays freeing the module's own memory (no copy is made).
      initial_values_.resize(params_.size());
      initial_values_[p] = values;
    }
    store->set_state(slot, TensorState::kHold);
    store->bind(slot, param, values);
  }, placement);
  if (!first) repack_stats_.peak_bytes = peak;
  std::vector<TensorId> tensor_of_param = role.tensors;
  std::vector<ChunkId> chunk_of_param(params_.size());
  for (int64_t p = 0; p < params_.size(); ++p) chunk_of_param[p] = role.chunks[layout.slots()[p].chunk];
  param_chunks_ = role.chunks;
  ++layout_version_;
  unregister_storages();
  store_ = std::move(store);  // the old store goes; parameters already view the new one
  layout_ = std::move(layout);
  // The optimizer state follows in the same repack, with the same routine.
  states_.erase(std::remove_if(states_.begin(), states_.end(), [](const auto& w) { return w.expired(); }), states_.end());
  for (const auto& weak : states_) {
    if (auto state = weak.lock()) state->build(layout_, params_.shapes());
  }
  tensor_of_param_ = std::move(tensor_of_param);
  chunk_of_param_ = std::move(chunk_of_param);
  register_storages();
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
int64_t ParamChunks::views_held_outside(int64_t* example) {
  std::vector<int64_t> bound(param_chunks_.size(), 0);
  std::unordered_map<ChunkId, size_t> index;
  for (size_t i = 0; i < param_chunks_.size(); ++i) index[param_chunks_[i]] = i;
  for (int64_t p = 0; p < params_.size(); ++p) ++bound[index.at(chunk_of_param_[p])];
  int64_t held = 0;
  for (size_t i = 0; i < param_chunks_.size(); ++i) {
    const int64_t extra = store_->storage_holders(param_chunks_[i]) - bound[i];
    if (extra <= 0) continue;
    held += extra;
    if (example && *example < 0) {
      for (int64_t p = 0; p < params_.size(); ++p) {
        if (chunk_of_param_[p] == param_chunks_[i]) {
          *example = p;
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

bool ParamChunks::repack_waits_for_views() {
  int64_t held_by = -1;
  const int64_t held = views_held_outside(&held_by);
  if (held <= 0) return false;
  // Note [A repack waits for held views]
  if (repack_stats_.waits++ == 0) {
    log::warn("ferry: the warm-up repack waits: views of parameter or optimizer state chunk memory are held "
              "outside ferry (", held, " references", held_by >= 0 ? ", one to '" + params_.name(held_by) + "'" : "",
              ")", ": a graph not yet backwarded, or a view or detach() of a parameter or of a state chunk "
              "(adam.state_store()) kept; it runs at the end of the first iteration after they are gone");
  }
  return true;
}

void ParamChunks::repack(const std::vector<int64_t>& order, int64_t device_room_bytes) {
  if (repack_stats_.waits > 0) {
    log::info("ferry: the held views are gone; the warm-up repack runs (it waited ", repack_stats_.waits,
              " iteration end(s))");
  }
  const auto start = std::chrono::steady_clock::now();
  build(order, device_room_bytes);
  repack_stats_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log::info("ferry: repacked ", params_.size(), " parameters in call order into ", layout_.num_chunks(),
            " chunks of ", format_bytes(layout_.options().chunk_numel * static_cast<int64_t>(c10::elementSize(dtype_))),
            " (waste ", static_cast<int>(layout_.waste() * 1000) / 10.0, "%) in ",
            static_cast<int64_t>(repack_stats_.seconds * 1000), " ms");
}

void ParamChunks::register_storages() {
  std::unordered_map<const c10::StorageImpl*, std::vector<ParamRange>> by_storage;
  for (int64_t p = 0; p < params_.size(); ++p) {
    const at::Tensor& t = params_.param(p);
    const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    const int64_t begin = t.storage_offset();
    by_storage[s].push_back({begin, begin + t.numel(), p});
  }
  for (auto& [storage, ranges] : by_storage) {
    register_storage(storage, listener_, std::move(ranges));
    registered_.push_back(storage);
  }
}

void ParamChunks::unregister_storages() {
  for (const c10::StorageImpl* s : registered_) unregister_storage(s);
  registered_.clear();
}

std::shared_ptr<StateChunks> ParamChunks::attach_state(std::vector<ChunkRole> roles, const StateChunks::Init& init,
                                                       std::vector<int> zero_roles) {
  return attach_state(StateChunks::fp32_specs(roles, zero_roles), init);
}

std::shared_ptr<StateChunks> ParamChunks::attach_state(std::vector<StateRoleSpec> roles, const StateChunks::Init& init) {
  ChunkStoreOptions options;
  options.device = device_;  // no budget of its own: groups are placed by the optimizer, admitted by the scheduler
  options.name = "optimizer state";
  // Pinned memory only for what moves every iteration (the parameter chunks): state chunks either stay
  // on the host (CpuAdam reads them there) or move to the device once, at placement; pinning them would
  // lock 12 B/param of host memory for nothing and cost seconds of cudaHostAlloc.
  options.pin_host_memory = false;
  options.accountant = accountant_;  // one device budget for parameters and state
  auto state = std::make_shared<StateChunks>(std::move(options), std::move(roles));
  state->build(layout_, params_.shapes(), init);
  states_.push_back(state);
  return state;
}

void ParamChunks::trace_copies(const ClockAnchor& anchor) const {
  store_->trace_copies(anchor);
  for (const auto& weak : states_) {
    if (const auto state = weak.lock()) state->store().trace_copies(anchor);
  }
}

void ParamChunks::unbind() {
  if (!bound_) return;
  unregister_storages();
  const c10::Device device = store_->device();
  for (int64_t p = 0; p < params_.size(); ++p) {
    const TensorId t = tensor_of_param_[p];
    at::Tensor fresh;
    if (store_->location(chunk_of_param_[p]) == Location::kNone) {
      // Remote, not fetched: unusable, loudly (any use fails on its shape), and no memory for a model
      // that may not fit.
      fresh = at::empty({0}, at::TensorOptions().dtype(dtype_).device(device));
    } else {
      fresh = store_->view(t).to(device, /*non_blocking=*/false, /*copy=*/true);
    }
    params_.param(p).set_data(fresh);
  }
  store_->synchronize();
  bound_ = false;
}

}  // namespace ferry
