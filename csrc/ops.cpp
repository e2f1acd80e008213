// Op schemas (declared once, implemented per dispatch key in cpu/ and cuda/) and the Python module pyengine._C.
//
// Importing pyengine._C runs the static registrations below and in the backend files; the module itself only
// reports how it was built. Gradients of the multi-tensor ops are worker-major: grads[g * P + i].
#include <pybind11/pybind11.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include "cpu/isa.h"
#include "mean_grad_adamw.h"

namespace pyengine::store {
void init_store_bindings(pybind11::module_& m);  // store/bindings.cpp
}

#define PYENGINE_UPDATE_OPTIONS                                                                                  \
  "float lr, float beta1, float beta2, float eps, float weight_decay, int step, bool adamw, bool maximize, "  \
  "bool amsgrad, "

TORCH_LIBRARY(pyengine, m) {
  m.def(
      "mean_grad_adamw_(Tensor(a!) param, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor[] grads, *, "
      PYENGINE_UPDATE_OPTIONS
      "Tensor(d!)? max_exp_avg_sq, Tensor? grad_scale, Tensor? found_inf, float[]? weights, "
      "Tensor(e!)? param_out, Tensor? grad_norm, float max_grad_norm) -> ()");
  m.def(
      "mean_grad_adamw_multi_(Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, Tensor[] grads, "
      "*, " PYENGINE_UPDATE_OPTIONS
      "Tensor(d!)[] max_exp_avg_sqs, Tensor? grad_scale, Tensor? found_inf, float[]? weights, "
      "Tensor(e!)[] param_outs, Tensor? grad_norm, float max_grad_norm) -> ()");
  m.def("mean_grad_norm(Tensor[] grads, float[]? weights) -> (Tensor, Tensor)");
  m.def("mean_grad_norm_multi(Tensor[] grads, int num_tensors, float[]? weights) -> (Tensor, Tensor)");
}

namespace {

// Note [Version counters of the in-place ops]
// The update ops write param, exp_avg, exp_avg_sq, max_exp_avg_sq and param_out in place; like torch's own in-place
// ops they bump those tensors' version counters (once the kernel has returned: an op that raises has written
// nothing), so that a tensor saved for a backward and then updated here makes that backward raise ("modified by an
// inplace operation") instead of silently using the new values. Registered for ADInplaceOrView, the key torch's
// in-place ops bump versions at; inference tensors have no version counter.
//
// Note [Negative views and the update ops]
// A tensor with the negative bit (torch._neg_view, or .conj().imag of a complex tensor) reads as the negation of its
// memory. torch's fallback for such arguments (at the Negative key, below this one) hands an op resolved clones and
// copies the clones of mutated arguments back through the op's returned tensors; the update ops return nothing, and
// the fallback failed an internal assert, leaving freed tensors (a crash after it). So this kernel refuses a
// negative view among the op's tensors before anything runs. Here, not in a kernel at the Negative key: one there
// cost ~5 us on every call (bench/RESULTS.md). torch.inference_mode skips this key: there a negative view still
// reached torch's fallback, which then aborted the process as its tensors were freed; the Python wrappers
// (pyengine/ops.py, _refuse_negative) refuse it under inference mode, so only a direct torch.ops.pyengine call
// there is not covered.
void bump_versions_of_mutated(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t start = stack->size() - arguments.size();
  for (size_t i = 0; i < arguments.size(); ++i) {  // Note [Negative views and the update ops]
    const c10::IValue& value = (*stack)[start + i];
    if (value.isTensor()) {
      TORCH_CHECK_VALUE(!(value.toTensor().defined() && value.toTensor().is_neg()), op.schema().name(), ": ",
                        arguments[i].name(), " is a negative view (torch._neg_view, .conj().imag); resolve it first "
                        "(.resolve_neg())");
    } else if (value.isTensorList()) {
      const auto list = value.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        const at::Tensor t = list[j];
        TORCH_CHECK_VALUE(!(t.defined() && t.is_neg()), op.schema().name(), ": ", arguments[i].name(), "[", j,
                          "] is a negative view (torch._neg_view, .conj().imag); resolve it first (.resolve_neg())");
      }
    }
  }
  std::vector<at::Tensor> mutated;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::AliasInfo* alias = arguments[i].alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    const c10::IValue& value = (*stack)[start + i];
    const size_t first = mutated.size();
    if (value.isTensor()) {
      mutated.push_back(value.toTensor());
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList()) mutated.push_back(t);
    }
    // No derivative: an update of a tensor autograd tracks is refused before anything is written (torch refuses
    // in-place ops on leaves that require grad likewise). Optimizer steps run under torch.no_grad().
    for (size_t j = first; j < mutated.size(); ++j) {
      TORCH_CHECK(!(c10::GradMode::is_enabled() && mutated[j].defined() && mutated[j].requires_grad()),
                  op.schema().name(), ": ", arguments[i].name(), " requires grad and grad mode is on; the update "
                  "writes it in place and has no derivative: call it under torch.no_grad(), as an optimizer step");
    }
  }
  {
    at::AutoDispatchBelowADInplaceOrView below;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : mutated) {
    if (t.defined() && !t.is_inference()) torch::autograd::increment_version(t);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(pyengine, ADInplaceOrView, m) {
  m.impl("mean_grad_adamw_", torch::CppFunction::makeFromBoxedFunction<&bump_versions_of_mutated>());
  m.impl("mean_grad_adamw_multi_", torch::CppFunction::makeFromBoxedFunction<&bump_versions_of_mutated>());
}


PYBIND11_MODULE(_C, m) {
  m.doc() = "pyengine C++/CUDA extension: fused mean-gradient AdamW ops (torch.ops.pyengine.*)";
#ifdef PYENGINE_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.def("cpu_isa", &pyengine::cpu::selected_isa,
        "Name of the CPU kernel variant in use (avx512, avx2 or default), chosen from at::get_cpu_capability(), "
        "which honours ATEN_CPU_CAPABILITY.");
  m.def("cpu_prefetch", &pyengine::cpu::prefetch_streams,
        "Whether the CPU update runs its software-prefetching loops (same results): PYENGINE_CPU_PREFETCH=0|1 when "
        "set, else True on Intel CPUs.");
  m.def("_set_cpu_prefetch", &pyengine::cpu::set_prefetch_streams, pybind11::arg("on"),
        "Run the CPU update's software-prefetching loops (True) or its plain ones (False) in this process, for A/B "
        "benchmarks and tests (the results are the same); returns the previous setting.");
  m.def("_set_serial_on_this_thread", &pyengine::cpu::set_serial_on_this_thread, pybind11::arg("serial"),
        "Run pyengine's CPU ops on the calling thread only (True) or with at::parallel_for (False), for this thread; "
        "returns the previous setting.");
  m.def(
      "_check_update_hyper",
      [](double lr, double beta1, double eps, double weight_decay, int64_t step) {
        try {
          pyengine::narrow_hyper(lr, beta1, eps, weight_decay, step);
        } catch (const c10::ValueError& e) {
          throw pybind11::value_error(e.what_without_backtrace());
        }
      },
      pybind11::arg("lr"), pybind11::arg("beta1"), pybind11::arg("eps"), pybind11::arg("weight_decay"),
      pybind11::arg("step"),
      "Raises ValueError where the update at these hyperparameters would refuse them: lr, eps, weight_decay, "
      "lr / (1 - beta1^step) or 1 - lr * weight_decay beyond float32's range (the check the ops make).");
  pyengine::store::init_store_bindings(m);
}
