// HybridAdam's API over its engine (optim/engine.h).
#include "hybrid_adam.h"

#include <utility>

#include "../common/safetensors.h"
#include "checkpoint_files.h"
#include "engine.h"
#include "state_roles.h"

namespace ferry {

HybridAdam::HybridAdam(ChunkedModel& model, HybridAdamOptions options)
    : engine_(std::make_unique<optim::Engine>(model, std::move(options))) {}

HybridAdam::~HybridAdam() = default;

StepResult HybridAdam::step() { return engine_->step(); }
StepResult HybridAdam::backward_step(const at::Tensor& loss) { return engine_->backward_step(loss); }
void HybridAdam::zero_grad() { engine_->zero_grad(); }
void HybridAdam::synchronize() { engine_->synchronize(); }
std::future<void> HybridAdam::run_on_worker(std::function<void()> job) { return engine_->run_on_worker(std::move(job)); }
int64_t HybridAdam::pipelined_jobs_started() const { return engine_->pipelined_jobs_started(); }
optim::RoundTrips::Stats HybridAdam::round_trip_stats() const { return engine_->round_trip_stats(); }
JointRates HybridAdam::joint_rates() const { return engine_->joint_rates(); }
int64_t HybridAdam::values_from_owners() const { return engine_->values_from_owners(); }
std::shared_ptr<const dist::ParamShards> HybridAdam::param_shards() const { return engine_->param_shards(); }

int HybridAdam::num_param_groups() const { return engine_->num_param_groups(); }
int HybridAdam::group_of(int64_t param) const { return engine_->group_of(param); }
const AdamOptions& HybridAdam::group_options(int group) const { return engine_->group_options(group); }
void HybridAdam::set_lr(int group, double lr) { engine_->set_lr(group, lr); }
void HybridAdam::set_lr(double lr) { engine_->set_lr(lr); }
int64_t HybridAdam::step_count(int group) const { return engine_->step_count(group); }
int64_t HybridAdam::param_step_count(int64_t param) const { return engine_->param_step_count(param); }
double HybridAdam::loss_scale() const { return engine_->loss_scale(); }
const DynamicLossScaler& HybridAdam::loss_scaler() const { return engine_->loss_scaler(); }
bool HybridAdam::uses_loss_scaling() const { return engine_->uses_loss_scaling(); }

bool HybridAdam::placed() const { return engine_->placed(); }
int64_t HybridAdam::device_state_chunks() const { return engine_->device_state_chunks(); }
bool HybridAdam::state_on_device(int64_t layout_chunk) const { return engine_->state_on_device(layout_chunk); }
int64_t HybridAdam::state_bytes_per_chunk(int64_t layout_chunk) const {
  return engine_->state_bytes_per_chunk(layout_chunk);
}
int HybridAdam::num_state_roles() const { return engine_->num_state_roles(); }
StateFormat HybridAdam::state_format() const { return engine_->state_format(); }
at::Tensor HybridAdam::master(int64_t param) { return engine_->state_view(optim::kMasterRole, param); }
at::Tensor HybridAdam::exp_avg(int64_t param) { return engine_->state_view(optim::kExpAvgRole, param); }
at::Tensor HybridAdam::exp_avg_sq(int64_t param) { return engine_->state_view(optim::kExpAvgSqRole, param); }
at::Tensor HybridAdam::grad(int64_t param) { return engine_->grad(param); }
ChunkStore& HybridAdam::state_store() { return engine_->state_store(); }
int64_t HybridAdam::last_migration_peak_bytes() const { return engine_->last_migration_peak_bytes(); }

void HybridAdam::save(const std::string& dir) { engine_->save(dir); }
void HybridAdam::load(const std::string& dir) { engine_->load(dir); }
bool HybridAdam::grads_pending() const { return engine_->grads_pending(); }
void HybridAdam::check_save_target(const std::string& dir) { optim::check_checkpoint_target(dir); }
NamedTensors HybridAdam::state_dict() { return engine_->state_dict(); }
void HybridAdam::load_state_dict(const NamedTensors& values, const ValueLoaded& loaded) {
  engine_->load_state_dict(values, loaded);
}
void HybridAdam::export_safetensors(const std::string& path) {
  write_safetensors(path, state_dict(), {{"format", "pt"}});
}

}  // namespace ferry
