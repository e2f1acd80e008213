"""Hybrid schedule: every worker computes on its shard of the batch, the host waits for all, averages the gradients
(weighted by shard sizes when uneven) and updates once: exactly one step on a batch G times larger."""
from __future__ import annotations

import time

from .metrics import step_metrics
from .workers import batch_size, split_batch


def hybrid_step(engine, batch) -> dict:
    start = time.perf_counter()
    shards = split_batch(batch, engine.num_workers)
    sizes = [batch_size(s) for s in shards]
    total = sum(sizes)
    weights = None if len(set(sizes)) == 1 else [n / total for n in sizes]

    def task(worker, shard):
        def run():
            with engine.phase("forward_backward+transfer", worker.index):
                return worker.compute(engine.loss_fn, [shard])
        return run

    results = engine.run_workers({w.index: task(w, s) for w, s in zip(engine.workers, shards)})
    engine.count("steps")
    updated = time.perf_counter()
    with engine.phase("update"):
        applied = engine.apply_update(list(range(engine.num_workers)), weights)
    copied = time.perf_counter()
    with engine.phase("copy_back"):
        engine.run_workers({w.index: w.pull for w in engine.workers})
    end = time.perf_counter()
    loss = sum(results[i][0] * n for i, n in enumerate(sizes)) / total
    return step_metrics(engine, loss=loss, samples=total, wall=end - start,
                        compute=max(r[1] for r in results.values()), update=copied - updated,
                        transfer_wait=max(r[2] for r in results.values()), copy_back=end - copied, applied=applied)
