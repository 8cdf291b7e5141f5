#include "state_chunks.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "repack.h"

namespace ferry {

std::vector<StateRoleSpec> StateChunks::fp32_specs(const std::vector<ChunkRole>& roles, const std::vector<int>& zero_roles) {
  std::vector<StateRoleSpec> out;
  for (ChunkRole role : roles) out.push_back({role, at::kFloat});
  for (int r : zero_roles) {
    TORCH_CHECK(r >= 0 && r < static_cast<int>(out.size()), "ferry: zero role ", r, " out of range [0, ", out.size(), ")");
    out[r].zero = true;
  }
  return out;
}

namespace {

// A role's layout for the parameter layout: itself, or for a blocked role the derived one, its slots
// 64-byte aligned as the parameter layout's are.
ChunkLayout role_layout(const StateRoleSpec& spec, const ChunkLayout& layout) {
  if (!spec.block) return layout;
  const int64_t align = std::max<int64_t>(1, 64 / static_cast<int64_t>(c10::elementSize(spec.dtype)));
  return layout.derive([&spec](int64_t n) { return spec.numel_for(n); }, align);
}
}  // namespace

StateChunks::StateChunks(ChunkStoreOptions options, std::vector<StateRoleSpec> roles)
    : options_(std::move(options)), roles_(std::move(roles)) {
  TORCH_CHECK(!roles_.empty(), "ferry: StateChunks needs at least one role");
  for (const StateRoleSpec& spec : roles_) {
    check_role_dtype(spec.role, spec.dtype);
    TORCH_CHECK(spec.block >= 0 && (spec.block == 0) == (spec.per_block == 0) && spec.per_block >= 0,
                "ferry: a ", to_string(spec.role), " state role needs block and per_block both 0 (mirroring the "
                "parameters) or both > 0, got ", spec.block, " and ", spec.per_block);
  }
}

StateChunks::StateChunks(ChunkStoreOptions options, const std::vector<ChunkRole>& roles, const std::vector<int>& zero_roles)
    : StateChunks(std::move(options), fp32_specs(roles, zero_roles)) {}

std::vector<int64_t> StateChunks::group_bytes_for(const ChunkLayout& layout, const std::vector<StateRoleSpec>& roles) {
  std::vector<int64_t> bytes(static_cast<size_t>(layout.num_chunks()), 0);
  for (const StateRoleSpec& spec : roles) {
    const ChunkLayout own = role_layout(spec, layout);
    for (int64_t g = 0; g < own.num_chunks(); ++g) {
      bytes[g] += own.chunks()[g].numel * static_cast<int64_t>(c10::elementSize(spec.dtype));
    }
  }
  return bytes;
}

void StateChunks::ensure_allocated(int r, int64_t group, Location at) {
  if (!untouched_[r][group]) return;
  const ChunkId id = chunk(r, group);
  store_->allocate_payload(id, at);  // zero-filled
  for (TensorId t : store_->chunk_info(id).tensors) store_->set_state(t, TensorState::kHold);
  untouched_[r][group] = 0;
}

void StateChunks::build(const ChunkLayout& layout, const std::vector<std::vector<int64_t>>& shapes, const Init& init) {
  TORCH_CHECK(num_dropped_ == 0, "ferry: the parameters were repacked after the optimizer state was sharded "
              "across ranks; the state of the new chunks is spread over other ranks. Shard after the layout is "
              "final (HybridAdam does, at its first step after warm-up), or set repack_after_warmup = false.");
  auto store = std::make_unique<ChunkStore>(options_);
  const bool migrate = store_ != nullptr;
  // A zero role untouched in every group stays untouched (no memory, no copy); one touched somewhere is
  // migrated, its untouched chunks given their zeros first (so fill_layout sees ordinary chunks).
  std::vector<char> keep_untouched(num_roles(), 0);
  // The roles fill_layout fills, by layout: the mirroring roles in one call, each blocked role in its own.
  struct Fill {
    ChunkLayout layout;
    std::vector<int> roles;
    std::vector<ChunkStore::RoleChunks> chunks;
    std::vector<std::vector<TensorId>> from;
  };
  std::vector<Fill> fills(1, Fill{layout, {}, {}, {}});
  std::vector<ChunkStore::RoleChunks> chunks;
  for (int r = 0; r < num_roles(); ++r) {
    const StateRoleSpec& spec = roles_[r];
    ChunkLayout own = role_layout(spec, layout);
    std::vector<std::vector<int64_t>> own_shapes;
    if (spec.block) {
      for (const Slot& s : own.slots()) own_shapes.push_back({s.numel});
    }
    chunks.push_back(store->add_layout(spec.role, spec.dtype, own, spec.block ? own_shapes : shapes, Location::kNone));
    if (migrate) {
      bool all = spec.zero;
      for (char u : untouched_[r]) all = all && u;
      keep_untouched[r] = all;
      if (!all) {
        for (int64_t g = 0; g < num_groups(); ++g) ensure_allocated(r, g, Location::kHost);
      }
    } else {
      keep_untouched[r] = spec.zero;
    }
    if (keep_untouched[r]) continue;
    if (spec.block) fills.push_back(Fill{std::move(own), {}, {}, {}});
    Fill& fill = spec.block ? fills.back() : fills.front();
    fill.roles.push_back(r);
    fill.chunks.push_back(chunks.back());
    if (migrate) fill.from.push_back(chunks_[r].tensors);
  }
  int64_t peak = 0;
  for (const Fill& fill : fills) {
    if (fill.roles.empty()) continue;
    peak = std::max(peak, fill_layout(*store, fill.layout, fill.chunks, store_.get(), fill.from,
                                      [&](int k, int64_t j, TensorId slot) {
      const int r = fill.roles[k];
      store->set_state(slot, TensorState::kHold);
      if (migrate) {
        store->view(slot).copy_(store_->view(chunks_[r].tensors[j]));
      } else if (init) {
        init(r, j, store->view(slot));
      }
    }));
  }
  if (migrate) migration_peak_bytes_ = peak;
  store_ = std::move(store);  // the old store (and its device bytes on the accountant) goes
  chunks_ = std::move(chunks);
  group_of_.assign(layout.slots().size(), 0);
  for (size_t t = 0; t < layout.slots().size(); ++t) group_of_[t] = layout.slots()[t].chunk;
  dropped_.assign(num_roles(), std::vector<char>(layout.num_chunks(), 0));
  untouched_.clear();
  for (int r = 0; r < num_roles(); ++r) untouched_.emplace_back(layout.num_chunks(), keep_untouched[r]);
}

void StateChunks::check_held(int r, int64_t group) const {
  TORCH_CHECK(!dropped_[r][group], "ferry: the ", to_string(roles_[r].role), " state of chunk group ", group,
              " is held by another rank (the optimizer state is sharded across ranks)");
}

void StateChunks::drop(int64_t group, const std::vector<int>& roles) {
  for (int r : roles) {
    if (dropped_[r][group]) continue;
    if (!untouched_[r][group]) store_->retire(chunk(r, group));  // its tensors FREE, its payload freed
    untouched_[r][group] = 0;
    dropped_[r][group] = 1;
    ++num_dropped_;
  }
}

void StateChunks::move_group(int64_t group, Location to) {
  for (int r = 0; r < num_roles(); ++r) {
    check_held(r, group);
    if (untouched_[r][group]) {
      ensure_allocated(r, group, to);  // zeros made where they are needed: nothing to copy
    } else {
      store_->move(chunk(r, group), to);
    }
  }
}

int64_t StateChunks::group_bytes(int64_t group) const {
  int64_t bytes = 0;
  for (int r = 0; r < num_roles(); ++r) {
    if (held(r, group)) bytes += store_->chunk_info(chunk(r, group)).nbytes;
  }
  return bytes;
}

int64_t StateChunks::views_held() {
  int64_t held = 0;
  for (const auto& role : chunks_) {
    for (ChunkId c : role.chunks) held += store_->storage_holders(c);
  }
  return held;
}

}  // namespace ferry
