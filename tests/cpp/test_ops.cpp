// Unit tests of the registered CPU ops (torch::ops pyengine::*), called through the dispatcher as Python would:
//   - five AdamW steps on 100003 elements (odd, several parallel chunks) against an ATen float64 reference;
//   - 1 and 2 threads give bit-identical results;
//   - a wrong gradient length raises and writes nothing; found_inf != 0 changes nothing;
//   - mean_grad_norm against a float64 norm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdio>
#include <cmath>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "check.h"

namespace {

// The hyperparameters as the kernels hold them, in float32: 1 - beta2 from float(0.999) differs from 0.001 by 1.3e-5
// relative, more than the tolerance, so the float64 reference starts from the same rounded values.
constexpr double kLr = 1e-2f, kBeta1 = 0.9f, kBeta2 = 0.999f, kEps = 1e-8f, kWeightDecay = 0.1f;

struct AdamState {
  at::Tensor param, exp_avg, exp_avg_sq;

  AdamState clone() const { return {param.clone(), exp_avg.clone(), exp_avg_sq.clone()}; }
  bool equal(const AdamState& o) const {
    return at::equal(param, o.param) && at::equal(exp_avg, o.exp_avg) && at::equal(exp_avg_sq, o.exp_avg_sq);
  }
};

// exp_avg_sq starts at 0.01 or more. The update m / (sqrt(v_hat) + eps) is ill-conditioned where v is tiny: exp_avg
// = beta1 * m + (1 - beta1) * g can cancel, and its float32 rounding error (~1e-7 |g|) is then divided by a
// denominator near eps, so a float32 kernel and a float64 reference may differ by far more than any tolerance on the
// result. With v >= 0.01 the denominator sqrt(v / bc2) stays above 1 for these five steps, the propagated error stays
// below 1e-8, and what is left to compare is the rounding of the update itself.
AdamState random_state(int64_t n) {
  return {at::randn({n}), at::randn({n}) * 0.1, at::randn({n}).square() * 0.01 + 0.01};
}

void mean_grad_adamw_(AdamState& s, const std::vector<at::Tensor>& grads, int64_t step,
                      const std::optional<at::Tensor>& found_inf = std::nullopt) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pyengine::mean_grad_adamw_", "");
  torch::jit::Stack stack{s.param, s.exp_avg, s.exp_avg_sq, c10::List<at::Tensor>(grads),
                          kLr, kBeta1, kBeta2, kEps, kWeightDecay, step,
                          /*adamw=*/true, /*maximize=*/false, /*amsgrad=*/false,
                          /*max_exp_avg_sq=*/c10::IValue(), /*grad_scale=*/c10::IValue(),
                          found_inf.has_value() ? c10::IValue(*found_inf) : c10::IValue(),
                          /*weights=*/c10::IValue(), /*param_out=*/c10::IValue(), /*grad_norm=*/c10::IValue(),
                          /*max_grad_norm=*/0.0};
  op.callBoxed(&stack);
}

double mean_grad_norm(const std::vector<at::Tensor>& grads) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("pyengine::mean_grad_norm", "");
  torch::jit::Stack stack{c10::List<at::Tensor>(grads), c10::IValue()};
  op.callBoxed(&stack);
  CHECK(stack.size() == 2 && stack[1].toTensor().item<float>() == 0.0f, "mean_grad_norm: finite input flagged");
  return stack[0].toTensor().item<double>();
}

std::vector<at::Tensor> random_grads(int64_t n, int G) {
  std::vector<at::Tensor> grads;
  for (int k = 0; k < G; ++k) grads.push_back(at::randn({n}).to(k % 2 == 0 ? at::kFloat : at::kBFloat16));
  return grads;
}

at::Tensor mean_f64(const std::vector<at::Tensor>& grads) {
  at::Tensor sum = at::zeros_like(grads[0], at::kDouble);
  for (const at::Tensor& g : grads) sum += g.to(at::kDouble);
  return sum / static_cast<double>(grads.size());
}

void test_matches_float64_reference() {
  const int64_t n = 100003;
  AdamState s = random_state(n);
  at::Tensor p = s.param.to(at::kDouble), m = s.exp_avg.to(at::kDouble), v = s.exp_avg_sq.to(at::kDouble);
  for (int64_t step = 1; step <= 5; ++step) {
    const std::vector<at::Tensor> grads = random_grads(n, 3);
    mean_grad_adamw_(s, grads, step);
    const at::Tensor g = mean_f64(grads);
    p.mul_(1.0 - kLr * kWeightDecay);
    m.mul_(kBeta1).add_(g, 1.0 - kBeta1);
    v.mul_(kBeta2).add_(g * g, 1.0 - kBeta2);
    const double bc1 = 1.0 - std::pow(kBeta1, step), bc2 = 1.0 - std::pow(kBeta2, step);
    p.sub_(m / (v.sqrt() / std::sqrt(bc2) + kEps), kLr / bc1);
    CHECK(at::allclose(s.exp_avg.to(at::kDouble), m, 1e-5, 1e-7), "exp_avg differs from float64 at step " << step);
    CHECK(at::allclose(s.exp_avg_sq.to(at::kDouble), v, 1e-5, 1e-9), "exp_avg_sq differs at step " << step);
    CHECK(at::allclose(s.param.to(at::kDouble), p, 1e-5, 1e-6),
          "param differs at step " << step << ": max abs err "
                                   << (s.param.to(at::kDouble) - p).abs().max().item<double>());
  }
}

void test_thread_count_changes_no_bit() {
  const int64_t n = 3 * 16384 + 17;
  const AdamState init = random_state(n);
  const std::vector<at::Tensor> grads = random_grads(n, 4);
  AdamState one = init.clone(), two = init.clone();
  at::set_num_threads(1);
  mean_grad_adamw_(one, grads, 2);
  at::set_num_threads(2);
  mean_grad_adamw_(two, grads, 2);
  CHECK(one.equal(two), "1 and 2 threads gave different bits");
}

void test_errors_and_skips_write_nothing() {
  const int64_t n = 4097;
  const AdamState init = random_state(n);
  AdamState s = init.clone();
  bool raised = false;
  try {
    mean_grad_adamw_(s, {at::randn({n}), at::randn({n - 1})}, 1);
  } catch (const c10::Error& e) {
    raised = true;
    CHECK(std::string(e.what()).find("grads") != std::string::npos, "message does not name grads: " << e.what());
  }
  CHECK(raised, "a gradient of the wrong length was accepted");
  CHECK(s.equal(init), "state changed by a call that raised");

  mean_grad_adamw_(s, random_grads(n, 2), 1, at::ones({1}));
  CHECK(s.equal(init), "state changed although found_inf was set");
}

void test_norm_matches_float64() {
  const std::vector<at::Tensor> grads = random_grads(100003, 3);
  const double expected = mean_f64(grads).norm().item<double>();
  const double norm = mean_grad_norm(grads);
  CHECK(std::abs(norm - expected) <= 1e-5 * expected, "mean_grad_norm " << norm << " vs " << expected);
}

}  // namespace

int main() {
#ifndef PYENGINE_HAVE_OP_SCHEMAS
  std::printf("test_ops: skipped (built without csrc/ops.cpp: no libpython)\n");
  return 77;
#else
  at::manual_seed(static_cast<uint64_t>(std::random_device{}()));
  test_matches_float64_reference();
  test_thread_count_changes_no_bit();
  test_errors_and_skips_write_nothing();
  test_norm_matches_float64();
  return pyengine::test::finish("test_ops");
#endif
}
