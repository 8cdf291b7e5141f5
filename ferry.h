#pragma once
// ferry's public API in one include: #include <ferry/ferry.h>
#include "ferry/common/config.h"
#include "ferry/common/cpu_features.h"
#include "ferry/common/env_report.h"
#include "ferry/common/gpu_info.h"
#include "ferry/common/logging.h"
#include "ferry/common/version.h"
#include "ferry/cpu_adam/adam_options.h"
#include "ferry/cpu_adam/cpu_adam.h"
#include "ferry/chunk/chunk_store.h"
#include "ferry/chunk/layout.h"
#include "ferry/hooks/chunked_model.h"
#include "ferry/scheduler/scheduler.h"
