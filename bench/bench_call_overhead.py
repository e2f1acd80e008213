"""Per-call cost of the update ops on tiny tensors, where the call is all there is: the Python wrapper's checks, the
dispatcher, and the ADInplaceOrView kernel that bumps the version counters of what the op writes (Note [Version
counters of the in-place ops] in csrc/ops.cpp).

Each round times the same calls under ``torch.no_grad()`` (the engine's case: the version-counter kernel runs) and
under ``torch.inference_mode()`` on inference tensors (the dispatcher skips ADInplaceOrView, so the kernel does
not run), interleaved; the median difference is an upper bound of that kernel's cost (inference mode skips a little
more than that kernel).

A second table splits the wrapper's cost: the raw op (``torch.ops.pyengine.mean_grad_adamw_.default`` with every
argument given, as the engine calls it), the public wrapper, and ``torch.Tensor.add_`` on the same tensor as a
yardstick of the machine's speed at that moment, all interleaved. ``--checkout DIR`` imports pyengine from another
checkout (built with ``make build``, or ``PYENGINE_CPU_ONLY=1 python setup.py build_ext --inplace``), so two
versions are compared by running the script once per checkout, alternately.

    OMP_NUM_THREADS=1 python bench/bench_call_overhead.py [--calls 3000] [--rounds 7] [--checkout DIR]
"""
import argparse
import os
import statistics
import sys
import time

import torch


def _import_ops(checkout: str):
    """pyengine.ops from ``checkout`` (a checkout runs without install), refusing an installed copy in its place."""
    sys.path.insert(0, os.path.abspath(checkout))
    import pyengine.ops as module
    if not os.path.abspath(module.__file__).startswith(os.path.join(os.path.abspath(checkout), "")):
        raise SystemExit(f"pyengine was imported from {module.__file__}, not from {checkout}")
    return module


ops = None  # main() imports it


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


def time_split(calls: int, rounds: int) -> dict:
    """Median microseconds per call of the raw flat op, its wrapper and ``add_``, interleaved, under no_grad."""
    with torch.no_grad():
        params, exp_avgs, exp_avg_sqs, grads = _buffers(7, 1, 2)
        p, m, v, g = params[0], exp_avgs[0], exp_avg_sqs[0], [w[0] for w in grads]
        raw = torch.ops.pyengine.mean_grad_adamw_.default
        forms = {
            "raw op": lambda step: raw(p, m, v, g, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                       step=step, adamw=True, maximize=False, amsgrad=False, max_exp_avg_sq=None,
                                       grad_scale=None, found_inf=None, weights=None, param_out=None,
                                       grad_norm=None, max_grad_norm=0.0),
            "wrapper": lambda step: ops.mean_grad_adamw_(p, m, v, g, lr=1e-3, step=step),
            "add_": lambda step: p.add_(0.0),
        }
        times = {name: [] for name in forms}
        for call in forms.values():
            call(1)
        for _ in range(rounds):
            for name, call in forms.items():
                start = time.perf_counter()
                for step in range(2, calls + 2):
                    call(step)
                times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> int:
    global ops
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--checkout", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the checkout whose pyengine is timed (default: this one)")
    args = parser.parse_args(argv)
    ops = _import_ops(args.checkout)
    print(f"pyengine from {os.path.dirname(ops.__file__)}; torch {torch.__version__}, {torch.get_num_threads()} "
          f"thread(s), {args.calls} calls x {args.rounds} rounds, interleaved")
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
    split = time_split(args.calls, args.rounds)
    print("\n| flat op (1 tensor, G=2), no_grad | raw op us/call | wrapper us/call | wrapper - raw | "
          "`add_` us/call (yardstick) |")
    print("|---|---|---|---|---|")
    print(f"| medians of rounds | {split['raw op']:.2f} | {split['wrapper']:.2f} | "
          f"{split['wrapper'] - split['raw op']:+.2f} | {split['add_']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
