// NVTX ranges around every copy, wait and update, so an Nsight Systems timeline reads as the data flow
// ("pyengine/d2h grads b3 w0", "pyengine/wait grads b3 w0", "pyengine/update b3", "pyengine/h2d weights b3 w0").
// The CUDA build uses the header-only nvtx3 shipped with CUDA (a no-op until a profiler injects itself); the CPU-only
// build compiles the ranges away.
#pragma once

#include <string>

#ifdef PYENGINE_WITH_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

namespace pyengine::store {

inline void nvtx_push(const std::string& name) {
#ifdef PYENGINE_WITH_CUDA
  nvtxRangePushA(name.c_str());
#else
  (void)name;
#endif
}

inline void nvtx_pop() {
#ifdef PYENGINE_WITH_CUDA
  nvtxRangePop();
#endif
}

// Pushes on construction, pops on destruction (also when the range is left by an exception).
class NvtxRange {
 public:
  explicit NvtxRange(const std::string& name) { nvtx_push(name); }
  ~NvtxRange() { nvtx_pop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace pyengine::store
