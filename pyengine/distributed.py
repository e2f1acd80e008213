"""Beyond one machine: the engine over torch.distributed (gloo for host tensors).

Every process runs an :class:`~pyengine.Engine` over its local devices; the processes are the ranks of a
torch.distributed process group (``torchrun`` sets the environment; :func:`init_process_group` reads it).

- **Multi-node hybrid** (:class:`DistributedHybrid`): a step splits each rank's local batch across its local workers;
  the global batch size is exchanged first, so every local gradient slot gets the weight (its samples / global
  samples). As soon as bucket k is in all local slots, the host forms the local weighted sum of bucket k and launches
  an asynchronous allreduce(SUM) of it, while the other buckets are still being computed and copied. The reduced
  buffer is the global mean gradient, identical on every rank; every rank applies the same fused update
  (``mean_grad_adamw_`` with G = 1), so all ranks hold bit-identical weights: one step on the concatenated batch.
- **Sharded update** (``shard_update=True``, ZeRO-1 style): each bucket is split into P contiguous parts of
  ceil(n_k / P) elements; rank r owns part r of every bucket (:func:`shard_ranges`). Each bucket is reduced and
  every rank keeps only its part (a reduce-scatter; see Note [Two reused bucket buffers] for why it is an in-place
  allreduce on gloo); each rank runs the fused update on its parts of the master weights and Adam state only (1/P of
  the update work), then an all-gather rebuilds the full weights. The global norm (clipping, the non-finite check) is
  the square root of the allreduced sum of the shards' squared norms.
  Memory: the rank's host store holds the Adam state of its own parts only (``HostStore(state_ranges=...)``), so with
  N elements in the flat layout, S_r = sum_k |part r of bucket k| (about N / P) and G local fp32 gradient slots its
  arena is ``4 N (1 + G) + 4 * pad64(S_r) * (2, or 3 with amsgrad)`` bytes instead of ``4 N (3 + G)`` (or
  ``4 N (4 + G)``), pad64 rounding up to 16 elements. Besides the arena: the reduced gradient shard (S_r elements
  plus < P per bucket) and two reused buffers of P * ceil(max_k n_k / P) elements for the bucket reductions and
  the all-gathers, so nothing else grows with N. :meth:`Engine.state_dict` (and
  :func:`pyengine.checkpoint.save_engine`) gathers the full Adam state with a collective, so **every rank must call
  it**; :meth:`Engine.load_state_dict` of a full state takes each rank's slice (no collective).
- **Multi-node async** (:func:`run_async`): rank 0 is the server and holds the master store; every other rank is a
  client that pulls the weights, computes a gradient with its local workers and pushes it with point-to-point
  send/recv. One server thread per client applies each push under the engine's mutex, with the engine's staleness
  options (``max_staleness``, ``staleness_lr``), exactly once.

Failures: collectives and point-to-point calls on a dead or failing peer raise (gloo reports the closed connection;
the process group's timeout bounds a silent peer); the engine re-raises them as :class:`DistributedError` naming this
rank and what it was doing, so no rank hangs.
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import math
import os
import threading
import time

import torch
import torch.distributed as dist

from . import ops
from .metrics import step_metrics
from .store import layout_of
from .streamer import make_buckets
from .workers import WorkerError, batch_size, split_batch

__all__ = ["DistributedError", "DistributedHybrid", "init_process_group", "resolve_group", "run_async",
           "gather_optimizer_state", "shard_ranges", "owned_state_ranges"]


class DistributedError(RuntimeError):
    """A collective or point-to-point exchange failed: a peer rank died, raised, or timed out."""


def init_process_group(backend: str = "gloo", timeout_s: float = 60.0, **kwargs) -> None:
    """``torch.distributed.init_process_group`` from the ``torchrun`` environment (MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE), with a timeout that bounds every collective: a silent peer becomes an error after ``timeout_s``."""
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
    if missing and "init_method" not in kwargs:
        raise ValueError(f"init_process_group: the environment lacks {missing}; launch with torchrun or set them")
    if not timeout_s > 0:
        raise ValueError(f"init_process_group: timeout_s must be > 0; got {timeout_s}")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def resolve_group(process_group, shard_update: bool, mode: str):
    """The process group an Engine uses: ``"auto"`` (the default group when torch.distributed is initialized with
    more than one rank), None (single process) or a ``ProcessGroup``. Validates ``shard_update`` and ``mode``."""
    if isinstance(process_group, str):
        if process_group != "auto":
            raise ValueError(f"process_group must be 'auto', None or a torch.distributed ProcessGroup; got "
                             f"{process_group!r}")
        initialized = dist.is_available() and dist.is_initialized()
        process_group = dist.group.WORLD if initialized and dist.get_world_size() > 1 else None
    if process_group is None:
        if shard_update:
            raise ValueError("shard_update=True shards the update across processes: it needs a process group "
                             "(run under torchrun / init_process_group, or pass process_group=...)")
        return None
    if not isinstance(process_group, dist.ProcessGroup):
        raise ValueError(f"process_group must be 'auto', None or a torch.distributed ProcessGroup; got "
                         f"{type(process_group).__name__}")
    if mode == "sync":
        raise ValueError("mode='sync' runs one worker at a time on one host; with a process group use mode='hybrid' "
                         "or mode='async'")
    if shard_update and mode != "hybrid":
        raise ValueError(f"shard_update=True is a hybrid option (sharded synchronous update); mode={mode!r}")
    if mode == "async" and dist.get_world_size(process_group) < 2:
        raise ValueError("multi-node async needs at least 2 ranks (rank 0 serves, the others compute)")
    return process_group


def _part(bucket, world: int) -> int:
    """Elements per rank of a bucket in the sharded update: ceil(n / P) (the last parts may be short or empty)."""
    return -(-(bucket.end - bucket.begin) // world)


def shard_ranges(buckets, rank: int, world: int) -> list[tuple[int, int]]:
    """The elements ``[lo, hi)`` of the flat store that ``rank`` of ``world`` owns in the sharded update, one range
    per bucket in bucket order: part ``rank`` of ceil(n_k / P) elements of bucket k, clipped to the bucket (so empty
    for the last ranks of a bucket smaller than P parts)."""
    ranges = []
    for bucket in buckets:
        lo = min(bucket.begin + rank * _part(bucket, world), bucket.end)
        ranges.append((lo, min(lo + _part(bucket, world), bucket.end)))
    return ranges


def owned_state_ranges(model, grad_dtype: torch.dtype, bucket_mb: float, first_bucket_mb: float,
                       group) -> list[tuple[int, int]]:
    """This rank's :func:`shard_ranges` for ``model`` before any store exists: the ``state_ranges`` of the
    :class:`~pyengine.HostStore` a sharded Engine creates (same layout, same buckets as its streamers)."""
    layout, numel = layout_of(model, grad_dtype)
    buckets = make_buckets(layout, numel, grad_dtype, bucket_mb, first_bucket_mb)
    return shard_ranges(buckets, dist.get_rank(group), dist.get_world_size(group))


@contextlib.contextmanager
def _collective(what: str, rank: int):
    """Re-raises a failed exchange as :class:`DistributedError` naming the rank and the operation."""
    try:
        yield
    except (DistributedError, WorkerError):
        raise
    except RuntimeError as exc:  # gloo's errors, DistBackendError included
        raise DistributedError(f"rank {rank}: {what} failed ({type(exc).__name__}: {exc}); a peer rank died, raised "
                               "or timed out") from exc


def _wait(work, what: str, rank: int) -> None:
    with _collective(what, rank):
        work.wait()


class DistributedHybrid:
    """The multi-node hybrid step of one rank (see the module docstring); built by the Engine.

    Note [Collective order across threads]
    Every rank must issue the same collectives in the same order. During a step only the reducer thread issues them
    (bucket 0, 1, ... in order, each once all local slots have it); the step's thread issues the loss exchange and
    the update's collectives only after joining the reducer. So at any time one thread per rank talks to the group,
    and the order is the bucket order on every rank. A worker failure leaves the reducer blocked on a bucket that
    never arrives: the step raises at once, the rank stops using the group (``broken``), and its peers' pending
    collectives fail when this process exits or after the group's timeout.

    Note [Two reused bucket buffers]
    The sharded path keeps no full-size exchange buffer: bucket k's reduction and all-gather run in
    ``_ring[k % 2]`` (P * ceil(max_k n_k / P) elements each). Before the reducer thread writes bucket k into a ring
    buffer it finishes bucket k - 2 (waits for its reduction and copies this rank's part into ``shard_grad``);
    likewise the all-gather copies bucket k - 2 out of its ring buffer before it launches bucket k. So at most two
    buckets are in flight, in bucket order, and a buffer is never rewritten while a collective still reads or writes
    it; the step's thread finishes the last two after joining the reducer.
    The reduction is an in-place allreduce of the ring buffer, of which this rank keeps its part, rather than
    ``reduce_scatter_tensor``: gloo (the backend for host tensors) implements that as a clone of the input, an
    allreduce of the clone and a copy of one chunk, so it moves the same bytes and costs one more bucket-sized
    buffer per bucket in flight (measured: ~30 MiB more peak RSS per rank with 8 MiB buckets).
    """

    def __init__(self, engine, group, shard_update: bool):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.shard_update = shard_update
        self.buckets = engine.workers[0].streamer.buckets
        self.broken = False
        store = engine.store
        if shard_update:
            self.part = [_part(b, self.world) for b in self.buckets]
            self.owned = shard_ranges(self.buckets, self.rank, self.world)
            if store.state_ranges is None or list(store.state_ranges) != self.owned:
                raise ValueError(f"rank {self.rank}: shard_update=True needs a HostStore whose state_ranges are this "
                                 "rank's owned ranges (distributed.owned_state_ranges); the Engine creates it so")
            self.shard_grad = torch.zeros(sum(self.part))  # this rank's part of each reduced bucket
            self.shard_offset = [sum(self.part[:k]) for k in range(len(self.buckets))]
            # Note [Two reused bucket buffers]
            self._ring = [torch.zeros(self.world * max(self.part)) for _ in range(2)]
            self._mine = [torch.zeros(max(self.part)) for _ in range(2)]
        else:
            self.reduced = torch.zeros(store.numel)
        with _collective("broadcast of the initial weights from rank 0", self.rank):
            dist.broadcast(store.param, src=dist.get_global_rank(group, 0), group=group)
        for worker in engine.workers:
            worker.pull(wait=True)

    # ---- the step ---------------------------------------------------------------------------------------------

    def step(self, engine, batch) -> dict:
        if self.broken:
            raise DistributedError(f"rank {self.rank}: an earlier step failed; the group is no longer usable")
        start = time.perf_counter()
        shards = split_batch(batch, engine.num_workers)
        sizes = [batch_size(s) for s in shards]
        counts = torch.tensor([float(sum(sizes))], dtype=torch.float64)
        with _collective("allreduce of the batch sizes", self.rank):
            dist.all_reduce(counts, group=self.group)
        total = counts.item()
        weights = [n / total for n in sizes]
        self._share_buffers(engine)
        works, errors = [], []
        reducer = threading.Thread(target=self._reduce_buckets, args=(engine, weights, works, errors),
                                   name="pyengine-reducer", daemon=True)
        reducer.start()

        def task(worker, shard):
            def run():
                with engine.phase("forward_backward+transfer", worker.index):
                    return worker.compute(engine.loss_fn, [shard])
            return run

        try:
            results = engine.run_workers({w.index: task(w, s) for w, s in zip(engine.workers, shards)})
        except BaseException:
            self.broken = True  # Note [Collective order across threads]
            raise
        reducer.join()
        engine.count("steps")
        computed = time.perf_counter()
        try:
            if errors:
                raise errors[0]
            with engine.phase("allreduce_wait"):
                for k, work in enumerate(works):
                    if work is None:  # the reducer finished it (Note [Two reused bucket buffers])
                        continue
                    if self.shard_update:
                        self._finish_reduce(works, k)
                    else:
                        _wait(work, "gradient bucket reduction", self.rank)
            loss = torch.tensor([sum(results[i][0] * n for i, n in enumerate(sizes))], dtype=torch.float64)
            with _collective("allreduce of the loss", self.rank):
                dist.all_reduce(loss, group=self.group)
            reduced = time.perf_counter()
            with engine.phase("update"):
                applied = self._update_sharded(engine) if self.shard_update else engine.apply_update(
                    [], None, grads=[self.reduced])
        except BaseException:
            self.broken = True
            raise
        updated = time.perf_counter()
        with engine.phase("copy_back"):
            engine.run_workers({w.index: w.pull for w in engine.workers})
        end = time.perf_counter()
        return step_metrics(engine, loss=loss.item() / total, samples=int(total), wall=end - start,
                            compute=max(r[1] for r in results.values()), update=updated - reduced,
                            transfer_wait=max(r[2] for r in results.values()) + reduced - computed,
                            copy_back=end - updated, applied=applied, rank=self.rank, world_size=self.world,
                            local_samples=sum(sizes))

    def _share_buffers(self, engine) -> None:
        """DDP's broadcast_buffers across ranks: rank 0's worker 0 buffers go to every replica of every rank."""
        if not engine.buffer_names:
            return
        named = dict(engine.workers[0].replica.named_buffers())
        with _collective("broadcast of the buffers from rank 0", self.rank):
            for name in engine.buffer_names:
                dist.broadcast(named[name], src=dist.get_global_rank(self.group, 0), group=self.group)
        engine.share_buffers(range(engine.num_workers))

    def _reduce_buckets(self, engine, weights, works, errors) -> None:
        """Reducer thread: for each bucket in order, wait for it in every local slot, weighted local sum into the
        reduce buffer (sharded: a ring buffer), launch its allreduce asynchronously."""
        store = engine.store
        slots = [store.grad_slot(w.index) for w in engine.workers]
        try:
            for bucket in self.buckets:
                k, b, e = bucket.index, bucket.begin, bucket.end
                for worker in engine.workers:
                    worker.streamer.wait(k)
                if self.shard_update:
                    if k >= 2:  # Note [Two reused bucket buffers]
                        self._finish_reduce(works, k - 2)
                    region = self._ring[k % 2][:self.world * self.part[k]]
                    self._local_sum(region[:e - b], [s[b:e] for s in slots], weights)
                    region[e - b:].zero_()
                    with _collective("reduction of a gradient bucket", self.rank):
                        works.append(dist.all_reduce(region, group=self.group, async_op=True))
                else:
                    region = self.reduced[b:e]
                    self._local_sum(region, [s[b:e] for s in slots], weights)
                    with _collective("allreduce of a gradient bucket", self.rank):
                        works.append(dist.all_reduce(region, group=self.group, async_op=True))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the step's thread
            errors.append(exc)

    def _finish_reduce(self, works: list, k: int) -> None:
        """Waits for bucket k's reduction and keeps this rank's part of it in ``shard_grad``."""
        _wait(works[k], "reduction of a gradient bucket", self.rank)
        works[k] = None
        part = self.part[k]
        self.shard_grad[self.shard_offset[k]:self.shard_offset[k] + part] = \
            self._ring[k % 2][self.rank * part:(self.rank + 1) * part]

    @staticmethod
    def _local_sum(out: torch.Tensor, grads: list[torch.Tensor], weights: list[float]) -> None:
        """out = sum_g weights[g] * grads[g] in fp32, in worker order (a fixed order: reproducible)."""
        out.copy_(grads[0]).mul_(weights[0])
        for grad, weight in zip(grads[1:], weights[1:]):
            out.add_(grad.float(), alpha=weight)

    def _update_sharded(self, engine) -> bool:
        """Fused update on this rank's parts, with the global norm; then all-gather the weights."""
        store, opt = engine.store, engine.optimizer
        grads = [self.shard_grad[self.shard_offset[k]:self.shard_offset[k] + hi - lo]
                 for k, (lo, hi) in enumerate(self.owned)]
        sq, bad = 0.0, 0.0
        for grad in grads:
            if grad.numel():
                norm, nonfinite = ops.mean_grad_norm([grad])
                sq, bad = sq + norm.double().item() ** 2, max(bad, nonfinite.item())
        summary = torch.tensor([sq, bad], dtype=torch.float64)
        with _collective("allreduce of the shard norms", self.rank):
            dist.all_reduce(summary, group=self.group)
        if not engine.admit_update(summary[1].item() != 0.0 or not math.isfinite(summary[0].item()), []):
            return False
        clip = opt.max_grad_norm or 0.0
        norm = torch.tensor(math.sqrt(summary[0].item()), dtype=torch.float32)
        for (lo, hi), grad in zip(self.owned, grads):
            if hi > lo:
                state = store.state_slice(lo, hi)
                torch.ops.pyengine.mean_grad_adamw_.default(
                    store.param[lo:hi], store.exp_avg[state], store.exp_avg_sq[state], [grad],
                    **opt.kernel_kwargs(), step=engine.version,
                    max_exp_avg_sq=None if store.max_exp_avg_sq is None else store.max_exp_avg_sq[state],
                    grad_scale=None, found_inf=None, weights=None, param_out=None,
                    grad_norm=norm if clip else None, max_grad_norm=float(clip))
        self._all_gather([store.param[lo:hi] for lo, hi in self.owned], store.param, "the updated weights")
        if store.shadow is not None:
            store.shadow.copy_(store.param)
        return True

    def _all_gather(self, parts: list[torch.Tensor], out: torch.Tensor, what: str) -> None:
        """Every rank's ``parts`` (this rank's elements of each bucket, :attr:`owned`) -> ``out`` (a flat tensor of
        the store's ``numel``), bucket by bucket through the two ring buffers (Note [Two reused bucket buffers])."""
        pending = collections.deque()
        for k, part in enumerate(parts):
            if len(pending) == 2:
                self._unpack_gathered(*pending.popleft(), out, what)
            mine = self._mine[k % 2][:self.part[k]]
            mine[:part.numel()] = part
            mine[part.numel():].zero_()
            region = self._ring[k % 2][:self.world * self.part[k]]
            with _collective(f"all-gather of {what}", self.rank):
                pending.append((k, dist.all_gather_into_tensor(region, mine, group=self.group, async_op=True)))
        while pending:
            self._unpack_gathered(*pending.popleft(), out, what)

    def _unpack_gathered(self, k: int, work, out: torch.Tensor, what: str) -> None:
        _wait(work, f"all-gather of {what}", self.rank)
        bucket = self.buckets[k]
        out[bucket.begin:bucket.end] = self._ring[k % 2][:bucket.end - bucket.begin]

    def gather_state(self, engine) -> dict[str, torch.Tensor]:
        """The full Adam state, assembled from every rank's packed parts: see :func:`gather_optimizer_state`."""
        if self.broken:
            raise DistributedError(f"rank {self.rank}: an earlier step failed; the group is no longer usable")
        store, full = engine.store, {}
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            packed = getattr(store, name)
            if packed is not None:
                full[name] = torch.zeros(store.numel)
                self._all_gather([packed[store.state_slice(lo, hi)] for lo, hi in self.owned], full[name],
                                 f"the optimizer state ({name})")
        return full


def gather_optimizer_state(engine) -> dict[str, torch.Tensor] | None:
    """On a sharded engine (``shard_update=True``): the full Adam state, ``{"exp_avg": ..., "exp_avg_sq": ...,
    ["max_exp_avg_sq": ...]}`` as flat tensors of the store's ``numel`` elements, all-gathered from the parts each
    rank holds; identical on every rank. None on an engine without a sharded update (its store holds the full state).

    A collective: every rank must call it, in the same order relative to the steps. :meth:`Engine.state_dict` and
    :meth:`Engine.optimizer_state_dict` call it, so on a sharded engine they are collectives too.
    """
    hybrid = getattr(engine, "dist", None)
    if not isinstance(hybrid, DistributedHybrid) or not hybrid.shard_update:
        return None
    return hybrid.gather_state(engine)


# ---- multi-node async: rank 0 serves, the other ranks push --------------------------------------------------------

# Header of a server -> client message: [status, version, id of this client's last applied push]; of a client ->
# server message: [kind, push_id, version_at_pull, samples, loss]. float64 tensors (exact for these integers).
_GO, _REFRESH, _STOP, _ABORT = 0.0, 1.0, 2.0, 3.0
_PUSH, _DONE = 0.0, 1.0


class AsyncServer:
    """Rank 0 of a multi-node async run: one thread per client, each applying that client's pushes under the
    engine's mutex.

    Note [Multi-node async exchange]
    Per client, strictly alternating messages on the pair (0, client) with tag = client rank, so the threads of
    different clients never match each other's messages: the server sends [status, version, last applied id] +
    weights (a snapshot taken under the mutex, sent outside it); the client answers [PUSH, id, version at pull,
    samples, loss] + gradient, or [DONE]. status tells the client to go on with new mini-batches (GO), to recompute
    the same ones on these weights because its push was too stale (REFRESH: same push id), that the run is over
    (STOP) or that it failed on another rank (ABORT). Each push is applied at most once under the mutex and the
    client learns from the next header which of its pushes was applied, before it sends anything else.
    Staleness = version at apply - version at pull.
    """

    def __init__(self, engine, group, steps, callbacks):
        self.engine, self.group, self.steps, self.callbacks = engine, group, steps, callbacks
        self.stop = threading.Event()
        self.errors: list[BaseException] = []

    def run(self) -> None:
        ranks = range(1, dist.get_world_size(self.group))
        threads = [threading.Thread(target=self._serve, args=(c,), name=f"pyengine-serve-{c}", daemon=True)
                   for c in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.errors:
            raise self.errors[0]

    def _serve(self, client: int) -> None:
        engine, peer = self.engine, dist.get_global_rank(self.group, client)
        header = torch.zeros(5, dtype=torch.float64)
        grad = torch.zeros(engine.store.numel)
        status, last_applied = _GO, 0
        try:
            while True:
                with engine.mutex:
                    weights, version = engine.store.param.clone(), engine.version
                if self.stop.is_set():
                    status = _ABORT if self.errors else _STOP
                self._send(torch.tensor([status, float(version), float(last_applied)], dtype=torch.float64), peer,
                           client)
                self._send(weights, peer, client)
                if status in (_STOP, _ABORT):
                    return
                self._recv(header, peer, client)
                if header[0].item() == _DONE:
                    return
                self._recv(grad, peer, client)
                status = self._apply(client, grad, header)
                if status == _GO:
                    last_applied = int(header[1].item())
        except BaseException as exc:  # noqa: BLE001 - re-raised by run()
            self.errors.append(exc if isinstance(exc, DistributedError) else DistributedError(
                f"rank 0 (async server): serving rank {client} failed ({type(exc).__name__}: {exc})"))
            self.stop.set()

    def _apply(self, client: int, grad: torch.Tensor, header: torch.Tensor) -> float:
        engine = self.engine
        push_id, pulled, samples, loss = (int(header[1].item()), int(header[2].item()), int(header[3].item()),
                                          header[4].item())
        with engine.mutex, engine.phase("push", client):
            if self.stop.is_set():
                return _STOP
            start = time.perf_counter()
            pushed = engine.apply_push(pulled, [], grads=[grad])
            if pushed is None:
                return _REFRESH
            applied, staleness = pushed
            update = time.perf_counter() - start
            metrics = step_metrics(engine, loss=loss, samples=samples, wall=update, compute=0.0, update=update,
                                   transfer_wait=0.0, copy_back=0.0, applied=applied, worker=client, rank=client,
                                   push_id=push_id, version_at_pull=pulled,
                                   version_at_apply=engine.version - int(applied), staleness=staleness)
            engine.history.append(metrics)
            for callback in self.callbacks:
                callback(engine, metrics)
            if self.steps is not None and engine.stats()["pushes"] >= self.steps:
                self.stop.set()
        return _GO

    def _send(self, tensor, peer, client):
        with _collective(f"send to rank {client}", 0):
            dist.send(tensor, dst=peer, group=self.group, tag=client)

    def _recv(self, tensor, peer, client):
        with _collective(f"receive from rank {client}", 0):
            dist.recv(tensor, src=peer, group=self.group, tag=client)


def _run_client(engine, group, batches, epochs) -> None:
    """A client rank: pull, compute with the local workers (node-local hybrid), push; until STOP or no data."""
    from .asynchronous import _BatchSource

    rank = dist.get_rank(group)
    server = dist.get_global_rank(group, 0)
    source = _BatchSource(batches, epochs)
    header = torch.zeros(3, dtype=torch.float64)
    store = engine.store
    reduced = torch.zeros(store.numel)
    slots = [store.grad_slot(w.index) for w in engine.workers]
    minibatches, push_id, sent_at = None, 0, 0

    def exchange(op, tensor, what):
        with _collective(f"{what} (async client of rank 0)", rank):
            op(tensor, server, group=group, tag=rank)

    while True:
        exchange(dist.recv, header, "receive of the server's status")
        exchange(dist.recv, store.param, "receive of the weights")
        status, pulled, applied = header[0].item(), int(header[1].item()), int(header[2].item())
        if applied and (not engine.history or engine.history[-1]["push_id"] != applied):
            engine.history.append(dict(push_id=applied, rank=rank, applied=True, version_at_pull=sent_at))
        if status == _ABORT:
            raise DistributedError(f"rank {rank}: the async server (rank 0) stopped the run because another rank "
                                   "failed")
        if status == _STOP:
            return
        if status == _GO:  # the previous push (if any) was applied: next mini-batches
            k = engine.batch_schedule(pulled) if engine.batch_schedule else engine.accumulate
            minibatches = source.take(int(k))
        else:
            engine.count("refreshes")
        if not minibatches:
            exchange(dist.send, torch.tensor([_DONE, 0, 0, 0, 0], dtype=torch.float64), "send of DONE")
            return
        for worker in engine.workers:
            worker.pull(wait=True)
        loss, samples = _client_gradient(engine, minibatches, slots, reduced)
        push_id += 1 if status == _GO else 0
        sent_at = pulled
        engine.count("pushes")
        exchange(dist.send, torch.tensor([_PUSH, push_id, pulled, samples, loss], dtype=torch.float64),
                 "send of a push header")
        exchange(dist.send, reduced, "send of a gradient")


def _client_gradient(engine, minibatches, slots, out) -> tuple[float, int]:
    """The local workers split every mini-batch; out = their weighted sum (the sum over the mini-batches of each
    mini-batch's mean gradient, as the single-node async ``accumulate``)."""
    shards = [split_batch(b, engine.num_workers) for b in minibatches]
    sizes = [batch_size(s) for s in shards[0]]
    weights = [n / sum(sizes) for n in sizes]
    results = engine.run_workers({w.index: (lambda w=w: w.compute(engine.loss_fn, [s[w.index] for s in shards]))
                                  for w in engine.workers})
    DistributedHybrid._local_sum(out, slots, weights)
    loss = sum(results[i][0] * weights[i] for i in results)
    return loss, sum(batch_size(b) for b in minibatches)


def run_async(engine, group, batches, *, steps, epochs, callbacks) -> None:
    """Multi-node async (see :class:`AsyncServer`): rank 0 serves until ``steps`` pushes are applied or every client
    ran out of data; the other ranks compute on their ``batches`` and push."""
    if dist.get_rank(group) == 0:
        AsyncServer(engine, group, steps, callbacks).run()
    else:
        _run_client(engine, group, batches, epochs)
