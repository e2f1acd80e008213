// A/B timing of versions of the CUDA update kernel (csrc/cuda/kernels.cu) against each other and a device copy.
//
// Built and run by bench/cuda_kernel_ab.py: one executable per version, this file compiled with that version's
// launch.h (-I<version>/cuda, plus its -DPYENGINE_CUDA_CHUNK / -DPYENGINE_CUDA_THREADS) and linked with its
// kernels.cu. No torch: plain nvcc, as llm.c's dev/cuda harnesses, so a version builds in seconds.
//
// One run of the program goes through every configuration (N, G, gradient dtype) on buffers allocated once for the
// largest: it fills param / exp_avg / exp_avg_sq / the G gradients from a counter-based hash (the same values in every
// version), applies steps 1 and 2, and prints a hash of the three state buffers' bits (every version must print the
// first version's); then it times `reps` launches, each followed by a device-to-device copy of `copy_mib` MiB on the
// same stream, with CUDA events, and prints the median of each. The copy in the same process is the yardstick:
// a GPU's clocks, and so both times, move together from run to run.
//
//   cuda_kernel_ab REPS COPY_MIB N:G:DTYPE [N:G:DTYPE ...]      DTYPE: fp32 | bf16
//
// Output: one line per configuration,
//   config N G DTYPE kernel_ms COPY_MS hash 0x...              (medians over REPS; hash of param, exp_avg, exp_avg_sq)
// An error (no device, a failed launch, bad arguments) prints one line on stderr and exits 1 (2: bad arguments).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "launch.h"

using pyengine::Dtype;
using pyengine::UpdateScalars;
using pyengine::cuda::DeviceScalars;
using pyengine::cuda::LaunchTable;

namespace {

#define CHECK_CUDA(call)                                                                          \
  do {                                                                                            \
    const cudaError_t err_ = (call);                                                              \
    if (err_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "cuda_kernel_ab: %s failed: %s\n", #call, cudaGetErrorString(err_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

struct Config {
  int64_t n;
  int g;
  Dtype dtype;
  std::string dtype_name;
};

__host__ __device__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A value in [lo, hi) from (stream, index): the same in every version and every run.
__device__ float hashed_uniform(uint64_t stream, int64_t i, float lo, float hi) {
  const uint64_t h = splitmix64(stream * 0x100000001b3ull ^ static_cast<uint64_t>(i));
  return lo + (hi - lo) * static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
}

// Keeps the stream busy while the host queues what follows, so a start event is stamped when the work before it
// ends, not when the host reaches it (an idle stream stamps an event at once, counting the launch delay after it).
__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

__global__ void fill_f32(float* p, int64_t n, uint64_t stream, float lo, float hi) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    p[i] = hashed_uniform(stream, i, lo, hi);
  }
}

__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint64_t stream) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    p[i] = __float2bfloat16_rn(hashed_uniform(stream, i, -1.0f, 1.0f));
  }
}

// XOR over elements of a mix of (buffer, index, bits): independent of the order the blocks run in.
__global__ void hash_bits(const float* p, int64_t n, uint64_t buffer, unsigned long long* out) {
  uint64_t h = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t bits;
    memcpy(&bits, p + i, sizeof bits);
    h ^= splitmix64((buffer << 56) ^ (static_cast<uint64_t>(i) << 20) ^ splitmix64(bits));
  }
  atomicXor(out, static_cast<unsigned long long>(h));
}

constexpr int kFillBlocks = 1024, kFillThreads = 256;

// AdamW scalars as make_update_scalars (csrc/mean_grad_adamw.cpp) derives them: lr 1e-3, betas (0.9, 0.999),
// eps 1e-8, weight decay 0.01, the plain mean of G gradients.
UpdateScalars scalars(int64_t step, int g) {
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, wd = 0.01;
  UpdateScalars s{};
  s.lr = static_cast<float>(lr);
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  s.weight_decay = static_cast<float>(wd);
  s.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, double(step))));
  s.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, double(step))));
  s.decay = static_cast<float>(1.0 - lr * wd);
  s.grad_mult = static_cast<float>(1.0 / g);
  s.max_grad_norm = 0.0f;
  s.adamw = true;
  s.amsgrad = false;
  return s;
}

bool parse_config(const char* text, Config* c) {
  char dtype[16] = {0};
  long long n = 0;
  int g = 0;
  if (std::sscanf(text, "%lld:%d:%15s", &n, &g, dtype) != 3 || n < 1 || g < 1 || g > pyengine::cuda::kMaxWorkers) {
    return false;
  }
  c->n = n;
  c->g = g;
  c->dtype_name = dtype;
  if (c->dtype_name == "fp32") c->dtype = Dtype::kFloat32;
  else if (c->dtype_name == "bf16") c->dtype = Dtype::kBFloat16;
  else return false;
  return true;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t k = v.size() / 2;
  return v.size() % 2 ? v[k] : 0.5 * (v[k - 1] + v[k]);
}

struct Buffers {
  float* param = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  std::vector<void*> grads;  // each sized for the largest N in fp32 (a bf16 gradient uses its first half)
  char* copy_src = nullptr;
  char* copy_dst = nullptr;
};

void run_config(const Config& c, const Buffers& b, int reps, size_t copy_bytes, cudaStream_t stream) {
  fill_f32<<<kFillBlocks, kFillThreads, 0, stream>>>(b.param, c.n, 1, -1.0f, 1.0f);
  fill_f32<<<kFillBlocks, kFillThreads, 0, stream>>>(b.exp_avg, c.n, 2, -0.01f, 0.01f);
  fill_f32<<<kFillBlocks, kFillThreads, 0, stream>>>(b.exp_avg_sq, c.n, 3, 0.0f, 1e-4f);
  for (int g = 0; g < c.g; ++g) {
    if (c.dtype == Dtype::kFloat32) {
      fill_f32<<<kFillBlocks, kFillThreads, 0, stream>>>(static_cast<float*>(b.grads[g]), c.n, 10 + g, -1.0f, 1.0f);
    } else {
      fill_bf16<<<kFillBlocks, kFillThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(b.grads[g]), c.n, 10 + g);
    }
  }
  CHECK_CUDA(cudaGetLastError());

  LaunchTable table{};
  table.param[0] = b.param;
  table.exp_avg[0] = b.exp_avg;
  table.exp_avg_sq[0] = b.exp_avg_sq;
  table.numel[0] = c.n;
  table.chunk_begin[0] = 0;
  table.chunk_begin[1] = static_cast<int>((c.n + pyengine::cuda::kChunk - 1) / pyengine::cuda::kChunk);
  for (int g = 0; g < c.g; ++g) {
    table.grads[g] = b.grads[g];
    table.grad_dtype[g] = c.dtype;
    table.weight[g] = 1.0f;
  }
  table.num_tensors = 1;
  table.num_workers = c.g;
  table.param_out_dtype = Dtype::kFloat32;
  const DeviceScalars none{nullptr, nullptr, nullptr};

  for (int64_t step = 1; step <= 2; ++step) {
    CHECK_CUDA(pyengine::cuda::launch_update(table, scalars(step, c.g), none, stream));
  }
  unsigned long long* hash = nullptr;
  CHECK_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&hash), sizeof *hash, stream));
  CHECK_CUDA(cudaMemsetAsync(hash, 0, sizeof *hash, stream));
  const float* state[3] = {b.param, b.exp_avg, b.exp_avg_sq};
  for (uint64_t k = 0; k < 3; ++k) hash_bits<<<kFillBlocks, kFillThreads, 0, stream>>>(state[k], c.n, k, hash);
  CHECK_CUDA(cudaGetLastError());
  unsigned long long host_hash = 0;
  CHECK_CUDA(cudaMemcpyAsync(&host_hash, hash, sizeof host_hash, cudaMemcpyDeviceToHost, stream));
  CHECK_CUDA(cudaFreeAsync(hash, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));

  // Timed: launch, copy, launch, copy, ... (three untimed pairs first). Later steps keep updating the same buffers;
  // their values do not change the time of a memory-bound kernel.
  const UpdateScalars s = scalars(3, c.g);
  cudaEvent_t ev[3];
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  std::vector<double> kernel_ms, copy_ms;
  for (int r = -3; r < reps; ++r) {
    spin<<<1, 1, 0, stream>>>(400000);  // ~0.2 ms: the launches below are queued before ev[0] is stamped
    CHECK_CUDA(cudaEventRecord(ev[0], stream));
    CHECK_CUDA(pyengine::cuda::launch_update(table, s, none, stream));
    CHECK_CUDA(cudaEventRecord(ev[1], stream));
    CHECK_CUDA(cudaMemcpyAsync(b.copy_dst, b.copy_src, copy_bytes, cudaMemcpyDeviceToDevice, stream));
    CHECK_CUDA(cudaEventRecord(ev[2], stream));
    CHECK_CUDA(cudaEventSynchronize(ev[2]));
    float k_ms = 0, c_ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&k_ms, ev[0], ev[1]));
    CHECK_CUDA(cudaEventElapsedTime(&c_ms, ev[1], ev[2]));
    if (r >= 0) {
      kernel_ms.push_back(k_ms);
      copy_ms.push_back(c_ms);
    }
  }
  for (auto& e : ev) CHECK_CUDA(cudaEventDestroy(e));
  std::printf("config %lld %d %s %.5f %.5f hash 0x%016llx\n", static_cast<long long>(c.n), c.g, c.dtype_name.c_str(),
              median(kernel_ms), median(copy_ms), host_hash);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: cuda_kernel_ab REPS COPY_MIB N:G:DTYPE [N:G:DTYPE ...]  (DTYPE fp32 | bf16)\n");
    return 2;
  }
  const int reps = std::atoi(argv[1]);
  const long long copy_mib = std::atoll(argv[2]);
  if (reps < 1 || copy_mib < 1) {
    std::fprintf(stderr, "cuda_kernel_ab: REPS and COPY_MIB must be positive, got '%s' and '%s'\n", argv[1], argv[2]);
    return 2;
  }
  std::vector<Config> configs;
  for (int i = 3; i < argc; ++i) {
    Config c;
    if (!parse_config(argv[i], &c)) {
      std::fprintf(stderr, "cuda_kernel_ab: bad configuration '%s': expected N:G:DTYPE with N >= 1, 1 <= G <= %d, "
                   "DTYPE fp32 or bf16\n", argv[i], pyengine::cuda::kMaxWorkers);
      return 2;
    }
    configs.push_back(c);
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "cuda_kernel_ab: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s chunk %lld threads %d\n", prop.name, static_cast<long long>(pyengine::cuda::kChunk),
              pyengine::cuda::kThreads);

  int64_t max_n = 0;
  int max_g = 0;
  for (const Config& c : configs) {
    max_n = std::max(max_n, c.n);
    max_g = std::max(max_g, c.g);
  }
  Buffers b;
  const size_t state_bytes = static_cast<size_t>(max_n) * sizeof(float);
  CHECK_CUDA(cudaMalloc(&b.param, state_bytes));
  CHECK_CUDA(cudaMalloc(&b.exp_avg, state_bytes));
  CHECK_CUDA(cudaMalloc(&b.exp_avg_sq, state_bytes));
  b.grads.resize(max_g);
  for (auto& g : b.grads) CHECK_CUDA(cudaMalloc(&g, state_bytes));
  const size_t copy_bytes = static_cast<size_t>(copy_mib) << 20;
  CHECK_CUDA(cudaMalloc(&b.copy_src, copy_bytes));
  CHECK_CUDA(cudaMalloc(&b.copy_dst, copy_bytes));
  CHECK_CUDA(cudaMemset(b.copy_src, 1, copy_bytes));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const Config& c : configs) run_config(c, b, reps, copy_bytes, stream);
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}
