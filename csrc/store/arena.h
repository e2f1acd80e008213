// The host store's arena: one block of host memory, allocated once at its exact size and handed out as a uint8
// tensor whose storage owns the block. Every view of the store is a view of that storage, so tensors handed out keep
// the memory alive after the Python HostStore object is gone (no use-after-free by construction).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>

namespace pyengine::store {

// Allocates nbytes of zeroed host memory.
// pinned=false: anonymous memory, 2 MiB-aligned, with transparent huge pages advised and every page touched in
// parallel now, so the first step pays no page faults.
// pinned=true (CUDA build and a usable device only, else a clear error that says how many bytes were asked and that
// pin=False is the fallback): with huge_pages, that same memory page-locked with cudaHostRegister, so the host's
// update streams it on 2 MiB pages (cudaHostAlloc's memory has 4 KiB pages, which cost the CPU update 7-18 %,
// bench/RESULTS.md); where the registration fails, or without huge_pages, cudaHostAlloc.
// Not torch's caching pinned allocator: it rounds large blocks up to a power of two.
at::Tensor allocate_arena(int64_t nbytes, bool pinned, bool huge_pages = true);

// True when the pinned path can be taken: a CUDA build and at least one visible device.
bool pinned_allocation_available();

#ifdef PYENGINE_WITH_CUDA
// Implemented in cuda/pinned_host.cpp, the only place that calls the CUDA runtime for host memory.
void* pinned_host_alloc(size_t nbytes);  // throws c10::Error with the size and the pin=False fallback
void pinned_host_free(void* ptr) noexcept;
bool pinned_host_register(void* base, size_t nbytes) noexcept;  // page-locks existing memory; false if it cannot
void pinned_host_unregister(void* base) noexcept;
bool cuda_device_usable() noexcept;
#endif

}  // namespace pyengine::store
