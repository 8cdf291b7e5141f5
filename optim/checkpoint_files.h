#pragma once
// The checkpoint files: HybridAdam's training state in a directory (format and guarantees:
// docs/CHECKPOINT.md). The fp32 masters and moments, streamed one parameter at a time, in model order;
// per param group its options and step count; per parameter its own step count where it differs from
// its group's (D62); the loss scaler; a CRC-32C per file. A save is atomic and durable (the directory
// holds the previous complete checkpoint or the new one, whatever interrupts it) and refuses non-finite
// state; a load checks the whole checkpoint first (every manifest number, names, shapes, group count,
// file sizes, checksums, finite values) and changes nothing if any check fails.
//
// Contract: between iterations (the state is not being updated). Across ranks both are collectives
// over the same files: every rank writes the parameters of the chunks it owns at their offsets, rank 0
// checks each rank's part by its CRC and publishes the manifest; a load reads the same files at any
// world size, each rank taking the state it holds. Every rank must see the directory.
#include <cstdint>
#include <string>
#include <vector>

#include "../chunk/state_chunks.h"
#include "../cpu_adam/adam_options.h"
#include "../dist/communicator.h"
#include "../hooks/chunked_model.h"
#include "loss_scaler.h"
#include "ownership.h"
#include "state_roles.h"
#include "state_values.h"

namespace ferry::optim {

// What a checkpoint holds beside the state chunks' values.
struct CheckpointCounters {
  std::vector<AdamOptions> options;  // per param group
  std::vector<int64_t> steps;        // per param group: applied steps
  // Per parameter of the model: its group's steps it missed (its own count is the group's minus this).
  // Saving at N > 1: meaningful for the parameters this rank owns; the manifest gets each owner's.
  std::vector<int64_t> lags;
  LossScalerState scaler;
};

// Fails now (creating `dir` if needed) if a checkpoint could not be written into `dir`.
void check_checkpoint_target(const std::string& dir);

// One process: the state of every parameter (its fp32 values, StateValues: the compact format's
// decoded, exactly) and `counters` into `dir`.
void save_checkpoint(const std::string& dir, const ChunkedModel& model, StateValues& state,
                     const std::vector<int>& group_of_param, const CheckpointCounters& counters);
// Every rank of `comm`: the same files as one process's save, each rank writing the parameters whose
// state it owns (`ownership`).
void save_checkpoint_across_ranks(const std::string& dir, const ChunkedModel& model, StateValues& state,
                                  const std::vector<int>& group_of_param, const CheckpointCounters& counters,
                                  const Ownership& ownership, dist::Communicator& comm);

// Checks the checkpoint in `dir` against the model, `num_groups` and, when given, the loss scaler's
// options (at N > 1 every rank checks, and all load or none does: `comm` then); then writes the state
// this process holds into `state` (in its format: fp32 values into compact state are encoded) and
// returns the counters. Nothing is written if a check fails.
CheckpointCounters load_checkpoint(const std::string& dir, const ChunkedModel& model, StateValues& state,
                                   const std::vector<int>& group_of_param, int num_groups,
                                   const DynamicLossScaler* scaler, const Ownership& ownership,
                                   dist::Communicator* comm);

}  // namespace ferry::optim
