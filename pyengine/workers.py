"""Workers: one replica of the model per worker, on its device, with its gradient streamer.

A worker computes forward and backward on its shard; the streamer's hooks copy each bucket of gradients into the
worker's slot of the host store while backward goes on. ``pull`` copies the master weights back into the replica.
Worker threads call :func:`set_worker_threads` once, so CPU workers divide the intra-op threads among themselves
(oversubscription is the first thing that kills CPU throughput on small machines).
"""
from __future__ import annotations

import contextlib
import copy
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from . import _C
from .store import overlaps_itself
from .streamer import GradientStreamer

__all__ = ["Worker", "WorkerError", "deferred_interrupt", "parse_devices", "split_batch", "batch_size", "to_device"]


class WorkerError(RuntimeError):
    """A worker raised; ``worker`` is its index. The original exception is ``__cause__`` (with its traceback)."""

    def __init__(self, worker: int, device, cause: BaseException):
        super().__init__(f"worker {worker} ({device}) failed: {type(cause).__name__}: {cause}")
        self.worker = worker

    def __reduce__(self):
        # Pickled (a process pool's result, a sweep's queue) as its message and attributes: the default rebuilds it
        # from ``args`` (the message alone), which this __init__ refuses, so the unpickling side lost the error (a
        # pool's result thread died, and its caller waited for ever). Like any exception, ``__cause__`` stays behind.
        return _rebuild_error, (type(self), self.args, self.__dict__)


def _rebuild_error(cls, args, attributes):
    """The unpickled form of a :class:`WorkerError` (or subclass): its message, args and attributes as pickled."""
    error = Exception.__new__(cls)
    error.args = args
    error.__dict__.update(attributes)
    return error


def parse_devices(devices) -> list[torch.device]:
    """``["cuda:0", "cuda:0", "cpu"]`` -> devices, checked; default: every visible GPU, else 2 CPU workers."""
    if devices is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")] * 2
    if isinstance(devices, (str, bytes, torch.device)) or not isinstance(devices, Sequence) or not devices:
        raise ValueError(f"devices must be a non-empty list like ['cpu', 'cpu'] or ['cuda:0']; got {devices!r}")
    parsed = []
    for d in devices:
        try:
            device = torch.device(d)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"devices: {d!r} is not a device ({exc})") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"devices: {d!r} asks for CUDA but no CUDA device is usable here")
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index >= torch.cuda.device_count():
                raise ValueError(f"devices: {d!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
            device = torch.device("cuda", index)
        elif device.type != "cpu":
            raise ValueError(f"devices: {d!r} is neither 'cpu' nor 'cuda:i'")
        parsed.append(device)
    return parsed


def batch_size(batch) -> int:
    """Size of dim 0, the same for every tensor of a tensor / tuple / list / dict batch. Every leaf of the batch
    is a tensor (or None): anything else (a number, a string, a numpy array, a list of labels) would reach every
    worker whole instead of being split with the tensors, so a loss that reads it saw all the samples' values
    with G > 1 workers and its own shard's with one (ValueError naming it). Sparse tensors are refused too (hybrid
    failed in torch.tensor_split, where sync and async took them).

    Note [A batch that requires grad]
    A batch tensor that requires grad (an input for adversarial training, one made under autograd, or a leaf made
    to require grad for a reentrant activation checkpoint) was split into views still attached to the caller's
    graph: each worker's backward sent its own shard's mean-loss gradient into it (hybrid with 2 workers: twice
    torch's; 3 workers on 7 samples 2.33x and 3.5x by shard; an fp16 loss scale of 65536 never divided out), and a
    tensor with a history (``sigmoid(leaf)``) failed the second shard's backward ("Trying to backward through the
    graph a second time"). Only the parameters' gradients are the engine's: in every mode of one process loss_fn
    (or a pipeline's first stage) gets each such tensor as a leaf of its own that requires grad (the same memory;
    :func:`_own_counter`, :func:`to_device`; a pipeline across processes hands its inputs to
    torch.distributed.pipelining as they are, not covered here), cut
    from the caller's graph, so a reentrant checkpoint still sees an input that requires grad, nothing is run
    backward twice, and the caller's tensor gets no ``.grad`` (a gradient with respect to the input is loss_fn's to
    take: ``torch.autograd.grad(loss, x, retain_graph=True)``)."""
    other = _first_other_leaf(batch, "batch")
    if other is not None:
        where, value = other
        kind = type(value).__qualname__ if type(value).__module__ == "builtins" else \
            f"{type(value).__module__}.{type(value).__qualname__}"
        raise ValueError(f"{where} is a {kind}, not a tensor: every "
                         "value of a batch is a tensor split along dim 0 among the workers (anything else would "
                         "reach each worker whole); make it a tensor (torch.as_tensor) or keep it out of the batch "
                         "(in the loss_fn's closure)")
    named = _named_tensors(batch, "batch")
    if not named:
        raise ValueError("a batch must contain at least one tensor")
    for where, t in named:
        if t.dim() == 0:
            raise ValueError(f"{where} is a 0-dim tensor: every tensor of a batch is split along dim 0 among the "
                             "workers (give it a batch dimension, or keep it out of the batch)")
        if t.layout != torch.strided:
            raise ValueError(f"{where} is a {t.layout} tensor: a batch is split along dim 0 into views, which only "
                             "dense (strided) tensors have; make it dense (tensor.to_dense()) or keep it out of the "
                             "batch")
    sizes = {t.shape[0] for _, t in named}
    if len(sizes) != 1:
        first = named[0]
        other = next((w, t) for w, t in named if t.shape[0] != first[1].shape[0])
        raise ValueError(f"every tensor of a batch must have the same size along dim 0; {first[0]} has "
                         f"{first[1].shape[0]}, {other[0]} has {other[1].shape[0]}")
    return sizes.pop()


def split_batch(batch, parts: int) -> list:
    """Splits a batch on dim 0 into ``parts`` shards whose sizes differ by at most one."""
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:  # 0 gave no shards at all
        raise ValueError(f"split_batch: parts must be an integer >= 1; got {parts!r}")
    n = batch_size(batch)
    if n < parts:
        raise ValueError(f"a batch of {n} samples cannot feed {parts} workers; use a batch of at least {parts}")
    return [_map(batch, lambda t, i=i: _own_counter(torch.tensor_split(t, parts)[i])) for i in range(parts)]


def _own_counter(shard: torch.Tensor) -> torch.Tensor:
    """Note [A shard's own version counter]
    torch.tensor_split gives views, and every view of a tensor shares its autograd version counter. An in-place
    first layer (``ReLU(inplace=True)``) of one worker (or of one pipeline micro-batch) bumped the counter that
    another worker's saved input carried, and that backward failed ("modified by an inplace operation"; hybrid with
    2 CPU workers, the pipeline's stage 0 with 2 micro-batches), though the shards share no element. Each shard gets
    a counter of its own: ``.data``, the same memory (no copy) under a new counter; one that required grad is a new
    leaf that requires grad (Note [A batch that requires grad])."""
    own = shard.data
    return own.requires_grad_() if shard.requires_grad else own


def split_microbatches(batch, parts: int, what: str = "a batch", hint: str = "") -> tuple[list, list[float] | None]:
    """``batch`` (``what``, for the error, followed by ``hint``) as ``parts`` micro-batches and the weight of each
    one's mean loss in the batch's mean (its share of the samples; None for one part, whose loss is the batch's
    own)."""
    if parts == 1:
        return [batch], None
    n = batch_size(batch)
    if n < parts:
        raise ValueError(f"{what} of {n} samples cannot be split into microbatches={parts}; use at least {parts} "
                         f"samples there{hint}")
    chunks = split_batch(batch, parts)
    return chunks, [batch_size(c) / n for c in chunks]


def autocast(device: torch.device, dtype: torch.dtype | None):
    """The engine's autocast region: ``torch.autocast`` to ``dtype`` (none when None), without its cast cache.

    Note [Autocast without its cast cache]
    torch's autocast keeps the low-precision casts of leaf tensors (the weights) in one map for the whole process,
    and empties it whenever any thread leaves its outermost autocast region. Workers (and pipeline stages) run their
    forwards concurrently on threads, so one worker's end emptied the map under another's forward: a weight used
    twice in that forward was cast once or twice depending on timing, and its two uses' gradients were summed in
    low precision (one cast) or in float32 (two): the same seed and data gave different weights from run to run
    (tested: bfloat16, a layer applied twice, hybrid and pipeline). Without the cache every use casts its weight:
    the same work each time, the gradients always summed in float32, and the cost one more cast per reuse."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None, cache_enabled=False)


def to_device(batch, device: torch.device):
    """``batch`` on ``device``; a tensor that requires grad as a leaf of its own (Note [A batch that requires
    grad]: a copy to the device would carry the caller's graph back to its tensor)."""
    return _map(batch, lambda t: _own_leaf(t.to(device, non_blocking=True)))


def _own_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_() if t.requires_grad else t


def _named_tensors(batch, where: str) -> list[tuple[str, torch.Tensor]]:
    """(where, tensor) for every tensor of a batch, ``where`` as an expression: batch[0], batch['x'][1]..."""
    if isinstance(batch, torch.Tensor):
        return [(where, batch)]
    if isinstance(batch, Mapping):
        return [item for k, v in batch.items() for item in _named_tensors(v, f"{where}[{k!r}]")]
    if isinstance(batch, (tuple, list)):
        return [item for i, v in enumerate(batch) for item in _named_tensors(v, f"{where}[{i}]")]
    return []


def _first_other_leaf(batch, where: str):
    """(where, value) of the first leaf of ``batch`` that is neither a tensor nor None, else None."""
    if isinstance(batch, torch.Tensor) or batch is None:
        return None
    if isinstance(batch, Mapping):
        items = ((f"{where}[{k!r}]", v) for k, v in batch.items())
    elif isinstance(batch, (tuple, list)):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(batch))
    else:
        return where, batch
    return next((found for w, v in items if (found := _first_other_leaf(v, w)) is not None), None)


def _tensors(batch) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (tuple, list)):
        return [t for v in batch for t in _tensors(v)]
    return []


def _map(batch, fn):
    """``batch`` with ``fn`` applied to each tensor in it, containers rebuilt as their own type where that type can
    be rebuilt from its items (a namedtuple from its fields, as default_collate does; a mapping whose constructor
    takes no plain dict, such as defaultdict, becomes a dict)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        mapped = {k: _map(v, fn) for k, v in batch.items()}
        try:
            return type(batch)(mapped)
        except TypeError:
            return mapped
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_map(v, fn) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_map(v, fn) for v in batch)
    return batch


def set_worker_threads(devices: list[torch.device], threads: int) -> None:
    """Intra-op threads of the calling worker thread: ``threads``, the intra-op threads of the thread that built the
    engine (``torch.get_num_threads()``, which honours OMP_NUM_THREADS, ``torch.set_num_threads`` and the CPUs the
    process may run on), divided among the CPU workers. Not ``os.cpu_count()``: a process pinned to 4 of a
    machine's 64 CPUs gave each of 2 workers 32 threads, and so did each of 8 processes of a node under torchrun
    (which sets OMP_NUM_THREADS=1 in each, unless given, for that reason).

    Note [Worker threads' count]
    ``torch.set_num_threads`` sets the calling thread's OpenMP count and also the count every thread started later
    begins with (ATen keeps the last value set on any thread). So after an engine's workers set theirs, a thread the
    user starts would run with the workers' share of the cores; :meth:`Engine.close` sets the count the constructing
    thread had back, and so does an engine collected without close() (a finalizer; tested: tests/test_engine.py)."""
    cpu_workers = sum(d.type == "cpu" for d in devices)
    if cpu_workers:
        torch.set_num_threads(max(1, threads // cpu_workers))


def task_thread_initializer(threads: set, devices: list[torch.device], intra_op_threads: int) -> None:
    """Initializer of an engine's worker and stage pool threads: records the thread in ``threads`` (so
    :meth:`Engine.close` knows a call from inside one of its steps) and sets its intra-op threads
    (:func:`set_worker_threads`)."""
    threads.add(threading.get_ident())
    set_worker_threads(devices, intra_op_threads)


# Host work over fewer elements than this runs on one thread beside CPU workers (Note [Host threads beside CPU
# workers]): below it the update's second thread saves less than its spin-wait costs the next forward.
HOST_PARALLEL_MIN_NUMEL = 1 << 23


@contextlib.contextmanager
def host_threads(devices: list[torch.device], numel: int | None = None, inline_worker: bool = False):
    """Within: with CPU workers among ``devices``, pyengine's CPU ops on the calling (host) thread run on that thread
    alone while the workers compute (``numel`` None) or for host-only work over fewer than
    ``HOST_PARALLEL_MIN_NUMEL`` elements; otherwise, without CPU workers, and when the lone CPU worker runs on the
    calling thread itself (``inline_worker``), they use every intra-op thread.

    Note [Host threads beside CPU workers]
    CPU workers already hold every core (:func:`set_worker_threads`). Host work overlapped with their backward (the
    per-bucket norm) on the host thread's own OpenMP team takes cores from them, and, worse, libgomp's team threads
    spin-wait after each parallel region (OMP_WAIT_POLICY unset: milliseconds), burning the workers' cores while they
    compute. So while workers run the host's ops stay on its own thread, and the update (workers idle) uses every
    core only when it is large enough to repay the spin that follows it into the next step's forward.
    This is a per-thread switch inside pyengine's ops (``_C._set_serial_on_this_thread``), not
    ``torch.set_num_threads``: toggling that on the host thread every step made a G=1 worker's backward up to
    1.6x slower (it is not a purely thread-local knob; which process-wide state it disturbs was not pinned down).
    A lone CPU worker runs on the host thread (Note [One CPU worker runs on the calling thread] in engine.py): its
    team is the host's own, nothing computes beside the host's ops, and the team that spins after them is the one the
    next forward uses; there the ops keep every thread (a 1.3M-parameter MLP's hybrid step: 1.16x faster).
    Measured on 2 vCPUs in bench/RESULTS.md.
    """
    if (inline_worker or not any(d.type == "cpu" for d in devices)
            or (numel is not None and numel >= HOST_PARALLEL_MIN_NUMEL)):
        yield
        return
    previous = _C._set_serial_on_this_thread(True)
    try:
        yield
    finally:
        _C._set_serial_on_this_thread(previous)


@contextlib.contextmanager
def deferred_interrupt(what: str, on_escape=None):
    """Within: the first Ctrl-C (SIGINT) is recorded, not raised; KeyboardInterrupt is raised when the block ends.

    Note [Ctrl-C inside a step]
    Python raises KeyboardInterrupt on the main thread between any two bytecodes. Inside a step that can leave the
    engine half done: worker tasks still running on the pool, gradient buckets launched and never released (the
    next step would read them as its own), the store updated in some buckets and not others with ``version``
    already advanced. So while a step (or an async push) runs on the main thread, the first Ctrl-C only asks: the
    step completes, then KeyboardInterrupt is raised with the engine consistent. A second Ctrl-C in the same step
    raises at once (the way out of a step that hangs) and calls ``on_escape``: the engine is then unusable (its
    next call says so). Nothing changes when the block runs on another thread (signals reach the main thread only)
    or when the program has its own SIGINT handler (the CLI's saves a checkpoint and stops cleanly).
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pressed = []

    def handler(signum, frame):
        pressed.append(signum)
        if len(pressed) > 1:
            if on_escape is not None:
                on_escape()
            raise KeyboardInterrupt(f"second Ctrl-C: {what} abandoned")

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:  # a handler the block installed (a callback's, say) stays
        if signal.getsignal(signal.SIGINT) is handler:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt(f"Ctrl-C during {what}: it completed first")


def check_weights_unchanged(changed: list[str], where: str) -> None:
    """Note [Weights changed in place by a step]
    The master weights live in the host store, and every step's copy back (a pipeline stage's pull) overwrites a
    replica's trainable parameters from it. A forward that writes a weight in place, outside autograd, would see its
    change dropped without a word: ``nn.Embedding(max_norm=...)`` renormalises the rows it looks up (torch keeps
    that in the parameter; measured here, the engine's rows drifted to norm 2.5 where torch's stay at 1, every
    mode), as would any ``weight.clamp_()`` under ``torch.no_grad()`` in a forward or loss_fn. So each replica's
    parameters' version counters are taken when the weights are written into them, and a step whose forward or
    backward bumped one fails before its update with this ValueError (the step is dropped as a worker's failure
    is: nothing counts). The next step's copy back puts the store's weights back (hybrid and sync: at the failed
    step's reset; async: its next pull; the pipeline pulls every step). A write through ``.data`` has a version
    counter of its own and is not seen. Cost: one ``_version`` read per parameter per step."""
    if changed:
        raise ValueError(f"{where}: the step wrote the trainable parameter(s) {_shown(changed)} in place "
                         "(nn.Embedding with max_norm renormalises the rows it looks up; an in-place op on a weight "
                         "under torch.no_grad()). The master weights live in the host store and each step copies "
                         "them over the replicas, so such a change would be lost: not supported (make it a function "
                         "of the weight inside the forward, or keep that state in a buffer)")


def _shown(names: list[str]) -> str:
    """The first names of a list for an error, and how many more."""
    return ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def replace_buffer(roots, old: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Every module under ``roots`` (modules) that holds buffer ``old`` holds one copy of ``value``, on ``old``'s
    device, instead (a whole tensor: an expanded ``value`` is copied out); returns that copy."""
    new = value.detach().to(old.device, copy=True)
    for root in roots:
        for module in root.modules():
            for key, buffer in module._buffers.items():
                if buffer is old:
                    module._buffers[key] = new
    return new


class KeptBufferCopies:
    """Note [Buffer copies kept from step to step]
    A step that does not count puts the buffers back as they were before it (Note [A failed step leaves the buffers
    alone] in engine.py, Note [Stopping a failed pipeline] in pipeline.py, Note [A step refused on every rank] in
    distributed.py), so each such step takes copies of them first. Fresh clones every step, found by walking the
    model (``named_buffers()``, ``modules()``), cost ~2.3 us a buffer on the 2-vCPU VM (a stage of 40 BatchNorm
    layers: 1.6 % of its forward+backward); here the buffers are looked up in fixed ``(module, key)`` slots (a module
    may assign a new tensor: looked up every step) and written with one multi-tensor copy into copies kept from
    step to step; only when a slot holds another tensor or shape than at the last :meth:`take` (or a tensor where it
    held None, a cache made by the first forward) are they cloned anew (bench/RESULTS.md). A copy is rewritten by
    the next take: who keeps one past its step (a reader of the state during the step, Note [Reading the state
    during a step] in engine.py) must be done with it by then (those readers run under the engine's mutex, which
    the step takes for its update, before the next step's take)."""

    def __init__(self, slots):
        self.slots = list(slots)
        self._held_ids, self._shapes, self._copies, self._one_device = None, None, [], True

    @classmethod
    def of_modules(cls, roots) -> "KeptBufferCopies":
        """The slots of every buffer key of ``roots`` and their submodules (None ones too: a cache that a forward
        makes later is taken from then on)."""
        return cls([(module, key) for root in roots for module in root.modules() for key in module._buffers])

    @torch.no_grad()
    def take(self) -> list[tuple]:
        """``(module, key, buffer, copy)`` for every slot that holds a tensor now (what :func:`put_back_saved` puts
        back); the copies are this object's, rewritten at the next take."""
        held = [(module, key, buffer) for module, key in self.slots
                if (buffer := module._buffers.get(key)) is not None]
        ids, shapes = [id(b) for *_, b in held], [b.shape for *_, b in held]
        if ids != self._held_ids or shapes != self._shapes:  # a buffer resized in place: its shape
            self._copies = [b.detach().clone() for *_, b in held]
            self._held_ids, self._shapes = ids, shapes
            self._one_device = len({b.device for *_, b in held}) <= 1
        elif self._one_device:
            if held:
                torch._foreach_copy_(self._copies, [b for *_, b in held])
        else:  # a pipeline's stages on several devices
            for copy_, (*_, buffer) in zip(self._copies, held):
                copy_.copy_(buffer)
        return [(module, key, buffer, copy_) for (module, key, buffer), copy_ in zip(held, self._copies)]


def put_back_saved(saved: list[tuple]) -> None:
    """Every buffer of :meth:`KeptBufferCopies.take` back to its copy, in place (references to it stay valid)."""
    put_back_buffers([(module, key, buffer) for module, key, buffer, _ in saved], [c for *_, c in saved])


@torch.no_grad()
def put_back_buffers(held, copies) -> None:
    """Each ``(module, key, buffer)`` of ``held`` holds ``buffer`` again, with the values of its copy in ``copies``
    (Note [A failed step leaves the buffers alone] in engine.py): a forward that assigned a new tensor gets the old
    one back, one that resized it in place its shape back (a log that grows), and one that overlaps itself (an
    expanded view) is left as it is (no forward wrote into it; copy_ cannot), so that such a buffer raises nothing
    here, while a failed step's error is on its way (a storage that cannot grow back still does)."""
    targets, sources = [], []
    for (module, key, buffer), copy_ in zip(held, copies):
        module._buffers[key] = buffer
        if overlaps_itself(buffer):
            continue
        if buffer.shape != copy_.shape:
            buffer.resize_(copy_.shape)
        targets.append(buffer)
        sources.append(copy_)
    if len({t.device for t in targets}) == 1:
        torch._foreach_copy_(targets, sources)
    else:  # a pipeline's stages on several devices (none: nothing to copy)
        for target, source in zip(targets, sources):
            target.copy_(source)


def whole_buffers(root: torch.nn.Module, tensors: list) -> list:
    """``tensors`` (buffers of ``root``) ready to receive values in place: each that overlaps itself (a forward that
    assigned an expanded view) is first replaced under ``root`` by a whole copy, which the list then holds."""
    return [replace_buffer([root], t, t) if overlaps_itself(t) else t for t in tensors]


def replica_of(model: torch.nn.Module, device: torch.device | None = None) -> torch.nn.Module:
    """A deep copy of ``model`` on ``device`` (None: where it is), with the gradient hooks of its parameters.

    Note [Replicas keep the parameters' hooks]
    A worker's replica (a pipeline stage's copy) is ``copy.deepcopy`` of the model, and a deep-copied parameter is
    a new tensor without the hooks registered on the original (``register_hook``, ``register_post_accumulate_grad_
    hook``): a hook that masks, clips or zeroes a gradient was dropped without a word, and the engine trained what
    it was there to hold back. So the hooks each parameter has when the engine is built are registered on its copy,
    in their order, before the gradient streamer's own (a post-accumulate hook that changes ``.grad`` runs before
    the copy of it). The module hooks (forward, backward) live in the modules' dicts and come with the deep copy;
    a hook added to the model's parameters later reaches no replica.

    A buffer that overlaps itself (registered expanded: ``torch.ones(1, n).expand(m, n)``) is made whole in the
    replica (one copy, held by every module that held it): the engine writes into the replicas' buffers (shared
    from the source replica, received from rank 0, loaded from a state), which copy_ cannot do into such a view
    (Note [Buffers that are not saved] in engine.py)."""
    replica = copy.deepcopy(model)
    if device is not None:
        replica = replica.to(device)
    for module in replica.modules():
        for buffer in list(module._buffers.values()):
            if buffer is not None and overlaps_itself(buffer):
                replace_buffer([replica], buffer, buffer)
    for original, copied in zip(model.parameters(), replica.parameters(), strict=True):
        if not copied.requires_grad:
            continue
        for hook in (original._backward_hooks or {}).values():
            copied.register_hook(hook)
        for hook in (getattr(original, "_post_accumulate_grad_hooks", None) or {}).values():
            copied.register_post_accumulate_grad_hook(hook)
    return replica


class Computed(NamedTuple):
    """What :meth:`Worker.compute` returns: the mean loss (weighted mean with weights), seconds of forward+backward,
    seconds waiting for the last gradient copies after backward, and seconds waiting for the previous update's
    weights to arrive before the first forward (the copy back not hidden behind other work; on CUDA the wait is
    the stream's, so ~0 on the host)."""

    loss: float
    compute_s: float
    transfer_wait_s: float
    weights_wait_s: float


class FollowedState:
    """Note [Model state the engine does not follow]
    The engine follows a replica's trainable parameters (the store) and the buffers the model held when the engine
    was built (shared from the schedule's source, put back after a failed step, saved, copied out by copy_to); a
    frozen parameter is a constant: each replica holds its own copy, a state only its digest. Two kinds of state a
    forward may keep escape that, and were lost without a word: a frozen parameter written in place (an EMA
    codebook updated under torch.no_grad()), which stayed on the replica that wrote it (sync with 2 workers: each
    worker's own; a checkpoint's digest, its construction value); and a persistent buffer registered as None that
    the forward sets (``named_buffers()`` skips None), which was nobody's to share, save or copy out (torch's
    state_dict saves it). Either fails the step before its update (a ValueError; the step is dropped as a worker's
    failure is), with the remedy: register such state as a buffer holding a tensor before the engine is built. A
    non-persistent one is a cache (a causal mask or rotary table made at the first forward), which torch does not
    save either: each replica makes its own, as before. Held by a worker (its replica) and by a pipeline stage (its
    layers): :meth:`mark` before the step's forward, :meth:`check` after its backward (which puts such a buffer back
    to None: a frozen parameter written stays written, the engine keeps no copy of it). Cost: one ``_version`` read
    per frozen parameter, twice, and a look per None buffer, a step. A write through ``.data`` is not seen (its own
    version counter)."""

    def __init__(self, module: torch.nn.Module):
        self._frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        self._unset = [(f"{prefix}.{name}" if prefix else name, sub, name) for prefix, sub in module.named_modules()
                       for name, value in sub._buffers.items()
                       if value is None and name not in sub._non_persistent_buffers_set]
        self._versions = [p._version for _, p in self._frozen]

    def mark(self) -> None:
        """The frozen parameters' version counters now, before the step's forward."""
        self._versions = [p._version for _, p in self._frozen]

    def check(self, where: str) -> None:
        """Raises ValueError (naming ``where``) if the step since :meth:`mark` wrote a frozen parameter in place or
        set a persistent buffer registered as None."""
        written = [n for (n, p), v in zip(self._frozen, self._versions) if p._version != v]
        set_later = [n for n, sub, local in self._unset if sub._buffers.get(local) is not None]
        if set_later:  # as the engine was built: nothing of the refused step stays there
            for _, sub, local in self._unset:
                sub._buffers[local] = None
        if written:
            raise ValueError(f"{where}: the step wrote the frozen parameter(s) {_shown(written)} in place (an EMA "
                             "under torch.no_grad(), say). The engine holds frozen parameters as constants (each "
                             "replica its own copy, a checkpoint their digest), so the change would stay on this "
                             "replica and out of every checkpoint: register that state as a buffer "
                             "(module.register_buffer) to have it shared, saved and copied out")
        if set_later:
            raise ValueError(f"{where}: the step set the buffer(s) {_shown(set_later)}, registered as None when the "
                             "engine was built. The engine shares, saves and copies out the buffers the model held "
                             "then (named_buffers() skips None), so this one would stay on this replica and out of "
                             "every checkpoint: register it with its initial tensor before building the engine (a "
                             "cache that each replica may make for itself: register it with persistent=False)")


class Worker:
    """One replica on one device, its streamer and (on CUDA) its compute stream; ``rng`` (a
    :class:`pyengine.rng.WorkerRNG`, for workers that run concurrently) is the replica's own random generator."""

    def __init__(self, index: int, device: torch.device, model: torch.nn.Module, store, *, bucket_mb: float,
                 first_bucket_mb: float, unused: str, autocast_dtype: torch.dtype | None, rng=None,
                 random_modules=(), eager_mb: float | None = 1.0):
        self.index = index
        self.device = device
        self.replica = replica_of(model, device)  # Note [Replicas keep the parameters' hooks]
        self.rng = rng
        if rng is not None:  # Note [Random numbers of concurrent workers] (pyengine/rng.py)
            rng.install(self.replica, random_modules)
        self.streamer = GradientStreamer(self.replica, store, worker=index, bucket_mb=bucket_mb,
                                         first_bucket_mb=first_bucket_mb, unused=unused, eager_mb=eager_mb)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.autocast_dtype = autocast_dtype
        self.followed = FollowedState(self.replica)  # Note [Model state the engine does not follow]
        self.refused: Exception | None = None  # the last compute's, with defer_refusal

    def pull(self, wait: bool = False) -> None:
        """Master weights (fp32, or the store's low-precision shadow) -> replica.

        The replica's next forward waits for the copies by itself. ``wait=True`` also blocks the host until they
        are done, so the store may be written right after (async pulls under the mutex need this).
        """
        self.copy_back()
        if wait:
            self.wait_copies_back()

    def wait_copies_back(self, failed_ok: bool = False) -> None:
        """Blocks the host until every bucket's copy of the store's weights into the replica has completed, so that
        the store's weights may be written after (Note [Pinned buffer busy until its copy's event]). A copy that
        failed raises its error (every wait for it does: Note [A failed copy's error]), unless ``failed_ok``: for a
        caller that copies every bucket again next (a load), for which a failed copy is complete all the same."""
        for k in range(len(self.streamer.buckets)):
            try:
                self.streamer.wait_weights(k)
            except RuntimeError:
                if not failed_ok:
                    raise

    def copy_back(self, buckets: Sequence[int] | None = None) -> None:
        """Starts the copy of the store's weights into the replica (``buckets``: those only; default: all). On CUDA
        the copies start after the work enqueued so far on the replica's compute stream, which reads the weights
        they overwrite, and on the calling thread's current stream (the replica's construction, a state loaded into
        it), whichever thread launches them."""
        if self.stream is None:
            self.streamer.copy_back(buckets=buckets)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.streamer.copy_back(buckets=buckets)

    def forward_backward(self, loss_fn, batch, weight: float | None = None,
                         loss_scale: float | None = None) -> torch.Tensor:
        """One forward and backward on ``batch`` (of the loss times ``weight``, then times ``loss_scale``, when
        given); returns the loss, detached, on the device (reading it would make the host wait for the device: the
        caller reads it after its last micro-batch). Gradients stream to the host as they are ready."""
        batch = to_device(batch, self.device)
        with autocast(self.device, self.autocast_dtype):
            loss = loss_fn(self.replica, batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a scalar tensor (the mean loss over the batch); got {shape}")
        if not loss.requires_grad:  # torch's own error named neither loss_fn nor the cause
            why = "detached, or computed under torch.no_grad()" if loss.is_floating_point() else "not floating point"
            raise ValueError(f"loss_fn returned a loss that does not require grad ({loss.dtype}: {why}): there is no "
                             "gradient to train on; return the mean loss computed from the replica loss_fn is given")
        scaled = loss if weight is None else loss * weight
        scaled = scaled if loss_scale is None else scaled * loss_scale  # Note [Loss scaling]
        with self.streamer.backward_pass(scaled):  # a loss that reaches no parameter must still end the pass
            scaled.backward()
        return loss.detach()

    def compute(self, loss_fn, batches, weights: list[float] | None = None,
                loss_scale: float | None = None, defer_refusal: bool = False) -> "Computed":
        """Forward+backward over ``batches`` (gradients summed in the replica, copied once after the last). With
        ``weights`` each loss is weighted and the returned loss is the weighted sum: micro-batches of one batch
        (:func:`split_microbatches`), so the replica holds the gradient of the whole batch's mean loss, or a
        multi-node async client's shards of several mini-batches, each weighted by its share of its mini-batch;
        without, the plain sum of the gradients and the mean of the losses (async's ``accumulate``). With
        ``loss_scale`` every loss is multiplied by it before backward (Note [Loss scaling]): the slot holds the
        scaled gradient.

        Returns a :class:`Computed`. The copies into the host slot are complete when this returns. A step that
        wrote state the engine does not follow raises its ValueError (Note [Weights changed in place by a step],
        Note [Model state the engine does not follow]) after those copies; with ``defer_refusal`` it is kept in
        :attr:`refused` instead, and the step returns, for a caller that refuses it with its peers (Note [A step
        refused on every rank] in pyengine/distributed.py); so is the streamer's RuntimeError of a parameter that
        got no gradient under ``unused="error"``, which otherwise raises from the backward.
        """
        self.refused = None
        self.streamer.defer_unused_error(defer_refusal)
        context = contextlib.nullcontext()
        if self.stream is not None:
            # A pool stream does not wait on the default stream by itself: order this step after the work enqueued
            # on the calling thread's current stream (a batch already on this device, buffers shared into the
            # replica, the replica's own construction)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            context = torch.cuda.stream(self.stream)
        with context:
            begun = time.perf_counter()
            self.followed.mark()
            self.streamer.wait_weights()  # the previous update's copy back (CPU: the host waits; CUDA: the stream)
            start = time.perf_counter()
            self.replica.zero_grad(set_to_none=True)
            self.streamer.accumulate(len(batches))
            scale = [None] * len(batches) if weights is None else weights
            losses = [self.forward_backward(loss_fn, b, w, loss_scale) for b, w in zip(batches, scale)]
            losses = [float(x) for x in losses]  # on CUDA the host waits here, once, for the last backward
            computed = time.perf_counter()
            self.streamer.wait_all()
            waited = time.perf_counter()
        self.refused = self.streamer.take_unused_error()  # kept only with defer_refusal; raised in backward else
        if self.refused is None:
            try:
                check_weights_unchanged(self.streamer.changed_in_place(), f"worker {self.index}'s replica")
                self.followed.check(f"worker {self.index}'s replica")
            except ValueError as exc:
                if not defer_refusal:
                    raise
                self.refused = exc
        loss = sum(losses) / len(losses) if weights is None else sum(w * x for w, x in zip(weights, losses))
        return Computed(loss, computed - start, waited - computed, start - begun)

    def close(self) -> None:
        self.streamer.close()

