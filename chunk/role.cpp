#include "role.h"

#include <c10/util/Exception.h>

namespace ferry {

const char* to_string(ChunkRole role) {
  switch (role) {
    case ChunkRole::kParam: return "param";
    case ChunkRole::kMaster: return "master";
    case ChunkRole::kExpAvg: return "exp_avg";
    case ChunkRole::kExpAvgSq: return "exp_avg_sq";
    case ChunkRole::kGrad: return "grad";
    case ChunkRole::kScales: return "scales";
  }
  return "?";
}

const char* to_string(Location location) {
  switch (location) {
    case Location::kNone: return "none";
    case Location::kDevice: return "device";
    case Location::kHost: return "host";
  }
  return "?";
}

const char* to_string(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kHost: return "host";
  }
  return "?";
}

void check_role_dtype(ChunkRole role, at::ScalarType dtype) {
  switch (role) {
    case ChunkRole::kParam:
      TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                  "ferry: param chunks hold float, bfloat16 or half, got ", dtype);
      return;
    case ChunkRole::kMaster:
      TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "ferry: master chunks hold float or bfloat16 "
                  "(the compact state format), got ", dtype);
      return;
    case ChunkRole::kExpAvg:
    case ChunkRole::kExpAvgSq:
      TORCH_CHECK(dtype == at::kFloat || dtype == at::kByte, "ferry: ", to_string(role), " chunks hold float or "
                  "uint8 codes (the compact state format), got ", dtype);
      return;
    case ChunkRole::kGrad:
    case ChunkRole::kScales:
      TORCH_CHECK(dtype == at::kFloat, "ferry: ", to_string(role), " chunks hold float, got ", dtype);
      return;
  }
}

}  // namespace ferry
