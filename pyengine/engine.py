"""The engine: one model, G workers, master weights and Adam state in the host store, three schedules.

    engine = pyengine.Engine(model, loss_fn, devices=["cpu"] * 4, mode="hybrid", optimizer=pyengine.AdamW(lr=1e-3))
    metrics = engine.step(batch)        # hybrid and sync
    engine.fit(batches, steps=100)      # all modes; async workers pull batches from the iterator

Schedules (one module each): :mod:`pyengine.hybrid` (all workers compute, the host averages and updates: one batch G
times larger), :mod:`pyengine.sync` (one worker at a time, round-robin), :mod:`pyengine.asynchronous` (each worker
pushes whenever it is done; the host applies each push under a mutex; staleness measured, bounded, damped),
:mod:`pyengine.pipeline` (the layers split into stages on separate workers, fed by micro-batches: GPipe or 1F1B).

Note [One update path]
Every update of the store is the fused kernel run by :meth:`Engine.update_range`, after :meth:`Engine.admit_update`
has decided from the global norm of the mean gradient whether the step is applied (the non-finite check and clipping
both need that norm before any weight changes). Sync and async take the norm and update the whole flat store in one
go (:meth:`Engine.apply_update`). Hybrid pipelines both per bucket (:mod:`pyengine.hybrid`): each bucket's share of
the norm is taken as soon as every worker delivered it, while backward still runs, and once the step is admitted
each bucket is updated and its copy back to the replicas starts at once, overlapping the update of the next bucket.
Updating before the whole norm is known would let a non-finite gradient in a late bucket leave a half-applied step:
the master weights must always hold the last complete update. The step counter (``version``) counts applied
updates; it is torch's ``step`` for bias correction.
"""
from __future__ import annotations

import collections
import collections.abc
import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import hashlib
import inspect
import numbers
import os
import sys
import threading
import time
import warnings
import weakref

import torch

from . import distributed, ops, rng as rng_module
from .asynchronous import run_async
from .hybrid import hybrid_step
from .metrics import step_counter
from .optim import AdamW, check_lr_factor, check_state_values
from .pipeline import Pipeline, StageError, as_sequential, check_mode_options, check_options as check_pipeline
from .profiling import PhaseRecorder
from .rng import WorkerRNG, cpu_generator_seed
from .scaler import LossScaler, grad_scale_tensor, make_scaler
from .store import (HostStore, check_initialized, check_no_partial_overlap, check_pin, layout_of, overlaps_itself,
                    replica_shadow_dtype)
from .streamer import _POLL_S, check_options as check_streamer_options, refuse_script_module
from .sync import sync_step
from .workers import (KeptBufferCopies, Worker, WorkerError, deferred_interrupt, parse_devices, put_back_saved,
                      replace_buffer, task_thread_initializer)

__all__ = ["Engine", "StageError", "WorkerError"]

MODES = ("hybrid", "sync", "async", "pipeline")
FORMAT = "pyengine.engine/1"


# Note [Importing the distributed pipeline]
# pyengine.pipeline_distributed imports torch.distributed.pipelining, and with it torch._dynamo: ~3 s, as long as
# torch's own import, so it is imported only where a pipeline across processes is built (distributed_pipeline()).
# Two things that import does would keep what the importer holds (an Engine under construction, its process group)
# alive after the caller dropped it:
# - torch.distributed.nn.functional's functions take ``group=group.WORLD`` as a default argument: imported while a
#   process group exists, they keep that group past torch.distributed.destroy_process_group() (its gloo threads
#   then end at interpreter shutdown, Note [No reference cycle through the engine] in pyengine/pipeline.py).
#   pyengine.distributed imports that module at once, before any group can exist (milliseconds).
# - torch.fx.wrap, run by module code during the import, keeps its own frame in a local: a cycle, which holds every
#   frame of the importing stack (Engine.__init__'s, with its locals) until the garbage collector runs (never, with
#   gc disabled). distributed_pipeline() collects right after the import.


def distributed_pipeline():
    """The module :mod:`pyengine.pipeline_distributed`, imported at the first call (Note [Importing the distributed
    pipeline])."""
    module = sys.modules.get("pyengine.pipeline_distributed")
    if module is None:
        from . import pipeline_distributed as module
        gc.collect()
    return module


def _across_processes(pipeline) -> bool:
    """Whether ``pipeline`` is a :class:`pyengine.pipeline_distributed.DistributedPipeline` (no pipeline can be one
    before that module is imported)."""
    module = sys.modules.get("pyengine.pipeline_distributed")
    return module is not None and isinstance(pipeline, module.DistributedPipeline)


def _under_mutex(method):
    """``method`` holding the engine's (re-entrant) mutex: a reader or writer of the state, never between an async
    pull's or push's parts (Note [Reading the state while async workers run] in asynchronous.py)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.mutex:
            return method(self, *args, **kwargs)
    return locked


_LIVE_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


class _FitEnd:
    """How fit's steps ended: how many ran, and the other ranks whose fit's end refused this rank's next step
    (Note [Ranks whose fits end at different steps], distributed.py), None when none did."""

    def __init__(self, steps: int, peers: list[int] | None):
        self.steps, self.peers = steps, peers


class _InFlight(collections.namedtuple("_InFlight", "generators buffers")):
    """What a running step keeps for readers until its update begins (Note [Reading the state during a step]):
    torch's generators before its work (``Engine._generator_states()``) and the copies of the source replica's
    buffers (None when that replica does not compute in this step)."""


def _before_fork() -> None:
    """A fork happens between two updates of every engine (Note [An engine in a forked process])."""
    for engine in list(_LIVE_ENGINES):
        engine._fork_held = engine.mutex.acquire(timeout=10)


def _after_fork_in_parent() -> None:
    for engine in list(_LIVE_ENGINES):
        if getattr(engine, "_fork_held", False):
            engine._fork_held = False
            engine.mutex.release()


def _after_fork_in_child() -> None:
    """The locks as the child's own, free (the threads that held them are not there)."""
    for engine in list(_LIVE_ENGINES):
        engine.mutex, engine._step_lock, engine._update_held, engine._fork_held, engine._step_depth = (
            threading.RLock(), threading.RLock(), 0, False, 0)


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)



def plain_int(value):
    """A numpy integer (any ``numbers.Integral`` but bool and int) as a Python int; anything else as it is, for the
    checks to judge."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)
    return value


def _generator_untouched_on_failure(init):
    """An Engine refused after its seeding (a check that needs the replicas or the stages built) puts torch's CPU
    generator back as it found it, as one refused by the option checks before the seeding does."""
    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except BaseException:
            before = self.__dict__.pop("_generator_before", None)
            if before is not None:
                torch.set_rng_state(before)
            raise
        self.__dict__.pop("_generator_before", None)
    return wrapper


def _takes_in_place(target: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether buffer ``target`` can take ``value``'s values by copy_ (Note [Buffers that are not saved])."""
    return (target.shape == value.shape and target.dtype == value.dtype
            and (target.is_contiguous() or not overlaps_itself(target)))  # is_contiguous: one C call, ~0.15 us


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
        lr_schedule: None, or ``callable(step) -> factor``: update ``k`` (1-based) uses ``optimizer.lr *
            lr_schedule(k - 1)``, as ``torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule)`` stepped after every
            ``opt.step()`` (e.g. :class:`pyengine.WarmupCosine`). ``step`` counts applied updates, so a skipped
            step (non-finite gradient) does not advance it; the schedule is not saved by :meth:`state_dict`: pass
            the same one to the engine that loads it. A value that is not a finite number >= 0 raises
            ``ValueError`` before that step changes anything (async: the push is neither applied nor counted, and
            ``fit`` raises the ``ValueError`` itself, as sync and hybrid do; so does any error the schedule raises).
        seed: seeds torch's RNG before the replicas are made, and the workers' own generators: workers that
            compute at the same time (hybrid and async with more than one worker or a process group, pipeline
            stages) draw dropout masks and the like from a generator each, seeded per step from (seed, worker,
            step), so runs with the same seed are bit-identical and resume bit-identically (Note [Random numbers of
            concurrent workers] in :mod:`pyengine.rng`).
        random_modules: module classes (besides dropout, RReLU and MultiheadAttention) whose forward draws random
            numbers, to be routed to the workers' own generators too.
        keep_history: the most step (async: push) metrics :attr:`history` keeps, the oldest dropped first (each is
            about 1 kB), and the most :meth:`fit` returns; None keeps every one. Callbacks see every one.
        bucket_mb, first_bucket_mb: gradient bucket sizes of the streamers (DDP's scheme).
        eager_mb: gradients of at least this many MiB start their copy to the host as soon as they are ready, ahead of
            their bucket (None: whole buckets only); see :class:`~pyengine.GradientStreamer`.
        unused: ``"zero"`` (parameters without a gradient in a step get zero) or ``"error"``. A zero gradient is
            still an AdamW step: the parameter's momentum and weight decay move it, where ``torch.optim.AdamW``
            leaves a parameter whose ``.grad`` is None alone (DDP too, for one no rank used). Freeze a parameter
            (``requires_grad=False``) that must not move; a step whose loss reached no parameter at all warns.
        autocast: None, or ``torch.bfloat16``/``torch.float16``: replicas compute under autocast and gradients travel
            in that dtype (master weights stay fp32).
        loss_scale: ``"auto"`` (dynamic loss scaling under float16 autocast, none otherwise), ``"dynamic"``, None (no
            scaling), a number > 0 (a static scale) or a :class:`pyengine.LossScaler`: each loss is multiplied by the
            scale before backward and the update divides the gradients by it; a non-finite gradient backs the scale
            off and skips the step (Note [Loss scaling] in :mod:`pyengine.scaler`).
        nonfinite: ``"skip"`` (the step is skipped and counted) or ``"raise"``.
        accumulate: async: mini-batches whose gradients a worker sums before one push.
        max_staleness: async: a worker whose snapshot is more than this many versions old refreshes (pulls the
            current weights and recomputes the same mini-batches) before pushing.
        staleness_lr: async: ``"none"`` or ``"inverse"`` (lr / (1 + staleness)).
        batch_schedule: async: ``callable(version) -> int`` mini-batches per push, overriding ``accumulate`` (the
            mini-batch growing during training). Asked with the version a worker pulls before it takes new
            mini-batches (not at a refresh, nor once the run stopped); the last pulls may find the batches run out,
            so it answers any version.
        pin: host store memory: ``"auto"``, True or False (see :class:`pyengine.HostStore`).
        stages: pipeline: S stages (default: one per device); ``devices`` holds S x R entries, stage s replica r
            on ``devices[s * R + r]``.
        microbatches: pipeline: M micro-batches per replica per step. Hybrid and sync: each worker's part of the
            batch runs as this many micro-batches whose gradients accumulate in the replica (each loss weighted by
            its share of the samples) before one transfer: the step is still one step on the whole batch, with the
            activations of one micro-batch at a time. Layers that use batch statistics (BatchNorm) see micro-batches.
        schedule: pipeline: ``"1f1b"`` (at most S micro-batches stored per stage) or ``"gpipe"`` (fill-drain).
        balance: pipeline: ``"params"``, ``"time"`` or a list of S layer counts.
        process_group: ``"auto"`` (the default torch.distributed group when it is initialized with more than one
            rank, e.g. under torchrun), None (this process alone) or a ``ProcessGroup``. With a group, hybrid steps
            combine every rank's gradients (one step on the concatenated batch) and async runs ranks
            ``0..servers-1`` as the servers of the other ranks' pushes; see :mod:`pyengine.distributed`. Pipeline
            with a group of S ranks: rank s runs stage s on its one device; with ``stages=S`` on S x R ranks, rank
            s * R + r runs stage s of data-parallel replica r
            (:class:`pyengine.pipeline_distributed.DistributedPipeline`). With a group, constructing the Engine is
            a collective, also when this rank's own checks fail (it then tells the other ranks before it raises:
            Note [Every rank's engine alike]): every rank of the group builds its Engine at the same point.
        shard_update: hybrid with a process group: reduce-scatter, each rank updates its 1/P of the weights and
            Adam state, all-gather (ZeRO-1 style); each rank's host store holds only its 1/P of the Adam state, so
            :meth:`state_dict` and :meth:`optimizer_state_dict` gather it: collectives every rank must call.
        servers: async with a process group: ranks ``0..servers-1`` are parameter servers, each holding and updating
            a contiguous shard of the store; the other ranks compute and push (see :mod:`pyengine.distributed`).

    Buffers (BatchNorm running statistics and the like) are not averaged. As DDP with ``broadcast_buffers=True``,
    one replica is their source: hybrid copies worker 0's buffers to the other replicas at the start of every step;
    sync hands them from each worker to the next, like one model trained sequentially; async leaves each replica its
    own and reports worker 0's; pipeline starts every step from replica 0's stages (across processes each stage's
    rank holds its buffers: Note [Buffers of stages across processes]). :meth:`buffers_state_dict`,
    :meth:`state_dict`, :meth:`copy_to` and :meth:`load_state_dict` use that source. Non-persistent buffers follow
    it too; the state holds the persistent ones only (Note [Buffers that are not saved]).
    """

    @_generator_untouched_on_failure
    def __init__(self, model: torch.nn.Module, loss_fn, devices=None, mode: str = "hybrid",
                 optimizer: AdamW | None = None, seed: int = 0, *, lr_schedule=None, bucket_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, eager_mb: float | None = 1.0, unused: str = "zero",
                 autocast: torch.dtype | None = None,
                 nonfinite: str = "skip", accumulate: int = 1, max_staleness: int | None = None,
                 staleness_lr: str = "none", batch_schedule=None, pin="auto", process_group="auto",
                 shard_update: bool = False, servers: int = 1, stages: int | None = None, microbatches: int = 1,
                 schedule: str = "1f1b", balance="params", loss_scale="auto", random_modules=(),
                 keep_history: int | None = None):
        # numpy's integers as Python's (the checks below, the saved config and the ranks' comparison take ints)
        seed, accumulate, max_staleness, servers, stages, microbatches, keep_history = map(
            plain_int, (seed, accumulate, max_staleness, servers, stages, microbatches, keep_history))
        if isinstance(balance, (list, tuple)):
            balance = [plain_int(size) for size in balance]
        try:  # this rank's own checks; a failure is reported to the other ranks (Note [Every rank's engine alike])
            if mode != "pipeline" and not isinstance(model, torch.nn.Module):  # AttributeError 'parameters' before
                raise TypeError(f"Engine: model must be an nn.Module (or, for mode='pipeline', a list of layers); "
                                f"got {type(model).__name__}")
            refuse_script_module(model, "Engine")
            self._check_options(mode, nonfinite, accumulate, max_staleness, staleness_lr, batch_schedule, autocast,
                                loss_fn)
            if keep_history is not None and (not isinstance(keep_history, int) or isinstance(keep_history, bool)
                                             or keep_history < 0):
                raise ValueError(f"keep_history must be an integer >= 0 or None; got {keep_history!r}")
            if not isinstance(balance, str) and getattr(balance, "ndim", None) is not None and hasattr(balance,
                                                                                                   "tolist"):
                balance = balance.tolist()  # an array or tensor of layer counts ("is ambiguous" in the checks)
            check_mode_options(mode, stages, microbatches, schedule, balance)
            bucket_mb, first_bucket_mb, eager_mb = check_streamer_options(bucket_mb, first_bucket_mb, unused, eager_mb,
                                                                          who="Engine")
            check_pin(pin, who="Engine")
            if mode == "pipeline":
                model = as_sequential(model)
            if not any(p.requires_grad for p in model.parameters()):
                raise ValueError("the model has no trainable parameters (every parameter has requires_grad=False)"
                                 if any(True for _ in model.parameters()) else "the model has no parameters")
            for name, param in model.named_parameters():  # before the host store is allocated
                check_initialized(name, param, "Engine")
                if param.requires_grad and param.is_complex():
                    raise ValueError(f"parameter {name!r} is {param.dtype}: a trainable parameter must be real "
                                     "(float32, bfloat16 or float16; the master weights are float32); hold its real "
                                     "and imaginary parts as a real parameter of shape (..., 2) and use "
                                     "torch.view_as_complex(p) in the forward")
                if param.requires_grad and param.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise ValueError(f"parameter {name!r} is {param.dtype}: a trainable parameter must be float32, "
                                     "bfloat16 or float16 (the master weights are float32); give the engine "
                                     "model.float()")
                if param.requires_grad and not param.is_contiguous():
                    raise ValueError(f"parameter {name!r} is not contiguous (shape {tuple(param.shape)}, strides "
                                     f"{param.stride()}; channels_last, or a transposed tensor): gradients and weights "
                                     "travel as flat buffers; give the engine the model after `for p in "
                                     "model.parameters(): p.data = p.data.contiguous()` (a channels_last model: "
                                     "model.to(memory_format=torch.contiguous_format))")
            check_no_partial_overlap(model.named_parameters())
            self.devices = parse_devices(devices)
            slots = len(self.devices)
            group = distributed.resolve_group(process_group, shard_update, mode)
            self.process_group = group
            # the works of this engine's collectives: Note [Gloo's works are released by the thread that waits]
            self.collective_works = distributed.KeptWorks(4096)
            if group is not None:
                distributed.keep_through_exit(self)
            if mode == "pipeline" and group is not None:  # rank s runs stage s (pyengine.pipeline_distributed)
                stages, slots = distributed_pipeline().check_engine_options(
                    model, self.devices, stages, microbatches, schedule, balance, group), 1
            elif mode == "pipeline":  # one gradient slot per data-parallel replica (Note [Pipeline update path])
                if stages is None and len(self.devices) > len(model):  # the default: one stage per device
                    raise ValueError(f"mode='pipeline': stages defaults to one per device, {len(self.devices)}, more "
                                     f"than the model's {len(model)} layers (each stage needs at least one); give "
                                     "stages=S (the devices are S stages x R replicas)")
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
            self.microbatches = microbatches
            if lr_schedule is not None and not callable(lr_schedule):
                raise TypeError(f"lr_schedule must be callable as lr_schedule(step) -> factor on the lr; "
                                f"got {type(lr_schedule).__name__}")
            self.lr_schedule = lr_schedule
            # ((update, schedule, base lr), lr): lr_at's last answer, so a per-bucket update asks the schedule once
            self._lr = (None, None)
            if not isinstance(seed, int) or isinstance(seed, bool):
                raise TypeError(f"seed must be an int; got {seed!r}")
            if not -2 ** 63 <= seed < 2 ** 64:  # torch.manual_seed's range
                raise ValueError(f"seed must be an int in [-2**63, 2**64); got {seed}")
            self.seed = seed
            self.random_modules = _module_classes(random_modules)
            self._worker_rngs: list[WorkerRNG] = []  # the workers' or pipeline stages' own generators (begin_rng_step)
            if self.optimizer.no_decay and shard_update:
                raise ValueError("AdamW(no_decay=...) with shard_update=True is not supported: the sharded update runs "
                                 "one weight decay over each rank's ranges; leave out one of them")
            self.scaler: LossScaler | None = make_scaler(loss_scale, autocast)
            grad_dtype = autocast if autocast is not None else torch.float32
            self.servers = distributed.check_servers(  # with the store's numel, before the store is allocated
                servers, group, mode, layout_of(model, grad_dtype, replica_shadow_dtype(model))[1])
            self._generator_before = torch.get_rng_state()  # put back if a later check refuses the engine
            # once every option is checked: a refused engine leaves the generator alone; the CPU generator keeps 32
            # bits of its seed, so seeds that differ above bit 32 (5 and 5 + 2**32) drew the same Dropout masks
            torch.manual_seed(cpu_generator_seed(seed))
        except Exception as exc:
            distributed.report_failed_config(process_group, exc)
            raise
        self._first_worker = 0  # the group-wide index of this rank's worker 0 (worker_rng)
        if group is not None:  # Note [Every rank's engine alike]: before any collective and any allocation
            workers = distributed.check_same_config(group, dict(
                mode=mode, shard_update=shard_update, servers=servers, stages=stages,
                microbatches=microbatches if mode == "pipeline" else None,
                schedule=schedule, balance=balance if isinstance(balance, str) else repr(balance),
                parameters=[(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()],
                buffers=[(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()],
                modules_in_eval_mode=[n for n, m in model.named_modules() if not m.training],
                bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb, unused=unused, autocast=str(autocast),
                optimizer=self.optimizer.config(), loss_scale=repr(self.scaler), nonfinite=nonfinite,
                max_staleness=max_staleness, staleness_lr=staleness_lr, seed=seed, lr_schedule=_samples(lr_schedule),
                random_modules=[c.__qualname__ for c in self.random_modules]), local=len(self.devices))
            self._first_worker = sum(workers[:group.rank()])  # the ranks' worker counts may differ
        # a low-precision model's replicas pull a shadow of their dtype (Note [The shadow follows the master weights])
        shadow_dtype = replica_shadow_dtype(model)
        # pinned under the first GPU worker's context, not one the allocation would make on the current device
        # (Note [Pinning under a context that exists] in csrc/cuda/pinned_host.cpp)
        cuda = next((d for d in self.devices if d.type == "cuda"), None)
        with torch.cuda.device(cuda) if cuda is not None else contextlib.nullcontext():
            self.store = HostStore(model, workers=slots, grad_dtype=grad_dtype, pin=pin,
                                   amsgrad=self.optimizer.amsgrad, shadow_dtype=shadow_dtype,
                                   state_ranges=distributed.owned_state_ranges(model, grad_dtype, bucket_mb,
                                                                               first_bucket_mb, group, shadow_dtype)
                                   if shard_update else None)
        self._decay_runs = (self.optimizer.no_decay, _decay_runs(self.store, self.optimizer))
        self.workers = [] if mode == "pipeline" else [  # pipeline stages are built by Pipeline below
            Worker(i, d, model, self.store, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb, eager_mb=eager_mb,
                   unused=unused, autocast_dtype=autocast, random_modules=self.random_modules,
                   rng=self.worker_rng(d, i) if mode != "sync" and (len(self.devices) > 1 or group is not None)
                   else None)
            for i, d in enumerate(self.devices)]
        self.version = 0  # applied updates: the optimizer's step count
        # The store's mutex: async pulls and pushes hold it, and so do a step's update (Note [A step's update under
        # the mutex]), the readers of the state (state_dict, stats) and close(). Re-entrant: a callback runs under it
        # and may call them (Note [Reading the state while async workers run] in asynchronous.py).
        self.mutex = threading.RLock()
        self._step_lock = threading.RLock()  # one step at a time (Note [A step's update under the mutex])
        self._update_held = 0  # times the running step took the mutex in begin_update
        self._in_flight: _InFlight | None = None  # a step's states from before its work, until its update begins
        self._step_depth = 0  # step() calls running (on the thread holding _step_lock; load_state_dict asks)
        self._pid = os.getpid()  # Note [An engine in a forked process]
        _LIVE_ENGINES.add(self)
        self._async_run = None  # the async fit running now (asynchronous.AsyncRun), for close()
        self.recorder = PhaseRecorder()
        self.history: list[dict] = []
        self.keep_history = keep_history
        self._recorded = 0  # metrics recorded so far, the ones dropped from history included (fit counts with it)
        self._fit_records = None  # an async fit's own metrics, recorded by its pushes (_fit)
        self._counters = collections.Counter()
        self._staleness = collections.Counter()
        # Note [One CPU worker runs on the calling thread] (submit_workers); async follows it too
        self.inline_worker = len(self.devices) == 1 and self.devices[0].type == "cpu"
        # close() restores it, and so does an engine dropped unclosed (Note [Worker threads' count])
        self._intra_op_threads = torch.get_num_threads()
        self._restore_threads = weakref.finalize(self, torch.set_num_threads, self._intra_op_threads)
        self._restore_threads.atexit = False
        self._task_threads = set()  # idents of the threads of this engine's worker and stage pools (close() asks)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, len(self.workers)), thread_name_prefix="pyengine-worker",
            initializer=task_thread_initializer, initargs=(self._task_threads, self.devices, self._intra_op_threads))
        # Note [Buffers that are not saved]
        # Every buffer follows the schedule's source in the process (shared, handed on, put back after a failed step,
        # copied out by copy_to), as DDP's broadcast_buffers shares named_buffers(): a non-persistent one that the
        # forward changes (a counter, an EMA kept out of checkpoints) trains as in torch. A checkpoint holds the
        # persistent ones only (state_dict's keys: buffers_state_dict, load_state_dict), as torch's does;
        # load_state_dict leaves a non-persistent buffer as the replicas hold it, as torch's does. A buffer (persistent
        # or not) may be a cache the forward replaces at another size (rotary tables) or a view that overlaps itself (an
        # expanded mask): one that cannot take the source's values in place is replaced by a copy of them
        # (replace_buffer; an expanded one is made whole), in share_buffers, load_state_dict and copy_to (whose model's
        # persistent buffers must have the engine's shapes, as torch's load_state_dict asks), and one that overlaps
        # itself is not written back after a failed step (no forward wrote into it). Replicas start with such views made
        # whole (replica_of), and a receive from another rank writes into whole ones (whole_buffers). Persistent ones
        # failed before (hybrid's every step, from the first: copy_ cannot write into an expanded view; across processes
        # the engine's construction). A constant one costs what DDP's broadcast costs: its copies each step, nothing
        # when a model has none. Across processes only the persistent ones travel (their shapes are checked alike on
        # every rank when the engine is built; a cache's may differ between ranks by then): each rank's non-persistent
        # ones are its own, and the pipeline across processes takes them for each stage's constants (Note [Buffers of
        # stages across processes]).
        saved_names = model.state_dict().keys()
        self.buffer_names = [name for name, _ in model.named_buffers()]  # the shared ones, in named_buffers' order
        self.saved_buffer_names = [name for name in self.buffer_names if name in saved_names]
        self._saved_buffers = frozenset(self.saved_buffer_names)  # the same, for lookups on the step's path
        if mode == "pipeline" and group is not None:
            self.buffer_names = list(self.saved_buffer_names)
        self.buffer_source = 0  # the worker whose replica holds the current buffers (see the class docstring)
        self._buffers_before = None  # Note [A failed step leaves the buffers alone]
        self._buffers_gathered = None  # the last gather_workers' snapshot (drop_gathered_step)
        self._buffer_kept = {}  # the source replica's KeptBufferCopies, by source
        self._buffers_on_cpu = all(d.type == "cpu" for d in self.devices)  # share_buffers' copies: one foreach
        self._stop = threading.Event()
        self._fitting = False  # fit() is running (one at a time)
        if mode == "pipeline" and group is not None:
            self.pipeline = distributed_pipeline().DistributedPipeline(
                self, model, stages=stages, microbatches=microbatches, schedule=schedule, balance=balance,
                unused=unused, autocast=autocast, group=group)
        else:
            self.pipeline = None if mode != "pipeline" else Pipeline(
                self, model, stages=stages, microbatches=microbatches, schedule=schedule, balance=balance,
                unused=unused, autocast=autocast)
        self._closed = False
        self._close_done = threading.Event()  # the first close() has stopped everything (a second one waits for it)
        self._close_cut_short = False  # a close() raised (a Ctrl-C) before it stopped everything: the next redoes it
        self._abandoned = False
        self._update_failed: str | None = None  # Note [A step that fails inside its update]
        self.dist = distributed.DistributedHybrid(self, group, shard_update) if group is not None and \
            mode == "hybrid" else None
        # multi-node async: the ranks' check-ins between runs, so a rank gone before a run is named
        self.async_naming = distributed.AsyncNaming(group) if group is not None and mode == "async" else None
        # Note [A state names the frozen parameters it was trained with]: under a process group rank 0's, which
        # every rank takes (Note [Every rank starts from rank 0's model]): DistributedHybrid and the pipeline across
        # processes took them above
        if group is None:
            self.frozen = frozen_digests(model.named_parameters())
        elif mode == "async":  # each client's buffers stay its own
            with distributed._collective("broadcast of the frozen parameters from rank 0", group.rank(),
                                         self.async_naming._explain):
                self.frozen = distributed.receive_rank0_state(
                    self.workers[0].replica, distributed.replicas_held(self), group, self.collective_works,
                    buffers=False)

    def _optimizer_differences(self, saved) -> dict:
        """The saved optimizer settings that differ from this engine's (None: a state that did not record them).
        ``amsgrad`` cannot differ: the Adam state has another buffer. The others (lr, betas, weight decay...) may, as
        when a run is continued with another lr: the caller warns."""
        if saved is None:
            return {}
        mine = self.optimizer.config()
        if not isinstance(saved, dict) or set(saved) != set(mine):
            raise ValueError(f"the state's optimizer_config must be pyengine.AdamW(...).config() with keys "
                             f"{sorted(mine)}; got {saved!r:.200}")
        def plain(value) -> bool:  # what config() holds: numbers, bools, strings, None, and tuples of them
            if isinstance(value, (list, tuple)):
                return all(plain(v) for v in value)
            return value is None or isinstance(value, (bool, int, float, str))

        for key, value in saved.items():  # a tensor among them raised "Boolean value of Tensor ... is ambiguous"
            if not plain(value):
                raise ValueError(f"the state's optimizer_config[{key!r}] must be a number (or a tuple of numbers, as "
                                 f"AdamW(...).config() gives); got {type(value).__name__} {value!r:.100}")
        if bool(saved["amsgrad"]) != bool(mine["amsgrad"]):
            raise ValueError(f"the state was saved with amsgrad={saved['amsgrad']} and this engine has "
                             f"amsgrad={mine['amsgrad']}: the Adam state differs (max_exp_avg_sq); build the engine "
                             f"with AdamW(amsgrad={saved['amsgrad']})")
        same = lambda a, b: (tuple(a) if isinstance(a, list) else a) == (tuple(b) if isinstance(b, list) else b)
        return {k: v for k, v in saved.items() if not same(v, mine[k])}

    def worker_rng(self, device: torch.device, index: int) -> WorkerRNG:
        """The own generator of concurrent worker ``index`` (Note [Random numbers of concurrent workers]); with a
        process group the index counts across ranks, the lower ranks' workers first (their numbers may differ by
        rank), so no two workers of the group draw the same numbers."""
        rng = WorkerRNG(device, self.seed, self._first_worker + index)
        self._worker_rngs.append(rng)
        return rng

    def begin_rng_step(self, step: int) -> None:
        """Seeds every worker's own generator for ``step`` (Note [Random numbers of concurrent workers])."""
        for rng in self._worker_rngs:
            rng.begin_step(step)

    # ---- public API ------------------------------------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def step(self, batch) -> dict:
        """One training step on ``batch`` (hybrid: split across workers; sync: the next worker in turn; pipeline:
        ``(inputs, targets)`` through the stages in micro-batches).

        Steps run one at a time: one called from another thread meanwhile, and :meth:`close`, wait for it. Its
        update holds the engine's mutex (Note [A step's update under the mutex]). From inside a step (its
        loss_fn, a hook) a RuntimeError: it would wait for itself, or nest in it."""
        self._check_not_in_step("step()")
        with self._step_lock:  # in a forked child a lock of its own (_after_fork_in_child); _step checks the process
            self._step_depth += 1
            try:
                return self._step(batch)
            finally:
                self._step_depth -= 1
                while self._update_held:
                    self._update_held -= 1
                    self.mutex.release()

    def begin_update(self) -> None:
        """Note [A step's update under the mutex]
        Called by each schedule once its workers' computations are over, before it counts the step and changes the
        store: the step holds the engine's mutex from here to its end, so :meth:`state_dict` and the other readers
        (which take it) on other threads see the state of a whole number of steps. Only the update holds it: a
        loss_fn, a hook or a stage's code that reads the state on a worker thread while the step computes goes on
        (with the whole step under the mutex that read waited for the step, which waited for it: a deadlock).
        Two steps at once ran two steps on the same streamers (the process crashed, "free(): corrupted unsorted
        chunks"): step() itself is serialised by a lock of its own, which readers do not take."""
        self.mutex.acquire()
        self._update_held += 1
        self._in_flight = None  # from here the state is this step's (Note [Reading the state during a step])
        self.count("steps")

    def _step(self, batch) -> dict:
        self._check_open()
        if self.mode == "async":
            raise ValueError("step() is for mode='hybrid', 'sync' or 'pipeline'; async workers pull batches: use "
                             "fit(batches)")
        if self._update_failed is not None:
            raise RuntimeError(f"{self._update_failed}: the master weights may be partly updated and the replicas "
                               "may not hold them (Note [A step that fails inside its update]); load a state to go on "
                               "(load_state_dict, checkpoint.load_engine) or build a new Engine")
        # A bad schedule value raises before any work or count. Every rank of a process group asks the same (its
        # version is the same on all), so all raise here and none leaves the others inside a collective.
        self.check_update(self.version + 1)
        self.begin_rng_step(self._counters["steps"])  # the step's number: restored on resume, skipped steps too
        steps, generators = self._counters["steps"], self._global_generators()
        raised = self._counters["raised_steps"]
        # Note [Reading the state during a step]: the generators as the step found them (taken here also when the
        # workers have their own: a random module's forward swaps those into torch's for a while)
        self._in_flight = _InFlight(self._generator_states() if generators is None else generators, None)
        with deferred_interrupt(f"step {self.version + 1}", self._abandon):  # Note [Ctrl-C inside a step]
            try:
                if self.mode == "pipeline":
                    self.share_buffers(range(self._num_replicas()))  # broadcast_buffers across the data replicas
                    return self._record(self.pipeline.step(batch))
                if self.mode == "hybrid":
                    return self._record(self.dist.step(self, batch) if self.dist is not None else
                                        hybrid_step(self, batch))
                return self._record(sync_step(self, batch))
            except BaseException as exc:
                if self._counters["steps"] == steps:  # a failed step, not a counted one
                    if generators is not None:
                        self._set_global_generators(generators)
                elif self._counters["raised_steps"] == raised:  # not nonfinite="raise" (a counted step, state whole)
                    # Note [A step that fails inside its update]
                    # The step counted (begin_update) and then failed: in the update itself, or in a copy of the new
                    # weights into a replica (hybrid updates and copies back bucket by bucket, overlapped). Some
                    # buckets may be updated and others not, and a replica may hold the old weights: a next step
                    # computed its gradients on them and trained on silently (seen with a copy back that raised: the
                    # step after it differed from an uninterrupted run's). Nothing rolls back a half update, so the
                    # engine refuses its next steps until a state is loaded; the state can still be read.
                    self._update_failed = (f"step {steps + 1} failed inside its update "
                                           f"({type(exc).__name__}: {str(exc)[:200]})")
                raise
            finally:
                self._in_flight = None

    def _global_generators(self):
        """Note [A failed step leaves the generators alone]
        Workers that draw from torch's own generators (a lone worker, sync mode, a pipeline on one device: the
        others have their own, seeded per step from the step count, which a failed step does not advance) leave
        them advanced by a failed step's forwards, so the steps after it would draw other dropout masks than had
        it never been tried. Their states (the CPU's and each CUDA device's in use; a few KB, no device sync; 1 us
        on the CPU) are taken before each step and put back when the step fails before it counts (a worker's or
        stage's error); a step that counts (one skipped or raised for a non-finite gradient) keeps them, as it
        keeps its BatchNorm statistics (Note [A failed step leaves the buffers alone]). None when no worker draws
        from them."""
        return None if self._worker_rngs else self._generator_states()

    def _generator_states(self) -> tuple:
        """torch's CPU generator state and ``[(index, state)]`` of the CUDA devices in use."""
        return torch.get_rng_state(), [(i, torch.cuda.get_rng_state(i)) for i in self._cuda_indices()]

    def _set_global_generators(self, generators) -> None:
        cpu, cuda = generators
        torch.set_rng_state(cpu)
        for index, state in cuda:
            torch.cuda.set_rng_state(state, index)

    def fit(self, batches, steps: int | None = None, epochs: int | None = None, callbacks=()) -> list[dict]:
        """Trains on ``batches`` (an iterable; re-iterated per epoch) for ``steps`` updates or ``epochs`` passes.

        ``steps`` counts this call's steps (hybrid, sync) or pushes (async), whatever ran before (async across
        processes: the servers end the run after ``steps`` applied pushes, and a client pushes at most ``steps``
        times). Each callback is called as ``callback(engine, metrics)`` after every step or push; a callback may
        call :meth:`stop` to end training after the current step (async: after the push being applied; the other
        workers' computations in flight are discarded, their mini-batches not pushed). Async callbacks run under
        :attr:`mutex` on the pushing worker's thread: a callback may read the state itself, but must not wait for
        another thread that reads it (that thread waits for the mutex). With ``steps``, no batch is
        taken from ``batches`` beyond those the steps use, and no new pass begins for none (a generator keeps the
        rest for a later fit). Returns the metrics of this call's steps (the last ``keep_history`` of them when the
        engine was given a bound). Hybrid and pipeline across processes: the ranks' fits end at the same step
        (one rank's batches running out, its ``steps`` done or its stop() end the others' with a RuntimeWarning;
        its batches or a callback raising make theirs raise :class:`~pyengine.distributed.PeerEndedFit`): Note
        [Ranks whose fits end at different steps] in distributed.py. So every rank calls fit as many times (a fit
        call's end is an exchange), and a step() loop on one rank does not pair with a fit on another.
        """
        self._check_process()
        self._check_not_in_step("fit()")
        with self.mutex:
            if self._fitting:
                raise RuntimeError("fit() is already running on this Engine (on another thread, or this is one of its "
                                   "callbacks): one fit at a time")
            self._fitting = True
        try:
            return self._fit(batches, steps, epochs, callbacks)
        finally:
            self._fitting = False

    def _fit_arguments(self, batches, steps, epochs, callbacks) -> tuple:
        """fit's arguments checked (a TypeError or ValueError before anything is taken from ``batches``): ``steps``,
        ``epochs`` as ints or None and the callbacks as a list."""
        steps, epochs = plain_int(steps), plain_int(epochs)
        if not isinstance(batches, collections.abc.Iterable):
            raise TypeError(f"fit: batches must be an iterable of batches; got {type(batches).__name__}")
        if isinstance(batches, torch.Tensor):  # its rows would be taken for batches, one update each
            raise ValueError(f"fit: batches must be an iterable of batches; got one tensor of shape "
                             f"{tuple(batches.shape)} (a single batch: fit([batch]) or step(batch))")
        if isinstance(batches, collections.abc.Mapping):  # its keys would be taken for batches
            raise ValueError(f"fit: batches must be an iterable of batches; got one {type(batches).__name__} with "
                             f"keys {list(batches)[:8]} (a single batch: fit([batch]) or step(batch))")
        for name, value, least in (("steps", steps, 0), ("epochs", epochs, 1)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise ValueError(f"fit: {name} must be an int >= {least} or None; got {value!r}")
        if callable(callbacks) or isinstance(callbacks, (str, bytes)):
            raise ValueError("fit: callbacks must be a list (or other iterable) of callables; got one "
                             f"{type(callbacks).__name__}: pass callbacks=[f]")
        try:
            callbacks = list(callbacks)
        except TypeError:
            raise ValueError(f"fit: callbacks must be an iterable of callables; got {type(callbacks).__name__}") \
                from None
        if not all(callable(c) for c in callbacks):
            raise ValueError(f"fit: every callback must be callable; got {[type(c).__name__ for c in callbacks]}")
        for callback in callbacks:  # before any step: a callback(metrics) failed after the first update
            try:
                signature = inspect.signature(callback)
            except (TypeError, ValueError):  # some builtins have none: called as they are
                continue
            try:
                signature.bind(self, {})
            except TypeError:
                raise TypeError(f"fit: a callback is called as callback(engine, metrics); {callback!r} takes "
                                f"{signature}") from None
        return steps, epochs, callbacks

    def _fit(self, batches, steps, epochs, callbacks) -> list[dict]:
        self._check_open()
        try:
            steps, epochs, callbacks = self._fit_arguments(batches, steps, epochs, callbacks)
        except Exception as exc:  # on this rank alone, maybe: the others, stepping, are told as of its batches'
            self._end_fit(_FitEnd(0, None), exc)  # error (Note [Ranks whose fits end at different steps])
            raise
        self._stop.clear()
        # A one-shot iterator (a generator, iter(list)) is used up by its first pass: what it cannot give is said,
        # not silently skipped (a list or a DataLoader is iterated again for each epoch).
        one_shot = isinstance(batches, collections.abc.Iterator)
        if one_shot and epochs is not None and epochs > 1:
            warnings.warn(f"fit: epochs={epochs} over a one-shot iterator ({type(batches).__name__}): its first "
                          "pass uses it up, so later epochs get no batches; pass a list or a re-iterable (a "
                          "DataLoader)", RuntimeWarning, stacklevel=3)
        if steps == 0:
            # an end all the same: the other ranks may step (Note [Ranks whose fits end at different steps])
            self._end_fit(_FitEnd(0, None), stacklevel=4)
            return []
        mine = collections.deque(maxlen=self.keep_history)  # this fit's metrics, the last keep_history of them
        recorded, done = self._recorded, 0
        if self.mode == "async":
            self._fit_records = mine  # its pushes record into it (_record): no step() runs beside an async fit
            try:
                if self.process_group is not None:
                    distributed.run_async(self, self.process_group, batches, servers=self.servers, steps=steps,
                                          epochs=epochs if epochs is not None or steps is not None else 1,
                                          callbacks=callbacks)
                else:
                    run_async(self, batches, steps=steps,
                              epochs=epochs if epochs is not None or steps is not None else 1, callbacks=callbacks)
            finally:
                self._fit_records = None
            done = self._recorded - recorded
        else:
            ended = self._fit_steps(_batches(batches, steps, epochs), callbacks, mine)
            done = ended.steps
            if ended.peers:  # Note [Ranks whose fits end at different steps] (distributed.py)
                warnings.warn(f"fit: the fit of {distributed._rank_list(ended.peers)} ended (its batches ran out, "
                              f"its steps were done, or stop()) while this rank had a batch for step {done + 1} of "
                              "this call: every rank's fit ended there (that batch and any after it were not trained; "
                              "give every rank as many batches: a sampler that pads, or steps=)", RuntimeWarning,
                              stacklevel=3)
                return list(mine)
        # across processes an async client's history holds its own pushes, the servers' the run's (which `steps`
        # counts): a server says when the clients' batches ran out
        client = (self.mode == "async" and self.process_group is not None
                  and torch.distributed.get_rank(self.process_group) >= self.servers)
        if steps is not None and done < steps and not self._stop.is_set() and not client:
            warnings.warn(f"fit: the batches ran out after {done} of the {steps} steps asked"
                          + (" (a one-shot iterator is not iterated again: pass a list or a DataLoader)" if one_shot
                             else ""), RuntimeWarning, stacklevel=3)
        elif (steps is None and done == 0 and not self._stop.is_set()
              and not (self.mode == "async" and self.process_group is not None)):
            # epochs over no batch (a DataLoader with drop_last and fewer samples than its batch_size, a used-up
            # generator): nothing trained, which is said (steps asked of no batch are an error: _batches)
            warnings.warn(f"fit: batches ({type(batches).__name__}) gave no batch: nothing was trained"
                          + (" (a one-shot iterator, empty or used up)" if one_shot else ""),
                          RuntimeWarning, stacklevel=3)
        return list(mine)

    def _fit_steps(self, batches, callbacks, mine) -> "_FitEnd":
        """fit's steps (hybrid, sync, pipeline): one per batch, then the callbacks, until the batches end or
        :meth:`stop`; under a process group (hybrid, pipeline), the ranks' fits end together (Note [Ranks whose
        fits end at different steps], distributed.py): a step that meets another rank's end is refused and ends
        this fit, and this fit's own end, or an error of its batches or callbacks, is told to the other ranks."""
        ended, iterator = _FitEnd(0, None), iter(batches)
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                break
            except Exception as exc:  # this rank's batches raised: the ranks still stepping are told, then it raises
                self._end_fit(ended, exc)
                raise
            together = self._fit_together()
            with self._step_lock:  # whether the step began is read with no step of another thread in between
                phase = together.phase if together is not None else None
                try:
                    metrics = self.step(batch)
                except distributed.PeerEndedFit as peer:
                    if peer.failed:
                        raise
                    ended.peers = peer.ranks
                    return ended
                except Exception as exc:  # raised before the step's first collective (its schedule value), or after
                    # its last on this rank alone (Note [A step that fails on one rank after its last collective],
                    # distributed.py): told as an error of its batches is
                    if phase is not None and (together.phase == phase or together.failed_alone):
                        self._end_fit(ended, exc)
                    raise
            ended.steps += 1
            mine.append(metrics)  # its own: step() may run on other threads meanwhile
            try:
                for callback in callbacks:
                    callback(self, metrics)
            except Exception as exc:
                self._end_fit(ended, exc)
                raise
            if self._stop.is_set():
                break
        self._end_fit(ended)
        return ended

    def _fit_together(self):
        """What makes this rank's fits end with the other ranks' (Note [Ranks whose fits end at different steps],
        distributed.py): multi-node hybrid's DistributedHybrid, or a pipeline across processes; None in one
        process (and in async, whose runs end by their own protocol)."""
        if self.dist is not None:
            return self.dist
        return self.pipeline if _across_processes(self.pipeline) else None

    def _end_fit(self, ended: "_FitEnd", error: BaseException | None = None, stacklevel: int = 5) -> None:
        """This rank's fit ends (``error``: raising it next): the other ranks of a multi-node hybrid or pipeline
        engine are told, and the ranks still stepping then are named in ``ended`` (a warning of this rank's)."""
        together = self._fit_together()
        if together is None:
            return
        with self._step_lock:  # its collective is never beside a step's, made on another thread
            stepping = together.end_fit(self, error)
        if stepping and error is None:
            warnings.warn(f"fit: this rank's fit ended after {ended.steps} steps (its batches ran out, its steps "
                          f"were done, or stop()) while {distributed._rank_list(stepping)} had a batch for another: "
                          "every rank's fit ended here (give every rank as many batches: a sampler that pads, or "
                          "steps=)", RuntimeWarning, stacklevel=stacklevel)

    def stop(self) -> None:
        """Ends the running :meth:`fit` after the current step (for callbacks: early stopping, time budgets); async:
        after the push being applied, the computations in flight discarded."""
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    @_under_mutex
    def master_state_dict(self) -> dict:
        """The fp32 master weights, keys as ``model.state_dict()`` and in its order (trainable parameters only, a
        shared one once under its first name, as ``model.named_parameters()`` gives it; the store holds them in
        reverse). Pipeline stages across processes: a collective (Note [Distributed pipeline
        store])."""
        self._whole_store()
        views = self.store.views(self.store.param)
        return {name: views[name].detach().clone() for name in reversed(self.store.names)}

    @_under_mutex
    def copy_to(self, model: torch.nn.Module) -> None:
        """Writes the model the engine trained into ``model``: the master weights into its parameters, the source
        replica's buffers into its buffers, and the frozen parameters (``requires_grad=False`` at construction) as
        the engine holds them (under a process group rank 0's: Note [Every rank starts from rank 0's model]; a rank
        that built its model from another seed exported its own frozen layers). Pipeline stages across processes: a
        collective (Note [Distributed pipeline store]); a rank holds its own stage's frozen parameters only, and the
        others' must already equal the engine's (a ValueError names them)."""
        if not isinstance(model, torch.nn.Module):  # a state dict, say: AttributeError 'named_buffers' before
            raise TypeError(f"copy_to: model must be an nn.Module (the engine writes its parameters and buffers); "
                            f"got {type(model).__name__}")
        self._whole_store()
        buffers, named = self._source_buffers(), dict(model.named_buffers())
        frozen, params = self._held_frozen(), dict(model.named_parameters())
        saved = self._saved_buffers  # a non-persistent buffer of another size is replaced (a cache)
        wrong = [f"{name!r} (the engine's {tuple(value.shape)}; model: "
                 f"{tuple(mine[name].shape) if name in mine else 'none'})"
                 for values, mine in ((buffers, named), (frozen, params))
                 for name, value in values.items()
                 if name not in mine or (mine[name].shape != value.shape and (values is frozen or name in saved))]
        if wrong:  # checked before the weights are written: nothing is written
            raise ValueError(f"copy_to: the model lacks or reshapes the engine's buffers or frozen parameters: "
                             f"{', '.join(wrong)}")
        elsewhere = [n for n in self.frozen if n not in frozen]  # another rank's pipeline stage holds them
        digests = frozen_digests((n, params[n].detach()) for n in elsewhere if n in params)
        differ = [n for n in elsewhere if digests.get(n) != self.frozen[n]]
        if differ:
            raise ValueError(f"copy_to: the model's frozen parameters {differ[:5]} differ from those the engine "
                             "trained with (rank 0's), which this rank's pipeline stage does not hold: call copy_to "
                             "on a model built as rank 0's (its frozen parameters), or on the rank of their stage")
        # the frozen parameters are written below: the model's may be trainable by now (a layer unfrozen after the
        # engine was built), which the store, holding the trainable ones only, refused as parameters not its own
        self.store.copy_to([(name, p) for name, p in model.named_parameters() if name not in self.frozen])
        with torch.no_grad():
            for values, mine in ((buffers, named), (frozen, params)):
                for name, value in values.items():
                    if values is buffers and (mine[name].shape != value.shape or overlaps_itself(mine[name])):
                        # Note [Buffers that are not saved]; in the model's dtype, as copy_ converts (a .double()
                        # model's statistics stay float64)
                        replace_buffer([model], mine[name], value.to(mine[name].dtype))
                    else:
                        mine[name].copy_(value)

    def _held_frozen(self) -> dict:
        """name -> each frozen parameter (:attr:`frozen` names them) as this process holds it: the source
        replica's, or the pipeline's layers (across processes: this rank's stage's only)."""
        if self.pipeline is None:
            named = self.workers[self.buffer_source].replica.named_parameters()
        elif _across_processes(self.pipeline):
            named = self.pipeline.module.named_parameters()
        elif not self.pipeline.stages:
            named = ((f"{n}.{p}", t) for n, layer in self.pipeline.layers for p, t in layer.named_parameters())
        else:
            named = ((n, t) for row in self.pipeline.stages for n, t in row[0].module.named_parameters())
        return {n: t.detach() for n, t in named if n in self.frozen}

    @_under_mutex
    def buffers_state_dict(self) -> dict:
        """The model's persistent buffers (e.g. BatchNorm running statistics) from the source replica (see the class
        docstring), on the CPU, keys as ``model.state_dict()`` (Note [Buffers that are not saved]). Pipeline stages
        across processes: a collective."""
        return {name: t for name, t in self._source_buffers().items() if name in self._saved_buffers}

    def _source_buffers(self) -> dict:
        """name -> a CPU copy of every shared buffer of the source replica (the persistent and the non-persistent
        ones: Note [Buffers that are not saved]), as the last complete step left them. Under the mutex."""
        self._whole_store()
        run = self._async_run
        if run is not None and run.buffers is not None:  # the source replica is computing: its last pushed state
            return {name: t.detach().to("cpu", copy=True) for name, t in zip(self.buffer_names, run.buffers)}
        flight = self._in_flight
        if flight is not None and flight.buffers is not None:  # Note [Reading the state during a step]
            return {name: t.detach().to("cpu", copy=True) for name, t in zip(self.buffer_names, flight.buffers)}
        named = self._replica_buffers(self.buffer_source)
        return {name: named[name].detach().to("cpu", copy=True) for name in self.buffer_names}

    def _rng_states(self) -> tuple:
        """Note [Reading the state during a step]
        :meth:`state_dict` and the other readers take the mutex, which a step holds from :meth:`begin_update` on, so
        they see the weights and counters of a whole number of steps; but a reader on another thread (or a worker's
        own loss_fn) may also come while the step's workers compute, before that. Then what the workers already
        changed outside the store must not be read either: the source replica's buffers (its forward moved
        BatchNorm's statistics) and torch's generators (a lone worker, sync mode, draw from them; a worker's random
        module swaps its own generator into them for its forward). So a step keeps, until its update begins, the
        states it took before its work anyway (the generators' and the source buffers' copies that a failed step puts
        back: Notes [A failed step leaves the generators alone] and [A failed step leaves the buffers alone]), and
        readers return those (the generators are taken also when the workers have their own generators, which their
        random modules' forwards swap into torch's for a while); at other times (an async fit's workers) torch's
        generators are read under the swap's lock, but a lone async worker's as its pull found them (under the mutex,
        kept on the run). The CPU and CUDA generator states (``{device index: state}``) as of the last complete
        step."""
        flight = self._in_flight
        run = self._async_run
        if flight is None and run is not None and run.generators is not None:
            flight = run
        if flight is not None:
            cpu, cuda = flight.generators
            return cpu.clone(), {i: state.clone() for i, state in cuda}
        inside_swap = getattr(rng_module._ACTIVE, "rng", None) is not None  # a random module's forward, this thread
        with contextlib.nullcontext() if inside_swap else rng_module._SWAP:
            return torch.get_rng_state(), {i: torch.cuda.get_rng_state(i) for i in self._cuda_indices()}

    def share_buffers(self, targets) -> None:
        """Copies the buffers of the source replica (``buffer_source``) into the replicas ``targets``."""
        if not self.buffer_names:
            return
        source = self.buffer_source
        named = self._replica_buffers(source)
        with torch.no_grad():
            for t in targets:
                if t == source:
                    continue
                mine = self._replica_buffers(t)
                into, values = [], []
                for name in self.buffer_names:
                    target, value = mine[name], named[name]
                    if target is value:  # a pipeline across processes: one set of buffers per rank
                        continue
                    if _takes_in_place(target, value):
                        into.append(target)
                        values.append(value)
                    else:
                        self._replace_buffer(t, name, value)  # Note [Buffers that are not saved]
                if into and self._buffers_on_cpu:
                    torch._foreach_copy_(into, values)  # one call for all: bench/RESULTS.md (2026-12-02)
                else:
                    for target, value in zip(into, values):
                        target.copy_(value)

    def _replace_buffer(self, index: int, name: str, value: torch.Tensor) -> None:
        """Replica ``index``'s non-persistent buffer ``name`` becomes a copy of ``value`` (Note [Buffers that are
        not saved]), in every module of the replica that holds it (a buffer tied between modules)."""
        if self.pipeline is None:
            roots = [self.workers[index].replica]
        elif self.pipeline.stages:  # the in-process pipeline (across processes only persistent buffers are shared)
            roots = [row[index].module for row in self.pipeline.stages]
        else:
            roots = [layer for _, layer in self.pipeline.layers]
        replace_buffer(roots, self._replica_buffers(index)[name], value)

    def _num_replicas(self) -> int:
        return self.pipeline.replicas if self.pipeline is not None else len(self.workers)

    def _replica_buffers(self, index: int) -> dict:
        """name -> buffer of replica ``index``: a worker's replica, or in pipeline mode the stages of data-parallel
        replica ``index`` together (before the stages are built, the layers they will be copied from)."""
        if self.pipeline is None:
            return dict(self.workers[index].replica.named_buffers())
        if _across_processes(self.pipeline):  # Note [Buffers of stages across processes]
            return self.pipeline.buffers
        if not self.pipeline.stages:
            return {f"{name}.{b}": t for name, layer in self.pipeline.layers for b, t in layer.named_buffers()}
        return {name: t for row in self.pipeline.stages for name, t in row[index].module.named_buffers()}

    @_under_mutex
    def optimizer_state_dict(self) -> dict:
        """The Adam state in ``torch.optim.AdamW.state_dict()`` form. With ``shard_update=True`` a collective that
        every rank must call (:func:`pyengine.distributed.gather_optimizer_state`); the full state on every rank.
        Pipeline stages across processes: a collective too (Note [Distributed pipeline store]). With an
        ``lr_schedule`` the group's ``lr`` is the last update's (the first's before any) and ``initial_lr`` the
        optimizer's lr; torch's ``LambdaLR`` would hold the next update's lr there, which this does not compute: a
        checkpoint never asks the schedule about a step not yet taken."""
        self._whole_store()
        return self.optimizer.torch_state_dict(
            self.store, self.version, self.param_names, distributed.gather_optimizer_state(self),
            scheduled_lr=None if self.lr_schedule is None else self.lr_at(max(1, self.version)))

    @_under_mutex
    def state_dict(self) -> dict:
        """Everything needed to resume bit-identically: weights, optimizer state, step, RNG, statistics. With
        ``shard_update=True`` a collective that every rank must call (the full Adam state is gathered). Consistent
        while async workers run (taken under the store's mutex, between two pushes), and while a step's workers compute
        (Note [Reading the state during a step]). During a multi-node async run only rank 0 of a run with one server
        reads it (its buffers are then the run's start's: the servers take the first client's at the run's end);
        another rank raises RuntimeError (Note [A state during a multi-node async run])."""
        rng_states = self._rng_states()
        return {
            "format": FORMAT,
            "mode": self.mode,
            "version": self.version,
            "names": list(self.store.names),
            "master": self.master_state_dict(),
            "buffers": self.buffers_state_dict(),
            "optimizer": self.optimizer_state_dict(),
            "optimizer_config": self.optimizer.config(),
            # torch's generators, and the CUDA ones that a lone worker, sync mode or a one-device pipeline draws from
            # (by device index): Note [Reading the state during a step]
            "rng": rng_states[0],
            "cuda_rng": rng_states[1],
            "seed": self.seed,  # the workers' generators are seeded per step from it (pyengine/rng.py)
            "counters": dict(self._counters),
            "staleness": dict(self._staleness),
            "loss_scaler": None if self.scaler is None else self.scaler.state_dict(),
            # a pipeline's layers per stage (None: not a pipeline, or balance="time" before its first step): Note
            # [A resumed pipeline keeps its split]
            "pipeline_sizes": None if self.pipeline is None or self.pipeline.sizes is None else list(
                self.pipeline.sizes),
            "frozen": dict(self.frozen),  # Note [A state names the frozen parameters it was trained with]
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restores :meth:`state_dict`. Everything is validated first (format, keys, names, shapes and dtypes of the
        weights, buffers and Adam state, step against version, RNG state, counters); an invalid state raises
        ``ValueError`` and leaves the engine as it was. The loss scaler's state is loaded into this engine's scaler (a
        state saved without one resets it; an engine without a scaler ignores it). A state of another mode loads, with a
        warning, its count of steps (async: pushes) going on as this engine's (Note [A state of another mode]). The
        state is always full (whatever engine wrote it): with ``shard_update=True`` each rank keeps its own slice of the
        Adam state, so every rank loads the same state and no collective is needed. With a process group every rank must
        load the same state: a hybrid step refuses ranks at different versions, on every rank, with a
        ``DistributedError`` (Note [Every rank at the same version] in :mod:`pyengine.distributed`). Refused during an
        async :meth:`fit` (from its callbacks or any thread): its workers compute on the weights they pulled and would
        push onto the loaded ones; stop the fit (:meth:`stop`) and load once it has returned. Refused as well while a
        :meth:`step` runs (on another thread, or from inside it: its loss_fn, a hook): its workers compute on the
        weights they pulled, and its update would count on top of the loaded state; load between steps (a :meth:`fit`
        callback may)."""
        # The step lock first, without waiting: a step holds it while its workers compute, and a load from inside
        # the step (a worker thread) waiting for it would never return. Then the mutex, in the step's order.
        if not self._step_lock.acquire(blocking=False):
            raise RuntimeError(self._LOAD_IN_STEP)
        try:
            if self._step_depth:  # this very thread is inside step() (an inline worker's loss_fn, a hook)
                raise RuntimeError(self._LOAD_IN_STEP)
            with self.mutex:
                self._load_state_dict(sd)
                self._update_failed = None  # the weights and the replicas are the loaded state's, whole
        finally:
            self._step_lock.release()

    _LOAD_IN_STEP = ("load_state_dict while a step is running: its workers compute on the weights they pulled and "
                     "its update would count on top of the loaded state; load between steps (after step() returns, "
                     "or from a fit callback)")

    def _check_not_in_step(self, what: str) -> None:
        """Raises RuntimeError when called from inside a running :meth:`step` of this engine: on one of its worker
        or stage threads (waiting for the step's end would wait for itself: a deadlock), or on the thread running
        the step (a lone CPU worker's loss_fn, a hook: the step would go on on stopped workers). From any other
        thread a step running is simply waited for."""
        if not self._step_depth:
            return
        inside = threading.get_ident() in self._task_threads
        if not inside and self._step_lock.acquire(blocking=False):  # free, or held by this very thread
            inside = bool(self._step_depth)
            self._step_lock.release()
        if inside:
            raise RuntimeError(f"{what} from inside a step (its loss_fn, a hook, a stage's code): the step would "
                               "wait for itself or go on on stopped workers; call it after step() returns")

    def _load_state_dict(self, sd: dict) -> None:
        self._check_open()
        if self._fitting and self.mode == "async":
            raise RuntimeError("load_state_dict during an async fit: its workers compute on the weights they pulled "
                               "and would push onto the loaded ones; call engine.stop() (a callback may) and load "
                               "once fit has returned")
        if not isinstance(sd, dict) or sd.get("format") != FORMAT:
            found = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
            raise ValueError(f"not a pyengine engine state (expected format {FORMAT!r}; got {found!r})")
        missing = [k for k in ("names", "master", "optimizer", "version", "rng", "counters", "staleness")
                   if k not in sd]
        if missing:
            raise ValueError(f"the engine state lacks {missing}")
        if not isinstance(sd["names"], (list, tuple)) or list(sd["names"]) != list(self.store.names):
            raise ValueError(f"the state's parameters {sd['names']} do not match this model's {self.store.names}")
        views = self.store.views(self.store.param)
        master = sd["master"]
        if not isinstance(master, dict) or set(master) != set(views):
            found = sorted(master, key=repr) if isinstance(master, dict) else type(master).__name__
            raise ValueError(f"the state's master weights {found} do not match this model's {sorted(views)}")
        for name, value in master.items():
            if (not _is_dense(value) or tuple(value.shape) != tuple(views[name].shape)
                    or value.dtype != torch.float32):
                raise ValueError(f"master weight {name!r}: expected float32 {tuple(views[name].shape)}; got "
                                 f"{_describe(value)}")
            check_state_values(value, f"master weight {name!r}")  # Note [A state's values are checked]
        buffers = sd.get("buffers", {})  # absent in states written before buffers were saved
        source = self._replica_buffers(self.buffer_source)  # shapes and dtypes only: no gather (a collective)
        current = {name: source[name] for name in self.saved_buffer_names}
        if not isinstance(buffers, dict) or ("buffers" in sd and set(buffers) != set(current)) or any(
                name not in current for name in buffers):
            found = sorted(buffers, key=repr) if isinstance(buffers, dict) else type(buffers).__name__
            raise ValueError(f"the state's buffers {found} do not match this model's {sorted(current)}")
        for name, value in buffers.items():
            if (not _is_dense(value) or tuple(value.shape) != tuple(current[name].shape)
                    or value.dtype != current[name].dtype):
                raise ValueError(f"buffer {name!r}: expected {current[name].dtype} {tuple(current[name].shape)}; got "
                                 f"{_describe(value)}")
        differing = self._optimizer_differences(sd.get("optimizer_config"))
        # The state's torch indices follow the groups of the optimizer that saved it: read with its no_decay, so
        # that each parameter gets its own moments when no_decay changed (they went to the parameters the new
        # groups put at those indices)
        saved_layout = self.optimizer
        if isinstance(sd.get("optimizer_config"), dict):
            try:
                saved_layout = dataclasses.replace(self.optimizer, no_decay=sd["optimizer_config"]["no_decay"])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"the state's optimizer_config: {exc}") from None
        step = saved_layout.check_torch_state_dict(self.store, sd["optimizer"], self.param_names)
        # Against the settings the state was saved with, where it has them: a difference from this engine's is
        # already in `differing`; one from the saved settings is a group edited (or written by torch.optim)
        saved_settings = saved_layout
        if isinstance(sd.get("optimizer_config"), dict):
            try:
                saved_settings = dataclasses.replace(saved_layout, **{k: v for k, v in sd["optimizer_config"].items()
                                                                      if k != "max_grad_norm"})
            except (TypeError, ValueError):
                pass  # settings that AdamW refuses: compare with this engine's
        edited = saved_settings.group_differences(sd["optimizer"], self.param_names,
                                                  scheduled=self.lr_schedule is not None)
        version = sd["version"]
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"the state's version must be an int >= 0; got {version!r}")
        if step != version:
            raise ValueError(f"optimizer step {step} does not match the state's version {version}")
        rng = sd["rng"]
        expected_rng = torch.get_rng_state()
        if not isinstance(rng, torch.Tensor) or rng.dtype != expected_rng.dtype or rng.shape != expected_rng.shape:
            raise ValueError(f"the state's rng must be torch.get_rng_state()'s {expected_rng.dtype} "
                             f"{tuple(expected_rng.shape)}; got {_describe(rng)}")
        try:  # its contents too: a scratch generator takes it or refuses it, before anything is written
            torch.Generator().set_state(rng)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"the state's rng is not a generator state: {exc}") from None
        cuda_rng = self._checked_cuda_rng(sd.get("cuda_rng", {}))  # absent in states written before it was saved
        seed = sd.get("seed", self.seed)  # absent in states written before workers had their own generators
        if not isinstance(seed, int) or isinstance(seed, bool) or not -2 ** 63 <= seed < 2 ** 64:
            raise ValueError(f"the state's seed must be an int in [-2**63, 2**64); got {seed!r}")
        saved_mode = sd.get("mode", self.mode)  # absent in states written before it was saved
        if saved_mode not in MODES:
            raise ValueError(f"the state's mode must be one of {MODES}; got {saved_mode!r:.200}")
        counters, staleness = self._own_counters(sd)
        def count(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        try:
            if not all(isinstance(k, str) and count(v) for k, v in counters.items()):
                raise TypeError(f"keys must be str and values ints >= 0; got {counters!r:.200}")
            # keys: ints >= 0, or their decimal strings (a state that went through JSON); True, 2.9 and -1 were taken
            if not all(count(v) and (count(k) or isinstance(k, str) and k.isdecimal()) for k, v in staleness.items()):
                raise TypeError(f"staleness keys and counts must be ints >= 0; got {staleness!r:.200}")
            staleness = collections.Counter({int(k): v for k, v in staleness.items()})
        except (AttributeError, TypeError, ValueError, OverflowError) as exc:  # int(inf): OverflowError
            raise ValueError(f"the state's counters / staleness are not {{name: count}} / {{staleness: count}} "
                             f"dicts: {exc}") from None
        scaler = sd.get("loss_scaler")  # absent in states written before loss scaling; None: saved without it
        if scaler is not None:
            LossScaler.check_state_dict(scaler)
        split = self._saved_split(sd.get("pipeline_sizes"))  # absent in states written before it was saved
        self._check_frozen(sd.get("frozen"))  # absent in states written before it was saved
        # Valid: from here on nothing raises on the state's account.
        counters = self._counters_of_mode(saved_mode, counters)
        if differing:
            warnings.warn(f"load_state_dict: the state was saved with {differing}; this engine's optimizer "
                          f"({ {k: self.optimizer.config()[k] for k in differing} }) is used from here on",
                          stacklevel=3)  # the caller of load_state_dict
        if edited:
            warnings.warn(f"load_state_dict: the state's optimizer param_groups hold {edited}, which are not read: "
                          f"the engine's optimizer settings drive the update (to change them, set engine.optimizer's "
                          f"fields, e.g. engine.optimizer.lr = ...)", stacklevel=3)
        if self.scaler is not None:  # None (saved without scaling): a fresh scaler; a static one keeps its scale
            scale, tracker, below = self.scaler.loaded(scaler)
            if below is not None:  # warned before anything is written: as an error (-W error) it changes nothing
                warnings.warn(f"load_state_dict: {below}", RuntimeWarning, stacklevel=3)
        if split is not None:  # first: the only step here that may still raise, and it leaves the pipeline unbuilt
            self.pipeline._build(split)
        for worker in self.workers:  # the last step's copies back still read the weights written below
            worker.wait_copies_back(failed_ok=True)  # a failed one too: the pulls below copy every bucket again
        saved_layout.load_torch_state_dict(self.store, sd["optimizer"], self.param_names, checked_step=step)
        with torch.no_grad():  # values that require grad (a model's parameters, say) must not tie the store to autograd
            for name, value in master.items():
                views[name].copy_(value.detach())
        self.store.refresh_shadow()  # before the pulls below (Note [The shadow follows the master weights])
        self.version = version
        torch.set_rng_state(rng)
        for index, state in cuda_rng.items():
            torch.cuda.set_rng_state(state, index)
        self.seed = seed  # the run continues the saved run's draws (Note [Random numbers of concurrent workers])
        for generator in self._worker_rngs:
            generator.seed = seed
        self._counters = collections.Counter(counters)
        self._staleness = staleness
        if self.scaler is not None:
            self.scaler.scale, self.scaler.growth_tracker = scale, tracker
        for worker in self.workers:
            worker.pull()
        with torch.no_grad():
            for index in range(self._num_replicas()):
                mine = self._replica_buffers(index)
                for name, value in buffers.items():
                    if _takes_in_place(mine[name], value) or _across_processes(self.pipeline):
                        mine[name].copy_(value)  # across processes every replica's shapes are checked alike
                    else:  # a replica's cache of another size, an expanded mask (Note [Buffers that are not saved])
                        self._replace_buffer(index, name, value)

    def _counters_of_mode(self, saved_mode: str, counters: dict) -> dict:
        """Note [A state of another mode]
        The weights, the Adam state, the version and the random state mean the same in every mode, so a state
        saved by an engine of another mode loads (a run started in hybrid goes on in async, say), with a warning.
        The counters do not: a hybrid, sync or pipeline engine numbers its steps with ``steps``, async with
        ``pushes`` (:func:`step_counter`), and the workers draw each step's random numbers by that number. So the
        saved run's count goes on as this engine's: after the load this engine's counter holds the saved one's
        value, stats() still finds it equal to applied + skipped + raised, and no worker draws a step's numbers a
        second time. The other counter keeps the saved value (a history of the earlier mode); the staleness
        histogram counts the async pushes only."""
        if saved_mode == self.mode:
            return counters
        saved, mine = step_counter(saved_mode), step_counter(self.mode)
        warnings.warn(f"load_state_dict: the state was saved by a mode={saved_mode!r} engine; this one is "
                      f"mode={self.mode!r}: its weights, optimizer state and version are taken"
                      + (f", and its {saved} ({counters.get(saved, 0)}) go on as this engine's {mine}"
                         if saved != mine else ""), stacklevel=4)  # past _load_state_dict, the mutex, the method
        return {**counters, mine: counters.get(saved, 0)}

    def _check_frozen(self, saved) -> None:
        """Note [A state names the frozen parameters it was trained with]
        The state holds the trainable weights (the master copy), the buffers and the optimizer; a frozen parameter
        (``requires_grad=False``: a pretrained layer, an embedding kept fixed) is the model's, never written by the
        engine, so a resume takes it from the model it is given. Were that model's frozen weights other than the
        saved run's (built from another seed, another pretrained file), the run would go on differently with
        nothing to show for it: the state holds a digest of each (:func:`frozen_digests`; under a process group,
        rank 0's, which every rank trains with) and a state whose digests differ from this engine's is refused.
        None (a state written before they were saved) is not checked."""
        if saved is None:
            return
        if not isinstance(saved, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in saved.items()):
            raise ValueError(f"the state's frozen must be a {{name: digest}} dict of strings; got {saved!r:.200}")
        differ = sorted(set(saved) ^ set(self.frozen) | {n for n in saved if n in self.frozen
                                                           and saved[n] != self.frozen[n]})
        if differ:
            raise ValueError(f"the state was trained with other frozen parameters (requires_grad=False) than this "
                             f"engine's model holds: {differ[:8]}{' ...' if len(differ) > 8 else ''}; a state keeps "
                             "the trainable weights only: build the model with the frozen weights it was trained "
                             "with (the same pretrained layers, the same seed)")

    def _saved_split(self, saved) -> list[int] | None:
        """Note [A resumed pipeline keeps its split]
        ``balance="time"`` chooses the layers per stage from timings at the first step, and timings vary: two fresh
        runs may split differently, and a split draws its own dropout masks (each stage has its generators). So the
        state holds the split, and a pipeline with ``balance="time"`` that has not chosen yet takes the saved one
        (returned here, built by the caller): a resume continues the saved run bit for bit. A pipeline already split
        otherwise (explicit sizes, by parameters, or timed) keeps its split, with a warning that the run then
        differs from the saved one. ValueError unless ``saved`` is None or a list of positive ints."""
        if saved is None:
            return None
        if not isinstance(saved, (list, tuple)) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in saved):
            raise ValueError(f"the state's pipeline_sizes must be None or a list of positive ints; got {saved!r:.200}")
        pipeline = self.pipeline
        if pipeline is None:
            return None
        if pipeline.sizes is None and len(saved) == pipeline.num_stages and sum(saved) == len(pipeline.layers):
            return list(saved)
        if list(saved) != (pipeline.sizes or []):
            warnings.warn(f"load_state_dict: the state was trained with {list(saved)} layers per stage; this "
                          f"pipeline {'splits ' + str(pipeline.sizes) if pipeline.sizes else 'has another shape'} "
                          f"(its dropout draws and the order of its sums differ from the saved run's)",
                          stacklevel=4)  # the caller of load_state_dict, past _load_state_dict
        return None

    def _own_counters(self, sd: dict) -> tuple:
        """The state's counters and staleness for this engine: this rank's when the state holds every rank's (a
        checkpoint of :func:`pyengine.checkpoint.save_engine` across a group of this engine's size: Note [Every
        rank resumes its own counters] there), else the ones of the engine that took it."""
        ranks = sd.get("ranks")  # absent in a state of Engine.state_dict() and in checkpoints before it was saved
        if ranks is not None and (not isinstance(ranks, (list, tuple)) or not all(
                isinstance(r, dict) and {"counters", "staleness"} <= set(r) for r in ranks)):
            raise ValueError(f"the state's ranks must be a list of {{'counters': ..., 'staleness': ...}} dicts, one "
                             f"per rank; got {ranks!r:.200}")
        if (ranks is None or self.process_group is None
                or len(ranks) != torch.distributed.get_world_size(self.process_group)):  # another group: rank 0's
            return sd["counters"], sd["staleness"]
        mine = ranks[torch.distributed.get_rank(self.process_group)]
        return mine["counters"], mine["staleness"]

    def _cuda_indices(self) -> list[int]:
        return sorted({d.index for d in self.devices if d.type == "cuda"})

    def _checked_cuda_rng(self, saved) -> dict:
        """The saved CUDA generator states (``{device index: state}``) that this engine's devices take, validated:
        ValueError unless it is such a dict and every state this engine takes is one its device's generator accepts.
        States of devices this engine does not use are left out (a run moved to other devices draws anew there)."""
        if not isinstance(saved, dict) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 and isinstance(v, torch.Tensor)
                and v.dtype == torch.uint8 and v.dim() == 1 for i, v in saved.items()):
            got = {k: _describe(v) for k, v in saved.items()} if isinstance(saved, dict) else _describe(saved)
            raise ValueError(f"the state's cuda_rng must be {{device index: torch.cuda.get_rng_state(index)}} (uint8 "
                             f"1-D tensors); got {got}")
        taken = {i: saved[i] for i in self._cuda_indices() if i in saved}
        for index, state in taken.items():
            try:  # a scratch generator on that device takes it or refuses it, before anything is written
                torch.Generator(device=f"cuda:{index}").set_state(state)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"the state's cuda_rng[{index}] is not a CUDA generator state: {exc}") from None
        return taken

    def record_failure(self, exc: BaseException) -> None:
        """Across processes: tells the other ranks that this one failed with ``exc`` outside a step (its data, say),
        so that their errors name it at once (Note [Naming the rank that failed] in :mod:`pyengine.distributed`);
        a failure inside :meth:`step` is recorded by the step itself. Best effort; nothing in one process."""
        for part in self._failure_naming():
            part._record_failure(exc)

    def recorded_failure(self) -> str | None:
        """Across processes: what a rank that failed recorded (``"rank f failed: <type>: <first line>"``), else None
        (also in one process): for an error of the caller's own collective to name the rank behind it."""
        for part in self._failure_naming():
            text = part.rendezvous.recorded("failed")
            if text is not None:
                return text
        return None

    def _failure_naming(self) -> list:
        return [part for part in (self.dist, self.pipeline, self.async_naming)
                if isinstance(part, distributed._FailureNaming)]

    @_under_mutex
    def stats(self) -> dict:
        """Counters: steps, pushes, applied updates, skipped steps, steps that raised (``nonfinite="raise"``),
        refreshes, and the staleness histogram (one entry per push). Steps (hybrid, sync, pipeline) and pushes
        (async) each equal ``applied_updates + skipped_steps + raised_steps``."""
        hist = dict(sorted(self._staleness.items()))
        total = sum(hist.values())
        return {
            "steps": self._counters["steps"],
            "pushes": self._counters["pushes"],
            "applied_updates": self._counters["applied_updates"],
            "skipped_steps": self._counters["skipped_steps"],
            "raised_steps": self._counters["raised_steps"],
            "refreshes": self._counters["refreshes"],
            "version": self.version,
            "staleness_histogram": hist,
            "staleness_mean": sum(k * v for k, v in hist.items()) / total if total else 0.0,
            "staleness_max": max(hist) if hist else 0,
            "loss_scale": None if self.scaler is None else self.scaler.scale,
        }

    def trace(self, path) -> None:
        """Writes a Chrome trace (chrome://tracing, Perfetto) of the recorded phases per worker."""
        self.recorder.write_chrome_trace(path)

    def close(self) -> None:
        """Stops the worker threads and removes every hook. Idempotent. During an async :meth:`fit` on another
        thread: the push being applied completes, no other is applied, and close() returns once the workers have
        stopped (their computations in flight are discarded); that fit then raises RuntimeError. A :meth:`step` running
        on another thread ends first; from inside a step (its loss_fn, a hook) it is a RuntimeError. In a process
        forked from the one that built it: marks it closed and touches nothing else (Note [An engine in a forked
        process])."""
        if os.getpid() != self._pid:
            self._closed = True
            return
        self._check_not_in_step("close()")
        with self.mutex:  # a push being applied completes first; none is applied after (asynchronous.py)
            closed, self._closed = self._closed, True
            run = self._async_run
            if run is not None and not closed:
                run.stop.set()
        inside_run = run is not None and threading.get_ident() in run.threads  # a callback of that fit
        if closed:  # closed already, or being closed by another thread: returns once that close() has stopped
            if not inside_run:  # everything, as the first did (it returned while async workers still ran)
                self._close_done.wait()
            with self.mutex:  # a close() cut short (a Ctrl-C in its waits) left the work to the next one: this
                if not self._close_cut_short:  # one does it (it returned at once, the workers and hooks left)
                    return
                self._close_cut_short = False
                self._close_done.clear()
        try:
            if run is not None and not inside_run:
                if threading.get_ident() == run.caller:  # a signal handler on fit's thread, which sets finished
                    # after the handler returns: the workers' own events, of the threads started (fit's start()
                    # loop may be what the handler interrupted: the others start after it, see the stop and end),
                    # polled (the handler may have interrupted a wait on one of them, holding its lock)
                    for thread, done in list(run.workers_done):
                        while thread.ident is not None and not done.is_set():
                            time.sleep(0.005)
                else:
                    run.finished.wait()
            with self._step_lock:  # a step running on another thread ends first
                self._pool.shutdown(wait=True)
                if self.pipeline is not None:
                    self.pipeline.close()
                for worker in self.workers:
                    worker.close()
            self._restore_threads()  # torch.set_num_threads(self._intra_op_threads): Note [Worker threads' count]
        except BaseException:
            self._close_cut_short = True
            raise
        finally:
            self._close_done.set()

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
        return self.gather_workers(self.submit_workers(tasks))

    def submit_workers(self, tasks: dict) -> dict:
        """Starts ``{worker_index: fn}`` on the worker threads; returns ``{index: future}`` for
        :meth:`gather_workers`.

        Note [One CPU worker runs on the calling thread]
        With a single CPU worker the task runs here, on the calling thread, and the returned future is already
        done. A worker thread would bring its own OpenMP team beside the one the calling thread already has (any
        torch op it ran made one). Measured on 2 vCPUs: once another thread has run a 2-thread parallel region, a
        small transformer's forward+backward is ~13 % slower (bench/RESULTS.md); the likely cause, not confirmed,
        is libgomp's shorter waiting at barriers when it manages more threads than there are cores. Nothing
        overlaps with a lone CPU worker anyway: the gradient copies still run on the streamer's copy thread, and
        the host's per-bucket work simply finds every bucket ready.
        """
        self._buffers_before = self._snapshot_source_buffers(tasks)
        copies = self.copies_for_readers(self._buffers_before)
        if self._in_flight is not None and copies is not None:  # Note [Reading the state during a step]
            self._in_flight = self._in_flight._replace(buffers=copies)
        if not self.inline_worker:
            return {i: self._pool.submit(_on_stream, self._caller_stream(i), fn) for i, fn in tasks.items()}
        futures = {}
        for i, fn in tasks.items():
            try:  # Note [A task's exception and its callers' frames]
                futures[i] = _future(*_call(fn))  # handed to gather_workers, as from the pool
            except BaseException:  # KeyboardInterrupt, SystemExit: leave nothing of the step behind, then stop
                saved, self._buffers_before = self._buffers_before, None
                self._drop_step(saved)  # Note [A failed step leaves the buffers alone]
                raise
        return futures

    def _caller_stream(self, index: int):
        """The calling thread's current stream on worker ``index``'s device (None for a CPU worker).

        Note [A worker task runs on its caller's streams]
        Current CUDA streams are per thread: on a pool thread the current stream is the device's default stream,
        whatever stream the thread that called :meth:`step` was on. A worker orders its compute stream after the
        current stream (the batch it gets, the buffers :meth:`share_buffers` copied into its replica), so a task
        started on the pool runs under its caller's stream, as the lone worker that runs on the calling thread does
        (Note [One CPU worker runs on the calling thread]). Without it, a step called inside
        ``torch.cuda.stream(s)`` with a batch made on ``s`` could read the batch before ``s`` wrote it."""
        device = self.devices[index]
        return torch.cuda.current_stream(device) if device.type == "cuda" else None

    def gather_workers(self, futures: dict) -> dict:
        """Waits for every future of :meth:`submit_workers`; returns ``{index: result}`` or raises
        :class:`WorkerError` for the first failed worker after all have finished. After a failure every worker's
        streamer is reset, so the engine can go on with the next step from the last complete update."""
        concurrent.futures.wait(futures.values())
        saved, self._buffers_before = self._buffers_before, None
        failed = next(((i, f.exception()) for i, f in futures.items() if f.exception() is not None), None)
        if failed is None:
            self._buffers_gathered = saved  # for drop_gathered_step
            return {i: f.result() for i, f in futures.items()}
        self._drop_step(saved)
        futures.clear()  # Note [A task's exception and its callers' frames]
        i, exc = failed
        raise WorkerError(i, self.devices[i], exc) from exc

    def drop_gathered_step(self) -> None:
        """Drops the step whose workers the last :meth:`gather_workers` returned, as a failed worker's step is (a
        step refused after its workers completed: Note [A step refused on every rank] in pyengine/distributed.py)."""
        saved, self._buffers_gathered = self._buffers_gathered, None
        self._drop_step(saved)

    def discard_workers(self, futures: dict) -> None:
        """For a schedule whose host failed between :meth:`submit_workers` and :meth:`gather_workers`: waits for
        every task, then drops what the step left (as a failed worker's step does). No task may outlive its step:
        the next one would run on the same streamers while it still writes their slots."""
        concurrent.futures.wait(futures.values())
        saved, self._buffers_before = self._buffers_before, None
        self._drop_step(saved)
        futures.clear()

    def _drop_step(self, saved: list | None) -> None:
        """A step that will not be applied: every worker's streamer reset (its buckets and waits dropped), the
        buffers' source as before it (Note [A failed step leaves the buffers alone])."""
        for worker in self.workers:
            worker.streamer.reset()
            if worker.streamer.changed_in_place():  # Note [Weights changed in place by a step]: the store's back
                worker.pull(wait=True)
        self._restore_source_buffers(saved)

    def _snapshot_source_buffers(self, tasks: dict) -> list | None:
        """Note [A failed step leaves the buffers alone]
        A worker's forward moves its replica's buffers (BatchNorm's running statistics count the batch) before any
        worker fails. If that replica is the buffers' source (hybrid: worker 0; sync with one worker), a failed step
        would leave them one batch ahead of the weights, and :meth:`state_dict` would save them so: the state would
        no longer be that of the last complete step. So the source's buffers are copied before its task runs and
        copied back when a worker fails (the pipeline does the same for its stages: Note [Stopping a failed
        pipeline]). A step that completes but is skipped or raises for a non-finite gradient keeps its statistics,
        as a step skipped by torch's GradScaler does.

        Cost: one multi-tensor copy into copies kept from step to step, the buffers looked up in their modules (Note
        [Buffer copies kept from step to step] in workers.py): ~15 us a step for 8 BatchNorm layers, where fresh
        clones of named_buffers() measured 84 us and 3 % of a 8 ms CPU step (bench/RESULTS.md)."""
        if not self.buffer_names or self.buffer_source not in tasks:
            return None
        kept = self._buffer_kept.get(self.buffer_source)
        if kept is None:  # (module, key) of each buffer: a module may assign a new tensor, so looked up every step
            modules = dict(self.workers[self.buffer_source].replica.named_modules())
            kept = KeptBufferCopies([(modules[prefix], key)
                                     for prefix, _, key in (n.rpartition(".") for n in self.buffer_names)])
            self._buffer_kept = {self.buffer_source: kept}
        return kept.take()

    def copies_for_readers(self, saved: list | None) -> list | None:
        """The copies of :meth:`_snapshot_source_buffers` in ``buffer_names`` order, what readers of the state
        return while the source replica computes; None without a snapshot, or when a buffer is None now (set so
        by a forward: it has no copy, the readers read the replica)."""
        if saved is None or len(saved) != len(self.buffer_names):
            return None
        return [copy_ for *_, copy_ in saved]

    @torch.no_grad()
    def _restore_source_buffers(self, saved: list | None) -> None:
        if saved is None:
            return
        stream = self.workers[self.buffer_source].stream
        if stream is not None:
            stream.synchronize()  # what the failed task left on the worker's stream has run
        put_back_saved(saved)

    def wait_bucket(self, k: int, futures: dict) -> bool:
        """Blocks until bucket ``k`` of every worker in ``futures`` is in its slot; False as soon as one of those
        workers has failed (its bucket may never come; :meth:`gather_workers` then raises)."""
        for i in futures:
            try:
                while not self.workers[i].streamer.wait(k, timeout=_POLL_S):
                    if any(f.done() and f.exception() is not None for f in futures.values()):
                        return False
            except RuntimeError:
                # A copy of the bucket that failed raises in every wait for it (Note [A failed copy's error] in
                # csrc/store/transfer.h), the worker's own too: its task fails with it, and gather_workers raises
                # that as the WorkerError naming the worker, whichever thread waited first.
                concurrent.futures.wait([futures[i]])
                if futures[i].exception() is not None:
                    return False
                raise
        return True

    def apply_update(self, workers: list[int], weights: list[float] | None, lr_divisor: float = 1.0,
                     grads: list[torch.Tensor] | None = None, loss_scale: float | None = None,
                     checked: bool = False) -> bool:
        """One fused update of the whole store from the gradient slots of ``workers``, or from ``grads`` (flat
        buffers of the store's size, e.g. a gradient reduced across processes) when given (Note [One update path]).
        ``loss_scale``: the scale the gradients were computed with (:meth:`loss_scale_now` at the step's start).
        ``checked``: as :meth:`admit_update`'s.

        Returns False when the step was skipped because a gradient was not finite (``nonfinite="skip"``).
        """
        slots = [self.store.grad_slot(g) for g in workers] if grads is None else list(grads)
        norm, nonfinite = ops.mean_grad_norm(slots, weights)
        if not self.admit_update(nonfinite.item() != 0.0, workers, loss_scale=loss_scale, checked=checked):
            return False
        self.update_range(0, self.store.numel, slots, weights, norm, lr_divisor, loss_scale=loss_scale)
        return True

    def admit_update(self, nonfinite: bool, workers: list[int], step: int | None = None,
                     loss_scale: float | None = None, decided: bool = False, checked: bool = False) -> bool:
        """Decides whether the step whose mean gradient is (non)finite is applied: raises (``nonfinite="raise"``) or
        counts a skipped step and returns False; otherwise counts the update, advances ``version`` (the step of the
        :meth:`update_range` calls that follow) and returns True. ``step``: the Adam step the update will use when
        not ``version + 1`` (a multi-server async shard applies the coordinating server's). ``loss_scale``: the
        scale the gradients were computed with; with a loss scaler a non-finite gradient first backs the scale off
        (skipped, counted), and an applied step counts towards its growth (Note [Loss scaling]). ``decided``: the
        coordinating server already decided (a multi-server async shard): a non-finite gradient is skipped, as
        there, and the scaler is left alone (the coordinator's decides). ``checked``: the caller ran
        :meth:`check_update` for this update under the same hold of the mutex, with no user code since (an async
        push: :meth:`apply_push`), so it is not asked again."""
        if decided and nonfinite:
            self._counters["skipped_steps"] += 1
            return False
        if self.scaler is not None and loss_scale is None and not decided:
            raise RuntimeError("this engine scales the loss: admit_update needs the scale the gradients were computed "
                               "with (loss_scale=engine.loss_scale_now() at the step's start)")
        if nonfinite and self.scaler is not None and self.scaler.overflow(loss_scale):
            self._counters["skipped_steps"] += 1
            return False
        if nonfinite:
            if self.nonfinite == "raise":
                self._counters["raised_steps"] += 1  # steps (pushes) = applied + skipped + raised
                where = f" (workers {workers})" if workers else ""
                raise FloatingPointError(f"non-finite gradient at step {self.version + 1}{where}; the master weights "
                                         "keep the last complete update")
            self._counters["skipped_steps"] += 1
            return False
        if not checked:  # a bad value raises before any count or write
            self.check_update(self.version + 1 if step is None else step)
        self.version += 1
        self._counters["applied_updates"] += 1
        if self.scaler is not None and not decided:
            self.scaler.applied(loss_scale)
        return True

    def update_range(self, begin: int, end: int, slots: list[torch.Tensor], weights: list[float] | None,
                     norm: torch.Tensor, lr_divisor: float = 1.0, step: int | None = None,
                     loss_scale: float | None = None, first: int = 0) -> None:
        """The fused mean-gradient AdamW over elements ``[begin, end)`` of the store at step ``version`` (or
        ``step``: a multi-node async server applies a push with the coordinating server's step).

        ``slots``: the full gradient slots of the step's workers; ``norm``: the global norm of their (weighted) mean,
        used when the optimizer clips; the lr is :meth:`lr_at` the step, divided by ``lr_divisor`` (async's
        ``staleness_lr="inverse"``: 1 + staleness); ``loss_scale``: the scale the gradients were computed with, which
        the kernel divides out (and out of the norm). Elementwise, so updating the store range by range gives the
        same bits as one call over all of it. ``first``: the store element at which ``slots`` begin (0: full slots;
        a multi-node async server's gradient holds its shard only).
        """
        store, opt = self.store, self.optimizer
        clip = opt.max_grad_norm or 0.0
        step = self.version if step is None else step
        lr = self.lr_at(step) / lr_divisor
        grad_scale = grad_scale_tensor(loss_scale)

        def part(t):
            return None if t is None else t[begin:end]

        if self._decay_runs[0] != opt.no_decay:  # the optimizer's no_decay was changed since
            self._decay_runs = (opt.no_decay, _decay_runs(store, opt))
        if self._decay_runs[1] is not None:  # AdamW(no_decay=...): one multi-tensor call per weight decay
            kwargs = opt.kernel_kwargs(lr)
            for decay in (True, False):
                kwargs["weight_decay"] = opt.weight_decay if decay else 0.0
                spans = [(max(lo, begin), min(hi, end)) for lo, hi, d in self._decay_runs[1]
                         if d == decay and max(lo, begin) < min(hi, end)]
                if not spans:
                    continue

                def parts(t, at=0):
                    return [] if t is None else [t[lo - at:hi - at] for lo, hi in spans]

                torch.ops.pyengine.mean_grad_adamw_multi_.default(
                    parts(store.param), parts(store.exp_avg), parts(store.exp_avg_sq),
                    [p for slot in slots for p in parts(slot, first)], **kwargs, step=step,
                    max_exp_avg_sqs=parts(store.max_exp_avg_sq), grad_scale=grad_scale, found_inf=None, weights=weights,
                    param_outs=parts(store.shadow), grad_norm=norm if clip else None, max_grad_norm=float(clip))
            return
        torch.ops.pyengine.mean_grad_adamw_.default(
            store.param[begin:end], store.exp_avg[begin:end], store.exp_avg_sq[begin:end],
            [slot[begin - first:end - first] for slot in slots], **opt.kernel_kwargs(lr), step=step,
            max_exp_avg_sq=part(store.max_exp_avg_sq), grad_scale=grad_scale, found_inf=None, weights=weights,
            param_out=part(store.shadow), grad_norm=norm if clip else None, max_grad_norm=float(clip))

    def apply_push(self, pulled: int, workers: list[int], grads: list[torch.Tensor] | None = None, *,
                   staleness: int | None = None, span: tuple[int, int] | None = None,
                   norm: tuple[torch.Tensor, bool] | None = None, step: int | None = None,
                   loss_scale: float | None = None, checked: bool = False) -> tuple[bool, int] | None:
        """One async push computed at version ``pulled``, under the mutex (Note [Async pushes and staleness]): None
        when it is too stale and must refresh (counted); else it is counted, applied from the slots of ``workers``
        (or ``grads``) with the staleness policy's lr, and ``(applied, staleness)`` is returned.

        Multi-node async servers (:mod:`pyengine.distributed`) pass ``span=(begin, end)``, their shard of the store,
        and ``grads`` of that shard only, with ``norm=(norm, nonfinite)`` of the whole pushed gradient, so that every
        shard clips and skips alike; ``staleness``, when given, is the coordinating server's admission decision (no
        refresh check here), and ``step`` its Adam step for this push (bias correction; default: this engine's
        ``version`` after the push).
        ``loss_scale``: the scale the push was computed with (taken with its snapshot). ``checked``: the caller
        ran :meth:`check_update` for this update under the same mutex (not twice: ~18 us a push).
        """
        decided = staleness is not None
        staleness = staleness if decided else self.version - pulled
        if not decided and self.max_staleness is not None and staleness > self.max_staleness:
            self._counters["refreshes"] += 1
            return None
        divisor = self.staleness_divisor(staleness)
        if not checked:
            self.check_update(self.version + 1 if step is None else step)  # a bad value raises before the count
        self._counters["pushes"] += 1
        self._staleness[staleness] += 1  # before the update, which may raise: the histogram counts every push
        if span is None:
            applied = self.apply_update(workers, None, divisor, grads=grads, loss_scale=loss_scale, checked=True)
        else:
            applied = self.admit_update(norm[1], workers, step, loss_scale=loss_scale, decided=decided, checked=True)
            if applied:
                self.update_range(span[0], span[1], grads, None, norm[0], divisor, step=step, loss_scale=loss_scale,
                                  first=span[0])
        return applied, staleness

    def check_update(self, step: int) -> None:
        """Raises ValueError when update ``step`` would be refused by the fused kernel: its learning rate
        (:meth:`lr_at`), ``eps``, ``weight_decay`` or a float32 scalar derived from them (lr / (1 - beta1^step),
        1 - lr * weight_decay) beyond float32's range. Asked before an update is counted, so a refused update never
        advances the step (the optimizer's fields may be changed between steps; a bad one raises here too)."""
        if not isinstance(self.optimizer, AdamW):
            raise TypeError(f"engine.optimizer must be a pyengine.AdamW; got {type(self.optimizer).__name__}")
        self.optimizer.check_update(max(1, step), self.lr_at(step))
        if self.optimizer.amsgrad != (self.store.max_exp_avg_sq is not None):
            raise ValueError(f"engine.optimizer.amsgrad was changed to {self.optimizer.amsgrad} after the engine was "
                             "made: the Adam state's buffers (max_exp_avg_sq) were sized then; build a new engine")
        if self.optimizer.no_decay and self.dist is not None and self.dist.shard_update:  # refused when made too
            raise ValueError(f"engine.optimizer.no_decay was set to {self.optimizer.no_decay} after the engine was "
                             "made with shard_update=True, which does not support it (the sharded update runs one "
                             "weight decay over each rank's ranges); set it back to () or build an engine without one "
                             "of them")

    def staleness_divisor(self, staleness: int | None) -> float:
        """What divides the scheduled lr of a push of this ``staleness`` (``staleness_lr="inverse"``: 1 +
        staleness; otherwise, and for None, 1)."""
        return 1.0 + staleness if self.staleness_lr == "inverse" and staleness is not None else 1.0

    def lr_at(self, step: int) -> float:
        """The learning rate of update ``step`` (1-based: the optimizer's step count after it): ``optimizer.lr``
        times ``lr_schedule(step - 1)``, or ``optimizer.lr`` without a schedule. The schedule is asked once per
        update (the last answer is kept); its value is checked (:func:`pyengine.optim.check_lr_factor`). Updates
        count from 1: a step below (a shard server's check of a push that makes no Adam step passes 0) asks for the
        first update's value, so a schedule is never called with a negative step (LambdaLR never does that).
        ``step``: an int >= 0 (2.5 once asked the schedule for 1.5; True, NaN and -3 gave the first update's lr)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"lr_at: step must be an int >= 0 (the update's number, 1-based); got {step!r}")
        if self.lr_schedule is None:
            return self.optimizer.lr
        step = max(1, step)
        key = (step, self.lr_schedule, self.optimizer.lr)
        if self._lr[0] != key:
            factor = self.lr_schedule(step - 1)
            lr = self.optimizer.lr * check_lr_factor(factor, step - 1)
            if not lr <= _F32_MAX:  # the kernel's float32 lr: refused here, before the update counts
                raise ValueError(f"lr_schedule({step - 1}) returned {factor!r}: times the optimizer's lr "
                                 f"{self.optimizer.lr} that is {lr}, beyond float32's range")
            self._lr = (key, lr)
        return self._lr[1]

    def loss_scale_now(self) -> float | None:
        """The loss scale a step starting now computes with (None without loss scaling)."""
        return None if self.scaler is None else self.scaler.scale

    def count(self, key: str, n: int = 1) -> None:
        self._counters[key] += n

    # ---- internals --------------------------------------------------------------------------------------------

    def _record(self, metrics: dict) -> dict:
        """Appends a step's (or push's) metrics to ``history``, dropping the oldest beyond ``keep_history``."""
        self.history.append(metrics)
        self._recorded += 1
        if self._fit_records is not None:
            self._fit_records.append(metrics)
        if self.keep_history is not None and len(self.history) > self.keep_history:
            del self.history[:len(self.history) - self.keep_history]
        return metrics

    def _whole_store(self) -> None:
        """Makes this rank's store whole before it is read: a pipeline's stages across processes are gathered (a
        collective); a multi-node async store that a failed run of several servers left split is refused (Note [A
        failed run of several servers] in :mod:`pyengine.distributed`)."""
        if _across_processes(self.pipeline):
            self.pipeline.gather()
        if self.async_naming is not None:
            self.async_naming.check_whole()
            # Note [A state during a multi-node async run]: the servers' shards meet only at a run's end, a client's
            # store holds the weights it pulled (its version and Adam state are those of the run's start); rank 0
            # of one server holds every update as it is applied (its buffers: the run's start's, Engine.state_dict)
            rank = torch.distributed.get_rank(self.process_group)
            if self._async_run is not None and (rank != 0 or self.servers > 1):
                raise RuntimeError(
                    f"rank {rank}: the state is read during a multi-node async run, where it is not whole: "
                    + ("a client's store holds the weights it pulled, not the run's version and Adam state"
                       if rank >= self.servers else f"each of the {self.servers} servers holds its shard's updates, "
                       "and the shards meet at the run's end") + "; read it after fit returns (rank 0 of a run "
                    "with one server may read it during the run)")

    def _check_process(self) -> None:
        """Note [An engine in a forked process]
        A fork copies the engine's memory into the child but none of its threads: the worker pool's, the copy
        threads of the transfers (a CUDA context is not usable there either), and its locks as they were at that
        instant, possibly held by a thread that is not there. A step or fit in the child waited for those threads
        for good, and close() or the exit crashed or hung joining them. So in the child the engine refuses to train,
        close() only marks it closed, and its transfers are never joined or freed there (Note [A transfer in a
        forked process] in csrc/store/transfer.h); readers of the state (state_dict) work on the child's copy, taken
        between two updates (the fork waits for the engine's mutex; the child gets fresh locks: os.register_at_fork
        above).
        A DataLoader's forked workers are not affected: they never touch the engine."""
        if os.getpid() != self._pid:
            raise RuntimeError(f"this Engine was built in process {self._pid} and this is process {os.getpid()}, a "
                               "fork of it: its worker and copy threads are not here. Build an Engine in this "
                               "process (or start the process with the 'spawn' method)")

    def _check_open(self) -> None:
        self._check_process()
        if self._closed:
            raise RuntimeError("this Engine is closed")
        if self._abandoned:
            raise RuntimeError("a step of this Engine was abandoned by a second Ctrl-C (Note [Ctrl-C inside a step]): "
                               "its state is undefined; close() it and restore a checkpoint into a new Engine")

    def _abandon(self) -> None:
        self._abandoned = True

    @staticmethod
    def _check_options(mode, nonfinite, accumulate, max_staleness, staleness_lr, batch_schedule, autocast, loss_fn):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
        if nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite must be 'skip' or 'raise'; got {nonfinite!r}")
        if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
            raise ValueError(f"accumulate must be an integer >= 1; got {accumulate!r}")
        if accumulate > 1 and mode != "async":
            raise ValueError(f"accumulate is an async option (mini-batches summed before one push); mode={mode!r}")
        if max_staleness is not None and (not isinstance(max_staleness, int) or isinstance(max_staleness, bool)
                                          or max_staleness < 0):
            raise ValueError(f"max_staleness must be an integer >= 0 or None; got {max_staleness!r}")
        if staleness_lr not in ("none", "inverse"):
            raise ValueError(f"staleness_lr must be 'none' or 'inverse'; got {staleness_lr!r}")
        if batch_schedule is not None and not callable(batch_schedule):
            raise TypeError(f"batch_schedule must be callable as batch_schedule(version) -> mini-batches per push; "
                            f"got {type(batch_schedule).__name__}")
        if batch_schedule is not None and accumulate > 1:  # the schedule decided alone: accumulate was ignored
            raise ValueError(f"accumulate={accumulate} and batch_schedule both set the mini-batches of a push; give "
                             "one of them (batch_schedule alone: return the count from it)")
        async_only = [name for name, value, default in (("max_staleness", max_staleness, None),
                                                         ("staleness_lr", staleness_lr, "none"),
                                                         ("batch_schedule", batch_schedule, None))
                      if value != default]
        if async_only and mode != "async":
            raise ValueError(f"{', '.join(async_only)}: async option(s) (pushes and their staleness); mode={mode!r}")
        if autocast not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"autocast must be None, torch.bfloat16 or torch.float16; got {autocast!r}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable as loss_fn(model, batch) -> scalar tensor")


def _on_stream(stream, fn):
    """``fn()`` with ``stream`` current (None: as it is): Note [A worker task runs on its caller's streams]."""
    if stream is None:
        return fn()
    with torch.cuda.stream(stream):
        return fn()


def frozen_digests(named) -> dict[str, str]:
    """name -> a digest (SHA-256 of dtype, shape and bytes) of each frozen parameter of ``named`` ((name, tensor)
    pairs: ``model.named_parameters()`` keeps those with ``requires_grad=False``). What a state keeps of the frozen
    parameters (Note [A state names the frozen parameters it was trained with])."""
    out = {}
    for name, t in named:
        if t.requires_grad:
            continue
        flat = t.detach().to("cpu").contiguous().view(-1)
        digest = hashlib.sha256(f"{t.dtype} {tuple(t.shape)} ".encode())
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
        out[name] = digest.hexdigest()
    return out


def _module_classes(classes) -> tuple[type, ...]:
    if isinstance(classes, type) or not isinstance(classes, (tuple, list)):
        raise TypeError(f"random_modules must be a tuple of nn.Module classes; got {classes!r}")
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, torch.nn.Module))]
    if bad:
        raise TypeError(f"random_modules must hold nn.Module classes; got {bad}")
    return tuple(classes)


def _decay_runs(store: HostStore, optimizer: AdamW) -> list[tuple[int, int, bool]] | None:
    """The store's elements as contiguous runs ``(lo, hi, decays)`` of parameters with and without weight decay
    (padding after a parameter goes with it: its zeros stay zero), or None without ``no_decay``."""
    if not optimizer.no_decay:
        return None
    entries = sorted(store.layout, key=lambda e: e.offset)
    runs: list[tuple[int, int, bool]] = []
    for i, entry in enumerate(entries):
        lo = 0 if i == 0 else entry.offset
        hi = entries[i + 1].offset if i + 1 < len(entries) else store.numel
        decays = optimizer.decays(entry.name)
        if runs and runs[-1][2] == decays:
            runs[-1] = (runs[-1][0], hi, decays)
        else:
            runs.append((lo, hi, decays))
    return runs


def _samples(schedule) -> list | None:
    """A schedule (callable of the step) as what it gives at a few steps, for comparing ranks' engines: its value,
    or the type of what it raised. None for no schedule."""
    if schedule is None:
        return None
    values = []
    for step in (0, 1, 2, 3, 10, 100, 1000, 10 ** 4, 10 ** 5):
        try:
            value = schedule(step)
        except Exception as exc:  # noqa: BLE001 - compared, not raised: the schedule's own checks come later
            values.append(f"raises {type(exc).__name__}")
            continue
        try:  # a number (or a one-element tensor, on any device) by its bits; anything else as it prints
            values.append(float(value).hex())
        except (TypeError, ValueError, RuntimeError):
            values.append(repr(value))
    return values


_F32_MAX = float(torch.finfo(torch.float32).max)


def _call(fn):
    """``(fn(), None)``, or ``(None, the exception)``, for a task run on the calling thread (Note [One CPU worker
    runs on the calling thread]).

    Note [A task's exception and its callers' frames]
    An exception's traceback holds the frames it passed through, and each frame links to its caller (``f_back``),
    so every frame above ``fn`` on the calling thread is reachable from the exception. A future holding the
    exception, kept in any of those frames, makes a cycle through the engine: it and its store (possibly GBs of
    pinned memory) would live until the garbage collector runs. So this frame keeps nothing, the caller makes the
    future in a call of its own (:func:`_future`), and :meth:`Engine.gather_workers` empties the caller's dict of
    futures before it raises (concurrent.futures' workers drop theirs for the same reason)."""
    try:
        return fn(), None
    except Exception as error:
        return None, error


def _future(result, error) -> concurrent.futures.Future:
    """A done future of ``result``, or of ``error`` when it is not None."""
    future = concurrent.futures.Future()
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
    return future


def _is_dense(value) -> bool:
    """Whether a state entry is a tensor whose values can be copied into the store: strided (a sparse tensor passed
    the dtype and shape checks, then failed the copy half-way through loading) and not on the meta device."""
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_meta


def _describe(value) -> str:
    """What a state entry is, for an error message: a tensor's dtype and shape, else its type."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    layout = "" if value.layout == torch.strided else f" ({value.layout})"
    return f"{value.dtype} {tuple(value.shape)}{layout}{' on the meta device' if value.is_meta else ''}"


def _batches(batches, steps, epochs):
    """Yields batches for ``steps`` steps or ``epochs`` passes (one pass when neither is given). A batch is taken
    from the iterable only when a step will use it, and a new pass begins only then: with ``steps`` reached at the
    end of a pass, the source is not iterated again (a generator keeps its next batch for a later fit, a live
    source is not waited on for a batch no step would take, a one-pass source is not restarted)."""
    if steps is None and epochs is None:
        epochs = 1
    done, epoch = 0, 0
    while (epochs is None or epoch < epochs) and (steps is None or done < steps):
        produced = False
        iterator = iter(batches)
        while steps is None or done < steps:
            try:
                batch = next(iterator)
            except StopIteration:
                break
            produced = True
            done += 1
            yield batch
        if not produced:
            if done == 0 and steps:
                raise ValueError("batches is empty")
            return
        epoch += 1
