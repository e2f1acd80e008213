"""Pipeline parallelism: a model of consecutive layers split into S stages, each on its own worker, fed by M
micro-batches under a GPipe (fill-drain) or 1F1B (one-forward-one-backward) schedule.

    engine = pyengine.Engine(torch.nn.Sequential(...), loss_fn, devices=["cpu"] * 4, mode="pipeline", stages=2,
                             microbatches=8, schedule="1f1b", balance="params")
    metrics = engine.step((inputs, targets))

- Split: the layers (an ``nn.Sequential``, an ``nn.ModuleList`` or a list of modules) are cut into S contiguous
  groups, balanced by parameter count (``balance="params"``), by forward+backward time measured on the first
  micro-batch on stage 0's device (``balance="time"``: Note [Timing the layers on stage 0's device]), or by explicit
  sizes (``balance=[3, 2, ...]``): see :func:`partition`.
- Devices: S x R entries; stage s, data-parallel replica r runs on ``devices[s * R + r]``. Each (stage, replica) is one
  thread with a deep copy of its layers (on CUDA, its own stream). The batch is split across the R replicas as in
  hybrid, then each replica's shard into M micro-batches.
- Schedules are explicit per-stage action lists of ``("F", m)`` / ``("B", m)`` (:func:`schedule_actions`) that each
  stage thread executes in order. Activations go downstream and their gradients upstream through :class:`_Channel`
  (a ``queue.Queue``; on CUDA the sender records an event on its stream and the receiver's stream waits on it).
- Loss contract: the batch is ``(inputs, targets)``; the Engine's ``loss_fn`` is called on the **last stage** as
  ``loss_fn(last_stage, (activations, targets_m))``, so a loss_fn of the form ``criterion(model(x), y)`` works
  unchanged. Micro-batch losses are scaled by ``n_m / n`` (n_m samples of n in the replica's shard), so the summed
  gradient is the shard's mean gradient; replicas are then weighted by shard size (as in hybrid).
- Batch statistics: each stage runs its layers on one micro-batch at a time, so a layer that computes statistics
  over the batch (``BatchNorm`` in training mode) normalises each micro-batch by its own mean and variance, and
  updates its running statistics once per micro-batch (``num_batches_tracked`` grows by M a step, the running mean
  and variance take M momentum updates). The equality with single-device training on the whole batch holds for
  layers that treat each sample on its own (Linear, LayerNorm, attention within a sample, ...); with BatchNorm only
  for M = 1 and one replica (as with gradient accumulation, and data parallelism without synchronised BatchNorm).
- Autocast (``Engine(autocast=torch.bfloat16)``): each stage's forward, the loss included, runs under
  ``torch.autocast`` on the stage's device, as hybrid workers do; backward runs outside it. Activations and their
  gradients cross stages in the autocast dtype; the store's gradient slots are in it; master weights stay fp32.
- Stages in separate processes: :mod:`pyengine.pipeline_distributed` (on ``torch.distributed.pipelining``).

Note [Pipeline update path]
Master weights stay in the Engine's one :class:`~pyengine.HostStore` over the whole model, with one gradient slot per
data-parallel replica: slot r holds replica r's gradients of *every* stage, each stage writing its own parameters'
range (the store lays parameters out in reverse model order, so a stage's parameters are one contiguous range; this
is checked when the stages are built). After every stage finished its micro-batches, the step is one call of
:meth:`Engine.apply_update` over the whole store, so clipping, the non-finite check and step counting are the same
code path as hybrid and sync; with R replicas the fused kernel averages the R slots (weighted by shard sizes). The
price: the update does not overlap the last stages' backward. Each stage copies its weights back from the store at
the start of the next step.

Note [Parameters tied across stages]
A trainable parameter held by several stages (an input embedding tied to the output layer) is one entry of the store,
under its first name in the model, inside the range of the first stage that holds it. Every stage holding it keeps
its own copy (``copy.deepcopy`` per stage) and pulls the master value into it at the start of each step, so all of
them compute with the last update. No stage writes a tied parameter's range of the gradient slot: a stage's thread
returns its copy's gradient (fp32), and after every stage's thread has finished, :meth:`Pipeline.step` writes the sum
of the contributions, in stage order, into slot r for each replica r. The update then sees the tied parameter's
full gradient, exactly as autograd accumulates it on one device. Summing on the step's thread after the join is what
makes it safe: two stage threads never write the same range of a slot.

Note [Stopping a failed pipeline]
Stages block only on their input channels, and a channel ``get`` polls a stop event shared by the step every 50 ms.
The first stage that raises records its exception and sets the event; every other stage then leaves its wait with
:class:`_Stopped`, so no thread is left blocked and the step raises :class:`StageError` naming the failing stage
(its original exception as the cause). Nothing was written to the master weights; the next step starts afresh (new
channels, gradients zeroed). The stages' buffers are put back too: the forwards that ran before the failure moved
BatchNorm running statistics (and ``num_batches_tracked``) of a step that never happened. So before a step every
stage's buffers are copied (buffers only: weights come from the store anyway), and a failed step copies them back
once every stage's thread has finished (on CUDA, after its stream did): a failed step leaves weights and buffers
as they were, and the steps after it train as if it had never been tried (tested).

Note [Timing the layers on stage 0's device]
``balance="time"`` needs each layer's time on the device it will run on, but which device runs a layer is what the
partition decides. The layers are timed on ``devices[0]`` (stage 0's), one deep copy of one layer at a time moved
there (so a model that fits no single device can still be timed), with that device's autocast; not on the device
the model or the batch was given on (the host, typically, for stages on GPUs). With stages on devices of one kind
(all CPU workers, GPUs of one model) those are the stages' times; with devices of different kinds (a CPU and a GPU)
the split balances stage 0's device's times, a limitation: time the layers yourself per device and pass
``balance=[sizes]``. The timing uses the first micro-batch of replica 0's shard: the first layer gets what the batch's
inputs hold (a tensor, or a tuple / list / dict of tensors), every later layer the output of the one before it, which
must be one tensor.

Note [CUDA ordering between stages]
A message is (micro-batch, tensor, event). The sender moves the tensor to the receiver's device on its own stream
(a device-to-device copy is ordered after the sender's kernels by PyTorch), records the event there and enqueues.
The receiver's stream waits on the event (no host sync) and ``record_stream`` tells the caching allocator the tensor
is used on the receiver's stream, so its memory is not reused before that work is done. A CPU sender hands a CUDA
receiver a tensor copied to its device synchronously; a CPU receiver of a CUDA sender's copy waits on the event on
the host. Weights come back from the pinned store with non-blocking copies on the stage's stream; gradient copies to
the store are waited for (stream synchronize) before the stage's thread returns, so the update never reads a slot
still being written. Before a step, each stage's stream waits for the work the caller enqueued on its device (the
batch, the replicas' buffers shared by :meth:`Engine.share_buffers`): pool streams do not wait on the default
stream by themselves.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import copy
import math
import queue
import statistics
import threading
import time
import weakref

import torch

from .metrics import step_metrics
from .streamer import check_dense_gradients
from .workers import (FollowedState, KeptBufferCopies, WorkerError, _map, _tensors, batch_size,
                      check_weights_unchanged, put_back_saved, replica_of, split_batch, task_thread_initializer,
                      to_device)
from .workers import autocast as autocast_region

__all__ = ["Pipeline", "SCHEDULES", "StageError", "as_sequential", "measure_layer_times", "partition",
           "schedule_actions", "split_layers", "stage_range"]

SCHEDULES = ("1f1b", "gpipe")
_POLL_S = 0.05


class StageError(WorkerError):
    """A pipeline stage raised; ``stage`` and ``replica`` name it. The original exception is ``__cause__``."""

    def __init__(self, stage: int, replica: int, device, cause: BaseException):
        RuntimeError.__init__(self, f"pipeline stage {stage} (replica {replica}, {device}) failed: "
                                    f"{type(cause).__name__}: {cause}")
        self.worker = stage
        self.stage = stage
        self.replica = replica


def check_unused(params, unused: str, tied=()) -> None:
    """``unused="error"``: raises RuntimeError naming the parameters of ``params`` (name, parameter) that got no
    gradient in this step, tied ones (``tied``: names, summed across the stages) left out."""
    missing = [name for name, p in params if p.grad is None and name not in tied]
    if missing and unused == "error":
        raise RuntimeError(f"{len(missing)} parameter(s) of this stage received no gradient: {missing[:10]}; "
                           "pass unused='zero' or freeze them")


class _Stopped(Exception):
    """Raised in a stage whose pipeline was stopped by another stage's failure."""


# ---- splitting -------------------------------------------------------------------------------------------------

def as_sequential(model) -> torch.nn.Sequential:
    """``model`` as an ``nn.Sequential`` of its layers: a list or tuple of modules, or an ``nn.ModuleList``, is
    wrapped (its layers named ``"0"``, ``"1"``, ..., as a ModuleList names them). A container holding parameters or
    buffers of its own, outside every layer, is refused: no stage would hold them (a buffer of its own trained,
    then state_dict() raised KeyError)."""
    if isinstance(model, torch.nn.Module):
        own = [name for name, value in (*model._parameters.items(), *model._buffers.items()) if value is not None]
        if own and isinstance(model, (torch.nn.Sequential, torch.nn.ModuleList)):
            raise ValueError(f"mode='pipeline': the {type(model).__name__} holds {own} itself, outside its layers, "
                             "and the stages are its layers; move them into a layer (a module of their own)")
    if isinstance(model, torch.nn.Sequential):
        hooks = model._forward_hooks or model._forward_pre_hooks or model._backward_hooks or \
            model._backward_pre_hooks  # a backward hook on the container: not run either (silently, before)
        if type(model).forward is not torch.nn.Sequential.forward or hooks:
            raise ValueError(f"mode='pipeline': the stages chain the layers of the {type(model).__name__}, so its "
                             f"{'hooks' if hooks else 'own forward()'} would not run; pass its layers (a "
                             "list or an nn.Sequential of them), with what that forward adds made a layer of its own")
        return model
    if (isinstance(model, (list, tuple, torch.nn.ModuleList)) and len(model)
            and all(isinstance(m, torch.nn.Module) for m in model)):
        return torch.nn.Sequential(*model)
    raise TypeError("mode='pipeline' needs the model as a sequence of layers: an nn.Sequential, an nn.ModuleList or "
                    f"a non-empty list of nn.Modules; got {type(model).__name__}")


def partition(costs, stages: int, each_positive: bool = False) -> list[int]:
    """Sizes of ``stages`` contiguous non-empty groups of layers minimising the largest group cost.

    ``costs`` are per-layer (parameter counts or seconds). Exact dynamic programme, O(stages x layers^2); ties go to
    the earliest cut. ``each_positive``: every group's cost must be > 0 where enough layers cost anything (stages
    across processes each need a trainable parameter; a GELU alone was a stage of its own), else as without it.
    """
    costs = [float(c) for c in costs]
    layers = len(costs)
    if not _is_int(stages) or not 1 <= stages <= layers:
        raise ValueError(f"stages must be an int in [1, {layers}] (the number of layers); got {stages!r}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[math.inf] * (layers + 1) for _ in range(stages + 1)]
    cut = [[0] * (layers + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    positive = each_positive and sum(c > 0 for c in costs) >= stages
    for s in range(1, stages + 1):
        for i in range(s, layers - (stages - s) + 1):
            for j in range(s - 1, i):
                if positive and not prefix[i] - prefix[j] > 0:
                    continue
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    sizes, i = [], layers
    for s in range(stages, 0, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def split_layers(layers, sizes: list[int]) -> list[torch.nn.Sequential]:
    """``layers`` (``(name, module)`` pairs) cut into ``sizes`` groups, each an ``nn.Sequential`` whose children keep
    their names, so its parameters are named as in the whole model (the store's names). The modules are shared with
    ``layers``, not copied.

    A trainable parameter may be in several stages (tied weights: Note [Parameters tied across stages]). A buffer in
    two stages is a ValueError naming it and the stages: each stage would update its own copy of it.
    """
    modules, begin = [], 0
    for size in sizes:
        modules.append(torch.nn.Sequential(collections.OrderedDict(layers[begin:begin + size])))
        begin += size
    shared = _shared_buffers(modules)
    if shared:
        name, stages = next(iter(shared.items()))
        raise ValueError(f"buffer {name!r} is shared between stages {stages}; pipeline stages need every buffer in "
                         "one stage")
    return modules


def stage_store_names(store_names: dict[int, str], modules) -> tuple[list[list[str]], dict[str, list[int]]]:
    """Each stage's trainable parameters by store name, in ``module.parameters()`` order (``store_names``: id of a
    parameter of the whole model -> its name there; a tied parameter's store name is its first name in the model),
    and the tied ones: store name -> the stages holding it, for those held by more than one (Note [Parameters tied
    across stages])."""
    names = [[store_names[id(p)] for p in module.parameters() if p.requires_grad] for module in modules]
    held = collections.defaultdict(list)
    for s, stage_names in enumerate(names):
        for name in stage_names:
            held[name].append(s)
    return names, {name: stages for name, stages in held.items() if len(stages) > 1}


def owned_names(names: list[str], stage: int, tied: dict[str, list[int]]) -> list[str]:
    """The parameters among stage ``stage``'s ``names`` whose store range it owns: all but those tied to an earlier
    stage (a tied parameter lies in the range of the first stage holding it)."""
    return [n for n in names if tied.get(n, [stage])[0] == stage]


def _shared_buffers(modules) -> dict[str, list[int]]:
    """Buffers that more than one of ``modules`` holds: the name of each in the first module that holds it -> the
    indices of the modules holding it."""
    first, stages = {}, collections.defaultdict(list)
    for s, module in enumerate(modules):
        for name, t in module.named_buffers():
            first.setdefault(id(t), name)
            stages[id(t)].append(s)
    return {first[key]: held for key, held in stages.items() if len(held) > 1}


def _param_costs(layers) -> list[int]:
    return [sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in layers]


def _is_int(value) -> bool:
    """An int and not a bool (``True`` is an int to Python, never a count of stages, layers or micro-batches)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_sizes(sizes, layers: int, stages: int) -> list[int]:
    if (not isinstance(sizes, (list, tuple)) or len(sizes) != stages
            or not all(_is_int(n) and n >= 1 for n in sizes) or sum(sizes) != layers):
        raise ValueError(f"balance must be 'params', 'time' or a list of {stages} positive ints (layers per stage) "
                         f"summing to {layers}; got {sizes!r}")
    return list(sizes)


def stage_range(store, stage: int, names: list[str]) -> tuple[int, int]:
    """The flat range ``[begin, end)`` of ``store`` that a stage's parameters ``names`` fill; a ValueError when they
    are not one contiguous range of it (Note [Pipeline update path]). ``(0, 0)`` for a stage without parameters."""
    if not names:
        return 0, 0
    entries = [store.entry(n) for n in names]
    begin = min(e.offset for e in entries)
    end = max(e.offset + e.numel for e in entries)
    # empty parameters hold no element: one may sit at another stage's offset, or just past this range's end
    inside = {e.name for e in store.layout if begin <= e.offset < end and e.numel}
    own = {e.name for e in entries if e.numel}
    if inside != own:
        raise ValueError(f"stage {stage}: its parameters are not one contiguous range of the host store "
                         f"(also holds {sorted(inside - own)[:5]})")
    return begin, end


def measure_layer_times(layers, inputs, repeats: int = 3, device=None) -> list[float]:
    """Median seconds of forward+backward of each layer, fed ``inputs`` (what the first layer takes: a tensor, or a
    tuple / list / dict holding tensors) and then each layer's output, on ``device`` (default: the device of the first
    tensor of ``inputs``).

    Nothing is modified: each layer is timed on a deep copy of it moved to ``device``, one layer at a time (a model
    that fits no single device can still be timed), and the random number generators (dropout draws from them) are
    restored afterwards, so a run balanced by time draws the same numbers as the same partition given explicitly. On
    CUDA the device is synchronized around each timing: its kernels run asynchronously to the host's clock.

    Every layer but the last must return one tensor (a stage may end after any layer, and what crosses to the next
    stage is one tensor); otherwise a TypeError names that layer.
    """
    layers = list(layers)
    given = _tensors(inputs)
    if not given:
        raise TypeError("balance='time' feeds the first layer the first micro-batch of the inputs, which must be a "
                        "tensor or a tuple / list / dict holding tensors; got "
                        f"{type(inputs).__name__} without one (use balance='params' or explicit sizes)")
    device = torch.device(device) if device is not None else given[0].device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    devices = [t.device for layer in layers for t in layer.parameters()] + [t.device for t in given] + [device]
    cuda = sorted({d.index for d in devices if d.type == "cuda"})

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device).requires_grad_(t.is_floating_point())

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    samples = []
    with torch.random.fork_rng(devices=cuda):
        x = _map(inputs, leaf)
        for i, original in enumerate(layers):
            layer = copy.deepcopy(original).to(device)
            times = []
            for _ in range(repeats):
                # an in-place first op must not modify a leaf
                fed = _map(x, lambda t: t.clone() if t.requires_grad else t)
                sync()
                start = time.perf_counter()
                try:
                    y = layer(fed)
                    outputs = [t for t in _tensors(y) if t.requires_grad]
                    if outputs:
                        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
                except Exception as exc:  # the layer's own error, of its own type, says where it came from
                    if hasattr(exc, "add_note"):  # Python >= 3.11
                        exc.add_note(f"(raised by layer {i}, {type(original).__name__}, while balance='time' timed "
                                     f"its forward and backward on {device}, fed "
                                     f"{', '.join(str(tuple(t.shape)) for t in _tensors(x))} from the first "
                                     f"micro-batch)")
                    raise
                sync()
                times.append(time.perf_counter() - start)
            samples.append(statistics.median(times))
            del layer
            if i < len(layers) - 1:
                if not isinstance(y, torch.Tensor):
                    raise TypeError(f"balance='time' times the layers one by one and needs each layer before the "
                                    f"last to return one tensor; layer {i} returned {type(y).__name__} (use "
                                    f"balance='params' or explicit sizes)")
                x = leaf(y)
    return samples


# ---- schedules -------------------------------------------------------------------------------------------------

def schedule_actions(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The ordered actions of ``stage``: ``("F", m)`` forward of micro-batch m, ``("B", m)`` its backward.

    ``"gpipe"``: every forward, then every backward (fill-drain; stage s stores all M micro-batches).
    ``"1f1b"``: S-1-s warm-up forwards, then one forward and one backward alternately, then the remaining backwards;
    stage s stores at most min(S - s, M) micro-batches. Both run the backwards in micro-batch order, so the gradients
    accumulate in the same order and the two schedules give bit-identical weights.
    """
    if schedule == "gpipe":
        return [("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)]
    if schedule != "1f1b":
        raise ValueError(f"schedule must be one of {SCHEDULES}; got {schedule!r}")
    warmup = min(stages - 1 - stage, microbatches)
    actions = [("F", m) for m in range(warmup)]
    for m in range(warmup, microbatches):
        actions += [("F", m), ("B", m - warmup)]
    actions += [("B", m) for m in range(microbatches - warmup, microbatches)]
    return actions


# ---- stages and channels ---------------------------------------------------------------------------------------

class _Channel:
    """One direction between two adjacent stages of one replica (see Note [CUDA ordering between stages])."""

    def __init__(self, stop: threading.Event):
        self._queue = queue.Queue()
        self._stop = stop

    def put(self, m: int, tensor: torch.Tensor, device: torch.device, stream) -> None:
        """Sends micro-batch ``m``'s ``tensor`` to the receiver on ``device``; ``stream``: the sender's (None: CPU)."""
        event = None
        if stream is not None:
            with torch.cuda.stream(stream):
                tensor = tensor.to(device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        else:
            tensor = tensor.to(device)  # from a CPU stage: complete when it returns
        self._queue.put((m, tensor, event))

    def get(self, m: int, stream) -> torch.Tensor:
        while True:
            try:
                got, tensor, event = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if self._stop.is_set():
                    raise _Stopped from None
        if got != m:
            raise RuntimeError(f"pipeline channel out of order: expected micro-batch {m}, got {got}")
        if event is not None and stream is None:
            event.synchronize()  # a CPU stage receiving a CUDA stage's copy
        elif stream is not None:
            if event is not None:
                stream.wait_event(event)
            tensor.record_stream(stream)
        return tensor


class _Stage:
    """One (stage, replica): a deep copy of its layers on its device, the store names of its parameters.

    ``names`` are the store names of ``module``'s trainable parameters in ``module.parameters()`` order (a tied
    parameter's store name is its first name in the whole model, not necessarily its name in this stage); ``tied``
    are those also held by another stage (Note [Parameters tied across stages])."""

    def __init__(self, index: int, replica: int, device: torch.device, module: torch.nn.Sequential, store,
                 names: list[str], tied: set[str], rng=None, random_modules=()):
        self.index, self.replica, self.device = index, replica, device
        self.module = replica_of(module, device)  # deepcopy keeps ties inside the stage, and hooks are kept
        if rng is not None:  # Note [Random numbers of concurrent workers] (pyengine/rng.py)
            rng.install(self.module, random_modules)
        self.params = list(zip(names, (p for p in self.module.parameters() if p.requires_grad), strict=True))
        self.tied = tied
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.param_ptrs = {p.data_ptr() for p in self.module.parameters()}
        # what the stage pulls: the shadow of a low-precision model (Note [The shadow follows the master weights])
        self._master = store.views(store.param if store.shadow is None else store.shadow)
        self._slot = store.views(store.grad_slot(replica))
        self._versions = [p._version for _, p in self.params]  # as pull() leaves them
        self.followed = FollowedState(self.module)  # Note [Model state the engine does not follow] (workers.py)

    def context(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    @torch.no_grad()
    def pull(self) -> None:
        """Master weights -> this stage's parameters (non-blocking on the stage's stream on CUDA)."""
        with self.context():
            for name, p in self.params:
                p.copy_(self._master[name], non_blocking=True)
        self._versions = [p._version for _, p in self.params]  # Note [Weights changed in place by a step]
        self.followed.mark()

    @torch.no_grad()
    def push_grads(self, unused: str) -> dict[str, torch.Tensor | None]:
        """This stage's accumulated gradients -> its range of the replica's gradient slot (zeros if none).

        Tied parameters are not written: their gradients are returned (fp32, on the CPU; None where this stage's copy
        got none) for :meth:`Pipeline.step` to sum across the stages."""
        check_unused(self.params, unused, self.tied)
        check_weights_unchanged([name for (name, p), v in zip(self.params, self._versions) if p._version != v],
                                f"stage {self.index} (replica {self.replica})")
        self.followed.check(f"stage {self.index} (replica {self.replica})")
        tied = {}
        with self.context():
            for name, p in self.params:
                if name in self.tied:
                    tied[name] = None if p.grad is None else p.grad.to("cpu", torch.float32, copy=True)
                elif p.grad is None:
                    self._slot[name].zero_()
                else:
                    self._slot[name].copy_(p.grad, non_blocking=True)
        if self.stream is not None:
            self.stream.synchronize()
        return tied


class _BusyClock:
    """Sums the compute time of a stage's actions: host time on CPU, CUDA event time on the stage's stream."""

    def __init__(self, stream):
        self.stream, self.seconds, self._events = stream, 0.0, []

    @contextlib.contextmanager
    def measure(self):
        if self.stream is None:
            start = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - start
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(self.stream)
        yield
        end.record(self.stream)
        self._events.append((begin, end))

    def total(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
            self.seconds += sum(b.elapsed_time(e) for b, e in self._events) / 1e3
            self._events = []
        return self.seconds


class _Activations:
    """Bytes autograd saves during a stage's forwards (parameters left out; each saved tensor counted once by its own
    size, not its storage's), and the number of micro-batches stored at once."""

    def __init__(self, param_ptrs):
        self._param_ptrs = param_ptrs
        self.count = self.peak_count = 0
        self.bytes = self.peak_bytes = 0
        self._ptrs: set = set()
        self._current = 0

    def hooks(self):
        """Counts one forward's saved bytes (call :meth:`stored` after it)."""
        self._ptrs = set()
        self._current = 0

        def pack(t):
            # the bytes of the tensor itself, not of its storage: a micro-batch is a view of the whole batch
            if t.layout == torch.strided and not t.is_nested:  # sparse and nested tensors have no storage to key
                ptr = t.untyped_storage().data_ptr()
                key = (ptr, t.storage_offset(), t.numel())
                if ptr not in self._param_ptrs and key not in self._ptrs:
                    self._ptrs.add(key)
                    self._current += t.numel() * t.element_size()
            # Detached, not t itself: an op's saved output kept as itself holds its own grad_fn, a cycle through C++
            # that only backward breaks and gc cannot see; the activations of a failed step, or of an op off the
            # loss's path, were never freed. Autograd gives the unpacked alias its grad_fn back.
            # With its version: under saved-tensor hooks autograd no longer checks that a saved tensor was not
            # changed in place since (the detached alias shares its version counter), so unpack does, with autograd's
            # own error (a layer that did y = exp(x); y.add_(1) trained on a wrong gradient in a pipeline only).
            return t.detach(), t._version

        def unpack(packed):
            t, version = packed
            if t._version != version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                    f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} instead "
                    "(a pipeline stage's forward changed a tensor in place after an operation saved it for backward)")
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def stored(self) -> int:
        nbytes = self._current
        self.count += 1
        self.bytes += nbytes
        self.peak_count = max(self.peak_count, self.count)
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return nbytes

    def released(self, nbytes: int) -> None:
        self.count -= 1
        self.bytes -= nbytes


# ---- the pipeline ----------------------------------------------------------------------------------------------

class Pipeline:
    """The stages of one Engine in ``mode="pipeline"`` and their step (see the module docstring).

    Args:
        engine: the Engine (its store, devices, loss_fn, recorder and :meth:`Engine.apply_update` are used).
        model: an ``nn.Sequential`` (see :func:`as_sequential`).
        stages: S; ``len(engine.devices)`` must be a multiple of S (R = len(devices) / S replicas per stage).
        microbatches: M >= 1 micro-batches per replica per step.
        schedule: ``"1f1b"`` or ``"gpipe"``.
        balance: ``"params"``, ``"time"`` (measured on the first step's first micro-batch, on ``devices[0]``: Note
            [Timing the layers on stage 0's device]; a state loaded before that step gives its split instead: Note
            [A resumed pipeline keeps its split] in pyengine.engine; the model is copied when the engine is made,
            so its changes after that are not trained on) or a list of S sizes.
        unused: ``"zero"`` or ``"error"`` for parameters that got no gradient in a step.
        autocast: None, ``torch.bfloat16`` or ``torch.float16``: every stage's forward (and the loss) runs under
            ``torch.autocast`` on its device, as hybrid workers do; activations and their gradients travel between
            stages in that dtype, gradients go to the store in it (the store's ``grad_dtype``), master weights stay
            fp32.
    """

    def __init__(self, engine, model: torch.nn.Sequential, *, stages: int, microbatches: int, schedule: str,
                 balance, unused: str = "zero", autocast: torch.dtype | None = None):
        devices = engine.devices
        check_dense_gradients(model, "pipeline")
        if balance == "time":  # the stages are built at the first step: from the model as it was given, not as the
            # caller changes it meanwhile (and neither timing nor a load touches it); with the parameters' gradient
            # hooks (Note [Replicas keep the parameters' hooks]: a deep copy dropped them, and the stages with them)
            model = replica_of(model)
        self.layers = list(model._modules.items())  # named_children() would list a repeated module once
        check_options(len(self.layers), len(devices), stages, microbatches, schedule, balance)
        # Note [No reference cycle through the engine]
        # The engine owns its pipeline; the pipeline's way back is a weak proxy. With a strong one the pair is a
        # cycle: dropping the engine would free neither (nor the host store, possibly GBs of pinned memory) until the
        # garbage collector runs, and an engine over a process group would keep the group (and its gloo threads)
        # alive past torch.distributed.destroy_process_group(), to be destroyed during interpreter shutdown.
        self.engine, self.store = weakref.proxy(engine), engine.store
        self.num_stages, self.microbatches, self.schedule = stages, microbatches, schedule
        self.replicas = len(devices) // stages
        self.devices = devices
        self.unused = unused
        self.balance = balance
        self.autocast = autocast
        self.sizes: list[int] | None = None
        self.stages: list[list[_Stage]] = []  # [stage][replica]
        self.tied: dict[str, list[int]] = {}  # store name -> the stages holding it
        # store names by tensor: a tied parameter is in the store once, under its first name in the model
        self._store_names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
        # stage threads run at once: each (stage, replica) draws from its own generator (Note [Random numbers of
        # concurrent workers]), made here, once: the stages are built at the first step with balance="time"
        self.rngs = [engine.worker_rng(d, i) if len(devices) > 1 else None for i, d in enumerate(devices)]
        if balance == "params":
            self._build(partition(_param_costs([layer for _, layer in self.layers]), stages))
        elif balance != "time":
            self._build(list(balance))
        # one thread per (stage, replica), all running at once: a stage blocked on its channel must not hold the
        # only thread its neighbour could run on
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=len(devices), thread_name_prefix="pyengine-stage", initializer=task_thread_initializer,
            initargs=(engine._task_threads, devices, engine._intra_op_threads))

    def _build(self, sizes: list[int]) -> None:
        """Builds the stages, or raises and leaves the pipeline unbuilt (the next step tries again)."""
        sizes = _check_sizes(sizes, len(self.layers), self.num_stages)
        modules = split_layers(self.layers, sizes)
        names, tied = stage_store_names(self._store_names, modules)
        for s in range(len(modules)):
            stage_range(self.store, s, owned_names(names[s], s, tied))
        stages = [[_Stage(s, r, self.devices[s * self.replicas + r], module, self.store, names[s], set(tied),
                          self.rngs[s * self.replicas + r], self.engine.random_modules)
                   for r in range(self.replicas)] for s, module in enumerate(modules)]
        self.sizes, self.tied, self.stages = sizes, tied, stages
        # one per stage: each on one device (Note [Buffer copies kept from step to step] in workers.py)
        self._kept_buffers = [KeptBufferCopies.of_modules([stage.module]) for row in stages for stage in row]

    # ---- one step ----

    def step(self, batch) -> dict:
        """One pipelined step on ``(inputs, targets)``: every replica's shard in M micro-batches, then one update."""
        engine = self.engine
        start = time.perf_counter()
        inputs, targets, shard_sizes = self._split(batch)
        if self.sizes is None:  # Note [Timing the layers on stage 0's device]
            device = self.devices[0]
            with self._autocast(device):
                times = measure_layer_times([layer for _, layer in self.layers], inputs[0][0], device=device)
            self._build(partition(times, self.num_stages))
        built = time.perf_counter()  # the copy back's window starts here: not the first step's layer timing
        buffers = self._save_buffers()  # Note [Stopping a failed pipeline]: restored if the step fails
        self._keep_for_readers(buffers)
        stop, failures, futures = threading.Event(), [], {}
        try:
            for stage in (st for row in self.stages for st in row):
                stage.pull()
            pulled = time.perf_counter()
            scale = engine.loss_scale_now()  # Note [Loss scaling]: the last stages scale their losses by it
            channels = [[(_Channel(stop), _Channel(stop)) for _ in range(self.num_stages - 1)]
                        for _ in range(self.replicas)]
            for stage in (st for row in self.stages for st in row):
                if stage.stream is not None:  # Note [CUDA ordering between stages]: after the caller's work
                    stage.stream.wait_stream(torch.cuda.current_stream(stage.device))
            for s, row in enumerate(self.stages):
                for r, stage in enumerate(row):
                    task = self._stage_task(stage, channels[r], inputs[r], targets[r], shard_sizes[r], scale, stop,
                                            failures)
                    futures[(s, r)] = self._pool.submit(task)
            concurrent.futures.wait(futures.values())
            if failures:
                (s, r), exc = failures[0]
                failures.clear()  # the stage task's frame, which its exception's traceback holds, holds the list:
                raise StageError(s, r, self.stages[s][r].device, exc) from exc  # a cycle through the engine
            results = {key: f.result() for key, f in futures.items()}
            self._sum_tied_grads(results)
        except BaseException:
            # also when raised between two submits (the pool shut by close(), Ctrl-C): the stages already running
            # would wait on their channels for ever
            stop.set()
            concurrent.futures.wait(futures.values())
            self._restore_buffers(buffers)
            raise
        schedule_end = max(res["end"] for res in results.values())
        engine.begin_update()  # Note [A step's update under the mutex]
        total = sum(shard_sizes)
        weights = None if len(set(shard_sizes)) == 1 else [n / total for n in shard_sizes]
        updated = time.perf_counter()
        with engine.phase("update"):
            applied = engine.apply_update(list(range(self.replicas)), weights, loss_scale=scale)
        end = time.perf_counter()
        return self._metrics(results, shard_sizes, start, built, pulled, schedule_end, updated, end, applied, scale)

    def _keep_for_readers(self, saved) -> None:
        """The copies of the buffers' source replica, in the engine's order, for readers of the state while the
        stages compute (Note [Reading the state during a step] in engine.py)."""
        engine = self.engine
        if engine._in_flight is None or not engine.buffer_names:
            return
        copies = {id(buffer): copy_ for _, _, buffer, copy_ in saved}
        live = engine._replica_buffers(engine.buffer_source)
        kept = [copies.get(id(live.get(name))) for name in engine.buffer_names]
        if all(k is not None for k in kept):
            engine._in_flight = engine._in_flight._replace(buffers=kept)

    def _save_buffers(self) -> list[tuple]:
        """The buffers of every stage and their copies (Note [Stopping a failed pipeline]; Note [Buffer copies kept
        from step to step] in workers.py). On CUDA the copies are made on the device's current stream, which every
        stage's stream waits for before the step."""
        return [held for kept in self._kept_buffers for held in kept.take()]

    @torch.no_grad()
    def _restore_buffers(self, saved) -> None:
        """Every buffer back to its copy from :meth:`_save_buffers`, in place (references to it stay valid), after
        the stages' streams finished what the failed step left on them."""
        for stage in (st for row in self.stages for st in row):
            if stage.stream is not None:
                stage.stream.synchronize()
        put_back_saved(saved)

    def _sum_tied_grads(self, results) -> None:
        """Each tied parameter's gradient in replica r's slot: the sum of its stages' contributions, in stage order
        (Note [Parameters tied across stages])."""
        for r in range(self.replicas):
            slot = self.store.views(self.store.grad_slot(r))
            for name, held in self.tied.items():
                parts = [g for g in (results[(s, r)]["tied_grads"][name] for s in held) if g is not None]
                if not parts and self.unused == "error":
                    raise RuntimeError(f"tied parameter {name!r} (stages {held}) received no gradient; pass "
                                       "unused='zero' or freeze it")
                total = parts[0] if parts else torch.zeros_like(slot[name], dtype=torch.float32)
                for g in parts[1:]:
                    total = total + g
                slot[name].copy_(total)

    def _autocast(self, device: torch.device):
        return autocast_region(device, self.autocast)  # Note [Autocast without its cast cache] (pyengine.workers)

    def _split(self, batch):
        check_pair(batch)
        n = batch_size(batch)
        per_replica = n // self.replicas
        if per_replica < self.microbatches:
            raise ValueError(f"a batch of {n} samples gives shards of {per_replica} over {self.replicas} replica(s); "
                             f"each shard must hold at least microbatches={self.microbatches} samples")
        shards = split_batch(batch, self.replicas)
        micro = [split_batch(shard, self.microbatches) for shard in shards]
        inputs = [[mb[0] for mb in replica] for replica in micro]
        # (targets, samples, the batch's type) of each micro-batch: targets may be None (a loss_fn that needs none);
        # loss_fn gets (activations, targets) of the batch's type (batch_like)
        targets = [[(mb[1], batch_size(mb), type(batch)) for mb in replica] for replica in micro]
        return inputs, targets, [batch_size(s) for s in shards]

    def _stage_task(self, stage: _Stage, channels, inputs, targets, shard_size, scale, stop, failures):
        def run():
            try:
                with stage.context():
                    return self._run_stage(stage, channels, inputs, targets, shard_size, scale)
            except _Stopped:
                return None
            except BaseException as exc:  # noqa: BLE001 - reported as StageError by step()
                failures.append(((stage.index, stage.replica), exc))
                stop.set()
                return None
        return run

    def _run_stage(self, stage: _Stage, channels, inputs, targets, shard_size, scale: float | None) -> dict:
        s, last = stage.index, stage.index == self.num_stages - 1
        recv_fwd = channels[s - 1][0] if s > 0 else None
        send_fwd = channels[s][0] if not last else None
        recv_bwd = channels[s][1] if not last else None
        send_bwd = channels[s - 1][1] if s > 0 else None
        upstream = self.stages[s - 1][stage.replica].device if s > 0 else None
        downstream = self.stages[s + 1][stage.replica].device if not last else None
        clock, memory = _BusyClock(stage.stream), _Activations(stage.param_ptrs)
        who, tid = f"stage{s}.r{stage.replica}", 1 + s * self.replicas + stage.replica
        stored, losses = {}, []  # the last stage's (loss, samples): read once the schedule is done, no sync inside
        stage.module.zero_grad(set_to_none=True)
        for kind, m in schedule_actions(self.schedule, s, self.num_stages, self.microbatches):
            if kind == "F":
                x = to_device(inputs[m], stage.device) if s == 0 else recv_fwd.get(m, stage.stream)
                with clock.measure(), self.engine.recorder.phase(who, f"F{m}", tid):
                    given = x
                    if s > 0:
                        # Note [A stage's input is its own]: x is the leaf whose .grad goes upstream; the stage gets
                        # a copy, so an in-place first layer (ReLU(inplace=True)) neither modifies a leaf (an error)
                        # nor the upstream stage's output, which may share x's storage (same device)
                        x = x.detach().requires_grad_(x.is_floating_point())
                        given = x.clone() if x.requires_grad else x
                    with memory.hooks():
                        out = self._forward(stage, given, last, targets[m])
                    if last:
                        samples = targets[m][1]
                        losses.append((out.detach(), samples))
                        out = out * (samples / shard_size)
                        if scale is not None:  # Note [Loss scaling]
                            out = out * scale
                    else:
                        send_fwd.put(m, out.detach(), downstream, stage.stream)
                stored[m] = (x, out, memory.stored())
            else:
                x, out, nbytes = stored.pop(m)
                grad = None if last else recv_bwd.get(m, stage.stream)
                with clock.measure(), self.engine.recorder.phase(who, f"B{m}", tid):
                    if out.requires_grad:
                        torch.autograd.backward(out, grad)
                    if s > 0:
                        send_bwd.put(m, x.grad if x.grad is not None else torch.zeros_like(x), upstream,
                                     stage.stream)
                memory.released(nbytes)
        busy = clock.total()  # on CUDA it waits for the stage's stream: the schedule ends when the device is done
        end = time.perf_counter()
        loss_sum = 0.0
        for loss, samples in losses:
            loss_sum += float(loss) * samples
        tied_grads = stage.push_grads(self.unused)
        return dict(busy=busy, end=end, pushed=time.perf_counter() - end, loss_sum=loss_sum,
                    peak_count=memory.peak_count, peak_bytes=memory.peak_bytes, tied_grads=tied_grads)

    def _forward(self, stage: _Stage, x, last: bool, targets):
        with self._autocast(stage.device):
            return self._forward_checked(stage, x, last, targets)

    def _forward_checked(self, stage: _Stage, x, last: bool, targets):
        if not last:
            out = stage.module(x)
            if not isinstance(out, torch.Tensor) or not out.is_floating_point():
                got = f"a {out.dtype} tensor" if isinstance(out, torch.Tensor) else type(out).__name__
                raise TypeError(f"a stage before the last must return one floating-point tensor (the activations "
                                f"for the next stage); got {got}")
            return out
        y, _, kind = targets
        return checked_loss(self.engine.loss_fn(stage.module, batch_like(kind, x, to_device(y, stage.device))))

    def _metrics(self, results, shard_sizes, start, built, pulled, schedule_end, updated, end, applied,
                 scale) -> dict:
        S, R, M = self.num_stages, self.replicas, self.microbatches
        wall = schedule_end - pulled
        busy = [[results[(s, r)]["busy"] for r in range(R)] for s in range(S)]
        total = sum(shard_sizes)
        loss = sum(results[(S - 1, r)]["loss_sum"] for r in range(R))
        return step_metrics(
            self.engine, loss=loss / total, samples=total, wall=end - start,
            compute=max(max(row) for row in busy), update=end - updated,
            transfer_wait=max(res["pushed"] for res in results.values()), copy_back=pulled - built, applied=applied,
            loss_scale=scale,
            stages=S, replicas=R, microbatches=M, schedule=self.schedule, stage_sizes=list(self.sizes),
            schedule_s=wall, stage_busy_s=[sum(row) / R for row in busy],
            bubble_fraction=max(0.0, 1.0 - sum(map(sum, busy)) / (S * R * wall)) if wall > 0 else 0.0,
            bubble_ideal=(S - 1) / (M + S - 1),
            activation_peak=[max(results[(s, r)]["peak_count"] for r in range(R)) for s in range(S)],
            activation_peak_bytes=[max(results[(s, r)]["peak_bytes"] for r in range(R)) for s in range(S)])

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def check_options(layers: int, devices: int, stages, microbatches, schedule, balance) -> None:
    """ValueErrors for pipeline options, before anything is built."""
    if not _is_int(stages) or stages < 1:
        raise ValueError(f"stages must be an int >= 1; got {stages!r}")
    if stages > layers:
        raise ValueError(f"stages={stages} is more than the model's {layers} layers; each stage needs at least one")
    if devices % stages:
        raise ValueError(f"devices must hold stages x replicas entries (stage s, replica r on devices[s * R + r]); "
                         f"got {devices} devices for stages={stages}")
    if not _is_int(microbatches) or microbatches < 1:
        raise ValueError(f"microbatches must be an int >= 1; got {microbatches!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}; got {schedule!r}")
    if balance not in ("params", "time"):
        _check_sizes(balance, layers, stages)


def check_pair(batch) -> None:
    """Refuses a pipeline batch that is not a pair ``(inputs, targets)`` (a tuple or a list of two), naming what it
    is: one check for the stages in one process and across processes."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        got = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) else \
            type(batch).__name__
        raise ValueError("mode='pipeline' needs each batch as (inputs, targets): inputs feed the first stage, "
                         "targets go with the last stage's output to loss_fn(last_stage, (activations, "
                         f"targets)); got {got}")


def batch_like(kind: type, activations, targets):
    """``(activations, targets)`` for the last stage's ``loss_fn``, of the batch's type ``kind``: a namedtuple (as
    hybrid's loss_fn gets it: ``b.targets`` works in every mode), a list or a tuple."""
    if issubclass(kind, tuple) and hasattr(kind, "_fields"):
        return kind(activations, targets)
    return [activations, targets] if issubclass(kind, list) else (activations, targets)


def checked_loss(loss):
    """The last stage's ``loss_fn`` result, checked: a scalar tensor that requires grad (a detached one skipped its
    backward, and the step applied weight decay alone)."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError("loss_fn(last_stage, (activations, targets)) must return a scalar tensor (the mean "
                         f"loss over the micro-batch); got {shape}")
    if not loss.requires_grad:
        raise RuntimeError("loss_fn(last_stage, (activations, targets)) returned a loss that does not require "
                           "grad (detached, or computed under torch.no_grad()): there is no gradient to train on")
    return loss


def check_mode_options(mode: str, stages, microbatches, schedule, balance) -> None:
    """Pipeline options belong to ``mode="pipeline"``; ``microbatches`` also to hybrid and sync (gradient
    accumulation within a step), not to async (whose workers accumulate mini-batches: ``accumulate``)."""
    if mode != "pipeline":
        given = [name for name, value, default in (("stages", stages, None), ("schedule", schedule, "1f1b"),
                                                   ("balance", balance, "params")) if value != default]
        if given:
            raise ValueError(f"{', '.join(given)}: pipeline options, for mode='pipeline'; mode={mode!r}")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be an int >= 1; got {microbatches!r}")
        if mode == "async" and microbatches != 1:
            raise ValueError("microbatches: an option of the hybrid, sync and pipeline steps; async workers sum "
                             "mini-batches before a push with accumulate=k")
