"""What a fit call's end costs across processes (Note [Ranks whose fits end at different steps] in
pyengine/distributed.py): the end-of-fit exchange alone, a step, and fit([batch], steps=1), on local gloo processes,
interleaved call by call, medians.

    python bench/bench_fit_end.py [--world 2] [--rounds 300] [--kinds hybrid,pipeline]

The model is Linear(64, 128) - Tanh - Linear(128, 10) on a batch of 32 (hybrid: each rank its own; pipeline
(``microbatches=2``): a stage per rank, the same batch on every rank). fit([batch], steps=1) minus step(batch) is
what one fit call adds: its end's exchange (and the rendezvous store's check-in of that phase) plus fit's own
checks. Rank 0 prints the medians (us).
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

    import pyengine
    from pyengine import distributed
    from pyengine.engine import _FitEnd

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    distributed.init_process_group("gloo", timeout_s=60)
    torch.manual_seed(0)

    def loss(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    for kind in args.kinds.split(","):
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
        mode = dict(mode="pipeline", microbatches=2) if kind == "pipeline" else {}
        with pyengine.Engine(model, loss, devices=["cpu"], pin=False, **mode) as engine:
            ways = {"end of fit": lambda: engine._end_fit(_FitEnd(0, None)), "step": lambda: engine.step(batch),
                    "fit, 1 step": lambda: engine.fit([batch], steps=1)}
            for fn in list(ways.values()) * 5:  # warm-up
                fn()
            times = {name: [] for name in ways}
            for _ in range(args.rounds):
                for name, fn in ways.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
        if rank == 0:
            med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
            print(f"{kind}, world {world}, {args.rounds} rounds: "
                  + ", ".join(f"{name} {us:.0f} us" for name, us in med.items())
                  + f"; a fit call adds {med['fit, 1 step'] - med['step']:.0f} us to its step")
    torch.distributed.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--kinds", default="hybrid,pipeline")
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
