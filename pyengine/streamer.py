"""Gradient streaming from a replica into the host store while backward runs, and the pipelined update.

A :class:`GradientStreamer` registers a post-accumulate-grad hook on each trainable parameter of one worker's replica.
Parameters are grouped into buckets as DDP does (reverse registration order, a small first bucket, then a size cap);
because the store is laid out in that order, each bucket is one contiguous range of the flat store. When a bucket's
last gradient is ready, its copy into the worker's gradient slot starts (buckets start in order) while backward goes
on: on a copy stream ordered by events for CUDA replicas, on a copy thread for CPU replicas; a large gradient starts
its copy as soon as it is ready, ahead of its bucket (Note [Early copies of large gradients]). The host waits per
bucket. :func:`pipelined_update` runs the fused mean-gradient AdamW on bucket k as soon as all G workers delivered it,
then starts bucket k's copy back to the replicas. See Note [Pinned buffer busy until its copy's event] in
csrc/store/transfer.h for the ordering rules.
"""
from __future__ import annotations

import collections.abc
import contextlib
import math
import numbers
import operator
import threading
import time
import warnings
import weakref
from typing import NamedTuple, Sequence

import torch

from . import _C, ops
from .store import HostStore, LayoutEntry

__all__ = ["Bucket", "GradientStreamer", "pipelined_update"]

_GRADS, _WEIGHTS = 0, 1


class Bucket(NamedTuple):
    """Bucket ``index``: parameters ``names`` (backward order), elements ``[begin, end)`` of the flat store."""

    index: int
    names: tuple[str, ...]
    begin: int
    end: int


def refuse_script_module(model, who: str) -> None:
    """A TorchScript module (torch.jit.script/trace) is refused naming the fix: it takes no forward pre-hook (the
    streamer's wait for the weights), and its copies (an engine's replicas) have no leaf parameters to hook the
    gradients on (torch said 'post accumulate grad hooks cannot be registered on non-leaf tensors')."""
    roots = [("the model", model)] if isinstance(model, torch.nn.Module) else \
        [(f"layer {i}", layer) for i, layer in enumerate(model)] if isinstance(model, (list, tuple)) else []
    scripted = [f"{root if not name else repr(name)} ({type(m).__name__})" for root, layer in roots
                if isinstance(layer, torch.nn.Module) for name, m in layer.named_modules()
                if isinstance(m, torch.jit.ScriptModule)]
    if scripted:
        raise TypeError(f"{who}: {scripted[0]} is a TorchScript module: the gradients and weights move by hooks on "
                        "the module and its parameters, which a TorchScript module cannot have; give the plain "
                        "nn.Module (torch.compile(model) trains)")


def check_options(bucket_mb, first_bucket_mb, unused, eager_mb, who: str = "GradientStreamer"):
    """ValueError naming the option unless the streamer's options are valid (the Engine checks them before it
    allocates or seeds anything). Returns (bucket_mb, first_bucket_mb, eager_mb) as Python floats (numpy's numbers
    are taken, as the bucket and worker indices are; an int past float's range is inf)."""
    def number(value) -> bool:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)

    def as_float(value) -> float:
        try:
            return float(value)
        except OverflowError:
            return math.inf

    if unused not in ("zero", "error"):
        raise ValueError(f"{who}: unused must be 'zero' or 'error'; got {unused!r}")
    for name, value in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
        if not number(value) or not value > 0:
            raise ValueError(f"{who}: {name} must be a number > 0 (MiB); got {value!r}")
    if eager_mb is not None and (not number(eager_mb) or not eager_mb >= 0):
        raise ValueError(f"{who}: eager_mb must be a number >= 0 or None; got {eager_mb!r}")
    return as_float(bucket_mb), as_float(first_bucket_mb), None if eager_mb is None else as_float(eager_mb)


def _copy_source(grad: torch.Tensor) -> torch.Tensor | None:
    """What a gradient's copy into its slot reads: None (a zero-fill) for a ZeroTensor, the storage-less zeros that
    some backward formulas give (torch.sgn's, a custom Function's torch._efficientzerotensor): its data pointer is
    null, and a copy from it killed the process. A lazily negated gradient (a custom Function's torch._neg_view) is
    resolved: the copy reads memory, not the negation bit."""
    return None if grad._is_zerotensor() else grad.detach().resolve_neg().contiguous()


def make_buckets(layout: Sequence[LayoutEntry], numel: int, grad_dtype: torch.dtype, bucket_mb: float,
                 first_bucket_mb: float) -> list[Bucket]:
    """DDP's scheme over a store layout (``store.layout``, ``store.numel``): a parameter joins the open bucket, which
    closes once it reaches its cap in bytes of ``grad_dtype``."""
    itemsize = grad_dtype.itemsize
    buckets, names, begin, size = [], [], 0, 0
    for i, entry in enumerate(layout):
        names.append(entry.name)
        size += entry.numel * itemsize
        cap = (first_bucket_mb if not buckets else bucket_mb) * 2**20
        last = i + 1 == len(layout)
        if size >= cap or last:
            end = numel if last else layout[i + 1].offset
            buckets.append(Bucket(len(buckets), tuple(names), begin, end))
            names, begin, size = [], end, 0
    return buckets


def check_dense_gradients(module: torch.nn.Module, who: str) -> None:
    """ValueError naming the trainable embeddings of ``module`` that make sparse gradients: the store holds dense
    ones (the copy into a slot failed inside torch, after a whole forward and backward)."""
    sparse = [f"{name}.weight" if name else "weight" for name, m in module.named_modules()  # a frozen one: none
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
    if sparse:
        raise ValueError(f"{who}: {sparse} make sparse gradients (sparse=True); the store holds dense gradients: build "
                         "them with sparse=False")


class GradientStreamer:
    """Streams one worker's gradients into ``store.grad_slot(worker)`` during backward, bucket by bucket.

    Args:
        replica: the worker's model (an ``nn.Module`` on ``cpu`` or ``cuda:i``), with the store's trainable parameters
            under the same names and shapes (contiguous; float32, bfloat16 or float16: gradients are converted to
            the slot's dtype; dense gradients: no ``nn.Embedding(sparse=True)``), and no other trainable one. The
            set is fixed here: a parameter unfrozen later (``requires_grad_(True)``) gets ``.grad`` and is never
            streamed, so a schedule that unfreezes layers builds a new store and streamer (a per-step check of
            the replica's parameters costs ~0.1 ms a step on a 200-parameter model: not made). Gradient hooks of
            the replica's parameters (``register_hook``, ``register_post_accumulate_grad_hook``) are registered
            before the streamer (an Engine copies the model's onto its replicas first): a post-accumulate hook
            added after it runs after the streamer's, and a bucket's copy may start from the streamer's hook of
            the bucket's last parameter, before that parameter's later hooks.
        store: the :class:`~pyengine.HostStore`.
        worker: which gradient slot this replica fills.
        bucket_mb, first_bucket_mb: bucket size caps in MiB of slot bytes (DDP's defaults).
        unused: what a parameter that got no gradient in a step (all backward passes of an accumulation window)
            gives: ``"zero"`` (zeros in the slot; ``param.grad`` untouched) or ``"error"`` (backward raises, naming
            the parameters; DDP's find_unused_parameters).
        eager_mb: a gradient of at least this many MiB of slot bytes starts its copy as soon as it is ready, ahead
            of the rest of its bucket (Note [Early copies of large gradients]: hooks registered after the
            streamer's must then leave ``.grad`` alone); ``None``: whole buckets only.

    Attributes: ``buckets`` (list of :class:`Bucket`), ``device``, ``worker``, ``hook_calls`` (hook invocations so
    far: one per parameter per backward pass).

    Use it as a context manager, or call :meth:`close`, to remove its hooks.
    """

    def __init__(self, replica: torch.nn.Module, store: HostStore, worker: int = 0, bucket_mb: float = 25,
                 first_bucket_mb: float = 1, unused: str = "zero", eager_mb: float | None = 1):
        if not isinstance(replica, torch.nn.Module):
            raise TypeError(f"GradientStreamer: replica must be an nn.Module; got {type(replica).__name__}")
        refuse_script_module(replica, "GradientStreamer")
        if not isinstance(store, HostStore):
            raise TypeError(f"GradientStreamer: store must be a HostStore; got {type(store).__name__}")
        bucket_mb, first_bucket_mb, eager_mb = check_options(bucket_mb, first_bucket_mb, unused, eager_mb)
        worker = store._check_worker(worker, "grad_slot")  # an int in [0, workers): the store says which
        self.store, self.worker, self.unused = store, worker, unused
        self._closed = False
        self._params = self._replica_params(replica, store)
        # each parameter's version counter as this streamer last wrote it (Note [Weights changed in place by a step])
        self._weight_versions = [p._version for p in self._params]
        self.device = self._params[0].device
        self.buckets = make_buckets(store.layout, store.numel, store.grad_dtype, bucket_mb, first_bucket_mb)
        index = {name: i for i, name in enumerate(store.names)}
        self._bucket_params = [[index[name] for name in b.names] for b in self.buckets]
        self._bucket_of = [0] * len(self._params)
        for k, members in enumerate(self._bucket_params):
            for i in members:
                self._bucket_of[i] = k
        slot = store.grad_slot(worker)
        self._slot_views = [slot[e.offset:e.offset + e.numel] for e in store.layout]
        # Note [Early copies of large gradients]
        self.eager_mb = eager_mb
        self._eager = [eager_mb is not None and e.numel * store.grad_dtype.itemsize >= eager_mb * 2**20
                       for e in store.layout]
        self._sent = [False] * len(self._params)  # copied early in the current sync pass
        self._transfer = _C.BucketTransfer(len(self.buckets), str(self.device), f"w{worker}")
        self._lock = threading.Lock()
        self._resets = 0  # reset() calls so far: pipelined_update's sign that a step it waits on failed
        self._accumulate = 1
        self._no_sync = 0  # how many no_sync() contexts are open (they nest, as DDP's)
        self._backward_count = 0
        self._in_backward = False
        self._sync = False
        self._end_deferred = False  # Note [Reentrant backward]
        self._passes = 0  # backward passes begun, for backward_pass()
        self._fired = [False] * len(self._params)  # got a gradient in the current accumulation window
        self._fired_pass = [False] * len(self._params)  # got it in the current backward pass (Note [Hook fires once])
        # Note [Unused parameters and overlap]
        self._prune = False  # set once a step had parameters without a gradient (unused="zero")
        self._said_reached_none = False  # the warning of a step whose backward reached no parameter: said once
        self._said_unseen = False  # the warning of a .grad no hook saw: said once
        self._defer_unused = False  # unused="error" kept, not raised (defer_unused_error)
        self._unused_error: RuntimeError | None = None  # the kept error of the last window
        self._looked_for_added = False  # the replica's parameters compared with the store's: after the first pass
        self._unreached: list[int] = []  # this pass: parameters the loss's graph does not reach
        self._presumed = [False] * len(self._params)  # counted ready at the pass's start (in _unreached)
        self._index_of = {id(p): i for i, p in enumerate(self._params)}  # the graph walk's AccumulateGrad variables
        self._pending = [0] * len(self.buckets)
        self._next_launch = 0
        self.hook_calls = 0
        self._replica = weakref.ref(replica)
        store.claim_slot(worker, self)  # last check: Note [One writer a slot]
        self._claimed = True
        self._handles = self._register_hooks(replica)

    @staticmethod
    def _replica_params(replica, store) -> list[torch.Tensor]:
        named = dict(replica.named_parameters())
        params = []
        for entry in store.layout:
            param = named.get(entry.name)
            if param is None or param.shape != entry.shape or not param.requires_grad:
                raise ValueError(f"GradientStreamer: the replica must have a trainable parameter {entry.name!r} of "
                                 f"shape {tuple(entry.shape)} like the store; got "
                                 f"{None if param is None else (tuple(param.shape), param.requires_grad)}")
            if not param.is_contiguous():
                raise ValueError(f"GradientStreamer: replica parameter {entry.name!r} must be contiguous")
            if param.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"GradientStreamer: replica parameter {entry.name!r} must be float32, bfloat16 or "
                                 f"float16 (its gradients are copied into the store's slots); got {param.dtype}")
            params.append(param)
        held = {entry.name for entry in store.layout}
        extra = [name for name, p in replica.named_parameters() if p.requires_grad and name not in held]
        if extra:  # they would get .grad every step and never be trained
            raise ValueError(f"GradientStreamer: the replica's trainable parameters {extra} are not in the store (a "
                             "weight tied in the store's model and not in the replica, or frozen there and not "
                             "here): build the replica like the model the store was made from")
        check_dense_gradients(replica, "GradientStreamer")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"GradientStreamer: a replica lives on one device; got {sorted(map(str, devices))}")
        return params

    def _register_hooks(self, replica) -> list:
        ref = weakref.ref(self)  # the hooks must not keep the streamer alive (close() on __del__)

        def on_grad(index):
            def hook(param):
                streamer = ref()
                if streamer is not None:
                    streamer._on_grad(index, param)
            return hook

        def before_forward(module, args):
            streamer = ref()
            if streamer is not None:
                streamer.wait_weights()

        handles = [p.register_post_accumulate_grad_hook(on_grad(i)) for i, p in enumerate(self._params)]
        handles.append(replica.register_forward_pre_hook(before_forward))
        return handles

    # ---- hooks (autograd threads) ----

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        """Note [Hook fires once]
        Within one backward pass a parameter's post-accumulate-grad hook fires once: its AccumulateGrad node runs
        once per graph task. The exception is a parameter used both inside and outside a reentrant activation
        checkpoint (``use_reentrant=True``): the inner backward is its own graph task, so the hook fires in each,
        and the first fire would have its bucket copied with half the gradient (or its bucket-mates zero-filled).
        That is an error here, as in DDP ("marked ready twice"); non-reentrant checkpoints have one graph task."""
        if param.grad is not None and param.grad.layout != torch.strided:
            raise RuntimeError(f"GradientStreamer(worker={self.worker}): parameter {self.store.names[index]!r} got a "
                               f"{param.grad.layout} gradient; the store holds dense gradients")
        with self._lock:
            if not self._in_backward:
                self._begin_backward()
            elif self._end_deferred:  # Note [Reentrant backward]: now on the outer backward's graph task
                self._end_deferred = False
                self._queue_end()
            twice = self._fired_pass[index]
            self._fired_pass[index] = True
            self.hook_calls += 1
            self._fired[index] = True
            hidden = self._presumed[index]
            if self._sync and not twice and not hidden:
                k = self._bucket_of[index]
                self._pending[k] -= 1
                if self._eager[index] and (self._pending[k] > 0 or k != self._next_launch):
                    self._launch_early(index, k)
            if self._sync:
                self._launch_ready()
        if hidden:
            raise RuntimeError(
                f"GradientStreamer(worker={self.worker}): parameter {self.store.names[index]!r} got a gradient though "
                "the loss's autograd graph did not reach it (Note [Unused parameters and overlap]): a custom autograd "
                "Function uses it without taking it as an input; its bucket may have been copied without it")
        if twice:
            raise RuntimeError(
                f"GradientStreamer(worker={self.worker}): parameter {self.store.names[index]!r} received its gradient "
                "twice in one backward pass (Note [Hook fires once]): it is used both inside and outside a reentrant "
                "activation checkpoint; use torch.utils.checkpoint.checkpoint(..., use_reentrant=False). (Or an "
                "earlier backward raised outside backward_pass() and left its pass open: call reset() after a failed "
                "backward, or run backward inside backward_pass(), which does)")

    def _begin_backward(self, queue_end: bool = True) -> None:
        self._in_backward = True
        self._passes += 1
        self._fired_pass = [False] * len(self._params)
        self._sync = not self._no_sync and (self._backward_count + 1) % self._accumulate == 0
        self._presumed = [False] * len(self._params)
        if self._sync:
            self._pending = [len(members) for members in self._bucket_params]
            self._next_launch = 0
            self._sent = [False] * len(self._params)
            for i in self._unreached:  # Note [Unused parameters and overlap]: no gradient will come this pass
                self._presumed[i] = True
                self._pending[self._bucket_of[i]] -= 1
        self._unreached = []
        if queue_end:
            self._queue_end()

    def _queue_end(self) -> None:
        ref = weakref.ref(self)
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: ref() is not None and ref()._end_backward(from_callback=True))

    def _end_backward(self, from_callback: bool = False) -> None:
        """The end of a backward pass: launches what is left (parameters that got no gradient).

        Note [Reentrant backward]
        The end is a callback queued on the graph task of the backward the first hook fired in. Under a reentrant
        activation checkpoint (``checkpoint(..., use_reentrant=True)``) that may be the *inner* backward, run from
        inside a node of the outer one, with hooks of other parameters still to come: ending the pass there would
        zero-fill them and start a second pass (DDP has the same trap and asks for ``use_reentrant=False``). So a
        callback that runs while an autograd node is still executing on this thread (an outer backward is in
        progress) only defers the end: the next hook re-queues it on the outer graph task, and
        :meth:`backward_pass` ends the pass when the outer backward returns with no hook left to fire.
        """
        if from_callback and torch._C._current_autograd_node() is not None:
            with self._lock:
                self._end_deferred = True
            return
        with self._lock:
            self._in_backward = False
            self._end_deferred = False
            self._backward_count += 1
            if not self._sync:
                return
            never = [self.store.names[i] for i, fired in enumerate(self._fired) if not fired]
            # a .grad no hook saw (assigned by hand, torch.autograd.grad's result, say): its slot got zeros
            unseen = [self.store.names[i] for i, fired in enumerate(self._fired)
                      if not fired and self._params[i].grad is not None] if never else []
            # Parameters that did not fire in this pass: their accumulated .grad, or zeros if they never fired in
            # the window. Launched in "error" mode too, so that no waiter hangs.
            self._pending = [0] * len(self.buckets)
            self._launch_ready()
            self._fired = [False] * len(self._params)
            self._prune = self._prune or (bool(never) and self.unused == "zero")
        if not self._looked_for_added:  # after the pass's launches, as the errors below: no waiter hangs
            self._looked_for_added = True
            self._refuse_added()
        replaced = self._replaced(never)
        if replaced:
            raise RuntimeError(
                f"GradientStreamer(worker={self.worker}): replica parameter(s) {replaced[:10]} were replaced or "
                "removed after the streamer was built (a new nn.Parameter assigned, or deleted, say in the forward): "
                "their gradients have no hook and their weights no copy back; change the model before building the "
                "store and the streamer (the Engine: before building it)")
        if never and self.unused == "zero" and len(never) == len(self._params) and not self._said_reached_none:
            self._said_reached_none = True
            warnings.warn(
                f"GradientStreamer(worker={self.worker}): this step's backward reached none of the replica's "
                f"{len(never)} trainable parameters, so every gradient streamed is zero (a loss computed with another "
                "module, such as the original model held in a closure instead of the replica that loss_fn is given, "
                "trains nothing); said once per streamer", RuntimeWarning, stacklevel=2)
        if unseen and not self._said_unseen:
            self._said_unseen = True
            warnings.warn(
                f"GradientStreamer(worker={self.worker}): {unseen[:10]} hold a .grad that autograd did not accumulate "
                "in this window (assigned by hand, or left from before it): the streamer takes each gradient as "
                "backward accumulates it, so their slots hold zeros; let backward compute them (from the loss); said "
                "once per streamer", RuntimeWarning, stacklevel=2)
        if never and self.unused == "error":
            exc = RuntimeError(
                f"GradientStreamer(worker={self.worker}): {len(never)} parameter(s) received no gradient in this "
                f"step: {never[:10]}; pass unused='zero' to stream zeros for them, or freeze them "
                "(requires_grad=False) so the store leaves them out")
            if not self._defer_unused:
                raise exc
            self._unused_error = exc  # the buckets were launched above, zeros for these: the step completes

    def _refuse_added(self) -> None:
        """A trainable parameter the store does not hold, created after the streamer was built (by the first
        forward: a hand-made lazy layer, ``self.w = nn.Parameter(...)`` in forward; or unfrozen since), would get a
        .grad each step and never be trained or saved, without a word. Looked for once, at the end of the first
        backward pass (a walk of the replica's parameters: the steps after it pay nothing); the pass then raises,
        its gradients are dropped as a failed step's. A parameter added in a later step is not seen."""
        replica = self._replica()
        if replica is None:
            return
        known, held = {id(p) for p in self._params}, set(self.store.names)
        added = [name for name, p in replica.named_parameters()
                 if p.requires_grad and id(p) not in known and name not in held]  # a held name: _replaced's
        if added:
            self._looked_for_added = False  # the next pass looks again
            raise RuntimeError(
                f"GradientStreamer(worker={self.worker}): the replica has trainable parameter(s) {added[:10]} that "
                "the store does not hold: made after the streamer was built (created in the forward, say) or "
                "unfrozen since; they would get gradients and never be trained or saved. Create every parameter "
                "before building the store and the streamer (the Engine: before building it; a lazy module: one "
                "forward on a sample batch first)")

    def _replaced(self, never: list[str]) -> list[str]:
        """Of the parameters that got no gradient, those no longer in the replica under their name (looked up only
        when some parameter got none: the common step pays nothing)."""
        replica = self._replica() if never else None
        if replica is None:
            return []
        named, missing = dict(replica.named_parameters()), set(never)
        return [name for i, name in enumerate(self.store.names)
                if name in missing and named.get(name) is not self._params[i]]

    def _launch_early(self, index: int, k: int) -> None:
        """Note [Early copies of large gradients]
        DDP's buckets exist to make few, large collectives; a bucket's copy into the host slot is one copy per
        parameter anyway, and waiting for the bucket's last gradient only delays the others: with two 17 MB layers
        per bucket, the copy of the earlier layer waited a whole layer's backward, and at the end of backward two
        layers' copies (0.9 ms on an H100) were left to run after its last kernel. So a gradient of at least
        ``eager_mb`` starts its copy from its own hook, as a part of its bucket (``completes_bucket=False``); the
        bucket's launch, when its last gradient is ready, copies the rest. Parts and launches of one worker run in
        launch order on one copy stream (or the copy thread), and the bucket counts as delivered only when its
        completing launch has completed, so :meth:`wait`, the pipelined update and the busy rule of the Note in
        transfer.h see whole buckets as before. The hook runs after the gradient's last accumulation of the pass
        (post-accumulate-grad), so the part copies its final value. Small gradients stay in their bucket's launch:
        on CUDA a part costs an event record and a stream wait beside the copy itself. A failed step's parts whose
        bucket never completes are drained by :meth:`reset` (BucketTransfer.drain), which counts no delivery.

        The rule this adds (DDP's communication hooks have it too): a post-accumulate-grad hook registered after the
        streamer's must not change ``.grad`` in place, since an early part may be reading it already (with
        ``eager_mb=None`` the rule held for each bucket's last gradient only)."""
        grad = self._params[index].grad
        if grad is None:  # no gradient after all: the bucket's launch decides (zeros or the error)
            return
        self._transfer.launch(_GRADS, k, [_copy_source(grad)], [self._slot_views[index]], False)
        self._sent[index] = True

    def _launch_ready(self) -> None:
        """Launches, in bucket order, every bucket whose gradients are all ready (less the parameters copied early)."""
        while self._next_launch < len(self.buckets) and self._pending[self._next_launch] == 0:
            k = self._next_launch
            srcs, dsts = [], []
            for i in self._bucket_params[k]:
                if self._sent[i]:
                    continue
                grad = self._params[i].grad
                srcs.append(_copy_source(grad) if self._fired[i] and grad is not None else None)
                dsts.append(self._slot_views[i])
            self._transfer.launch(_GRADS, k, srcs, dsts)
            self._next_launch += 1

    # ---- host side ----

    def _unreached_by(self, loss) -> list[int]:
        """Note [Unused parameters and overlap]
        Buckets launch in order, and a parameter that gets no gradient in a pass is only known at the pass's end: one
        unused parameter in the first bucket would hold every bucket back until backward ends (no overlap at all).
        As DDP's find_unused_parameters, the loss's autograd graph is walked before backward runs and the parameters
        it does not reach are counted ready at once (zeros, or the window's earlier gradient, as at the end). The
        walk costs a Python visit per graph node, so it runs only once a step has shown unused parameters
        (``unused="zero"``): a model whose parameters all train never pays. A reentrant activation checkpoint builds
        its graph during backward, so a walk that meets one prunes nothing; any other gradient that arrives for a
        parameter the walk did not reach is an error (its bucket may have gone without it), never a wrong slot."""
        if not self._prune or not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            return []
        index = self._index_of
        reached, seen, stack = set(), set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if type(node).__name__ == "CheckpointFunctionBackward":
                return []
            variable = getattr(node, "variable", None)  # AccumulateGrad
            if variable is not None and id(variable) in index:
                reached.add(index[id(variable)])
            stack.extend(next_node for next_node, _ in node.next_functions)
        return [i for i in range(len(self._params)) if i not in reached]

    @contextlib.contextmanager
    def backward_pass(self, loss: torch.Tensor | None = None):
        """Wrap each ``loss.backward()`` in this (optional, but :class:`~pyengine.Engine` workers always do):

        - a backward that reaches no trainable parameter (a loss that does not depend on the model) fires no hook;
          without this, the step's buckets would never be launched and :meth:`wait` would wait forever. Here it
          counts as a pass in which no parameter got a gradient (``unused`` decides: zeros, or the error); with
          zeros, the first such step warns (a RuntimeWarning: a loss computed with another module trains nothing).
        - a pass whose end was deferred by a reentrant checkpoint (Note [Reentrant backward]) ends here.
        - a backward that raises leaves no half-launched step behind (:meth:`reset`): the next backward starts a
          fresh step, and no :meth:`wait` returns on the failed one's buckets.
        - given the ``loss`` that backward starts from, parameters it does not reach are known before backward, not
          at its end, once a step has had unused parameters (Note [Unused parameters and overlap]).
        - later work may change ``.grad`` in place: the pass ends ordered after its copies, which read ``.grad``
          (Note [The pass's copies read .grad]; CPU: the host waits for them here).
        """
        self._check_open("backward_pass")
        unreached = self._unreached_by(loss)
        with self._lock:
            self._unreached = unreached
            passes = self._passes
        try:
            yield self
        except BaseException:
            self.reset()  # a backward that failed half way: its buckets must not pass for the next step's
            raise
        with self._lock:
            if self._passes == passes and not self._in_backward:
                self._begin_backward(queue_end=False)
            finish = self._in_backward
        if finish:
            try:
                self._end_backward()
            except BaseException:  # unused="error" for a pass that reached no parameter: as a failed backward
                self.reset()
                raise
        # Note [The pass's copies read .grad]
        # The copies read each param.grad itself (no copy of it is taken), and backward returns while they run: a
        # caller that then changed .grad in place (clip_grad_norm_, a GradScaler's unscale_, zero_grad with
        # set_to_none=False, the next accumulation's +=) would have the slot take a torn mix of the two values. So
        # the pass ends ordered after its copies: on CUDA the current (compute) stream waits on their events (no
        # host block), on CPU the host waits for them. A backward run outside backward_pass has no such end: there,
        # .grad must not change in place before wait_all().
        try:
            self._transfer.order_current_stream(_GRADS)
        except BaseException:  # a copy that failed (its tensor freed meanwhile): as a failed backward, and the later
            self.reset()       # buckets' copies, still running or failed too, are waited for and dropped with it
            raise

    def defer_unused_error(self, defer: bool = True) -> None:
        """With ``defer``, a window whose parameters did not all get a gradient under ``unused="error"`` does not
        raise at the end of its backward: its buckets are delivered as they are in any step (zeros for those
        parameters) and the error is kept for :meth:`take_unused_error`, for a caller that refuses the step
        together with other processes (Note [A step refused on every rank] in pyengine/distributed.py). Such a step
        must not be applied: the caller drops it (:meth:`reset`) once its collectives are done."""
        self._defer_unused = bool(defer)

    def take_unused_error(self) -> RuntimeError | None:
        """The error that :meth:`defer_unused_error` kept from this step's window, or None; forgets it."""
        with self._lock:
            exc, self._unused_error = self._unused_error, None
        return exc

    def accumulate(self, n: int) -> "GradientStreamer":
        """Copy gradients after every ``n``-th backward pass (gradient accumulation; ``param.grad`` accumulates as
        usual in between, so zero it after each step). Returns self."""
        self._check_open("accumulate")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:  # True was taken as 1
            raise ValueError(f"GradientStreamer.accumulate: n must be an int >= 1; got {n!r}")
        with self._lock:
            self._accumulate = n
            self._backward_count = 0
        return self

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this context only accumulate into ``param.grad``; the next one outside copies.
        Contexts nest: the passes stay uncopied until the outermost one exits."""
        self._check_open("no_sync")
        with self._lock:
            self._no_sync += 1
        try:
            yield self
        finally:
            with self._lock:
                self._no_sync -= 1
                if not self._no_sync:
                    self._backward_count = -1 % self._accumulate  # the next backward completes the window

    def wait(self, k: int, timeout: float | None = None) -> bool:
        """Block until bucket ``k``'s gradients of this step are in the worker's slot (its backward may still run).

        A delivered bucket counts as this step's until it is consumed: :meth:`copy_back` (or
        :func:`pipelined_update`) consumes it; a caller that uses the slot another way (say, its own update and
        ``store.copy_to``) calls :meth:`reset` after, or the next step's waits return at once on the old data.

        ``timeout`` (seconds) bounds the wait for the bucket's copy to be launched, i.e. for the backward that
        produces it (which may have failed, or touch no parameter of the bucket until it ends): returns False when
        it ran out, True once the bucket is in the slot. Without a timeout it waits as long as it takes.

        A copy of the bucket that failed (CPU: a gradient's storage freed before its copy ran) makes every wait for
        it raise ``RuntimeError`` naming the bucket, in every thread that waits (the worker's and the host's), until
        :meth:`reset` drops the step (``backward_pass`` does: its end waits for the copies).
        """
        self._check_open("wait")
        k = self._check_bucket(k, "wait")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)):
            raise TypeError(f"GradientStreamer.wait: timeout must be a number of seconds >= 0 or None; got "
                            f"{type(timeout).__name__} {timeout!r}")
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"GradientStreamer.wait: timeout must be >= 0 seconds or None; got {timeout}")
        if timeout is not None and timeout <= _INTERRUPT_POLL_S:  # one wait in C++ (the engine's polls)
            return self._transfer.wait(_GRADS, k, True, float(timeout))
        # a timeout past float's range (an int) waits as long as it takes, as None does
        return self._wait_interruptibly(k, None if timeout is None or timeout > 1e300 else float(timeout))

    def _wait_interruptibly(self, k: int, timeout: float | None = None) -> bool:
        """Waits for bucket ``k``'s delivery in bounded waits, so that Ctrl-C interrupts it: one wait in C++ for a
        backward that never comes (a wait before it, on the main thread) held the thread there for as long as the
        timeout (an hour, say), and a KeyboardInterrupt is raised only once the thread is back in Python. False
        when ``timeout`` (seconds; None: none) ran out."""
        if timeout is None:
            while not self._transfer.wait(_GRADS, k, True, _INTERRUPT_POLL_S):
                pass
            return True
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if self._transfer.wait(_GRADS, k, True, max(0.0, min(left, _INTERRUPT_POLL_S))):
                return True
            if left <= _INTERRUPT_POLL_S:
                return False

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"GradientStreamer.{what}: this streamer is closed (its hooks removed, its transfers "
                               "shut); build a new one")

    def _check_bucket(self, k, what: str) -> int:
        """``k`` as a bucket index (an int, or numpy's, in [0, len(buckets))), or an IndexError naming ``what``."""
        index = _index_in(k, len(self.buckets))
        if index is None:
            raise IndexError(f"GradientStreamer.{what}: bucket must be an int in [0, {len(self.buckets)}); got "
                             f"{type(k).__name__} {k!r}")
        return index

    def wait_all(self) -> None:
        """Block until every bucket's gradients of this step are in the worker's slot. As with :meth:`wait`, a
        bucket that :meth:`copy_back` or :func:`pipelined_update` consumed is the next step's: a worker thread that
        waits after the host's update started may wait for the next backward (wait before it, or not at all)."""
        self._check_open("wait_all")
        for k in range(len(self.buckets)):
            self._wait_interruptibly(k)

    def copy_back(self, source: torch.Tensor | None = None, buckets: Sequence[int] | None = None) -> None:
        """Start copying updated weights into the replica's parameters, bucket by bucket.

        ``source`` is a flat store buffer (default: ``store.shadow`` if the store has one, else ``store.param``).
        This also marks the buckets' gradients as consumed: the next :meth:`wait` waits for the next backward. The
        replica's next forward waits for the copies (a forward pre-hook: on CUDA its stream waits on the events, on
        CPU the host waits). On CUDA the copies start after the work enqueued so far on the calling thread's current
        stream: call this with the replica's compute stream current when another stream may still read the weights.
        """
        self._check_open("copy_back")
        source = self._source(source)
        if buckets is not None and not isinstance(buckets, collections.abc.Iterable):
            raise TypeError(f"GradientStreamer.copy_back: buckets must be a sequence of bucket indices or None; got "
                            f"{type(buckets).__name__} {buckets!r}")
        buckets = range(len(self.buckets)) if buckets is None else list(buckets)
        indices = [_index_in(k, len(self.buckets)) for k in buckets]
        bad = [k for k, index in zip(buckets, indices) if index is None]
        if bad:  # checked before any copy starts
            raise ValueError(f"GradientStreamer.copy_back: buckets must be indices in [0, {len(self.buckets)}); "
                             f"got {bad}")
        buckets = indices  # numpy's ints as ints, as wait() takes them
        destinations = self._destinations(buckets)  # every bucket checked before the first is released or copied
        for k in buckets:
            self._copy_back_bucket(k, source, destinations[k])

    def _destinations(self, buckets) -> dict:
        """Flat views of the replica's parameters of each bucket, the copy back's destinations. A parameter whose
        layout changed since the streamer was built (``model.to(memory_format=torch.channels_last)``) has no flat
        view: a clear error before any bucket's copy starts, not a half-copied replica."""
        out = {}
        for k in buckets:
            for i in self._bucket_params[k]:
                p, entry = self._params[i], self.store.layout[i]
                if not p.is_contiguous() or p.numel() != entry.numel:
                    raise ValueError(f"GradientStreamer.copy_back: the replica's parameter {entry.name!r} is no longer "
                                     f"a contiguous tensor of {entry.numel} elements (shape {tuple(p.shape)}, strides "
                                     f"{p.stride()}): was the model moved to another memory format or resized after "
                                     "the streamer was built? The weights are copied into flat views")
            out[k] = [self._params[i].detach().view(-1) for i in self._bucket_params[k]]
        return out

    def _source(self, source):
        if source is None:
            source = self.store.shadow if self.store.shadow is not None else self.store.param
        if not isinstance(source, torch.Tensor):
            raise TypeError(f"GradientStreamer.copy_back: source must be a flat store buffer (a tensor) or None; got "
                            f"{type(source).__name__}")
        if source.dim() != 1 or source.numel() != self.store.numel:
            raise ValueError(f"GradientStreamer.copy_back: source must be a flat store buffer of {self.store.numel} "
                             f"elements; got shape {tuple(source.shape)}")
        # checked before any bucket is released or copied
        if (source.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not source.is_contiguous()
                or source.device.type != "cpu" or source._is_zerotensor()):
            raise ValueError(f"GradientStreamer.copy_back: source must be a contiguous float32, bfloat16 or float16 "
                             f"host buffer (the store's param or shadow); got {source.dtype} on {source.device}"
                             f"{'' if source.is_contiguous() else ', not contiguous'}"
                             f"{', a ZeroTensor (no memory behind it)' if source._is_zerotensor() else ''}")
        return source

    def _copy_back_bucket(self, k: int, source: torch.Tensor, dsts: list[torch.Tensor]) -> None:
        members = self._bucket_params[k]
        layout = self.store.layout
        srcs = [source[layout[i].offset:layout[i].offset + layout[i].numel] for i in members]
        self._transfer.release(_GRADS, k)
        self._transfer.launch(_WEIGHTS, k, srcs, dsts)
        # as an in-place copy_ would (CUDA's copy does; the CPU copy thread writes bytes): a graph that saved one of
        # these weights now raises in its backward instead of using the new values
        torch.autograd.graph.increment_version(dsts)
        for i in members:
            self._weight_versions[i] = self._params[i]._version

    def changed_in_place(self) -> list[str]:
        """The store names of the replica's parameters written in place since this streamer last copied weights into
        them (or was built): Note [Weights changed in place by a step] in workers.py. A write through ``.data``
        shares no version counter and is not seen."""
        now = [p._version for p in self._params]
        if now == self._weight_versions:  # the common case, in one comparison of the lists
            return []
        return [entry.name for entry, a, b in zip(self.store.layout, now, self._weight_versions) if a != b]

    def wait_weights(self, k: int | None = None) -> None:
        """Order the replica's next work after the weight copies: on CUDA the current stream waits on the events
        (no host block); on CPU the host waits. With ``k``, the host waits for bucket k's copy back (the store's
        bucket k may be written again after this). After :meth:`close` it returns at once: close finished them."""
        if self._closed:
            if k is not None:
                self._check_bucket(k, "wait_weights")
            return
        if k is None:
            self._transfer.order_current_stream(_WEIGHTS)
        else:
            self._transfer.wait(_WEIGHTS, self._check_bucket(k, "wait_weights"), False)

    def reset(self) -> None:
        """Forget a step that did not complete (its worker, or another one, failed): wait for the copies in flight,
        drop the gradient buckets launched but not consumed and the accumulation window, so the next backward starts
        a fresh step and no wait returns on the failed step's data. Errors of those copies are dropped with them.

        Call it once this worker's backward has ended (returned or raised; :meth:`backward_pass` resets a backward
        that raises by itself): the hooks of a backward still running would take its later gradients for a new
        step's, and the next wait would return on them (the engine resets only after every worker's task ended).
        After :meth:`close` it does nothing: close finished the copies and nothing is delivered any more."""
        if self._closed:
            return
        self._resets += 1  # first: a pipelined_update waiting on this step sees it before any next-step delivery
        with self._lock:
            self._in_backward = False
            self._end_deferred = False
            self._sync = False
            self._backward_count = 0
            self._fired = [False] * len(self._params)
            self._presumed = [False] * len(self._params)
            self._unreached = []
            self._pending = [0] * len(self.buckets)
            self._next_launch = 0
            self._sent = [False] * len(self._params)
            self._unused_error = None
        # Early parts of buckets whose completing launch never came: done before the slot is used again, and no
        # launch that a waiter (the engine's thread) would take for the bucket's delivery.
        self._transfer.drain()
        for k in range(len(self.buckets)):
            try:
                self._transfer.wait(_GRADS, k, False)
            except RuntimeError:
                pass  # the failed step's copy; its slot is overwritten by the next step
            self._transfer.release(_GRADS, k)

    def close(self) -> None:
        """Remove every hook and finish the copies in flight. Idempotent. After it the methods that start or wait
        for a step (backward_pass, accumulate, no_sync, wait, wait_all, copy_back) refuse to run; reset and
        wait_weights return at once (nothing is in flight), and changed_in_place still answers."""
        self._closed = True
        handles, self._handles = getattr(self, "_handles", []), []
        for handle in handles:
            handle.remove()
        transfer = getattr(self, "_transfer", None)
        if transfer is not None:
            transfer.close()
        if getattr(self, "_claimed", False):  # the slot is free once no copy into it is in flight
            self._claimed = False
            self.store.release_slot(self.worker, self)

    def __enter__(self) -> "GradientStreamer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    @property
    def resets(self) -> int:
        """How many times :meth:`reset` ran (``backward_pass`` resets a backward that raised): read before a step's
        workers start, the ``since`` of :func:`pipelined_update`."""
        return self._resets

    def __repr__(self) -> str:
        return (f"GradientStreamer(worker={self.worker}, device={self.device}, buckets={len(self.buckets)}, "
                f"unused={self.unused!r})")


def pipelined_update(streamers: Sequence[GradientStreamer], store: HostStore, step: int, lr: float,
                     betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, adamw: bool = True,
                     amsgrad: bool = False, maximize: bool = False, weights=None, grad_scale=None, found_inf=None,
                     max_grad_norm=None, copy_back: bool = True, since: Sequence[int] | None = None):
    """One optimizer step over the store, bucket by bucket, overlapped with the transfers.

    For bucket k in order: wait until every streamer delivered bucket k (their backward passes may still run), wait
    until the previous copy back of bucket k has completed, run :func:`pyengine.ops.mean_grad_adamw_` on the
    bucket's range (gradients summed in the order of ``streamers``, writing ``store.shadow`` too when it exists),
    then start bucket k's copy back to every replica. The update is elementwise, so the weights are bit-identical to
    one update over the whole store after all gradients arrived. ``max_grad_norm`` needs the global norm first: all
    buckets are waited for, the norm is taken, then the buckets are updated (no overlap with backward).
    ``grad_scale``, ``found_inf`` and ``weights`` are passed to the fused op as they are; ``copy_back=False`` leaves
    the copies back to the caller (:meth:`GradientStreamer.copy_back`).

    With ``copy_back=True`` bucket k's new weights are copied into the replicas while their backward may still run:
    right for a model whose later backward kernels do not read bucket k's weights once its gradients are complete,
    which holds unless the forward used a weight outside autograd too (``w.detach()``, ``w.data``: the gradient
    hook fires when the tracked uses are done, and the detached use's input-gradient kernel may read the weight
    later, half copied). For such a model pass ``copy_back=False`` and copy back after backward, as the engine does.

    A worker whose backward fails (its streamer is :meth:`~GradientStreamer.reset`, as ``backward_pass`` does)
    while this waits for its buckets makes this raise ``RuntimeError`` instead of waiting for good, or for the next
    step's gradients: the error names the buckets already updated (and copied back), which stay so: an update
    applied bucket by bucket cannot be taken back (the engine defers its updates until every worker succeeded).
    A reset counts from ``since``: each streamer's :attr:`~GradientStreamer.resets` in the order of ``streamers``
    (default: read by this call). Pass them, read before the step's workers started, when a worker runs on a thread
    of its own: one that fails before this call is reached was reset already, and without ``since`` this waited
    for good for its buckets.

    Returns the norm of the mean gradient when clipping, else None.
    """
    if isinstance(streamers, GradientStreamer) or not isinstance(streamers, collections.abc.Iterable):
        raise TypeError(f"pipelined_update: streamers must be a list of GradientStreamers (one per worker); got "
                        f"{type(streamers).__name__} (one streamer: pass [streamer])")
    streamers = list(streamers)
    _check_streamers(streamers, store)
    resets = _check_since(since, streamers)  # a reset from then on: a failed step (_wait_delivered)
    if store.state_ranges is not None:  # its Adam state is packed: bucket offsets do not index it
        raise ValueError("pipelined_update: the store holds the Adam state of some ranges only (state_ranges, a "
                         "sharded update's store); pipelined_update updates whole stores")
    slots = [store.grad_slot(s.worker) for s in streamers]
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"pipelined_update: betas must be two numbers (beta1, beta2); got {betas!r}")
    if amsgrad and store.max_exp_avg_sq is None:
        raise ValueError("pipelined_update: amsgrad=True needs a store built with amsgrad=True")
    # The ops' own checks, every one before the first wait (called before backward, a wait for a call the op would
    # refuse lasted for good): the wrappers' checks of types, then the op itself on no element, which checks every
    # value (lr >= 0, betas in [0, 1), weights, grad_scale, ...) and writes nothing.
    try:
        hyper, step = ops._hyper(lr, betas[0], betas[1], eps, weight_decay), ops._step(step)
        flags, weights = ops._flags(adamw, maximize, amsgrad), ops._weights(weights)
        clip = ops._clip_norm(max_grad_norm)
        ops._tensors({}, dict(grad_scale=grad_scale, found_inf=found_inf))
        _update_range(store, slots, 0, 0, hyper, step, flags, amsgrad, grad_scale, found_inf, weights,
                      torch.zeros((), device=store.param.device) if clip else None, clip)
    except (TypeError, ValueError) as error:
        raise type(error)(f"pipelined_update: {error}") from None
    if not isinstance(copy_back, bool):  # "no" counted as True
        raise TypeError(f"pipelined_update: copy_back must be True or False; got {copy_back!r}")
    if copy_back:  # the replicas' flat views, every one checked before the first wait
        destinations = {s.worker: s._destinations(range(len(s.buckets))) for s in streamers}
    norm = None
    if clip:
        for k in range(len(streamers[0].buckets)):
            _wait_delivered(streamers, resets, k, 0)
        norm = torch.ops.pyengine.mean_grad_norm.default(slots, weights)[0]
    for bucket in streamers[0].buckets:
        k, b, e = bucket.index, bucket.begin, bucket.end
        _wait_delivered(streamers, resets, k, k)
        for s in streamers:
            s.wait_weights(k)  # the copy back of the previous step still reads bucket k (the Note in transfer.h)
        _C._nvtx_push(f"pyengine/update b{k}")
        try:
            _update_range(store, slots, b, e, hyper, step, flags, amsgrad, grad_scale, found_inf, weights, norm, clip)
        finally:
            _C._nvtx_pop()
        for s in streamers:
            if copy_back:
                s._copy_back_bucket(k, s._source(None), destinations[s.worker][k])
            else:
                s._transfer.release(_GRADS, k)
    return norm


def _update_range(store, slots, b, e, hyper, step, flags, amsgrad, grad_scale, found_inf, weights, norm, clip):
    """The fused op on the store's elements [b, e) (none when b == e: the op's checks alone)."""
    torch.ops.pyengine.mean_grad_adamw_.default(
        store.param[b:e], store.exp_avg[b:e], store.exp_avg_sq[b:e], [slot[b:e] for slot in slots], **hyper,
        step=step, **flags, max_exp_avg_sq=store.max_exp_avg_sq[b:e] if amsgrad else None, grad_scale=grad_scale,
        found_inf=found_inf, weights=weights, param_out=None if store.shadow is None else store.shadow[b:e],
        grad_norm=norm, max_grad_norm=clip)


_INTERRUPT_POLL_S = 0.1  # the longest a wait for a gradient bucket stays in C++: how soon Ctrl-C interrupts it
_POLL_S = 0.05  # how often a host's wait for a gradient bucket (here, the engine's, distributed's) looks whether a
# worker's step failed


def _wait_delivered(streamers: list[GradientStreamer], resets: list[int], k: int, updated: int) -> None:
    """Waits until every streamer delivered bucket ``k``; raises once one of them was reset since ``resets`` was
    taken (its step failed: the bucket may never come, or come from the next step). ``updated``: buckets already
    updated, for the error."""
    for s, before in zip(streamers, resets):
        delivered = False
        while not delivered and s._resets == before:
            delivered = s.wait(k, timeout=_POLL_S)
        if s._resets != before:  # checked after a delivery too: the reset may have come first
            raise RuntimeError(
                f"pipelined_update: worker {s.worker}'s step failed (its streamer was reset) before bucket {k} was "
                f"delivered; " + (f"buckets 0..{updated - 1} were updated and copied back already and stay so"
                                  if updated else "no bucket was updated")
                + "; reset the other workers' streamers once their backward passes have ended")


def _index_in(k, count: int) -> int | None:
    """``k`` as an index in [0, count) (an int or numpy's; not a bool), or None."""
    try:
        index = None if isinstance(k, bool) else operator.index(k)
    except TypeError:
        return None
    return index if index is not None and 0 <= index < count else None


def _check_since(since, streamers: list[GradientStreamer]) -> list[int]:
    """pipelined_update's ``since`` as a list of ints, one per streamer, none beyond its streamer's count."""
    if since is None:
        return [s._resets for s in streamers]
    if isinstance(since, (str, bytes)) or not isinstance(since, collections.abc.Iterable):
        raise TypeError(f"pipelined_update: since must be a list of ints (each streamer's resets); got "
                        f"{type(since).__name__}")
    since = list(since)
    counts = [_index_in(v, s._resets + 1) for v, s in zip(since, streamers)]
    if len(since) != len(streamers) or None in counts:
        raise ValueError(f"pipelined_update: since must hold each streamer's resets as read before the step (ints, "
                         f"at most {[s._resets for s in streamers]} now); got {since!r}")
    return counts


def _check_streamers(streamers: list[GradientStreamer], store: HostStore) -> None:
    if not streamers:
        raise ValueError("pipelined_update: streamers must hold at least one GradientStreamer")
    if not isinstance(store, HostStore):
        raise TypeError(f"pipelined_update: store must be a HostStore; got {type(store).__name__}")
    for s in streamers:
        if not isinstance(s, GradientStreamer):
            raise TypeError(f"pipelined_update: streamers must be GradientStreamers; got {type(s).__name__}")
        if s._closed:  # before any bucket is updated (the first copy back failed inside the closed transfer)
            raise RuntimeError(f"pipelined_update: {s!r} is closed; build a new one")
        if s.store is not store:
            raise ValueError(f"pipelined_update: {s!r} streams into another store")
        if [(b.begin, b.end) for b in s.buckets] != [(b.begin, b.end) for b in streamers[0].buckets]:
            raise ValueError("pipelined_update: all streamers must use the same buckets (same bucket_mb and "
                             "first_bucket_mb)")
    workers = [s.worker for s in streamers]
    if len(set(workers)) != len(workers):
        raise ValueError(f"pipelined_update: each worker must appear once; got workers {workers}")
