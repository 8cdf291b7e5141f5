# Finds every real dependency of ferry. Nothing is vendored.
#   Torch 2.11 (CUDA build; needs the CUDA toolkit at configure time), OpenMP (the runtime torch uses),
#   oneTBB, spdlog, and GoogleTest when tests are built.

# A CUDA-built torch enables the CUDA language while it is found: point it at /usr/local/cuda unless
# the caller chose a toolkit.
if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
endif()
if(NOT DEFINED CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
  set(CUDAToolkit_ROOT /usr/local/cuda)
endif()

find_package(Torch REQUIRED)
if(NOT Torch_VERSION VERSION_GREATER_EQUAL 2.11 OR Torch_VERSION VERSION_GREATER_EQUAL 2.12)
  message(FATAL_ERROR "ferry needs LibTorch 2.11.x, found ${Torch_VERSION} in ${Torch_DIR}")
endif()
set(FERRY_WITH_CUDA OFF)
if(TARGET torch_cuda OR CAFFE2_USE_CUDA)
  set(FERRY_WITH_CUDA ON)
endif()
message(STATUS "ferry: LibTorch ${Torch_VERSION} (${Torch_DIR}), CUDA build: ${FERRY_WITH_CUDA}")

find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(TBB REQUIRED)
find_package(spdlog REQUIRED)
if(FERRY_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
find_package(Python3 COMPONENTS Interpreter)   # only to report the torch python in ferry_info
