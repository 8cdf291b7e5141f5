#pragma once
// The device a test built twice runs on: CUDA in its `gpu` build (FERRY_TEST_ON_CUDA), the simulated
// device's CPU tensors otherwise (test_device_adam, test_device_norm).
#include <c10/core/Device.h>

namespace ferry::test {

inline c10::Device device_under_test() {
#ifdef FERRY_TEST_ON_CUDA
  return c10::Device(c10::kCUDA, 0);
#else
  return c10::Device(c10::kCPU);
#endif
}

}  // namespace ferry::test
