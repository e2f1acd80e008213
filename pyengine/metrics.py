"""Per-step metrics shared by the schedules."""
from __future__ import annotations

import math
import time


def step_counter(mode: str) -> str:
    """The counter that numbers a ``mode`` engine's steps: ``"pushes"`` for async, ``"steps"`` for the others (each
    equals ``applied_updates + skipped_steps + raised_steps``; the workers' random numbers are drawn per its value)."""
    return "pushes" if mode == "async" else "steps"


def step_metrics(engine: Engine, *, loss: float, samples: int, wall: float, compute: float, update: float,
                 transfer_wait: float, copy_back: float, applied: bool, lr_step: int | None = None,
                 lr_divisor: float = 1.0, loss_scale: float | None = None, **extra) -> dict:
    """The per-step metrics every schedule reports (seconds; overlap = (compute + update) / wall). ``lr``: the
    learning rate the update ran with: the scheduled one (:meth:`Engine.lr_at` its step, ``lr_step`` when not
    ``version``) divided by ``lr_divisor`` (async's staleness damping, :meth:`Engine.staleness_divisor`); None when
    the step was skipped. ``loss_scale``: the scale the step computed with, reported when the engine scales the
    loss."""
    lr = engine.lr_at(engine.version if lr_step is None else lr_step) / lr_divisor if applied else None
    # step: the steps (async: pushes) the engine has counted, this one included, as stats() counts them (the
    # length of history was not: a step raised for a non-finite gradient is counted and not recorded, and
    # load_state_dict restores the counts, not the history)
    step = engine._counters[step_counter(engine.mode)]
    return dict(step=step, version=engine.version, loss=loss, samples=samples, lr=lr,
                samples_per_s=samples / wall if wall > 0 else math.inf, wall_s=wall, compute_s=compute,
                transfer_wait_s=transfer_wait, update_s=update, copy_back_s=copy_back,
                overlap_efficiency=min(1.0, (compute + update) / wall) if wall > 0 else 1.0, applied=applied,
                time=time.time(), **({} if engine.scaler is None else {"loss_scale": loss_scale}), **extra)
