"""What sharing rank 0's buffers costs per hybrid step across processes: one broadcast per buffer (as the step did
before 2026-11-27) against one broadcast of all their bytes (pyengine.distributed.BytePacket, what the step does now:
Note [Tensors travel as bytes]), on local gloo processes, interleaved round by round, medians.

    python bench/bench_buffer_share.py [--layers 50] [--width 64] [--world 2] [--rounds 15] [--repeats 20]

The model is ``--layers`` BatchNorm1d(``--width``) (3 persistent buffers each: running_mean, running_var,
num_batches_tracked), the buffers a hybrid step shares. Rank 0 prints the per-exchange medians (ms) and the ratio.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rank_main(rank: int, world: int, port: int, args) -> None:
    import torch
    import torch.distributed as dist

    from pyengine import distributed

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.Sequential(*[torch.nn.BatchNorm1d(args.width) for _ in range(args.layers)])
    buffers = [b for _, b in model.named_buffers()]

    def per_buffer():
        for b in buffers:
            distributed.run(dist.broadcast, b, src=0)

    packet = distributed.BytePacket(buffers)  # as DistributedHybrid._share_buffers keeps one

    def packed():
        if rank == 0:
            packet.pack(buffers)
        distributed.run(dist.broadcast, packet.flat, src=0)
        if rank != 0:
            packet.unpack(buffers)

    ways = {"per buffer": per_buffer, "packed": packed}
    for fn in ways.values():  # warm-up
        fn()
    times = {name: [] for name in ways}
    for r in range(args.rounds):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for name in order:
            distributed.run(dist.barrier)
            start = time.perf_counter()
            for _ in range(args.repeats):
                ways[name]()
            times[name].append((time.perf_counter() - start) / args.repeats)
    if rank == 0:
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"{len(buffers)} buffers ({sum(b.numel() * b.element_size() for b in buffers)} bytes), world {world}, "
              f"{args.rounds} rounds x {args.repeats}")
        for name, ms in med.items():
            print(f"  {name:10s} median {ms:8.3f} ms per exchange")
        print(f"  packed is {med['per buffer'] / med['packed']:.1f}x faster")
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.world, args.port, args)
        return
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                               "--rank", str(r), "--port", str(port)], env=env) for r in range(args.world)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
