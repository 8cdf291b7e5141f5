#include "state_chunks.h"

#include <c10/util/Exception.h>

#include "repack.h"

namespace ferry {

StateChunks::StateChunks(ChunkStoreOptions options, std::vector<ChunkRole> roles, std::vector<int> zero_roles)
    : options_(std::move(options)), roles_(std::move(roles)) {
  TORCH_CHECK(!roles_.empty(), "ferry: StateChunks needs at least one role");
  zero_role_.assign(roles_.size(), 0);
  for (int r : zero_roles) {
    TORCH_CHECK(r >= 0 && r < num_roles(), "ferry: zero role ", r, " out of range [0, ", num_roles(), ")");
    zero_role_[r] = 1;
  }
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
  std::vector<int> filled;  // the roles fill_layout fills
  std::vector<ChunkStore::RoleChunks> chunks, filled_chunks;
  std::vector<std::vector<TensorId>> from;
  for (int r = 0; r < num_roles(); ++r) {
    chunks.push_back(store->add_layout(roles_[r], at::kFloat, layout, shapes, Location::kNone));
    if (migrate) {
      bool all = zero_role_[r] != 0;
      for (char u : untouched_[r]) all = all && u;
      keep_untouched[r] = all;
      if (!all) {
        for (int64_t g = 0; g < num_groups(); ++g) ensure_allocated(r, g, Location::kHost);
      }
    } else {
      keep_untouched[r] = zero_role_[r];
    }
    if (keep_untouched[r]) continue;
    filled.push_back(r);
    filled_chunks.push_back(chunks.back());
    if (migrate) from.push_back(chunks_[r].tensors);
  }
  const int64_t peak = fill_layout(*store, layout, filled_chunks, store_.get(), from,
                                   [&](int k, int64_t j, TensorId slot) {
    const int r = filled[k];
    store->set_state(slot, TensorState::kHold);
    if (migrate) {
      store->view(slot).copy_(store_->view(chunks_[r].tensors[j]));
    } else if (init) {
      init(r, j, store->view(slot));
    }
  });
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
  TORCH_CHECK(!dropped_[r][group], "ferry: the ", to_string(roles_[r]), " state of chunk group ", group,
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
