"""Sync schedule: one worker at a time, round-robin. The worker gets the current weights and the whole batch; the
update lands before the next batch goes out. Correct gradients, one worker busy: the baseline for the others."""
from __future__ import annotations

import time

from .metrics import step_metrics
from .workers import batch_size, split_microbatches


def sync_step(engine, batch) -> dict:
    start = time.perf_counter()
    samples = batch_size(batch)
    if samples == 0:
        raise ValueError("a batch of 0 samples: a step needs at least one sample")
    worker = engine.workers[engine.stats()["steps"] % engine.num_workers]

    parts = split_microbatches(batch, engine.microbatches)  # before any work: a batch too small is refused
    engine.share_buffers([worker.index])  # one model trained sequentially: the buffers follow the batches
    scale = engine.loss_scale_now()  # Note [Loss scaling]

    def run():
        with engine.phase("pull", worker.index):
            worker.pull()
        with engine.phase("forward_backward+transfer", worker.index):
            return worker.compute(engine.loss_fn, *parts, loss_scale=scale)

    loss, compute, wait, weights_wait = engine.run_workers({worker.index: run})[worker.index]
    engine.begin_update()  # Note [A step's update under the mutex]
    engine.buffer_source = worker.index
    updated = time.perf_counter()
    with engine.phase("update"):
        applied = engine.apply_update([worker.index], None, loss_scale=scale)
    end = time.perf_counter()
    return step_metrics(engine, loss=loss, samples=samples, wall=end - start, compute=compute, update=end - updated,
                        transfer_wait=wait, copy_back=weights_wait, applied=applied, worker=worker.index,
                        loss_scale=scale)
