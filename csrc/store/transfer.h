// BucketTransfer: the copy machinery of one worker's GradientStreamer. Two channels of per-bucket copies:
//   kGrads   — a replica's gradients into the worker's slot of the host store (launched from the grad hooks),
//   kWeights — updated weights from the host store back into the replica (launched after each bucket's update).
// CUDA replicas copy on a dedicated copy stream ordered by events (cuda/cuda_transfer.cpp); CPU replicas copy on one
// copy thread per worker (cpu_transfer.cpp), so the overlap with backward is real without a GPU. Both give the same
// per-bucket waits: the host never waits for the whole device, only for the bucket it is about to read or write.
//
// Note [Pinned buffer busy until its copy's event]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A range of the host store is busy from the moment a copy that reads or writes it is launched until that copy is
// known to be complete: on CUDA, its bucket event has completed (cudaEventSynchronize/Query); on CPU, the copy thread
// has counted it complete. Until then the host must neither read it (a grad slot being filled by D2H holds a mix of
// two steps) nor write it (the fp32 master or the shadow being read by an H2D copy back would ship a half-updated
// bucket to the replica). Launching a copy is not completing it, and a guess ("backward has returned, so the copies
// are done") is wrong: the copy stream runs behind the compute stream. Hence:
//   * the update of bucket k starts only after wait(kGrads, k) for every worker;
//   * the update of bucket k writes the master weights only after wait(kWeights, k) for every worker, i.e. the
//     previous step's copy back of bucket k has completed;
//   * the next forward of a replica runs only after order_current_stream(kWeights): on CUDA its compute stream waits
//     on the copy-back events (no host block), on CPU the host waits for the copy thread.
// On CUDA a replica's gradient is also busy for the stream that reads it: it is recorded on the copy stream (or, when
// it is converted to the slot's dtype first, on the conversion stream), so the caching allocator does not hand its
// memory to the next step before the D2H copy (or the conversion) has read it.
// A launch is ordered after the stream current on the launching thread (the hook of the bucket's last gradient):
// the bucket's other gradients must have been accumulated on that stream too. A forward that runs some parameters'
// ops on a side stream breaks that (autograd accumulates each gradient on its forward op's stream): not supported
// (README, "Host store and gradient streaming"); an early part is ordered after its own gradient's stream.
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace pyengine::store {

enum Channel : int { kGrads = 0, kWeights = 1, kNumChannels = 2 };

const char* channel_name(int channel);

// One bucket's copies: dsts[i] <- srcs[i], converted to dsts[i]'s dtype; an undefined srcs[i] zero-fills dsts[i].
// completes_bucket = false makes it an early part of the bucket (Note [Early copies of large gradients] in
// pyengine/streamer.py): it is copied in launch order like any launch, but the bucket counts as launched, and as
// complete, only with its completing launch, which comes after its parts and so completes after them.
struct CopyJob {
  std::vector<at::Tensor> srcs;
  std::vector<at::Tensor> dsts;
  bool completes_bucket = true;
};

// Copies the pairs of job on the calling thread (CPU tensors): memcpy when the dtypes match, else a converting loop
// (round to nearest even, as Tensor.to does). Used by the CPU copy thread.
void copy_on_host(const CopyJob& job);

class BucketTransfer {
 public:
  BucketTransfer(int64_t num_buckets, std::string label);
  virtual ~BucketTransfer() = default;
  BucketTransfer(const BucketTransfer&) = delete;
  BucketTransfer& operator=(const BucketTransfer&) = delete;

  int64_t num_buckets() const { return num_buckets_; }

  // Starts the copies of bucket `bucket` on `channel` and returns at once. The tensors are checked here: same
  // numel per pair, contiguous, float32/bfloat16/float16. completes_bucket = false: an early part of the bucket
  // (see CopyJob); waits see the bucket launched only once a completing launch follows.
  void launch(int64_t channel, int64_t bucket, std::vector<at::Tensor> srcs, std::vector<at::Tensor> dsts,
              bool completes_bucket = true);

  // Blocks (the caller releases the GIL) until the last launched copy of the bucket has completed, and rethrows an
  // error raised by that copy (each wait does, until release: Note [A failed copy's error]). until_launched: first
  // wait until the bucket has been launched since the last release() (a gradient bucket of a backward that is still
  // running); otherwise a bucket with no copy in flight returns at once. timeout_s >= 0 bounds the wait for the launch (the backward that produces the bucket may have
  // failed or never run): returns false when it ran out, true once the copy is complete. A launched copy always
  // completes, so the wait for completion itself has no timeout.
  bool wait(int64_t channel, int64_t bucket, bool until_launched, double timeout_s = -1.0);
  void wait_all(int64_t channel, bool until_launched);

  // The host is done with the bucket's data of this step: the next wait(until_launched) waits for a new launch, and
  // the error of a failed copy of it (or of an early part of its next launch) is dropped.
  void release(int64_t channel, int64_t bucket);

  // Orders later work after every launched copy of the channel: on CUDA the current stream waits on the bucket
  // events (no host block); on CPU the host waits.
  void order_current_stream(int64_t channel);

  // Blocks until every copy started so far has completed, early parts included, and changes no counter: a waiter
  // of a bucket whose completing launch never came (a failed step) keeps waiting. For failure paths (the CUDA
  // backend synchronizes its copy stream). Returns at once on a closed transfer (close() completed its copies).
  void drain();

  // Completes the copies in flight and releases the copy thread / stream resources. Idempotent. In a forked
  // process: returns at once (Note [A transfer in a forked process]).
  void close();

  // Note [A transfer in a forked process]
  // A fork copies the transfer's memory into the child but not its copy thread (or a usable CUDA context), and its
  // mutexes and condition variables as they were at that instant, possibly held or waited on. In the child every
  // call but close() raises (a wait would wait for a thread that is not there: a hang), close() returns at once,
  // and the object must not be destroyed there: joining a thread of another process crashed, and destroying a
  // condition variable the parent's copy thread was waiting on blocks for good. The factories' TransferPtr
  // (ForkSafeDelete) leaks it there instead (the memory is the child's copy; the parent's transfer is unaffected).
  bool forked() const;

 protected:
  // The backend's halves of order_current_stream(), drain() and close(), called in the process that made it.
  virtual void order_stream(int64_t channel) = 0;
  virtual void drain_copies() = 0;
  virtual void close_copies() = 0;

  struct Counters {
    int64_t launched = 0;   // completing launches so far (early parts are not counted)
    int64_t completed = 0;  // their completions so far (copies of one bucket and channel complete in launch order)
    int64_t released = 0;   // value of `launched` at the last release
    std::string error;      // the error of a failed copy: Note [A failed copy's error]
    int64_t error_launch = 0;  // the completing launch it belongs to (an early part's: its bucket's next one)
  };
  // Note [A failed copy's error]
  // Every wait for a launch whose copy failed raises its error, not only the first: the worker's thread (the end of
  // its backward pass) and the host (the update of the bucket) both wait for a gradient bucket, and the one that got
  // no error went on with a torn slot (the host updated the bucket from it). The error stays until the bucket is
  // released (the host is done with the step's data: reset(), a copy back); a wait for a later launch of the bucket
  // does not raise it.

  // Begins the copies of a launch (called with mutex_ not held, in launch order per transfer).
  virtual void start(int64_t channel, int64_t bucket, CopyJob job) = 0;
  // Blocks until the copy counted as launch number `target` has completed; called and returns with lock held.
  virtual void wait_completed(int64_t channel, int64_t bucket, int64_t target, std::unique_lock<std::mutex>& lock) = 0;

  Counters& counters(int64_t channel, int64_t bucket) { return counters_[channel * num_buckets_ + bucket]; }
  void check_index(int64_t channel, int64_t bucket, const char* what) const;
  // "pyengine/<verb> <channel> b<bucket> [early ]<label>" (early: a part launched ahead of its bucket).
  std::string range_name(const char* verb, int64_t channel, int64_t bucket, bool part = false) const;

  void check_process(const char* what) const;  // raises in a forked process (Note [A transfer in a forked process])

  const int64_t num_buckets_;
  const std::string label_;
  const int64_t owner_pid_;  // the process that made it
  std::mutex mutex_;
  std::condition_variable changed_;  // notified on every launch and completion
  std::mutex launch_mutex_;          // keeps the order of start() calls equal to the order of launches
  std::vector<Counters> counters_;
  bool closed_ = false;
};

// Deletes a transfer in the process that made it; in a forked one leaves it (Note [A transfer in a forked process]).
struct ForkSafeDelete {
  void operator()(BucketTransfer* transfer) const;
};
using TransferPtr = std::unique_ptr<BucketTransfer, ForkSafeDelete>;

// A transfer for a replica on `device`: the copy thread for CPU, the copy stream for CUDA (CUDA builds only).
TransferPtr make_transfer(int64_t num_buckets, const at::Device& device, std::string label);

TransferPtr make_cpu_transfer(int64_t num_buckets, std::string label);
#ifdef PYENGINE_WITH_CUDA
TransferPtr make_cuda_transfer(int64_t num_buckets, const at::Device& device, std::string label);
#endif

}  // namespace pyengine::store
