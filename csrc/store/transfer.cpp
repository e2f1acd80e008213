// BucketTransfer's backend-independent half: argument checks, the per-bucket launch/complete/release counters and
// the waits built on them (see the Note in transfer.h), and the choice of backend.
#include "transfer.h"

#include <c10/util/Exception.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>

#include "nvtx.h"

namespace pyengine::store {
namespace {

bool copyable_dtype(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
}

void check_pair(const at::Tensor& src, const at::Tensor& dst, size_t i) {
  TORCH_CHECK_VALUE(dst.defined() && dst.is_contiguous(), "BucketTransfer: dsts[", i,
                    "] must be a contiguous tensor");
  // A ZeroTensor (torch._efficientzerotensor; torch.sgn's gradient, say) has no memory: its data pointer is null, and
  // the copy thread's memcpy from it killed the process. A zero source is an undefined one (a zero-fill).
  TORCH_CHECK_VALUE(!dst._is_zerotensor() && !(src.defined() && src._is_zerotensor()), "BucketTransfer: pair ", i,
                    " holds a ZeroTensor (no memory behind it); pass an undefined source (None) to fill with zeros");
  // A lazy negation (torch._neg_view) lives in a flag a byte copy would not see: the values would land unnegated.
  TORCH_CHECK_VALUE(!dst.is_neg() && !(src.defined() && src.is_neg()), "BucketTransfer: pair ", i,
                    " is a negative view (torch._neg_view); resolve it first (.resolve_neg())");
  TORCH_CHECK_VALUE(copyable_dtype(dst.scalar_type()), "BucketTransfer: dsts[", i,
                    "] must be float32, bfloat16 or float16; got ", dst.scalar_type());
  if (!src.defined()) return;  // zero-fill
  TORCH_CHECK_VALUE(src.is_contiguous(), "BucketTransfer: srcs[", i, "] must be contiguous");
  TORCH_CHECK_VALUE(copyable_dtype(src.scalar_type()), "BucketTransfer: srcs[", i,
                    "] must be float32, bfloat16 or float16; got ", src.scalar_type());
  TORCH_CHECK_VALUE(src.numel() == dst.numel(), "BucketTransfer: srcs[", i, "] has ", src.numel(),
                    " elements but dsts[", i, "] has ", dst.numel());
  // Overlapping memory would make the copy's result depend on its order (memcpy's is undefined)
  const auto s = reinterpret_cast<uintptr_t>(src.data_ptr()), d = reinterpret_cast<uintptr_t>(dst.data_ptr());
  TORCH_CHECK_VALUE(src.nbytes() == 0 || s + src.nbytes() <= d || d + dst.nbytes() <= s, "BucketTransfer: srcs[",
                    i, "] and dsts[", i, "] overlap in memory; a copy needs a destination of its own");
}

}  // namespace

const char* channel_name(int channel) { return channel == kGrads ? "grads" : "weights"; }

namespace {
constexpr double kLongestTimeoutS = 1e9;  // ~31 years

int64_t checked_num_buckets(int64_t num_buckets) {  // before counters_ is sized from it
  TORCH_CHECK_VALUE(num_buckets >= 0, "BucketTransfer: num_buckets must be >= 0; got ", num_buckets);
  return num_buckets;
}
}  // namespace

BucketTransfer::BucketTransfer(int64_t num_buckets, std::string label)
    : num_buckets_(checked_num_buckets(num_buckets)), label_(std::move(label)), owner_pid_(getpid()),
      counters_(kNumChannels * num_buckets_) {}

bool BucketTransfer::forked() const { return getpid() != owner_pid_; }

void BucketTransfer::check_process(const char* what) const {
  TORCH_CHECK(!forked(), "BucketTransfer.", what, ": this transfer (", label_, ") was made in process ", owner_pid_,
              " and this is process ", getpid(), ", a fork of it: its copy thread or CUDA stream is not here. Build "
              "the engine or streamer in this process (or start it with the 'spawn' method)");
}

void BucketTransfer::order_current_stream(int64_t channel) {
  check_process("order_current_stream");
  order_stream(channel);
}

void BucketTransfer::drain() {
  check_process("drain");
  drain_copies();
}

void BucketTransfer::close() {
  if (!forked()) close_copies();
}

void ForkSafeDelete::operator()(BucketTransfer* transfer) const {
  if (transfer != nullptr && !transfer->forked()) delete transfer;
}

void BucketTransfer::check_index(int64_t channel, int64_t bucket, const char* what) const {
  TORCH_CHECK_VALUE(channel == kGrads || channel == kWeights, "BucketTransfer.", what,
                    ": channel must be 0 (grads) or 1 (weights); got ", channel);
  TORCH_CHECK_INDEX(bucket >= 0 && bucket < num_buckets_, "BucketTransfer.", what, ": bucket must be in [0, ",
                    num_buckets_, "); got ", bucket);
}

std::string BucketTransfer::range_name(const char* verb, int64_t channel, int64_t bucket, bool part) const {
  return std::string("pyengine/") + verb + " " + channel_name(static_cast<int>(channel)) + " b" +
         std::to_string(bucket) + (part ? " early " : " ") + label_;
}

void BucketTransfer::launch(int64_t channel, int64_t bucket, std::vector<at::Tensor> srcs,
                            std::vector<at::Tensor> dsts, bool completes_bucket) {
  check_process("launch");
  check_index(channel, bucket, "launch");
  TORCH_CHECK_VALUE(srcs.size() == dsts.size(), "BucketTransfer.launch: srcs and dsts must have the same length; got ",
                    srcs.size(), " and ", dsts.size());
  for (size_t i = 0; i < srcs.size(); ++i) check_pair(srcs[i], dsts[i], i);
  std::lock_guard<std::mutex> order(launch_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!closed_, "BucketTransfer.launch: the transfer of ", label_, " is closed");
  }
  start(channel, bucket, CopyJob{std::move(srcs), std::move(dsts), completes_bucket});
  if (!completes_bucket) return;
  {
    // Counted only once start() has issued the copy, so a waiter never waits on an earlier copy's completion.
    std::lock_guard<std::mutex> lock(mutex_);
    counters(channel, bucket).launched += 1;
  }
  changed_.notify_all();
}

bool BucketTransfer::wait(int64_t channel, int64_t bucket, bool until_launched, double timeout_s) {
  check_process("wait");
  check_index(channel, bucket, "wait");
  TORCH_CHECK_VALUE(!std::isnan(timeout_s), "BucketTransfer.wait: timeout_s must be a number of seconds (< 0: no "
                    "timeout); got NaN");
  NvtxRange range(range_name("wait", channel, bucket));
  std::unique_lock<std::mutex> lock(mutex_);
  Counters& c = counters(channel, bucket);
  if (until_launched) {
    const auto ready = [&] { return c.launched > c.released || closed_; };
    if (timeout_s < 0 || timeout_s > kLongestTimeoutS) {  // longer ones overflow wait_for's clock: no timeout
      changed_.wait(lock, ready);
    } else if (!changed_.wait_for(lock, std::chrono::duration<double>(timeout_s), ready)) {
      return false;
    }
    TORCH_CHECK(c.launched > c.released, "BucketTransfer.wait: the transfer of ", label_,
                " was closed before bucket ", bucket, " was launched");
  }
  const int64_t target = c.launched;
  if (c.completed < target) wait_completed(channel, bucket, target, lock);
  if (!c.error.empty() && c.error_launch == target) {  // kept for the next waiter: Note [A failed copy's error]
    const std::string error = c.error;
    TORCH_CHECK(false, "BucketTransfer: the copy of ", channel_name(static_cast<int>(channel)), " bucket ", bucket,
                " of ", label_, " failed: ", error);
  }
  return true;
}

void BucketTransfer::wait_all(int64_t channel, bool until_launched) {
  for (int64_t k = 0; k < num_buckets_; ++k) wait(channel, k, until_launched);
}

void BucketTransfer::release(int64_t channel, int64_t bucket) {
  check_process("release");
  check_index(channel, bucket, "release");
  std::lock_guard<std::mutex> lock(mutex_);
  Counters& c = counters(channel, bucket);
  c.released = c.launched;
  // An early part's error for a launch that has not come goes too: reset() releases a failed step's buckets, whose
  // completing launches never come (the next step's would raise it). The next step's parts start after the release.
  c.error.clear();
}

TransferPtr make_transfer(int64_t num_buckets, const at::Device& device, std::string label) {
  if (device.is_cpu()) return make_cpu_transfer(num_buckets, std::move(label));
#ifdef PYENGINE_WITH_CUDA
  if (device.is_cuda()) return make_cuda_transfer(num_buckets, device, std::move(label));
#endif
  TORCH_CHECK_VALUE(false, "GradientStreamer: replicas on ", device,
                    " are not supported (cpu, and cuda in a CUDA build of pyengine)");
}

}  // namespace pyengine::store
