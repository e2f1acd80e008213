// The fused mean-gradient AdamW loops, compiled once per instruction set.
//
// This file is compiled three times (setup.py / CMakeLists.txt) with PYENGINE_ISA set to avx512, avx2 or default and
// the matching -m flags; each copy defines kernel_table_<isa>(). The loops are plain C++ over __restrict pointers that
// gcc vectorises (checked in the disassembly: zmm for avx512, ymm for avx2); fp16 conversion uses F16C intrinsics
// because gcc does not vectorise _Float16 casts. Everything is compiled with -ffp-contract=off: without FMA
// contraction the vector and scalar paths round identically, so all three ISAs give bit-identical results.
//
// Shape of one update, per tile of kTile elements:
//   1. acc[j]  = w_0 * g_0[j];  acc[j] += w_k * g_k[j] for k = 1..G-1   (fixed order: bit-reproducible)
//      Consecutive fp32 gradients are added in groups of up to 4 (8 in the prefetching form: kMaxGroup) in one loop
//      (acc[j] = (((acc[j] + x_k) + x_k+1) + ...), the same operations in the same order, so the same bits): acc is
//      loaded and stored once per group, not once per gradient, and a few gradient streams are read side by side.
//      Measured 1.05-1.09x at G=4 and 1.10-1.25x at G=8 on one thread (bench/cpu_kernel_ab.py, bench/RESULTS.md).
//      Fusing the gradients into the Adam loop as well (7-10 streams in one loop) measured 0.7x: the Adam loop is
//      best left with its 3+3 streams.
//   2. Adam loop over the tile, reading acc from L1 and param/m/v from memory, writing param/m/v (+ param_out).
// So the G gradients and the state are each read once from memory: 4N(G+6) bytes with fp32 gradients.
// Tiles are kTile elements (acc in L1), or kLongTile (acc in L2) when more than kMaxGroup fp32 gradients make the sum
// take two or more passes over acc: each pass then reads a longer run of every stream (kernel.h has the measurements).
// Each loop also comes in a software-prefetching form (kPrefetch, KernelTable::update_prefetch): see
// Note [Prefetching the streams] below.
#include "kernel.h"

#include <cstring>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#ifndef PYENGINE_ISA
#error "PYENGINE_ISA must be defined (avx512, avx2 or default)"
#endif
#define PYENGINE_CONCAT_(a, b) a##b
#define PYENGINE_CONCAT(a, b) PYENGINE_CONCAT_(a, b)
#define PYENGINE_STR_(a) #a
#define PYENGINE_STR(a) PYENGINE_STR_(a)

namespace pyengine::cpu {
namespace {

// No std:: templates in this file: their out-of-line copies are weak symbols that the linker could take from the
// AVX-512 object for a caller running on an older CPU. Builtins and internal-linkage helpers only.
inline int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

// Note [Prefetching the streams]
// The hardware prefetchers of some cores (Intel's L2 streamer among them) follow a stream within one 4 KiB page
// only, and restart at every page; the tiles above end a run of every stream at least once a page. The prefetching
// form of the loops walks each tile in blocks of kPrefetchBlock elements and, before each block, hints the lines
// kPrefetchAhead elements further on in every memory stream (the fp32 gradients, param/m/v for writing, and the
// gradient itself when Adam reads it straight from memory), so each stream is requested ahead across page edges too.
// Measured on one core (bench/cpu_kernel_ab.py, bench/RESULTS.md, 2026-11-27): Intel Xeon (Emerald Rapids) 1.05-1.15x
// at G = 4, 1.03-1.06x at G = 8, 1.03-1.16x at G = 1 (1 KiB ahead; 0.5-2 KiB measured alike). On AMD Zen 5 this form
// measured 0.78-0.80x at G = 4 and 8 and 1.00x at G = 1 (2026-11-28; without the hints, blocks only, 0.94x at G = 4:
// the hints themselves cost there), and an earlier hint (the first lines of every stream's next page, once per tile)
// 0.68-0.87x, so the form is chosen at run time: on for Intel CPUs, off elsewhere, PYENGINE_CPU_PREFETCH=0|1 to
// override (prefetch_streams() in isa.h).
// The same form sums up to 8 fp32 gradients in one pass (kMaxGroup), measured on the Xeon 1.05-1.08x at G = 8 and
// 1.09-1.10x at G = 5 and 6 against two passes of up to 4. Neither changes a result: the bits are those of the
// plain loops (tests/cpp/test_kernels.cpp, tests/test_ops.py).
constexpr int64_t kPrefetchBlock = 64;   // elements per block: 4 cache lines of each stream
constexpr int64_t kPrefetchAhead = 256;  // elements (1 KiB) between a block and the lines hinted before it

// Hints the kPrefetchBlock elements that start kPrefetchAhead elements after x (kWrite: to be written). A prefetch
// never faults, so hinting past the end of a buffer is harmless; the address is formed as an integer, not as an
// out-of-bounds pointer.
template <int kWrite, class T>
inline void prefetch_ahead(const T* x) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(x) + kPrefetchAhead * sizeof(T);
  for (int64_t line = 0; line < kPrefetchBlock * static_cast<int64_t>(sizeof(T)); line += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(first + line), kWrite);
  }
}

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, NaN kept a (quiet) NaN: the same rounding as torch's float -> bfloat16 cast.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return __builtin_isnan(f) ? static_cast<uint16_t>(0x7fc0u) : static_cast<uint16_t>(rounded);
}

// fp16 -> fp32 for n elements into out (F16C/AVX-512 when compiled for them, a scalar tail otherwise).
void widen_fp16(const uint16_t* __restrict in, float* __restrict out, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + j));
    _mm512_storeu_ps(out + j, _mm512_cvtph_ps(h));
  }
#elif defined(__F16C__)
  for (; j + 8 <= n; j += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + j));
    _mm256_storeu_ps(out + j, _mm256_cvtph_ps(h));
  }
#endif
  for (; j < n; ++j) {
    _Float16 h;
    std::memcpy(&h, in + j, sizeof h);
    out[j] = static_cast<float>(h);
  }
}

// fp32 -> fp16, round to nearest even (the F16C instruction and the _Float16 cast both do).
void narrow_fp16(const float* __restrict in, uint16_t* __restrict out, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(in + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), h);
  }
#elif defined(__F16C__)
  for (; j + 8 <= n; j += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), h);
  }
#endif
  for (; j < n; ++j) {
    _Float16 h = static_cast<_Float16>(in[j]);
    std::memcpy(out + j, &h, sizeof h);
  }
}

// A gradient element as a float: fp32 as stored, bf16 widened (exactly: its bits are a float's top half). fp16 is
// widened a block at a time by widen_fp16 instead (kStaged): GCC does not vectorize a _Float16 -> float cast.
inline float load_grad(const float* __restrict g, int64_t j) { return g[j]; }
inline float load_grad(const uint16_t* __restrict g, int64_t j) { return bf16_to_float(g[j]); }

template <class T>
constexpr bool kStaged = false;  // widened into an L1 block before the sum (fp16)
template <>
constexpr bool kStaged<_Float16> = true;

// acc[j0..j1) (=|+=) the R (1..8) gradients g0..g(R-1) of one storage type T (fp32: float, bf16: uint16_t; weights
// w[0..R)) in one pass, in list order: acc = (((acc + w0 g0) + w1 g1) + ...) + w(R-1) g(R-1), each
// product rounded, then each sum: the bits of adding one gradient at a time, however the list is cut into runs.
// acc is read and written once per run, not R times. Pointers past R are unused. Returns the largest exponent field
// (bits & 0x7f800000) of the sums it wrote (kCheck, the last pass; else 0): all ones when one of them is not finite
// (Note [A finite mean whose float32 sum overflows]).
template <bool kFirst, bool kCheck, int R, class T>
inline uint32_t accumulate_range(const T* __restrict g0, const T* __restrict g1, const T* __restrict g2,
                                 const T* __restrict g3, const T* __restrict g4, const T* __restrict g5,
                                 const T* __restrict g6, const T* __restrict g7, const float* w,
                                 float* __restrict acc, int64_t j0, int64_t j1) {
  const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3], w4 = w[4], w5 = w[5], w6 = w[6], w7 = w[7];
  uint32_t top = 0;
  for (int64_t j = j0; j < j1; ++j) {
    float x = kFirst ? load_grad(g0, j) * w0 : acc[j] + load_grad(g0, j) * w0;
    if constexpr (R > 1) x = x + load_grad(g1, j) * w1;
    if constexpr (R > 2) x = x + load_grad(g2, j) * w2;
    if constexpr (R > 3) x = x + load_grad(g3, j) * w3;
    if constexpr (R > 4) x = x + load_grad(g4, j) * w4;
    if constexpr (R > 5) x = x + load_grad(g5, j) * w5;
    if constexpr (R > 6) x = x + load_grad(g6, j) * w6;
    if constexpr (R > 7) x = x + load_grad(g7, j) * w7;
    acc[j] = x;
    if constexpr (kCheck) {
      uint32_t bits;
      std::memcpy(&bits, &x, sizeof bits);
      const uint32_t e = bits & 0x7f800000u;
      top = top > e ? top : e;
    }
  }
  return top;
}

inline uint32_t max_u32(uint32_t a, uint32_t b) { return a > b ? a : b; }

template <bool kFirst, bool kCheck, int R, bool kPrefetch, class T>
uint32_t accumulate_run(const GradSource* g, int64_t begin, int64_t n, float* __restrict acc) {
  const T* src[8];
  float w[8];
  for (int k = 0; k < 8; ++k) {
    const int i = k < R ? k : 0;
    src[k] = static_cast<const T*>(g[i].data) + begin;
    w[k] = g[i].weight;
  }
  if constexpr (kStaged<T>) {  // each stream's block widened into L1 (exactly), then summed as fp32
    alignas(64) float stage[R][kPrefetchBlock];
    const float* staged[8];
    for (int k = 0; k < 8; ++k) staged[k] = stage[k < R ? k : 0];
    uint32_t top = 0;
    for (int64_t j = 0; j < n; j += kPrefetchBlock) {
      const int64_t m = min_i64(kPrefetchBlock, n - j);
      for (int k = 0; k < R; ++k) {
        if constexpr (kPrefetch) prefetch_ahead<0>(src[k] + j);
        widen_fp16(reinterpret_cast<const uint16_t*>(src[k] + j), stage[k], m);
      }
      top = max_u32(top, accumulate_range<kFirst, kCheck, R>(staged[0], staged[1], staged[2], staged[3], staged[4],
                                                             staged[5], staged[6], staged[7], w, acc + j, 0, m));
    }
    return top;
  } else if constexpr (!kPrefetch) {
    return accumulate_range<kFirst, kCheck, R>(src[0], src[1], src[2], src[3], src[4], src[5], src[6], src[7], w, acc,
                                               0, n);
  } else {
    uint32_t top = 0;
    for (int64_t j = 0; j < n; j += kPrefetchBlock) {
      for (int k = 0; k < R; ++k) prefetch_ahead<0>(src[k] + j);
      top = max_u32(top, accumulate_range<kFirst, kCheck, R>(src[0], src[1], src[2], src[3], src[4], src[5], src[6],
                                                             src[7], w, acc, j, min_i64(j + kPrefetchBlock, n)));
    }
    return top;
  }
}

// The most gradients summed in one pass: 4 in the plain loops (measured on AMD Zen 5: a loop of more streams read
// slower per byte there), 8 in the prefetching ones (measured on Intel Xeon: 1.05-1.08x at G = 8 over two passes of
// 4; Note [Prefetching the streams]).
template <bool kPrefetch>
constexpr int kMaxGroup = kPrefetch ? 8 : 4;

// Adds the r (1..kMaxGroup) gradients of storage type T at g into acc in one pass; *top: the largest exponent field
// of the sums (accumulate_range).
template <bool kFirst, bool kCheck, bool kPrefetch, class T>
int accumulate_run_of_(const GradSource* g, int r, int64_t begin, int64_t n, float* acc, uint32_t* top) {
  if constexpr (kPrefetch) {
    switch (r) {
      case 8: *top = accumulate_run<kFirst, kCheck, 8, kPrefetch, T>(g, begin, n, acc); return 8;
      case 7: *top = accumulate_run<kFirst, kCheck, 7, kPrefetch, T>(g, begin, n, acc); return 7;
      case 6: *top = accumulate_run<kFirst, kCheck, 6, kPrefetch, T>(g, begin, n, acc); return 6;
      case 5: *top = accumulate_run<kFirst, kCheck, 5, kPrefetch, T>(g, begin, n, acc); return 5;
      default: break;
    }
  }
  switch (r) {
    case 4: *top = accumulate_run<kFirst, kCheck, 4, kPrefetch, T>(g, begin, n, acc); return 4;
    case 3: *top = accumulate_run<kFirst, kCheck, 3, kPrefetch, T>(g, begin, n, acc); return 3;
    case 2: *top = accumulate_run<kFirst, kCheck, 2, kPrefetch, T>(g, begin, n, acc); return 2;
    default: *top = accumulate_run<kFirst, kCheck, 1, kPrefetch, T>(g, begin, n, acc); return 1;
  }
}

// The last pass (r == left) takes the check: the sums of earlier passes need none (inf and NaN stay so).
template <bool kFirst, bool kPrefetch, class T>
int accumulate_run_of(const GradSource* g, int r, int left, int64_t begin, int64_t n, float* acc, uint32_t* top) {
  return r == left ? accumulate_run_of_<kFirst, true, kPrefetch, T>(g, r, begin, n, acc, top)
                   : accumulate_run_of_<kFirst, false, kPrefetch, T>(g, r, begin, n, acc, top);
}

// Adds the next group of gradients into acc: up to kMaxGroup consecutive ones of the same storage type in one pass
// (hinted in the prefetching form). Returns how many it consumed.
template <bool kFirst, bool kPrefetch>
int accumulate_group(const GradSource* g, int left, int64_t begin, int64_t n, float* acc, uint32_t* top) {
  const Dtype dtype = g[0].dtype;
  int r = 1;
  while (r < kMaxGroup<kPrefetch> && r < left && g[r].dtype == dtype) ++r;
  switch (dtype) {
    case Dtype::kFloat32: return accumulate_run_of<kFirst, kPrefetch, float>(g, r, left, begin, n, acc, top);
    case Dtype::kBFloat16: return accumulate_run_of<kFirst, kPrefetch, uint16_t>(g, r, left, begin, n, acc, top);
    case Dtype::kFloat16: return accumulate_run_of<kFirst, kPrefetch, _Float16>(g, r, left, begin, n, acc, top);
  }
  __builtin_unreachable();
}

// acc[0..n) = the weighted sum of the gradients' elements begin..begin+n. Returns whether one of the sums is not
// finite, from the last pass's exponent fields (a sum that was inf or NaN in an earlier pass stays so): taken in
// the memory-bound summation loop, not in a pass of its own (Note [A finite mean whose float32 sum overflows]).
template <bool kPrefetch>
bool sum_grads(const GradSource* grads, int num_grads, int64_t begin, int64_t n, float* acc) {
  uint32_t top = 0;
  int k = accumulate_group<true, kPrefetch>(grads, num_grads, begin, n, acc, &top);
  while (k < num_grads) k += accumulate_group<false, kPrefetch>(grads + k, num_grads - k, begin, n, acc, &top);
  return top == 0x7f800000u;
}

// Note [A finite mean whose float32 sum overflows]
// The G gradients are summed in float32 and the sum is multiplied by 1/G (grad_mult) after it: finite gradients
// whose sum passes float32's range (elements near 3.4e38 / G) gave an infinite sum and an inf/NaN update, where
// torch.optim, on the mean itself, takes a finite step (and the norm flagged such a step non-finite: skipped or
// raised for). So a tile whose sum holds an element that is not finite is finished by mean_or_wide(): every finite
// sum is multiplied as the Adam loop would (the same bits), every other element is summed again in double from the
// gradients, in the same order, and rounded to float32 once, after the multiplier: inf or NaN only where a gradient
// element is, or where the mean itself is beyond float32. The Adam loop then takes the finished tile with a
// multiplier of 1 (x * 1 is x). The check is the largest exponent field of the sums, taken in the summation loop
// itself (a pass of its own over the tile's sum in L1 measured 0.92-0.95x at G = 4: the memory streams stalled
// meanwhile); the second pass runs only where the first overflowed. The CUDA kernels do the same per element (cuda/kernels.cu).

// A gradient element as a float, any storage type: the rare paths' scalar load.
inline float grad_element(const GradSource& g, int64_t j) {
  switch (g.dtype) {
    case Dtype::kFloat32: return static_cast<const float*>(g.data)[j];
    case Dtype::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(g.data)[j]);
    case Dtype::kFloat16: {
      _Float16 h;
      std::memcpy(&h, static_cast<const uint16_t*>(g.data) + j, sizeof h);
      return static_cast<float>(h);
    }
  }
  __builtin_unreachable();
}

// acc[0..n) (the float32 sums of elements begin..begin+n) becomes the mean gradient: acc * mult where the sum is
// finite, the sum redone in double and multiplied before one rounding where it is not (Note [A finite mean whose
// float32 sum overflows]).
inline void mean_or_wide(const GradSource* grads, int num_grads, float mult, int64_t begin, int64_t n,
                         float* __restrict acc) {
  for (int64_t j = 0; j < n; ++j) {
    if (__builtin_isfinite(acc[j])) {
      acc[j] = acc[j] * mult;
      continue;
    }
    double wide = static_cast<double>(grad_element(grads[0], begin + j)) * static_cast<double>(grads[0].weight);
    for (int k = 1; k < num_grads; ++k) {
      wide = wide + static_cast<double>(grad_element(grads[k], begin + j)) * static_cast<double>(grads[k].weight);
    }
    acc[j] = static_cast<float>(wide * static_cast<double>(mult));
  }
}

template <bool kAdamW, bool kAmsgrad>
inline void adam_range(float* __restrict p, float* __restrict m, float* __restrict v, float* __restrict vmax,
                       const float* __restrict acc, const UpdateScalars& s, int64_t j0, int64_t j1) {
  const float beta1 = s.beta1, one_minus_beta1 = s.one_minus_beta1;
  const float beta2 = s.beta2, one_minus_beta2 = s.one_minus_beta2;
  const float wd = s.weight_decay, decay = s.decay, mult = s.grad_mult;
  const float step_size = s.step_size, inv_bc2 = s.inv_bias_correction2_sqrt, eps = s.eps;
  for (int64_t j = j0; j < j1; ++j) {
    float g = acc[j] * mult;
    float w = p[j];
    if constexpr (kAdamW) {
      w = w * decay;
    } else {
      g = g + wd * w;
    }
    const float mj = beta1 * m[j] + one_minus_beta1 * g;
    // (1 - beta2) * g first, then * g, as torch.optim: g * g overflows float32 for |g| > 1.8e19 (and the element's
    // second moment stayed inf, its update 0, for good); this way it is finite up to ~5.8e20 at beta2 = 0.999.
    const float vj = beta2 * v[j] + (one_minus_beta2 * g) * g;
    float vd = vj;
    if constexpr (kAmsgrad) {
      vd = vmax[j] > vj ? vmax[j] : vj;  // NaN in vj propagates, as torch.maximum
      vmax[j] = vd;
    }
    const float denom = __builtin_sqrtf(vd) * inv_bc2 + eps;
    m[j] = mj;
    v[j] = vj;
    p[j] = w - step_size * (mj / denom);
  }
}

// acc_in_memory: acc is a gradient read straight from memory (G = 1), not the tile's sum in L1; it is prefetched too.
template <bool kAdamW, bool kAmsgrad, bool kPrefetch>
void adam_tile(const TensorBuffers& t, const UpdateScalars& s, int64_t begin, int64_t n, const float* __restrict acc,
               bool acc_in_memory) {
  float* __restrict p = t.param + begin;
  float* __restrict m = t.exp_avg + begin;
  float* __restrict v = t.exp_avg_sq + begin;
  float* __restrict vmax = kAmsgrad ? t.max_exp_avg_sq + begin : nullptr;
  if constexpr (!kPrefetch) {
    adam_range<kAdamW, kAmsgrad>(p, m, v, vmax, acc, s, 0, n);
  } else {
    for (int64_t j = 0; j < n; j += kPrefetchBlock) {
      prefetch_ahead<1>(p + j);
      prefetch_ahead<1>(m + j);
      prefetch_ahead<1>(v + j);
      if constexpr (kAmsgrad) prefetch_ahead<1>(vmax + j);
      if (acc_in_memory) prefetch_ahead<0>(acc + j);
      adam_range<kAdamW, kAmsgrad>(p, m, v, vmax, acc, s, j, min_i64(j + kPrefetchBlock, n));
    }
  }
}

void write_param_out(const TensorBuffers& t, int64_t begin, int64_t n) {
  const float* __restrict p = t.param + begin;
  switch (t.param_out_dtype) {
    case Dtype::kFloat32:
      std::memcpy(static_cast<float*>(t.param_out) + begin, p, n * sizeof(float));
      break;
    case Dtype::kBFloat16: {
      uint16_t* __restrict out = static_cast<uint16_t*>(t.param_out) + begin;
      for (int64_t j = 0; j < n; ++j) out[j] = float_to_bf16(p[j]);
      break;
    }
    case Dtype::kFloat16:
      narrow_fp16(p, static_cast<uint16_t*>(t.param_out) + begin, n);
      break;
  }
}

template <bool kAdamW, bool kAmsgrad, int64_t kT, bool kPrefetch>
void update_tiles(const TensorBuffers& t, const UpdateScalars& s, int64_t begin, int64_t end) {
  alignas(64) float acc[kT];
  // One fp32 gradient of weight 1 (G = 1, a plain mean): acc would be 1 * g = g bit for bit, so read g directly.
  const bool direct = t.num_grads == 1 && t.grads[0].dtype == Dtype::kFloat32 && t.grads[0].weight == 1.0f;
  UpdateScalars finished = s;  // for a tile already multiplied by mean_or_wide()
  finished.grad_mult = 1.0f;
  for (int64_t tile = begin; tile < end; tile += kT) {
    const int64_t n = min_i64(kT, end - tile);
    const float* g = acc;
    const UpdateScalars* scalars = &s;
    if (direct) {
      g = static_cast<const float*>(t.grads[0].data) + tile;
    } else if (sum_grads<kPrefetch>(t.grads, t.num_grads, tile, n, acc)) [[unlikely]] {
      // a sum that is not finite: Note [A finite mean whose float32 sum overflows]
      mean_or_wide(t.grads, t.num_grads, s.grad_mult, tile, n, acc);
      scalars = &finished;
    }
    adam_tile<kAdamW, kAmsgrad, kPrefetch>(t, *scalars, tile, n, g, direct);
    if (t.param_out != nullptr) write_param_out(t, tile, n);
  }
}

// Tiles of kLongTile when the fp32 gradients take more than one summation pass (more than kMaxGroup of them): see
// kLongTile.
template <bool kAdamW, bool kAmsgrad, bool kPrefetch>
void update_impl(const TensorBuffers& t, const UpdateScalars& s, int64_t begin, int64_t end) {
  bool all_fp32 = true;
  for (int k = 0; k < t.num_grads; ++k) all_fp32 = all_fp32 && t.grads[k].dtype == Dtype::kFloat32;
  if (all_fp32 && t.num_grads > kMaxGroup<kPrefetch>) {
    update_tiles<kAdamW, kAmsgrad, kLongTile, kPrefetch>(t, s, begin, end);
  } else {
    update_tiles<kAdamW, kAmsgrad, kTile, kPrefetch>(t, s, begin, end);
  }
}

template <bool kPrefetch>
void update(const TensorBuffers& t, const UpdateScalars& s, int64_t begin, int64_t end) {
  if (s.adamw) {
    s.amsgrad ? update_impl<true, true, kPrefetch>(t, s, begin, end)
              : update_impl<true, false, kPrefetch>(t, s, begin, end);
  } else {
    s.amsgrad ? update_impl<false, true, kPrefetch>(t, s, begin, end)
              : update_impl<false, false, kPrefetch>(t, s, begin, end);
  }
}

// The clip norm's pass: the gradients summed as the update sums them (kPrefetch: with the prefetching form's hints and
// groups, the same bits), then squared into 16 fixed lanes.
//
// Note [A finite gradient's squares beyond float32]
// The squares are summed in float32: one square overflows for |g| > 1.8e19, and their sum once the range's norm
// passes that, though every element and the update itself are finite (the update adds (1 - beta2) * g * g in that
// order: finite up to ~5.8e20). The norm would be inf and its flag would skip (or raise for) a step of finite
// gradients. So a range whose float32 sum is not finite is summed again in float64 from the same float32 mean
// gradient: inf or NaN only when an element of it is. The common path keeps its bits; the second pass runs only
// where the first overflowed.
template <bool kPrefetch>
double sum_squares(const GradSource* grads, int num_grads, float mult, int64_t begin, int64_t end) {
  constexpr int kLanes = 16;
  alignas(64) float acc[kTile];
  alignas(64) float lanes[kLanes] = {};
  for (int64_t tile = begin; tile < end; tile += kTile) {
    const int64_t n = min_i64(kTile, end - tile);
    sum_grads<kPrefetch>(grads, num_grads, tile, n, acc);
    const int64_t full = n - n % kLanes;
    for (int64_t j = 0; j < full; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const float x = acc[j + l] * mult;
        lanes[l] += x * x;
      }
    }
    for (int64_t j = full; j < n; ++j) {
      const float x = acc[j] * mult;
      lanes[j - full] += x * x;
    }
  }
  float total = 0.0f;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  if (__builtin_isfinite(total)) return total;
  double wide = 0.0;  // Note [A finite gradient's squares beyond float32]
  for (int64_t tile = begin; tile < end; tile += kTile) {
    const int64_t n = min_i64(kTile, end - tile);
    sum_grads<kPrefetch>(grads, num_grads, tile, n, acc);
    mean_or_wide(grads, num_grads, mult, tile, n, acc);  // Note [A finite mean whose float32 sum overflows]
    for (int64_t j = 0; j < n; ++j) {
      const double x = static_cast<double>(acc[j]);
      wide += x * x;
    }
  }
  return wide;
}

}  // namespace

const KernelTable& PYENGINE_CONCAT(kernel_table_, PYENGINE_ISA)() {
  static const KernelTable table{PYENGINE_STR(PYENGINE_ISA), &update<false>, &sum_squares<false>, &update<true>,
                                 &sum_squares<true>};
  return table;
}

}  // namespace pyengine::cpu
