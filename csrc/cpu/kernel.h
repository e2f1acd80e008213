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

// Elements per tile when more fp32 gradients are summed than one pass takes (4 in the plain loops, 8 in the
// prefetching ones: kMaxGroup in kernel_isa.cpp), so two or more passes go over the tile's sum: 64 KiB of
// sum (L2-resident), so each pass reads 64 KiB runs of every stream rather than 4 KiB ones. Measured on one Zen 5
// core, N = 32M (bench/cpu_kernel_ab.py, bench/RESULTS.md): G = 5 / 6 / 8 fp32 1.02 / 1.05 / 1.14x faster on 4 KiB
// pages, 1.10 / 1.13 / 1.24x on 2 MiB pages; but G = 2 / 4 fp32 0.88 / 0.92x and bf16 (then a pass per gradient)
// 0.61-0.74x, which keep kTile. 16-bit runs summed in two passes (bf16 G = 12 / 16, Intel Xeon, prefetching form)
// measured 0.97-0.98x with long tiles (2026-11-27): they keep kTile too. Must divide kChunk (mean_grad_adamw.cpp).
constexpr int64_t kLongTile = 16 * kTile;

struct KernelTable {
  const char* isa;
  // Updates elements [begin, end) of one tensor. Elements are independent: any split gives bit-identical results.
  void (*update)(const TensorBuffers& t, const UpdateScalars& s, int64_t begin, int64_t end);
  // Sum of squares of the (weighted) gradient sum over [begin, end), times mult^2: float accumulation in 16 fixed
  // lanes, so every ISA gives the same bits for the same range; a range whose float sum overflows is summed again in
  // double (Note [A finite gradient's squares beyond float32] in kernel_isa.cpp).
  double (*sum_squares)(const GradSource* grads, int num_grads, float mult, int64_t begin, int64_t end);
  // update with software prefetching of the memory streams: the same bits (Note [Prefetching the streams] in
  // kernel_isa.cpp); prefetch_streams() (isa.h) says which of the two the ops use.
  void (*update_prefetch)(const TensorBuffers& t, const UpdateScalars& s, int64_t begin, int64_t end);
  // sum_squares with the same prefetching (and summation groups) as update_prefetch: the same bits.
  double (*sum_squares_prefetch)(const GradSource* grads, int num_grads, float mult, int64_t begin, int64_t end);
};

const KernelTable& kernel_table_avx512();
const KernelTable& kernel_table_avx2();
const KernelTable& kernel_table_default();

}  // namespace pyengine::cpu
