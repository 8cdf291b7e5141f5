// MomentBudget (see moment_budget.h).
#include "moment_budget.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

#include "../common/logging.h"

namespace ferry {

MomentBudget::MomentBudget(DeviceBudget budget, int64_t store_budget_bytes)
    : budget_(budget), store_budget_(store_budget_bytes) {}

int64_t MomentBudget::chunk_budget(const ChunkStore& store) const {
  if (budget_.budget_bytes == 0) return 0;
  // The budget covers every store charging the device accountant: the parameter chunks get what the
  // others (device-resident optimizer state) leave.
  return std::max<int64_t>(1, budget_.budget_bytes - store.device_bytes_elsewhere());
}

int64_t MomentBudget::at_moment(int64_t non_model, const ChunkStore& store) const {
  const int64_t budget = chunk_budget(store);
  if (budget_.capacity_bytes == 0 || non_model < 0) return budget;
  const int64_t others = store.device_bytes_elsewhere();
  int64_t room = budget_.capacity_bytes - others - non_model;
  if (room < largest_chunk_bytes_) {
    log::warn_once("scheduler-capacity",
                   "ferry scheduler: non-model memory of " + format_bytes(non_model) + " leaves " +
                       format_bytes(std::max<int64_t>(0, room)) + " of the device's " +
                       format_bytes(budget_.capacity_bytes) + " (" + format_bytes(others) +
                       " of optimizer state) for parameter chunks, less than the largest chunk (" +
                       format_bytes(largest_chunk_bytes_) + "); keeping room for one chunk. The device may run "
                       "out of memory: use activation checkpointing, a smaller batch or smaller chunks.");
    room = largest_chunk_bytes_;
  }
  return budget == 0 ? room : std::min(budget, room);
}

int64_t MomentBudget::room_at_worst(int64_t non_model_peak) const {
  const int64_t budget = budget_.budget_bytes;
  if (budget_.capacity_bytes == 0) return budget;
  const int64_t room = std::max<int64_t>(0, budget_.capacity_bytes - non_model_peak);
  return budget == 0 ? room : std::min(budget, room);
}

int64_t MomentBudget::admitting(int64_t bytes, const ChunkStore& store) const {
  TORCH_CHECK(bytes >= 0, "ferry: admitted device bytes must be >= 0, got ", bytes);
  if (budget_.budget_bytes == 0) return 0;
  const int64_t others = store.device_bytes_elsewhere();
  const int64_t left = budget_.budget_bytes - others - bytes;
  TORCH_CHECK(left >= std::max<int64_t>(1, largest_chunk_bytes_), "ferry: ", format_bytes(bytes),
              " more device bytes for optimizer state (", format_bytes(others), " there already) of a device budget of ",
              format_bytes(budget_.budget_bytes), " would leave ", format_bytes(std::max<int64_t>(0, left)),
              " for parameter chunks, less than the largest chunk (", format_bytes(largest_chunk_bytes_), ")");
  return left;
}

void MomentBudget::apply(ChunkStore& store, int64_t bytes) {
  if (bytes == store_budget_) return;  // the usual case on the per-use path: no store call
  store.set_device_budget(bytes);
  store_budget_ = bytes;
}

}  // namespace ferry
