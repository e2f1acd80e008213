// Unit tests of the per-ISA CPU kernel tables (csrc/cpu/kernel.h), below ATen:
//   - every table the CPU can run matches a scalar float64 reference written here, element by element;
//   - the AVX-512, AVX2 and baseline tables give bit-identical results (the promise of -ffp-contract=off);
//   - splitting a range at an odd point changes no bit (elements are independent);
//   - every table's software-prefetching update (update_prefetch) gives the bits of its plain one;
//   - sum_squares is bit-identical across tables (and to its prefetching form) and matches a float64 sum.
// Lengths that are not multiples of the SIMD width, G in {1, 3, 8}, fp32/bf16/fp16/mixed gradients, AdamW and Adam
// with L2, amsgrad, maximize, weighted means and bf16/fp16 param_out. Fresh random data every run (seed printed).
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "check.h"
#include "cpu/kernel.h"

namespace pyengine::cpu {
namespace {

struct NamedTable {
  const char* name;
  const KernelTable* table;
};

std::vector<NamedTable> runnable_tables() {
  std::vector<NamedTable> tables{{"default", &kernel_table_default()}};
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    tables.push_back({"avx2", &kernel_table_avx2()});
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    tables.push_back({"avx512", &kernel_table_avx512()});
  }
#endif
  return tables;
}

uint16_t to_bf16(float f) {  // round to nearest even, as torch
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return 0x7fc0u;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t to_fp16(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
}

float from_fp16(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof h);
  return static_cast<float>(h);
}

const char* dtype_name(Dtype d) {
  return d == Dtype::kFloat32 ? "fp32" : d == Dtype::kBFloat16 ? "bf16" : "fp16";
}

// One worker's gradient in its storage type; values() gives the floats the kernel sees.
struct Grad {
  Dtype dtype;
  std::vector<float> f32;
  std::vector<uint16_t> half;

  Grad(Dtype d, const std::vector<float>& x) : dtype(d) {
    if (d == Dtype::kFloat32) {
      f32 = x;
      return;
    }
    half.resize(x.size());
    for (size_t j = 0; j < x.size(); ++j) half[j] = d == Dtype::kBFloat16 ? to_bf16(x[j]) : to_fp16(x[j]);
  }
  const void* data() const { return dtype == Dtype::kFloat32 ? static_cast<const void*>(f32.data()) : half.data(); }
  double value(size_t j) const {
    if (dtype == Dtype::kFloat32) return f32[j];
    return dtype == Dtype::kBFloat16 ? from_bf16(half[j]) : from_fp16(half[j]);
  }
};

struct State {
  std::vector<float> param, exp_avg, exp_avg_sq, max_exp_avg_sq;
  std::vector<uint16_t> param_out;
};

struct Case {
  int64_t n;
  int G;
  int dtype;  // 0..2: all grads of that Dtype; 3: mixed (worker k has Dtype k % 3)
  bool adamw;
  bool amsgrad;
  bool weighted;
  bool maximize;
  int param_out;  // -1: none, else a Dtype (bf16 or fp16)
};

std::ostream& operator<<(std::ostream& os, const Case& c) {
  return os << "n=" << c.n << " G=" << c.G << " grads=" << (c.dtype == 3 ? "mixed" : dtype_name(Dtype(c.dtype)))
            << (c.adamw ? " adamw" : " adam-L2") << (c.amsgrad ? " amsgrad" : "") << (c.weighted ? " weighted" : "")
            << (c.maximize ? " maximize" : "")
            << (c.param_out < 0 ? "" : c.param_out == 1 ? " param_out=bf16" : " param_out=fp16");
}

class KernelCase {
 public:
  KernelCase(const Case& c, std::mt19937_64& rng) : c_(c) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto draw = [&](float scale) {
      std::vector<float> x(c.n);
      for (float& e : x) e = scale * normal(rng);
      return x;
    };
    init_.param = draw(1.0f);
    init_.exp_avg = draw(0.1f);
    init_.exp_avg_sq = draw(0.1f);
    for (float& e : init_.exp_avg_sq) e = e * e;
    if (c.amsgrad) {
      init_.max_exp_avg_sq = draw(0.1f);
      for (size_t j = 0; j < init_.max_exp_avg_sq.size(); ++j) {
        init_.max_exp_avg_sq[j] = init_.max_exp_avg_sq[j] * init_.max_exp_avg_sq[j] + init_.exp_avg_sq[j] * 0.999f;
      }
    }
    if (c.param_out >= 0) init_.param_out.assign(c.n, 0xffffu);
    std::uniform_real_distribution<float> uniform(0.5f, 1.5f);
    double weight_total = 0.0;
    for (int k = 0; k < c.G; ++k) {
      grads_.emplace_back(c.dtype == 3 ? Dtype(k % 3) : Dtype(c.dtype), draw(1.0f));
      weights_.push_back(c.weighted ? uniform(rng) : 1.0f);
      weight_total += weights_.back();
    }
    if (c.weighted) {
      for (float& w : weights_) w = static_cast<float>(w / weight_total);
    }
    for (int k = 0; k < c.G; ++k) sources_.push_back({grads_[k].data(), grads_[k].dtype, weights_[k]});
    scalars_ = make_scalars();
  }

  // Runs table over [0, n) split at the given points (its prefetching update when prefetch); returns the final state.
  State run(const KernelTable& table, const std::vector<int64_t>& splits = {}, bool prefetch = false) const {
    const auto update = prefetch ? table.update_prefetch : table.update;
    State s = init_;
    const TensorBuffers t{s.param.data(),
                          s.exp_avg.data(),
                          s.exp_avg_sq.data(),
                          c_.amsgrad ? s.max_exp_avg_sq.data() : nullptr,
                          c_.param_out >= 0 ? s.param_out.data() : nullptr,
                          c_.param_out >= 0 ? Dtype(c_.param_out) : Dtype::kFloat32,
                          sources_.data(),
                          c_.G,
                          c_.n};
    int64_t begin = 0;
    for (int64_t end : splits) {
      update(t, scalars_, begin, end);
      begin = end;
    }
    update(t, scalars_, begin, c_.n);
    return s;
  }

  // table's sum_squares over [0, n) (its prefetching one when prefetch), in one range or split at the given points.
  float sum_squares(const KernelTable& table, bool prefetch = false, const std::vector<int64_t>& splits = {}) const {
    const auto sum_squares = prefetch ? table.sum_squares_prefetch : table.sum_squares;
    float total = 0.0f;
    int64_t begin = 0;
    for (int64_t end : splits) {
      total += static_cast<float>(sum_squares(sources_.data(), c_.G, scalars_.grad_mult, begin, end));
      begin = end;
    }
    return total + static_cast<float>(sum_squares(sources_.data(), c_.G, scalars_.grad_mult, begin, c_.n));
  }

  // The mean gradient in float64 (before grad_mult's sign and 1/G).
  double grad_sum(int64_t j) const {
    double g = 0.0;
    for (int k = 0; k < c_.G; ++k) g += static_cast<double>(weights_[k]) * grads_[k].value(j);
    return g;
  }

  double grad_scale(int64_t j) const {  // sum of |w_k g_k|: the size of the rounding error of the float sum
    double g = 0.0;
    for (int k = 0; k < c_.G; ++k) g += std::abs(static_cast<double>(weights_[k]) * grads_[k].value(j));
    return g * std::abs(static_cast<double>(scalars_.grad_mult));
  }

  void check_against_reference(const State& out, const char* table) const {
    const double lr = kLr, b1 = kBeta1, b2 = kBeta2, eps = kEps, wd = kWeightDecay;
    const double bc1 = 1.0 - std::pow(b1, kStep), bc2 = 1.0 - std::pow(b2, kStep);
    for (int64_t j = 0; j < c_.n; ++j) {
      double g = grad_sum(j) * static_cast<double>(scalars_.grad_mult);
      double p = init_.param[j];
      if (c_.adamw) {
        p *= 1.0 - lr * wd;
      } else {
        g += wd * p;
      }
      const double m = b1 * init_.exp_avg[j] + (1.0 - b1) * g;
      const double v = b2 * init_.exp_avg_sq[j] + (1.0 - b2) * g * g;
      const double vmax = c_.amsgrad ? std::max(static_cast<double>(init_.max_exp_avg_sq[j]), v) : v;
      const double denom = std::sqrt(vmax) / std::sqrt(bc2) + eps;
      p -= lr / bc1 * m / denom;

      const double gs = grad_scale(j) + (c_.adamw ? 0.0 : wd * std::abs(init_.param[j]));
      const double tol_m = 1e-5 * (std::abs(m) + gs);
      const double tol_v = 1e-5 * (std::abs(v) + gs * gs);
      const double tol_p = 1e-5 * (std::abs(p) + lr / bc1 * (std::abs(m) + gs) / denom);
      CHECK(std::abs(out.exp_avg[j] - m) <= tol_m, table << " " << c_ << " j=" << j << " exp_avg " << out.exp_avg[j]
                                                         << " vs " << m);
      CHECK(std::abs(out.exp_avg_sq[j] - v) <= tol_v,
            table << " " << c_ << " j=" << j << " exp_avg_sq " << out.exp_avg_sq[j] << " vs " << v);
      CHECK(std::abs(out.param[j] - p) <= tol_p, table << " " << c_ << " j=" << j << " param " << out.param[j]
                                                       << " vs " << p);
      if (c_.amsgrad) {
        CHECK(out.max_exp_avg_sq[j] == static_cast<float>(std::max(init_.max_exp_avg_sq[j], out.exp_avg_sq[j])),
              table << " " << c_ << " j=" << j << " max_exp_avg_sq");
      }
      if (c_.param_out >= 0) {
        const uint16_t expected = c_.param_out == 1 ? to_bf16(out.param[j]) : to_fp16(out.param[j]);
        CHECK(out.param_out[j] == expected, table << " " << c_ << " j=" << j << " param_out " << out.param_out[j]
                                                  << " vs " << expected);
      }
    }
  }

  double reference_sum_squares() const {
    double total = 0.0;
    for (int64_t j = 0; j < c_.n; ++j) {
      const double g = grad_sum(j) * static_cast<double>(scalars_.grad_mult);
      total += g * g;
    }
    return total;
  }

  // The sum over elements of grad_scale^2 (>= the sum of squares): what the float sum's rounding error in the sum
  // of squares is relative to. Where the weighted gradients cancel it is not relative to the sum of squares itself
  // (a fresh-data run, one element, G = 3: 2.60722e-08 against 2.60669e-08, 2e-4 apart).
  double reference_sum_squares_scale() const {
    double total = 0.0;
    for (int64_t j = 0; j < c_.n; ++j) total += grad_scale(j) * grad_scale(j);
    return total;
  }

 private:
  static constexpr float kLr = 1e-2f, kBeta1 = 0.9f, kBeta2 = 0.999f, kEps = 1e-8f, kWeightDecay = 0.1f;
  static constexpr int kStep = 3;

  UpdateScalars make_scalars() const {
    UpdateScalars s{};
    s.lr = kLr;
    s.beta1 = kBeta1;
    s.beta2 = kBeta2;
    s.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(kBeta1));
    s.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(kBeta2));
    s.eps = kEps;
    s.weight_decay = kWeightDecay;
    s.step_size = static_cast<float>(static_cast<double>(kLr) / (1.0 - std::pow(static_cast<double>(kBeta1), kStep)));
    s.inv_bias_correction2_sqrt =
        static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(static_cast<double>(kBeta2), kStep)));
    s.decay = static_cast<float>(1.0 - static_cast<double>(kLr) * kWeightDecay);
    s.grad_mult = static_cast<float>((c_.maximize ? -1.0 : 1.0) / (c_.weighted ? 1.0 : c_.G));
    s.max_grad_norm = 0.0f;
    s.adamw = c_.adamw;
    s.amsgrad = c_.amsgrad;
    return s;
  }

  Case c_;
  State init_;
  std::vector<Grad> grads_;
  std::vector<float> weights_;
  std::vector<GradSource> sources_;
  UpdateScalars scalars_;
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

bool same_state(const State& a, const State& b) {
  return same_bits(a.param, b.param) && same_bits(a.exp_avg, b.exp_avg) && same_bits(a.exp_avg_sq, b.exp_avg_sq) &&
         same_bits(a.max_exp_avg_sq, b.max_exp_avg_sq) && a.param_out == b.param_out;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

void run_case(const Case& c, const std::vector<NamedTable>& tables, std::mt19937_64& rng) {
  const KernelCase kc(c, rng);
  const State first = kc.run(*tables[0].table);
  kc.check_against_reference(first, tables[0].name);
  const float squares = kc.sum_squares(*tables[0].table);
  const double ref_squares = kc.reference_sum_squares();
  CHECK(std::abs(squares - ref_squares) <= 1e-4 * kc.reference_sum_squares_scale() + 1e-30,
        c << " sum_squares " << squares << " vs " << ref_squares);
  for (size_t i = 1; i < tables.size(); ++i) {
    CHECK(same_state(kc.run(*tables[i].table), first), c << ": " << tables[i].name << " differs from default");
    CHECK(same_bits(kc.sum_squares(*tables[i].table), squares),
          c << ": " << tables[i].name << " sum_squares differs from default");
  }
  // Ranges that split SIMD blocks and tiles at odd points give the same bits.
  const std::vector<int64_t> splits = c.n > 1030 ? std::vector<int64_t>{3, 1029} : std::vector<int64_t>{c.n / 2};
  CHECK(same_state(kc.run(*tables.back().table, splits), first), c << ": split range differs");
  for (const NamedTable& t : tables) {
    CHECK(same_state(kc.run(*t.table, {}, true), first), c << ": " << t.name << " update_prefetch differs");
    CHECK(same_bits(kc.sum_squares(*t.table, true), squares), c << ": " << t.name << " sum_squares_prefetch differs");
  }
  CHECK(same_state(kc.run(*tables.back().table, splits, true), first), c << ": split prefetching range differs");
  CHECK(same_bits(kc.sum_squares(*tables.back().table, true, splits), kc.sum_squares(*tables.back().table, false,
                                                                                       splits)),
        c << ": split prefetching sum_squares differs");
}

}  // namespace
}  // namespace pyengine::cpu

int main(int argc, char** argv) {
  using namespace pyengine::cpu;
  // a failed run's seed, given back, replays its data: test_kernels <seed>
  const uint64_t seed = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : std::random_device{}();
  std::printf("test_kernels: seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  const std::vector<NamedTable> tables = runnable_tables();
  std::printf("tables:");
  for (const NamedTable& t : tables) std::printf(" %s", t.name);
  std::printf("\n");

  int index = 0, cases = 0;
  for (int64_t n : {1, 7, 17, 4097, 100003}) {
    for (int G : {1, 3, 8}) {
      for (int dtype = 0; dtype < 4; ++dtype) {
        for (int mode = 0; mode < 4; ++mode) {
          const Case c{n, G, dtype, mode < 2, mode % 2 == 1, index % 3 == 1, index % 5 == 2,
                       index % 3 == 0 ? -1 : index % 3};
          run_case(c, tables, rng);
          ++index;
          ++cases;
        }
      }
    }
  }
  std::printf("%d cases x %zu tables\n", cases, tables.size());
  return pyengine::test::finish("test_kernels");
}
