"""Fused mean-gradient AdamW (pyengine.ops.mean_grad_adamw_) against the stock torch paths.

Paths, all on preallocated buffers, each checked against the stock result before it is timed:

- ``ours``:  ``pyengine.ops.mean_grad_adamw_(param, m, v, grads, ...)``, one pass over memory.
- ``plain`` (CPU, where the update prefetches by default: Intel CPUs): ``ours`` with its plain loops
  (``pyengine._C._set_cpu_prefetch(False)`` around the call; Note [Prefetching the streams] in csrc/cpu/kernel_isa.cpp).
- ``stock``: the best stock path: ``torch.add(g0, g1, out=buf)`` (bf16/fp16: ``buf.copy_(g0)``, torch would add
  two 16-bit tensors in 16 bits), ``torch._foreach_add_`` of the remaining gradients into that one fp32 buffer,
  ``mul_(1/G)``, then ``torch.optim.AdamW(fused=True).step()`` (G=1: the fp32 gradient is the ``.grad`` itself; a
  16-bit one is copied into the fp32 buffer, fused AdamW needs the param's dtype).
- ``stack``: ``torch.stack(grads, out=...)``, ``torch.mean(..., 0, out=buf)`` + fused AdamW.
- ``adamw``: fused AdamW alone on a ready fp32 gradient (the floor for G=1).
- ``deepspeed``: the mean as in ``stock``, then DeepSpeed's CPU Adam on ours' own buffers (the same addresses), when
  deepspeed is importable.

Bytes counted for one update (the fewest a single pass can move): 4N(G+6) with fp32 gradients, 2NG+24N with 16-bit
ones (bf16, fp16: ``--dtypes fp16``).
GB/s are quoted against a copy bandwidth measured in the same process (``dst.copy_(src)`` of 32M floats, read+write).

``--clip``: the update with the mean gradient clipped to a global norm (``max_grad_norm=1.0``; random gradients of
32M elements always clip). ``ours`` is ``mean_grad_adamw_clipped_`` (a norm pass over the G gradients, then the
update pass), ``plain`` the same with the plain loops, ``stock`` the mean as above, then
``torch.nn.utils.clip_grad_norm_(foreach=True)`` and fused AdamW (G = 1: on a gradient of its own, which the clip
scales in place). Two more columns time the norm pass alone: ``norm`` (``mean_grad_norm``) and ``norm_plain``.
The fewest bytes of two passes: 4N(2G+6) with fp32 gradients, 4NG+24N with 16-bit ones.

Two ways to run:

    pytest bench/bench_fused_adamw.py --benchmark-only           # pytest-benchmark, one test per path and case
    python bench/bench_fused_adamw.py --quick|--full [--cuda] [--dtypes fp32]   # interleaved medians, markdown table

These VMs are noisy: the script mode alternates the paths round by round in one process and reports medians.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs without install
import pyengine.ops as ops  # noqa: E402

LR, WEIGHT_DECAY = 1e-3, 1e-2
COPY_NUMEL = 32 << 20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


CLIP_NORM = 1.0  # --clip's max_grad_norm


def update_bytes(n: int, g: int, dtype: str, clip: bool = False) -> int:
    """The fewest bytes one update moves: the G gradients read once (twice with clipping: the norm first), param, m
    and v read and written."""
    grad_bytes = (4 if dtype == "fp32" else 2) * n * g
    return grad_bytes * (2 if clip else 1) + 24 * n


def deepspeed_adam():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # noqa: BLE001  (not installed, or its op fails to build: skip)
        return None
    return DeepSpeedCPUAdam


@dataclass
class Workspace:
    """Every buffer of one (N, G, dtype, device) case, allocated and touched once, reused by every round."""

    n: int
    g: int
    dtype: str
    device: str
    clip: bool = False  # every path clips the mean gradient to CLIP_NORM (--clip)
    grads: list = field(init=False)

    def __post_init__(self):
        dev, dt = torch.device(self.device), DTYPES[self.dtype]
        self.grads = [torch.randn(self.n, device=dev).to(dt) for _ in range(self.g)]
        init = self.init = torch.randn(self.n, device=dev)
        self.param, self.exp_avg, self.exp_avg_sq = init.clone(), torch.zeros_like(init), torch.zeros_like(init)
        self.step = 0
        self.buf = torch.randn_like(init)
        self.stock_param = torch.nn.Parameter(init.clone())
        self.stock_opt = torch.optim.AdamW([self.stock_param], lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        self.stack_buf = None
        self.ds_param = None
        # --clip, G = 1 fp32: clip_grad_norm_ scales .grad in place, so the stock path clips a gradient of its own
        self.stock_grad = self.grads[0].clone() if self.clip and self.g == 1 and dt == torch.float32 else None

    # -- the paths ----------------------------------------------------------------------------------------------
    def ours(self):
        self.step += 1
        if self.clip:
            ops.mean_grad_adamw_clipped_(self.param, self.exp_avg, self.exp_avg_sq, self.grads, lr=LR,
                                         weight_decay=WEIGHT_DECAY, step=self.step, max_grad_norm=CLIP_NORM)
        else:
            ops.mean_grad_adamw_(self.param, self.exp_avg, self.exp_avg_sq, self.grads, lr=LR,
                                 weight_decay=WEIGHT_DECAY, step=self.step)

    def plain(self):
        self._plain(self.ours)

    def norm(self):
        return ops.mean_grad_norm(self.grads).norm

    def norm_plain(self):
        return self._plain(self.norm)

    @staticmethod
    def _plain(fn):
        previous = ops._C._set_cpu_prefetch(False)
        try:
            return fn()
        finally:
            ops._C._set_cpu_prefetch(previous)

    def mean_into_buf(self):
        grads = self.grads
        if len(grads) == 1:
            if grads[0].dtype == torch.float32:
                return grads[0] if self.stock_grad is None else self.stock_grad
            return self.buf.copy_(grads[0])
        if grads[0].dtype == torch.float32 and grads[1].dtype == torch.float32:
            torch.add(grads[0], grads[1], out=self.buf)  # saves the copy; with bf16 inputs it would add in bf16
            rest = grads[2:]
        else:
            self.buf.copy_(grads[0])
            rest = grads[1:]
        for g in rest:
            torch._foreach_add_([self.buf], [g])
        return self.buf.mul_(1.0 / len(grads))

    def _stock_step(self):
        if self.clip:
            torch.nn.utils.clip_grad_norm_([self.stock_param], CLIP_NORM, foreach=True)
        self.stock_opt.step()

    def stock(self):
        self.stock_param.grad = self.mean_into_buf()
        self._stock_step()

    def stack(self):
        if self.stack_buf is None:
            self.stack_buf = torch.empty((self.g, self.n), dtype=self.grads[0].dtype, device=self.buf.device)
        torch.stack(self.grads, out=self.stack_buf)
        torch.mean(self.stack_buf, 0, dtype=torch.float32, out=self.buf)
        self.stock_param.grad = self.buf
        self._stock_step()

    def adamw(self):
        self.stock_param.grad = self.buf
        self._stock_step()

    def deepspeed(self, param: torch.Tensor | None = None):
        """The mean as in ``stock``, then DeepSpeed's CPU Adam. Timed on ours' own buffers (param, exp_avg,
        exp_avg_sq: the same addresses), so that the two are not compared by where their buffers lie: on these VMs
        the placement of 128 MiB buffers alone moves a streaming loop's time by 10-30 % (bench/RESULTS.md). With
        ``param`` (the check): on that tensor and fresh state."""
        if param is not None:
            param = torch.nn.Parameter(param)
            opt = deepspeed_adam()([param], lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=True)
        else:
            if self.ds_param is None:
                self.ds_param = torch.nn.Parameter(self.param)  # shares ours' storage
                self.ds_opt = deepspeed_adam()([self.ds_param], lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=True)
                self.ds_opt.state[self.ds_param] = {"step": 0, "exp_avg": self.exp_avg,
                                                    "exp_avg_sq": self.exp_avg_sq}
            param, opt = self.ds_param, self.ds_opt
        param.grad = self.mean_into_buf()
        opt.step()
        return param

    # -- correctness before timing ------------------------------------------------------------------------------
    def _restart_stock(self):
        self.stock_param = torch.nn.Parameter(self.init.clone())
        self.stock_opt = torch.optim.AdamW([self.stock_param], lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def check(self, paths=("ours", "stock")):
        """One step of every path in ``paths`` from the same state (``adamw``, which updates with a ready buffer
        rather than the mean, is not compared): the weights must agree with the stock path's."""
        # With --clip, the stock norm (torch's float32 sum of squares on the CPU) is up to ~2e-3 off the float64 norm
        # at 32M elements (measured: -1.8e-3; ours: 1e-8, checked below), and exp_avg scales with it.
        exp_avg_rtol = 5e-3 if self.clip else 1e-5

        def agree(name, param, exp_avg=None, expected_exp_avg=None):
            torch.testing.assert_close(param, self.stock_param.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name} vs stock, N={self.n} G={self.g} {self.dtype}: {m}")
            if exp_avg is not None:  # (a first step's weights barely see the gradient's scale; exp_avg does)
                torch.testing.assert_close(exp_avg, expected_exp_avg, rtol=exp_avg_rtol, atol=1e-7,
                                           msg=lambda m: f"{name} vs stock (exp_avg), N={self.n} G={self.g}: {m}")

        self.param.copy_(self.init)
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.step = 0
        if self.stock_grad is not None:  # as drawn, not as a previous clip left it
            self.stock_grad.copy_(self.grads[0])
        self.ours()
        self._restart_stock()
        self.stock()  # first step: creates (and zero-fills) the optimizer's state
        agree("ours", self.param, self.exp_avg, self.stock_opt.state[self.stock_param]["exp_avg"])
        if "plain" in paths:  # the prefetching and the plain loops: the same bits
            ours = [t.clone() for t in (self.param, self.exp_avg, self.exp_avg_sq)]
            self.param.copy_(self.init)
            self.exp_avg.zero_()
            self.exp_avg_sq.zero_()
            self.step = 0
            self.plain()
            assert all(torch.equal(a, b) for a, b in zip(ours, (self.param, self.exp_avg, self.exp_avg_sq))), \
                f"plain loops differ from ours, N={self.n} G={self.g} {self.dtype}"
        if "norm" in paths:  # the norm pass: the norm of the float64 mean; its plain loops give the same bits
            mean = torch.stack([g.double() for g in self.grads]).mean(0)
            torch.testing.assert_close(self.norm().double(), torch.linalg.vector_norm(mean), rtol=1e-6, atol=0,
                                       msg=lambda m: f"norm vs float64, N={self.n} G={self.g} {self.dtype}: {m}")
            if "norm_plain" in paths:
                assert torch.equal(self.norm(), self.norm_plain()), f"plain norm loops differ, G={self.g}"
        if "deepspeed" in paths:
            agree("deepspeed", self.deepspeed(self.init.clone()).detach())
        if "stack" in paths:
            stock = self.stock_param.detach().clone()
            stock_mean = self.mean_into_buf().clone()
            self._restart_stock()
            self.stack()
            # The two means differ by summation order only. Where a mean is within that rounding of zero, the first
            # step's lr * m / (sqrt(v) + eps) (about lr * sign(mean)) may flip sign: up to 2 lr apart (seen at N=256M,
            # G=4 on an H100: 14 elements). Everywhere else the weights must agree as tightly as the other paths'.
            torch.testing.assert_close(self.buf, stock_mean, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"stack's mean vs stock's, N={self.n} G={self.g}: {m}")
            settled = stock_mean.abs() > 1e-4
            param = self.stock_param.detach()
            torch.testing.assert_close(param[settled], stock[settled], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"stack vs stock, N={self.n} G={self.g} {self.dtype}: {m}")
            worst = (param - stock).abs().max().item()
            assert worst <= 2 * LR * (1 + 1e-3), f"stack vs stock, N={self.n} G={self.g}: {worst} apart (> 2 lr)"


SPIN_CYCLES = 4_000_000  # ~2 ms at 2 GHz: longer than any path's launches take on the host


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def time_once(fn, device: str) -> float:
    """Seconds of one call: host clock on the CPU, CUDA events on the GPU. On the GPU the stream first spins ~2 ms
    (``torch.cuda._sleep``), so that the start event and the call's kernels are all queued before the start is
    stamped: the time is the device's, not the host's launch delay before the first kernel (without the spin the
    stream is idle at ``start.record()``, which the GPU stamps at once)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved_medians(fns: dict, rounds: int, device: str, warmup: int = 2) -> dict:
    """Median seconds per path, the paths alternating within every round (same noise for all)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(time_once(fn, device))
    return {name: statistics.median(t) for name, t in times.items()}


class CopyBench:
    """dst.copy_(src) of 32M floats (256M for CUDA, to leave the 50 MB L2), counted as bytes read + written."""

    def __init__(self, device: str):
        numel = COPY_NUMEL * (8 if device == "cuda" else 1)
        self.src = torch.randn(numel, device=device)
        self.dst = torch.empty_like(self.src).fill_(0)
        self.bytes = 2 * 4 * numel

    def __call__(self):
        self.dst.copy_(self.src)


# -- pytest-benchmark -------------------------------------------------------------------------------------------
try:
    import pytest
except ImportError:  # script mode needs no pytest
    pytest = None

if pytest is not None:
    _workspaces: dict = {}

    def _workspace(n, g, dtype):
        key = (n, g, dtype)
        if key not in _workspaces:
            _workspaces.clear()  # one case's buffers at a time (32M x G=8 fp32 is ~3 GB with every path)
            ws = Workspace(n, g, dtype, "cpu")
            ws.check(["ours", "stock", "stack"] + (["deepspeed"] if deepspeed_adam() is not None else []))
            _workspaces[key] = ws
        return _workspaces[key]

    @pytest.mark.parametrize("threads", [1, 2])
    @pytest.mark.parametrize("dtype", ["fp32", "bf16"])
    @pytest.mark.parametrize("g", [1, 2, 4, 8])
    @pytest.mark.parametrize("n", [32 << 20, 4 << 20], ids=["32M", "4M"])
    @pytest.mark.parametrize("path", ["ours", "stock", "stack", "deepspeed"])
    def test_mean_grad_adamw(benchmark, path, n, g, dtype, threads):
        if path == "deepspeed" and deepspeed_adam() is None:
            pytest.skip("deepspeed is not importable")
        torch.set_num_threads(threads)
        ws = _workspace(n, g, dtype)
        copy = CopyBench("cpu")
        fn = getattr(ws, path)
        medians = interleaved_medians({path: fn, "stock": ws.stock, "copy": copy}, rounds=3, device="cpu")
        benchmark.pedantic(fn, rounds=5, warmup_rounds=1)
        nbytes = update_bytes(n, g, dtype)
        t = benchmark.stats.stats.median
        benchmark.extra_info.update({
            "time_s": t, "bytes": nbytes, "GBps": nbytes / t / 1e9,
            "copy_GBps": copy.bytes / medians["copy"] / 1e9,
            "ratio_to_stock": medians["stock"] / medians[path],  # interleaved: > 1 means faster than stock
        })


# -- script mode: interleaved medians, markdown table ------------------------------------------------------------
def run_table(sizes, gs, dtypes, threads_list, rounds, device, paths, clip=False):
    rows = []
    copy = CopyBench(device)
    for threads in threads_list:
        if device == "cpu":
            torch.set_num_threads(threads)
        for n in sizes:
            for dtype in dtypes:
                for g in gs:
                    ws = Workspace(n, g, dtype, device, clip=clip)
                    ws.check(paths)
                    fns = {p: getattr(ws, p) for p in paths if p != "adamw" or g == 1}
                    fns["copy"] = copy
                    med = interleaved_medians(fns, rounds, device)
                    rows.append(dict(n=n, g=g, dtype=dtype, threads=threads, med=med,
                                     bytes=update_bytes(n, g, dtype, clip), copy_GBps=copy.bytes / med["copy"] / 1e9))
                    print(format_row(rows[-1], paths), flush=True)
                    del ws
    return rows


def header(paths):
    cols = ["N", "G", "grads", "threads"] + [f"{p} ms" for p in paths] + \
           ["ours GB/s", "copy GB/s", "ours/copy", "stock/ours"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def format_row(r, paths):
    med = r["med"]
    ours_gbps = r["bytes"] / med["ours"] / 1e9
    cells = [f"{r['n'] >> 20}M", str(r["g"]), r["dtype"], str(r["threads"])]
    cells += [f"{med[p] * 1e3:.2f}" if p in med else "" for p in paths]
    cells += [f"{ours_gbps:.1f}", f"{r['copy_GBps']:.1f}", f"{ours_gbps / r['copy_GBps']:.2f}",
              f"{med['stock'] / med['ours']:.2f}x"]
    return "| " + " | ".join(cells) + " |"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_true", help="N=32M, G in {1,4,8}, 1 thread, 7 rounds")
    mode.add_argument("--full", action="store_true", help="N in {32M,4M}, G in {1,2,4,8}, 1 and 2 threads")
    ap.add_argument("--cuda", action="store_true", help="run on the GPU (CUDA events; copy = 1 GiB device copy)")
    ap.add_argument("--deepspeed", action="store_true",
                    help="also time DeepSpeed's CPU Adam (after the stock mean); --full does when importable")
    ap.add_argument("--clip", action="store_true",
                    help=f"every path clips the mean gradient to the global norm {CLIP_NORM} (ours: the norm pass, "
                         "then the update; stock: clip_grad_norm_), and the norm pass is timed alone")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["fp32", "bf16"],
                    help="gradient dtypes to run (default: fp32 bf16)")
    ap.add_argument("--out", help="also write the markdown table to this file")
    args = ap.parse_args(argv)

    device = "cuda" if args.cuda else "cpu"
    if args.cuda and not torch.cuda.is_available():
        sys.exit("--cuda: torch.cuda.is_available() is False")
    paths = ["ours", "stock", "norm"] if args.clip else ["ours", "stock", "stack", "adamw"]
    if device == "cpu" and ops._C.cpu_prefetch():
        paths.insert(1, "plain")
        if args.clip:
            paths.append("norm_plain")
    if args.clip and args.deepspeed:
        sys.exit("--deepspeed and --clip: DeepSpeed's CPU Adam is timed without clipping only")
    if device == "cpu" and not args.clip and (args.full or args.deepspeed):
        if deepspeed_adam() is not None:
            paths.append("deepspeed")
        elif args.deepspeed:
            sys.exit("--deepspeed: deepspeed.ops.adam.DeepSpeedCPUAdam is not importable")
    if args.quick:
        sizes, gs, threads = [32 << 20], [1, 4, 8], [1]
    else:
        sizes, gs, threads = [32 << 20, 4 << 20], [1, 2, 4, 8], [1, 2]
    if device == "cuda":
        sizes, threads = ([64 << 20] if args.quick else [256 << 20, 32 << 20]), [1]
    machine = torch.cuda.get_device_name() if device == "cuda" else f"cpu, {torch.get_num_threads()} threads max"
    title = (f"{datetime.date.today()} torch {torch.__version__}, {machine}, cpu isa {ops._C.cpu_isa()}"
             f"{', prefetching' if ops._C.cpu_prefetch() else ''}{f', clipped to {CLIP_NORM}' if args.clip else ''}, "
             f"median of {args.rounds} interleaved rounds")
    print(title)
    print(header(paths), flush=True)
    rows = run_table(sizes, gs, args.dtypes, threads, args.rounds, device, paths, clip=args.clip)
    if args.out:
        with open(args.out, "w") as f:
            f.write(title + "\n\n" + header(paths) + "\n" + "\n".join(format_row(r, paths) for r in rows) + "\n")


if __name__ == "__main__":
    main()
