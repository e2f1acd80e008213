// Host arena allocation (see arena.h): pinned through cuda/pinned_host.cpp, or mmap'd, THP-advised and pre-faulted.
#include "arena.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
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

size_t mapped_bytes(size_t nbytes) { return round_up(std::max<size_t>(nbytes, 1), page_size()); }

// munmap needs the mapping's length, which the deleter's context carries.
struct Mapping {
  void* base;
  size_t length;
};

// A 1-D uint8 tensor over the whole block; its storage owns the block through data's deleter.
at::Tensor byte_tensor(at::DataPtr data, int64_t nbytes) {
  at::Storage storage(at::Storage::use_byte_size_t(), nbytes, std::move(data), /*allocator=*/nullptr,
                      /*resizable=*/false);
  return at::empty({0}, at::TensorOptions().dtype(at::kByte)).set_(storage, 0, {nbytes}, {1});
}

void unmap(void* ctx) {
  auto* mapping = static_cast<Mapping*>(ctx);
  munmap(mapping->base, mapping->length);
  delete mapping;
}

at::Tensor allocate_unpinned(int64_t nbytes) {
  const size_t length = mapped_bytes(static_cast<size_t>(nbytes));
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(base != MAP_FAILED, "HostStore: could not allocate ", nbytes, " bytes of host memory (mmap: ",
              std::strerror(errno), ")");
#ifdef MADV_HUGEPAGE
  madvise(base, length, MADV_HUGEPAGE);  // advice only: THP may be disabled, which is not an error
#endif
  touch_pages(base, length, /*zero_fill=*/false);  // anonymous pages are already zero
  auto* mapping = new Mapping{base, length};
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

at::Tensor allocate_arena(int64_t nbytes, bool pinned) {
  TORCH_CHECK_VALUE(nbytes >= 0, "HostStore: arena size must be >= 0 bytes; got ", nbytes);
  if (!pinned) return allocate_unpinned(nbytes);
#ifdef PYENGINE_WITH_CUDA
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
