#pragma once
// What a chunk holds and where its payload is. Shared vocabulary of the chunk layer.
#include <c10/core/ScalarType.h>

#include <cstdint>

namespace ferry {

// Index of a chunk in its ChunkStore (dense, from 0, in creation order).
using ChunkId = int64_t;
// Index of a tensor slot in its ChunkStore (dense, from 0, in creation order).
using TensorId = int64_t;

// One chunk holds one role of one dtype. Optimizer-state chunks mirror the layout of the parameter
// chunks (same capacity in elements, same slot offsets), so a parameter's (chunk index, offset) names
// its slot in every role.
enum class ChunkRole {
  kParam,     // compute copy of parameters (fp32, bf16 or fp16); what the model's tensors view
  kMaster,    // master parameters: fp32, or bf16 in the compact state format (cpu_adam/compact_state.h)
  kExpAvg,    // Adam first moment: fp32, or 8-bit codes (uint8) in the compact format
  kExpAvgSq,  // Adam second moment: fp32, or 8-bit codes (uint8) in the compact format
  kGrad,      // gradients kept across micro-batches (fp32), for gradient accumulation
  kScales,    // the compact format's per-block scales of the moments (fp32)
};
constexpr int kNumChunkRoles = 6;

// Where a chunk's payload lives. kNone: no payload anywhere (chunk state RELEASED).
enum class Location { kNone, kDevice, kHost };

// The two memory tiers with budgets.
enum class Tier { kDevice, kHost };

const char* to_string(ChunkRole role);
const char* to_string(Location location);
const char* to_string(Tier tier);

// The dtype a role's chunks must have: kMaster/kExpAvg/kExpAvgSq/kGrad are fp32; kParam is any of
// fp32, bf16, fp16. Fails with the role and the dtype named otherwise.
void check_role_dtype(ChunkRole role, at::ScalarType dtype);

}  // namespace ferry
