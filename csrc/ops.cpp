// Op schemas (declared once, implemented per dispatch key in cpu/ and cuda/) and the Python module pyengine._C.
//
// Importing pyengine._C runs the static registrations below and in the backend files; the module itself only
// reports how it was built. Gradients of the multi-tensor ops are worker-major: grads[g * P + i].
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include "cpu/isa.h"

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
  m.def("_set_serial_on_this_thread", &pyengine::cpu::set_serial_on_this_thread, pybind11::arg("serial"),
        "Run pyengine's CPU ops on the calling thread only (True) or with at::parallel_for (False), for this thread; "
        "returns the previous setting.");
  pyengine::store::init_store_bindings(m);
}
