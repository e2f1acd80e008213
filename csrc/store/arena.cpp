// Host arena allocation (see arena.h): pinned through cuda/pinned_host.cpp, or mmap'd, THP-advised and pre-faulted.
#include "arena.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

namespace pyengine::store {
namespace {

size_t page_size() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Writes one byte per page from several threads: a page fault costs ~20x filling the page, and faulting serially
// on first use would put that cost into the first training step.
void touch_pages(void* base, size_t nbytes, bool zero_fill) {
  auto* bytes = static_cast<unsigned char*>(base);
  const int64_t page = static_cast<int64_t>(page_size());
  const int64_t pages = static_cast<int64_t>((nbytes + page - 1) / page);
  at::parallel_for(0, pages, /*grain_size=*/256, [&](int64_t begin, int64_t end) {
    if (zero_fill) {
      const size_t first = static_cast<size_t>(begin * page);
      const size_t last = std::min(nbytes, static_cast<size_t>(end * page));
      std::memset(bytes + first, 0, last - first);
      return;
    }
    for (int64_t p = begin; p < end; ++p) reinterpret_cast<volatile unsigned char*>(bytes)[p * page] = 0;
  });
}

constexpr size_t kHugePage = size_t{2} << 20;

size_t mapped_bytes(size_t nbytes) { return round_up(std::max<size_t>(nbytes, 1), page_size()); }

// munmap (and cudaHostUnregister) need the mapping, which the deleter's context carries.
struct Mapping {
  void* base;
  size_t length;
  bool registered = false;  // page-locked with cudaHostRegister
};

// Anonymous memory of `length` bytes starting on a 2 MiB boundary (transparent huge pages cover only whole aligned
// 2 MiB ranges), THP advised, every page faulted in now; anonymous pages are already zero.
void* map_huge(size_t length) {
  const size_t padded = length + kHugePage;
  void* raw = mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(raw != MAP_FAILED, "HostStore: could not allocate ", length, " bytes of host memory (mmap: ",
              std::strerror(errno), ")");
  const auto start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = round_up(start, kHugePage);
  if (aligned > start) munmap(raw, aligned - start);  // the unaligned head and the unused tail go back
  const uintptr_t end = aligned + length, raw_end = start + padded;
  if (raw_end > end) munmap(reinterpret_cast<void*>(end), raw_end - end);
  void* base = reinterpret_cast<void*>(aligned);
#ifdef MADV_HUGEPAGE
  madvise(base, length, MADV_HUGEPAGE);  // advice only: THP may be disabled, which is not an error
#endif
  touch_pages(base, length, /*zero_fill=*/false);
  return base;
}

// A 1-D uint8 tensor over the whole block; its storage owns the block through data's deleter.
at::Tensor byte_tensor(at::DataPtr data, int64_t nbytes) {
  at::Storage storage(at::Storage::use_byte_size_t(), nbytes, std::move(data), /*allocator=*/nullptr,
                      /*resizable=*/false);
  return at::empty({0}, at::TensorOptions().dtype(at::kByte)).set_(storage, 0, {nbytes}, {1});
}

void unmap(void* ctx) {
  auto* mapping = static_cast<Mapping*>(ctx);
#ifdef PYENGINE_WITH_CUDA
  if (mapping->registered) pinned_host_unregister(mapping->base);
#endif
  munmap(mapping->base, mapping->length);
  delete mapping;
}

// THP-backed memory, page-locked when `pin` (nullptr if the registration failed: the caller falls back).
at::Tensor allocate_mapped(int64_t nbytes, bool pin) {
  const size_t length = mapped_bytes(static_cast<size_t>(nbytes));
  void* base = map_huge(length);
  auto* mapping = new Mapping{base, length};
#ifdef PYENGINE_WITH_CUDA
  if (pin) {
    mapping->registered = pinned_host_register(base, length);
    if (!mapping->registered) {
      unmap(mapping);
      return at::Tensor();
    }
  }
#else
  TORCH_INTERNAL_ASSERT(!pin);
#endif
  at::DataPtr data(base, mapping, &unmap, at::Device(at::kCPU));
  return byte_tensor(std::move(data), nbytes);
}

}  // namespace

bool pinned_allocation_available() {
#ifdef PYENGINE_WITH_CUDA
  return cuda_device_usable();
#else
  return false;
#endif
}

at::Tensor allocate_arena(int64_t nbytes, bool pinned, bool huge_pages) {
  TORCH_CHECK_VALUE(nbytes >= 0, "HostStore: arena size must be >= 0 bytes; got ", nbytes);
  if (!pinned) return allocate_mapped(nbytes, /*pin=*/false);
#ifdef PYENGINE_WITH_CUDA
  if (huge_pages && cuda_device_usable()) {
    at::Tensor arena = allocate_mapped(nbytes, /*pin=*/true);
    if (arena.defined()) return arena;
  }
  void* ptr = pinned_host_alloc(static_cast<size_t>(std::max<int64_t>(nbytes, 1)));
  touch_pages(ptr, static_cast<size_t>(nbytes), /*zero_fill=*/true);  // cudaHostAlloc does not zero
  at::DataPtr data(ptr, ptr, &pinned_host_free, at::Device(at::kCPU));
  return byte_tensor(std::move(data), nbytes);
#else
  TORCH_CHECK(false, "HostStore: pin=True asks for ", nbytes,
              " bytes of pinned (page-locked) memory, but pyengine was built without CUDA; pass pin=False for "
              "pageable memory");
#endif
}

}  // namespace pyengine::store
