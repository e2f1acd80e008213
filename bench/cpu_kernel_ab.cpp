// Single-thread A/B timing of versions of the CPU update loop (csrc/cpu/kernel_isa.cpp), interleaved in one process.
//
// Built and run by bench/cpu_kernel_ab.py, which compiles each version of kernel_isa.cpp under its own label
// (-DPYENGINE_ISA=<label>, so each defines kernel_table_<label>()) and this file with
// -DPYENGINE_AB_VARIANTS="X(label_a, update) X(label_b, update_prefetch) ..." (the table's entry each version times).
// Why a separate harness: the VM's memory bandwidth moves by 2x
// from minute to minute, so versions are only comparable when they run round by round in the same process on the same
// buffers (A, B, copy, A, B, copy, ...; the order rotates every round) and are compared by their medians.
//
// Before timing, every version updates the same initial state once and must give the same bits as the first version
// (param, exp_avg, exp_avg_sq): a faster loop that changes the result is not a candidate.
//
//   cpu_kernel_ab N G DTYPE ROUNDS CHUNK [huge]   DTYPE: fp32 | bf16 | fp16;
//                                                CHUNK: elements per update() call (as kChunk);
//                                                huge: every version also runs on a second set of buffers
//                                                      madvise(MADV_HUGEPAGE)d (transparent huge pages), label /2M
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <random>
#include <sys/mman.h>
#include <string>
#include <vector>

#include "cpu/kernel.h"

#ifndef PYENGINE_AB_VARIANTS
#error "PYENGINE_AB_VARIANTS must list the versions, e.g. -DPYENGINE_AB_VARIANTS='X(base, update) X(pf, update_prefetch)'"
#endif

namespace pyengine::cpu {
#define X(label, entry) const KernelTable& kernel_table_##label();
PYENGINE_AB_VARIANTS
#undef X
}  // namespace pyengine::cpu

namespace {

using namespace pyengine::cpu;

using UpdateFn = void (*)(const TensorBuffers& t, const UpdateScalars& s, int64_t begin, int64_t end);

struct Variant {
  const char* label;
  UpdateFn update;
};

std::vector<Variant> variants() {
  std::vector<Variant> v;
#define X(label, entry) v.push_back({#label, kernel_table_##label().entry});
  PYENGINE_AB_VARIANTS
#undef X
  return v;
}

// std::allocator that asks for transparent huge pages (2 MiB) once g_huge is set, to measure what 4 KiB pages cost.
bool g_huge = false;

template <class T>
struct PageAllocator {
  using value_type = T;
  PageAllocator() = default;
  template <class U>
  PageAllocator(const PageAllocator<U>&) {}
  T* allocate(size_t k) {
    constexpr size_t kAlign = 2 << 20;
    const size_t bytes = (k * sizeof(T) + kAlign - 1) / kAlign * kAlign;
    void* p = std::aligned_alloc(kAlign, bytes);
    if (p == nullptr) throw std::bad_alloc();
    if (g_huge) madvise(p, bytes, MADV_HUGEPAGE);
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  bool operator==(const PageAllocator&) const { return true; }
};
template <class T>
using Buffer = std::vector<T, PageAllocator<T>>;

uint16_t to_fp16(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
}

uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Every buffer of one case, allocated and touched once; all versions run on these same buffers.
struct Case {
  int64_t n;
  int G;
  Dtype dtype;
  Buffer<float> param, m, v, param0, m0, v0;
  std::vector<Buffer<float>> grads32;
  std::vector<Buffer<uint16_t>> grads16;
  std::vector<GradSource> sources;
  UpdateScalars s{};

  Case(int64_t n_, int G_, Dtype dtype_) : n(n_), G(G_), dtype(dtype_) {
    std::mt19937 gen(std::random_device{}());
    std::normal_distribution<float> normal;
    auto randn = [&](int64_t k) {
      Buffer<float> x(k);
      for (float& e : x) e = normal(gen);
      return x;
    };
    param0 = randn(n);
    m0 = randn(n);
    v0 = randn(n);
    for (float& e : v0) e = e * e;
    for (int k = 0; k < G; ++k) {
      Buffer<float> g = randn(n);
      if (dtype == Dtype::kFloat32) {
        grads32.push_back(std::move(g));
      } else {
        Buffer<uint16_t> h(n);
        for (int64_t j = 0; j < n; ++j) h[j] = dtype == Dtype::kBFloat16 ? to_bf16(g[j]) : to_fp16(g[j]);
        grads16.push_back(std::move(h));
      }
    }
    for (int k = 0; k < G; ++k) {
      const void* data = dtype == Dtype::kFloat32 ? static_cast<const void*>(grads32[k].data())
                                                  : static_cast<const void*>(grads16[k].data());
      sources.push_back({data, dtype, 1.0f});
    }
    reset();
    s.lr = 1e-3f;
    s.beta1 = 0.9f;
    s.beta2 = 0.999f;
    s.one_minus_beta1 = static_cast<float>(1.0 - 0.9);
    s.one_minus_beta2 = static_cast<float>(1.0 - 0.999);
    s.eps = 1e-8f;
    s.weight_decay = 1e-2f;
    s.step_size = static_cast<float>(1e-3 / (1.0 - 0.9 * 0.9 * 0.9));
    s.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - 0.999 * 0.999 * 0.999));
    s.decay = 1.0f - 1e-3f * 1e-2f;
    s.grad_mult = 1.0f / static_cast<float>(G);
    s.adamw = true;
  }

  void reset() {
    param = param0;
    m = m0;
    v = v0;
  }

  TensorBuffers buffers() {
    return {param.data(), m.data(), v.data(), nullptr, nullptr, Dtype::kFloat32, sources.data(), G, n};
  }

  // One update of all n elements in chunks of `chunk`, as update_cpu does on one thread.
  void update(UpdateFn fn, int64_t chunk) {
    const TensorBuffers t = buffers();
    for (int64_t b = 0; b < n; b += chunk) fn(t, s, b, std::min(n, b + chunk));
  }

  int64_t bytes() const {
    const int64_t grad_bytes = dtype == Dtype::kFloat32 ? 4 : 2;
    return n * (grad_bytes * G + 24);
  }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const size_t k = x.size();
  return k % 2 ? x[k / 2] : 0.5 * (x[k / 2 - 1] + x[k / 2]);
}

// Every version must reproduce the first version's bits from the same initial state (unless PYENGINE_AB_NO_CHECK is
// set, for diagnostic variants that leave out part of the work on purpose).
bool check_identical(Case& c, const std::vector<Variant>& vs, int64_t chunk) {
  c.update(vs[0].update, chunk);
  const Buffer<float> p = c.param, m = c.m, v = c.v;
  bool ok = true;
  for (size_t i = 1; i < vs.size(); ++i) {
    c.reset();
    c.update(vs[i].update, chunk);
    const bool same = std::memcmp(p.data(), c.param.data(), c.n * 4) == 0 &&
                      std::memcmp(m.data(), c.m.data(), c.n * 4) == 0 &&
                      std::memcmp(v.data(), c.v.data(), c.n * 4) == 0;
    if (!same) std::printf("MISMATCH: %s differs from %s\n", vs[i].label, vs[0].label);
    ok = ok && same;
  }
  c.reset();
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6 && !(argc == 7 && std::string(argv[6]) == "huge")) {
    std::fprintf(stderr, "usage: %s N G fp32|bf16|fp16 ROUNDS CHUNK [huge]\n", argv[0]);
    return 2;
  }
  const int64_t n = std::atoll(argv[1]);
  const int G = std::atoi(argv[2]);
  const std::string dt = argv[3];
  const int rounds = std::atoi(argv[4]);
  const int64_t chunk = std::atoll(argv[5]);
  if (n <= 0 || G <= 0 || rounds <= 0 || chunk <= 0 || (dt != "fp32" && dt != "bf16" && dt != "fp16")) {
    std::fprintf(stderr, "bad arguments: N, G, ROUNDS, CHUNK must be > 0 and DTYPE fp32, bf16 or fp16\n");
    return 2;
  }
  // One set of buffers on 4 KiB pages; with "huge", a second set on transparent huge pages, and every version runs
  // on both (labels ending in /2M), so the cost of 4 KiB pages is measured in the same rounds.
  const Dtype dtype = dt == "fp32" ? Dtype::kFloat32 : dt == "bf16" ? Dtype::kBFloat16 : Dtype::kFloat16;
  std::vector<Case> cases;
  cases.reserve(2);
  cases.emplace_back(n, G, dtype);
  if (argc == 7) {
    g_huge = true;
    cases.emplace_back(n, G, dtype);
  }
  const std::vector<Variant> vs = variants();
  for (Case& c : cases) {
    if (std::getenv("PYENGINE_AB_NO_CHECK") == nullptr && !check_identical(c, vs, chunk)) return 1;
  }

  Buffer<float> copy_src(cases[0].param0), copy_dst(n);
  const size_t k = vs.size() * cases.size();  // slot i: version i % vs.size() on cases[i / vs.size()]
  std::vector<std::vector<double>> times(k + 1);  // the last slot: the copy
  for (int r = -1; r < rounds; ++r) {              // round -1 warms up
    for (size_t i = 0; i <= k; ++i) {
      const size_t j = (i + static_cast<size_t>(r + 1)) % (k + 1);
      const auto t0 = std::chrono::steady_clock::now();
      if (j < k) {
        cases[j / vs.size()].update(vs[j % vs.size()].update, chunk);
      } else {
        std::memcpy(copy_dst.data(), copy_src.data(), n * sizeof(float));
      }
      if (r >= 0) times[j].push_back(seconds_since(t0));
    }
  }
  const double copy_s = median(times[k]);
  std::printf("N=%lld G=%d %s rounds=%d chunk=%lld  copy %.2f ms = %.1f GB/s (read+write)\n",
              static_cast<long long>(n), G, dt.c_str(), rounds, static_cast<long long>(chunk), copy_s * 1e3,
              8.0 * n / copy_s / 1e9);
  const double base = median(times[0]);
  for (size_t i = 0; i < k; ++i) {
    const double t = median(times[i]);
    const double lo = *std::min_element(times[i].begin(), times[i].end());
    std::vector<double> paired(times[i].size());  // same-round ratios: robust to the bandwidth drifting
    for (size_t r = 0; r < paired.size(); ++r) paired[r] = times[0][r] / times[i][r];
    const std::string label = std::string(vs[i % vs.size()].label) + (i >= vs.size() ? "/2M" : "");
    std::printf("  %-14s median %8.2f ms  min %8.2f ms  %6.1f GB/s  speed vs %s: %5.3fx (medians) %5.3fx (paired)\n",
                label.c_str(), t * 1e3, lo * 1e3, cases[0].bytes() / t / 1e9, vs[0].label, base / t,
                median(paired));
  }
  return 0;
}
