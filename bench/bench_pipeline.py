"""Pipeline parallelism: samples/s and bubble fraction (measured and ideal) for S stages and M micro-batches.

An MLP of ``--layers`` Linear(width, width) + ReLU blocks and a Linear head, trained with mode="pipeline" on S CPU
workers (or ``--device cuda:0``: S workers on one GPU, each stage with its own stream), schedules 1F1B and GPipe,
against single-device training (mode="hybrid" on one worker of the same device) on the same batches.

Before anything is timed, one pipelined step is checked against one single-device step from the same weights
(element by element, fp32 tolerance). Each cell is the median over ``--steps`` steps after ``--warmup`` steps.
Bubble measured = 1 - sum of stage busy seconds / (S x schedule wall seconds); ideal = (S-1)/(M+S-1).

Run: python bench/bench_pipeline.py                    (S in {2, 4}, M in {1, 4, 16}, a markdown table)
     python bench/bench_pipeline.py --device cuda:0 --width 4096 --batch 512
"""
import argparse
import statistics

import torch

import pyengine


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


def check(args, batch, stages) -> None:
    """One pipelined step equals one single-device step (the numbers below are of a correct pipeline)."""
    with engine(args, "hybrid", [args.device]) as single:
        single.step(batch)
        expected = single.master_state_dict()
    with engine(args, "pipeline", [args.device] * stages, microbatches=4) as piped:
        piped.step(batch)
        got = piped.master_state_dict()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


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
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(args.batch, args.width, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen))
               for _ in range(args.warmup + args.steps)]
    check(args, batches[0], min(args.stages))
    base = measure(args, batches, "hybrid", [args.device])
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) + ReLU + head, batch {args.batch}, "
          f"device {args.device}, torch threads {torch.get_num_threads()}")
    print(f"single device: {base['samples_per_s']:.0f} samples/s ({base['wall_ms']:.1f} ms/step)\n")
    print("| S | M | schedule | samples/s | vs single | bubble measured | bubble ideal | stage busy ms | "
          "stage-0 stored micro-batches (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for stages in args.stages:
        for microbatches in args.microbatches:
            for schedule in args.schedules:
                r = measure(args, batches, "pipeline", [args.device] * stages, stages=stages,
                            microbatches=microbatches, schedule=schedule)
                busy = " / ".join(f"{b:.0f}" for b in r["busy_ms"])
                print(f"| {stages} | {microbatches} | {schedule} | {r['samples_per_s']:.0f} | "
                      f"{r['samples_per_s'] / base['samples_per_s']:.2f}x | {r['bubble']:.3f} | {r['ideal']:.3f} | "
                      f"{busy} | {r['act']} ({r['act_mb']:.1f}) |", flush=True)


if __name__ == "__main__":
    main()
