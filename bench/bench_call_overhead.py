"""Per-call cost of the update ops on tiny tensors, where the call is all there is: the Python wrapper's checks, the
dispatcher, and the ADInplaceOrView kernel that bumps the version counters of what the op writes (Note [Version
counters of the in-place ops] in csrc/ops.cpp).

Each round times the same calls under ``torch.no_grad()`` (the engine's case: the version-counter kernel runs) and
under ``torch.inference_mode()`` on inference tensors (the dispatcher skips ADInplaceOrView, so the kernel does
not run), interleaved; the median difference is an upper bound of that kernel's cost (inference mode skips a little
more than that kernel).

    OMP_NUM_THREADS=1 python bench/bench_call_overhead.py [--calls 3000] [--rounds 7]
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs without install
import pyengine.ops as ops  # noqa: E402


def _buffers(n: int, tensors: int, g: int):
    params = [torch.randn(n) for _ in range(tensors)]
    zeros = lambda: [torch.zeros(n) for _ in range(tensors)]  # noqa: E731
    return params, zeros(), zeros(), [[torch.randn(n) for _ in range(tensors)] for _ in range(g)]


def time_calls(form: str, inference: bool, calls: int, g: int = 2, tensors: int = 8, n: int = 7) -> float:
    """Microseconds per call of the ``form`` ("flat" or "multi") op on fresh buffers of ``n`` elements."""
    mode = torch.inference_mode if inference else torch.no_grad
    with mode():
        params, exp_avgs, exp_avg_sqs, grads = _buffers(n, 1 if form == "flat" else tensors, g)
        if form == "flat":
            call = lambda step: ops.mean_grad_adamw_(params[0], exp_avgs[0], exp_avg_sqs[0],  # noqa: E731
                                                     [w[0] for w in grads], lr=1e-3, step=step)
        else:
            call = lambda step: ops.mean_grad_adamw_multi_(params, exp_avgs, exp_avg_sqs, grads,  # noqa: E731
                                                           lr=1e-3, step=step)
        call(1)  # first call: dispatcher caches
        start = time.perf_counter()
        for step in range(2, calls + 2):
            call(step)
        return (time.perf_counter() - start) / calls * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.calls} calls x {args.rounds} "
          "rounds, interleaved")
    print("| op | no_grad us/call | inference_mode us/call | difference us (median of rounds) |")
    print("|---|---|---|---|")
    for form in ("flat", "multi"):
        tracked, skipped = [], []
        for _ in range(args.rounds):
            tracked.append(time_calls(form, False, args.calls))
            skipped.append(time_calls(form, True, args.calls))
        diff = statistics.median(a - b for a, b in zip(tracked, skipped))
        label = "mean_grad_adamw_ (1 tensor, G=2)" if form == "flat" else "mean_grad_adamw_multi_ (8 tensors, G=2)"
        print(f"| {label} | {statistics.median(tracked):.2f} | {statistics.median(skipped):.2f} | {diff:+.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
