"""Calibrates the planner's alpha-beta model (pyengine.comm) against measured gloo allreduce between local processes.

    python bench/bench_comm.py [--sizes 4e3,6.4e4,1e6,1.6e7,6.4e7] [--worlds 2,4] [--repeats 9] [--rounds 1]
    torchrun --nnodes N --nproc-per-node 1 ... bench/bench_comm.py [--sizes ...] [--repeats 9]
             [--bandwidth 25Gbit --latency 5us]

Local mode (plain ``python``) starts P processes (gloo, CPU tensors, 127.0.0.1) per world size, times ``all_reduce`` of float32 tensors of each
size (median of ``--repeats`` after a warm-up, barrier before each), fits alpha and the bandwidth on the P = 2
measurements with the ring model (gloo's CPU allreduce is ring-based for these sizes), and prints, for every
measurement, the model's prediction and relative error; the P > 2 rows are predictions from the P = 2 fit.
Localhost gloo is memory copies and loopback TCP, not a network: the fitted "bandwidth" and "latency" describe this
machine's loopback, and the error says how well the model's shape fits, not what a cluster would do.

``--rounds R`` (R > 1) interleaves the sizes: R rounds, each timing every size in turn (``--repeats`` calls each), and
each size's figure is the median of its R round medians. Use it to compare nearby sizes on a noisy machine (a drift
in the machine's speed then falls on every size alike), e.g. what a few more float64 in a step's all-reduce cost:
``--sizes 8,24,40,48,64,96 --rounds 41 --repeats 11``.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set by the launcher) the script measures the launched group itself, at its
world size (gloo, across whatever hosts torchrun spans), fits alpha and the bandwidth on those measurements and prints
the same table on rank 0; with ``--bandwidth``/``--latency`` (the ``pyengine plan`` syntax) it also prints the error
of the model with those given figures, i.e. how far a plan made from the nominal link figures is from the cluster.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's pyengine, also in the rank processes


def rank_main(sizes: list[int], repeats: int, out: str | None, rounds: int = 1) -> tuple[list[float], int]:
    import statistics

    import torch
    import torch.distributed as dist

    from pyengine import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
    per_round = [[comm.time_collective("all_reduce", n, repeats) for n in sizes] for _ in range(rounds)]
    times = [statistics.median(column) for column in zip(*per_round)]
    if out is not None and dist.get_rank() == 0:
        Path(out).write_text(json.dumps(times))
    world = dist.get_world_size()
    dist.destroy_process_group()
    return times, world


def measure(world: int, sizes: list[int], repeats: int, rounds: int = 1) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                   PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, __file__, "--rank-main", json.dumps(sizes), str(repeats), out,
                                  str(rounds)],
                                  env=dict(env, RANK=str(r))) for r in range(world)]
        try:
            codes = [p.wait(timeout=600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if codes != [0] * world:
            raise RuntimeError(f"measurement ranks exited with {codes}")
        return json.loads(Path(out).read_text())


def report(samples: dict, fit_world: int, net, label: str) -> None:
    """The table of measured vs modelled times for every world size in ``samples``, with ``net``'s figures."""
    from pyengine import comm

    print(f"{label}: alpha = {net.alpha * 1e6:.1f} us, bandwidth = {net.bandwidth / 1e9:.2f} GB/s "
          f"({net.bandwidth * 8 / 1e9:.1f} Gbit/s)")
    print("| P | bytes | measured ms | model ms | error |")
    print("|---|---:|---:|---:|---:|")
    for w, rows in samples.items():
        errors = comm.model_errors(rows, net)
        for (_, _, n, t), e in zip(rows, errors):
            print(f"| {w}{' (fit)' if w == fit_world else ''} | {n:,} | {t * 1e3:.3f} | "
                  f"{comm.exchange_cost('ring', w, n, net).time_s * 1e3:.3f} | {e:+.0%} |")
        print(f"P={w}: mean |error| {sum(map(abs, errors)) / len(errors):.0%}, max |error| "
              f"{max(map(abs, errors)):.0%}", file=sys.stderr)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        rank_main(json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4e3,6.4e4,1e6,1.6e7,6.4e7", help="message sizes in bytes")
    parser.add_argument("--worlds", default="2,4", help="local mode: process counts; the first is used for the fit")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=1, help="interleave the sizes over this many rounds (median of "
                        "the round medians)")
    parser.add_argument("--bandwidth", help="under torchrun: nominal link bandwidth to check, e.g. 25Gbit")
    parser.add_argument("--latency", help="under torchrun: nominal latency to check, e.g. 5us")
    args = parser.parse_args()
    from pyengine import comm

    sizes = [int(float(s)) // 4 * 4 for s in args.sizes.split(",")]
    if args.rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats must be >= 1")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun: measure this group
        if (args.bandwidth is None) != (args.latency is None):
            parser.error("--bandwidth and --latency go together")
        times, world = rank_main(sizes, args.repeats, None, args.rounds)
        if int(os.environ["RANK"]) == 0:
            samples = {world: [("ring", world, n, t) for n, t in zip(sizes, times)]}
            report(samples, world, comm.fit_network(samples[world]), f"fit on P={world} (ring model)")
            if args.bandwidth is not None:
                nominal = comm.Network(alpha=comm.parse_latency(args.latency),
                                       bandwidth=comm.parse_bandwidth(args.bandwidth))
                report(samples, -1, nominal, "nominal figures (ring model)")
        return
    if args.bandwidth is not None or args.latency is not None:
        parser.error("--bandwidth/--latency are for runs under torchrun")
    worlds = [int(w) for w in args.worlds.split(",")]
    samples = {w: [("ring", w, n, t) for n, t in zip(sizes, measure(w, sizes, args.repeats, args.rounds))] for w in worlds}
    report(samples, worlds[0], comm.fit_network(samples[worlds[0]]), f"fit on P={worlds[0]} (ring model)")


if __name__ == "__main__":
    main()
