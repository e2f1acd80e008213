// Validation and scalar derivation for the fused mean-gradient AdamW ops (see mean_grad_adamw.h).
//
// Note [Nothing written on error]
// Every check runs before the first byte of any output is touched, on every device: a caller who gets an error keeps
// the weights and the optimizer state exactly as they were. The implementations call check_update_args() first and
// launch nothing until it returns.
#include "mean_grad_adamw.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace pyengine {
namespace {

bool is_grad_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// The kernels read and write elements through typed pointers (vector loads on CUDA when aligned); a tensor whose data
// does not start on its element size's boundary (torch.frombuffer at an odd offset, DLPack) is formally undefined
// behaviour on the CPU and a misaligned-address fault on CUDA, which ends the process's CUDA context.
bool aligned(const at::Tensor& t) {
  return t.numel() == 0 || reinterpret_cast<uintptr_t>(t.data_ptr()) % t.element_size() == 0;
}

std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << t.scalar_type() << " tensor of shape " << t.sizes() << " on " << t.device()
     << (t.is_contiguous() ? "" : " (non-contiguous)");
  return os.str();
}

// name[i] as used in messages: "exp_avg" for the flat form (one tensor), "exp_avgs[3]" for the multi-tensor form.
std::string arg_name(const char* name, int64_t index, int64_t count) {
  if (count == 1) return name;
  return std::string(name) + "[" + std::to_string(index) + "]";
}

// written: the kernel writes t (a copy would lose the update); otherwise it only reads t.
void check_buffer(const at::Tensor& t, const std::string& name, const at::Tensor& param, bool float32_only,
                  bool written, bool flat) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a tensor, got an undefined tensor");
  TORCH_CHECK_VALUE(!flat || t.dim() == 1, name, " must be 1-D (flat form); got ", describe(t));
  TORCH_CHECK_VALUE(t.device() == param.device(), name, " must be on ", param.device(), " like param; got ",
                    describe(t));
  if (float32_only) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be float32; got ", describe(t));
  } else {
    TORCH_CHECK_TYPE(is_grad_dtype(t.scalar_type()), name, " must be float32, bfloat16 or float16; got ", describe(t));
  }
  TORCH_CHECK_VALUE(t.numel() == param.numel(), name, " must have ", param.numel(),
                    " elements like param; got ", describe(t));
  // The multi form pairs elements by position: a [3, 2] gradient for a [2, 3] param (a transposed one made
  // contiguous, say) would pair the wrong elements silently.
  TORCH_CHECK_VALUE(flat || t.sizes() == param.sizes(), name, " must have param's shape ", param.sizes(), "; got ",
                    describe(t));
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous (",
                    written ? "it is written in place; a copy would lose the update" : "it is read as a flat array",
                    "); got ", describe(t));
  TORCH_CHECK_VALUE(aligned(t), name, "'s data must start on a multiple of its element size (", t.element_size(),
                    " bytes); got ", describe(t), " at address ", t.data_ptr());
}

void check_scalar_tensor(const std::optional<at::Tensor>& t, const char* name, const at::Tensor& param) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->numel() == 1, name, " must have exactly 1 element; got ", describe(*t));
  TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, name, " must be float32; got ", describe(*t));
  TORCH_CHECK_VALUE(aligned(*t), name, "'s data must start on a multiple of 4 bytes; got address ", t->data_ptr());
  TORCH_CHECK_VALUE(t->device() == param.device(), name, " must be on ", param.device(), " like param; got ",
                    describe(*t));
}

void check_hyper(const AdamWHyper& h) {
  TORCH_CHECK_VALUE(std::isfinite(h.lr) && h.lr >= 0.0, "lr must be a finite number >= 0; got ", h.lr);
  // eps = 0: an element whose gradients have all been 0 so far divides 0 by 0 (NaN in the master weights); one below
  // float32's smallest normal number is 0 where the hardware flushes subnormals.
  TORCH_CHECK_VALUE(std::isfinite(h.eps) && h.eps >= std::numeric_limits<float>::min(),
                    "eps must be a finite number >= ", std::numeric_limits<float>::min(),
                    " (float32's smallest normal number; with eps = 0 an element whose gradients are all 0 divides 0 by"
                    " 0); got ", h.eps);
  TORCH_CHECK_VALUE(h.beta1 >= 0.0 && h.beta1 < 1.0, "beta1 must be in [0, 1); got ", h.beta1);
  TORCH_CHECK_VALUE(h.beta2 >= 0.0 && h.beta2 < 1.0, "beta2 must be in [0, 1); got ", h.beta2);
  TORCH_CHECK_VALUE(std::isfinite(h.weight_decay) && h.weight_decay >= 0.0,
                    "weight_decay must be a finite number >= 0; got ", h.weight_decay);
  TORCH_CHECK_VALUE(h.step >= 1, "step must be >= 1 (the step count after increment, as torch.optim counts); got ",
                    h.step);
  TORCH_CHECK_VALUE(!std::isnan(h.max_grad_norm) && h.max_grad_norm >= 0.0,
                    "max_grad_norm must be > 0 to clip, or None; got ", h.max_grad_norm);
}

void check_weights(const std::optional<at::ArrayRef<double>>& weights, int64_t num_workers) {
  if (!weights.has_value()) return;
  TORCH_CHECK_VALUE(static_cast<int64_t>(weights->size()) == num_workers, "weights must have one entry per worker (",
                    num_workers, "); got ", weights->size());
  double sum = 0.0;
  for (size_t g = 0; g < weights->size(); ++g) {
    const double w = (*weights)[g];
    TORCH_CHECK_VALUE(std::isfinite(w) && w >= 0.0, "weights[", g, "] must be a finite number >= 0; got ", w);
    sum += w;
  }
  TORCH_CHECK_VALUE(std::abs(sum - 1.0) <= 1e-5, "weights must sum to 1 (they weight the mean over workers); got a "
                    "sum of ", sum);
}

// The byte range a contiguous tensor covers, with the name to report when it collides with another.
struct Span {
  uintptr_t begin;
  uintptr_t end;
  std::string name;
};

Span span_of(const at::Tensor& t, std::string name) {
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {begin, begin + static_cast<uintptr_t>(t.nbytes()), std::move(name)};
}

// Outputs must not overlap each other nor any gradient: the kernels read and write them in tiles, so an overlap
// would silently read half-updated values. Sorted intervals: O(K log K) for K tensors, cheap for whole models.
void check_no_overlap(std::vector<Span> outputs, const std::vector<Span>& inputs) {
  std::erase_if(outputs, [](const Span& s) { return s.begin == s.end; });
  std::sort(outputs.begin(), outputs.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < outputs.size(); ++i) {
    TORCH_CHECK_VALUE(outputs[i - 1].end <= outputs[i].begin, outputs[i - 1].name, " and ", outputs[i].name,
                      " overlap in memory; every updated buffer needs its own memory");
  }
  for (const Span& in : inputs) {
    if (in.begin == in.end) continue;
    // The last output starting before `in` ends is the only candidate that can overlap it from the left; any
    // output starting inside `in` overlaps too.
    auto it = std::lower_bound(outputs.begin(), outputs.end(), in.end,
                               [](const Span& s, uintptr_t value) { return s.begin < value; });
    if (it == outputs.begin()) continue;
    --it;
    TORCH_CHECK_VALUE(it->end <= in.begin, in.name, " overlaps ", it->name,
                      " in memory; gradients must not share memory with the buffers being updated");
  }
}

}  // namespace

Dtype dtype_code(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return Dtype::kFloat32;
    case at::kBFloat16: return Dtype::kBFloat16;
    case at::kHalf: return Dtype::kFloat16;
    default: TORCH_CHECK_TYPE(false, "unsupported dtype ", type, "; expected float32, bfloat16 or float16");
  }
}

int64_t check_norm_args(at::TensorList grads, int64_t num_tensors, const std::optional<at::ArrayRef<double>>& weights,
                        const char* op_name) {
  TORCH_CHECK_VALUE(num_tensors >= 1, op_name, ": need at least one tensor per worker; got ", num_tensors);
  TORCH_CHECK_VALUE(!grads.empty(), op_name, ": grads must hold at least one worker's gradient (G >= 1); got an "
                    "empty list");
  TORCH_CHECK_VALUE(static_cast<int64_t>(grads.size()) % num_tensors == 0, op_name, ": got ", grads.size(),
                    " gradients, not a multiple of the ", num_tensors, " tensors");
  const int64_t num_workers = static_cast<int64_t>(grads.size()) / num_tensors;
  for (int64_t i = 0; i < num_tensors; ++i) {
    const at::Tensor& first = grads[i];
    TORCH_CHECK_VALUE(first.defined(), op_name, ": gradient of worker 0 for tensor ", i, " is undefined");
    for (int64_t g = 0; g < num_workers; ++g) {
      const at::Tensor& t = grads[g * num_tensors + i];
      const std::string name = "grads[" + std::to_string(g) + "]" + (num_tensors > 1 ? "[" + std::to_string(i) + "]"
                                                                                         : std::string());
      TORCH_CHECK_VALUE(t.defined(), op_name, ": ", name, " is undefined");
      // Against the very first gradient: every tensor's gradients on one device (the kernel is launched on it).
      TORCH_CHECK_VALUE(t.device() == grads[0].device(), op_name, ": ", name, " must be on ", grads[0].device(),
                        " like the other gradients; got ", describe(t));
      TORCH_CHECK_TYPE(is_grad_dtype(t.scalar_type()), op_name, ": ", name,
                       " must be float32, bfloat16 or float16; got ", describe(t));
      TORCH_CHECK_VALUE(t.numel() == first.numel(), op_name, ": ", name, " must have ", first.numel(),
                        " elements like grads[0]; got ", describe(t));
      // The elements are paired by position, as the update pairs them: a transposed gradient made contiguous
      // ([3, 2] against [2, 3]) would pair the wrong ones without a word (the update refuses it too).
      TORCH_CHECK_VALUE(t.sizes() == first.sizes(), op_name, ": ", name, " must have the shape of worker 0's gradient ",
                        first.sizes(), "; got ", describe(t));
      TORCH_CHECK_VALUE(t.is_contiguous(), op_name, ": ", name, " must be contiguous; got ", describe(t));
      TORCH_CHECK_VALUE(aligned(t), op_name, ": ", name, "'s data must start on a multiple of its element size (",
                        t.element_size(), " bytes); got ", describe(t), " at address ", t.data_ptr());
    }
  }
  check_weights(weights, num_workers);
  return num_workers;
}

void check_update_args(const UpdateArgs& a) {
  const int64_t P = a.num_tensors();
  TORCH_CHECK_VALUE(P >= 1, "params must hold at least one tensor");
  TORCH_CHECK_VALUE(static_cast<int64_t>(a.exp_avgs.size()) == P && static_cast<int64_t>(a.exp_avg_sqs.size()) == P,
                    "params, exp_avgs and exp_avg_sqs must have the same length; got ", P, ", ", a.exp_avgs.size(),
                    " and ", a.exp_avg_sqs.size());
  TORCH_CHECK_VALUE(!a.grads.empty(), "grads must hold at least one worker's gradient (G >= 1); got an empty list");
  TORCH_CHECK_VALUE(static_cast<int64_t>(a.grads.size()) % P == 0, "grads must hold G gradients per param; got ",
                    a.grads.size(), " gradients for ", P, " params");
  check_hyper(a.hyper);
  const int64_t G = a.num_workers();
  TORCH_CHECK_VALUE(a.hyper.amsgrad || a.max_exp_avg_sqs.empty(),  // it was left as it was, any size, no word
                    "max_exp_avg_sq given with amsgrad=False: only amsgrad reads and writes it; pass amsgrad=True, "
                    "or leave it out");
  TORCH_CHECK_VALUE(!a.hyper.amsgrad || static_cast<int64_t>(a.max_exp_avg_sqs.size()) == P,
                    "amsgrad=True needs max_exp_avg_sq (one float32 buffer per param like exp_avg_sq); got ",
                    a.max_exp_avg_sqs.size(), " for ", P, " params");
  TORCH_CHECK_VALUE(a.param_outs.empty() || static_cast<int64_t>(a.param_outs.size()) == P,
                    "param_out must be None or one tensor per param; got ", a.param_outs.size(), " for ", P,
                    " params");

  const at::Device device = a.params[0].device();
  std::vector<Span> outputs, inputs;
  for (int64_t i = 0; i < P; ++i) {
    const at::Tensor& p = a.params[i];
    const std::string pname = arg_name("param", i, P);
    TORCH_CHECK_VALUE(p.defined(), pname, " is undefined");
    TORCH_CHECK_VALUE(p.device() == device, pname, " must be on ", device, " like the other params; got ",
                      describe(p));
    TORCH_CHECK_TYPE(p.scalar_type() == at::kFloat, pname, " must be float32 (the fp32 master weights); got ",
                     describe(p));
    TORCH_CHECK_VALUE(p.is_contiguous(), pname, " must be contiguous (it is updated in place; a copy would lose the "
                      "update); got ", describe(p));
    TORCH_CHECK_VALUE(!a.flat || p.dim() == 1, "param must be 1-D (flat form); got ", describe(p));
    TORCH_CHECK_VALUE(aligned(p), pname, "'s data must start on a multiple of its element size (4 bytes); got ",
                      describe(p), " at address ", p.data_ptr());
    check_buffer(a.exp_avgs[i], arg_name("exp_avg", i, P), p, true, true, a.flat);
    check_buffer(a.exp_avg_sqs[i], arg_name("exp_avg_sq", i, P), p, true, true, a.flat);
    outputs.push_back(span_of(p, pname));
    outputs.push_back(span_of(a.exp_avgs[i], arg_name("exp_avg", i, P)));
    outputs.push_back(span_of(a.exp_avg_sqs[i], arg_name("exp_avg_sq", i, P)));
    if (a.hyper.amsgrad) {
      check_buffer(a.max_exp_avg_sqs[i], arg_name("max_exp_avg_sq", i, P), p, true, true, a.flat);
      outputs.push_back(span_of(a.max_exp_avg_sqs[i], arg_name("max_exp_avg_sq", i, P)));
    }
    if (!a.param_outs.empty()) {
      check_buffer(a.param_outs[i], arg_name("param_out", i, P), p, false, true, a.flat);
      outputs.push_back(span_of(a.param_outs[i], arg_name("param_out", i, P)));
    }
    for (int64_t g = 0; g < G; ++g) {
      const at::Tensor& grad = a.grad(g, i);
      const std::string gname = "grads[" + std::to_string(g) + "]" + (P > 1 ? "[" + std::to_string(i) + "]" : "");
      check_buffer(grad, gname, p, false, false, a.flat);
      inputs.push_back(span_of(grad, gname));
    }
  }
  check_weights(a.weights, G);
  check_scalar_tensor(a.grad_scale, "grad_scale", a.params[0]);
  check_scalar_tensor(a.found_inf, "found_inf", a.params[0]);
  check_scalar_tensor(a.grad_norm, "grad_norm", a.params[0]);
  TORCH_CHECK_VALUE(a.hyper.max_grad_norm <= 0.0 || a.grad_norm.has_value(),
                    "clipping (max_grad_norm > 0) needs grad_norm, the norm from mean_grad_norm()");
  // The 1-element scalars are read by every CUDA block: one inside an output would change between blocks.
  for (const auto& [scalar, name] : {std::pair{&a.grad_scale, "grad_scale"}, std::pair{&a.found_inf, "found_inf"},
                                     std::pair{&a.grad_norm, "grad_norm"}}) {
    if (scalar->has_value()) inputs.push_back(span_of(**scalar, name));
  }
  check_no_overlap(std::move(outputs), inputs);
}

namespace {
// float(x) for an update scalar: the kernels compute in float32, and narrowing a double beyond float's range is
// undefined behaviour (lr = 1e300 was accepted and wrote -inf into the weights).
float narrowed(double x, const char* what) {
  TORCH_CHECK_VALUE(std::abs(x) <= static_cast<double>(std::numeric_limits<float>::max()), what, " = ", x,
                    " is beyond float32's range (the update computes in float32)");
  return static_cast<float>(x);
}
}  // namespace

NarrowedHyper narrow_hyper(double lr, double beta1, double eps, double weight_decay, int64_t step) {
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  return {narrowed(lr, "lr"), narrowed(eps, "eps"), narrowed(weight_decay, "weight_decay"),
          narrowed(lr / bias_correction1, "lr / (1 - beta1^step)"),
          narrowed(1.0 - lr * weight_decay, "1 - lr * weight_decay")};
}

UpdateScalars make_update_scalars(const UpdateArgs& a) {
  const AdamWHyper& h = a.hyper;
  const double bias_correction2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  const double mean_mult = a.weights.has_value() ? 1.0 : 1.0 / static_cast<double>(a.num_workers());
  const NarrowedHyper n = narrow_hyper(h.lr, h.beta1, h.eps, h.weight_decay, h.step);
  UpdateScalars s{};
  s.lr = n.lr;
  s.beta1 = static_cast<float>(h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.eps = n.eps;
  s.weight_decay = n.weight_decay;
  s.step_size = n.step_size;
  s.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  s.decay = n.decay;
  s.grad_mult = static_cast<float>(h.maximize ? -mean_mult : mean_mult);
  // A positive bound below float's range must still clip (to ~0), not turn clipping off by rounding to 0.
  // Beyond float's range (finite or not): a bound no float norm reaches, infinity.
  s.max_grad_norm = h.max_grad_norm > static_cast<double>(std::numeric_limits<float>::max())
      ? std::numeric_limits<float>::infinity()
      : h.max_grad_norm > 0.0 ? std::max(static_cast<float>(h.max_grad_norm), std::numeric_limits<float>::denorm_min())
                              : 0.0f;
  s.adamw = h.adamw;
  s.amsgrad = h.amsgrad;
  return s;
}

std::vector<float> summation_weights(const std::optional<at::ArrayRef<double>>& weights, int64_t num_workers) {
  std::vector<float> w(num_workers, 1.0f);
  if (weights.has_value()) {
    for (int64_t g = 0; g < num_workers; ++g) w[g] = static_cast<float>((*weights)[g]);
  }
  return w;
}

}  // namespace pyengine
