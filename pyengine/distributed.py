"""Beyond one machine: the engine over torch.distributed (gloo for host tensors).

Every process runs an :class:`~pyengine.Engine` over its local devices; the processes are the ranks of a
torch.distributed process group (``torchrun`` sets the environment; :func:`init_process_group` reads it).

- **Multi-node hybrid** (:class:`DistributedHybrid`): a step splits each rank's local batch across its local workers;
  the global batch size is exchanged first, so every local gradient slot gets the weight (its samples / global samples);
  every rank's version comes with it, and ranks at different versions (a state loaded on one rank only) refuse the step
  together (Note [Every rank at the same version]). As soon as bucket k is in all local slots, the host forms the local
  weighted sum of bucket k and launches an asynchronous allreduce(SUM) of it, while the other buckets are still being
  computed and copied. The reduced buffer is the global mean gradient, identical on every rank; every rank applies the
  same fused update (``mean_grad_adamw_`` with G = 1), so all ranks hold bit-identical weights: one step on the
  concatenated batch.
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
- **Multi-node async** (:func:`run_async`, ``Engine(..., mode="async", servers=K)``): ranks 0..K-1 are parameter
  servers, rank s holding and updating shard s of the flat store (contiguous, split on element boundaries, sizes
  differing by at most one: :func:`shard_spans`); every other rank is a client that pulls every shard, computes a
  gradient with its local workers and pushes each server its slice with point-to-point send/recv. One server thread
  per client applies that client's pushes to the server's shard under the server's mutex. Rank 0 also coordinates:
  it alone decides each push (``max_staleness`` refresh, the end of the run), then the client commits the push to
  the other servers, so a push is applied by all servers or none, exactly once each. Version and staleness are
  global (rank 0's count of applied pushes; staleness = the most applied pushes missing from any shard of the
  weights the gradient was computed on), since per-shard values would let shards disagree on refreshing and on the
  ``staleness_lr`` damping. Clipping and the non-finite skip use the norm of the whole pushed gradient, which the
  client computes and sends in the push header. At the end of a run every rank receives every shard (weights, Adam
  state, version). With K = 1 (the default) rank 0 is the only server. Details: Note [Multi-node async exchange].

Configuration: every rank's Engine is compared with the others' before the first collective; ranks built differently,
or a rank that failed its own checks, make every rank raise one ValueError that names the difference or the rank
(:func:`check_same_config`, Note [Every rank's engine alike]).

Failures: collectives and point-to-point calls on a dead or failing peer raise (gloo reports the closed connection;
the process group's timeout bounds a silent peer); the engine re-raises them as :class:`DistributedError` naming this
rank and what it was doing, so no rank hangs. In multi-node hybrid, a rank that raises inside a step records
"rank f failed: <type>: <first line>" in the rendezvous store and its peers' errors end with it (Note [Naming the
rank that failed]; a non-finite gradient under ``nonfinite="raise"`` is no failure: every rank decides it from the
same reduced norm and raises the FloatingPointError together, and the engine trains on, as in one process); a rank
that dies, raises or hangs between steps is named from the phases each rank checked in for ("rank f never reached
step n (ranks ... did ...)"; Note [Naming a rank that died between steps]); a rank that dies inside a step is
reported as such ("every rank ... reached step n, so a peer died ... inside it"); when rank 0, the store's host, is
the one gone, the errors say so. In multi-node async, a rank that dies or raises makes every other
rank raise ``DistributedError: rank r: the async run stopped because rank f failed: ...`` naming the failed rank f
and, when f raised, its error's type and first line: the servers see the broken exchange (or a client's report) and
tell their other clients ABORT; a client that stops tells the servers waiting for it which rank failed and why; a
client that ended normally waits for every server's STOP or ABORT before the end-of-run broadcast. A rank that hangs
is named as "rank f did not answer within the process group's timeout (T s)" within about 2 T (Note [A timeout names
the rank that hangs]). A rank gone between runs (before a fit) is named from the check-ins of :class:`AsyncNaming`,
or with the error it recorded (:meth:`Engine.record_failure`). Tested (tests/test_distributed.py): a client, the
coordinating server and a non-coordinating server that exit, raise or hang, with 1 and 2 servers; a client that ended
before another failed; an async rank gone between runs; a hybrid rank whose loss raises or that exits mid-step, one
that exits (replicated, sharded, rank 0), raises or hangs between steps.
"""
from __future__ import annotations

import atexit
import collections
import collections.abc
import contextlib
import ctypes
import datetime
import itertools
import math
import os
import pickle
import struct
import threading
import time
import typing
import warnings
import weakref
import zlib

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401 - before any group: Note [Importing the distributed pipeline]

from . import ops
from .metrics import step_metrics
from .scaler import grad_scale_tensor
from .store import layout_of
from .streamer import _POLL_S, make_buckets
from .workers import WorkerError, batch_size, split_batch, split_microbatches, whole_buffers

__all__ = ["DistributedError", "PeerEndedFit", "DistributedHybrid", "init_process_group", "resolve_group",
           "check_same_config", "report_failed_config", "run_async", "gather_optimizer_state", "shard_ranges",
           "owned_state_ranges", "check_servers", "shard_spans"]


class DistributedError(RuntimeError):
    """A collective or point-to-point exchange failed: a peer rank died, raised, or timed out."""


class PeerEndedFit(DistributedError):
    """Another rank's :meth:`Engine.fit` ended (Note [Ranks whose fits end at different steps]) while this rank
    stepped, or it raised while this rank's fit ended too: ``ranks`` are those ranks, ``failed`` whether their fit
    raised. A step that meets it is refused on every rank before any work, and the group stays usable. Inside fit
    this rank's fit ends there too (with a warning, or raising this when the other rank's fit raised); a step()
    called by hand raises it: the ranks made different calls."""

    def __init__(self, message: str, ranks: list[int] = (), failed: bool = False):
        super().__init__(message)
        self.ranks, self.failed = list(ranks), failed

    def __reduce__(self):  # pickled (a worker's error sent to another process) with its fields
        return type(self), (str(self), self.ranks, self.failed)


MAX_TIMEOUT_S = 7 * 24 * 3600  # a group's longest timeout: far above any checkpoint write (larger ones overflowed
#                                timedelta or gloo)


def init_process_group(backend: str = "gloo", timeout_s: float = 60.0, **kwargs) -> None:
    """``torch.distributed.init_process_group`` from the ``torchrun`` environment (MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE), with a timeout that bounds every collective: a silent peer becomes an error after ``timeout_s``."""
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
    if missing and "init_method" not in kwargs:
        raise ValueError(f"init_process_group: the environment lacks {missing}; launch with torchrun or set them")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"init_process_group: timeout_s must be a number of seconds > 0 and at most {MAX_TIMEOUT_S} "
                         f"(a week); got {timeout_s!r}")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def resolve_group(process_group, shard_update: bool, mode: str):
    """The process group an Engine uses: ``"auto"`` (the default group when torch.distributed is initialized with
    more than one rank), None (single process) or a ``ProcessGroup``. Validates ``shard_update`` and ``mode``."""
    alone = False  # "auto" with torch.distributed initialized on 1 rank (torchrun --nproc-per-node 1)
    if isinstance(process_group, str):
        if process_group != "auto":
            raise ValueError(f"process_group must be 'auto', None or a torch.distributed ProcessGroup; got "
                             f"{process_group!r}")
        initialized = dist.is_available() and dist.is_initialized()
        alone = initialized and dist.get_world_size() == 1
        process_group = dist.group.WORLD if initialized and dist.get_world_size() > 1 else None
        world = os.environ.get("WORLD_SIZE", "1")
        if not initialized and world.isdigit() and int(world) > 1:  # each rank trained alone, on its own batches
            warnings.warn(f"Engine: WORLD_SIZE={world} (launched by torchrun?) but torch.distributed is not "
                          "initialized, so process_group='auto' trains in this process alone; call "
                          "pyengine.distributed.init_process_group(...) before building the Engine, or pass "
                          "process_group=None to train alone without this warning", RuntimeWarning, stacklevel=3)
    if process_group is None:
        if shard_update and alone:
            raise ValueError("shard_update=True shards the update across the ranks of a process group, and the "
                             "default torch.distributed group has only 1 rank (WORLD_SIZE=1), so process_group='auto' "
                             "runs this process alone: leave shard_update out, or launch more than one rank")
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


_ENGINES_ALIKE = ("engines are not configured alike (every rank builds its Engine from the same model and options; "
                  "the devices may differ)")


def check_same_config(group, config: dict, what: str = _ENGINES_ALIKE,
                      failed: str = "could not build its Engine", local=None) -> list:
    """Raises ValueError on every rank unless every rank of ``group`` passed an equal ``config`` (a dict of picklable
    values: what this rank's Engine was built with): "rank r: the P ranks' <what>: <each difference>". A collective:
    every rank calls it, before any other. A rank whose own checks failed first calls :func:`report_failed_config`
    instead: the others then raise naming it and its error ("rank r <failed>: <error>"). ``local``: a picklable value
    of this rank that may differ by rank and is not compared (the Engine's: its number of local workers); returns
    every rank's, in rank order.

    Note [Every rank's engine alike]
    The ranks of a group run one training: their collectives pair up by order and size, and each rank applies the
    same reduced gradient with its own copy of the optimizer. Ranks built differently fail far from the cause or not
    at all: a model of other shapes or other buckets makes gloo abort the process with a size mismatch in native code
    (no Python error) and the other ranks blame the wrong one; another mode or ``shard_update`` pairs a collective
    with a different one and every rank hangs until the timeout; another lr, weight decay, clipping or schedule trains
    on with ranks whose weights drift apart, silently; a model in eval mode on one rank (BatchNorm on its running
    statistics, no dropout) mixes other gradients into every step; another seed trains alike but cannot resume alike
    (the state keeps rank 0's seed, from which every rank's generators are seeded). So the Engine gathers every rank's
    configuration once, before its first collective, and every rank raises the same error naming what differs and on
    which ranks. A rank that fails its own checks before that point (its devices, say) joins the same exchange with
    its error, so the others name it at once instead of failing in their next collective. What may differ by rank is
    left out: the local devices (their number included: each rank's local batch is split among its workers and
    weighted by samples; the numbers are gathered alongside, uncompared, to give every worker of the group its own
    random generator, Note [Random numbers of concurrent workers]), hybrid's ``microbatches`` (a memory setting of
    the local workers: the same step), an async client's ``accumulate`` and ``batch_schedule`` (what it computes
    before a push), ``pin``, ``loss_fn`` and the process group itself. Schedules are compared by their values at a
    few steps (they are called there once, at construction), floats by their bits (NaN equals NaN).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gathered = _gather_configs(group, rank, {**config, _LOCAL_KEY: local})
    failures = [(r, c[_FAILED_KEY]) for r, c in enumerate(gathered) if isinstance(c, dict) and _FAILED_KEY in c]
    if failures:
        raise ValueError(f"rank {rank}: " + "; ".join(f"rank {r} {failed}: {text}" for r, text in failures))
    keys = list(dict.fromkeys(k for c in gathered if isinstance(c, dict) for k in c if k != _LOCAL_KEY))
    differences = []
    for key in keys:
        values = [c.get(key, "<missing>") if isinstance(c, dict) else "<missing>" for c in gathered]
        differing = [r for r, v in enumerate(values) if not _same(v, values[0])]
        if differing:
            first, other = _first_difference(values[0], values[differing[0]])
            differences.append(f"{key}: rank 0 has {first}, rank{'s' if len(differing) > 1 else ''} "
                               f"{', '.join(map(str, differing))} {other}")
    if differences:
        raise ValueError(f"rank {rank}: the {world} ranks' {what}: " + "; ".join(differences))
    return [c.get(_LOCAL_KEY) for c in gathered]


_FAILED_KEY = "<this rank failed>"
_LOCAL_KEY = "<this rank's own, not compared>"


def report_failed_config(process_group, exc: BaseException) -> None:
    """For a rank whose Engine failed its own checks before :func:`check_same_config`: joins that exchange with its
    error, so that the other ranks raise naming it (Note [Every rank's engine alike]). Best effort: nothing when no
    group is resolved (``process_group`` as the Engine takes it) or the exchange itself fails; the caller re-raises
    its own error."""
    if isinstance(process_group, str) and process_group == "auto":
        initialized = dist.is_available() and dist.is_initialized()
        process_group = dist.group.WORLD if initialized and dist.get_world_size() > 1 else None
    if not isinstance(process_group, dist.ProcessGroup):
        return
    with contextlib.suppress(DistributedError, RuntimeError):
        _gather_configs(process_group, dist.get_rank(process_group), {_FAILED_KEY: _short_error(exc)})


def _gather_configs(group, rank: int, config: dict) -> list:
    with _collective("the check that every rank's engine is configured alike", rank):
        return all_gather_object(config, group)


# Note [Gloo's works are released by the thread that waits]
# A gloo collective runs on one of the process group's worker threads (ProcessGroupGloo::runLoop), which holds the
# collective's work, and through it the work's tensors, until a little after the caller's wait has returned. When the
# worker drops the last reference to the work, the work's tensors lose a C++ reference; for a tensor that has a
# Python object, torch then releases that object (its TensorImpl holds a strong reference to it while C++ does),
# which takes the GIL, whether or not Python still references the tensor. Taking the GIL during interpreter shutdown
# ends the thread inside a destructor: std::terminate, "terminate called without an active exception", SIGABRT. It
# happened to a rank of a pipeline across processes in about 1 exit in 10 on a loaded machine, its engine still
# referenced by the script: the core showed gloo's runLoop destroying the broadcast of the final gather while the
# main thread was in Py_FinalizeEx (the main thread had kept the GIL from the wait's return to the exit); it had
# happened before on ranks exiting after a failed step.
# So every collective the engine issues is issued with ``async_op=True`` and waited for by the caller, and the
# caller keeps the work (:class:`KeptWorks`: the engine's last 4096, this module's last 256 for exchanges outside an
# engine). The worker thread then never drops the last reference: the work and its tensors are released by Python,
# with the GIL, when the work leaves the window (thousands of collectives later) or its engine is freed. An engine
# still alive when the interpreter begins to exit (atexit: before finalization) is kept alive past its end, with
# its works (a deliberate leak of what the process is about to give back anyway), so no work of it is released
# during finalization either. An engine freed just before the exit (a local of ``main()``, the script ending with a
# checkpoint) drops its works with it, and gloo's thread may still hold the last one; so the exit also waits 50 ms
# with the GIL released (atexit), in which such a thread takes the GIL and lets go. A precaution whose effect was
# too small to measure: such a script aborted once in 20 exits, then in none of 85 without the wait and 70 with it.
# (Tested by reference: every collective of a step, a gather and a checkpoint is kept; the exit itself is a race,
# measured in bench/RESULTS.md: 0 aborts in 70 runs of a 2-rank script, 5 in 40 before.)


class KeptWorks:
    """The works of the last ``size`` collectives issued through :meth:`run` / :meth:`start`, kept (Note [Gloo's
    works are released by the thread that waits])."""

    def __init__(self, size: int):
        self.works: collections.deque = collections.deque(maxlen=size)

    def start(self, collective, /, *args, **kwargs):
        """``collective(*args, async_op=True, **kwargs)`` (a torch.distributed collective); returns its work,
        kept."""
        work = collective(*args, async_op=True, **kwargs)
        self.works.append(work)
        return work

    def run(self, collective, /, *args, **kwargs) -> None:
        """:meth:`start`, then waits for the work: a blocking collective whose work is kept."""
        self.start(collective, *args, **kwargs).wait()


_WORKS = KeptWorks(256)  # the exchanges outside an engine: the objects below, the CLI's stop agreement
_ENGINES: "weakref.WeakSet" = weakref.WeakSet()
_EXIT_GRACE_S = 0.05
_grace_at_exit = False  # an engine with a process group was built: its works may be the last ones gloo releases


def keep_through_exit(engine) -> None:
    """Registers ``engine`` (with a process group) to be kept alive through the interpreter's exit if it is alive
    then, with the works it keeps (Note [Gloo's works are released by the thread that waits])."""
    global _grace_at_exit
    _grace_at_exit = True
    _ENGINES.add(engine)


def run(collective, /, *args, **kwargs) -> None:
    """A blocking collective outside an engine, its work kept by this module (Note [Gloo's works are released by
    the thread that waits])."""
    _WORKS.run(collective, *args, **kwargs)


def _keep_at_exit() -> None:
    for kept in (*_ENGINES, _WORKS):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))
    if _grace_at_exit:  # an engine freed just before the exit (a local of main()) dropped its works with it: a
        time.sleep(_EXIT_GRACE_S)  # gloo thread still releasing one takes the GIL now, before finalization


atexit.register(_keep_at_exit)


def _pickled(obj) -> torch.Tensor:
    """``obj`` pickled into a uint8 tensor of its own (what the object exchanges below send)."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).clone()


# Note [Exchanges that pair up wrongly]
# A collective carries no name. When the ranks make different calls (rank 0 steps once more while rank 1, its data
# done, saves a checkpoint), the step's all-gather of the batch sizes pairs with the checkpoint's exchange of an
# object's size, and gloo pairs them byte for byte: rank 0 read rank 1's pickle length as a version and raised that
# the ranks hold different states (false: nobody had loaded anything), and rank 1 aborted in native code (more
# bytes came than its output held). So both exchanges send a header of the same size, HEADER_LEN float64s per rank,
# whose first element names the call (_STEP_TAG, _OBJECT_TAG), into an output zeroed first; a rank that reads
# another tag (or none) raises, and its DistributedError says which phase each rank is in (Note [Naming a rank that
# died between steps]: the ranks made different calls). Both sides raise after this one exchange, so neither waits
# on a collective the other never makes; the group is out of step and refused from then on.
# A step's header also pairs with another rank's end of fit (_END_TAG: Note [Ranks whose fits end at different
# steps]), which is no error.
HEADER_LEN = 5
_STEP_TAG, _OBJECT_TAG, _END_TAG = 5005.0, 7007.0, 6006.0


def _check_tags(gathered: torch.Tensor, tag: float, partner: float | None = None) -> None:
    """Raises RuntimeError (a failed exchange) unless every rank's header in ``gathered`` (world x HEADER_LEN) starts
    with ``tag`` or ``partner`` (Note [Exchanges that pair up wrongly])."""
    others = [r for r, t in enumerate(gathered[:, 0].tolist()) if t != tag and t != partner]
    if others:
        raise RuntimeError(f"{_rank_list(others)} sent the data of another exchange: the collectives paired up "
                           "wrongly")


def all_gather_object(obj, group, works: KeptWorks = _WORKS) -> list:
    """``torch.distributed.all_gather_object`` whose works are kept (torch's are not: Note [Gloo's works are
    released by the thread that waits]). Pickles: for the engine's own small dicts between the ranks of one job. A
    rank in another exchange (a step) raises RuntimeError on both sides (Note [Exchanges that pair up wrongly])."""
    world = dist.get_world_size(group)
    data = _pickled(obj)
    header = torch.zeros(HEADER_LEN, dtype=torch.float64)
    header[0], header[1] = _OBJECT_TAG, float(data.numel())
    headers = torch.zeros(world, HEADER_LEN, dtype=torch.float64)
    works.run(_all_gather_flat, headers.view(-1), header, group=group)
    _check_tags(headers, _OBJECT_TAG)
    sizes = headers[:, 1].to(torch.int64)
    longest = int(sizes.max())
    mine, everyone = torch.zeros(longest, dtype=torch.uint8), torch.zeros(world * longest, dtype=torch.uint8)
    mine[:data.numel()] = data
    works.run(_all_gather_flat, everyone, mine, group=group)
    return [pickle.loads(everyone[r * longest:r * longest + int(sizes[r])].numpy().tobytes()) for r in range(world)]


def broadcast_object(obj, group, src: int = 0, works: KeptWorks = _WORKS):
    """``torch.distributed.broadcast_object_list`` of one object from the group's rank ``src``, its works kept;
    returns rank ``src``'s object on every rank."""
    source = dist.get_global_rank(group, src)
    size = torch.zeros(1, dtype=torch.int64)
    data = None
    if dist.get_rank(group) == src:
        data = _pickled(obj)
        size[0] = data.numel()
    works.run(dist.broadcast, size, src=source, group=group)
    if data is None:
        data = torch.zeros(int(size[0]), dtype=torch.uint8)
    works.run(dist.broadcast, data, src=source, group=group)
    return pickle.loads(data.numpy().tobytes())


def _same(a, b) -> bool:
    """Equal, or alike to the bit (``repr``: a NaN equals a NaN, which ``==`` denies)."""
    return a == b or repr(a) == repr(b)


def _first_difference(a, b) -> tuple[str, str]:
    """Where two values differ, short: a list's first differing entry (or its length), else the values."""
    def short(value) -> str:
        text = repr(value)
        return text if len(text) <= 120 else text[:117] + "..."

    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b)):
            if not _same(x, y):
                return f"[{i}] = {short(x)}", f"[{i}] = {short(y)}"
        return f"{len(a)} entries", f"{len(b)} entries"
    if isinstance(a, dict) and isinstance(b, dict):
        keys = [k for k in {**a, **b} if not _same(a.get(k, "<missing>"), b.get(k, "<missing>"))]
        return (", ".join(f"{k}={short(a.get(k, '<missing>'))}" for k in keys),
                ", ".join(f"{k}={short(b.get(k, '<missing>'))}" for k in keys))
    return short(a), short(b)


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
                       group, shadow_dtype: torch.dtype | None = None) -> list[tuple[int, int]]:
    """This rank's :func:`shard_ranges` for ``model`` before any store exists: the ``state_ranges`` of the
    :class:`~pyengine.HostStore` a sharded Engine creates (same layout, same buckets as its streamers; the layout
    depends on the store's dtypes, the shadow's included)."""
    layout, numel = layout_of(model, grad_dtype, shadow_dtype)
    buckets = make_buckets(layout, numel, grad_dtype, bucket_mb, first_bucket_mb)
    return shard_ranges(buckets, dist.get_rank(group), dist.get_world_size(group))


def receive_rank0_state(model, held: dict, group, works, buffers: bool = True) -> dict[str, str]:
    """Note [Every rank starts from rank 0's model]
    Ranks may build the model from different seeds (as DDP, rank 0's state wins). The trainable weights come from
    rank 0 with the host store; this brings rank 0's frozen parameters and buffers (BatchNorm statistics)
    into this rank's tensors ``held[name]`` (a list per name of ``model``: the replicas' copies, a pipeline stage's
    and its CPU copies of other stages' buffers). One broadcast of their bytes in one flat buffer (gloo refuses
    some dtypes, float8 and int16 among them: bytes it takes), in ``model``'s order (the same on every rank:
    check_same_config compares names, shapes and dtypes), emptied once copied: its work (kept by ``works``, Note
    [Gloo's works are released by the thread that waits]) keeps the tensor object, not a second copy of every
    frozen weight. None to send: no collective, on every rank alike. A collective. Tested on 2 ranks built from
    different seeds with a frozen Linear, a frozen float8 parameter, an int16 buffer and a BatchNorm with
    non-default statistics: hybrid (replicated, sharded) and the pipeline across processes train as rank 0's model
    would (before, hybrid ranks kept their own frozen layers and trained on them); multi-node async takes rank 0's
    frozen parameters too (``buffers=False``: each client's statistics are its own, as before). Returns the digests
    of rank 0's frozen parameters (:func:`pyengine.engine.frozen_digests`), the same on every rank."""
    from .engine import frozen_digests

    frozen_names = {n for n, p in model.named_parameters() if not p.requires_grad}  # shared ones by first name
    frozen = ((n, p) for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad)
    items = list(itertools.chain(frozen, model.named_buffers(remove_duplicate=False) if buffers else ()))
    if not items:
        return {}
    digests, flat = {}, packed_bytes([t for _, t in items])
    with torch.no_grad():
        works.run(dist.broadcast, flat, src=dist.get_global_rank(group, 0), group=group)
        for (name, _), received in zip(items, unpacked_bytes(flat, [t for _, t in items])):
            for mine in held.get(name, ()):
                mine.copy_(received)
            if name in frozen_names:
                digests.update(frozen_digests([(name, received)]))
    flat.set_()  # its storage goes now; the kept work holds the tensor object, not the storage
    return digests


# Note [Tensors travel as bytes]
# gloo refuses some dtypes (int16 and the float8 types among them: "Invalid scalar type"), which a model's frozen
# parameters and buffers may have. What is only copied between ranks (not reduced) therefore travels as bytes: many
# tensors packed into one flat uint8 buffer (one collective instead of one per tensor), or one contiguous CPU tensor
# viewed as uint8 (as_bytes).

def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes: a flat uint8 view of its storage (Note [Tensors travel as bytes]); a view, so
    that what is received into it lands in ``t`` (a non-contiguous tensor's reshape would be a copy: refused)."""
    if not t.is_contiguous():
        raise ValueError(f"as_bytes: the tensor (shape {tuple(t.shape)}, strides {t.stride()}) is not contiguous")
    return t.reshape(-1).view(torch.uint8)


def _byte_spans(tensors) -> tuple[list[tuple[int, int]], int]:
    """Each tensor's (start, bytes) in one flat buffer, every start on a 16-byte boundary (so that its bytes are
    viewed back as its dtype in place), and the buffer's length."""
    spans, at = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        spans.append((at, nbytes))
        at += -(-nbytes // 16) * 16
    return spans, at


def packed_bytes(tensors, fill: bool = True) -> torch.Tensor:
    """One flat CPU uint8 buffer laid out for ``tensors`` (:func:`unpacked_bytes` views it back), holding their
    bytes (``fill``), or to receive them (zeros). Note [Tensors travel as bytes]."""
    spans, total = _byte_spans(tensors)
    flat = torch.zeros(total, dtype=torch.uint8)
    if fill:
        with torch.no_grad():
            for t, (start, nbytes) in zip(tensors, spans):
                flat[start:start + nbytes] = as_bytes(t.detach().to("cpu").contiguous())
    return flat


def unpacked_bytes(flat: torch.Tensor, like) -> list[torch.Tensor]:
    """Views of ``flat`` (:func:`packed_bytes` of tensors shaped as ``like``) as those tensors' dtypes and shapes."""
    spans, _ = _byte_spans(like)
    return [flat[start:start + nbytes].view(t.dtype).view(t.shape) for t, (start, nbytes) in zip(like, spans)]


class BytePacket:
    """A flat CPU byte buffer for tensors of given dtypes and shapes, and its views as them, made once and used for
    every exchange of their values (Note [Tensors travel as bytes]): ``pack`` copies tensors in, ``unpack`` out, one
    multi-tensor copy each (a copy per tensor, or a new buffer per exchange, cost 12x more for 150 small buffers)."""

    def __init__(self, tensors):
        self.layout = self.layout_of(tensors)
        self.flat = packed_bytes(tensors, fill=False)
        self.views = unpacked_bytes(self.flat, tensors)

    @staticmethod
    def layout_of(tensors) -> list:
        return [(t.dtype, tuple(t.shape)) for t in tensors]

    def fits(self, tensors) -> bool:
        return self.layout == self.layout_of(tensors)

    @torch.no_grad()
    def pack(self, tensors) -> None:
        sources = [t.detach() for t in tensors]
        if all(t.device.type == "cpu" for t in sources):
            torch._foreach_copy_(self.views, sources)
        else:  # a GPU replica's buffers: copies across devices
            for view, t in zip(self.views, sources):
                view.copy_(t)

    @torch.no_grad()
    def unpack(self, tensors) -> None:
        if all(t.device.type == "cpu" for t in tensors):
            torch._foreach_copy_(list(tensors), self.views)
        else:
            for t, view in zip(tensors, self.views):
                t.copy_(view)


def replicas_held(engine) -> dict:
    """name -> every local replica's tensor of that frozen parameter or buffer (:func:`receive_rank0_state`)."""
    held = collections.defaultdict(list)
    for worker in engine.workers:
        for name, t in itertools.chain(worker.replica.named_parameters(remove_duplicate=False),
                                       worker.replica.named_buffers(remove_duplicate=False)):
            if not (isinstance(t, torch.nn.Parameter) and t.requires_grad):
                held[name].append(t)
    return held


_TEXT_BYTES = 240  # what a failed rank tells the others (async: the bytes after ABORT and FAILED headers)


def _short_error(exc: BaseException) -> str:
    """``"Type: first line of the message"``: what a failed rank tells the others about its exception."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


PRESENCE_WAIT_S = 5.0  # Note [Naming a rank that died between steps]: how long a failed collective waits for peers


def _failure_store():
    """The default group's rendezvous store (torchrun's TCPStore), through which ranks tell each other what a
    collective cannot carry; None when there is none (torch has no public accessor for it)."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except (RuntimeError, ValueError):
        return None


def _group_timeout(group) -> float | None:
    """The process group's timeout in seconds (what bounds each wait of a collective or point-to-point exchange), or
    None when torch does not say."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


def _timed_out(exc: BaseException | None) -> bool:
    """Whether gloo's error ``exc`` comes from a timeout of this process: its own wait ("Timed out waiting ...") or
    the closing of every connection that gloo does right after one ("Application timeout caused pair closure")."""
    return exc is not None and ("Timed out" in str(exc) or "Application timeout" in str(exc))


def _rank_list(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def update_digest(engine) -> int:
    """A 32-bit digest of what the step's update will use, compared by every rank at every step (Note [Every rank
    at the same version]): the optimizer's settings (:meth:`pyengine.AdamW.digest`) and the learning rate of the
    update (``lr_schedule``'s: a schedule that differs between the ranks at a step the construction's check does not
    sample, or reads state of its own rank, trained the ranks apart, silently). A schedule that raises fails this
    rank's step here, before any work (it failed in the update before)."""
    return zlib.crc32(struct.pack("<d", engine.lr_at(engine.version + 1)), engine.optimizer.digest())


def differing_optimizers(rank: int, digests: list[int], engine) -> str:
    """The error of a step whose ranks' updates would differ (``digests``: every rank's :func:`update_digest`, by
    rank): which ranks agree with which, and this rank's settings and lr (Note [Every rank at the same version])."""
    groups = {}
    for r, d in enumerate(digests):
        groups.setdefault(d, []).append(r)
    return (f"rank {rank}: the ranks' engine.optimizer settings or learning rates differ (the ranks alike: "
            + " | ".join(_rank_list(ranks) for ranks in groups.values())
            + f"; this rank's: {_update_settings(engine)}): a change between steps must be made on every rank, and "
              "lr_schedule must give every rank the same; this step was refused on every rank")


def _update_settings(engine) -> str:
    """This rank's optimizer and the lr of its next update, for :func:`differing_optimizers`' errors."""
    return f"{engine.optimizer!r}, lr {engine.lr_at(engine.version + 1)!r} for update {engine.version + 1}"


class _Rendezvous:
    """The keys of one hybrid engine or one async run in the default group's rendezvous store, best effort: what a
    rank that failed says (Note [Naming the rank that failed], Note [A timeout names the rank that hangs]) and which
    ranks reached the current phase (Note [Naming a rank that died between steps]).

    Keys: ``pyengine/<elastic restart>/<group name>/<kind><n>/...``. Every rank builds these objects in the same
    order (building a hybrid engine, starting an async run: collectives), so the n-th one built for a group in this
    process is the n-th on every rank; TORCHELASTIC_RESTART_COUNT separates the attempts of an elastic job, whose
    store outlives its workers."""

    _built: collections.Counter = collections.Counter()

    def __init__(self, group, kind: str):
        name = f"pyengine/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{getattr(group, 'group_name', '')}/{kind}"
        _Rendezvous._built[name] += 1
        self.prefix = f"{name}{_Rendezvous._built[name]}/"
        self.store = _failure_store()

    def record(self, key: str, text: str) -> str | None:
        """Sets ``key`` to ``text`` unless a record is there already (the first writer wins); returns the record that
        holds, or None when the store is missing or unreachable."""
        if self.store is None:
            return None
        try:
            return self.store.compare_set(self.prefix + key, "", text).decode("utf-8", "ignore")
        except RuntimeError:
            return None

    def recorded(self, key: str) -> str | None:
        """What :meth:`record` recorded, or None (nothing, or the store is missing or unreachable)."""
        try:
            if self.store is not None and self.store.check([self.prefix + key]):
                return self.store.get(self.prefix + key).decode("utf-8", "ignore")
        except RuntimeError:
            pass
        return None

    def check_in(self, rank: int, count: int, name: str) -> None:
        """Records that ``rank`` entered its ``count``-th phase, ``name`` (best effort: an unreachable store fails the
        next collective). Only ``rank`` writes its key."""
        if self.store is not None:
            with contextlib.suppress(RuntimeError):
                self.store.set(f"{self.prefix}present/{rank}", f"{count} {name}")

    def phases(self, world: int) -> list[tuple[int, str | None]]:
        """(phases reached, the last one's name) of each rank of ``world``, (0, None) for a rank that checked in for
        none; raises RuntimeError when the store is unreachable."""
        found = []
        for r in range(world):
            key = f"{self.prefix}present/{r}"
            if not self.store.check([key]):  # get() would wait for the key
                found.append((0, None))
                continue
            count, _, name = self.store.get(key).decode("utf-8", "ignore").partition(" ")
            found.append((int(count), name))
        return found


@contextlib.contextmanager
def _collective(what: str, rank: int, explain=None):
    """Re-raises a failed exchange as :class:`DistributedError` naming the rank and the operation, and what
    ``explain()`` finds out about the cause (which rank failed or is missing: :meth:`DistributedHybrid._explain`)."""
    try:
        yield
    except (DistributedError, WorkerError):
        raise
    except RuntimeError as exc:  # gloo's errors, DistBackendError included
        cause = (explain() if explain is not None else None) or "a peer rank died, raised or timed out"
        raise DistributedError(f"rank {rank}: {what} failed ({type(exc).__name__}: {exc}); {cause}") from exc


# Every rank's tensor into one flat output: torch 2.14 deprecates all_gather_into_tensor (a FutureWarning) for
# all_gather_single, which torch 2.11 lacks.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@contextlib.contextmanager
def engine_exchange(engine, what: str):
    """An exchange of ``engine``'s ranks outside its steps (a checkpoint's, :func:`pyengine.checkpoint.save_engine`)
    as its steps' collectives are: refused once an earlier step broke the group, checked in as a phase (Note [Naming
    the rank that failed]), a failed exchange raised as :class:`DistributedError` naming this rank, what failed and
    what the rendezvous store tells (a peer that died: it was gloo's raw "Connection reset by peer")."""
    naming = engine.dist if engine.dist is not None else engine.async_naming if engine.async_naming is not None \
        else engine.pipeline if isinstance(engine.pipeline, _FailureNaming) else None
    rank = dist.get_rank(engine.process_group)
    if naming is not None:
        if naming.broken:
            raise DistributedError(f"rank {rank}: an earlier step failed; the group is no longer usable")
        naming._enter(what)
    try:
        with _collective(what, rank, naming._explain if naming is not None else None):
            yield
    except BaseException as exc:
        if naming is not None:  # the ranks are out of step: the next step is refused at once, as after a step's
            naming.broken = True
            naming._record_failure(exc)
        raise


def _wait(work, what: str, rank: int, explain=None) -> None:
    with _collective(what, rank, explain):
        work.wait()


def _take_first(errors: list) -> BaseException:
    """The first of ``errors``, the list emptied."""
    first = errors[0]
    errors.clear()
    return first


# why a rank refuses its batch (DistributedHybrid.step), and how the other ranks' errors say it
_TOO_FEW_FOR_WORKERS, _TOO_FEW_FOR_MICROBATCHES, _NOT_A_BATCH = 2.0, 1.0, 3.0
_END_PHASE = "the end of fit"  # Note [Ranks whose fits end at different steps]
_ENDED, _RAISED = 1, 2  # a rank's fit ended, or raised (_FailureNaming._peer_end)
# why a rank refuses a step it computed (Note [A step refused on every rank]): its flag in the step's all-reduce
_WROTE_STATE, _NO_GRADIENT = 1.0, 2.0
_REFUSED_BECAUSE = {_WROTE_STATE: "wrote state the engine does not follow",
                    _NO_GRADIENT: "had trainable parameter(s) that received no gradient, with unused='error'"}


def refusal_flag(refusal: BaseException | None) -> float:
    """This rank's flag for the all-reduce that refuses a computed step (Note [A step refused on every rank]): 0
    when ``refusal`` is None, else why: the ValueError of state written, the RuntimeError of a parameter without
    a gradient under unused="error"."""
    if refusal is None:
        return 0.0
    return _WROTE_STATE if isinstance(refusal, ValueError) else _NO_GRADIENT


class RefusalFlags:
    """Every rank's :func:`refusal_flag` in a region of a float64 all-reduce (SUM) that the step makes anyway (Note [A
    step refused on every rank]). Up to 33 ranks the flags travel as the base-3 digits of one element (rank r adds
    flag * 3**r; every partial sum is an integer below 2**53, so the sum is exact in any order); beyond, one element
    per rank. One element, not ``world``: gloo's all-reduce of 1 or 2 float64 takes a shorter path than that of 3 or
    more (bench/RESULTS.md, "The refusal flags in the step's all-reduce"), and the hybrid's loss all-reduce was
    [loss, one flag per rank]."""

    PACKED_RANKS = 33  # 3**33 - 1, the largest sum of 33 digits, is below 2**53

    def __init__(self, world: int):
        self.world = world
        self.size = 1 if world <= self.PACKED_RANKS else world  # elements of the region

    def put(self, region: torch.Tensor, rank: int, refusal: BaseException | None) -> None:
        """Adds this rank's flag to ``region`` (``size`` float64 elements, zeroed by the caller)."""
        flag = refusal_flag(refusal)
        if self.size == 1:
            region[0] = flag * float(3 ** rank)
        else:
            region[rank] = flag

    def read(self, region: torch.Tensor) -> list[float]:
        """Every rank's flag from ``region`` after the all-reduce: a list of ``world`` floats."""
        if self.size > 1:
            return region.tolist()
        packed, flags = int(region[0].item()), []
        for _ in range(self.world):
            packed, digit = divmod(packed, 3)
            flags.append(float(digit))
        return flags


def refused_step_error(rank: int, whose: str, flags: list[float]) -> DistributedError:
    """The error of a rank whose step a peer refused: each refusing rank and why, from ``flags`` (every rank's
    :func:`refusal_flag`); ``whose``: "a worker of" (hybrid) or "the stage of" (the pipeline)."""
    why = {}
    for r, flag in enumerate(flags):
        if flag:
            why.setdefault(flag, []).append(r)
    said = " and ".join(f"{whose} {_rank_list(ranks)} {_REFUSED_BECAUSE.get(flag, _REFUSED_BECAUSE[_WROTE_STATE])}"
                        for flag, ranks in why.items())
    return DistributedError(f"rank {rank}: the step was refused on every rank: {said} (its own error names it and "
                            "the remedy); nothing of the step was applied, the group stays usable")


def _step_meets_end(a: str, b: str) -> bool:
    """Whether phases ``a`` and ``b`` of two ranks are a step and an end of fit, which pair up (Note [Ranks whose
    fits end at different steps]): no calls that differ."""
    return (a == _END_PHASE) != (b == _END_PHASE) and (a.startswith("step ") or b.startswith("step "))


class _FailureNaming:
    """What a rank of a multi-process engine (:class:`DistributedHybrid`, the cross-process pipeline) does so that its
    peers name it when it fails (Note [Naming the rank that failed], Note [Naming a rank that died between steps]):
    check-ins per phase and a record of its own error in the rendezvous store, and the explanation a rank whose
    collective failed gives from them. Subclasses call :meth:`_start_naming` first."""

    def _start_naming(self, group, kind: str) -> None:
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.broken = False  # a step failed: the group is no longer usable by this rank
        # the last step raised after its last collective, on this rank alone: the group is still in step (Note [A
        # step that fails on one rank after its last collective])
        self.failed_alone = False
        self.rendezvous = _Rendezvous(group, kind)
        self.phase = 0  # phases entered (_enter)

    def _enter(self, phase: str) -> None:
        """Checks this rank in for ``phase`` before the phase's first collective."""
        self.failed_alone = False
        self.phase, self.phase_name, self.phase_start = self.phase + 1, phase, time.monotonic()
        self.rendezvous.check_in(self.rank, self.phase, phase)

    def _record_failure(self, exc: BaseException) -> None:
        """Records that this rank failed with ``exc`` (its own error; not a failed exchange with a peer), best
        effort: the peers are blocked in a collective, which fails once this process exits or after the timeout."""
        if not isinstance(exc, DistributedError):
            self.rendezvous.record("failed", f"rank {self.rank} failed: {_short_error(exc)}"[:_TEXT_BYTES])

    def _end_fit_with(self, exchange, error: BaseException | None) -> list[int]:
        """An end_fit (Note [Ranks whose fits end at different steps]): checks in for the phase, runs
        ``exchange()``, which sends this rank's end (``error``: its fit raises it next) and returns every rank's
        status (:meth:`_peer_end`), and returns the ranks that were stepping (their step refused, their fit ended
        here too). Raises PeerEndedFit when another rank's fit raised at the same point. Nothing after a failed
        step (the group is unusable)."""
        if self.broken:
            return []
        self._enter(_END_PHASE)
        try:
            status = exchange()
            ended = self._peer_end(status, own=error, stepping=False)
        except BaseException as exc:
            self.broken = True
            self._record_failure(exc)
            raise
        if ended is not None and ended.failed and error is None:  # another rank's fit raised: so does this one's
            try:
                raise ended
            finally:  # Note [No reference cycle through the engine]
                ended = None
        return [r for r, v in enumerate(status) if not v]

    def _peer_end(self, status: list[int], own: BaseException | None = None,
                  stepping: bool = True) -> PeerEndedFit | None:
        """What the ranks' ``status`` (each rank's, alike on every rank: 0 stepping, _ENDED its fit ended, _RAISED
        its fit raised) tells this rank (``stepping``, or ending its own fit, raising ``own``): None when no other
        rank's fit ended (Note [Ranks whose fits end at different steps]). When one raised, every rank exchanges the
        errors' texts first."""
        raised = [r for r, v in enumerate(status) if v == _RAISED]
        texts = None
        if raised:  # every rank sees the same status: all of them make this exchange, or none
            text = None
            if own is not None:
                try:
                    text = _short_error(own)
                except Exception:  # noqa: BLE001 - its __str__ raised: this rank must still take part
                    text = type(own).__name__
            with _collective("all-gather of the errors that ended fit", self.rank, self._explain):
                texts = all_gather_object(text, self.group, self.works)
        ended = [r for r, v in enumerate(status) if v and r != self.rank]
        if not ended:
            return None
        failed = [r for r in raised if r != self.rank]
        if failed:
            here = "this rank's step was refused (inside fit, its fit ends here too)" if stepping else \
                "this rank's fit, which ended here too, raises"
            return PeerEndedFit(f"rank {self.rank}: the fit of {_rank_list(failed)} raised ("
                                + "; ".join(f"rank {r}: {texts[r]}" for r in failed)
                                + f"): {here}; the group stays usable", failed, True)
        return PeerEndedFit(f"rank {self.rank}: the fit of {_rank_list(ended)} ended (its batches ran out, its "
                            "steps were done, or stop()) while this rank had a batch for another step: that step "
                            "was refused on every rank", ended, False)

    def _explain(self) -> str | None:
        """Why a collective of the current phase failed, as far as the rendezvous store tells: the record of the rank
        that raised, else the ranks that never reached this phase (waiting up to ``PRESENCE_WAIT_S`` after this
        rank's check-in for ranks that are only slower), else that every rank reached it."""
        rendezvous = self.rendezvous
        recorded = rendezvous.recorded("failed")
        if recorded is not None or rendezvous.store is None:
            return recorded
        try:
            while True:
                phases = rendezvous.phases(self.world)
                missing = [r for r, (n, _) in enumerate(phases) if n < self.phase]
                waited = time.monotonic() - self.phase_start
                if not missing or waited >= PRESENCE_WAIT_S:
                    break
                time.sleep(0.05)
        except RuntimeError as exc:
            host = "torchrun's agent on the first node" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" \
                else "rank 0"
            return (f"the rendezvous store is unreachable too ({_short_error(exc)}), so its host, {host}, is gone "
                    f"(died or exited); see its log")
        recorded = rendezvous.recorded("failed")  # a rank that raised meanwhile
        if recorded is not None:
            return recorded
        present = [r for r in range(self.world) if r not in missing]
        elsewhere = {r: name for r, (n, name) in enumerate(phases) if n == self.phase and name != self.phase_name
                     and not _step_meets_end(name, self.phase_name)}
        if elsewhere:  # as many phases, other calls: the ranks' collectives paired up wrongly
            return ("the ranks made different calls: this rank is in " + self.phase_name + ", while "
                    + "; ".join(f"rank {r} is in {name}" for r, name in elsewhere.items())
                    + ": every rank must make the same engine calls in the same order (step, fit, "
                      "checkpoint.save_engine, and state_dict or master_state_dict of a sharded engine: collectives)")
        if missing:
            one = len(missing) == 1
            return (f"{_rank_list(missing)} never reached {self.phase_name} ({_rank_list(present)} did; this rank "
                    f"waited {waited:.1f} s after reaching it): {'it' if one else 'they'} died, exited, raised or "
                    f"{'hangs' if one else 'hang'} before it; see {'its' if one else 'their'} log")
        if self.world == 2:
            return (f"rank {1 - self.rank}, the only peer, reached {self.phase_name} too and died, exited, raised or "
                    f"hangs inside it; see its log")
        return (f"every rank ({_rank_list(present)}) reached {self.phase_name}, so a peer died, exited, raised or "
                f"hangs inside it (gloo's error names its address, not its rank); see the other ranks' logs")


class DistributedHybrid(_FailureNaming):
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

    Note [Naming the rank that failed]
    A collective cannot carry a message: when rank f raises inside a step (a worker's loss, the update), its peers
    are blocked in a bucket's allreduce, which fails only when f's process exits (or after the group's timeout), and
    gloo's error names an address, not a rank. So before the step re-raises, f writes "rank f failed: <error type>:
    <first line>" into the default group's rendezvous store; a peer whose collective fails reads it and names f in
    its :class:`DistributedError`. The write happens before f's exception leaves the step, hence before f's process
    can exit and close its connections, so a peer that sees the closed connection finds the record. A rank that dies
    (``os._exit``, a signal) or raises outside a step records nothing: see the next Note.

    Note [Naming a rank that died between steps]
    A rank that dies (``os._exit``, a signal, the OOM killer) or raises or hangs outside a step leaves no record, and
    gloo's "Connection closed by peer [address]" does not say which rank is gone. So every rank counts the phases it
    reaches in the rendezvous store: :meth:`_enter` sets ``present/<rank>`` to its count and the phase's name before
    the phase's first collective (the construction, each step, each gather of the optimizer state; one store round
    trip per step, no thread).
    When a collective of this rank's phase n fails and no rank recorded a failure, :meth:`_explain` reads every
    rank's count and names the ranks below n: they never reached the phase that this rank is in, so they died,
    exited, raised or hang before it. Ranks that are alive but slower between steps (loading data, a checkpoint)
    check in shortly after, so the check waits until ``PRESENCE_WAIT_S`` (module attribute, 5 s) after this rank's
    check-in for the missing ones (polling the store; no wait when the collective failed later than that, e.g. on
    the group's timeout), and the error says how long it waited. A rank at the same count in a phase of another name
    made other calls (rank 0 alone gathering a sharded state while rank 1 steps): their collectives paired up
    wrongly, and the error says that, naming both phases. When every rank reached the phase, a rank died or
    hangs inside it: the error says so, and that gloo does not tell which (with 2 ranks: the other one). Reports
    from the ranks whose collective failed would not tell more: a live rank can stay blocked on a peer that is busy
    reporting, and look dead. If the store itself is unreachable, its host is gone: rank 0, unless torchrun's agent
    hosts the store (TORCHELASTIC_USE_AGENT_STORE); the error says that instead. Nothing is deleted at a clean exit:
    every rank makes the same calls, so the counts stay equal until one rank goes missing.

    Note [Every rank at the same version]
    Each rank applies the reduced gradient to its own copy of the weights and Adam state, so the ranks stay alike
    only if every step starts alike on all of them. The construction makes them so (rank 0's weights are broadcast),
    but :meth:`Engine.load_state_dict` is no collective: a rank that loads another state, or loads one while the
    others do not ("resume on rank 0 only"), would train on with other weights, silently, for good. So the step's
    first collective, the exchange of the batch sizes, carries every rank's version too (an all-gather of three
    numbers per rank in place of an allreduce of two: no collective more), and when the versions differ every rank
    refuses the step together with a :class:`DistributedError` naming each rank's version; the group stays in step,
    and usable once every rank has loaded the same state. Two states of one version (two runs' checkpoints of the
    same step) are not told apart: comparing the weights would cost a pass over them every step. The optimizer's
    settings, which may be changed between steps (``engine.optimizer.lr = ...``), travel the same way as a digest
    (:meth:`pyengine.AdamW.digest`, ~4 us), with the learning rate the update will use (:func:`update_digest`: the
    construction compares ``lr_schedule`` at a few steps only): a change made on some ranks only (under ``if rank
    == 0:``), or a schedule that differs at some step, made their weights drift apart for good, silently.
    """

    def __init__(self, engine, group, shard_update: bool):
        self.group = group
        self.works = engine.collective_works  # Note [Gloo's works are released by the thread that waits]
        self._start_naming(group, "hybrid")  # Note [Naming the rank that failed]
        self.shard_update = shard_update
        self.buckets = engine.workers[0].streamer.buckets
        self.steps = 0  # steps begun
        self._enter("the construction of the engine")  # Note [Naming a rank that died between steps]
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
        # every tensor a step hands to a collective is one of these, kept (no allocation per step); the works are
        # kept too: Note [Gloo's works are released by the thread that waits]
        # the step's tag (Note [Exchanges that pair up wrongly]), this rank's sample count, refusal flag, version and
        # optimizer digest
        self._sizes = torch.zeros(HEADER_LEN, dtype=torch.float64)
        self._all_sizes = torch.zeros(self.world, HEADER_LEN, dtype=torch.float64)
        self._buffer_packet: BytePacket | None = None  # _share_buffers' bytes
        self._all_sizes_flat = self._all_sizes.view(-1)
        # the step's loss, then the flags of the ranks that refuse the step (Note [A step refused on every rank])
        self._flags = RefusalFlags(self.world)
        self._loss = torch.zeros(1 + self._flags.size, dtype=torch.float64)
        self._norms = torch.zeros(2, dtype=torch.float64)  # the sharded update's squared norm and non-finite flag
        if shard_update:  # bucket k's reduction and all-gather region, and this rank's part of the gather
            self._regions = [self._ring[k % 2][:self.world * self.part[k]] for k in range(len(self.buckets))]
            self._mine_parts = [self._mine[k % 2][:self.part[k]] for k in range(len(self.buckets))]
        else:
            self._regions = [self.reduced[b.begin:b.end] for b in self.buckets]
        with _collective("broadcast of the initial weights, frozen parameters and buffers from rank 0", self.rank,
                         self._explain):
            self.works.run(dist.broadcast, store.param, src=dist.get_global_rank(group, 0), group=group)
            engine.frozen = receive_rank0_state(engine.workers[0].replica, replicas_held(engine), group, self.works)
        store.refresh_shadow()  # Note [The shadow follows the master weights]
        for worker in engine.workers:
            worker.pull(wait=True)

    # ---- the end of a fit -------------------------------------------------------------------------------------

    # Note [Ranks whose fits end at different steps]
    # Engine.fit on every rank runs one step per batch of that rank's own data, and the data may end unevenly (a sampler
    # that does not pad, an IterableDataset's shards), or one rank may stop() alone: that rank left fit while the others
    # waited in their next step's first collective until the group's timeout, or paired it with whatever that rank
    # called next. So a rank's fit that ends without a failed step (its batches ran out, its steps were done, stop(), or
    # its batches, a callback or fit's own argument checks raised: a bad ``steps`` on one rank alone) makes one more
    # exchange of the step's header size, tagged _END_TAG (end_fit; a pipeline across processes: its step's first
    # all-reduce, with this rank's slot of the ends set, DistributedPipeline.end_fit). Every rank's fit ends at the same
    # step that way: when all of them end there, their end headers meet and nothing else happens (one small exchange per
    # fit call); a rank still stepping meets them with its step's header, refuses that step before any work (every rank
    # sees every header: no rank goes on) and its fit ends too, with a RuntimeWarning naming the ranks whose fit ended,
    # or raising PeerEndedFit naming their error when their fit raised (its text travels in one exchange more, which
    # every rank makes when a header says so). A rank whose step fails does not send one: its step raised on every rank
    # (a refusal, a non-finite gradient under nonfinite="raise") or broke the group (Note [Naming the rank that
    # failed]); one that raised before its first collective (a schedule value refused, an engine closed) sends one with
    # its error, as its batches would, and so does one that failed after its last collective (Note [A step that fails
    # on one rank after its last collective]). A Ctrl-C does not: the peers may be anywhere by then. The group stays
    # usable in every case above. A step refused by an end is not counted in the phases' names (steps), so they stay
    # alike; an end and a step at the same phase count are no calls that differ (_explain).

    # Note [A step that fails on one rank after its last collective]
    # The local tail of a step: hybrid's update of the reduced gradient (not sharded: no collective in it) and its
    # copy back into the replicas; a pipeline stage's update of its range once the norm and flag are all-reduced.
    # When that raises on one rank, its peers have finished the step and go on to their next step's header exchange
    # (or their end of fit). That rank's engine refuses its next steps (Note [A step that fails inside its update] in
    # engine.py), and until its fit sent nothing the peers waited for the group's timeout. The step now marks
    # ``failed_alone`` (not ``broken``: every collective of the step was made on every rank, the group is in step), and
    # fit sends an end of fit with the error, as for an error of its batches: the peers' next step meets it and their
    # fits raise PeerEndedFit naming it at once. Every rank loading the same state makes the group step again. A
    # step() called outside fit sends nothing (what the peers call next is theirs to say): they wait as before.

    def end_fit(self, engine, error: BaseException | None = None) -> list[int]:
        """Tells the other ranks that this rank's :meth:`Engine.fit` ends (``error``: with this exception, which
        the caller raises next) and returns the ranks that were still stepping: their step was refused and their
        fit ended here too. Raises PeerEndedFit when another rank's fit raised at the same point. Nothing after a
        failed step (the group is unusable)."""
        def exchange() -> list[int]:
            self._sizes.copy_(torch.tensor([_END_TAG, float(error is not None), float(engine.version), 0.0, 0.0],
                                           dtype=torch.float64))
            self._all_sizes.zero_()
            with _collective("all-gather of the end of fit", self.rank, self._explain):
                self.works.run(_all_gather_flat, self._all_sizes_flat, self._sizes, group=self.group)
                _check_tags(self._all_sizes, _END_TAG, _STEP_TAG)
            return self._status(self._all_sizes)

        return self._end_fit_with(exchange, error)

    @staticmethod
    def _status(gathered: torch.Tensor) -> list[int]:
        """Each rank's end of fit (:meth:`_FailureNaming._peer_end`'s status) from the gathered headers."""
        tags, flags = gathered[:, 0].tolist(), gathered[:, 1].tolist()
        return [0 if t != _END_TAG else _RAISED if f > 0 else _ENDED for t, f in zip(tags, flags)]

    # ---- the step ---------------------------------------------------------------------------------------------

    def step(self, engine, batch) -> dict:
        if self.broken:
            raise DistributedError(f"rank {self.rank}: an earlier step failed; the group is no longer usable")
        self.steps += 1
        self._enter(f"step {self.steps}")
        start = time.perf_counter()
        try:  # a batch this rank cannot take otherwise (not a batch) fails its step: recorded, the group broken
            # a batch with fewer samples than this rank's workers (a data set's uneven tail), or a worker's shard too
            # small for its micro-batches: refused by every rank together, below (the group stays usable)
            refusal, refused, sizes = 0.0, None, [0]
            try:
                batch_size(batch)  # leaves that are not tensors, tensors of different sizes along dim 0
            except ValueError as exc:
                refusal, refused = _NOT_A_BATCH, exc
            if refused is None:
                try:
                    shards = split_batch(batch, engine.num_workers)
                except ValueError as exc:
                    refusal, refused = _TOO_FEW_FOR_WORKERS, exc
            if refused is None:
                sizes = [batch_size(s) for s in shards]
                try:
                    parts = [split_microbatches(s, engine.microbatches, f"rank {self.rank}'s worker {g}'s shard")
                             for g, s in enumerate(shards)]
                except ValueError as exc:
                    refusal, refused = _TOO_FEW_FOR_MICROBATCHES, exc
            # every rank's batch size, whether it refuses its batch (and why), its version and its optimizer's
            # digest (Note [Every rank at the same version]): on a refusal every rank refuses this step together,
            # before any work, and the group stays usable
            self._sizes.copy_(torch.tensor([_STEP_TAG, float(sum(sizes)), refusal, float(engine.version),
                                            float(update_digest(engine))], dtype=torch.float64))
            self._all_sizes.zero_()  # a rank whose header did not come reads as no step's
            counts = self._all_sizes[:, 1:]
            with _collective("all-gather of the batch sizes", self.rank, self._explain):
                self.works.run(_all_gather_flat, self._all_sizes_flat, self._sizes, group=self.group)
                _check_tags(self._all_sizes, _STEP_TAG, _END_TAG)
            ended = self._peer_end(self._status(self._all_sizes))
        except BaseException as exc:
            self.broken = True
            self._record_failure(exc)
            raise
        if ended is not None:  # another rank's fit ended here: every rank's step is refused, before any work
            refused = None
            self.steps -= 1  # not begun: the phases' names stay as the ended rank's (Note [Ranks whose fits ...])
            try:
                raise ended
            finally:  # the frame must not hold its own exception (Note [No reference cycle through the engine])
                ended = None
        versions = [int(v) for v in counts[:, 2].tolist()]
        if len(set(versions)) > 1:
            refused = None
            at = {v: [r for r, w in enumerate(versions) if w == v] for v in sorted(set(versions))}
            raise DistributedError(
                f"rank {self.rank}: the ranks' engines hold different states ("
                + "; ".join(f"version {v} on {_rank_list(ranks)}" for v, ranks in at.items())
                + "): every rank must load the same state (load_state_dict or checkpoint.load_engine on every rank); "
                  "this step was refused on every rank")
        digests = [int(d) for d in counts[:, 3].tolist()]
        if len(set(digests)) > 1:
            refused = None
            raise DistributedError(differing_optimizers(self.rank, digests, engine))
        refusals = counts[:, 1].tolist()
        if any(refusals):
            kinds = ((_NOT_A_BATCH, "a batch that cannot be split on dim 0 (its own error says why)"),
                     (_TOO_FEW_FOR_WORKERS, "a batch with fewer samples than its local workers"),
                     (_TOO_FEW_FOR_MICROBATCHES, f"a worker's shard too small for microbatches={engine.microbatches}"))
            why = [f"{_rank_list(ranks)} {'has' if len(ranks) == 1 else 'have'} {what}" for kind, what in kinds
                   if (ranks := [r for r, v in enumerate(refusals) if v == kind])]
            try:
                raise refused if refused is not None else ValueError(
                    f"rank {self.rank}: " + "; ".join(why) + "; this step was refused on every rank")
            finally:  # the frame (and through it the engine) must not hold its own exception: a reference cycle
                refused = None  # (Note [No reference cycle through the engine])
        total = counts[:, 0].sum().item()
        weights = [n / total for n in sizes]
        scale = engine.loss_scale_now()  # the same on every rank: each applies the same admit_update decisions
        try:
            self._share_buffers(engine)
        except BaseException as exc:
            self.broken = True
            self._record_failure(exc)
            raise
        works, errors, abandoned = [], [], threading.Event()
        self.launched_at = []  # perf_counter of each bucket's allreduce launch (the reducer appends)
        reducer = threading.Thread(target=self._reduce_buckets, args=(engine, weights, works, errors, abandoned),
                                   name="pyengine-reducer", daemon=True)
        reducer.start()

        def task(worker, part):
            def run():
                with engine.phase("forward_backward+transfer", worker.index):
                    # a refusal is this rank's and its peers' together: Note [A step refused on every rank]
                    return worker.compute(engine.loss_fn, *part, loss_scale=scale, defer_refusal=True)
            return run

        try:
            results = engine.run_workers({w.index: task(w, p) for w, p in zip(engine.workers, parts)})
            workers_done = time.perf_counter()
        except BaseException as exc:
            self.broken = True  # Note [Collective order across threads]
            self._record_failure(exc)
            abandoned.set()  # the reducer ends at its next look: a failed worker's buckets never come
            raise
        reducer.join()
        computed = time.perf_counter()
        try:
            if errors:  # the list emptied and nothing of it kept in this frame, which the traceback holds: no cycle
                raise _take_first(errors)  # through the engine (Note [A task's exception and its callers' frames])
            with engine.phase("allreduce_wait"):
                for k, work in enumerate(works):
                    if work is None:  # the reducer finished it (Note [Two reused bucket buffers])
                        continue
                    if self.shard_update:
                        self._finish_reduce(works, k)
                    else:
                        _wait(work, "gradient bucket reduction", self.rank, self._explain)
            loss = self._loss
            loss.zero_()
            loss[0] = sum(results[i][0] * n for i, n in enumerate(sizes))
            refusals = [w for w in engine.workers if w.refused is not None]
            self._flags.put(loss[1:], self.rank, refusals[0].refused if refusals else None)
            with _collective("allreduce of the loss", self.rank, self._explain):
                self.works.run(dist.all_reduce, loss, group=self.group)
            reduced = time.perf_counter()
        except BaseException as exc:
            self.broken = True
            self._record_failure(exc)
            raise
        flags = self._flags.read(loss[1:])
        if any(flags):
            self._refuse(engine, flags, refusals)
        engine.begin_update()  # Note [A step's update under the mutex]
        try:
            with engine.phase("update"):
                applied = self._update_sharded(engine, scale) if self.shard_update else engine.apply_update(
                    [], None, grads=[self.reduced], loss_scale=scale)
        except FloatingPointError:
            # nonfinite="raise" (Engine.admit_update): every rank took this decision from the same reduced norm,
            # before any collective of the update, so the group is still in step: no rank failed, the engine stays
            # usable, as in one process. The step's gradient buckets were consumed by no copy back: drop them (as
            # hybrid_step does), or the next step's waits would return on this step's stale slots.
            for worker in engine.workers:
                worker.streamer.reset()
            raise
        except BaseException as exc:
            if self.shard_update:  # its collectives may be half made
                self.broken = True
                self._record_failure(exc)
            else:  # Note [A step that fails on one rank after its last collective]
                self.failed_alone = True
            raise
        updated = time.perf_counter()
        with engine.phase("copy_back"):
            try:
                engine.run_workers({w.index: w.pull for w in engine.workers})
            except BaseException:
                self.failed_alone = True  # Note [A step that fails on one rank after its last collective]
                raise
        end = time.perf_counter()
        return step_metrics(engine, loss=loss[0].item() / total, samples=int(total), wall=end - start,
                            compute=max(r[1] for r in results.values()), update=updated - reduced,
                            transfer_wait=max(r[2] for r in results.values()) + reduced - computed,
                            copy_back=end - updated, applied=applied, loss_scale=scale, rank=self.rank,
                            world_size=self.world,
                            local_samples=sum(sizes),
                            overlapped_buckets=sum(t < workers_done for t in self.launched_at))

    def _share_buffers(self, engine) -> None:
        """DDP's broadcast_buffers across ranks: rank 0's worker 0 buffers go to every replica of every rank, as one
        broadcast of their bytes (Note [Tensors travel as bytes]: an int16 or float8 buffer failed every step)."""
        if not engine.saved_buffer_names:  # the persistent ones (Note [Buffers that are not saved])
            return
        named = dict(engine.workers[0].replica.named_buffers())
        tensors = [named[name] for name in engine.saved_buffer_names]
        # one packet for every step (the kept works hold the tensors they sent: a new one per step kept a copy of
        # every buffer for each of the last 4096 steps), made again only when a buffer's shape or dtype changed
        if self._buffer_packet is None or not self._buffer_packet.fits(tensors):
            self._buffer_packet = BytePacket(tensors)
        packet = self._buffer_packet
        if self.rank == 0:
            packet.pack(tensors)
        with _collective("broadcast of the buffers from rank 0", self.rank, self._explain):
            self.works.run(dist.broadcast, packet.flat, src=dist.get_global_rank(self.group, 0), group=self.group)
        if self.rank != 0:  # into whole tensors: a forward may have assigned an expanded one (replica_of's doc)
            packet.unpack(whole_buffers(engine.workers[0].replica, tensors))
        engine.share_buffers(range(engine.num_workers))

    def _refuse(self, engine, flags: list[float], refusals: list) -> None:
        """Note [A step refused on every rank]
        A step that wrote state the engine does not follow (Note [Weights changed in place by a step], Note [Model
        state the engine does not follow] in pyengine/workers.py: a trainable parameter written in place, a frozen
        one written, a persistent buffer registered as None set) fails in one process before its update, naming
        the parameter or buffer and the remedy. Across processes the rank whose worker (or pipeline stage) raised
        there left its peers blocked in the step's all-reduces, the group broken, until its process exited or the
        group's timeout (a pipeline stage trained on without a word), for a mistake in the model. Now the check
        runs once the step's gradients are complete (a worker's in its slots: :meth:`Worker.compute` with
        ``defer_refusal``, so every bucket's reduction runs as in any step; a stage's after its schedule), each
        rank sets a flag of its own in an all-reduce the step makes anyway (hybrid: the loss's; the pipeline: the
        norm's), and after the step's last collective, before anything is counted or written (``begin_update``),
        every rank refuses the step together: the refusing rank raises the error of one process (the WorkerError,
        the pipeline's StageError, around the ValueError), the others a DistributedError naming the refusing
        ranks. Nothing of the step counts: it is dropped as a failed worker's is (streamers reset, the buffers as
        before it, a written weight pulled back; a buffer registered as None is None again), and the group stays
        usable, in step (a frozen parameter written stays written, as in one process: the engine keeps no copy of
        frozen parameters). Cost: one float64 more in that all-reduce (:class:`RefusalFlags`). Tested on 2 ranks, each kind: hybrid
        replicated and sharded (then bit for bit the same engine that never saw the refused batch), the pipeline
        with the writing stage on either rank (then bit for bit the in-process pipeline).
        A trainable parameter without a gradient under ``unused="error"`` is refused the same way (it had broken
        the group as well): the streamer keeps its RuntimeError instead of raising it from the backward
        (:meth:`GradientStreamer.defer_unused_error`), so its buckets are delivered (zeros for that parameter) and
        reduced as in any step; a stage checks after its schedule. The flag says which of the two it is
        (:func:`refusal_flag`), and the peers' DistributedError says it (:func:`refused_step_error`)."""
        engine.drop_gathered_step()
        if refusals:
            worker = refusals[0]
            exc = worker.refused
            for w in engine.workers:
                w.refused = None
            try:
                raise WorkerError(worker.index, worker.device, exc) from exc
            finally:  # the frame must not hold its own exception (Note [No reference cycle through the engine])
                exc = None
        raise refused_step_error(self.rank, "a worker of", flags)

    def _reduce_buckets(self, engine, weights, works, errors, abandoned: threading.Event) -> None:
        """Reducer thread: for each bucket in order, wait for it in every local slot, weighted local sum into the
        reduce buffer (sharded: a ring buffer), launch its allreduce asynchronously. Ends once ``abandoned`` is set
        (a local worker failed: its buckets never come; it waited for good, holding the engine)."""
        store = engine.store
        slots = [store.grad_slot(w.index) for w in engine.workers]
        try:
            for bucket in self.buckets:
                k, b, e = bucket.index, bucket.begin, bucket.end
                for worker in engine.workers:
                    while not worker.streamer.wait(k, timeout=_POLL_S):
                        if abandoned.is_set():
                            return
                if abandoned.is_set():  # the step raised: no collective more on the broken group
                    return
                if self.shard_update:
                    if k >= 2:  # Note [Two reused bucket buffers]
                        self._finish_reduce(works, k - 2)
                    region = self._regions[k]
                    self._local_sum(region[:e - b], [s[b:e] for s in slots], weights)
                    region[e - b:].zero_()
                    with _collective("reduction of a gradient bucket", self.rank, self._explain):
                        works.append(self.works.start(dist.all_reduce, region, group=self.group))
                    self.launched_at.append(time.perf_counter())
                else:
                    region = self._regions[k]
                    self._local_sum(region, [s[b:e] for s in slots], weights)
                    with _collective("allreduce of a gradient bucket", self.rank, self._explain):
                        works.append(self.works.start(dist.all_reduce, region, group=self.group))
                    self.launched_at.append(time.perf_counter())
        except BaseException as exc:  # noqa: BLE001 - re-raised by the step's thread
            errors.append(exc)

    def _finish_reduce(self, works: list, k: int) -> None:
        """Waits for bucket k's reduction and keeps this rank's part of it in ``shard_grad``."""
        _wait(works[k], "reduction of a gradient bucket", self.rank, self._explain)
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

    def _update_sharded(self, engine, scale: float | None) -> bool:
        """Fused update on this rank's parts, with the global norm; then all-gather the weights. ``scale``: the loss
        scale the gradients were computed with."""
        store, opt = engine.store, engine.optimizer
        grads = [self.shard_grad[self.shard_offset[k]:self.shard_offset[k] + hi - lo]
                 for k, (lo, hi) in enumerate(self.owned)]
        sq, bad = 0.0, 0.0
        for grad in grads:
            if grad.numel():
                norm, nonfinite = ops.mean_grad_norm([grad])
                sq, bad = sq + norm.double().item() ** 2, max(bad, nonfinite.item())
        summary = self._norms
        summary[0], summary[1] = sq, bad
        with _collective("allreduce of the shard norms", self.rank, self._explain):
            self.works.run(dist.all_reduce, summary, group=self.group)
        if not engine.admit_update(summary[1].item() != 0.0 or not math.isfinite(summary[0].item()), [],
                                   loss_scale=scale):
            return False
        clip = opt.max_grad_norm or 0.0
        norm = torch.tensor(math.sqrt(summary[0].item()), dtype=torch.float32)
        for (lo, hi), grad in zip(self.owned, grads):
            if hi > lo:
                state = store.state_slice(lo, hi)
                torch.ops.pyengine.mean_grad_adamw_.default(
                    store.param[lo:hi], store.exp_avg[state], store.exp_avg_sq[state], [grad],
                    **opt.kernel_kwargs(engine.lr_at(engine.version)), step=engine.version,
                    max_exp_avg_sq=None if store.max_exp_avg_sq is None else store.max_exp_avg_sq[state],
                    grad_scale=grad_scale_tensor(scale), found_inf=None, weights=None, param_out=None,
                    grad_norm=norm if clip else None, max_grad_norm=float(clip))
        self._all_gather([store.param[lo:hi] for lo, hi in self.owned], store.param, "the updated weights")
        store.refresh_shadow()  # the other ranks' parts (Note [The shadow follows the master weights])
        return True

    def _all_gather(self, parts: list[torch.Tensor], out: torch.Tensor, what: str) -> None:
        """Every rank's ``parts`` (this rank's elements of each bucket, :attr:`owned`) -> ``out`` (a flat tensor of
        the store's ``numel``), bucket by bucket through the two ring buffers (Note [Two reused bucket buffers])."""
        pending = collections.deque()
        for k, part in enumerate(parts):
            if len(pending) == 2:
                self._unpack_gathered(*pending.popleft(), out, what)
            mine, region = self._mine_parts[k], self._regions[k]
            mine[:part.numel()] = part
            mine[part.numel():].zero_()
            with _collective(f"all-gather of {what}", self.rank, self._explain):
                pending.append((k, self.works.start(_all_gather_flat, region, mine, group=self.group)))
        while pending:
            self._unpack_gathered(*pending.popleft(), out, what)

    def _unpack_gathered(self, k: int, work, out: torch.Tensor, what: str) -> None:
        _wait(work, f"all-gather of {what}", self.rank, self._explain)
        bucket = self.buckets[k]
        out[bucket.begin:bucket.end] = self._ring[k % 2][:bucket.end - bucket.begin]

    def gather_state(self, engine) -> dict[str, torch.Tensor]:
        """The full Adam state, assembled from every rank's packed parts: see :func:`gather_optimizer_state`."""
        if self.broken:
            raise DistributedError(f"rank {self.rank}: an earlier step failed; the group is no longer usable")
        self._enter(f"the gather of the optimizer state after step {self.steps}")
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


# ---- multi-node async: ranks 0..K-1 serve shards of the store, the other ranks push --------------------------------

# Server -> client header: [status, version (a decision: rank 0's version right after applying the push, i.e. its
# Adam step), id of this client's last applied push, failed rank (-1: none), staleness of the push just decided,
# loss scale (rank 0's, taken with its snapshot; 0: none), decision (K = 1: rank 0's status for the client's last
# push, as its own field: step 4 of Note [Multi-node async exchange])], then (a state message) the server's shard
# of the weights.
# Client -> server header: [kind, push id, version at pull, samples, loss, norm of the whole gradient, non-finite
# flag, staleness (COMMIT) or failed rank (FAILED), Adam step (COMMIT), the loss scale the push was computed with (0:
# none)], then (PUSH, COMMIT) the shard of the gradient. float64 tensors: exact for these integers, for the fp32
# norm and for the fp32 scale.
_GO, _REFRESH, _STOP, _ABORT = 0.0, 1.0, 2.0, 3.0
_PUSH, _DONE, _PULL, _COMMIT, _DROP, _FAILED = 0.0, 1.0, 2.0, 3.0, 4.0, 5.0
_SERVER_HEADER, _CLIENT_HEADER = 7, 10


def _encode_text(text: str) -> torch.Tensor:
    """``text`` as a uint8 tensor of ``_TEXT_BYTES`` (truncated, zero-padded) for a point-to-point message."""
    data = text.encode("utf-8")[:_TEXT_BYTES]
    out = torch.zeros(_TEXT_BYTES, dtype=torch.uint8)
    if data:
        out[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def _decode_text(tensor: torch.Tensor) -> str:
    """Inverse of :func:`_encode_text` (a character cut by the truncation is dropped)."""
    return bytes(tensor.tolist()).rstrip(b"\0").decode("utf-8", errors="ignore")


def check_servers(servers, group, mode: str, numel: int) -> int:
    """Validates the number of async parameter servers ``servers`` (K) for ``group`` and ``mode``; returns it."""
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
        raise ValueError(f"servers must be an integer >= 1 (the number of async parameter server ranks); got "
                         f"{servers!r}")
    if servers == 1:
        return servers
    if group is None or mode != "async":
        raise ValueError(f"servers={servers} shards the store across async server ranks: it needs mode='async' and a "
                         f"process group; got mode={mode!r}, process_group={group}")
    world = dist.get_world_size(group)
    if servers >= world:
        raise ValueError(f"servers={servers} leaves no client rank in a process group of {world} ranks: servers must "
                         f"be in [1, {world - 1}]")
    if servers > numel:
        raise ValueError(f"servers={servers} is more than the {numel} elements of the store: every server needs a "
                         "non-empty shard")
    return servers


def shard_spans(numel: int, servers: int) -> list[tuple[int, int]]:
    """Server s's shard ``[lo, hi)`` of the flat store: contiguous, in rank order, sizes differing by at most one
    (element boundaries: a shard may split a parameter or a bucket; the update is elementwise)."""
    base, extra = divmod(numel, servers)
    bounds = [s * base + min(s, extra) for s in range(servers + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class AsyncNaming(_FailureNaming):
    """Multi-node async between its runs: every rank checks in at the engine's construction and at the start of each
    run (:func:`run_async`), so a rank that died, raised or hangs before a run is named by the others, as in
    multi-node hybrid (Note [Naming a rank that died between steps]), and a rank that failed outside a run (its data
    loading) and said so (:meth:`Engine.record_failure`) is named with its error (Note [Naming the rank that
    failed]). Inside a run the run's own exchange names a failed rank (Note [Multi-node async exchange])."""

    def __init__(self, group):
        self._start_naming(group, "async-engine")
        self.runs = 0
        self.split: str | None = None  # Note [A failed run of several servers]: why the store is no longer whole
        self._enter("the construction of the engine")

    def check_whole(self) -> None:
        """Raises :class:`DistributedError` when this rank's store is no longer one state of the model (Note [A failed
        run of several servers])."""
        if self.split is not None:
            raise DistributedError(self.split)

    def start_run(self) -> None:
        self.runs += 1
        self._enter(f"the start of async run {self.runs} (fit)")


_NONFINITE_RAISED = "raised FloatingPointError: non-finite gradient"  # a push's nonfinite="raise", as it is told


def _servers_take_client_buffers(engine, group, servers: int, explain=None) -> None:
    """Note [The servers hold a client's statistics]
    A server computes nothing, so its replicas' buffers (BatchNorm's running statistics) stayed as built: rank 0's
    ``state_dict`` (what :func:`pyengine.checkpoint.save_engine` writes) held untrained statistics while the clients'
    had moved (a model saved so evaluated with mean 0 and variance 1, and a resumed run's clients went back to
    them). In one process the state holds a worker's statistics. So at the end of a run that ended well the first
    client (rank ``servers``) broadcasts its source replica's buffers as bytes; the servers take them into every
    replica of theirs, and the other clients keep their own (each client's statistics are its own, as when the
    engine was built). A collective."""
    if not engine.saved_buffer_names:  # the persistent ones (Note [Buffers that are not saved])
        return
    rank, names = dist.get_rank(group), engine.saved_buffer_names
    source = engine._replica_buffers(engine.buffer_source)
    packet = BytePacket([source[name] for name in names])
    if rank == servers:
        packet.pack([source[name] for name in names])
    with _collective("broadcast of the first client's buffers", rank, explain):
        engine.collective_works.run(dist.broadcast, packet.flat, src=dist.get_global_rank(group, servers),
                                    group=group)
    if rank < servers:
        for worker in range(len(engine.workers)):
            named = engine._replica_buffers(worker)
            packet.unpack([named[name] for name in names])


def _share_store(engine, group, spans, explain=None) -> None:
    """Broadcasts ``store[lo:hi]`` of the weights and the Adam state from rank ``src`` for each ``(src, lo, hi)`` of
    ``spans``, then the version and the loss scaler's state from rank 0: every rank then holds the same complete
    store. A collective; ``explain`` names a rank behind a failure (:meth:`_FailureNaming._explain`)."""
    store = engine.store
    rank = dist.get_rank(group)
    version = torch.tensor([float(engine.version)], dtype=torch.float64)
    scaler = torch.tensor([engine.scaler.scale, float(engine.scaler.growth_tracker)], dtype=torch.float64) \
        if engine.scaler is not None else None
    views = [(flat[lo:hi], src) for flat in (store.param, store.exp_avg, store.exp_avg_sq, store.max_exp_avg_sq)
             if flat is not None for src, lo, hi in spans]
    with _collective("broadcast of the async store", rank, explain):
        for view, src in views:
            engine.collective_works.run(dist.broadcast, view, src=dist.get_global_rank(group, src), group=group)
        engine.collective_works.run(dist.broadcast, version, src=dist.get_global_rank(group, 0), group=group)
        if scaler is not None:  # rank 0's decides (Note [Loss scaling]); the same options on every rank
            engine.collective_works.run(dist.broadcast, scaler, src=dist.get_global_rank(group, 0), group=group)
    engine.version = int(version.item())
    if engine.scaler is not None:
        engine.scaler.load_state_dict({"scale": scaler[0].item(), "growth_tracker": int(scaler[1].item())})
    store.refresh_shadow()  # Note [The shadow follows the master weights]


class AsyncServer:
    """Server rank ``s < K`` of a multi-node async run: holds shard s of the store (see :func:`shard_spans`) and runs
    one thread per client, each applying that client's pushes to the shard under the engine's mutex. Rank 0 is also
    the coordinator: it decides for every push whether it is applied (staleness, the run's end).

    Note [Multi-node async exchange]
    Per (server, client) pair, strictly alternating messages with tag = client rank, so the threads of different
    clients never match each other's messages. A round of client c:

    1. every server s >= 1 sends c [GO, version_s, ...] + its shard (a snapshot taken under its mutex);
    2. c sends rank 0 PULL (K > 1 only); rank 0 sends [status, version_0, last applied id, ...] + shard 0;
    3. c computes on the gathered weights, then sends rank 0 [PUSH, id, version at pull, samples, loss, norm,
       non-finite] + gradient shard 0; rank 0 decides and applies under its mutex;
    4. K = 1: the decision comes in the next round's step 2 header, in a field of its own (its status may be STOP
       after a REFRESH decision: the client counts that refresh as the server did). K > 1: rank 0 sends the
       decision header; c sends every server s >= 1 COMMIT (the decision's staleness) + gradient shard s, or DROP
       (refresh or end); each applies a COMMIT under its mutex and starts the next round with step 1.

    Status GO: the previous push was applied or skipped as non-finite; go on with new mini-batches. REFRESH: it was
    too stale; recompute the same ones on the new weights (same push id). STOP: the run is over (``steps`` pushes, or
    :meth:`Engine.stop` or ``close()`` asked on rank 0: its next header says so, so no client computes a push after
    it); the client tells the other servers DONE. ABORT: a rank failed; the header names it.

    Why a push is applied by all servers or none, exactly once each: only rank 0 decides, and a server s >= 1 applies
    exactly the pushes that c COMMITs to it, after rank 0 applied them; clipping and the non-finite skip use the norm
    of the whole gradient, computed by the client and sent in the header, so every shard takes the same decision.
    Why the version and staleness are global: per-shard staleness would let shards disagree on refreshing a push and
    on its damped lr. Version_s counts the pushes server s applied, a subset of those rank 0 applied; rank 0's
    snapshot is taken last (after c holds every other shard), so version at pull = min_s version_s, and staleness =
    version_0 at apply - version at pull is the largest number of applied pushes missing from any shard of the
    weights the gradient was computed on. With ``max_staleness=0`` that is none on every shard: the run is sequential
    training in rank 0's order. With K = 1 this is the single server's version and staleness.

    Failures: a failed exchange names its peer, a FAILED header names the rank it reports; the first failure a
    server sees stops it, and each of its threads sends its client ABORT naming the failed rank at the next step 1
    or 2 (or 4). A client that learns of a failure (ABORT, a failed exchange, its own exception) first receives what
    the servers are sending it, then sends FAILED to every server waiting for it, then raises; so a surviving
    client's exit is not taken for the failure, and every rank raises :class:`DistributedError` naming it. ABORT and
    FAILED headers are followed by ``_TEXT_BYTES`` of UTF-8 text, what failed (for a rank that raised: its
    exception's type and first line), which every rank's error repeats.
    End of a run: a client that ended normally (it sent DONE, or received STOP) then waits for one more header from
    every server; once all of its threads have ended, each server sends every such client STOP, or ABORT if any rank
    failed meanwhile. Without it a client that ran out of data early would learn of a later failure only from the
    end-of-run broadcast, which cannot say which rank failed. That wait, like the broadcast after it, is bounded by
    the process group's timeout: a client that runs out of data longer than that before the run ends raises.

    Note [A timeout names the rank that hangs]
    A rank that hangs (a push whose update never ends, a stuck client) sends nothing, so its peers' waits end only at
    the process group's timeout T, and after its first timeout gloo closes every connection of that process
    ("Application timeout caused pair closure"): no FAILED or ABORT can follow. And the first rank to time out may
    not be the one next to the hung rank: with K > 1, while client c waits for a hung server s, rank 0 waits for c's
    next PULL, since a moment before c began waiting, so rank 0 times out first and would blame c. So timeouts are
    told through the rendezvous store (key ``hung``, the first record wins):
    - a client whose wait for server s times out records "s hangs, reported by c": a server thread for c waits for
      nothing but c, and takes the mutex only to update or copy its shard, so a silent server thread means s hangs;
    - a server whose wait for client c times out first waits up to T for such a record (c began its own wait about
      when this server began waiting for c, so its timeout comes within about T of this one) and names the rank it
      reports; only without one does it record and name c ("did not answer within T s: it hangs, or waits for a rank
      that hangs");
    - a server thread whose exchange failed because another thread of this process timed out (the closed
      connections) names nothing itself (it is used only if no other failure is);
    - a server that timed out says so at once (key ``timedout/<s>``), before its wait; a client whose exchange with
      server s fails otherwise (s closed its connections, or exited) waits up to ``_ANNOUNCE_WAIT_S`` (1 s: gloo
      closes the connections a moment before the server's Python code runs) for that, then looks for the ``hung``
      record, waiting up to T + 1 s for it when s timed out; so neither a server that timed out nor a rank that
      exited because of a hang is taken for the failure. The cost: a client that sees a server die learns it 1 s
      later (once: later failed exchanges of that client do not wait).
    So every rank but the hung one raises within about 2 T naming it; the hung rank goes on hanging.
    """

    def __init__(self, engine, group, servers: int, steps, callbacks, rendezvous: _Rendezvous, run=None):
        self.engine, self.group, self.servers, self.callbacks = engine, group, servers, callbacks
        self.run_threads = run.threads if run is not None else set()  # Note [Closing a multi-node async run]
        self.rendezvous, self.timeout_s = rendezvous, _group_timeout(group)
        self.rank = dist.get_rank(group)
        self.span = shard_spans(engine.store.numel, servers)[self.rank]
        self.last_push = None if steps is None else engine.stats()["pushes"] + steps  # ``steps`` counts this run's
        self.stop = threading.Event()
        # (failed rank, what failed: the text passed on in ABORT, the rank that reported it or None, cause): first wins
        self.failure: tuple[int, str, int | None, BaseException | None] | None = None
        self.consequence: tuple | None = None  # a failure caused by this process's own timeout (Note [A timeout ...])
        self._failure_lock = threading.Lock()
        self.finished: set[int] = set()  # the clients that ended normally (DONE, or sent STOP): told the outcome

    def run(self) -> None:
        serve = self._coordinate if self.rank == 0 else self._serve_shard
        threads = [threading.Thread(target=self._guarded, args=(serve, c), name=f"pyengine-serve-{c}", daemon=True)
                   for c in range(self.servers, dist.get_world_size(self.group))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.failure = self.failure or self.consequence
        self._tell_outcome()
        if self.failure is not None:
            failed, what, reporter, cause = self.failure
            # the cause's traceback holds this server's frames: kept here too, it made a cycle that kept the engine
            self.failure = self.consequence = None
            raise DistributedError(f"rank {self.rank}: the async run stopped because rank {failed} failed: "
                                   f"{_reported(what, reporter)}") from cause

    def _tell_outcome(self) -> None:
        """Sends every client that ended normally STOP, or ABORT naming the failed rank when a rank failed after it
        ended, so that it raises instead of waiting in the end-of-run broadcast for a rank that is gone."""
        for client in sorted(self.finished):
            try:
                self._send_header(client, _STOP, 0, 0)
            except _ExchangeFailed as exc:
                self._exchange_failed(client, exc)

    def _fail(self, failed: int, what: str, reporter: int | None = None, cause: BaseException | None = None,
              consequence: bool = False) -> None:
        with self._failure_lock:
            if consequence:
                self.consequence = self.consequence or (failed, what, reporter, cause)
            elif self.failure is None:
                self.failure = (failed, what, reporter, cause)
        self.stop.set()

    def _exchange_failed(self, client: int, exc: "_ExchangeFailed") -> None:
        """Records the failure of an exchange with ``client``: the rank that a timed-out rank reported hung, else
        ``client`` (Note [A timeout names the rank that hangs])."""
        cause = exc.__cause__
        own_timeout = "Timed out" in str(cause)
        if own_timeout:
            self.rendezvous.record(f"timedout/{self.rank}", "1")
        report = _hang_report(self.rendezvous, (self.timeout_s or 0.0) if own_timeout else 0.0)
        if report is not None:
            self._fail(*report, cause=cause)
        elif own_timeout:
            what = _silent(client, self.timeout_s, "or waits for a rank that hangs", exc)
            self.rendezvous.record("hung", f"{client}\n{self.rank}\n{what}")
            self._fail(client, what, cause=cause)
        else:
            self._fail(client, str(exc), cause=cause, consequence=_timed_out(cause))

    def _guarded(self, serve, client: int) -> None:
        ident = threading.get_ident()
        self.run_threads.add(ident)  # a callback's close() here must not wait for this thread
        try:
            serve(client)
        except _ExchangeFailed as exc:
            self._exchange_failed(client, exc)
        except BaseException as exc:  # noqa: BLE001 - re-raised by run()
            self._fail(self.rank, f"serving rank {client} raised {_short_error(exc)}", cause=exc)
        finally:  # a thread started after this one ended may get its id (close() compares ids)
            self.run_threads.discard(ident)

    def _coordinate(self, client: int) -> None:
        """Rank 0's thread for ``client``: steps 2-4 of Note [Multi-node async exchange]."""
        header = torch.zeros(_CLIENT_HEADER, dtype=torch.float64)
        lo, hi = self.span
        grad = torch.zeros(hi - lo)  # this server's shard of a push (a whole store's per client before)
        status, last_applied, staleness = _GO, 0, 0
        while True:
            if self.servers > 1 and not self._receive(header, client, expect=(_PULL,)):
                return
            if self._ends(client, self._send_header(client, status, last_applied, staleness, weights=True)):
                return
            if not self._receive(header, client, expect=(_PUSH,)):
                return
            self._exchange(dist.recv, grad, client, "receive of a gradient from")
            status, staleness, step = self._apply(client, grad, header)
            if status == _GO and step:  # applied (a push skipped as non-finite has no Adam step)
                last_applied = int(header[1].item())
            if self.servers > 1 and self._ends(client, self._send_header(client, status, last_applied, staleness,
                                                                         version=step)):
                return

    def _ends(self, client: int, status: float) -> bool:
        """Whether the header just sent to ``client`` ends its thread (STOP: the client ended normally)."""
        if status == _STOP:
            self.finished.add(client)
        return status in (_STOP, _ABORT)

    def _serve_shard(self, client: int) -> None:
        """The thread of a server s >= 1 for ``client``: step 1, then apply what the client COMMITs."""
        header = torch.zeros(_CLIENT_HEADER, dtype=torch.float64)
        lo, hi = self.span
        grad = torch.zeros(hi - lo)  # this server's shard of a push
        while True:
            if self._send_header(client, _GO, 0, 0, weights=True) == _ABORT:
                return
            if not self._receive(header, client, expect=(_COMMIT, _DROP)):
                return
            if header[0].item() == _COMMIT:
                self._exchange(dist.recv, grad, client, "receive of a gradient from")
                self._apply(client, grad, header, staleness=int(header[7].item()), step=int(header[8].item()))

    def _apply(self, client: int, grad: torch.Tensor, header: torch.Tensor, staleness: int | None = None,
               step: int | None = None) -> tuple[float, int, int]:
        """Applies a push to this server's shard under the mutex (rank 0 decides; the others are given the
        ``staleness`` and the Adam ``step`` rank 0 applied it with: a push applied on the shards in different orders
        still gets one bias correction everywhere); returns the status for the client, the push's staleness and its
        Adam step (0 when not applied). An exception (a callback, ``nonfinite="raise"``) stops the run: the client is
        told ABORT next."""
        try:
            return self._apply_push(client, grad, header, staleness, step)
        except Exception as exc:  # noqa: BLE001 - re-raised by run()
            self._fail(self.rank, f"applying a push of rank {client} raised {_short_error(exc)}", cause=exc)
            return _ABORT, 0, 0

    def _apply_push(self, client, grad, header, staleness, step) -> tuple[float, int, int]:
        engine = self.engine
        push_id, pulled, samples, loss, norm, nonfinite = header[1:7].tolist()
        scale = header[9].item() or None  # the scale the client computed with (Note [Loss scaling])
        with engine.mutex, engine.phase("push", client):
            if self._stopped():  # between two pushes: none more
                return _STOP, 0, 0
            start = time.perf_counter()
            pushed = engine.apply_push(int(pulled), [], grads=[grad], staleness=staleness, span=self.span,
                                       norm=(torch.tensor(norm, dtype=torch.float32), nonfinite != 0.0), step=step,
                                       loss_scale=scale)
            if pushed is None:
                return _REFRESH, 0, 0
            applied, staleness = pushed
            step = (engine.version if step is None else step) if applied else 0
            update = time.perf_counter() - start
            metrics = step_metrics(engine, loss=loss, samples=int(samples), wall=update, compute=0.0, update=update,
                                   transfer_wait=0.0, copy_back=0.0, applied=applied, worker=client, rank=client,
                                   push_id=int(push_id), version_at_pull=int(pulled),
                                   version_at_apply=engine.version - int(applied), staleness=staleness,
                                   server=self.rank, adam_step=step if applied else None, lr_step=step or None,
                                   lr_divisor=engine.staleness_divisor(staleness), loss_scale=scale)
            engine._record(metrics)
            for callback in self.callbacks:
                callback(engine, metrics)
            if self.rank == 0 and (engine.stop_requested or engine._closed or
                                   self.last_push is not None and engine.stats()["pushes"] >= self.last_push):
                self.stop.set()
        return _GO, staleness, step

    def _stopped(self) -> bool:
        """Under the engine's mutex: whether this server stopped (rank 0: ``steps`` reached, or stop() or close()
        asked on this rank, which stops it here; any server: a rank failed)."""
        if self.rank == 0 and (self.engine.stop_requested or self.engine._closed):
            self.stop.set()
        return self.stop.is_set()

    def _send_header(self, client: int, status: float, last_applied: int, staleness: int,
                     weights: bool = False, version: int | None = None) -> float:
        """Sends ``client`` a header (ABORT naming the failed rank once this server failed) and with ``weights``
        a snapshot of this server's shard taken under the mutex, then STOP once rank 0 stopped (a decision is sent
        as it was taken: the push that reached ``steps`` is still committed); ``status`` also goes in a field of its
        own, rank 0's decision on the client's last push (step 4 of Note [Multi-node async exchange]); returns the
        status sent."""
        lo, hi = self.span
        store = self.engine.store
        source = store.param if store.shadow is None else store.shadow  # Note [An async pull sends the replicas' dtype]
        try:
            with self.engine.mutex:
                version = self.engine.version if version is None else version
                snapshot = source[lo:hi].clone() if weights else None
                scale = (self.engine.loss_scale_now() or 0.0) if self.rank == 0 else 0.0  # rank 0's scale decides
                stopped = self._stopped()
        except Exception as exc:  # noqa: BLE001 - told to the client now, raised by run()
            # This server's own code failed (not an exchange: a failed allocation, a bug) while the client waits for
            # this header and the weights after it: it is sent ABORT naming this rank and the error, and zeros in
            # place of the weights it expects, so it raises with them (it learned only of a closed connection).
            self._fail(self.rank, f"serving rank {client} raised {_short_error(exc)}", cause=exc)
            version, scale, stopped = version or 0, 0.0, True
            snapshot = torch.zeros(hi - lo, dtype=source.dtype) if weights else None
        failed, failure, decision = -1.0, self.failure, status
        if failure is not None:
            status, failed = _ABORT, float(failure[0])
        elif weights and stopped and self.rank == 0:
            status = _STOP
        header = torch.tensor([status, float(version), float(last_applied), failed, float(staleness), scale,
                               decision], dtype=torch.float64)
        self._exchange(dist.send, header, client, "send to")
        if status == _ABORT:
            self._exchange(dist.send, _encode_text(failure[1]), client, "send to")
        if snapshot is not None:
            self._exchange(dist.send, snapshot, client, "send of the weights to")
        return status

    def _receive(self, header: torch.Tensor, client: int, expect: tuple) -> bool:
        """Receives a client header: True for a kind in ``expect``; False when the client is DONE (recorded in
        :attr:`finished`) or reports a failed rank (recorded, with the text that follows)."""
        self._exchange(dist.recv, header, client, "receive from")
        kind = header[0].item()
        if kind == _FAILED:
            text = torch.zeros(_TEXT_BYTES, dtype=torch.uint8)
            self._exchange(dist.recv, text, client, "receive from")
            self._fail(int(header[7].item()), _decode_text(text), reporter=client)
            return False
        if kind == _DONE:
            self.finished.add(client)
            return False
        if kind not in expect:
            raise RuntimeError(f"async protocol: message kind {kind} from rank {client}; expected one of {expect}")
        return True

    def _exchange(self, op, tensor: torch.Tensor, client: int, what: str) -> None:
        try:
            op(tensor, dist.get_global_rank(self.group, client), group=self.group, tag=client)
        except RuntimeError as exc:  # gloo's errors, DistBackendError included
            raise _ExchangeFailed(f"{what} rank {client} failed ({type(exc).__name__}: {exc})") from exc


class _ExchangeFailed(RuntimeError):
    """A point-to-point exchange of the async protocol failed: the peer died, raised or timed out."""


def _silent(peer: int, timeout_s: float | None, also: str, exc: BaseException) -> str:
    """What a rank whose wait for ``peer`` timed out says about it."""
    within = f"the process group's timeout ({timeout_s:g} s)" if timeout_s else "the process group's timeout"
    return (f"rank {peer} did not answer within {within}: it hangs, is stuck {also}; see its log (if it is only "
            f"slow, raise init_process_group(timeout_s=...)) [{exc}]")


_ANNOUNCE_WAIT_S = 1.0  # Note [A timeout names the rank that hangs]: from a closed connection to the record after it


def _wait_record(rendezvous: _Rendezvous, key: str, wait_s: float) -> str | None:
    """The record ``key`` of ``rendezvous``, waiting up to ``wait_s`` for one (polling the store); None if none."""
    deadline = time.monotonic() + wait_s
    while True:
        record = rendezvous.recorded(key)
        if record is not None or time.monotonic() >= deadline:
            return record
        time.sleep(0.05)


def _hang_report(rendezvous: _Rendezvous, wait_s: float = 0.0) -> tuple[int, str, int] | None:
    """(hung rank, what, reporting rank) from the ``hung`` record of the run, waiting up to ``wait_s`` for one; None
    if there is none (Note [A timeout names the rank that hangs])."""
    record = _wait_record(rendezvous, "hung", wait_s)
    if record is None:
        return None
    failed, reporter, what = record.split("\n", 2)
    return int(failed), what, int(reporter)


def _reported(what: str, reporter: int | None) -> str:
    return what if reporter is None else f"{what} (reported by rank {reporter})"


class _ClientAbort(Exception):
    """Inside a client: the run must stop because rank ``failed`` failed; ``what`` failed (the text passed on to the
    servers), as ``reporter`` said (None: this rank saw it)."""

    def __init__(self, failed: int, what: str, reporter: int | None = None):
        super().__init__(_reported(what, reporter))
        self.failed, self.what, self.reporter = failed, what, reporter


class _ServerHeader(typing.NamedTuple):
    """A server's header as a client reads it (Note [Multi-node async exchange])."""

    status: float  # GO, REFRESH, STOP or ABORT
    version: int  # the server's version (rank 0's decision header: the push's Adam step)
    applied: int  # rank 0: the id of this client's last applied push (0: none yet)
    failed: int  # ABORT: the rank that failed
    staleness: int  # rank 0's decision header: the push's staleness
    text: str  # ABORT: what failed (the text that follows), else ""
    scale: float | None  # rank 0's loss scale (None: no scaling)
    decision: float  # rank 0: its decision on this client's last push (GO before the first)


class _AsyncClient:
    """A client rank of a multi-node async run: pull every shard, compute with the local workers (node-local
    hybrid), push each server its shard of the gradient; until STOP or no data (Note [Multi-node async exchange]).
    """

    def __init__(self, engine, group, servers: int, rendezvous: _Rendezvous, callbacks=()):
        self.engine, self.group, self.servers, self.callbacks = engine, group, servers, callbacks
        self.rendezvous, self.timeout_s = rendezvous, _group_timeout(group)
        self.rank = dist.get_rank(group)
        self.spans = shard_spans(engine.store.numel, servers)
        self.reduced = torch.zeros(engine.store.numel)
        self.waiting: set[int] = set()  # the servers waiting for a header from this rank
        self.announced_wait = _ANNOUNCE_WAIT_S  # spent on the first failed exchange (Note [A timeout names the ...])
        self.sent_at = 0  # version at pull of the last push sent
        self.newest_pull = engine.version  # the newest version pulled in this run (Note [A failed run of several ...])
        self.sent: dict = {}  # its loss and samples
        self.acknowledged = 0  # the last of this fit's pushes that server 0 said it applied (push ids start at 1)
        self.acknowledgements: list[dict] = []  # their metrics, not yet given to the callbacks

    def run(self, batches, epochs, steps=None) -> None:
        from .asynchronous import _AsItself

        own = None
        try:
            self._loop(batches, epochs, steps)
            self._receive_outcome()
        except _ClientAbort as abort:
            self._tell_waiting(_FAILED, failed=abort.failed, text=abort.what)
            raise DistributedError(f"rank {self.rank}: the async run stopped because rank {abort.failed} failed: "
                                   f"{abort}") from abort.__cause__
        except _AsItself as wrapped:  # the batches iterable's error: this rank's, raised as itself (below)
            own, wrapped.error = wrapped.error, None  # raised in here, it would hold the wrapper that holds it
            self._tell_waiting(_FAILED, failed=self.rank, text=_short_error(own))
        except BaseException as exc:  # this rank fails: the servers learn it at once, and what it raised
            self._tell_waiting(_FAILED, failed=self.rank, text=_short_error(exc))
            raise
        if own is not None:
            try:
                raise own
            finally:  # this frame is in its traceback: no cycle through the engine (Note [A task's exception and
                own = None  # its callers' frames] in engine.py)

    def call_back(self) -> None:
        """The callbacks, with the metrics of each push rank 0 acknowledged since the last call. Called between
        exchanges, never inside one (a callback that raised there left server 0 sending the weights, and both
        waited for the group's timeout): in the loop after a pull or a decision, and after the run's end."""
        while self.acknowledgements:
            metrics = self.acknowledgements.pop(0)
            for callback in self.callbacks:  # its error is this rank's: the servers are told, fit raises it
                callback(self.engine, metrics)

    def _receive_outcome(self) -> None:
        """After this rank ended normally: every server's STOP, or ABORT naming a rank that failed later (raised as
        :class:`_ClientAbort` once every server's message is in)."""
        failure = None
        for s in range(self.servers):
            try:
                header = self._receive_header(s)
                if header.status == _ABORT:
                    failure = failure or _ClientAbort(header.failed, header.text, reporter=s)
            except _ClientAbort as abort:
                failure = failure or abort
        if failure is not None:
            raise failure

    def _loop(self, batches, epochs, steps=None) -> None:
        from .asynchronous import _BatchSource, minibatches_per_push

        engine = self.engine
        source = None  # made after the first pull: iter(batches) may raise (as a batch may), and a client that
        # failed before its first pull left the servers' first weights unreceived in the connections, where the next
        # run's first broadcast then read them (every rank timed out at its start)
        slots = [engine.store.grad_slot(w.index) for w in engine.workers]
        minibatches, push_id, decision = None, 0, _GO
        while True:
            status, pulled, scale, decided = self._pull()
            self.newest_pull = max(self.newest_pull, pulled)
            if self.servers == 1:  # rank 0's decision on the last push comes with the pull, a STOP or not
                decision = self._learn(decided, push_id)
            self.call_back()
            if status == _STOP:
                self._tell_waiting(_DONE)
                return
            if engine.stop_requested or engine._closed:  # Note [Closing a multi-node async run]; before a batch is
                self._tell_waiting(_DONE)  # taken, which a later fit gets (a generator lost it), as in one process
                return
            if decision == _GO:  # the previous push (if any) was applied or skipped: next mini-batches
                if source is None:  # fit's steps: this client's pushes at most
                    source = _BatchSource(batches, epochs, pushes=steps)
                _, minibatches = source.take(minibatches_per_push(engine, pulled))
            if not minibatches:
                self._tell_waiting(_DONE)
                return
            for worker in engine.workers:
                worker.pull(wait=True)
            engine.begin_rng_step(engine._counters["pushes"])  # Note [Random numbers of concurrent workers]
            loss, samples = _client_gradient(engine, minibatches, slots, self.reduced, scale)
            norm, nonfinite = ops.mean_grad_norm([self.reduced])
            push_id += 1 if decision == _GO else 0
            self.sent_at, self.sent = pulled, dict(loss=loss, samples=samples)
            engine.count("pushes")
            header = [_PUSH, push_id, pulled, samples, loss, norm.item(), nonfinite.item(), 0.0, 0.0, scale or 0.0]
            self._send(0, header, gradient=True)
            if self.servers > 1:
                decision = self._learn(self._decide(header), push_id)
                self.call_back()
                if decision == _STOP:
                    return

    def _learn(self, decision: float, push_id: int) -> float:
        """Rank 0's ``decision`` on this rank's last push ``push_id``, returned; a REFRESH is counted here, as the
        server counted it when it refused the push, whatever follows (a STOP may come with it: counted only when the
        next pull said go on, such a refresh was counted by no client). A GO for a push rank 0 did not acknowledge as
        applied: skipped as non-finite, counted and recorded so (``applied`` False), as a skipped step in one
        process; the client's history and callbacks had it as applied."""
        if decision == _REFRESH:
            self.engine.count("refreshes")
        elif decision == _GO and push_id and self.acknowledged != push_id:
            self.engine.count("skipped_steps")
            metrics = dict(push_id=push_id, rank=self.rank, applied=False, version_at_pull=self.sent_at, **self.sent)
            self.engine._record(metrics)
            self.acknowledgements.append(metrics)  # to the callbacks, as an applied push's
        return decision

    def _pull(self) -> tuple[float, int, float | None, float]:
        """Steps 1 and 2: every shard of the weights into the store; returns rank 0's status, the version at pull
        (the smallest of the servers' versions), rank 0's loss scale (None: no scaling) to compute with and its
        decision on this rank's last push (GO before the first)."""
        versions, failure = [], None
        for s in range(1, self.servers):
            try:
                versions.append(self._receive_state(s).version)
            except _ClientAbort as abort:  # go on receiving what the other servers are sending
                failure = failure or abort
        if failure is not None:
            raise failure
        if self.servers > 1:
            self._send(0, [_PULL])
        header = self._receive_state(0)
        return header.status, min([header.version] + versions), header.scale, header.decision

    def _decide(self, header: list) -> float:
        """Step 4 with K > 1: rank 0's decision, then COMMIT (with its staleness) or DROP to every other server."""
        decided = self._receive_header(0)
        status = decided.status
        if status == _ABORT:
            raise _ClientAbort(decided.failed, decided.text, reporter=0)
        if status == _STOP:
            self._tell_waiting(_DONE)
            return status
        commit = [_COMMIT] + header[1:7] + [decided.staleness, decided.version, header[9]]  # version: its Adam step
        message = commit if status == _GO else [_DROP]
        sent, failure = [], None
        for s in range(1, self.servers):
            try:
                self._send(s, message, gradient=status == _GO)
                sent.append(s)
            except _ClientAbort as abort:
                failure = failure or abort
        if failure is not None:  # receive the states the others are sending, then stop
            for s in sent:
                with contextlib.suppress(_ClientAbort):
                    self._receive_state(s)
            raise failure
        return status

    def _receive_header(self, server: int) -> "_ServerHeader":
        """A server's header; records rank 0's acknowledgement."""
        header = torch.zeros(_SERVER_HEADER, dtype=torch.float64)
        self._exchange(dist.recv, header, server, "receive from")
        status, version, applied, failed, staleness, scale, decision = header.tolist()
        text = torch.zeros(_TEXT_BYTES, dtype=torch.uint8)
        if status == _ABORT:
            self._exchange(dist.recv, text, server, "receive from")
        if status not in (_STOP, _ABORT):
            self.waiting.add(server)
        # recorded once per push (headers repeat the last applied one); not looked up in the engine's history,
        # which keep_history may have emptied
        if server == 0 and applied and self.acknowledged != applied:
            self.acknowledged = applied
            metrics = dict(push_id=int(applied), rank=self.rank, applied=True, version_at_pull=self.sent_at,
                           **self.sent)
            self.engine._record(metrics)
            self.acknowledgements.append(metrics)  # to the callbacks once this exchange is over (call_back)
        return _ServerHeader(status, int(version), int(applied), int(failed), int(staleness), _decode_text(text),
                             scale or None, decision)

    def _receive_state(self, server: int) -> "_ServerHeader":
        """A server's header and its shard of the weights (into the store); raises :class:`_ClientAbort` on
        ABORT."""
        header = self._receive_header(server)
        lo, hi = self.spans[server]
        store = self.engine.store
        if store.shadow is None:
            self._exchange(dist.recv, store.param[lo:hi], server, "receive of the weights from")
        else:
            # Note [An async pull sends the replicas' dtype]
            # A low-precision model's replicas compute on the master weights rounded to their dtype, which a server
            # holds as its store's shadow (Note [The shadow follows the master weights]): it sends that, half the
            # bytes of its float32 weights, and the client computes on the same bits as if it had received those
            # and rounded them itself. The client's float32 weights are then the ones it computes on (what its
            # callbacks read during the run); the end of the run gives every rank the exact master (_share_store).
            self._exchange(dist.recv, store.shadow[lo:hi], server, "receive of the weights from")
            store.param[lo:hi].copy_(store.shadow[lo:hi])
        if header.status == _ABORT:
            raise _ClientAbort(header.failed, header.text, reporter=server)
        return header

    def _send(self, server: int, header: list, gradient: bool = False) -> None:
        """Sends ``server`` a header (padded) and with ``gradient`` its shard of the pushed gradient."""
        message = torch.zeros(_CLIENT_HEADER, dtype=torch.float64)
        message[:len(header)] = torch.tensor(header, dtype=torch.float64)
        self.waiting.discard(server)
        self._exchange(dist.send, message, server, "send to")
        if gradient:
            lo, hi = self.spans[server]
            self._exchange(dist.send, self.reduced[lo:hi], server, "send of a gradient to")

    def _tell_waiting(self, kind: float, failed: int = -1, text: str = "") -> None:
        """DONE (errors raise) or FAILED naming ``failed``, followed by ``text`` (what failed; best effort), to every
        server waiting for this rank."""
        for s in sorted(self.waiting):
            try:
                self._send(s, [kind] + [0.0] * 6 + [float(failed)])
                if kind == _FAILED:
                    self._exchange(dist.send, _encode_text(text), s, "send to")
            except _ClientAbort:
                if kind != _FAILED:
                    raise

    def _exchange(self, op, tensor: torch.Tensor, server: int, what: str) -> None:
        try:
            op(tensor, dist.get_global_rank(self.group, server), group=self.group, tag=self.rank)
        except RuntimeError as exc:  # gloo's errors, DistBackendError included
            self.waiting.discard(server)  # Note [A timeout names the rank that hangs]
            what = f"{what} rank {server} failed ({type(exc).__name__}: {exc})"
            if "Timed out" in str(exc):
                what = _silent(server, self.timeout_s, "or is overloaded", what)
                self.rendezvous.record("hung", f"{server}\n{self.rank}\n{what}")
                raise _ClientAbort(server, what) from exc
            # the server may have closed its connections on its own timeout: then it names the rank that hangs soon
            resolving = _wait_record(self.rendezvous, f"timedout/{server}", self.announced_wait) is not None
            self.announced_wait = 0.0
            report = _hang_report(self.rendezvous, (self.timeout_s or 0.0) + 1.0 if resolving else 0.0)
            raise (_ClientAbort(*report) if report is not None else _ClientAbort(server, what)) from exc


def _client_gradient(engine, minibatches, slots, out, scale: float | None) -> tuple[float, int]:
    """The local workers split every mini-batch; out = the sum over the mini-batches of each mini-batch's mean
    gradient, as the single-node async ``accumulate``, each loss times ``scale`` when given. Returns the mean of the
    mini-batches' mean losses (as single-node async) and the samples.

    Each mini-batch splits on its own (8 samples 4/4, then 3 samples 2/1), so a worker weights each of its shards'
    losses by that shard's share of its mini-batch (:meth:`Worker.compute` with ``weights``): its slot holds
    sum_j (n_jg / N_j) grad_jg, and the plain sum of the slots is the sum over j of mini-batch j's mean gradient.
    A mini-batch of fewer samples than workers (a data set's tail) feeds only as many workers, one sample each, as
    single-node async computes on any batch; a worker that gets no shard of any mini-batch sits the push out, its
    slot (an earlier push's gradient) left out of the sum."""
    G = engine.num_workers
    shards = [split_batch(b, min(G, batch_size(b)) or G) for b in minibatches]  # 0 samples: split_batch's error
    shares = [[batch_size(s) / sum(batch_size(t) for t in split) for s in split] for split in shards]
    mine = {w.index: [j for j, split in enumerate(shards) if w.index < len(split)] for w in engine.workers}
    def compute(w):
        return w.compute(engine.loss_fn, [shards[j][w.index] for j in mine[w.index]],
                         [shares[j][w.index] for j in mine[w.index]], loss_scale=scale)

    results = engine.run_workers({w.index: (lambda w=w: compute(w)) for w in engine.workers if mine[w.index]})
    used = [g for g, w in enumerate(engine.workers) if mine[w.index]]
    DistributedHybrid._local_sum(out, [slots[g] for g in used], [1.0] * len(used))
    loss = sum(results[i][0] for i in results) / len(minibatches)
    return loss, sum(batch_size(b) for b in minibatches)


def run_async(engine, group, batches, *, servers: int = 1, steps, epochs, callbacks) -> None:
    """Multi-node async (Note [Multi-node async exchange]): ranks ``0..servers-1`` serve their shards of the store
    until ``steps`` pushes are applied (counted from this call), :meth:`Engine.stop` or every client ran out of data;
    the other ranks compute on their ``batches`` and push.

    Collectives at both ends: rank 0's store (weights, Adam state, version) goes to every rank first, and at the end
    every server's shard goes to every rank, so after a complete run every rank's store holds the result. After a
    failure every rank raises :class:`DistributedError` and the servers' shards may differ by the pushes in flight.

    Note [A failed run of several servers]
    With ``servers > 1`` each server applies the pushes to its own shard, and the shards meet only in the exchange
    that ends a run well; a failed run skips it. The next run began with rank 0's whole store broadcast to every
    rank, so the other servers' shards went back to the start of the failed run (weights and Adam moments), while
    the version and Adam step went on counting: silently wrong weights (4e-2 apart from one process after a
    nonfinite="raise" run). So after a failed run in which a push was applied (as far as the rank saw: a server's
    version moved, a client pulled a later version) the rank's engine refuses further runs and its state (fit,
    state_dict, master_state_dict, copy_to, checkpoint.save_engine: a DistributedError saying so); a run that failed
    before any push was applied, or after the end's exchange, changed no shard alone; with one server rank 0 holds
    the whole store, and the next run goes on from it as before. (A client that saw no push applied while a server
    did goes on to the next run, whose start then fails on it naming the servers that refused it.)"""
    from .asynchronous import AsyncRun, _closed_during_fit, _end

    # Note [Closing a multi-node async run]
    # close() from another thread (or a callback) while this runs must neither return at once while the pushes go on
    # being applied nor close the workers' transfers under a computing client (which failed the whole run as this
    # rank's error). So the run is registered as a one-process run is (engine._async_run): close() marks the engine
    # closed, then waits for this function to return before it closes the workers (not from a thread of the run: a
    # server's threads run the callbacks). Marked closed, rank 0 stops the run after the push being applied (as
    # stop() does there; checked before each push is applied, so none is after it); a client ends its part after
    # its current push (as when its batches run out; stop() on a client does the same); another server serves on
    # until rank 0 ends the run. The run then ends as usual (every rank's store holds the result) and fit raises
    # RuntimeError on the closed rank. A client's fit, and so its close(), ends only with the whole run (the
    # servers' word on its outcome, the final exchange of the store): it may wait for the other clients' pushes.
    if dist.get_rank(group) < servers and isinstance(batches, collections.abc.Sized) and len(batches) > 0:
        warnings.warn(f"fit: rank {dist.get_rank(group)} is a parameter server (servers={servers}) and trains on no "
                      f"batches: its {len(batches)} are not used (pass [] on the servers; the clients' batches are "
                      "the run's data)", RuntimeWarning, stacklevel=4)  # the caller of Engine.fit
    run = AsyncRun()
    with engine.mutex:
        engine._check_open()
        engine._async_run = run
    try:
        numel = engine.store.numel
        naming = engine.async_naming
        naming.check_whole()
        naming.start_run()
        _share_store(engine, group, [(0, 0, numel)], naming._explain)
        rendezvous = _Rendezvous(group, "async")  # Note [A timeout names the rank that hangs]
        client, start, whole = None, engine.version, False
        try:
            if dist.get_rank(group) < servers:
                AsyncServer(engine, group, servers, steps, callbacks, rendezvous, run).run()
            else:
                client = _AsyncClient(engine, group, servers, rendezvous, callbacks)
                client.run(batches, epochs, steps)
            _share_store(engine, group, [(s, lo, hi) for s, (lo, hi) in enumerate(shard_spans(numel, servers))])
            whole = True
            _servers_take_client_buffers(engine, group, servers, naming._explain)
        except BaseException as exc:
            # a push was applied in this run, as far as this rank saw (a server's version moved; a client pulled
            # weights of a later version)
            moved = engine.version != start or (client is not None and client.newest_pull != start)
            if servers > 1 and moved and not whole:  # Note [A failed run of several servers]
                naming.broken = True
                naming.split = (f"rank {dist.get_rank(group)}: an earlier async run failed, and with servers="
                                f"{servers} each server's shard of the store went on alone until then (only a run "
                                "that ends well brings them together): this rank's store mixes that run's shards "
                                "with its start's, so it neither trains on nor gives its state; load the last "
                                "checkpoint into a new engine")
            if engine.nonfinite == "raise" and isinstance(exc, DistributedError) and _NONFINITE_RAISED in str(exc):
                # nonfinite="raise" on rank 0: raised by every rank as the FloatingPointError it is, as in one process
                # and in hybrid (it was a DistributedError blaming the server); the message names the push
                raise FloatingPointError(str(exc)) from exc
            raise
        if client is not None:  # the pushes acknowledged at the run's end (the others' run is over: no exchange)
            client.call_back()
    finally:
        _end(engine, run)
    if engine._closed:
        raise _closed_during_fit()
