// Plain C++ types shared by the CPU loops and the CUDA kernels (no ATen, no CUDA headers): the storage type of a
// gradient and the per-step scalars of one AdamW update, derived once on the host by make_update_scalars().
#pragma once

#include <cstdint>

namespace pyengine {

// Storage type of a gradient or of the optional copy of the updated weights.
enum class Dtype : uint8_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct UpdateScalars {
  float lr;
  float beta1;
  float beta2;
  float one_minus_beta1;  // 1 - beta1 and 1 - beta2 computed in double: 1 - (float)0.999 is 1.3e-5 off
  float one_minus_beta2;
  float eps;
  float weight_decay;
  float step_size;                  // lr / (1 - beta1^step)
  float inv_bias_correction2_sqrt;  // 1 / sqrt(1 - beta2^step)
  float decay;                      // 1 - lr * weight_decay (AdamW); unused for Adam with L2
  // Multiplies the summed gradient: 1/G for a plain mean (1 with explicit weights), -1 for maximize. The CPU path
  // also folds in 1/grad_scale and the clip coefficient; the CUDA kernels read those from device memory instead.
  float grad_mult;
  float max_grad_norm;  // > 0: clip by the global norm of the mean gradient
  bool adamw;
  bool amsgrad;
};

}  // namespace pyengine
