// Unit tests of the host store's C++ core, without Python:
//   - allocate_arena: exact size, page alignment, zeroed; the pinned path's error without a usable CUDA device;
//   - the CPU BucketTransfer: copies (same dtype, converting to bf16 like Tensor.to, zero-fill), per-bucket waits,
//     release, the launch timeout, a wait woken by a launch from another thread, early parts of a bucket (not counted
//     as its launch; drain), errors for bad arguments and for a transfer closed before the bucket came, a transfer
//     in a forked process.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "store/arena.h"
#include "store/transfer.h"

namespace {

using pyengine::store::kGrads;
using pyengine::store::kWeights;
using Clock = std::chrono::steady_clock;

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "";
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void test_arena() {
  const int64_t nbytes = 3 * 4096 + 17;
  const at::Tensor arena = pyengine::store::allocate_arena(nbytes, /*pinned=*/false);
  CHECK(arena.numel() == nbytes && arena.scalar_type() == at::kByte, "arena of " << arena.numel() << " bytes");
  CHECK(reinterpret_cast<uintptr_t>(arena.data_ptr()) % 4096 == 0, "arena not page-aligned");
  CHECK(arena.count_nonzero().item<int64_t>() == 0, "arena not zeroed");
  if (!pyengine::store::pinned_allocation_available()) {
    const std::string error = error_of([&] { pyengine::store::allocate_arena(nbytes, /*pinned=*/true); });
    CHECK(error.find(std::to_string(nbytes)) != std::string::npos && error.find("pin=False") != std::string::npos,
          "the pinned error must name the bytes asked and the pin=False fallback; got: " << error);
  }
}

void test_copies_and_waits() {
  auto transfer = pyengine::store::make_cpu_transfer(3, "test");
  const at::Tensor a = at::randn({1001}), b = at::randn({77});
  at::Tensor slot = at::full({1001 + 77 + 5}, 7.0f);
  at::Tensor low = at::empty({1001}, at::kBFloat16);
  transfer->launch(kGrads, 0, {a, at::Tensor(), b},
                   {slot.narrow(0, 0, 1001), slot.narrow(0, 1001, 5), slot.narrow(0, 1006, 77)});
  transfer->launch(kGrads, 1, {a}, {low});
  CHECK(transfer->wait(kGrads, 0, true), "bucket 0 launched but wait said it timed out");
  CHECK(transfer->wait(kGrads, 1, true, 5.0), "bucket 1 launched but wait timed out");
  CHECK(at::equal(slot.narrow(0, 0, 1001), a) && at::equal(slot.narrow(0, 1006, 77), b), "copies differ");
  CHECK(slot.narrow(0, 1001, 5).count_nonzero().item<int64_t>() == 0, "an undefined source must zero-fill");
  CHECK(at::equal(low, a.to(at::kBFloat16)), "the bf16 conversion must round like Tensor.to");

  // Bucket 2 was never launched: a bounded wait returns false after about its timeout.
  auto start = Clock::now();
  CHECK(!transfer->wait(kGrads, 2, true, 0.05), "a wait for a bucket never launched returned true");
  const double waited = seconds_since(start);
  CHECK(waited >= 0.04 && waited < 5.0, "timeout 0.05 s waited " << waited << " s");
  // Released: the next wait is for the next launch.
  transfer->release(kGrads, 0);
  CHECK(!transfer->wait(kGrads, 0, true, 0.0), "a released bucket counted as launched");
  // A wait without timeout is woken by a launch from another thread.
  std::thread producer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    transfer->launch(kGrads, 2, {b}, {slot.narrow(0, 0, 77)});
  });
  start = Clock::now();
  CHECK(transfer->wait(kGrads, 2, true), "the woken wait returned false");
  producer.join();
  CHECK(at::equal(slot.narrow(0, 0, 77), b), "the copy launched from another thread is not in the slot");
  // The weights channel is separate: nothing launched there, and a wait that does not ask for a launch returns.
  CHECK(transfer->wait(kWeights, 0, false), "weights channel wait without a launch blocked or failed");

  // An early part of bucket 1 is copied, but the bucket counts as launched only with its completing launch.
  transfer->release(kGrads, 1);
  const at::Tensor c = at::randn({1001});
  transfer->launch(kGrads, 1, {c}, {slot.narrow(0, 0, 1001)}, /*completes_bucket=*/false);
  CHECK(!transfer->wait(kGrads, 1, true, 0.05), "an early part alone counted as the bucket's launch");
  transfer->launch(kGrads, 1, {b}, {slot.narrow(0, 1006, 77)});
  CHECK(transfer->wait(kGrads, 1, true, 5.0), "the completing launch after a part was not seen");
  CHECK(at::equal(slot.narrow(0, 0, 1001), c) && at::equal(slot.narrow(0, 1006, 77), b),
        "the part's and the completing launch's copies must both be in the slot");
  transfer->release(kGrads, 1);
  CHECK(!transfer->wait(kGrads, 1, true, 0.0), "a part and its completing launch counted as two launches");
  // drain() completes a part whose bucket never completes (a failed step) and delivers nothing.
  const at::Tensor big = at::randn({1 << 22});
  at::Tensor big_slot = at::full({1 << 22}, 7.0f);
  transfer->launch(kGrads, 1, {big}, {big_slot}, /*completes_bucket=*/false);
  transfer->drain();
  CHECK(at::equal(big_slot, big), "drain() returned before the early part was copied");
  CHECK(!transfer->wait(kGrads, 1, true, 0.0), "drain() delivered the bucket");
  transfer->close();
  transfer->drain();  // closed: returns at once
}

void test_bad_arguments() {
  auto transfer = pyengine::store::make_cpu_transfer(2, "bad");
  std::string error = error_of([&] { transfer->launch(kGrads, 0, {at::randn({5})}, {at::empty({4})}); });
  CHECK(error.find("srcs[0] has 5 elements but dsts[0] has 4") != std::string::npos, "numel mismatch: " << error);
  error = error_of([&] { transfer->launch(kGrads, 2, {}, {}); });
  CHECK(error.find("bucket must be in [0, 2)") != std::string::npos, "bucket index: " << error);
  error = error_of([&] { transfer->launch(kGrads, 0, {at::randn({4})}, {at::empty({4}, at::kDouble)}); });
  CHECK(error.find("float32, bfloat16 or float16") != std::string::npos, "dtype: " << error);
  error = error_of([&] { transfer->launch(kGrads, 0, {at::randn({4, 2}).t()}, {at::empty({8})}); });
  CHECK(error.find("contiguous") != std::string::npos, "non-contiguous source: " << error);
  std::thread closer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    transfer->close();
  });
  error = error_of([&] { transfer->wait(kGrads, 1, true); });
  closer.join();
  CHECK(error.find("closed before bucket 1 was launched") != std::string::npos, "closed transfer: " << error);
}

// Note [A transfer in a forked process]: in a child forked while the copy thread waits for work, every call but
// close() raises, close() returns at once and the transfer is left undestroyed (joining the parent's thread crashed;
// destroying the condition variable it waited on blocks); the parent's transfer goes on.
void test_fork() {
  auto transfer = pyengine::store::make_cpu_transfer(1, "fork");
  at::Tensor src = at::randn({64}), dst = at::zeros({64});
  transfer->launch(kGrads, 0, {src}, {dst});
  CHECK(transfer->wait(kGrads, 0, true), "the first copy");
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the copy thread back to waiting for work
  const pid_t child = fork();
  if (child == 0) {
    const std::string error = error_of([&] { transfer->wait(kGrads, 0, false); });
    const bool refused = error.find("a fork of it") != std::string::npos &&
                         !error_of([&] { transfer->launch(kGrads, 0, {src}, {dst}); }).empty();
    transfer->close();
    transfer.reset();  // left, not destroyed
    std::_Exit(refused ? 0 : 3);
  }
  int status = 0;
  CHECK(waitpid(child, &status, 0) == child, "waitpid");
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the forked child: status " << status);
  at::Tensor src2 = at::randn({64});
  transfer->launch(kGrads, 0, {src2}, {dst});
  CHECK(transfer->wait(kGrads, 0, true) && at::equal(dst, src2), "the parent's transfer after the fork");
  transfer->close();
}

}  // namespace

int main() {
  test_arena();
  test_copies_and_waits();
  test_bad_arguments();
  test_fork();
  return pyengine::test::finish("test_store");
}
