"""Engine throughput: samples/s per schedule for G CPU workers, and hybrid vs torch DDP (gloo) on the same model
and global batch, run side by side in one invocation.

    python bench/bench_engine.py [--quick] [--models mlp,transformer] [--workers 1,2,4]     # markdown table
    python -m pytest bench/bench_engine.py --benchmark-only                                # pytest-benchmark

Every configuration first checks that training moves the loss (a broken engine is not timed), then times
``--steps`` steps after ``--warmup`` steps; DDP runs in G processes (torch.multiprocessing, gloo, localhost), each
with 1/G of the global batch and of the cores, with torch.optim.AdamW — the stock data-parallel path.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pyengine  # noqa: E402


# ---- workloads ----------------------------------------------------------------------------------------------------

def make_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                   torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    if name == "transformer":
        return TinyTransformer()
    raise ValueError(name)


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab=512, dim=128, layers=2, heads=4, seq=64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.zeros(seq, dim))
        layer = torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens) + self.pos[: tokens.shape[1]]))


def make_batch(name: str, size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return torch.randn(size, 256, generator=gen), torch.randint(0, 10, (size,), generator=gen)
    tokens = torch.randint(0, 512, (size, 65), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model, batch):
    x, y = batch
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# ---- pyengine -----------------------------------------------------------------------------------------------------

def engine_samples_per_s(model_name, mode, workers, batch, steps, warmup) -> float:
    batches = [make_batch(model_name, batch, i) for i in range(4)]
    with pyengine.Engine(make_model(model_name), loss_fn, devices=["cpu"] * workers, mode=mode,
                         optimizer=pyengine.AdamW(lr=1e-3)) as engine:
        first = engine.fit(batches[:1], steps=1)[0]["loss"]
        engine.fit(batches, steps=warmup)
        start = time.perf_counter()
        history = engine.fit(batches, steps=steps)
        wall = time.perf_counter() - start
    if not history[-1]["loss"] < first:
        raise AssertionError(f"{model_name}/{mode}/G={workers}: loss did not move ({first} -> {history[-1]['loss']})")
    return sum(m["samples"] for m in history) / wall


# ---- torch DDP (gloo) ---------------------------------------------------------------------------------------------

def _ddp_worker(rank, world, model_name, batch, steps, warmup, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(make_model(model_name))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [make_batch(model_name, batch, i) for i in range(4)]
    shards = [tuple(torch.tensor_split(t, world)[rank] for t in b) for b in batches]

    def run(n):
        for i in range(n):
            opt.zero_grad(set_to_none=True)
            loss_fn(model, shards[i % len(shards)]).backward()
            opt.step()

    run(warmup)
    dist.barrier()
    start = time.perf_counter()
    run(steps)
    dist.barrier()
    if rank == 0:
        out.put(batch * steps / (time.perf_counter() - start))
    dist.destroy_process_group()


def ddp_samples_per_s(model_name, workers, batch, steps, warmup) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = 29500 + (os.getpid() % 1000)
    mp.start_processes(_ddp_worker, args=(workers, model_name, batch, steps, warmup, port, out), nprocs=workers,
                       join=True, start_method="spawn")
    return out.get()


# ---- script mode --------------------------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--modes", default="hybrid,sync,async")
    parser.add_argument("--batch", type=int, default=64, help="global batch (hybrid: split among the workers)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (median reported)")
    args = parser.parse_args(argv)
    steps, warmup = (10, 2) if args.quick else (30, 5)
    rounds = args.rounds or (1 if args.quick else 3)
    print(f"# pyengine engine benchmark: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, batch {args.batch}, {steps} steps, "
          f"median of {rounds} interleaved rounds\n")
    print("| model | G | " + " | ".join(f"{m} samples/s" for m in args.modes.split(",")) +
          " | DDP gloo samples/s | hybrid / DDP |")
    print("|---" * (len(args.modes.split(",")) + 4) + "|")
    for model_name in args.models.split(","):
        for workers in (int(w) for w in args.workers.split(",")):
            results = {m: [] for m in args.modes.split(",")}
            results["ddp"] = []
            for _ in range(rounds):
                for mode in args.modes.split(","):
                    results[mode].append(engine_samples_per_s(model_name, mode, workers, args.batch, steps, warmup))
                results["ddp"].append(ddp_samples_per_s(model_name, workers, args.batch, steps, warmup))
            med = {k: statistics.median(v) for k, v in results.items()}
            ratio = med["hybrid"] / med["ddp"] if "hybrid" in med else float("nan")
            cells = " | ".join(f"{med[m]:.0f}" for m in args.modes.split(","))
            print(f"| {model_name} | {workers} | {cells} | {med['ddp']:.0f} | {ratio:.2f}x |", flush=True)


# ---- pytest-benchmark mode ----------------------------------------------------------------------------------------

try:
    import pytest

    @pytest.mark.parametrize("mode", ["hybrid", "sync", "async"])
    @pytest.mark.parametrize("workers", [1, 2])
    def test_engine_mlp(benchmark, mode, workers):
        rate = benchmark.pedantic(engine_samples_per_s, args=("mlp", mode, workers, 64, 5, 1), rounds=3,
                                  iterations=1)
        benchmark.extra_info["samples_per_s"] = rate
except ImportError:  # script mode without pytest
    pass


if __name__ == "__main__":
    main()
