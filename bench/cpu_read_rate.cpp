// How fast one core reads memory, by the shape of the loop: the ceiling of the CPU update.
//
// The fused update and the stock path both stream buffers far larger than the caches. On one core the time of such
// loops follows the bytes *read* (a line written after it was read is written back at little extra cost; a line
// written without being read first costs a read for ownership). This program measures that read rate for the loop
// shapes the two paths use: k streams read side by side, read-modify-write streams, `d += a`, and a copy whose
// destination is not in cache. Interleaved rounds, medians; buffers 2 MiB-aligned, on 4 KiB pages or (with `huge`)
// madvise(MADV_HUGEPAGE)d.
//
//   g++ -O3 -std=c++20 -mavx512f -mavx512vl -mfma -fno-trapping-math -fassociative-math -fno-signed-zeros \
//       bench/cpu_read_rate.cpp -o /tmp/cpu_read_rate && /tmp/cpu_read_rate && /tmp/cpu_read_rate huge
//
//   cpu_read_rate [4k|huge] [MIB]   MIB: size of each of the 8 buffers (default 128; the tests use a small one)
//
// (-fassociative-math lets gcc vectorise the sums; the values are not used.)
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

size_t kN = size_t{32} << 20;  // floats per buffer: 128 MiB by default, as the N = 32M rows of bench_fused_adamw.py
constexpr size_t kAlign = size_t{2} << 20;

float* alloc(bool huge) {
  const size_t bytes = kN * 4;
  void* raw = mmap(nullptr, bytes + kAlign, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  float* p = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(raw) + kAlign - 1) & ~(kAlign - 1));
  if (huge) madvise(p, bytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < kN; ++i) p[i] = 1e-3f * static_cast<float>(i % 1000);
  return p;
}

__attribute__((noinline)) float read_tiled(float* const* s, int k, size_t tile) {
  float acc[16] = {};
  for (size_t t = 0; t < kN; t += tile) {
    for (int q = 0; q < k; ++q) {
      const float* __restrict a = s[q] + t;
      for (size_t j = 0; j < tile; j += 16)
        for (int l = 0; l < 16; ++l) acc[l] += a[j + l];
    }
  }
  float r = 0;
  for (float x : acc) r += x;
  return r;
}

__attribute__((noinline)) float read_side_by_side(float* const* s, int k) {
  float acc[16] = {};
  for (size_t j = 0; j < kN; j += 16)
    for (int q = 0; q < k; ++q)
      for (int l = 0; l < 16; ++l) acc[l] += s[q][j + l];
  float r = 0;
  for (float x : acc) r += x;
  return r;
}

__attribute__((noinline)) void rmw1(float* __restrict a) {
  for (size_t j = 0; j < kN; ++j) a[j] = a[j] * 0.999f + 1e-6f;
}

__attribute__((noinline)) void rmw3(float* __restrict a, float* __restrict b, float* __restrict c) {
  for (size_t j = 0; j < kN; ++j) {
    a[j] = a[j] * 0.999f + 1e-6f;
    b[j] = b[j] * 0.999f + 1e-6f;
    c[j] = c[j] * 0.999f + a[j];
  }
}

__attribute__((noinline)) void add_to(float* __restrict d, const float* __restrict a) {
  for (size_t j = 0; j < kN; ++j) d[j] += a[j];
}

__attribute__((noinline)) void copy_scaled(float* __restrict d, const float* __restrict a) {
  for (size_t j = 0; j < kN; ++j) d[j] = a[j] * 1.0f;  // a plain store loop, not memcpy (which may stream)
}

}  // namespace

int main(int argc, char** argv) {
  const bool huge = argc > 1 && std::string(argv[1]) == "huge";
  if ((argc > 1 && !huge && std::string(argv[1]) != "4k") || argc > 3 || (argc == 3 && std::atol(argv[2]) <= 0)) {
    std::fprintf(stderr, "usage: %s [4k|huge] [MiB per buffer, > 0]\n", argv[0]);
    return 2;
  }
  if (argc == 3) kN = static_cast<size_t>(std::atol(argv[2])) << 18;  // MiB -> floats; a multiple of the 4 KiB tile
  std::vector<float*> s;
  for (int i = 0; i < 8; ++i) s.push_back(alloc(huge));
  volatile float sink = 0;
  struct Job {
    const char* name;
    int reads;  // buffers of kN floats read (a store to a line not in cache counts as a read)
    std::function<void()> run;
    std::vector<double> times;
  };
  std::vector<Job> jobs = {
      {"read 1 stream", 1, [&] { sink = sink + read_tiled(s.data(), 1, kN); }, {}},
      {"read 4 streams, 4 KiB tiles", 4, [&] { sink = sink + read_tiled(s.data(), 4, 1024); }, {}},
      {"read 4 streams side by side", 4, [&] { sink = sink + read_side_by_side(s.data(), 4); }, {}},
      {"read 7 streams side by side", 7, [&] { sink = sink + read_side_by_side(s.data(), 7); }, {}},
      {"read-modify-write 1 stream", 1, [&] { rmw1(s[5]); }, {}},
      {"read-modify-write 3 streams", 3, [&] { rmw3(s[5], s[6], s[7]); }, {}},
      {"d += a", 2, [&] { add_to(s[0], s[1]); }, {}},
      {"d = a, d not in cache", 2, [&] { copy_scaled(s[2], s[3]); }, {}},
  };
  const int rounds = 7;
  for (int r = -1; r < rounds; ++r) {  // round -1 warms up; the order rotates every round
    for (size_t i = 0; i < jobs.size(); ++i) {
      Job& job = jobs[(i + static_cast<size_t>(r + 1)) % jobs.size()];
      const auto t0 = std::chrono::steady_clock::now();
      job.run();
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r >= 0) job.times.push_back(dt);
    }
  }
  std::printf("one thread, buffers of %zu MiB, %s pages, median of %d rounds\n", kN * 4 >> 20,
              huge ? "2 MiB (THP)" : "4 KiB", rounds);
  for (Job& job : jobs) {
    std::sort(job.times.begin(), job.times.end());
    const double t = job.times[job.times.size() / 2];
    std::printf("  %-30s %7.2f ms   read rate %5.1f GB/s\n", job.name, t * 1e3, job.reads * kN * 4.0 / t / 1e9);
  }
  return 0;
}
