"""The engine: one model, G workers, master weights and Adam state in the host store, three schedules.

    engine = pyengine.Engine(model, loss_fn, devices=["cpu"] * 4, mode="hybrid", optimizer=pyengine.AdamW(lr=1e-3))
    metrics = engine.step(batch)        # hybrid and sync
    engine.fit(batches, steps=100)      # all modes; async workers pull batches from the iterator

Schedules (one module each): :mod:`pyengine.hybrid` (all workers compute, the host averages and updates: one batch G
times larger), :mod:`pyengine.sync` (one worker at a time, round-robin), :mod:`pyengine.asynchronous` (each worker
pushes whenever it is done; the host applies each push under a mutex; staleness measured, bounded, damped),
:mod:`pyengine.pipeline` (the layers split into stages on separate workers, fed by micro-batches: GPipe or 1F1B).

Note [One update path]
Every schedule updates the store through :meth:`Engine.apply_update`: a norm pass over the gradient slots (the
non-finite check and clipping both need the global norm before any weight changes), then the fused kernel over the
whole flat store. The step counter (``version``) counts applied updates; it is torch's ``step`` for bias correction.
"""
from __future__ import annotations

import collections
import concurrent.futures
import threading

import torch

from . import ops
from .asynchronous import run_async
from .hybrid import hybrid_step
from .optim import AdamW
from .pipeline import Pipeline, StageError, as_sequential, check_mode_options, check_options as check_pipeline
from .profiling import PhaseRecorder
from .store import HostStore
from .sync import sync_step
from .workers import Worker, WorkerError, parse_devices, set_worker_threads

__all__ = ["Engine", "StageError", "WorkerError"]

MODES = ("hybrid", "sync", "async", "pipeline")
FORMAT = "pyengine.engine/1"


class Engine:
    """Trains ``model`` with G workers; see the module docstring.

    Args:
        model: the model; its trainable parameters seed the master weights (it is not modified: workers train
            replicas; :meth:`master_state_dict` / :meth:`copy_to` give the result).
        loss_fn: ``loss_fn(model, batch) -> scalar`` mean loss over the batch.
        devices: one entry per worker (``"cpu"``, ``"cuda:i"``; entries may repeat). Default: every visible GPU,
            else 2 CPU workers.
        mode: ``"hybrid"``, ``"sync"``, ``"async"`` or ``"pipeline"`` (see :mod:`pyengine.pipeline`: the model is an
            ``nn.Sequential`` or a list of layers, batches are ``(inputs, targets)`` and ``loss_fn`` is called on
            the last stage as ``loss_fn(last_stage, (activations, targets))``).
        optimizer: :class:`pyengine.AdamW` (default ``AdamW()``).
        seed: seeds torch's RNG before the replicas are made.
        bucket_mb, first_bucket_mb: gradient bucket sizes of the streamers (DDP's scheme).
        unused: ``"zero"`` (parameters without a gradient in a step get zero) or ``"error"``.
        autocast: None, or ``torch.bfloat16``/``torch.float16``: replicas compute under autocast and gradients travel
            in that dtype (master weights stay fp32).
        nonfinite: ``"skip"`` (the step is skipped and counted) or ``"raise"``.
        accumulate: async: mini-batches whose gradients a worker sums before one push.
        max_staleness: async: a worker whose snapshot is more than this many versions old refreshes (pulls the
            current weights and recomputes the same mini-batches) before pushing.
        staleness_lr: async: ``"none"`` or ``"inverse"`` (lr / (1 + staleness)).
        batch_schedule: async: ``callable(version) -> int`` mini-batches per push, overriding ``accumulate`` (the
            mini-batch growing during training).
        pin: host store memory: ``"auto"``, True or False (see :class:`pyengine.HostStore`).
        stages: pipeline: S stages (default: one per device); ``devices`` holds S x R entries, stage s replica r
            on ``devices[s * R + r]``.
        microbatches: pipeline: M micro-batches per replica per step.
        schedule: pipeline: ``"1f1b"`` (at most S micro-batches stored per stage) or ``"gpipe"`` (fill-drain).
        balance: pipeline: ``"params"``, ``"time"`` or a list of S layer counts.
    """

    def __init__(self, model: torch.nn.Module, loss_fn, devices=None, mode: str = "hybrid",
                 optimizer: AdamW | None = None, seed: int = 0, *, bucket_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, unused: str = "zero", autocast: torch.dtype | None = None,
                 nonfinite: str = "skip", accumulate: int = 1, max_staleness: int | None = None,
                 staleness_lr: str = "none", batch_schedule=None, pin="auto", stages: int | None = None,
                 microbatches: int = 1, schedule: str = "1f1b", balance="params"):
        self._check_options(mode, nonfinite, accumulate, max_staleness, staleness_lr, autocast, loss_fn)
        check_mode_options(mode, stages, microbatches, schedule, balance, autocast)
        if mode == "pipeline":
            model = as_sequential(model)
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("the model has no trainable parameters (every parameter has requires_grad=False)")
        self.devices = parse_devices(devices)
        slots = len(self.devices)
        if mode == "pipeline":  # one gradient slot per data-parallel replica (Note [Pipeline update path])
            stages = len(self.devices) if stages is None else stages
            check_pipeline(len(model), len(self.devices), stages, microbatches, schedule, balance)
            slots = len(self.devices) // stages
        # model.parameters() order (shared parameters once): how torch.optim indexes its state
        self.param_names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.mode = mode
        self.loss_fn = loss_fn
        self.optimizer = optimizer if optimizer is not None else AdamW()
        if not isinstance(self.optimizer, AdamW):
            raise TypeError(f"optimizer must be a pyengine.AdamW; got {type(self.optimizer).__name__}")
        self.nonfinite = nonfinite
        self.accumulate = accumulate
        self.max_staleness = max_staleness
        self.staleness_lr = staleness_lr
        self.batch_schedule = batch_schedule
        self.seed = seed
        torch.manual_seed(seed)
        grad_dtype = autocast if autocast is not None else torch.float32
        self.store = HostStore(model, workers=slots, grad_dtype=grad_dtype, pin=pin,
                               amsgrad=self.optimizer.amsgrad)
        self.workers = [] if mode == "pipeline" else [  # pipeline stages are built by Pipeline below
            Worker(i, d, model, self.store, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb, unused=unused,
                   autocast_dtype=autocast) for i, d in enumerate(self.devices)]
        self.version = 0  # applied updates: the optimizer's step count
        self.mutex = threading.Lock()  # the store's mutex: async pulls and pushes hold it
        self.recorder = PhaseRecorder()
        self.history: list[dict] = []
        self._counters = collections.Counter()
        self._staleness = collections.Counter()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, len(self.workers)), thread_name_prefix="pyengine-worker",
            initializer=set_worker_threads, initargs=(self.devices,))
        self.pipeline = None if mode != "pipeline" else Pipeline(
            self, model, stages=stages, microbatches=microbatches, schedule=schedule, balance=balance, unused=unused)
        self._closed = False

    # ---- public API ------------------------------------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def step(self, batch) -> dict:
        """One training step on ``batch`` (hybrid: split across workers; sync: the next worker in turn; pipeline:
        ``(inputs, targets)`` through the stages in micro-batches)."""
        self._check_open()
        if self.mode == "pipeline":
            return self._record(self.pipeline.step(batch))
        if self.mode == "hybrid":
            return self._record(hybrid_step(self, batch))
        if self.mode == "sync":
            return self._record(sync_step(self, batch))
        raise ValueError("step() is for mode='hybrid' or 'sync'; async workers pull batches: use fit(batches)")

    def fit(self, batches, steps: int | None = None, epochs: int | None = None, callbacks=()) -> list[dict]:
        """Trains on ``batches`` (an iterable; re-iterated per epoch) for ``steps`` updates or ``epochs`` passes.

        Each callback is called as ``callback(engine, metrics)`` after every step (hybrid, sync) or push (async).
        Returns the metrics of this call's steps.
        """
        self._check_open()
        if steps is not None and steps < 0:
            raise ValueError(f"steps must be >= 0; got {steps}")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1; got {epochs}")
        start = len(self.history)
        if self.mode == "async":
            run_async(self, batches, steps=steps, epochs=epochs if epochs is not None or steps is not None else 1,
                      callbacks=callbacks)
        else:
            for batch in _batches(batches, steps, epochs):
                metrics = self.step(batch)
                for callback in callbacks:
                    callback(self, metrics)
        return self.history[start:]

    def master_state_dict(self) -> dict:
        """The fp32 master weights, keys as ``model.state_dict()`` (trainable parameters only)."""
        return {name: view.detach().clone() for name, view in self.store.views(self.store.param).items()}

    def copy_to(self, model: torch.nn.Module) -> None:
        """Writes the master weights into ``model``'s parameters."""
        self.store.copy_to(model)

    def optimizer_state_dict(self) -> dict:
        """The Adam state in ``torch.optim.AdamW.state_dict()`` form."""
        return self.optimizer.torch_state_dict(self.store, self.version, self.param_names)

    def state_dict(self) -> dict:
        """Everything needed to resume bit-identically: weights, optimizer state, step, RNG, statistics."""
        return {
            "format": FORMAT,
            "mode": self.mode,
            "version": self.version,
            "names": list(self.store.names),
            "master": self.master_state_dict(),
            "optimizer": self.optimizer_state_dict(),
            "optimizer_config": self.optimizer.config(),
            "rng": torch.get_rng_state(),
            "counters": dict(self._counters),
            "staleness": dict(self._staleness),
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restores :meth:`state_dict`; validates format, names and shapes before changing anything."""
        self._check_open()
        if not isinstance(sd, dict) or sd.get("format") != FORMAT:
            found = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
            raise ValueError(f"not a pyengine engine state (expected format {FORMAT!r}; got {found!r})")
        if list(sd["names"]) != list(self.store.names):
            raise ValueError(f"the state's parameters {sd['names']} do not match this model's {self.store.names}")
        views = self.store.views(self.store.param)
        for name, value in sd["master"].items():
            if tuple(value.shape) != tuple(views[name].shape) or value.dtype != torch.float32:
                raise ValueError(f"master weight {name!r}: expected float32 {tuple(views[name].shape)}; got "
                                 f"{value.dtype} {tuple(value.shape)}")
        step = self.optimizer.load_torch_state_dict(self.store, sd["optimizer"], self.param_names)
        for name, value in sd["master"].items():
            views[name].copy_(value)
        self.version = int(sd["version"])
        if step not in (0, self.version):
            raise ValueError(f"optimizer step {step} does not match the engine's version {self.version}")
        torch.set_rng_state(sd["rng"])
        self._counters = collections.Counter(sd["counters"])
        self._staleness = collections.Counter({int(k): v for k, v in sd["staleness"].items()})
        for worker in self.workers:
            worker.pull()

    def stats(self) -> dict:
        """Counters: steps, pushes, applied updates, skipped steps, refreshes, and the staleness histogram."""
        hist = dict(sorted(self._staleness.items()))
        total = sum(hist.values())
        return {
            "steps": self._counters["steps"],
            "pushes": self._counters["pushes"],
            "applied_updates": self._counters["applied_updates"],
            "skipped_steps": self._counters["skipped_steps"],
            "refreshes": self._counters["refreshes"],
            "version": self.version,
            "staleness_histogram": hist,
            "staleness_mean": sum(k * v for k, v in hist.items()) / total if total else 0.0,
            "staleness_max": max(hist) if hist else 0,
        }

    def trace(self, path) -> None:
        """Writes a Chrome trace (chrome://tracing, Perfetto) of the recorded phases per worker."""
        self.recorder.write_chrome_trace(path)

    def close(self) -> None:
        """Stops the worker threads and removes every hook. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        if self.pipeline is not None:
            self.pipeline.close()
        for worker in self.workers:
            worker.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # ---- shared machinery of the schedules --------------------------------------------------------------------

    def phase(self, name: str, worker: int | None = None):
        """NVTX range + trace span for one phase of ``worker`` (None: the host)."""
        who = "host" if worker is None else f"worker{worker}"
        return self.recorder.phase(who, name, 0 if worker is None else worker + 1)

    def run_workers(self, tasks: dict) -> dict:
        """Runs ``{worker_index: fn}`` on the worker threads; returns ``{index: result}``.

        If any worker raises, waits for the others to finish their task (so no thread is left running), then
        raises :class:`WorkerError` naming the first failed worker, with the original exception as its cause.
        """
        futures = {i: self._pool.submit(fn) for i, fn in tasks.items()}
        concurrent.futures.wait(futures.values())
        for i, future in futures.items():
            exc = future.exception()
            if exc is not None:
                raise WorkerError(i, self.devices[i], exc) from exc
        return {i: f.result() for i, f in futures.items()}

    def apply_update(self, workers: list[int], weights: list[float] | None, lr: float | None = None) -> bool:
        """One fused update from the gradient slots of ``workers`` (see Note [One update path]).

        Returns False when the step was skipped because a gradient was not finite (``nonfinite="skip"``).
        """
        store, opt = self.store, self.optimizer
        slots = [store.grad_slot(g) for g in workers]
        norm, nonfinite = ops.mean_grad_norm(slots, weights)
        if nonfinite.item() != 0.0:
            if self.nonfinite == "raise":
                raise FloatingPointError(f"non-finite gradient at step {self.version + 1} (workers {workers}); the "
                                         "master weights keep the last complete update")
            self._counters["skipped_steps"] += 1
            return False
        self.version += 1
        clip = opt.max_grad_norm or 0.0
        torch.ops.pyengine.mean_grad_adamw_.default(
            store.param, store.exp_avg, store.exp_avg_sq, slots, **opt.kernel_kwargs(lr), step=self.version,
            max_exp_avg_sq=store.max_exp_avg_sq, grad_scale=None, found_inf=None, weights=weights,
            param_out=store.shadow, grad_norm=norm if clip else None, max_grad_norm=float(clip))
        self._counters["applied_updates"] += 1
        return True

    def count(self, key: str, n: int = 1) -> None:
        self._counters[key] += n

    def record_staleness(self, staleness: int) -> None:
        self._staleness[staleness] += 1

    # ---- internals --------------------------------------------------------------------------------------------

    def _record(self, metrics: dict) -> dict:
        self.history.append(metrics)
        return metrics

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine is closed")

    @staticmethod
    def _check_options(mode, nonfinite, accumulate, max_staleness, staleness_lr, autocast, loss_fn):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
        if nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite must be 'skip' or 'raise'; got {nonfinite!r}")
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate must be an integer >= 1; got {accumulate!r}")
        if accumulate > 1 and mode != "async":
            raise ValueError(f"accumulate is an async option (mini-batches summed before one push); mode={mode!r}")
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
            raise ValueError(f"max_staleness must be an integer >= 0 or None; got {max_staleness!r}")
        if staleness_lr not in ("none", "inverse"):
            raise ValueError(f"staleness_lr must be 'none' or 'inverse'; got {staleness_lr!r}")
        if autocast not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"autocast must be None, torch.bfloat16 or torch.float16; got {autocast!r}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable as loss_fn(model, batch) -> scalar tensor")


def _batches(batches, steps, epochs):
    """Yields batches for ``steps`` steps or ``epochs`` passes (one pass when neither is given)."""
    if steps is None and epochs is None:
        epochs = 1
    done, epoch = 0, 0
    while epochs is None or epoch < epochs:
        produced = False
        for batch in batches:
            if steps is not None and done >= steps:
                return
            produced = True
            done += 1
            yield batch
        if not produced:
            if done == 0 and steps:
                raise ValueError("batches is empty")
            return
        epoch += 1
