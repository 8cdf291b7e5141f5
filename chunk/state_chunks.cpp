#include "ferry/chunk/state_chunks.h"

#include <c10/util/Exception.h>

#include "ferry/chunk/repack.h"

namespace ferry {

StateChunks::StateChunks(ChunkStoreOptions options, std::vector<ChunkRole> roles)
    : options_(std::move(options)), roles_(std::move(roles)) {
  TORCH_CHECK(!roles_.empty(), "ferry: StateChunks needs at least one role");
}

void StateChunks::build(const ChunkLayout& layout, const std::vector<std::vector<int64_t>>& shapes, const Init& init) {
  auto store = std::make_unique<ChunkStore>(options_);
  const bool migrate = store_ != nullptr;
  std::vector<ChunkStore::RoleChunks> chunks;
  std::vector<std::vector<TensorId>> from;
  for (int r = 0; r < num_roles(); ++r) {
    chunks.push_back(store->add_layout(roles_[r], at::kFloat, layout, shapes, Location::kNone));
    if (migrate) from.push_back(chunks_[r].tensors);
  }
  const int64_t peak = fill_layout(*store, layout, chunks, store_.get(), from, [&](int r, int64_t j, TensorId slot) {
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
}

void StateChunks::move_group(int64_t group, Location to) {
  for (int r = 0; r < num_roles(); ++r) store_->move(chunk(r, group), to);
}

int64_t StateChunks::group_bytes(int64_t group) const {
  int64_t bytes = 0;
  for (int r = 0; r < num_roles(); ++r) bytes += store_->chunk_info(chunk(r, group)).nbytes;
  return bytes;
}

}  // namespace ferry
