#pragma once
// StateChunks: the optimizer's half of each parameter chunk's group. For every chunk of a parameter
// layout, one chunk per role (master, exp_avg, exp_avg_sq, and with accumulation an fp32 grad), in a
// store of their own that shares the parameters' DeviceAccountant (one device budget for both) and
// never pins host memory (state moves once, at placement). A role has its own dtype (fp32; the compact
// format's bf16 master and uint8 moment codes) and either mirrors the parameter chunk slot for slot or,
// with a block, holds `per_block` values per block of each tensor (the compact format's scales) in a
// derived layout (ChunkLayout::derive): same groups, same tensors, its own offsets. A group's bytes are
// its chunks' real bytes, so placement weighs what the format really costs.
//
// The parameter chunks' owner (ChunkedModel) builds it with the layout and migrates it in the same
// repack, with the same routine (fill_layout, chunk/repack.h); the optimizer asks it for views and
// decides where groups live (move_group), nothing more.
//
// Zero roles (the moments, the accumulated gradients): they start at zero, so their chunks get memory
// only when first touched (payload(), view(), move_group(): allocated in place, on the device directly
// for a group placed there) and never on a rank that drops them before (D46). A repack keeps a role
// that was never touched unallocated.
//
// Sharding (data parallelism, D44): drop(group, roles) frees the payloads of those roles of a group whose
// state another rank holds; their views then fail, naming the group. A repack after a drop fails (the
// state a rank would need for its new chunks is on other ranks): shard after the layout is final.
//
// Contract: for between iterations and for the optimizer's own work during backward (the pipelined
// step); not thread-safe beyond what ChunkStore guarantees.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "chunk_store.h"
#include "layout.h"

namespace ferry {

// One role of the state chunks.
struct StateRoleSpec {
  ChunkRole role = ChunkRole::kMaster;
  at::ScalarType dtype = at::kFloat;  // checked against the role (check_role_dtype, role.h)
  bool zero = false;                  // starts at zero: memory only when first touched
  // 0: mirrors the parameters (a tensor of n elements has n here, in its shape). > 0: a tensor of n
  // elements has per_block * ceil(n / block) values here, as a flat [count] tensor.
  int64_t block = 0;
  int64_t per_block = 0;
  int64_t numel_for(int64_t numel) const { return block ? per_block * ((numel + block - 1) / block) : numel; }
};

class StateChunks {
 public:
  StateChunks(ChunkStoreOptions options, std::vector<StateRoleSpec> roles);
  // fp32 roles mirroring the parameters; `zero_roles`: indices into `roles` of those that start at zero.
  StateChunks(ChunkStoreOptions options, const std::vector<ChunkRole>& roles, const std::vector<int>& zero_roles = {});
  // Those roles' specs.
  static std::vector<StateRoleSpec> fp32_specs(const std::vector<ChunkRole>& roles, const std::vector<int>& zero_roles);

  // The bytes each group's roles would take for `layout` (parameter layout), without building anything:
  // placement on paper (a model too large to build here).
  static std::vector<int64_t> group_bytes_for(const ChunkLayout& layout, const std::vector<StateRoleSpec>& roles);

  // Chunks for `layout` (shapes[j]: tensor j's shape). The first call gives every slot zeros, then
  // init(role, tensor, slot view) may write initial values; later calls (a repack) migrate the values
  // from the current chunks into a fresh store, chunk by chunk, dropping the old one.
  using Init = std::function<void(int role, int64_t tensor, const at::Tensor& slot)>;
  void build(const ChunkLayout& layout, const std::vector<std::vector<int64_t>>& shapes, const Init& init = {});

  int num_roles() const { return static_cast<int>(roles_.size()); }
  ChunkRole role(int r) const { return roles_[r].role; }
  const StateRoleSpec& spec(int r) const { return roles_[r]; }
  int64_t num_groups() const { return chunks_.empty() ? 0 : static_cast<int64_t>(chunks_[0].chunks.size()); }
  ChunkStore& store() { return *store_; }
  const ChunkStore& store() const { return *store_; }
  ChunkId chunk(int r, int64_t group) const { return chunks_[r].chunks[group]; }
  TensorId tensor(int r, int64_t param) const { return chunks_[r].tensors[param]; }
  // Role r's chunk of the group (layout chunk), flat, and one tensor's slot (ChunkStore::payload/view rules).
  at::Tensor payload(int r, int64_t group) {
    check_held(r, group);
    ensure_allocated(r, group, Location::kHost);
    return store_->payload(chunk(r, group));
  }
  at::Tensor view(int r, int64_t param) {
    check_held(r, group_of_[param]);
    ensure_allocated(r, group_of_[param], Location::kHost);
    return store_->view(tensor(r, param));
  }
  // Whether role r's chunk of the group has memory (a zero role not yet touched, or dropped, has none).
  bool allocated(int r, int64_t group) const { return !dropped_[r][group] && !untouched_[r][group]; }
  // Frees role r's chunk of `group` for each r in `roles` (sharding: another rank holds it).
  void drop(int64_t group, const std::vector<int>& roles);
  bool held(int r, int64_t group) const { return !dropped_[r][group]; }
  bool any_dropped() const { return num_dropped_ > 0; }
  // Moves every role's chunk of the group to `to` (synchronous, as ChunkStore::move).
  void move_group(int64_t group, Location to);
  int64_t group_bytes(int64_t group) const;  // of the roles held
  // Views of its chunks' memory held outside it (payload() and view() results kept): what a repack
  // would leave without memory, so it waits while any is (Note [A repack waits for held views]).
  int64_t views_held();
  // Peak payload bytes of the old and new stores together during the last migration.
  int64_t last_migration_peak_bytes() const { return migration_peak_bytes_; }

 private:
  ChunkStoreOptions options_;
  std::vector<StateRoleSpec> roles_;
  std::unique_ptr<ChunkStore> store_;
  std::vector<ChunkStore::RoleChunks> chunks_;  // per role
  int64_t migration_peak_bytes_ = 0;
  std::vector<int64_t> group_of_;             // per tensor: its group (layout chunk)
  std::vector<std::vector<char>> dropped_;    // per role, per group
  std::vector<std::vector<char>> untouched_;  // per role, per group: a zero role's chunk without memory yet
  int64_t num_dropped_ = 0;
  void check_held(int r, int64_t group) const;
  // A zero role's untouched chunk gets zeros at `at` (its tensors HOLD).
  void ensure_allocated(int r, int64_t group, Location at);
};

}  // namespace ferry
