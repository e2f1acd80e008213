"""CPU overlap of gradient streaming: backward with the copy thread vs backward then copy.

A ~50M-parameter MLP (PYENGINE_BENCH_PARAMS_M to change) on one CPU worker. Per round, interleaved:
  backward  — backward alone (grads zeroed in place, never freed: no page faults in the timing),
  copy      — the same bucket copies alone (all buckets launched on the copy thread, then waited for),
  serial    — backward, then the copies,
  overlap   — backward with the GradientStreamer's hooks launching the copies, then wait_all.
Overlap efficiency = max(backward, copy) / overlap (1.0 is perfect overlap; serial gives about
max / (backward + copy)). The slots are checked bit for bit against param.grad before anything is timed.

A second measure, the per-call cost of ``GradientStreamer.wait_all`` on buckets already delivered (the end of every
worker's step): it waits bucket by bucket in bounded waits, so that Ctrl-C interrupts it, against one call of the
transfer's own ``wait_all`` (C++), interleaved, on a 200-bucket model.

Run: python -m pytest bench/bench_streamer.py --benchmark-only -s   (1 and 2 intra-op threads)
     python bench/bench_streamer.py                                (a table, more rounds)
"""
import os
import statistics
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs without install
import pyengine  # noqa: E402

PARAMS_M = float(os.environ.get("PYENGINE_BENCH_PARAMS_M", "50"))
WIDTH = 2048
BATCH = 32
ROUNDS = int(os.environ.get("PYENGINE_BENCH_ROUNDS", "5"))


def make_model():
    layers = max(1, round(PARAMS_M * 1e6 / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


class Setup:
    """The model, a one-worker store, the streamer's bucket partition, and a bare transfer for the copy-alone and
    serial timings (the same C++ copies the streamer launches from its hooks)."""

    def __init__(self):
        self.model = make_model()
        self.x = torch.randn(BATCH, WIDTH)
        self.store = pyengine.HostStore(self.model, workers=1, pin=False)
        self.nparams = sum(p.numel() for p in self.model.parameters())
        self.bytes = self.nparams * 4
        with self.streamer() as streamer:
            buckets = streamer.buckets
        self.transfer = pyengine._C.BucketTransfer(len(buckets), "cpu", "bench")
        named = dict(self.model.named_parameters())
        slot = self.store.grad_slot(0)
        entries = [[self.store.entry(n) for n in b.names] for b in buckets]
        self.jobs = [([named[e.name] for e in bucket], [slot[e.offset:e.offset + e.numel] for e in bucket])
                     for bucket in entries]

    def streamer(self):
        return pyengine.GradientStreamer(self.model, self.store, worker=0)

    def backward(self):
        self.model.zero_grad(set_to_none=False)  # in place: no page faults inside the timings
        return self.model(self.x).square().mean().backward

    def copy_all(self):
        for k, (params, dsts) in enumerate(self.jobs):
            self.transfer.launch(0, k, [p.grad for p in params], dsts)
        self.transfer.wait_all(0, False)


def streamed_step(backward, streamer):
    """Backward with the hooks launching the bucket copies, then the host waits for the last bucket."""
    backward()
    streamer.wait_all()
    for k in range(len(streamer.buckets)):  # consumed: the next wait is for the next backward
        streamer._transfer.release(0, k)


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def check_slots(setup):
    with setup.streamer() as streamer:
        streamed_step(setup.backward(), streamer)
    named = dict(setup.model.named_parameters())
    for name, view in setup.store.views(setup.store.grad_slot(0)).items():
        assert torch.equal(view, named[name].grad), name


def measure(rounds=ROUNDS):
    """Medians (s) of backward, copy, serial and overlap, interleaved per round; checks the slots first."""
    setup = Setup()
    check_slots(setup)
    times = {"backward": [], "copy": [], "serial": [], "overlap": []}
    for _ in range(rounds + 1):  # the first round warms up
        times["backward"].append(timed(setup.backward()))
        times["copy"].append(timed(setup.copy_all))
        backward = setup.backward()
        times["serial"].append(timed(lambda: (backward(), setup.copy_all())))
        with setup.streamer() as streamer:
            backward = setup.backward()
            times["overlap"].append(timed(lambda: streamed_step(backward, streamer)))
    setup.transfer.close()
    return {key: statistics.median(values[1:]) for key, values in times.items()}, setup


def report(med, setup, threads):
    best = max(med["backward"], med["copy"])
    return {
        "threads": threads, "params": setup.nparams, "buckets": len(setup.jobs), "copy_bytes": setup.bytes,
        "backward_ms": 1e3 * med["backward"], "copy_ms": 1e3 * med["copy"],
        "copy_GBps_rw": 2 * setup.bytes / med["copy"] / 1e9, "serial_ms": 1e3 * med["serial"],
        "overlap_ms": 1e3 * med["overlap"], "overlap_efficiency": best / med["overlap"],
        "serial_efficiency": best / med["serial"],
    }


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_backward_copy_overlap(benchmark, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        med, setup = measure()
        info = report(med, setup, threads)
        benchmark.extra_info.update(info)
        print("\n" + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items()))
        with setup.streamer() as streamer:
            benchmark.pedantic(streamed_step, setup=lambda: ((setup.backward(), streamer), {}), rounds=ROUNDS,
                               warmup_rounds=1)
    finally:
        torch.set_num_threads(old)


def measure_wait_all(rounds: int = 21, calls: int = 100, benchmark=None) -> dict:
    """Median microseconds per call of streamer.wait_all() and of its transfer's C++ wait_all on 200 delivered
    buckets; ``benchmark`` (pytest-benchmark's fixture) then times streamer.wait_all() itself."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(100)])  # 200 parameters, a bucket each
    store = pyengine.HostStore(model, pin=False)
    times = {"streamer": [], "transfer": []}
    with pyengine.GradientStreamer(model, store, bucket_mb=1e-6, first_bucket_mb=1e-6) as streamer:
        with streamer.backward_pass(loss := model(torch.randn(4, 16)).square().mean()):
            loss.backward()
        calls_of = {"streamer": streamer.wait_all, "transfer": lambda: streamer._transfer.wait_all(0, True)}
        for _ in range(rounds):
            for key, call in calls_of.items():
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                times[key].append((time.perf_counter() - start) / calls)
        buckets = len(streamer.buckets)
        if benchmark is not None:
            benchmark.pedantic(streamer.wait_all, rounds=rounds * calls, warmup_rounds=1)
    return {"buckets": buckets, **{f"{k}_us": 1e6 * statistics.median(v) for k, v in times.items()}}


def test_wait_all_call_cost(benchmark):
    info = measure_wait_all(rounds=7, benchmark=benchmark)
    benchmark.extra_info.update(info)
    print("\n" + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items()))


if __name__ == "__main__":
    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in measure_wait_all().items()))
    for threads in (1, 2):
        torch.set_num_threads(threads)
        med, setup = measure(rounds=int(os.environ.get("PYENGINE_BENCH_ROUNDS", "15")))
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in report(med, setup, threads).items()))
