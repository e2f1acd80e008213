// CUDA kernels of the fused mean-gradient AdamW update and of the mean-gradient norm.
//
// One launch covers every tensor of a LaunchTable (launch.h); each block takes one chunk of one tensor. Per element:
// sum the G gradients (fixed order, float math whatever the storage type), then AdamW, in one pass over memory.
// Loads and stores are 16-byte vectors (4 floats; 4 halves as 8 bytes) when every pointer of the tensor is aligned,
// a scalar loop otherwise and for the last N % 4 elements. Indices are 64-bit throughout (N >= 2^31 works).
// grad_scale, found_inf and the clip norm are read from device memory: a skipped step costs no host sync.
// Built with --fmad=false so the arithmetic rounds exactly as the CPU loops do (see kernel_isa.cpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "launch.h"

namespace pyengine::cuda {
namespace {

__device__ __forceinline__ float load_grad(const void* p, Dtype t, int64_t i) {
  switch (t) {
    case Dtype::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case Dtype::kFloat16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// Four consecutive gradients starting at i (i % 4 == 0, pointer aligned): one 16-byte or 8-byte load.
__device__ __forceinline__ float4 load_grad4(const void* p, Dtype t, int64_t i) {
  if (t == Dtype::kFloat32) return reinterpret_cast<const float4*>(p)[i / 4];
  const uint2 raw = reinterpret_cast<const uint2*>(p)[i / 4];
  const uint16_t h[4] = {static_cast<uint16_t>(raw.x), static_cast<uint16_t>(raw.x >> 16),
                         static_cast<uint16_t>(raw.y), static_cast<uint16_t>(raw.y >> 16)};
  float f[4];
  for (int k = 0; k < 4; ++k) {
    f[k] = t == Dtype::kBFloat16 ? __bfloat162float(__ushort_as_bfloat16(h[k])) : __half2float(__ushort_as_half(h[k]));
  }
  return make_float4(f[0], f[1], f[2], f[3]);
}

__device__ __forceinline__ void store_out(void* p, Dtype t, int64_t i, float x) {
  switch (t) {
    case Dtype::kBFloat16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x); break;
    case Dtype::kFloat16: static_cast<__half*>(p)[i] = __float2half_rn(x); break;
    default: static_cast<float*>(p)[i] = x;
  }
}

__device__ __forceinline__ bool aligned(const void* p, Dtype t) {
  const uintptr_t need = t == Dtype::kFloat32 ? 16 : 8;
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % need == 0;
}

__device__ int tensor_of_block(const LaunchTable& tab) {
  int t = 0;
  while (t + 1 < tab.num_tensors && static_cast<int>(blockIdx.x) >= tab.chunk_begin[t + 1]) ++t;
  return t;
}

struct ElementState {
  float p, m, v, vmax;
};

template <bool kAdamW, bool kAmsgrad>
__device__ __forceinline__ void adamw(ElementState& e, float g, const UpdateScalars& s) {
  if (kAdamW) {
    e.p = e.p * s.decay;
  } else {
    g = g + s.weight_decay * e.p;
  }
  e.m = s.beta1 * e.m + s.one_minus_beta1 * g;
  e.v = s.beta2 * e.v + (s.one_minus_beta2 * g) * g;  // torch.optim's order: see adam_range in cpu/kernel_isa.cpp
  float vd = e.v;
  if (kAmsgrad) {
    vd = e.vmax > e.v ? e.vmax : e.v;
    e.vmax = vd;
  }
  const float denom = sqrtf(vd) * s.inv_bias_correction2_sqrt + s.eps;
  e.p = e.p - s.step_size * (e.m / denom);
}

// Note [A finite mean whose float32 sum overflows] (csrc/cpu/kernel_isa.cpp): the mean gradient of element i from its
// float32 sum acc: acc * mult where acc is finite (the common path, its bits unchanged), else the sum redone in double
// from the gradients, in the same order, and multiplied before one rounding, as the CPU loops do.
__device__ __forceinline__ float wide_mean(const void* const* grads, const Dtype* dtypes, const float* weight, int G,
                                           int64_t i, float mult) {
  double wide = static_cast<double>(load_grad(grads[0], dtypes[0], i)) * static_cast<double>(weight[0]);
  for (int g = 1; g < G; ++g) {
    wide = wide + static_cast<double>(load_grad(grads[g], dtypes[g], i)) * static_cast<double>(weight[g]);
  }
  return static_cast<float>(wide * static_cast<double>(mult));
}

__device__ __forceinline__ float mean_of(float acc, const void* const* grads, const Dtype* dtypes, const float* weight,
                                         int G, int64_t i, float mult) {
  return isfinite(acc) ? acc * mult : wide_mean(grads, dtypes, weight, G, i, mult);
}

// The multiplier of the summed gradient, or false if the step is to be skipped (found_inf, a grad_scale that is not
// a positive finite number, a clip norm that is not a finite number >= 0).
__device__ __forceinline__ bool grad_multiplier(const UpdateScalars& s, const DeviceScalars& d, float* mult) {
  if (d.found_inf != nullptr && *d.found_inf != 0.0f) return false;
  const float scale = d.grad_scale != nullptr ? *d.grad_scale : 1.0f;
  if (!(scale > 0.0f) || isinf(scale)) return false;  // a broken loss scale (0, negative, NaN, inf): skipped
  float m = s.grad_mult / scale;
  if (isinf(m)) return false;  // a subnormal scale whose inverse overflows: skipped, as GradScaler does
  if (s.max_grad_norm > 0.0f) {
    const float norm = *d.grad_norm / scale;
    if (!(norm >= 0.0f) || isinf(norm)) return false;  // a negative norm would reverse the step
    m = m * fminf(1.0f, s.max_grad_norm / (norm + 1e-6f));
  }
  *mult = m;
  return true;
}

template <bool kAdamW, bool kAmsgrad>
__global__ void __launch_bounds__(kThreads) update_kernel(LaunchTable tab, UpdateScalars s, DeviceScalars d) {
  float mult;
  if (!grad_multiplier(s, d, &mult)) return;
  const int t = tensor_of_block(tab);
  const int G = tab.num_workers;
  const void* const* grads = tab.grads + t * G;
  const Dtype* dtypes = tab.grad_dtype + t * G;
  float* param = tab.param[t];
  float* exp_avg = tab.exp_avg[t];
  float* exp_avg_sq = tab.exp_avg_sq[t];
  float* max_sq = tab.max_exp_avg_sq[t];
  void* out = tab.param_out[t];
  const int64_t begin = static_cast<int64_t>(blockIdx.x - tab.chunk_begin[t]) * kChunk;
  const int64_t end = min(tab.numel[t], begin + kChunk);

  auto update_one = [&](int64_t i) {
    float acc = load_grad(grads[0], dtypes[0], i) * tab.weight[0];
    for (int g = 1; g < G; ++g) acc = acc + load_grad(grads[g], dtypes[g], i) * tab.weight[g];
    ElementState e{param[i], exp_avg[i], exp_avg_sq[i], kAmsgrad ? max_sq[i] : 0.0f};
    adamw<kAdamW, kAmsgrad>(e, mean_of(acc, grads, dtypes, tab.weight, G, i, mult), s);
    param[i] = e.p;
    exp_avg[i] = e.m;
    exp_avg_sq[i] = e.v;
    if (kAmsgrad) max_sq[i] = e.vmax;
    if (out != nullptr) store_out(out, tab.param_out_dtype, i, e.p);
  };

  bool vec = aligned(param, Dtype::kFloat32) && aligned(exp_avg, Dtype::kFloat32) &&
             aligned(exp_avg_sq, Dtype::kFloat32) && aligned(max_sq, Dtype::kFloat32) &&
             aligned(out, tab.param_out_dtype);
  for (int g = 0; g < G; ++g) vec = vec && aligned(grads[g], dtypes[g]);
  const int64_t vec_end = vec ? begin + (end - begin) / 4 * 4 : begin;

  for (int64_t i = begin + 4 * static_cast<int64_t>(threadIdx.x); i < vec_end; i += 4 * kThreads) {
    // Same order as the scalar path and the CPU loops: acc = w_0 g_0, then acc + w_g g_g.
    const float4 x0 = load_grad4(grads[0], dtypes[0], i);
    const float w0 = tab.weight[0];
    float acc[4] = {x0.x * w0, x0.y * w0, x0.z * w0, x0.w * w0};
    for (int g = 1; g < G; ++g) {
      const float4 x = load_grad4(grads[g], dtypes[g], i);
      const float w = tab.weight[g];
      acc[0] = acc[0] + x.x * w;
      acc[1] = acc[1] + x.y * w;
      acc[2] = acc[2] + x.z * w;
      acc[3] = acc[3] + x.w * w;
    }
    // the means before the state is loaded: the rare double path then holds no state in registers
    for (int k = 0; k < 4; ++k) acc[k] = mean_of(acc[k], grads, dtypes, tab.weight, G, i + k, mult);
    const float4 p4 = reinterpret_cast<const float4*>(param)[i / 4];
    const float4 m4 = reinterpret_cast<const float4*>(exp_avg)[i / 4];
    const float4 v4 = reinterpret_cast<const float4*>(exp_avg_sq)[i / 4];
    const float4 x4 = kAmsgrad ? reinterpret_cast<const float4*>(max_sq)[i / 4] : make_float4(0, 0, 0, 0);
    ElementState e[4] = {{p4.x, m4.x, v4.x, x4.x}, {p4.y, m4.y, v4.y, x4.y},
                         {p4.z, m4.z, v4.z, x4.z}, {p4.w, m4.w, v4.w, x4.w}};
    for (int k = 0; k < 4; ++k) adamw<kAdamW, kAmsgrad>(e[k], acc[k], s);
    reinterpret_cast<float4*>(param)[i / 4] = make_float4(e[0].p, e[1].p, e[2].p, e[3].p);
    reinterpret_cast<float4*>(exp_avg)[i / 4] = make_float4(e[0].m, e[1].m, e[2].m, e[3].m);
    reinterpret_cast<float4*>(exp_avg_sq)[i / 4] = make_float4(e[0].v, e[1].v, e[2].v, e[3].v);
    if (kAmsgrad) reinterpret_cast<float4*>(max_sq)[i / 4] = make_float4(e[0].vmax, e[1].vmax, e[2].vmax, e[3].vmax);
    if (out != nullptr) {
      for (int k = 0; k < 4; ++k) store_out(out, tab.param_out_dtype, i + k, e[k].p);
    }
  }
  for (int64_t i = vec_end + threadIdx.x; i < end; i += kThreads) update_one(i);
}

// Fixed-shape block reduction: the same inputs always give the same bits.
template <typename T>
__device__ T block_sum(T x) {
  __shared__ T warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_down_sync(0xffffffffu, x, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = x;
  __syncthreads();
  x = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : T(0);
  if (warp == 0) {
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_down_sync(0xffffffffu, x, offset);
  }
  return x;  // valid in thread 0
}

// The mean gradient's element i of tensor t, as the update sums it.
__device__ __forceinline__ float mean_grad(const LaunchTable& tab, int t, int64_t i, float mult) {
  const int G = tab.num_workers;
  const void* const* grads = tab.grads + t * G;
  const Dtype* dtypes = tab.grad_dtype + t * G;
  float acc = load_grad(grads[0], dtypes[0], i) * tab.weight[0];
  for (int g = 1; g < G; ++g) acc = acc + load_grad(grads[g], dtypes[g], i) * tab.weight[g];
  return mean_of(acc, grads, dtypes, tab.weight, G, i, mult);
}

// Note [A finite gradient's squares beyond float32] (csrc/cpu/kernel_isa.cpp): a block whose float32 sum of squares
// is not finite sums its chunk again in double; the common path keeps its bits.
__global__ void __launch_bounds__(kThreads) sum_squares_kernel(LaunchTable tab, float mult, double* partials) {
  const int t = tensor_of_block(tab);
  const int64_t begin = static_cast<int64_t>(blockIdx.x - tab.chunk_begin[t]) * kChunk;
  const int64_t end = min(tab.numel[t], begin + kChunk);
  float sum = 0.0f;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float acc = mean_grad(tab, t, i, mult);
    sum = sum + acc * acc;
  }
  sum = block_sum(sum);
  __shared__ bool overflowed;
  if (threadIdx.x == 0) overflowed = !isfinite(sum);
  __syncthreads();  // every thread takes the same branch: block_sum below synchronises the block
  double total = sum;
  if (overflowed) {
    double wide = 0.0;
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      const double acc = mean_grad(tab, t, i, mult);
      wide += acc * acc;
    }
    total = block_sum(wide);
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kThreads) finish_norm_kernel(const double* partials, int64_t count, float* norm,
                                                               float* nonfinite) {
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) sum += partials[i];
  sum = block_sum(sum);
  if (threadIdx.x == 0) {
    // float32 like the update's scalars: a norm past float32's range (elements near its top) is not finite either
    const float n = static_cast<float>(sqrt(sum));
    *norm = n;
    *nonfinite = isfinite(n) ? 0.0f : 1.0f;
  }
}

}  // namespace

cudaError_t launch_update(const LaunchTable& table, const UpdateScalars& s, DeviceScalars d, cudaStream_t stream) {
  const dim3 grid(table.chunk_begin[table.num_tensors]);
  if (s.adamw) {
    if (s.amsgrad) update_kernel<true, true><<<grid, kThreads, 0, stream>>>(table, s, d);
    else update_kernel<true, false><<<grid, kThreads, 0, stream>>>(table, s, d);
  } else {
    if (s.amsgrad) update_kernel<false, true><<<grid, kThreads, 0, stream>>>(table, s, d);
    else update_kernel<false, false><<<grid, kThreads, 0, stream>>>(table, s, d);
  }
  return cudaGetLastError();
}

cudaError_t launch_sum_squares(const LaunchTable& table, float mult, double* partials, cudaStream_t stream) {
  sum_squares_kernel<<<table.chunk_begin[table.num_tensors], kThreads, 0, stream>>>(table, mult, partials);
  return cudaGetLastError();
}

cudaError_t launch_finish_norm(const double* partials, int64_t count, float* norm, float* nonfinite,
                               cudaStream_t stream) {
  finish_norm_kernel<<<1, kThreads, 0, stream>>>(partials, count, norm, nonfinite);
  return cudaGetLastError();
}

}  // namespace pyengine::cuda
