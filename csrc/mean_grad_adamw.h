// The ATen-level face of the fused mean-gradient AdamW update, shared by the CPU and CUDA implementations:
// argument validation (everything is checked before anything is written) and the derivation of the per-step scalars.
//
// Every op works on P tensors at once (the multi-tensor form); the flat form is the same call with P = 1.
// Gradients arrive worker-major: grads[g * P + i] is worker g's gradient of tensor i.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

#include "update_scalars.h"

namespace pyengine {

struct AdamWHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  int64_t step;
  bool adamw;
  bool maximize;
  bool amsgrad;
  double max_grad_norm;  // <= 0: no clipping
};

struct UpdateArgs {
  at::TensorList params;
  at::TensorList exp_avgs;
  at::TensorList exp_avg_sqs;
  at::TensorList grads;            // worker-major, num_workers() * params.size()
  at::TensorList max_exp_avg_sqs;  // empty unless amsgrad
  at::TensorList param_outs;       // empty, or one per param
  const std::optional<at::Tensor>& grad_scale;
  const std::optional<at::Tensor>& found_inf;
  const std::optional<at::ArrayRef<double>>& weights;
  const std::optional<at::Tensor>& grad_norm;
  AdamWHyper hyper;
  bool flat;  // the flat form (mean_grad_adamw_): one 1-D param; the multi form takes any shapes

  int64_t num_tensors() const { return static_cast<int64_t>(params.size()); }
  int64_t num_workers() const { return static_cast<int64_t>(grads.size()) / num_tensors(); }
  const at::Tensor& grad(int64_t worker, int64_t tensor) const { return grads[worker * num_tensors() + tensor]; }
};

// Throws c10::Error / c10::ValueError naming the argument, what was expected and what was given.
void check_update_args(const UpdateArgs& args);

// Validates the gradients of a norm pass; returns the number of workers G.
int64_t check_norm_args(at::TensorList grads, int64_t num_tensors, const std::optional<at::ArrayRef<double>>& weights,
                        const char* op_name);

// The per-step scalars (computed in double, stored as float). grad_mult holds 1/G (or 1 with weights) and the sign.
UpdateScalars make_update_scalars(const UpdateArgs& args);

// The update's float32 scalars that follow from the hyperparameters alone, each checked to lie in float32's range
// (a clear ValueError naming it otherwise). make_update_scalars() takes them from here; the engine asks before it
// counts an update (pyengine._C._check_update_hyper), so a refused value never advances the step.
struct NarrowedHyper {
  float lr, eps, weight_decay, step_size, decay;
};
NarrowedHyper narrow_hyper(double lr, double beta1, double eps, double weight_decay, int64_t step);

Dtype dtype_code(at::ScalarType type);

// Per-worker weight of the summation: weights[g] when given, else 1 (the 1/G goes into grad_mult).
std::vector<float> summation_weights(const std::optional<at::ArrayRef<double>>& weights, int64_t num_workers);

// ---- Op entry points, instantiated once per backend with its implementation (cpu/ and cuda/). ----
// The argument lists mirror the schemas in ops.cpp; the flat form is the multi-tensor form with one tensor.

using UpdateImpl = void (*)(const UpdateArgs&);
using NormImpl = std::tuple<at::Tensor, at::Tensor> (*)(at::TensorList grads, int64_t num_tensors,
                                                       const std::optional<at::ArrayRef<double>>& weights);

template <UpdateImpl Impl>
void run_update(bool flat, at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList grads, double lr, double beta1, double beta2, double eps, double weight_decay,
                int64_t step, bool adamw, bool maximize, bool amsgrad, at::TensorList max_exp_avg_sqs,
                const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                std::optional<at::ArrayRef<double>> weights, at::TensorList param_outs,
                const std::optional<at::Tensor>& grad_norm, double max_grad_norm) {
  const UpdateArgs args{params,     exp_avgs,  exp_avg_sqs, grads,   max_exp_avg_sqs,
                        param_outs, grad_scale, found_inf,  weights, grad_norm,
                        AdamWHyper{lr, beta1, beta2, eps, weight_decay, step, adamw, maximize, amsgrad,
                                   max_grad_norm},
                        flat};
  check_update_args(args);
  Impl(args);
}

template <UpdateImpl Impl>
void mean_grad_adamw_multi_op(at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                              at::TensorList grads, double lr, double beta1, double beta2, double eps,
                              double weight_decay, int64_t step, bool adamw, bool maximize, bool amsgrad,
                              at::TensorList max_exp_avg_sqs, const std::optional<at::Tensor>& grad_scale,
                              const std::optional<at::Tensor>& found_inf,
                              std::optional<at::ArrayRef<double>> weights, at::TensorList param_outs,
                              const std::optional<at::Tensor>& grad_norm, double max_grad_norm) {
  run_update<Impl>(/*flat=*/false, params, exp_avgs, exp_avg_sqs, grads, lr, beta1, beta2, eps, weight_decay, step,
                   adamw, maximize, amsgrad, max_exp_avg_sqs, grad_scale, found_inf, weights, param_outs, grad_norm,
                   max_grad_norm);
}

template <UpdateImpl Impl>
void mean_grad_adamw_op(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                        at::TensorList grads, double lr, double beta1, double beta2, double eps, double weight_decay,
                        int64_t step, bool adamw, bool maximize, bool amsgrad,
                        const std::optional<at::Tensor>& max_exp_avg_sq, const std::optional<at::Tensor>& grad_scale,
                        const std::optional<at::Tensor>& found_inf, std::optional<at::ArrayRef<double>> weights,
                        const std::optional<at::Tensor>& param_out, const std::optional<at::Tensor>& grad_norm,
                        double max_grad_norm) {
  std::vector<at::Tensor> max_list, out_list;
  if (max_exp_avg_sq.has_value()) max_list.push_back(*max_exp_avg_sq);
  if (param_out.has_value()) out_list.push_back(*param_out);
  run_update<Impl>(/*flat=*/true, {param}, {exp_avg}, {exp_avg_sq}, grads, lr, beta1, beta2, eps, weight_decay,
                   step, adamw, maximize, amsgrad, max_list, grad_scale, found_inf, weights, out_list, grad_norm,
                   max_grad_norm);
}

template <NormImpl Impl>
std::tuple<at::Tensor, at::Tensor> mean_grad_norm_multi_op(at::TensorList grads, int64_t num_tensors,
                                                           std::optional<at::ArrayRef<double>> weights) {
  check_norm_args(grads, num_tensors, weights, "mean_grad_norm");
  return Impl(grads, num_tensors, weights);
}

template <NormImpl Impl>
std::tuple<at::Tensor, at::Tensor> mean_grad_norm_op(at::TensorList grads,
                                                     std::optional<at::ArrayRef<double>> weights) {
  return mean_grad_norm_multi_op<Impl>(grads, 1, weights);
}

// Registers the four ops of one backend (used inside TORCH_LIBRARY_IMPL).
#define PYENGINE_REGISTER_OPS(m, update_impl, norm_impl)                                       \
  m.impl("mean_grad_adamw_", &::pyengine::mean_grad_adamw_op<update_impl>);                  \
  m.impl("mean_grad_adamw_multi_", &::pyengine::mean_grad_adamw_multi_op<update_impl>);      \
  m.impl("mean_grad_norm", &::pyengine::mean_grad_norm_op<norm_impl>);                       \
  m.impl("mean_grad_norm_multi", &::pyengine::mean_grad_norm_multi_op<norm_impl>)

}  // namespace pyengine
