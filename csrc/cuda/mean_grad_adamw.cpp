// CUDA implementation of the fused mean-gradient AdamW ops: groups the tensors into launch tables (launch.h), launches
// on the current stream under a device guard, and checks every launch. No host synchronisation anywhere: grad_scale,
// found_inf and the clip norm stay on the device.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <functional>

#include "../mean_grad_adamw.h"
#include "launch.h"

namespace pyengine::cuda {
namespace {

int64_t num_chunks(int64_t numel) { return (numel + kChunk - 1) / kChunk; }

// Fills tables with tensors [0, num_tensors) in order and calls launch(table, first_chunk) for each full table.
// fill(table, slot, tensor) sets the per-tensor pointers; gradient pointers and chunk bounds are set here.
void for_each_table(at::TensorList grads, int64_t num_tensors, const std::vector<float>& weights,
                    const std::function<void(LaunchTable&, int, int64_t)>& fill,
                    const std::function<void(const LaunchTable&, int64_t)>& launch) {
  const int64_t G = static_cast<int64_t>(grads.size()) / num_tensors;
  TORCH_CHECK_VALUE(G <= kMaxWorkers, "the CUDA kernels take at most ", kMaxWorkers, " gradients per tensor; got ",
                    G);
  const int per_table = static_cast<int>(std::min<int64_t>(kMaxTensorsPerLaunch, kMaxGradSlots / G));
  LaunchTable table{};
  table.num_workers = static_cast<int>(G);
  for (int64_t g = 0; g < G; ++g) table.weight[g] = weights[g];
  int64_t chunks_launched = 0;
  auto flush = [&] {
    if (table.num_tensors == 0) return;
    launch(table, chunks_launched);
    chunks_launched += table.chunk_begin[table.num_tensors];
    table.num_tensors = 0;
  };
  for (int64_t i = 0; i < num_tensors; ++i) {
    const int64_t numel = grads[i].numel();
    if (numel == 0) continue;
    const int slot = table.num_tensors;
    fill(table, slot, i);
    table.numel[slot] = numel;
    for (int64_t g = 0; g < G; ++g) {
      const at::Tensor& t = grads[g * num_tensors + i];
      table.grads[slot * G + g] = t.data_ptr();
      table.grad_dtype[slot * G + g] = dtype_code(t.scalar_type());
    }
    const int first = slot == 0 ? 0 : table.chunk_begin[slot];
    table.chunk_begin[slot] = first;
    table.chunk_begin[slot + 1] = first + static_cast<int>(num_chunks(numel));
    table.num_tensors = slot + 1;
    if (table.num_tensors == per_table) flush();
  }
  flush();
}

const float* optional_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

void update_cuda(const UpdateArgs& a) {
  const c10::cuda::CUDAGuard guard(a.params[0].device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const UpdateScalars s = make_update_scalars(a);
  const DeviceScalars d{optional_ptr(a.grad_scale), optional_ptr(a.found_inf),
                        s.max_grad_norm > 0.0f ? optional_ptr(a.grad_norm) : nullptr};
  const Dtype out_dtype = a.param_outs.empty() ? Dtype::kFloat32 : dtype_code(a.param_outs[0].scalar_type());
  for (const at::Tensor& out : a.param_outs) {
    TORCH_CHECK_TYPE(dtype_code(out.scalar_type()) == out_dtype, "on CUDA every param_out must have the same dtype; "
                     "got ", out.scalar_type(), " and ", a.param_outs[0].scalar_type());
  }
  auto fill = [&](LaunchTable& table, int slot, int64_t i) {
    table.param[slot] = a.params[i].data_ptr<float>();
    table.exp_avg[slot] = a.exp_avgs[i].data_ptr<float>();
    table.exp_avg_sq[slot] = a.exp_avg_sqs[i].data_ptr<float>();
    table.max_exp_avg_sq[slot] = s.amsgrad ? a.max_exp_avg_sqs[i].data_ptr<float>() : nullptr;
    table.param_out[slot] = a.param_outs.empty() ? nullptr : a.param_outs[i].data_ptr();
    table.param_out_dtype = out_dtype;
  };
  auto launch = [&](const LaunchTable& table, int64_t) { C10_CUDA_CHECK(launch_update(table, s, d, stream)); };
  for_each_table(a.grads, a.num_tensors(), summation_weights(a.weights, a.num_workers()), fill, launch);
}

std::tuple<at::Tensor, at::Tensor> norm_cuda(at::TensorList grads, int64_t num_tensors,
                                             const std::optional<at::ArrayRef<double>>& weights) {
  const c10::cuda::CUDAGuard guard(grads[0].device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t G = static_cast<int64_t>(grads.size()) / num_tensors;
  int64_t total_chunks = 0;
  for (int64_t i = 0; i < num_tensors; ++i) total_chunks += num_chunks(grads[i].numel());
  const auto options = at::TensorOptions().dtype(at::kFloat).device(grads[0].device());
  at::Tensor partials = at::zeros({std::max<int64_t>(total_chunks, 1)}, options.dtype(at::kDouble));
  at::Tensor norm = at::empty({}, options);
  at::Tensor nonfinite = at::empty({}, options);
  const float mult = weights.has_value() ? 1.0f : static_cast<float>(1.0 / static_cast<double>(G));
  auto launch = [&](const LaunchTable& table, int64_t first_chunk) {
    C10_CUDA_CHECK(launch_sum_squares(table, mult, partials.data_ptr<double>() + first_chunk, stream));
  };
  for_each_table(grads, num_tensors, summation_weights(weights, G), [](LaunchTable&, int, int64_t) {}, launch);
  C10_CUDA_CHECK(launch_finish_norm(partials.data_ptr<double>(), partials.numel(), norm.data_ptr<float>(),
                                    nonfinite.data_ptr<float>(), stream));
  return {norm, nonfinite};
}

}  // namespace
}  // namespace pyengine::cuda

TORCH_LIBRARY_IMPL(pyengine, CUDA, m) {
  PYENGINE_REGISTER_OPS(m, ::pyengine::cuda::update_cuda, ::pyengine::cuda::norm_cuda);
}
