#pragma once
// The objects the phases of a step work with (PipelinedStep, SlotAccumulation, ShardedStep), by
// reference: HybridAdam's engine owns each of them, and they outlive every phase object. Each keeps its
// own state; a phase reads and changes it through their methods only.
#include "../hooks/chunked_model.h"
#include "chunk_finality.h"
#include "chunk_updates.h"
#include "grad_ledger.h"
#include "host_jobs.h"
#include "ownership.h"
#include "state_placement.h"

namespace ferry::optim {

struct StepParts {
  ChunkedModel& model;
  GradLedger& ledger;
  ChunkFinality& finality;
  StatePlacement& placement;
  ChunkUpdates& updates;
  HostJobs& jobs;
  const Ownership& ownership;
};

}  // namespace ferry::optim
