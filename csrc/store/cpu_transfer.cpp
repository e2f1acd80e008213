// The CPU backend of BucketTransfer: one copy thread per worker runs the bucket copies in launch order while the
// worker's thread goes on with backward (or the host with the next bucket's update). The copy thread uses no
// intra-op parallelism: on a few cores, a second parallel region fighting backward's would undo the overlap.
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "nvtx.h"
#include "transfer.h"

namespace pyengine::store {
namespace {

template <typename Src, typename Dst>
void convert(const Src* __restrict src, Dst* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<Dst>(static_cast<float>(src[i]));
}

template <typename Src>
void convert_to(const Src* src, const at::Tensor& dst, int64_t n) {
  switch (dst.scalar_type()) {
    case at::kFloat: return convert(src, static_cast<float*>(dst.data_ptr()), n);
    case at::kBFloat16: return convert(src, static_cast<c10::BFloat16*>(dst.data_ptr()), n);
    case at::kHalf: return convert(src, static_cast<c10::Half*>(dst.data_ptr()), n);
    default: TORCH_CHECK(false, "copy_on_host: unsupported destination dtype ", dst.scalar_type());
  }
}

// A large memcpy with ordinary stores pulls every destination line into the cache, evicting the weights and
// activations backward is working on: the copy thread would slow backward by as much as it overlaps it. Streaming
// (non-temporal) stores write around the cache. SSE2 is baseline x86-64, so this needs no ISA flags.
void copy_bytes(void* dst, const void* src, size_t nbytes) {
#if defined(__x86_64__)
  constexpr size_t kStreamMin = 1 << 20;
  const auto d = reinterpret_cast<uintptr_t>(dst);
  if (nbytes >= kStreamMin && d % 16 == 0) {
    auto* out = static_cast<__m128i*>(dst);
    const auto* in = static_cast<const __m128i*>(src);
    const size_t vectors = nbytes / 16;
    for (size_t i = 0; i < vectors; ++i) _mm_stream_si128(out + i, _mm_loadu_si128(in + i));
    _mm_sfence();  // the streaming stores are visible before the copy is counted complete
    std::memcpy(static_cast<char*>(dst) + vectors * 16, static_cast<const char*>(src) + vectors * 16,
                nbytes - vectors * 16);
    return;
  }
#endif
  std::memcpy(dst, src, nbytes);
}

// The job holds its tensors, not their bytes: a storage freed or shrunk after the launch's checks (resize_(0), as
// code that frees gradients or parameters to save memory does) left a null or short pointer, and the copy thread
// read or wrote through it (a segfault). Checked here, on the copy thread, just before the copy: an error that the
// bucket's wait raises. (A storage freed during the copy itself is not caught: that is a race in the caller.)
void check_bytes_held(const at::Tensor& t, const char* what) {
  const c10::Storage& storage = t.storage();
  const size_t needed = static_cast<size_t>(t.storage_offset() + t.numel()) * t.element_size();  // contiguous
  TORCH_CHECK(storage.data() != nullptr && storage.nbytes() >= needed, "copy_on_host: the ", what, "'s storage ",
              "holds ", storage.nbytes(), " bytes but the copy needs ", needed, ": it was freed or resized after ",
              "the copy was launched (keep a tensor's storage until its bucket's wait returns)");
}

void copy_pair(const at::Tensor& src, const at::Tensor& dst) {
  if (dst.nbytes() == 0) return;  // an empty tensor's data_ptr() may be null, which memcpy/memset must never get
  check_bytes_held(dst, "destination");
  if (src.defined()) check_bytes_held(src, "source");
  if (!src.defined()) {
    std::memset(dst.data_ptr(), 0, dst.nbytes());
    return;
  }
  if (src.scalar_type() == dst.scalar_type()) {
    copy_bytes(dst.data_ptr(), src.data_ptr(), dst.nbytes());
    return;
  }
  const int64_t n = src.numel();
  switch (src.scalar_type()) {
    case at::kFloat: return convert_to(static_cast<const float*>(src.data_ptr()), dst, n);
    case at::kBFloat16: return convert_to(static_cast<const c10::BFloat16*>(src.data_ptr()), dst, n);
    case at::kHalf: return convert_to(static_cast<const c10::Half*>(src.data_ptr()), dst, n);
    default: TORCH_CHECK(false, "copy_on_host: unsupported source dtype ", src.scalar_type());
  }
}

class CpuTransfer final : public BucketTransfer {
 public:
  CpuTransfer(int64_t num_buckets, std::string label)
      : BucketTransfer(num_buckets, std::move(label)), thread_([this] { run(); }) {}

  ~CpuTransfer() override { close(); }

  void order_stream(int64_t channel) override { wait_all(channel, /*until_launched=*/false); }

  void drain_copies() override {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      const int64_t target = queued_;
      changed_.wait(lock, [&] { return finished_ >= target; });
    }
    release_retired();  // a reset step's gradients are not kept until the next launch
  }

  void close_copies() override {
    {
      // launch_mutex_ first: a launch that passed its closed_ check finishes queueing its job before closed_ is
      // set, so the thread still runs it (a job queued after the thread returned would never complete).
      std::lock_guard<std::mutex> order(launch_mutex_);
      std::lock_guard<std::mutex> lock(mutex_);
      closed_ = true;  // the thread drains the queue, then returns
    }
    work_.notify_all();
    changed_.notify_all();
    {
      // One joiner: two threads closing at once would both see joinable() and join the same thread (undefined;
      // seen: one of them blocked for good). The second waits here until the first has joined.
      std::lock_guard<std::mutex> joining(join_mutex_);
      if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
    }
    release_retired();
  }

 protected:
  void start(int64_t channel, int64_t bucket, CopyJob job) override {
    for (size_t i = 0; i < job.srcs.size(); ++i) {
      TORCH_CHECK_VALUE(job.dsts[i].is_cpu() && (!job.srcs[i].defined() || job.srcs[i].is_cpu()),
                        "GradientStreamer: a CPU worker copies between CPU tensors only; pair ", i, " is ",
                        job.srcs[i].defined() ? job.srcs[i].device().str() : "zero", " -> ", job.dsts[i].device());
    }
    release_retired();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(Task{channel, bucket, std::move(job)});
      queued_ += 1;
    }
    work_.notify_one();
  }

  void wait_completed(int64_t channel, int64_t bucket, int64_t target, std::unique_lock<std::mutex>& lock) override {
    Counters& c = counters(channel, bucket);
    changed_.wait(lock, [&] { return c.completed >= target; });
  }

 private:
  struct Task {
    int64_t channel;
    int64_t bucket;
    CopyJob job;
  };

  void run() {
    for (;;) {
      std::unique_lock<std::mutex> lock(mutex_);
      work_.wait(lock, [&] { return !queue_.empty() || closed_; });
      if (queue_.empty()) return;
      Task task = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      std::string error;
      try {
        NvtxRange range(range_name("copy", task.channel, task.bucket, !task.job.completes_bucket));
        copy_on_host(task.job);
      } catch (const c10::Error& e) {
        error = e.what_without_backtrace();  // the bucket's wait raises it again: its frames here say nothing
      } catch (const std::exception& e) {
        error = e.what();
      }
      lock.lock();
      Counters& c = counters(task.channel, task.bucket);
      if (task.job.completes_bucket) c.completed += 1;  // an early part completes with its bucket (in order)
      if (!error.empty()) {  // a part's error belongs to its bucket's next completing launch
        const int64_t launch = task.job.completes_bucket ? c.completed : c.completed + 1;
        if (c.error.empty() || c.error_launch != launch) {  // the launch's first error is the one raised
          c.error = std::move(error);
          c.error_launch = launch;
        }
      }
      finished_ += 1;
      retired_.push_back(std::move(task.job));  // Note [Tensor references leave on the launching thread]
      lock.unlock();
      changed_.notify_all();
    }
  }

  // Note [Tensor references leave on the launching thread]
  // A finished job's tensors may hold the last reference to a Python tensor (the worker already set .grad to None).
  // Dropping it here would take the GIL on this C++ thread: a stall for the copy queue, and at interpreter exit a
  // thread that may not take the GIL any more (CPython ends it with a forced unwind: std::terminate). So the copy
  // thread only retires finished jobs; the thread that launches the next job (or closes) drops them.
  void release_retired() {
    std::vector<CopyJob> retired;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      retired.swap(retired_);
    }
  }  // the references go here, on the calling thread, outside the lock

  std::deque<Task> queue_;
  int64_t queued_ = 0;    // tasks queued so far, early parts included (guarded by mutex_; for drain)
  int64_t finished_ = 0;  // of those, run to the end
  std::vector<CopyJob> retired_;  // guarded by mutex_
  std::condition_variable work_;
  std::mutex join_mutex_;  // close(): one thread joins
  std::thread thread_;  // last member: started once the others exist
};

}  // namespace

void copy_on_host(const CopyJob& job) {
  for (size_t i = 0; i < job.dsts.size(); ++i) copy_pair(job.srcs[i], job.dsts[i]);
}

TransferPtr make_cpu_transfer(int64_t num_buckets, std::string label) {
  return TransferPtr(new CpuTransfer(num_buckets, std::move(label)));
}

}  // namespace pyengine::store
