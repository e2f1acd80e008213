"""Pipeline parallelism: samples/s and bubble fraction (measured and ideal) for S stages and M micro-batches.

An MLP of ``--layers`` Linear(width, width) + ReLU blocks and a Linear head, trained with mode="pipeline" on S CPU
workers (or ``--device cuda:0``: S workers on one GPU, each stage with its own stream), schedules 1F1B and GPipe,
against single-device training (mode="hybrid" on one worker of the same device) on the same batches.

Before anything is timed, one pipelined step is checked against one single-device step from the same weights
(element by element, fp32 tolerance). Each cell is the median over ``--steps`` steps after ``--warmup`` steps.
Bubble measured = 1 - sum of stage busy seconds / (S x schedule wall seconds); ideal = (S-1)/(M+S-1).

With ``--processes`` the stages run in separate processes instead (``Engine(mode="pipeline", process_group=...)``
on S gloo ranks started per cell, each with cores // S intra-op threads): samples/s and wall time are rank 0's,
the bubble is measured across the ranks (Note [Bubble across processes]), busy times are each rank's, and each
cell's ranks first check one step against the single-device step.

Run: python bench/bench_pipeline.py                    (S in {2, 4}, M in {1, 4, 16}, a markdown table)
     python bench/bench_pipeline.py --processes         (the same, stages in separate processes)
     python bench/bench_pipeline.py --device cuda:0 --width 4096 --batch 512
"""
import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs without install
import pyengine  # noqa: E402


def make_model(layers: int, width: int, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 10))


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def engine(args, mode, devices, **options):
    opt = pyengine.AdamW(lr=1e-3, eps=1e-3)  # eps away from the ill-conditioned regime, for the check
    return pyengine.Engine(make_model(args.layers, args.width), loss_fn, devices=devices, mode=mode, optimizer=opt,
                           **options)


def single_step(args, batch) -> dict:
    """The master weights after one single-device step on ``batch``."""
    with engine(args, "hybrid", [args.device]) as single:
        single.step(batch)
        return single.master_state_dict()


def assert_matches(got: dict, expected: dict) -> None:
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


def check(args, batch, stages) -> None:
    """One pipelined step equals one single-device step (the numbers below are of a correct pipeline)."""
    with engine(args, "pipeline", [args.device] * stages, microbatches=4) as piped:
        piped.step(batch)
        assert_matches(piped.master_state_dict(), single_step(args, batch))


def measure(args, batches, mode, devices, **options) -> dict:
    with engine(args, mode, devices, **options) as e:
        for b in batches[:args.warmup]:
            e.step(b)
        history = [e.step(b) for b in batches[args.warmup:]]
    med = lambda key: statistics.median(m[key] for m in history)  # noqa: E731
    out = {"samples_per_s": med("samples_per_s"), "wall_ms": med("wall_s") * 1e3}
    if mode == "pipeline":
        out.update(bubble=med("bubble_fraction"), ideal=history[0]["bubble_ideal"],
                   busy_ms=[1e3 * statistics.median(m["stage_busy_s"][s] for m in history)
                            for s in range(options["stages"])],
                   act=history[0]["activation_peak"][0], act_mb=history[0]["activation_peak_bytes"][0] / 2**20)
    return out


def _rank(rank, world, init_file, args, batches, options, expected, out_file) -> None:
    """One rank of a ``--processes`` cell: the check against ``expected``, then the timed steps; rank 0 saves."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{init_file}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        with engine(args, "pipeline", [args.device], microbatches=options["microbatches"],
                    schedule=options["schedule"]) as piped:
            piped.step(batches[0])
            assert_matches(piped.master_state_dict(), expected)  # a collective: every rank checks
        with engine(args, "pipeline", [args.device], **options) as e:
            for b in batches[:args.warmup]:
                e.step(b)
            history = [e.step(b) for b in batches[args.warmup:]]
        busy = [None] * world
        dist.all_gather_object(busy, statistics.median(m["busy_s"] for m in history))
        if rank == 0:
            med = lambda key: statistics.median(m[key] for m in history)  # noqa: E731
            torch.save(dict(samples_per_s=med("samples_per_s"), wall_ms=med("wall_s") * 1e3,
                            bubble=med("bubble_fraction"), ideal=history[0]["bubble_ideal"],
                            busy_ms=[1e3 * b for b in busy], act=history[0]["activation_peak"],
                            act_mb=history[0]["activation_peak_bytes"] / 2**20), out_file)
    finally:
        dist.destroy_process_group()


def measure_processes(args, batches, expected, stages, microbatches, schedule) -> dict:
    """:func:`measure` of a pipeline whose S stages are S processes (``--processes``)."""
    import torch.multiprocessing as mp

    options = dict(microbatches=microbatches, schedule=schedule)
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        out_file = os.path.join(tmp, "rank0.pt")
        mp.spawn(_rank, args=(stages, os.path.join(tmp, "init"), args, batches, options, expected, out_file),
                 nprocs=stages)
        return torch.load(out_file)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"])
    parser.add_argument("--processes", action="store_true", help="each stage in its own process (gloo, CPU)")
    args = parser.parse_args()
    if args.processes and args.device != "cpu":
        parser.error("--processes runs the stages as gloo ranks on the CPU")
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(args.batch, args.width, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen))
               for _ in range(args.warmup + args.steps)]
    if not args.processes:  # with --processes every cell's ranks check their first step
        check(args, batches[0], min(args.stages))
    expected = single_step(args, batches[0]) if args.processes else None
    base = measure(args, batches, "hybrid", [args.device])
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) + ReLU + head, batch {args.batch}, "
          f"device {args.device}, torch threads {torch.get_num_threads()}"
          + (", stages in separate processes (gloo)" if args.processes else ""))
    print(f"single device: {base['samples_per_s']:.0f} samples/s ({base['wall_ms']:.1f} ms/step)\n")
    print("| S | M | schedule | samples/s | vs single | bubble measured | bubble ideal | stage busy ms | "
          "stage-0 stored micro-batches (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for stages in args.stages:
        for microbatches in args.microbatches:
            for schedule in args.schedules:
                if args.processes and schedule == "1f1b" and microbatches < stages:
                    print(f"| {stages} | {microbatches} | {schedule} | (torch's Schedule1F1B needs M >= S) |||||||")
                    continue
                if args.processes:
                    r = measure_processes(args, batches, expected, stages, microbatches, schedule)
                else:
                    r = measure(args, batches, "pipeline", [args.device] * stages, stages=stages,
                                microbatches=microbatches, schedule=schedule)
                busy = " / ".join(f"{b:.0f}" for b in r["busy_ms"])
                print(f"| {stages} | {microbatches} | {schedule} | {r['samples_per_s']:.0f} | "
                      f"{r['samples_per_s'] / base['samples_per_s']:.2f}x | {r['bubble']:.3f} | {r['ideal']:.3f} | "
                      f"{busy} | {r['act']} ({r['act_mb']:.1f}) |", flush=True)


if __name__ == "__main__":
    main()
