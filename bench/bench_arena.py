"""The host store's arena: what its pages cost the host's update, and (on a GPU machine) the copies.

    python bench/bench_arena.py [--n 32] [--g 4] [--rounds 9] [--threads 1 2] [--out table.md]

The update (``pyengine.ops.mean_grad_adamw_``, N = --n Mi floats, G fp32 gradients) runs on buffers carved out of
each kind of host memory, the kinds alternating round by round in one process (medians; "paired" is the median of
the rounds' time ratios against the first kind):

- ``torch``:          plain ``torch.empty`` tensors (4 KiB pages, torch's default), the baseline;
- ``arena``:          ``_C._allocate_arena(pinned=False)``: 2 MiB-aligned, huge pages advised, pre-faulted, the
                      buffers a stagger apart (the store's pageable arena);
- ``pinned-huge``:    ``_C._allocate_arena(pinned=True)``: that memory page-locked with cudaHostRegister (the store's
                      pinned arena; CUDA machines only);
- ``pinned-hostalloc``: ``_C._allocate_arena(pinned=True, huge_pages=False)``: cudaHostAlloc's memory, 4 KiB pages (the
                      store's pinned arena before; CUDA machines only).

On a CUDA machine it also times a D2H copy of 256 MiB from the device into each pinned kind (cudaMemcpyAsync),
which must not lose bandwidth to the registration. Each kind's AnonHugePages (from /proc/self/smaps) is reported.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs without install
import pyengine  # noqa: E402
from pyengine import _C, ops  # noqa: E402
from pyengine.store import huge_page_bytes, section_stagger  # noqa: E402


def huge_bytes(tensors) -> int:
    """Bytes of transparent huge pages behind ``tensors``: each mapping holding one of them counted once (an arena's
    buffers share one mapping; torch's tensors have one each)."""
    def mapping(address: int) -> tuple[int, int] | None:
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= address < hi:
                    return lo, hi
        return None

    starts = {m[0] for m in (mapping(t.data_ptr()) for t in tensors) if m is not None}
    return sum(huge_page_bytes(start) for start in starts)


def carve(kind: str, n: int, g: int) -> list[torch.Tensor]:
    """param, exp_avg, exp_avg_sq and g gradients of n floats each, from one block of the kind's memory, laid out as
    the store lays out its sections (Note [Staggered sections])."""
    if kind == "torch":
        flats = [torch.empty(n) for _ in range(3 + g)]
    else:
        pinned = kind.startswith("pinned")
        stride = 4 * n + section_stagger([4 * n] * (3 + g))
        arena = _C._allocate_arena(stride * (3 + g), pinned, huge_pages=kind != "pinned-hostalloc")
        flats = [arena[i * stride:i * stride + 4 * n].view(torch.float32) for i in range(3 + g)]
    gen = torch.Generator().manual_seed(0)
    for i, t in enumerate(flats):
        if i == 2:
            t.copy_(torch.rand(n, generator=gen))  # exp_avg_sq >= 0
        else:
            t.copy_(torch.randn(n, generator=gen))
    return flats


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=32, help="Mi floats per buffer (default 32)")
    parser.add_argument("--g", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    n, g = args.n << 20, args.g
    cuda = torch.cuda.is_available() and _C.with_cuda
    kinds = ["torch", "arena"] + (["pinned-huge", "pinned-hostalloc"] if cuda else [])
    buffers = {kind: carve(kind, n, g) for kind in kinds}
    lines = [f"device: {torch.cuda.get_device_name(0) if cuda else 'cpu'}, torch {torch.__version__}, N = {args.n}M, "
             f"G = {g} fp32\n",
             "| kind | huge pages MiB | threads | update ms | GB/s | paired vs torch |", "|---|---|---|---|---|---|"]
    nbytes = 4 * n * (g + 6)
    for threads in args.threads:
        torch.set_num_threads(threads)
        times = {kind: [] for kind in kinds}
        for r in range(args.rounds + 1):  # the first round warms up
            order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
            for kind in order:
                p, m, v, *grads = buffers[kind]
                times[kind].append(timed(lambda: ops.mean_grad_adamw_(p, m, v, grads, lr=1e-3, step=r + 1,
                                                                      weight_decay=1e-2)))
        base = times["torch"][1:]
        for kind in kinds:
            t = times[kind][1:]
            huge = huge_bytes(buffers[kind]) >> 20
            paired = statistics.median(b / a for b, a in zip(base, t))
            lines.append(f"| {kind} | {huge} | {threads} | {1e3 * statistics.median(t):.2f} | "
                         f"{nbytes / statistics.median(t) / 1e9:.1f} | {paired:.3f}x |")
    if cuda:
        lines += ["", "| kind | D2H GB/s (256 MiB, cudaMemcpyAsync) |", "|---|---|"]
        src = torch.randn(64 << 20, device="cuda")
        dsts = {kind: _C._allocate_arena(src.numel() * 4, True, huge_pages=kind == "pinned-huge").view(torch.float32)
                for kind in ("pinned-huge", "pinned-hostalloc")}
        times = {kind: [] for kind in dsts}
        for r in range(args.rounds + 1):
            for kind, dst in (list(dsts.items()) if r % 2 else list(dsts.items())[::-1]):
                torch.cuda.synchronize()
                start = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                times[kind].append(time.perf_counter() - start)
        for kind, t in times.items():
            lines.append(f"| {kind} | {src.numel() * 4 / statistics.median(t[1:]) / 1e9:.1f} |")
        for kind, dst in dsts.items():
            assert torch.equal(dst, src.cpu()), kind
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
