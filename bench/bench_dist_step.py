"""The hybrid step across processes: median step time of a small model, where the step's collectives dominate.

    torchrun --standalone --nproc-per-node 2 bench/bench_dist_step.py [--steps 400] [--width 16] [--batch 8]

Every rank builds two engines over the launched group (gloo, one CPU worker each) on the same model: one with the
refusal flags of the step's loss all-reduce packed into one float64 (``RefusalFlags``, the engine's way up to 33
ranks), one with a float64 per rank (as before the packing: ``RefusalFlags.PACKED_RANKS = 0`` while it is built).
Their steps alternate (which goes first alternates too), a barrier before each, on the same batch; rank 0 prints each
one's median step time over the steps after the first 20, and checks that both end with the same weights (the
packing changes no number). Nothing else differs between the two: the difference is what ``world - 1`` more float64
in that all-reduce costs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs without install
import pyengine  # noqa: E402
from pyengine import distributed  # noqa: E402


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8, help="each rank's batch")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("launch under torchrun (see the docstring)")
    if args.steps < 22:
        parser.error("--steps must be >= 22 (the first 20 are warm-up)")
    torch.set_num_threads(1)
    distributed.init_process_group("gloo", timeout_s=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    engines = {}
    packed_ranks = distributed.RefusalFlags.PACKED_RANKS
    try:
        for arm, packed in (("packed", packed_ranks), ("per_rank", 0)):
            distributed.RefusalFlags.PACKED_RANKS = packed
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
                                        torch.nn.Linear(args.width, 1))
            engines[arm] = pyengine.Engine(model, loss_fn, devices=["cpu"], optimizer=pyengine.AdamW(lr=1e-3),
                                           pin=False)
    finally:
        distributed.RefusalFlags.PACKED_RANKS = packed_ranks
    gen = torch.Generator().manual_seed(rank)
    batch = (torch.randn(args.batch, args.width, generator=gen), torch.randn(args.batch, 1, generator=gen))
    times = {arm: [] for arm in engines}
    for i in range(args.steps):
        for arm in (("packed", "per_rank") if i % 2 else ("per_rank", "packed")):
            dist.barrier()
            start = time.perf_counter()
            engines[arm].step(batch)
            times[arm].append(time.perf_counter() - start)
    a, b = (engines[arm].master_state_dict() for arm in ("packed", "per_rank"))
    same = all(torch.equal(a[name], b[name]) for name in a)
    if rank == 0:
        medians = {arm: statistics.median(t[20:]) * 1e3 for arm, t in times.items()}
        print(f"| {world} ranks | packed (1 float64) {medians['packed']:.3f} ms | per rank ({world} float64) "
              f"{medians['per_rank']:.3f} ms | {medians['packed'] / medians['per_rank'] - 1:+.1%} | weights "
              f"{'equal' if same else 'DIFFER'} |")
    for engine in engines.values():
        engine.close()
    dist.destroy_process_group()
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
