// Python bindings of the host store's C++ core (pyengine._C): the arena allocator, BucketTransfer and NVTX ranges.
// The Python faces (pyengine/store.py, pyengine/streamer.py) are the public API; these names start with an
// underscore or are documented there. Every call that can block or copy releases the GIL.
#include <torch/extension.h>

#include <optional>

#include "arena.h"
#include "nvtx.h"
#include "transfer.h"

namespace pyengine::store {
namespace {

std::vector<at::Tensor> undefined_for_none(const std::vector<std::optional<at::Tensor>>& tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(t.has_value() ? *t : at::Tensor());
  return out;
}

}  // namespace

void init_store_bindings(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("_allocate_arena", &allocate_arena, py::arg("nbytes"), py::arg("pinned"), py::arg("huge_pages") = true,
        py::call_guard<py::gil_scoped_release>(),
        "Zeroed host memory of exactly nbytes as a uint8 tensor whose storage owns it: 2 MiB-aligned, THP-advised "
        "and pre-faulted, page-locked with cudaHostRegister when pinned (cudaHostAlloc when that fails or "
        "huge_pages=False).");
  m.def("_pinned_allocation_available", &pinned_allocation_available,
        "True when a CUDA build sees a usable device, so pinned arenas can be allocated.");
  m.def("_nvtx_push", &nvtx_push, py::arg("name"), "Opens an NVTX range (no-op in a CPU-only build).");
  m.def("_nvtx_pop", &nvtx_pop, "Closes the innermost NVTX range.");

  // held with ForkSafeDelete: Note [A transfer in a forked process]
  py::class_<BucketTransfer, TransferPtr>(m, "BucketTransfer",
                             "Per-bucket copies of one worker: channel 0 grads (replica -> host slot), channel 1 "
                             "weights (host -> replica), on a copy stream (CUDA) or a copy thread (CPU).")
      .def(py::init([](int64_t num_buckets, const std::string& device, std::string label) {
             return make_transfer(num_buckets, at::Device(device), std::move(label));
           }),
           py::arg("num_buckets"), py::arg("device"), py::arg("label"))
      .def_property_readonly("num_buckets", &BucketTransfer::num_buckets)
      .def(
          "launch",
          [](BucketTransfer& self, int64_t channel, int64_t bucket, const std::vector<std::optional<at::Tensor>>& srcs,
             std::vector<at::Tensor> dsts, bool completes_bucket) {
            std::vector<at::Tensor> sources = undefined_for_none(srcs);
            py::gil_scoped_release no_gil;
            self.launch(channel, bucket, std::move(sources), std::move(dsts), completes_bucket);
          },
          py::arg("channel"), py::arg("bucket"), py::arg("srcs"), py::arg("dsts"), py::arg("completes_bucket") = true,
          "Starts dsts[i] <- srcs[i] (None zero-fills) for one bucket; returns at once. completes_bucket=False: an "
          "early part of the bucket, copied in order; waits count the bucket launched only with its completing "
          "launch.")
      .def("wait", &BucketTransfer::wait, py::arg("channel"), py::arg("bucket"), py::arg("until_launched"),
           py::arg("timeout_s") = -1.0, py::call_guard<py::gil_scoped_release>(),
           "Blocks until the bucket's last launched copy is complete; False if timeout_s (>= 0) ran out waiting for "
           "the launch.")
      .def("wait_all", &BucketTransfer::wait_all, py::arg("channel"), py::arg("until_launched"),
           py::call_guard<py::gil_scoped_release>())
      .def("release", &BucketTransfer::release, py::arg("channel"), py::arg("bucket"))
      .def("order_current_stream", &BucketTransfer::order_current_stream, py::arg("channel"),
           py::call_guard<py::gil_scoped_release>())
      .def("drain", &BucketTransfer::drain, py::call_guard<py::gil_scoped_release>(),
           "Blocks until every copy started so far (early parts included) has completed; no counter changes.")
      .def("close", &BucketTransfer::close, py::call_guard<py::gil_scoped_release>());
}

}  // namespace pyengine::store
