// ChunkedModel: construction and the model between iterations (see chunked_model.h); one iteration is
// in model_iteration.cpp.
#include "chunked_model.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <unordered_map>
#include <unordered_set>

#include "../common/logging.h"

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

// The caller's Config, checked before anything is touched; the log takes its level and rank unless the
// program configured it itself (log::configure_default).
const Config& checked(const std::shared_ptr<torch::nn::Module>& module, const Config& config) {
  TORCH_CHECK(module, "ferry: ChunkedModel needs a module, got null");
  config.validate();
  log::configure_default(config.log_level, config.rank);
  return config;
}

// Host memory counts as the device's non-model memory only where the device's memory is host memory
// (ChunkedModelOptions::measure_host_non_model, make_heap_probe).
bool counts_host_memory(const ChunkedModelOptions& options, const Device& device) {
  return options.measure_host_non_model && device.torch_device().is_cpu();
}

// The caller's options with the scheduler's budget and capacity from the one DeviceBudget made of the
// Config (chunk/device.h), checked before the module is touched.
ChunkedModelOptions with_budget(ChunkedModelOptions options, const Config& config, const Device& device) {
  const DeviceBudget budget = DeviceBudget::of(config, device, counts_host_memory(options, device));
  options.scheduler.device_budget_bytes = budget.budget_bytes;
  options.scheduler.device_capacity_bytes = budget.capacity_bytes;
  options.scheduler.validate();
  return options;
}

ParamChunksOptions chunk_options(const Config& config, const ChunkedModelOptions& options) {
  ParamChunksOptions o;
  o.chunk_size_bytes = config.chunk_size_bytes;
  o.device_budget_bytes = options.scheduler.device_budget_bytes;  // the DeviceBudget's (with_budget)
  // D99: the auto size leaves the device's room (the budget, else the capacity) sixteen uses' worth of
  // chunks; sharded, a use gathers a group of world_size chunks.
  const int64_t room = o.device_budget_bytes > 0 ? o.device_budget_bytes : options.scheduler.device_capacity_bytes;
  o.auto_chunk_max_bytes = auto_chunk_cap_bytes(room, std::max(1, config.world_size));
  o.host_budget_bytes = config.host_budget_bytes;
  o.host_cache_bytes = options.host_cache_bytes;
  o.copy_engine = options.copy_engine;
  return o;
}

// How a segment's recompute is measured (ActivationSegments::Probe): the device's allocated bytes, or
// on the simulated device (which cannot tell) the process heap in use, where its CPU tensors live;
// the device synchronised around it, so that its time is the device's.
ActivationSegments::Probe segment_probe(const std::shared_ptr<const Device>& device) {
  ActivationSegments::Probe p;
  p.allocated_bytes = [device] {
    const int64_t bytes = device->allocated_bytes();
    return bytes >= 0 ? bytes : host_heap_in_use_bytes();
  };
  p.synchronize = [device] { device->synchronize(); };
  return p;
}

}  // namespace

ChunkedModel::ChunkedModel(std::shared_ptr<torch::nn::Module> module, const Config& config,
                           ChunkedModelOptions options)
    : module_(std::move(module)),
      config_(checked(module_, config)),
      device_(make_device(config_.device)),
      options_(with_budget(std::move(options), config_, *device_)),
      table_(*module_, dtype_of(config_.precision)),
      chunks_(table_, this, device_, dtype_of(config_.precision), chunk_options(config_, options_)),
      slots_(table_.size()),
      timer_([this] { return chunks_.store().make_mark(); }),  // the device never changes (a repack keeps it)
      activations_(config_.activations, segment_probe(device_)) {
  watch_.remember(table_.params());  // Note [Writes to parameters]: as bound
  const c10::Device device = chunks_.store().device();
  for (auto& b : module_->buffers(/*recurse=*/true)) {
    if (b.defined() && b.device() != device) b.set_data(b.to(device));
  }
  std::unique_ptr<MemoryProbe> probe = std::move(options_.probe);
  if (!probe && counts_host_memory(options_, *device_)) {
    probe = make_heap_probe([this] {
      const ChunkStoreStats s = chunks_.store().stats();
      return s.device.current_bytes + s.host.current_bytes + s.host_buffers.cached_bytes;
    });
  }
  if (!probe) probe = make_memory_probe(device_);
  scheduler_ = std::make_unique<Scheduler>(chunks_.store(), chunks_.policy(), std::move(probe), options_.scheduler,
                                           chunks_.tensor_of_param(), chunks_.chunk_of_param());
  int64_t bytes = 0;
  for (int64_t n : table_.numels()) bytes += n * static_cast<int64_t>(c10::elementSize(compute_dtype()));
  const int64_t budget = options_.scheduler.device_budget_bytes, capacity = options_.scheduler.device_capacity_bytes;
  log::info("ferry: ChunkedModel manages ", num_params(), " parameters (", format_bytes(bytes), " as ", compute_dtype(),
            ") in ", layout().num_chunks(), " chunks of ", format_bytes(chunk_size_bytes()), ", waste ",
            static_cast<int>(layout().waste() * 1000) / 10.0, "%, device ", device.str(), " (",
            chunks_.store().engine_name(), "), device budget ", budget ? format_bytes(budget) : "unlimited",
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

void ChunkedModel::check_module_parameters(const char* where) const { table_.check_module(*module_, where); }

// Note [Writes to parameters]
void ChunkedModel::take_writes(const char* where) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  TORCH_CHECK(chunks_.bound(), "ferry: take_writes() on a materialized ChunkedModel");
  const at::ScalarType dtype = compute_dtype();
  const std::vector<WriteWatch::Written> found = watch_.find(table_.params(), dtype, chunks_.store().device());
  if (found.empty()) return;
  std::vector<WrittenParam> written;
  int64_t recast = 0, first_recast = -1;  // replacements of another dtype
  at::ScalarType given = dtype;
  for (const WriteWatch::Written& w : found) {
    const int64_t p = w.param;
    at::Tensor t = table_.param(p);  // a handle: binding changes what the parameter views
    TORCH_CHECK(!slots_.holds_grad(p), "ferry: ", where, ": parameter ", table_.name(p), " was written after "
                "backward(), while its slot held its gradient (Note [Gradient in the parameter slot]): the write went "
                "into the gradient. Write parameters before forward() or after the optimizer's step; zero_grad() "
                "discards the gradients (and the write)");
    if (!w.replaced) {
      written.push_back({p, at::Tensor()});
      continue;
    }
    TORCH_CHECK(t.sizes() == at::IntArrayRef(table_.shapes()[p]), "ferry: ", where, ": parameter ", table_.name(p),
                " was given a tensor of shape ", t.sizes(), " (set_(), set_data() or torch::load); its shape is ",
                at::IntArrayRef(table_.shapes()[p]), " (ChunkedModel's chunks hold every parameter at its shape: wrap "
                "the module again to change one)");
    TORCH_CHECK(at::isFloatingType(t.scalar_type()), "ferry: ", where, ": parameter ", table_.name(p), " was given "
                "a tensor of dtype ", t.scalar_type(), "; a floating dtype is needed");
    if (t.scalar_type() != dtype && recast++ == 0) {
      first_recast = p;
      given = t.scalar_type();
    }
    const at::Tensor replacement = t.detach();  // keeps the given storage; the parameter views its slot again
    chunks_.store().bind(chunks_.tensor_of(p), t, replacement);
    written.push_back({p, replacement});
  }
  if (recast > 0) {  // Note [The module's parameters]
    log::warn("ferry: ", where, ": ", recast, " parameter(s) were given tensors of another dtype (",
              table_.name(first_recast), ": ", given, "; module.to(dtype) or torch::load of another precision); their "
              "values were taken in at ferry's compute dtype, ", dtype, ", which Config::precision sets: the "
              "parameters stay ", dtype, grad_sink_ ? " (the optimizer's fp32 masters take the values at full precision)" : "");
  }
  // At info the first time only (WriteWatch::count_take); later ones at debug.
  const log::Level level = watch_.count_take();
  if (log::enabled(level)) {
    log::write(level, log::detail::concat("ferry: ", written.size(), " parameter(s) written (",
                                          table_.name(written.front().param), written.size() > 1 ? ", ..." : "",
                                          "), taken in before ", where,
                                          grad_sink_ ? ", into the optimizer's state too" : "",
                                          level == log::Level::kInfo ? " (later writes: at debug level)" : ""));
  }
  for (const WrittenParam& w : written) release_initial_value(w.param);  // the write is the value now
  if (grad_sink_) grad_sink_->values_written(written);
  watch_.remember(table_.params());
}

void ChunkedModel::set_loss_scale(double scale) {
  TORCH_CHECK(std::isfinite(scale) && scale > 0, "ferry: loss scale must be finite and > 0, got ", scale);
  loss_scale_ = scale;
}

std::shared_ptr<StateChunks> ChunkedModel::attach_state(std::vector<ChunkRole> roles, const StateChunks::Init& init,
                                                       std::vector<int> zero_roles) {
  return attach_state(StateChunks::fp32_specs(roles, zero_roles), init);
}

std::shared_ptr<StateChunks> ChunkedModel::attach_state(std::vector<StateRoleSpec> roles, const StateChunks::Init& init) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  TORCH_CHECK(phase_.load() == ModelPhase::kIdle || phase_.load() == ModelPhase::kForwardDone,
              "ferry: attach_state() inside an iteration");
  take_writes("attach_state()");  // the state starts from what was written before it (Note [Writes to parameters])
  return chunks_.attach_state(std::move(roles), init);
}

void ChunkedModel::set_remote_chunks(std::shared_ptr<RemoteChunks> remote) {
  TORCH_CHECK(phase_.load() == ModelPhase::kIdle, "ferry: set_remote_chunks() inside an iteration (phase ",
              to_string(phase_.load()), ")");
  TORCH_CHECK(!remote || layout_final(), "ferry: parameters can be sharded only once the warm-up repack is done");
  chunks_.set_remote(std::move(remote));
  scheduler_->set_remote(chunks_.remote());
  hold_remote_hazard(chunks_.remote() != nullptr);
}

at::Tensor ChunkedModel::param_values(int64_t index) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  TORCH_CHECK(index >= 0 && index < num_params(), "ferry: parameter index ", index, " out of range [0, ", num_params(),
              ")");
  if (grad_sink_) grad_sink_->await_param(index);
  const TensorId t = chunks_.tensor_of(index);
  TORCH_CHECK(!chunks_.remote_param(index) || chunks_.store().tensor_info(t).state != TensorState::kFree,
              "ferry: parameter ", table_.name(index), " is in a chunk that another rank owns and that is not fetched "
              "now (sharded parameters); state_dict() gathers every parameter");
  return chunks_.store().view(t);
}

void ChunkedModel::set_layout_listener(LayoutListener* listener) {
  const ModelPhase phase = phase_.load();
  TORCH_CHECK(phase == ModelPhase::kIdle || (!listener && phase == ModelPhase::kForwardDone),
              "ferry: set_layout_listener() inside an iteration (phase ", to_string(phase), ")");
  layout_listener_ = listener;
}

void ChunkedModel::set_plan_agreement(PlanAgreement* agreement) {
  const ModelPhase phase = phase_.load();
  TORCH_CHECK(phase == ModelPhase::kIdle || (!agreement && phase == ModelPhase::kForwardDone),
              "ferry: set_plan_agreement() inside an iteration (phase ", to_string(phase), ")");
  plan_agreement_ = agreement;
}

void ChunkedModel::set_grad_sink(GradSink* sink) {
  const ModelPhase phase = phase_.load();
  TORCH_CHECK(phase == ModelPhase::kIdle || (!sink && phase == ModelPhase::kForwardDone),
              "ferry: set_grad_sink() inside an iteration (phase ", to_string(phase), ")");
  TORCH_CHECK(chunks_.bound(), "ferry: set_grad_sink() on a materialized ChunkedModel");
  TORCH_CHECK(sink == nullptr || grad_sink_ == nullptr || sink == grad_sink_,
              "ferry: set_grad_sink(): the model's gradients go to another sink already; set null first");
  grad_sink_ = sink;
  install_grad_hooks(sink != nullptr);
}

void ChunkedModel::check_trainable() {
  if (!grad_sink_) return;
  const GradSlots::Changed changed = slots_.trainable_changed(table_.params());
  if (changed.count == 0) return;
  log::info("ferry: ", changed.count, " parameter(s) changed requires_grad since the last forward (",
            table_.name(changed.first), " now ", slots_.trainable(changed.first) ? "requires" : "does not require",
            " it); the optimizer is told");
  grad_sink_->trainable_changed();
}

void ChunkedModel::check_activation_plan() {
  if (!grad_sink_ || activations_.changes() == told_activation_changes_) return;
  told_activation_changes_ = activations_.changes();
  grad_sink_->backward_uses_changed();
}

void ChunkedModel::clear_grad_slots() {
  TORCH_CHECK(phase_.load() == ModelPhase::kIdle || phase_.load() == ModelPhase::kForwardDone,
              "ferry: clear_grad_slots() inside an iteration");
  slots_.clear_all();
}

void ChunkedModel::clear_grad_slot(int64_t index) {
  // Backward too: a gradient sink that gave the slot its value back (on autograd's thread, or in
  // backward_finished) says so here.
  const ModelPhase phase = phase_.load();
  TORCH_CHECK(phase == ModelPhase::kIdle || phase == ModelPhase::kForwardDone || phase == ModelPhase::kBackward,
              "ferry: clear_grad_slot() inside a forward");
  TORCH_CHECK(index >= 0 && index < num_params(), "ferry: parameter index ", index, " out of range [0, ", num_params(), ")");
  slots_.clear(index);
}

void ChunkedModel::check_no_grad_in_slots(const char* what) const {
  if (!slots_.any()) return;
  TORCH_CHECK(false, "ferry: ", what, ": ", slots_.count(), " parameter(s), e.g. ", table_.name(slots_.first()),
              ", hold their gradients in their chunks since backward (the optimizer step writes their values "
              "back); call the optimizer's step() or zero_grad() first");
}

PhaseSeconds ChunkedModel::last_phase_seconds() const {
  TORCH_CHECK(phase_.load() == ModelPhase::kIdle, "ferry: last_phase_seconds() between iterations only, not in ",
              to_string(phase_.load()), " (after an evaluation forward, call end_iteration() first)");
  return timer_.seconds();
}

void ChunkedModel::trace_last_phases() const {
  if (!trace::enabled()) return;
  TORCH_CHECK(phase_.load() == ModelPhase::kIdle, "ferry: trace_last_phases() between iterations only, not in ",
              to_string(phase_.load()));
  const ClockAnchor anchor(chunks_.store().make_mark());
  timer_.trace(anchor);
  chunks_.trace_copies(anchor);
}

void ChunkedModel::materialize() {
  TORCH_CHECK(!grad_sink_, "ferry: materialize() while an optimizer (the model's gradient sink) is attached: destroy "
              "it first (adam.reset()), after adam.save() or adam.state_dict() if you need its fp32 masters");
  materialize(/*fetch_remote=*/true);
}

void ChunkedModel::materialize(bool fetch_remote) {
  const OwnOps own_ops;  // ferry's ops, never uses of a parameter (hooks/interceptor.h)
  if (!chunks_.bound()) return;
  TORCH_CHECK(phase_.load() == ModelPhase::kIdle || phase_.load() == ModelPhase::kForwardDone,
              "ferry: materialize() inside forward/backward");
  try {  // a parameter given new storage keeps those values (Note [Writes to parameters])
    take_writes("materialize()");
  } catch (const std::exception& e) {  // the parameters get their memory back all the same
    log::warn("ferry: materialize(): ", e.what());
  }
  if (grad_sink_) grad_sink_->await_params();
  const std::shared_ptr<RemoteChunks>& remote = chunks_.remote();
  if (remote && remote->any_remote()) {
    if (fetch_remote) {
      remote->fetch_all();  // a collective: every rank materializes
    } else {
      log::info("ferry: the ChunkedModel is destroyed while its parameters are sharded across ranks: the "
                "parameters in chunks of other ranks are left empty (0 elements); call materialize() on every "
                "rank first to keep them");
    }
  }
  if (grad_sink_) {  // only from the destructor: the public materialize() refuses
    log::error("ferry: a ChunkedModel is destroyed before its optimizer (gradient sink): destroy the optimizer "
               "first (declare it after the model); the optimizer refuses every call from now on, and its fp32 "
               "masters are lost (the parameters keep their ", compute_dtype(), " values)");
    try {
      grad_sink_->model_gone();
    } catch (const std::exception& e) {
      log::error("ferry: the gradient sink failed to let go of its model: ", e.what());
    }
    install_grad_hooks(false);
    grad_sink_ = nullptr;
  }
  if (slots_.any()) {
    log::warn("ferry: materialize(): ", slots_.count(), " parameter(s) hold their gradients, not their values "
              "(backward without an optimizer step); they keep the gradients");
  }
  hold_remote_hazard(false);  // plain tensors from here on
  hold_forward_done_hazard(false);
  chunks_.unbind();  // unregisters, then gives every parameter plain device memory
}

NamedTensors ChunkedModel::state_dict() {
  TORCH_CHECK(phase_.load() == ModelPhase::kIdle, "ferry: state_dict() is for between iterations (the model is in ",
              to_string(phase_.load()), ")");
  if (grad_sink_) grad_sink_->await_params();
  take_writes("state_dict()");  // Note [Writes to parameters]
  check_no_grad_in_slots("state_dict()");
  const std::shared_ptr<RemoteChunks>& remote = chunks_.remote();
  const bool fetched = remote && remote->any_remote();
  if (fetched) remote->fetch_all();  // a collective: every rank calls state_dict()
  NamedTensors out;
  for (int64_t p = 0; p < num_params(); ++p) out.emplace_back(table_.name(p), param_values(p).to(at::kCPU).clone());
  if (fetched) remote->release_all();
  for (const auto& b : module_->named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) out.emplace_back(b.key(), b.value().to(at::kCPU).clone());
  }
  return out;
}

void ChunkedModel::load_state_dict(const NamedTensors& values, const ValueLoaded& loaded,
                                   const std::function<void(int64_t param, const at::Tensor& value)>& also) {
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
  for (int64_t p = 0; p < num_params(); ++p) check(table_.name(p), table_.shapes()[p]);
  size_t expected = static_cast<size_t>(num_params());
  for (const auto& b : buffers) {
    if (b.value().defined()) check(b.key(), b.value().sizes()), ++expected;
  }
  if (given.size() != expected) {
    std::unordered_set<std::string> known(table_.names().begin(), table_.names().end());
    for (const auto& b : buffers) known.insert(b.key());
    for (const auto& [name, t] : values) {
      TORCH_CHECK(known.count(name), "ferry: load_state_dict: '", name, "' is not a parameter or buffer of this model");
    }
  }
  at::NoGradGuard no_grad;
  if (grad_sink_) grad_sink_->await_params();
  take_writes("load_state_dict()");  // a parameter given new storage views its slot again, which is loaded
  const std::shared_ptr<RemoteChunks>& remote = chunks_.remote();
  if (remote && remote->any_remote()) remote->fetch_all();  // a collective: every rank loads
  for (int64_t p = 0; p < num_params(); ++p) {
    const at::Tensor& value = *given.at(table_.name(p));
    param_values(p).copy_(value);
    if (also) also(p, value);
    if (loaded) loaded(value);
  }
  for (auto& b : buffers) {
    if (!b.value().defined()) continue;
    const at::Tensor& value = *given.at(b.key());
    b.value().copy_(value);
    if (loaded) loaded(value);
  }
  clear_grad_slots();  // every slot holds its value now
}

}  // namespace ferry
