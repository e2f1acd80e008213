// The CPU kernel interface: plain C++ types only, no ATen.
//
// Why a separate, ATen-free interface: the loops in kernel_isa.cpp are compiled once per instruction set (AVX-512,
// AVX2, baseline x86-64) with different -m flags and linked into the same library. ATen's headers must not be pulled
// into those objects (their inline functions would be emitted with AVX-512 instructions and could be picked by the
// linker for callers running on an older CPU). The ATen side (mean_grad_adamw.cpp) validates the tensors, fills these
// structs and picks a table at run time with at::get_cpu_capability().
#pragma once

#include <cstdint>

#include "../update_scalars.h"

namespace pyengine::cpu {

using pyengine::Dtype;
using pyengine::UpdateScalars;

// One worker's gradient for one tensor.
struct GradSource {
  const void* data;
  Dtype dtype;
  float weight;  // multiplies this gradient before summation: 1 for a plain mean, w_k for a weighted mean
};

// One tensor's buffers. Every pointer covers numel elements; grads has num_grads entries.
struct TensorBuffers {
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // nullptr unless amsgrad
  void* param_out;        // nullptr, or a bf16/fp16/fp32 copy of the updated weights
  Dtype param_out_dtype;
  const GradSource* grads;
  int num_grads;
  int64_t numel;
};

// Elements per tile: the summed gradient of a tile lives in a 4 KiB stack buffer (L1-resident) between the
// summation loop and the Adam loop, so the G gradients are read from memory exactly once.
constexpr int64_t kTile = 1024;

struct KernelTable {
  const char* isa;
  // Updates elements [begin, end) of one tensor. Elements are independent: any split gives bit-identical results.
  void (*update)(const TensorBuffers& t, const UpdateScalars& s, int64_t begin, int64_t end);
  // Sum of squares of the (weighted) gradient sum over [begin, end), times mult^2: float accumulation in 16 fixed
  // lanes, so every ISA gives the same bits for the same range.
  float (*sum_squares)(const GradSource* grads, int num_grads, float mult, int64_t begin, int64_t end);
};

const KernelTable& kernel_table_avx512();
const KernelTable& kernel_table_avx2();
const KernelTable& kernel_table_default();

}  // namespace pyengine::cpu
