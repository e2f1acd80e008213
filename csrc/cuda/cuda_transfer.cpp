// The CUDA backend of BucketTransfer: one copy stream per worker, ordered by events, never by a device or stream
// synchronisation on the host (drain(), for failure paths, is the exception). A gradient bucket's D2H copy waits on
// an event recorded on the compute stream when the bucket's last gradient is ready (an early part: when its own
// is); every completing launch records the bucket's completion event on the copy stream; the host waits on that
// one event (wait) and the compute stream waits on the copy-back events before the next forward
// (order_current_stream). See Note [Pinned buffer busy until its copy's event] in store/transfer.h.
//
// Note [Gradients converted on a stream of their own]
// A gradient copied into a slot of another dtype (float32 gradients into bfloat16 slots: Engine(autocast=...)) is
// converted on the device first. Tensor.copy_ does that on the stream it runs on, so on the copy stream each
// conversion kernel ran between two copies and the copy engine waited for it: the H100 run of 2026-11-26 (RESULTS)
// streamed bfloat16 slots at 0.79-0.82 of a raw copy of the same bytes, float32 slots at 0.96-0.98. Conversions now
// run on a second stream (made at the first one, so transfers without conversions take no stream from the pool):
// it waits on the bucket's ready event, converts, records the bucket's converted event, and the copy stream waits on
// that; a launch's conversion then runs while the previous launch's copy is in flight. The conversions write into
// two staging buffers of the transfer's own, used in turn: a conversion into one first waits (on the device) for
// the copies that read it last time, so at most two launches' converted gradients are held on the device, each
// buffer as large as the largest launch so far (a bucket, or an early part), in the slots' dtype. (Converted
// tensors allocated per launch would be held until their copies complete, which the host learns only later: in a
// copy-bound step, up to every converted gradient of the step.) The buffers are recorded on the copy stream
// (copy_pair), the gradients read by a conversion on the conversion stream; the conversion is the kernel copy_ used,
// so the slots' bits are unchanged.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>
#include <optional>

#include "../store/nvtx.h"
#include "../store/transfer.h"

namespace pyengine::store {
namespace {

class CudaTransfer final : public BucketTransfer {
 public:
  CudaTransfer(int64_t num_buckets, const at::Device& device, std::string label)
      : BucketTransfer(num_buckets, std::move(label)),
        device_(device.index() < 0 ? at::Device(at::kCUDA, c10::cuda::current_device()) : device),
        // High priority: a pool apart from the workers' compute streams (torch.cuda.Stream() takes the low-priority
        // one, 32 streams round-robin), so a copy stream is never some worker's compute stream, and a bucket's copy
        // is launched ahead of backward's queued kernels.
        copy_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_.index())),
        ready_(num_buckets),
        converted_(num_buckets),
        done_(kNumChannels * num_buckets) {}

  ~CudaTransfer() override {
    try {
      close();
    } catch (...) {
      // A failing device cannot be reported from a destructor; close() raised it already if it was called.
    }
  }

  void order_stream(int64_t channel) override {
    c10::cuda::CUDAGuard guard(device_);
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device_.index());
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t k = 0; k < num_buckets_; ++k) {
      if (counters(channel, k).launched > 0) done_[channel * num_buckets_ + k].block(current);
    }
  }

  void drain_copies() override {
    c10::cuda::CUDAGuard guard(device_);
    std::optional<c10::cuda::CUDAStream> convert;
    {
      std::lock_guard<std::mutex> order(launch_mutex_);  // start() makes the conversion stream under it
      convert = convert_stream_;
    }
    copy_stream_.synchronize();  // a failure path: every copy enqueued so far, early parts included
    if (convert) convert->synchronize();  // and a conversion whose copy a failed launch never issued
  }

  void close_copies() override {
    {
      std::lock_guard<std::mutex> order(launch_mutex_);  // a launch in progress enqueues before the synchronize
      std::lock_guard<std::mutex> lock(mutex_);
      if (closed_) return;
      closed_ = true;
    }
    changed_.notify_all();
    c10::cuda::CUDAGuard guard(device_);
    copy_stream_.synchronize();  // copies in flight read or write memory their owners may free next
    if (convert_stream_) convert_stream_->synchronize();
  }

 protected:
  void start(int64_t channel, int64_t bucket, CopyJob job) override {
    c10::cuda::CUDAGuard guard(device_);
    NvtxRange range(range_name(channel == kGrads ? "d2h" : "h2d", channel, bucket, !job.completes_bucket));
    // The copies read what the compute stream wrote (gradients) or overwrite what it reads (weights): they start
    // after the work enqueued so far on the current stream.
    at::cuda::CUDAEvent& ready = ready_[bucket];
    ready.record(c10::cuda::getCurrentCUDAStream(device_.index()));
    int64_t bytes = 0;                  // the converted gradients' room in a staging buffer
    const at::Tensor* first = nullptr;  // the first gradient to convert, if any (an unused parameter's is undefined)
    for (size_t i = 0; i < job.srcs.size(); ++i) {
      if (!converts(job.srcs[i], job.dsts[i])) continue;
      bytes += staged_bytes(job.dsts[i]);
      if (first == nullptr) first = &job.srcs[i];
    }
    int staging = -1;  // the staging buffer this launch converts into, if any
    if (first != nullptr) {  // Note [Gradients converted on a stream of their own]
      if (!convert_stream_) {
        convert_stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_.index());
        // the pool hands out its 32 streams round-robin: this transfer's copy stream again, once in 32 transfers
        if (*convert_stream_ == copy_stream_) {
          convert_stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_.index());
        }
      }
      const c10::cuda::CUDAStream convert = *convert_stream_;
      staging = next_staging_;
      next_staging_ = 1 - next_staging_;
      ready.block(convert);
      staging_free_[staging].block(convert);  // the copies that read this buffer last time have completed
      c10::cuda::CUDAStreamGuard convert_guard(convert);
      at::Tensor& buffer = staging_[staging];
      if (!buffer.defined() || buffer.numel() < bytes) {
        buffer.reset();  // back to the allocator once the copies recorded on it are done
        buffer = first->new_empty({bytes}, first->options().dtype(at::kByte));
      }
      int64_t offset = 0;
      for (size_t i = 0; i < job.srcs.size(); ++i) {
        if (!converts(job.srcs[i], job.dsts[i])) continue;
        const at::Tensor& grad = job.srcs[i];
        const at::Tensor& dst = job.dsts[i];
        at::Tensor out =
            buffer.narrow(0, offset, dst.numel() * dst.element_size()).view(dst.scalar_type()).view(dst.sizes());
        out.copy_(grad.view(dst.sizes()));  // the conversion, on the conversion stream
        c10::cuda::CUDACachingAllocator::recordStream(grad.storage().data_ptr(), convert);
        job.srcs[i] = out;
        offset += staged_bytes(dst);
      }
      at::cuda::CUDAEvent& converted = converted_[bucket];
      converted.record(convert);
      converted.block(copy_stream_);  // after ready too: the conversion stream waited on it
    } else {
      ready.block(copy_stream_);
    }
    for (size_t i = 0; i < job.dsts.size(); ++i) {
      if (!job.srcs[i].defined() && !job.dsts[i].is_cuda()) {
        // A host slot is zeroed by the host, now (copy_pair): this bucket's previous copy into it may still be in
        // flight on the copy stream and would land after the zeros (the CPU transfer orders both on its thread).
        done_[channel * num_buckets_ + bucket].synchronize();
        break;
      }
    }
    c10::cuda::CUDAStreamGuard stream_guard(copy_stream_);
    try {
      for (size_t i = 0; i < job.dsts.size(); ++i) copy_pair(job.srcs[i], job.dsts[i]);
    } catch (...) {
      // copies enqueued before the error may still read the staging buffer: its next conversion waits for them
      if (staging >= 0) staging_free_[staging].record(copy_stream_);
      throw;
    }
    // Only a completing launch records the bucket's event: it follows the bucket's early parts on this stream, so
    // it completes after them too; and the zero-fill above waits for the previous step's copies of the bucket,
    // not for an early part of this step still queued behind backward's kernels (a host stall mid-backward).
    if (job.completes_bucket) done_[channel * num_buckets_ + bucket].record(copy_stream_);
    if (staging >= 0) staging_free_[staging].record(copy_stream_);
  }

  void wait_completed(int64_t channel, int64_t bucket, int64_t target, std::unique_lock<std::mutex>& lock) override {
    at::cuda::CUDAEvent& done = done_[channel * num_buckets_ + bucket];
    lock.unlock();
    {
      c10::cuda::CUDAGuard guard(device_);
      done.synchronize();  // a launch in between re-records the event: waiting longer is still correct
    }
    lock.lock();
    Counters& c = counters(channel, bucket);
    c.completed = std::max(c.completed, target);
  }

 private:
  // A device gradient into a host slot of another dtype: converted before its copy.
  static bool converts(const at::Tensor& src, const at::Tensor& dst) {
    return src.defined() && src.is_cuda() && !dst.is_cuda() && src.scalar_type() != dst.scalar_type();
  }
  static int64_t staged_bytes(const at::Tensor& dst) {  // a converted gradient's room in a staging buffer
    constexpr int64_t kAlign = 256;
    return (dst.numel() * dst.element_size() + kAlign - 1) / kAlign * kAlign;
  }

  // Runs on the copy stream (current under the caller's guard).
  void copy_pair(const at::Tensor& src, const at::Tensor& dst) {
    if (!src.defined()) {
      if (dst.is_cuda()) {
        dst.zero_();
        c10::cuda::CUDACachingAllocator::recordStream(dst.storage().data_ptr(), copy_stream_);
      } else {
        std::memset(dst.data_ptr(), 0, dst.nbytes());  // host slot of an unused parameter: no copy reads it now
      }
      return;
    }
    // Equal element counts, any shapes (a [7, 7] gradient into its flat slot): view the contiguous src as dst.
    // The caching allocator must not reuse a device block before this stream is done with it (recorded first: a
    // copy that raises after enqueueing still has its blocks recorded).
    if (src.is_cuda()) c10::cuda::CUDACachingAllocator::recordStream(src.storage().data_ptr(), copy_stream_);
    if (dst.is_cuda()) c10::cuda::CUDACachingAllocator::recordStream(dst.storage().data_ptr(), copy_stream_);
    dst.copy_(src.view(dst.sizes()), /*non_blocking=*/true);
  }

  const at::Device device_;
  c10::cuda::CUDAStream copy_stream_;
  std::optional<c10::cuda::CUDAStream> convert_stream_;  // made at the first conversion (start, under launch_mutex_)
  std::vector<at::cuda::CUDAEvent> ready_;      // per bucket: compute-stream point the copies start after
  std::vector<at::cuda::CUDAEvent> converted_;  // per bucket: the conversions' end on convert_stream_
  at::Tensor staging_[2];                       // bytes the conversions write, used in turn (start, launch_mutex_)
  at::cuda::CUDAEvent staging_free_[2];         // the end of the copies that read each staging buffer last
  int next_staging_ = 0;
  std::vector<at::cuda::CUDAEvent> done_;       // per channel and bucket: completion of the last launch
};

}  // namespace

TransferPtr make_cuda_transfer(int64_t num_buckets, const at::Device& device, std::string label) {
  return TransferPtr(new CudaTransfer(num_buckets, device, std::move(label)));
}

}  // namespace pyengine::store
