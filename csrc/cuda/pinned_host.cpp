// Page-locked host memory for the host store's arena (store/arena.h), straight from cudaHostAlloc: the block has the
// exact size asked for, unlike torch's caching pinned allocator, which rounds large blocks up to a power of two.
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include "../store/arena.h"

namespace pyengine::store {
namespace {

// Note [Pinning under a context that exists]
// cudaHostAlloc, cudaHostRegister and their frees run in a CUDA context, and the runtime makes the current device's
// primary context when it has none: the engine builds its store before a worker touches its GPU, and the current
// device is 0 unless the caller set another, so a process driving cuda:r alone (one rank per GPU under torchrun)
// paid for a context on GPU 0 too (hundreds of MiB of that GPU's memory, per process). As torch's own pinned
// allocator does, these calls run on a device that already has a context when there is one (the pinning is
// Portable: valid in every context); the engine makes its first worker's device current for the store's allocation.
// Moving to it cannot fail the call: when the probe or the move fails, the call runs on the current device as
// before.
void use_existing_context(c10::cuda::OptionalCUDAGuard& guard) noexcept {
  try {
    if (const auto index = c10::cuda::getDeviceIndexWithPrimaryContext()) guard.set_index(*index);
  } catch (...) {
    cudaGetLastError();  // no error left for the next CUDA call
  }
}

}  // namespace

bool cuda_device_usable() noexcept {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) cudaGetLastError();  // a failed probe leaves no error for the next CUDA call (and a
  return err == cudaSuccess && count > 0;      // successful one clears no one else's)
}

void* pinned_host_alloc(size_t nbytes) {
  TORCH_CHECK(cuda_device_usable(), "HostStore: pin=True asks for ", nbytes,
              " bytes of pinned (page-locked) memory, but no CUDA device is usable; pass pin=False for pageable "
              "memory (or pin=\"auto\")");
  c10::cuda::OptionalCUDAGuard guard;  // Note [Pinning under a context that exists]
  use_existing_context(guard);
  void* ptr = nullptr;
  // Portable: the pinning is valid in every CUDA context, so workers on several GPUs share one arena.
  const cudaError_t err = cudaHostAlloc(&ptr, nbytes, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();
    TORCH_CHECK(false, "HostStore: cudaHostAlloc of ", nbytes, " bytes (", nbytes >> 20,
                " MiB) of pinned memory failed: ", cudaGetErrorString(err),
                ". Pinned memory cannot be swapped and is limited by host RAM and ulimit -l; pass pin=False for "
                "pageable memory, or lower max_bytes / the model size");
  }
  return ptr;
}

void pinned_host_free(void* ptr) noexcept {
  c10::cuda::OptionalCUDAGuard guard;  // Note [Pinning under a context that exists]
  use_existing_context(guard);
  if (cudaFreeHost(ptr) != cudaSuccess) cudaGetLastError();  // a deleter cannot raise: no error left for a later check
}

bool pinned_host_register(void* base, size_t nbytes) noexcept {
  if (!cuda_device_usable()) return false;
  c10::cuda::OptionalCUDAGuard guard;  // Note [Pinning under a context that exists]
  use_existing_context(guard);
  // Portable, as cudaHostAllocPortable: the registration is valid in every CUDA context.
  const bool ok = cudaHostRegister(base, nbytes, cudaHostRegisterPortable) == cudaSuccess;
  if (!ok) cudaGetLastError();  // the caller falls back to cudaHostAlloc: no sticky error for its next call
  return ok;
}

void pinned_host_unregister(void* base) noexcept {
  c10::cuda::OptionalCUDAGuard guard;  // Note [Pinning under a context that exists]
  use_existing_context(guard);
  if (cudaHostUnregister(base) != cudaSuccess) cudaGetLastError();
}

}  // namespace pyengine::store
