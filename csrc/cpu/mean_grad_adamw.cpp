// CPU implementation of the fused mean-gradient AdamW ops: builds the kernel arguments, splits the work of all
// tensors into fixed chunks, and runs them in one at::parallel_for region with the ISA variant chosen at run time.
//
// Determinism: the update of an element depends only on that element, and the norm's partial sums are taken over
// chunks whose bounds do not depend on the thread count, then added in chunk order in double. So results are
// bit-identical for any number of threads, and across ISA variants (see kernel_isa.cpp on -ffp-contract=off).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "../mean_grad_adamw.h"
#include "isa.h"
#include "kernel.h"

namespace pyengine::cpu {
namespace {

// Elements per unit of parallel work: 16 tiles = 64 KiB per stream, so the G + 6 streams of a chunk fit in L2; one
// long tile (kernel.h).
constexpr int64_t kChunk = kLongTile;

thread_local bool serial_on_this_thread = false;

// at::parallel_for over [0, n), or a plain loop on this thread when set_serial_on_this_thread(true) is in force.
template <typename F>
void for_chunks(int64_t n, const F& body) {
  if (serial_on_this_thread) {
    body(0, n);
  } else {
    at::parallel_for(0, n, 1, body);
  }
}

struct Chunk {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

std::vector<Chunk> split_into_chunks(const std::vector<int64_t>& numels) {
  std::vector<Chunk> chunks;
  for (int64_t t = 0; t < static_cast<int64_t>(numels.size()); ++t) {
    for (int64_t begin = 0; begin < numels[t]; begin += kChunk) {
      chunks.push_back({t, begin, std::min(numels[t], begin + kChunk)});
    }
  }
  return chunks;
}

// grads of tensor i for every worker, as the kernel reads them: sources[i * G + g].
std::vector<GradSource> grad_sources(at::TensorList grads, int64_t num_tensors, const std::vector<float>& weights) {
  const int64_t G = static_cast<int64_t>(grads.size()) / num_tensors;
  std::vector<GradSource> sources(grads.size());
  for (int64_t i = 0; i < num_tensors; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const at::Tensor& t = grads[g * num_tensors + i];
      sources[i * G + g] = {t.data_ptr(), dtype_code(t.scalar_type()), weights[g]};
    }
  }
  return sources;
}

// The gradient multiplier once grad_scale and clipping are known; nullopt when the step must be skipped (found_inf,
// a grad_scale that is not a positive finite number, a clip norm that is not a finite number >= 0), as the CUDA
// kernels decide on the device.
std::optional<float> effective_grad_mult(const UpdateArgs& a, const UpdateScalars& s) {
  if (a.found_inf.has_value() && a.found_inf->item<float>() != 0.0f) return std::nullopt;
  // The same float operations as grad_multiplier() in cuda/kernels.cu, so CPU and CUDA take the same multiplier
  // (and skip the same steps) from the same grad_scale and norm.
  const float scale = a.grad_scale.has_value() ? a.grad_scale->item<float>() : 1.0f;
  if (!(scale > 0.0f) || std::isinf(scale)) return std::nullopt;  // a broken loss scale: skipped, as found_inf
  float mult = s.grad_mult / scale;
  if (std::isinf(mult)) return std::nullopt;  // a subnormal scale whose inverse overflows: skipped, as GradScaler
  if (s.max_grad_norm > 0.0f) {
    const float norm = a.grad_norm->item<float>() / scale;
    if (!(norm >= 0.0f) || std::isinf(norm)) return std::nullopt;  // a negative norm would reverse the step
    mult = mult * std::fmin(1.0f, s.max_grad_norm / (norm + 1e-6f));
  }
  return mult;
}

void update_cpu(const UpdateArgs& a) {
  UpdateScalars s = make_update_scalars(a);
  const std::optional<float> mult = effective_grad_mult(a, s);
  if (!mult.has_value()) return;
  s.grad_mult = *mult;

  const int64_t P = a.num_tensors(), G = a.num_workers();
  const std::vector<GradSource> sources = grad_sources(a.grads, P, summation_weights(a.weights, G));
  std::vector<TensorBuffers> buffers(P);
  std::vector<int64_t> numels(P);
  for (int64_t i = 0; i < P; ++i) {
    const bool has_out = !a.param_outs.empty();
    buffers[i] = {a.params[i].data_ptr<float>(),
                  a.exp_avgs[i].data_ptr<float>(),
                  a.exp_avg_sqs[i].data_ptr<float>(),
                  s.amsgrad ? a.max_exp_avg_sqs[i].data_ptr<float>() : nullptr,
                  has_out ? a.param_outs[i].data_ptr() : nullptr,
                  has_out ? dtype_code(a.param_outs[i].scalar_type()) : Dtype::kFloat32,
                  sources.data() + i * G,
                  static_cast<int>(G),
                  a.params[i].numel()};
    numels[i] = buffers[i].numel;
  }
  const std::vector<Chunk> chunks = split_into_chunks(numels);
  const KernelTable& kernels = selected_kernels();
  const auto update = prefetch_streams() ? kernels.update_prefetch : kernels.update;
  for_chunks(static_cast<int64_t>(chunks.size()), [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      update(buffers[chunks[c].tensor], s, chunks[c].begin, chunks[c].end);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> norm_cpu(at::TensorList grads, int64_t num_tensors,
                                            const std::optional<at::ArrayRef<double>>& weights) {
  const int64_t G = static_cast<int64_t>(grads.size()) / num_tensors;
  const std::vector<GradSource> sources = grad_sources(grads, num_tensors, summation_weights(weights, G));
  const float mult = weights.has_value() ? 1.0f : static_cast<float>(1.0 / static_cast<double>(G));
  std::vector<int64_t> numels(num_tensors);
  for (int64_t i = 0; i < num_tensors; ++i) numels[i] = grads[i].numel();
  const std::vector<Chunk> chunks = split_into_chunks(numels);
  std::vector<double> partial(chunks.size());
  const KernelTable& kernels = selected_kernels();
  const auto sum_squares = prefetch_streams() ? kernels.sum_squares_prefetch : kernels.sum_squares;
  for_chunks(static_cast<int64_t>(chunks.size()), [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const Chunk& ch = chunks[c];
      partial[c] = sum_squares(sources.data() + ch.tensor * G, static_cast<int>(G), mult, ch.begin, ch.end);
    }
  });
  double total = 0.0;
  for (double p : partial) total += p;
  // float32 like the update's scalars: a norm past float32's range (elements near its top) is not finite either
  const float norm = static_cast<float>(std::sqrt(total));
  const auto options = at::TensorOptions().dtype(at::kFloat).device(grads[0].device());
  at::Tensor norm_t = at::scalar_tensor(norm, options);
  at::Tensor nonfinite_t = at::scalar_tensor(std::isfinite(norm) ? 0.0f : 1.0f, options);
  return {norm_t, nonfinite_t};
}

}  // namespace

bool set_serial_on_this_thread(bool serial) {
  const bool previous = serial_on_this_thread;
  serial_on_this_thread = serial;
  return previous;
}

const KernelTable& selected_kernels() {
#ifdef PYENGINE_CPU_ISA_VARIANTS
  // at::get_cpu_capability() is ATen's exported answer ("AVX512", "AVX2", "DEFAULT", ...); it is decided once per
  // process and honours ATEN_CPU_CAPABILITY, so this choice is made once too.
  static const KernelTable& table = [] () -> const KernelTable& {
    const std::string capability = at::get_cpu_capability();
    if (capability == "AVX512") return kernel_table_avx512();
    if (capability == "AVX2") return kernel_table_avx2();
    return kernel_table_default();
  }();
  return table;
#else
  return kernel_table_default();
#endif
}

std::string selected_isa() { return selected_kernels().isa; }

namespace {

// The CPU's vendor string from CPUID leaf 0 ("GenuineIntel", "AuthenticAMD", ...), empty off x86.
std::string cpu_vendor() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return "";
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  return vendor;
#else
  return "";
#endif
}

// -1 until decided, then 0 or 1: decided at the first call, like the ISA; set_prefetch_streams overrides it.
std::atomic<int> prefetch_setting{-1};

}  // namespace

bool prefetch_streams() {
  int on = prefetch_setting.load(std::memory_order_relaxed);
  if (on >= 0) return on == 1;
  // A bad value throws here, and again at the next call (nothing is stored): no op runs with a setting the user
  // did not mean.
  const char* env = std::getenv("PYENGINE_CPU_PREFETCH");
  if (env != nullptr && *env != '\0') {
    const std::string value(env);
    TORCH_CHECK(value == "0" || value == "1", "PYENGINE_CPU_PREFETCH must be 0 (plain loops) or 1 (software "
                "prefetching), or unset (on for Intel CPUs); got '", value, "'");
    on = value == "1";
  } else {
    on = cpu_vendor() == "GenuineIntel";
  }
  int undecided = -1;  // two threads deciding at once decide the same
  prefetch_setting.compare_exchange_strong(undecided, on);
  return prefetch_setting.load(std::memory_order_relaxed) == 1;
}

bool set_prefetch_streams(bool on) {
  const bool previous = prefetch_streams();
  prefetch_setting.store(on ? 1 : 0, std::memory_order_relaxed);
  return previous;
}

}  // namespace pyengine::cpu

TORCH_LIBRARY_IMPL(pyengine, CPU, m) {
  PYENGINE_REGISTER_OPS(m, ::pyengine::cpu::update_cpu, ::pyengine::cpu::norm_cpu);
}
