"""What a multi-node async pull costs for a low-precision model, version against version: local gloo processes,
rank 0 the server, rank 1 a client pushing a bfloat16 MLP's gradients (Note [An async pull sends the replicas'
dtype] in pyengine/distributed.py). Runs alternate between the versions (A B B A ...); medians per version.

    python bench/bench_async_pull.py                              # old=rev:HEAD against new=. (the working tree)
    python bench/bench_async_pull.py old=rev:HEAD~1 new=. --width 2048 --layers 4 --pushes 12 --rounds 6

A version is ``name=PATH`` (a checkout whose pyengine/ holds a built extension) or ``name=rev:REV``: REV checked out
in a temporary worktree, given this checkout's built extension, which requires csrc/ unchanged between them.

Per run: the client's ``_pull`` (every server's header and weights, into its store) timed around each call, and the
fit's wall time per push on the client; the first ``--skip`` pushes of a run are left out (warm-up).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_main(args) -> None:
    sys.path.insert(0, args.tree)
    import torch
    import torch.distributed as dist

    import pyengine
    from pyengine import distributed

    torch.set_num_threads(1)
    # A file rendezvous: a port picked here and released before the ranks bind it could be taken in between.
    dist.init_process_group("gloo", init_method=f"file://{args.rendezvous}", rank=args.rank, world_size=2)
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(args.batch, args.width, generator=g).to(torch.bfloat16),
                torch.randn(args.batch, args.width, generator=g).to(torch.bfloat16)) for _ in range(args.pushes)]

    def loss_fn(m, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(m(x).float(), y.float())

    pulls, ends = [], []
    pull = distributed._AsyncClient._pull

    def timed_pull(self):
        start = time.perf_counter()
        out = pull(self)
        pulls.append(time.perf_counter() - start)
        ends.append(time.perf_counter())
        return out

    distributed._AsyncClient._pull = timed_pull
    with pyengine.Engine(model, loss_fn, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(lr=1e-4),
                         pin=False) as engine:
        engine.fit(batches if args.rank else [], steps=args.pushes)
        if args.rank:
            rounds = [b - a for a, b in zip(ends, ends[1:])][args.skip:]  # pull to pull: one push's round
            print(json.dumps(dict(pull_ms=statistics.median(pulls[args.skip:]) * 1e3,
                                  push_ms=statistics.median(rounds) * 1e3, numel=engine.store.numel,
                                  shadow=str(engine.store.shadow.dtype) if engine.store.shadow is not None else None)),
                  flush=True)
    dist.destroy_process_group()


def one_run(tree: str, args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="pull-rdzv-") as rendezvous:
        common = ["--width", str(args.width), "--layers", str(args.layers), "--pushes", str(args.pushes),
                  "--batch", str(args.batch), "--skip", str(args.skip), "--tree", tree,
                  "--rendezvous", os.path.join(rendezvous, "store")]
        procs = [subprocess.Popen([sys.executable, __file__, *common, "--rank", str(r)], env=env,
                                  stdout=subprocess.PIPE, text=True) for r in range(2)]
        outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{tree}: a rank failed (exit codes {[p.returncode for p in procs]})")
    return json.loads(outs[1].strip().splitlines()[-1])


def checkout(spec: str, keep: list) -> str:
    """A version spec's checkout (see the module docstring); temporary worktrees are appended to ``keep``."""
    if not spec.startswith("rev:"):
        return os.path.abspath(spec)
    rev = spec[4:]
    changed = subprocess.run(["git", "-C", ROOT, "diff", "--quiet", rev, "--", "csrc"]).returncode
    if changed:
        raise SystemExit(f"{spec}: csrc/ differs from this checkout's; build that version and pass its path")
    tree = tempfile.mkdtemp(prefix="pull-ab-")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", tree, rev], check=True)
    keep.append(tree)
    for built in glob.glob(os.path.join(ROOT, "pyengine", "_C*.so")):
        shutil.copy(built, os.path.join(tree, "pyengine"))
    return tree


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", default=["old=rev:HEAD", "new=."])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--pushes", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args)
        return
    if args.pushes < args.skip + 3:
        parser.error("--pushes must leave at least 3 pushes after --skip")
    keep = []
    try:
        versions = {}
        for spec in args.versions:
            name, sep, where = spec.partition("=")
            if not sep:
                parser.error(f"version {spec!r}: expected name=PATH or name=rev:REV")
            versions[name] = checkout(where, keep)
        runs = {name: [] for name in versions}
        for r in range(args.rounds):
            for name in (list(versions) if r % 2 == 0 else list(reversed(versions))):
                runs[name].append(one_run(versions[name], args))
                print(f"round {r} {name}: {runs[name][-1]}", flush=True)
        first = next(iter(versions))
        print(f"\n{args.layers} x Linear({args.width}) bfloat16, batch {args.batch}, {args.pushes} pushes "
              f"({args.skip} skipped), {args.rounds} runs per version; medians of the runs' medians")
        base = {k: statistics.median(run[k] for run in runs[first]) for k in ("pull_ms", "push_ms")}
        for name, rs in runs.items():
            med = {k: statistics.median(run[k] for run in rs) for k in ("pull_ms", "push_ms")}
            print(f"  {name:8s} pull {med['pull_ms']:8.2f} ms ({base['pull_ms'] / med['pull_ms']:.2f}x)   "
                  f"push round {med['push_ms']:8.2f} ms ({base['push_ms'] / med['push_ms']:.2f}x)   "
                  f"shadow {rs[0]['shadow']}, {rs[0]['numel']} parameters")
    finally:
        for tree in keep:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=False)


if __name__ == "__main__":
    main()
