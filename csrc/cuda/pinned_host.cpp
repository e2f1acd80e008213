// Page-locked host memory for the host store's arena (store/arena.h), straight from cudaHostAlloc: the block has the
// exact size asked for, unlike torch's caching pinned allocator, which rounds large blocks up to a power of two.
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include "../store/arena.h"

namespace pyengine::store {

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
  if (cudaFreeHost(ptr) != cudaSuccess) cudaGetLastError();  // a deleter cannot raise: no error left for a later check
}

bool pinned_host_register(void* base, size_t nbytes) noexcept {
  if (!cuda_device_usable()) return false;
  // Portable, as cudaHostAllocPortable: the registration is valid in every CUDA context.
  const bool ok = cudaHostRegister(base, nbytes, cudaHostRegisterPortable) == cudaSuccess;
  if (!ok) cudaGetLastError();  // the caller falls back to cudaHostAlloc: no sticky error for its next call
  return ok;
}

void pinned_host_unregister(void* base) noexcept {
  if (cudaHostUnregister(base) != cudaSuccess) cudaGetLastError();
}

}  // namespace pyengine::store
