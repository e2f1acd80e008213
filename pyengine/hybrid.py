"""Hybrid schedule: every worker computes on its shard of the batch, the host waits for all, averages the gradients
(weighted by shard sizes when uneven) and updates once: exactly one step on a batch G times larger.

The host works per bucket (Note [One update path] in :mod:`pyengine.engine`): while the workers' backward passes run,
it takes each bucket's share of the mean gradient's norm as soon as every worker delivered that bucket; once all
workers are done and the step is admitted, it updates bucket by bucket and starts each bucket's copy back to the
replicas right after its update, so the copies overlap the update of the next bucket.
"""
from __future__ import annotations

import math
import time

import torch

from . import ops
from .metrics import step_metrics
from .workers import batch_size, host_threads, split_batch, split_microbatches


def hybrid_step(engine, batch) -> dict:
    start = time.perf_counter()
    shards = split_batch(batch, engine.num_workers)
    sizes = [batch_size(s) for s in shards]
    total = sum(sizes)
    weights = None if len(set(sizes)) == 1 else [n / total for n in sizes]
    workers = list(range(engine.num_workers))
    slots = [engine.store.grad_slot(g) for g in workers]
    buckets = engine.workers[0].streamer.buckets
    scale = engine.loss_scale_now()  # Note [Loss scaling]: the scale this step computes and divides by

    # before any work: a shard too small for the micro-batches is refused here
    whole = "" if min(sizes) >= engine.microbatches else (  # the error's hint, formatted only for it
        f" (a batch of at least {len(shards) * engine.microbatches} samples gives each of the {len(shards)} workers "
        f"a shard of {engine.microbatches} or more)")
    parts = [split_microbatches(s, engine.microbatches, f"worker {g}'s shard", whole) for g, s in enumerate(shards)]

    def task(worker, part):
        def run():
            with engine.phase("forward_backward+transfer", worker.index):
                return worker.compute(engine.loss_fn, *part, loss_scale=scale)
        return run

    engine.share_buffers(workers)  # DDP's broadcast_buffers: worker 0's buffers go to every replica
    futures = engine.submit_workers({w.index: task(w, p) for w, p in zip(engine.workers, parts)})
    squares, nonfinite = 0.0, False
    try:
        # Note [Host threads beside CPU workers] in workers.py
        with host_threads(engine.devices, inline_worker=engine.inline_worker):
            for b in buckets:
                if not engine.wait_bucket(b.index, futures):
                    break  # a worker failed: gather_workers raises
                with engine.phase("norm"):
                    norm, flag = ops.mean_grad_norm([slot[b.begin:b.end] for slot in slots], weights)
                squares += float(norm) ** 2
                nonfinite |= bool(flag)
    except BaseException:
        engine.discard_workers(futures)  # the workers' tasks end before the step does
        raise
    results = engine.gather_workers(futures)
    engine.begin_update()  # Note [A step's update under the mutex]
    updated = time.perf_counter()
    with engine.phase("update"), host_threads(engine.devices, engine.store.numel, engine.inline_worker):
        try:
            applied = engine.admit_update(nonfinite or not math.isfinite(squares), workers, loss_scale=scale)
        except BaseException:
            # nonfinite="raise": the step's gradient buckets were consumed by no copy back, so drop them here, or the
            # next step's waits would return on this step's stale slots.
            for w in engine.workers:
                w.streamer.reset()
            raise
        norm = torch.tensor([math.sqrt(squares)], dtype=torch.float32)
        for b in buckets:
            for w in engine.workers:
                w.streamer.wait_weights(b.index)  # the last copy back of this bucket has completed
            if applied:
                engine.update_range(b.begin, b.end, slots, weights, norm, loss_scale=scale)
            for w in engine.workers:
                w.copy_back(buckets=[b.index])
    end = time.perf_counter()
    loss = sum(results[i][0] * n for i, n in enumerate(sizes)) / total
    return step_metrics(engine, loss=loss, samples=total, wall=end - start,
                        compute=max(r[1] for r in results.values()), update=end - updated,
                        transfer_wait=max(r.transfer_wait_s for r in results.values()),
                        copy_back=max(r.weights_wait_s for r in results.values()), applied=applied,
                        loss_scale=scale)
