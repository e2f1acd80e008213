// The CUDA kernels' launch interface: plain structs passed by value as kernel arguments (apex's multi_tensor_apply
// pattern), so one launch updates many tensors. No ATen here: the .cu file includes only CUDA headers, and the
// ATen side (mean_grad_adamw.cpp) validates, groups tensors into tables and checks every launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../update_scalars.h"

namespace pyengine::cuda {

// The block shape. The build uses these defaults; bench/cuda_kernel_ab.py compiles the kernels with other values
// (-DPYENGINE_CUDA_CHUNK=..., -DPYENGINE_CUDA_THREADS=...) to time them against each other. Chunk and thread count
// change which block computes an element, not its arithmetic: the update's bits do not depend on them (the norm's
// partial sums do, by their grouping). 2048 elements a block: on an H100, 1.4-4.2 % faster than 16384 at N = 32M and
// 256M, 2x at 1M (more, fuller waves; bench/RESULTS.md, 2026-11-25).
#ifndef PYENGINE_CUDA_CHUNK
#define PYENGINE_CUDA_CHUNK 2048
#endif
#ifndef PYENGINE_CUDA_THREADS
#define PYENGINE_CUDA_THREADS 256
#endif

constexpr int kMaxTensorsPerLaunch = 24;
constexpr int kMaxGradSlots = 256;                // gradient pointers per launch: tensors * G
constexpr int kMaxWorkers = 64;                   // G per call on CUDA (one table must hold one tensor's G gradients)
constexpr int64_t kChunk = PYENGINE_CUDA_CHUNK;   // elements per thread block
constexpr int kThreads = PYENGINE_CUDA_THREADS;  // threads per block: a multiple of 32, at most 1024
static_assert(kChunk > 0 && kChunk % 4 == 0, "PYENGINE_CUDA_CHUNK must be a positive multiple of 4");
static_assert(kThreads >= 32 && kThreads <= 1024 && kThreads % 32 == 0,
              "PYENGINE_CUDA_THREADS must be a multiple of 32 in [32, 1024]");

// Kept under 4 KiB, the classic kernel-parameter limit. Block b works on chunk (b - chunk_begin[t]) of tensor t.
struct LaunchTable {
  float* param[kMaxTensorsPerLaunch];
  float* exp_avg[kMaxTensorsPerLaunch];
  float* exp_avg_sq[kMaxTensorsPerLaunch];
  float* max_exp_avg_sq[kMaxTensorsPerLaunch];
  void* param_out[kMaxTensorsPerLaunch];
  int64_t numel[kMaxTensorsPerLaunch];
  int chunk_begin[kMaxTensorsPerLaunch + 1];
  const void* grads[kMaxGradSlots];  // tensor t, worker g: grads[t * num_workers + g]
  Dtype grad_dtype[kMaxGradSlots];
  float weight[kMaxWorkers];
  int num_tensors;
  int num_workers;
  Dtype param_out_dtype;
};
static_assert(sizeof(LaunchTable) <= 4000, "LaunchTable must fit in the kernel parameter space");

// Device pointers may be null: no grad_scale, no found_inf, no clipping.
struct DeviceScalars {
  const float* grad_scale;
  const float* found_inf;
  const float* grad_norm;
};

cudaError_t launch_update(const LaunchTable& table, const UpdateScalars& s, DeviceScalars d, cudaStream_t stream);

// partials[b] = sum over block b's chunk of (mult * sum_g w_g grad_g)^2: summed in float, again in double where the
// float sum overflowed (Note [A finite gradient's squares beyond float32] in csrc/cpu/kernel_isa.cpp).
cudaError_t launch_sum_squares(const LaunchTable& table, float mult, double* partials, cudaStream_t stream);

// norm = sqrt(sum of partials) accumulated in double in a fixed order, as float32; nonfinite = 1 if it is not finite.
cudaError_t launch_finish_norm(const double* partials, int64_t count, float* norm, float* nonfinite,
                               cudaStream_t stream);

}  // namespace pyengine::cuda
