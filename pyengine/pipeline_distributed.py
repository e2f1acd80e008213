"""Pipeline stages in separate processes: one process per stage, the transport and the GPipe / 1F1B schedules of
``torch.distributed.pipelining``, each stage's master weights updated from the Engine's host store by the fused kernel.

    # every rank of a process group of S ranks (torchrun, or torch.multiprocessing.spawn + init_process_group)
    engine = pyengine.Engine(model, loss_fn, devices=["cpu"], mode="pipeline", microbatches=4, schedule="1f1b",
                             process_group=group)          # or the default group under torchrun
    metrics = engine.step((inputs, targets))               # the same batch on every rank

:class:`DistributedPipeline` is what the Engine builds for this: the Engine's API, loss contract and update path,
each rank updating its stage's range of the Engine's store (Note [Distributed pipeline store]).

Every rank builds the same split of ``model`` (``balance="params"`` or a list of sizes) and keeps only its stage:
rank s runs stage s (with ``stages`` < the group's size, data-parallel replicas of each stage: Note [Replicas of
stages across processes]); every rank starts from rank 0's weights, frozen parameters and buffers (broadcast at
construction: Note [Every rank starts from rank 0's model]), and parameters tied across stages stay tied (Note
[Parameters tied across processes]). The schedule scales the
gradients by 1/M (``scale_grads``), so the step is one step of AdamW on the whole batch's mean gradient.
torch.distributed.pipelining sizes its receive buffers from one micro-batch's shape (Note [Static stage metadata]), so
every micro-batch must have the same size: the batch must be a multiple of M (checked, with a clear error).
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import time
import warnings
import weakref
import zlib

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.func import functional_call

from . import ops
from .metrics import step_metrics
from .distributed import (_ENDED, _RAISED, BytePacket, DistributedError, _collective, _FailureNaming,
                          _update_settings, as_bytes, receive_rank0_state, RefusalFlags, refused_step_error,
                          update_digest)
from .pipeline import (StageError, _Activations, _check_sizes, _is_int, _param_costs, batch_like, check_options,
                       check_pair, check_unused, checked_loss, owned_names, partition, split_layers, stage_range,
                       stage_store_names)
from .streamer import check_dense_gradients
from .workers import autocast as autocast_region
from .workers import (FollowedState, KeptBufferCopies, batch_size, check_weights_unchanged, put_back_saved,
                      replica_of, whole_buffers)

__all__ = ["DistributedPipeline", "check_engine_options"]

_SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
SCHEDULES_KEPT = 8  # batch shapes whose schedule a DistributedPipeline keeps (Note [One schedule per batch shape])


def _grads_to_slot(params, slot_views: dict) -> None:
    """Each parameter's ``.grad`` into its view of the gradient slot (zeros for a parameter without one)."""
    for name, p in params:
        if p.grad is None:
            slot_views[name].zero_()
        else:
            slot_views[name].copy_(p.grad)


def _stage_sizes(layers, stages: int, balance) -> list[int]:
    """Layers per stage for ``stages`` processes: ``balance="params"`` or a list of sizes (``"time"`` would need every
    rank to time every layer: not supported)."""
    if stages > len(layers):
        raise ValueError(f"{stages} ranks (stages) but the model has {len(layers)} layers")
    if balance == "params":  # every stage needs a trainable parameter here (its range of the store)
        return partition(_param_costs([layer for _, layer in layers]), stages, each_positive=True)
    if balance == "time":
        raise ValueError("balance='time' is not supported across processes; use 'params' or a list of sizes")
    return _check_sizes(balance, len(layers), stages)


def _run_schedule(schedule, device, microbatches: int, inputs, targets, losses: list) -> None:
    """One pass of a torch.distributed.pipelining schedule: ``inputs`` on the first rank, ``targets`` on the last
    (None elsewhere), one loss per micro-batch appended to ``losses`` on the last rank.

    The whole batch goes through the public ``step(*args, target=, losses=)``, which every torch with pipelining
    takes (pre-split ``arg_mbs=`` is newer); the schedule splits with ``tensor_split`` along dim 0, the same
    micro-batches as ``_check_equal_split``, which the caller runs first to name an uneven batch clearly."""
    args, kwargs = (), {}
    if inputs is not None:
        args = (inputs.to(device),)
    if targets is not None:
        kwargs.update(target=targets.to(device), losses=losses)
    schedule.step(*args, **kwargs)


def _check_equal_split(tensor, microbatches: int, what: str) -> None:
    """A ValueError naming the sizes unless ``tensor`` splits into ``microbatches`` equal micro-batches along dim 0."""
    n = batch_size(tensor)
    if n < microbatches or n % microbatches:
        raise ValueError(f"{what}: a batch of {n} samples does not split into microbatches={microbatches} equal "
                         f"micro-batches (torch.distributed.pipelining needs equal sizes); use a batch size that is "
                         f"a multiple of {microbatches}")


@contextlib.contextmanager
def _attributes_restored(module: torch.nn.Module):
    """Within: a forward of ``module`` may assign its submodules' attributes (``self.cache = torch.ones(...)`` for a
    buffer registered as None, ``self.calls += 1``); on leaving, every submodule holds the attributes, parameters,
    buffers and submodules it held on entering (the same objects: nothing is copied)."""
    saved = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules),
              set(m._non_persistent_buffers_set)) for m in module.modules()]
    try:
        yield
    finally:
        for m, attributes, parameters, buffers, modules, non_persistent in saved:
            m.__dict__.clear()
            m.__dict__.update(attributes)
            for held, kept in ((m._parameters, parameters), (m._buffers, buffers), (m._modules, modules),
                               (m._non_persistent_buffers_set, non_persistent)):
                held.clear()
                held.update(kept)


def stage_inputs(modules, microbatch: torch.Tensor, device: torch.device, context) -> list[torch.Tensor]:
    """What every stage of ``modules`` (the whole model's split) takes in on ``device``, as meta tensors (shape,
    strides, dtype, requires_grad): stage 0's input (``microbatch``), then each stage's output, stage S - 2's last.
    Computed on fake tensors (Note [Static stage metadata]): no data, no arithmetic, no random number drawn, no
    buffer changed, each stage under ``context(device)`` (its autocast). The modules are the user's model's own
    layers: what their forwards assign to themselves is undone (:func:`_attributes_restored`; a cache made at the
    first forward was left in the user's model as a FakeTensor); forward hooks registered on them run, on fake
    tensors. Raises what the fake forward raised."""
    fakes: dict[int, torch.Tensor] = {}  # id -> fake: a parameter tied across stages is one fake tensor

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            fakes[id(t)] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device,
                                               requires_grad=t.requires_grad)
        return fakes[id(t)]

    with FakeTensorMode(), torch.enable_grad():  # with autograd: whether an output requires grad is exact
        x = fake(microbatch)
        inputs = [x]
        for s, module in enumerate(modules[:-1]):
            state = {name: fake(t) for name, t in itertools.chain(module.named_parameters(remove_duplicate=False),
                                                                  module.named_buffers(remove_duplicate=False))}
            with context(device), _attributes_restored(module):
                x = functional_call(module, state, (x,))
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():  # an int one: no gradient goes back
                got = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
                raise _StageOutputError(f"stage {s}'s output is {got}; a stage before the last must return one "
                                        "floating-point tensor (it travels to the next stage's process)")
            inputs.append(x)
    # contiguous: what travels between the processes (gloo sends contiguous tensors only; the stages' outputs are
    # made so, Note [Activations travel contiguous])
    return [torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(t.requires_grad) for t in inputs]


class _StageOutputError(TypeError):
    """A stage before the last returns something other than one tensor: the model's error, the same on every rank
    (each computes every stage's metadata), raised by every rank rather than taken for a failure to infer shapes."""


def _batch_problem(inputs, targets) -> str | None:
    """Why ``(inputs, targets)`` is not a batch a pipeline across processes can run, or None: the inputs must be one
    tensor (the first stage's only argument, split into micro-batches and sent between stages as one tensor), the
    targets one tensor or None (Note [Batches without targets across processes])."""
    if not isinstance(inputs, torch.Tensor):
        return (f"a pipeline over a process group needs the inputs of each (inputs, targets) batch as one tensor; got "
                f"{type(inputs).__name__} (the in-process pipeline, devices=[...] without a process group, also takes "
                "a tuple, list or dict)")
    if targets is not None and not isinstance(targets, torch.Tensor):
        return (f"a pipeline over a process group needs the targets of each (inputs, targets) batch as one tensor or "
                f"None; got {type(targets).__name__}")
    return None


def _fingerprint(t) -> tuple[float, float]:
    """(element count, CRC-32 of the bytes) of a tensor; (-1, 0) for None and (-2, 0) for anything else (Note [The
    same batch on every rank])."""
    if isinstance(t, torch.Tensor):
        return float(t.numel()), batch_checksum(t)
    return (-1.0 if t is None else -2.0), 0.0


# ---- Engine(mode="pipeline") with a process group: rank s runs stage s ------------------------------------------

class _StageMeter:
    """This rank's stage during one step: its compute seconds (Note [Bubble across processes]) and the activations
    autograd keeps for its micro-batches in flight (Note [Activations across processes])."""

    def __init__(self, param_ptrs: set, last: bool):
        self.param_ptrs, self.last = param_ptrs, last
        self.start_step()

    def start_step(self) -> None:
        self.busy = 0.0
        self.memory = _Activations(self.param_ptrs)
        self._saved: dict[int, int] = {}  # micro-batch -> bytes kept for its backward
        self._forward_chunk = None  # the last stage: the micro-batch whose loss comes next

    @contextlib.contextmanager
    def compute(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.busy += time.perf_counter() - start

    @contextlib.contextmanager
    def forward(self, chunk: int):
        if self.last:  # its layers run in the loss (Note [Engine loss on the last process])
            self._forward_chunk = chunk
            with self.compute():
                yield
            return
        with self.compute(), self.memory.hooks():
            yield
        self._saved[chunk] = self.memory.stored()

    @contextlib.contextmanager
    def loss(self):
        with self.compute(), self.memory.hooks():
            yield
        self._saved[self._forward_chunk] = self.memory.stored()

    @contextlib.contextmanager
    def backward(self, chunk: int):
        with self.compute():
            yield
        if chunk in self._saved:
            self.memory.released(self._saved.pop(chunk))


@contextlib.contextmanager
def buffers_restored(module: torch.nn.Module):
    """Within: ``module``'s buffers may change; on leaving, each holds the values it had on entering again (copied
    back in place, so references to the buffers stay valid)."""
    saved = {name: b.detach().clone() for name, b in module.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in saved and b.shape == saved[name].shape:
                    b.copy_(saved[name])


class _MeteredStage(PipelineStage):
    """A ``PipelineStage`` whose forward and backward computations a :class:`_StageMeter` measures. The schedules wait
    for a micro-batch's receives before calling them, so the time is the stage's compute, not its waiting. A backward
    that raises is this rank's own failure, a :class:`StageError` as a forward's or the loss's is (Note [Naming the
    stage that failed]). Built with its metadata (Note [Static stage metadata]), it runs no inference of its own.

    Note [Shape inference leaves the buffers alone]
    Only where the static metadata could not be computed (Note [Static stage metadata]) does a ``PipelineStage`` run
    its module once more at its first step to learn its shapes. torch 2.11 runs it on zeros, under no_grad but in
    training mode: every BatchNorm of the stage took a batch of zeros into its running statistics (running_var
    pulled 10 % towards 0, one batch more counted), which the in-process pipeline and single-device training never
    see. Newer torch backs the buffers up around its (renamed) metadata inference itself; on torch that still has
    ``_shape_inference`` the override below does the same. Tested: a unit test that stands in for torch 2.11's
    inference (the BatchNorm runs across processes failed on torch 2.11 without it, before the static metadata).
    """

    def __init__(self, *args, meter: _StageMeter, **kwargs):
        super().__init__(*args, **kwargs)
        self._pyengine_meter = meter

    def _shape_inference(self, *args, **kwargs):  # torch 2.11; 2.14 calls _forward_metadata_inference instead
        with buffers_restored(self.submod):
            return super()._shape_inference(*args, **kwargs)

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        with self._pyengine_meter.forward(fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        with self._pyengine_meter.backward(bwd_chunk_id):
            try:
                return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
            except Exception as exc:  # this rank's own failure (Note [Naming the stage that failed])
                cause = exc
                while cause.__cause__ is not None:  # torch's "Failed to run stage backward" wraps the error raised
                    cause = cause.__cause__
                if isinstance(cause, StageError):  # a recomputed forward (activation checkpoint) raised
                    raise cause
                raise self.submod.failure(cause) from cause


class _PipelinedLayers(torch.nn.Module):
    """A stage's layers as ``torch.distributed.pipelining`` runs them: the forward under autocast (when the Engine
    has one). On the last stage the forward passes its input through and the Engine's loss runs the layers
    (Note [Engine loss on the last process])."""

    def __init__(self, layers: torch.nn.Sequential, autocast: torch.dtype | None, last: bool, stage: int,
                 replica: int, device: torch.device):
        super().__init__()
        self.layers, self.autocast, self.last = layers, autocast, last
        self.stage, self.replica, self.device = stage, replica, device

    def context(self, device: torch.device):
        return autocast_region(device, self.autocast)  # Note [Autocast without its cast cache] (pyengine.workers)

    def failure(self, exc: BaseException) -> StageError:
        """This rank's own failure ``exc`` (its layers' forward or backward, or the loss) as the StageError naming
        its stage (Note [Naming the stage that failed])."""
        return StageError(self.stage, self.replica, self.device, exc)

    def forward(self, x):
        # Note [A stage's input is its own] (pyengine.pipeline): a received activation is a leaf that requires grad;
        # the layers get a copy, so that an in-place first layer (ReLU(inplace=True), where balance="params" puts
        # parameter-free layers) modifies no leaf (it was "a view of a leaf Variable ... used in an in-place
        # operation" across processes, while the in-process pipeline trained it)
        own = x.clone() if x.requires_grad else x
        if self.last:
            # A node of its own, not the received buffer itself (torch 2.11 left the input without a gradient when
            # x came back unchanged: "has gradients None ... expecting to send gradients to stage 0").
            return own if own is not x else x.view_as(x)
        try:
            with self.context(x.device):
                out = self.layers(own)
        except Exception as exc:  # this rank's own failure (Note [Naming the stage that failed])
            raise self.failure(exc) from exc
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():  # where no fake forward checked it
            got = f"a {out.dtype} tensor" if isinstance(out, torch.Tensor) else type(out).__name__
            raise self.failure(TypeError(f"a stage before the last must return one floating-point tensor (the "
                                         f"activations for the next stage); got {got}"))
        # Note [Activations travel contiguous]: gloo sends and receives contiguous tensors only; a transposed
        # output failed the exchange on both ranks, each naming the other (the in-process pipeline trains it)
        return out.contiguous()


def batch_checksum(t: torch.Tensor) -> float:
    """CRC-32 of a tensor's dtype, shape and bytes (any device), as a float (exact: < 2**32). The same data gives the
    same value whatever the thread count, unlike a floating-point sum (Note [The same batch on every rank]); the same
    bytes as another dtype or shape (zeros as int32 and as float32; [4, 6] and [6, 4]: other micro-batch splits)
    give another value."""
    data = t.detach().to("cpu").contiguous().reshape(-1)
    header = zlib.crc32(f"{t.dtype} {tuple(t.shape)}".encode())
    return float(zlib.crc32(data.view(torch.uint8).numpy(), header))


class DistributedPipeline(_FailureNaming):
    """``Engine(mode="pipeline")`` over a process group of S ranks: rank s builds the same split of the model as every
    other rank, keeps stage s on its one device and runs it under ``torch.distributed.pipelining``'s GPipe / 1F1B
    schedule; built by :class:`~pyengine.Engine` when it has a process group.

    Every rank calls ``engine.step((inputs, targets))`` with the same batch: rank 0 feeds the inputs, the last rank
    the targets. The inputs are one tensor, the targets one tensor or None (Note [Batches without targets across
    processes]). The batch must split into M equal micro-batches (torch.distributed.pipelining's stages need equal
    shapes); its size may change from step to step (Note [One schedule per batch shape]).

    Note [Engine loss on the last process]
    The Engine's contract is ``loss_fn(last_stage, (activations, targets))``. The schedule calls its loss function as
    ``loss(output, target)`` on the last stage's output, so the last stage's module passes its input activations
    through unchanged and the loss runs the last stage's layers on them: autograd then reaches those layers'
    parameters and the received activations exactly as in the in-process pipeline. The layers stay submodules of the
    module the library holds, so its ``scale_grads`` (1/M) and ``zero_grad`` cover them.

    Note [One schedule per batch shape]
    A ``PipelineStage`` sizes its receive buffers from the shapes of its activations once, for good: a later batch of
    another shape (the short last batch of an epoch, another sequence length) would be received into the old
    buffers, an error or, for a smaller message, stale rows read as data. So each batch shape (inputs' and targets'
    shapes and dtypes, the same on every rank) gets its own stage and schedule, built at its first batch with that
    shape's metadata (Note [Static stage metadata]; every rank builds it at the same step, so the exchanges of its
    first step match); the last ``SCHEDULES_KEPT`` shapes are kept, the oldest dropped first, the same on every rank.

    Note [Static stage metadata]
    A ``PipelineStage`` built without ``input_args`` / ``output_args`` infers them at its first step by running its
    module once more: torch 2.11 a no-grad forward on zeros (``_shape_inference``), torch 2.14 a real forward and
    backward, on the last stage with the schedule's loss (``_forward_metadata_inference`` /
    ``_backward_metadata_inference``), on the first micro-batch and, past stage 0, on uninitialised activations.
    That hidden pass drew dropout masks from the rank's generator right after it was seeded for the step (so the
    first step of every new shape drew other masks than the same step of a run whose schedule already existed: a
    resumed run was not bit-identical to the uninterrupted one), ran the user's loss_fn once more on garbage, and
    counted in step 1's ``activation_peak`` and ``busy_s``. Every rank holds the whole model, so each computes every
    stage's input and output metadata itself instead (:func:`stage_inputs`): the model's own layers run, split as the
    stages are, on fake tensors (``FakeTensorMode``: shapes, strides, dtypes and requires_grad propagate, no data, no
    arithmetic, no random number drawn, no buffer changed; parameters and buffers passed with ``functional_call``) on
    the stage's device under its autocast, from the first micro-batch's shape; the last stage's output is its input
    (Note [Engine loss on the last process]). Both torch versions then skip their inference (2.11: ``inputs_meta`` is
    set; 2.14: the stages vote STATIC), with no exchange of shapes. A model whose forward cannot run on fake tensors
    (it reads a value: ``.item()``, data-dependent shapes; an operator without a fake kernel) falls back, with a
    RuntimeWarning, to torch's inference: every rank computes every stage's metadata, so all fall back together.
    Tested: on 2 ranks with dropout in both stages, resuming is bit-identical, loss_fn runs M times per step and
    step 1's activation peak is every later step's (each failed before); the metadata equals a real forward's, under
    autocast too, and leaves the random state and buffers alone; the fallback trains.

    Note [Replicas of stages across processes]
    With ``stages=S`` on a group of W = S x R ranks, each stage has R data-parallel replicas (pipeline x hybrid, as
    in process): group rank s * R + r runs stage s of replica r (the in-process layout of ``devices``). Replica r's
    S ranks form one pipeline (their own subgroup; its ``PipelineStage`` uses it) on replica r's shard of the batch
    (``tensor_split`` into R, each split into M micro-batches); stage s's R ranks form its data-parallel subgroup.
    After the schedule each rank scales its stage's mean gradient by its shard's share of the batch and all-reduces
    it over that subgroup: every replica of stage s then holds the weighted mean gradient, the whole batch's, and the
    same fused update keeps the replicas identical. The global norm takes each stage's squared norm once (replica
    0's), the loss each replica's last stage's, weighted. Buffers: at the start of every step replica 0's go to the
    other replicas (DDP's broadcast_buffers), and gather() takes replica 0's. The subgroups are created with
    ``new_group``, which every rank of the default group must enter: so replicas need the default group.

    Note [Parameters tied across processes]
    A trainable parameter held by several stages (an input embedding tied to the output layer) is one entry of every
    rank's store, inside the range of the first stage holding it (as in process: Note [Parameters tied across stages]
    in :mod:`pyengine.pipeline`); each rank of a stage holding it has its own copy in its layers. After the schedule,
    every rank of the group writes its share of each tied parameter's gradient into one flat buffer (its copy's
    gradient times its replica's share of the batch, zeros where its stage does not hold it) and one all-reduce (sum)
    over the whole group gives every rank the weighted mean over replicas of the sum over stages: the parameter's full
    gradient, as autograd accumulates it on one device. That sum lands in the tied entries of the slot on every rank
    holding one, after the replicas' reduction of the stage ranges (which would otherwise average the owner's entry
    again). The owner's update covers the entry with its range; every other rank holding it updates the entry too,
    with the same gradient, global norm, step and prior state, so the same bits (the update is elementwise), and all
    copies compute with the same weights next step without an exchange. The global norm counts the entry once (in
    the owner's range). Every rank starts from rank 0's weights (the construction broadcasts them: Note [Every rank
    starts from rank 0's model]), so the copies' weights and Adam state start equal, and gather() and
    load_state_dict() keep them so.

    Note [Bubble across processes]
    Each rank times its own stage's compute during the schedule (forward and backward of every micro-batch, and on
    the last stage the loss, which runs its layers: :class:`_StageMeter`); the busy seconds are summed over the W = S x
    R ranks in the all-reduce the update already makes. The wall is one for all ranks, as in process: right before the
    schedule every rank enters a barrier over the group (:meth:`_start_clock`), so all start their clocks together,
    within a message's latency; each counts the seconds from leaving it to the end of its own schedule, and an
    all-reduce MAX of those gives the schedule's wall, from the common start to the last rank's end. Only durations
    cross ranks, never clock readings, so ranks on other nodes need no agreeing clocks. ``bubble_fraction`` = 1 - sum
    of busy / (W x wall), the in-process definition (1 - sum of busy / (S x R x the shared wall)); ``schedule_s`` is
    that wall, the same on every rank. Each rank's own wall instead (stopping at its own last backward) missed the
    idle time of the stages that finish first: at S = 2, M = 1 it read 0.42 in the tests, below the 0.5 that M = 1
    cannot go under (no two stages ever compute at once, so the bubble is at least (S - 1) / S: tested).

    Note [Activations across processes]
    ``activation_peak`` / ``activation_peak_bytes`` of a step are this rank's stage's: the most micro-batches whose
    activations it held at once, and the most bytes autograd saved for them (parameters left out), counted as in
    process (``_Activations`` of :mod:`pyengine.pipeline`): bytes saved during a micro-batch's forward (on the last
    stage, its loss) are held until its backward.

    Note [Naming the stage that failed]
    Across processes a failing stage cannot stop the others as the in-process pipeline does: its peers are blocked in
    a receive or a collective, which fails when its process exits (or after the group's timeout), with gloo's error
    naming an address. So a rank's own failure (its layers' forward or backward, or the loss, raising: a
    :class:`StageError` naming its stage and the original error, as in process; for a backward the error torch's
    "Failed to run stage backward" wraps) is recorded in the rendezvous store before it leaves the step, and a rank
    whose exchange fails raises :class:`~pyengine.distributed.DistributedError` naming the rank that failed from that
    record, or the rank that never reached this step (the check-ins of every step and gather), exactly as the
    multi-node hybrid engine does (Note [Naming the rank that failed], Note [Naming a rank that died between steps]
    in :mod:`pyengine.distributed`). After a failed step (or gather) the engine refuses further steps and gathers
    (so ``state_dict()``, ``master_state_dict()``, ``optimizer_state_dict()``) at once with a DistributedError: its
    peers may still be blocked in the failed step's exchanges, and a collective would wait for the group's timeout.

    Note [Batches without targets across processes]
    A loss that needs no targets takes ``(inputs, None)`` batches, as in process. torch's schedules compute the loss
    on the last stage only when given a target to split, so the last rank gives it a stand-in with the batch's rows
    and no columns (``torch.empty(n, 0)``, no memory), and ``_loss`` hands loss_fn None. The inputs must be one
    tensor (the first stage's only argument, cut into micro-batches and sent between stages as one tensor) and the
    targets one tensor or None: anything else (a dict, a tuple; the in-process pipeline takes them) is a ValueError,
    raised after the batch check's all-reduce, whose fingerprint marks None and such batches, so every rank given it
    raises the same and the group stays usable. Tested on 2 ranks: equal to the in-process pipeline, and a dict or
    tuple refused on both ranks with the engine stepping on.

    Rank 0's model on every rank (Note [Every rank starts from rank 0's model] in pyengine.distributed): the
    construction broadcasts rank 0's trainable weights (the host store), then its frozen parameters and buffers
    into each rank's stage and its copies of the other stages' buffers. Tested on 2 ranks built from different
    seeds, a frozen Linear and a BatchNorm with non-default statistics in stage 1: losses, weights and buffers equal
    the in-process pipeline of rank 0's model.

    Note [Distributed pipeline store]
    Each rank's host store (the Engine's, one gradient slot) covers the whole model, and stage s's parameters are one
    contiguous range of it (checked for every stage). A step updates only the rank's own range, with
    :meth:`Engine.admit_update` and :meth:`Engine.update_range` after the squared gradient norm, the non-finite flag
    and the loss are all-reduced: every rank clips by the whole model's norm, skips (or raises on) the same steps and
    keeps the same ``version``. The other ranges of a rank's store are stale until :meth:`gather`, a collective that
    broadcasts each stage's range of the weights and Adam state from its rank; :meth:`Engine.master_state_dict` and
    :meth:`Engine.optimizer_state_dict` (so :meth:`Engine.state_dict`) call it, so on such an engine they are
    collectives every rank must call in the same order.
    """

    def __init__(self, engine, model: torch.nn.Sequential, *, stages, microbatches: int, schedule: str, balance,
                 autocast: torch.dtype | None, group, unused: str = "zero"):
        # weak: Note [No reference cycle through the engine] (pyengine.pipeline)
        self.engine, self.store, self.group = weakref.proxy(engine), engine.store, group
        self.works = engine.collective_works  # Note [Gloo's works are released by the thread that waits]
        world = dist.get_world_size(group)
        self.num_stages, self.replicas = stages, world // stages  # Note [Replicas of stages across processes]
        self.stage, self.replica = divmod(dist.get_rank(group), self.replicas)
        self.microbatches, self.schedule, self.autocast, self.unused = microbatches, schedule, autocast, unused
        self.stages: list = []  # no in-process stages: Engine._replica_buffers reads self.buffers
        # every rank checks every stage, so a bad split is the same ValueError on every rank, before any collective
        check_dense_gradients(model, "pipeline")
        self.layers = list(model._modules.items())
        self.sizes = _stage_sizes(self.layers, self.num_stages, balance)
        modules = split_layers(self.layers, self.sizes)
        self._split = modules  # the whole model's stages (its own layers): Note [Static stage metadata]
        store_names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
        names, self.tied = stage_store_names(store_names, modules)  # Note [Parameters tied across processes]
        empty = [s for s, stage_names in enumerate(names) if not stage_names]
        if empty:
            which = f"stage {empty[0]} has" if len(empty) == 1 else f"stages {', '.join(map(str, empty))} have"
            raise ValueError(f"{which} no trainable parameters (stage sizes {self.sizes}); choose another balance")
        self.ranges = [stage_range(self.store, s, owned_names(stage_names, s, self.tied))
                       for s, stage_names in enumerate(names)]
        self._pipe_group, self._dp_group = self._subgroups(group)  # the first collective (new_group with replicas)
        self.device = engine.devices[0]
        self.module = replica_of(modules[self.stage], self.device)  # Note [Replicas keep the parameters' hooks]
        self._kept_buffers = KeptBufferCopies.of_modules([self.module])  # Note [Buffer copies kept from step to step]
        # each rank its own generator (global index = rank), seeded per step: the data-parallel replicas of a stage
        # draw different masks (Note [Random numbers of concurrent workers] in pyengine/rng.py)
        engine.worker_rng(self.device, 0).install(self.module, engine.random_modules)
        # (store name, this rank's copy): a tied parameter's store name is its first name in the model
        self.params = list(zip(names[self.stage], (p for p in self.module.parameters() if p.requires_grad)))
        # what the stage pulls: the shadow of a low-precision model (Note [The shadow follows the master weights])
        self._master = self.store.views(self.store.param if self.store.shadow is None else self.store.shadow)
        self._slot = self.store.views(self.store.grad_slot(0))
        self._gathered = (engine.version, 0)  # (version, steps) at the last gather: every rank starts equal
        self._scale = None  # the step's loss scale, which _loss multiplies in (Note [Loss scaling])
        self._targetless = False  # the step's batch is (inputs, None): _loss gives loss_fn None
        self._kind = tuple  # the step's batch's type: _loss gives loss_fn (activations, targets) of it (batch_like)
        # Note [Buffers of stages across processes]
        # A stage's persistent buffers (BatchNorm statistics) live, and change, on its own rank only. ``buffers``
        # holds every persistent buffer of the model: this rank's stage's own tensors, and a CPU copy of every other
        # stage's, which gather() refreshes from the owning rank (as it does the weights). Engine reads and writes
        # buffers through it (buffers_state_dict, load_state_dict). Non-persistent buffers (a causal mask) are
        # constants each stage's copy of its layers already holds. The stage's own buffers are looked up in their
        # modules at every use: a layer may assign its buffer a new tensor in its forward (an EMA).
        owner = {name: s for s, m in enumerate(modules) for name, _ in m.named_buffers()}
        originals = dict(model.named_buffers())
        slots = {f"{prefix}.{key}" if prefix else key: (module, key)
                 for prefix, module in self.module.named_modules() for key in module._buffers}
        self._buffer_names = list(engine.buffer_names)
        self._own_slots = {name: slots[name] for name in self._buffer_names if owner[name] == self.stage}
        # contiguous CPU copies: broadcast as bytes (Note [Tensors travel as bytes]), received in place
        self._other_buffers = {name: originals[name].detach().to("cpu", copy=True,
                                                                  memory_format=torch.contiguous_format)
                               for name in self._buffer_names if owner[name] != self.stage}
        # the CPU tensors broadcast: another stage's buffer is received into its copy; an own one is sent from a
        # CPU tensor of its own (copied in before each send)
        self._buffer_exchange = [(name, self._other_buffers[name] if name in self._other_buffers
                                  else self.buffers[name].detach().to("cpu", copy=True,
                                                                      memory_format=torch.contiguous_format),
                                  self._ranks_of(owner[name], group)) for name in self._buffer_names]
        self._own_buffers = [(name, exchanged) for name, exchanged, src in self._buffer_exchange
                             if owner[name] == self.stage]
        self._replica_packet = None  # _share_buffers' bytes across the replicas of this stage
        self.is_first, self.is_last = self.stage == 0, self.stage == self.num_stages - 1
        self._wrapped = _PipelinedLayers(self.module, autocast, self.is_last, self.stage, self.replica, self.device)
        # Note [A step refused on every rank]: what the update's exchange checks
        self.followed = FollowedState(self.module)  # Note [Model state the engine does not follow] (workers.py)
        self._versions = [p._version for _, p in self.params]  # Note [Weights changed in place by a step] (ibid.)
        self.steps = 0  # steps begun
        self._start_naming(group, "pipeline")  # Note [Naming the stage that failed]
        self._enter("the construction of the engine")
        with _collective("broadcast of the initial weights, frozen parameters and buffers from rank 0", self.rank,
                         self._explain):
            self.works.run(dist.broadcast, self.store.param, src=dist.get_global_rank(group, 0), group=group)
            self._rank0_state(model, group)
        self.store.refresh_shadow()  # Note [The shadow follows the master weights]
        self._schedules: collections.OrderedDict = collections.OrderedDict()  # Note [One schedule per batch shape]
        # Every tensor this class hands to a collective is a buffer it keeps (no allocation per step); the works
        # are kept too: Note [Gloo's works are released by the thread that waits] (pyengine.distributed)
        flats = [self.store.param, self.store.exp_avg, self.store.exp_avg_sq, self.store.max_exp_avg_sq]
        self._gather_views = [(flat[begin:end], self._ranks_of(s, group)) for flat in flats if flat is not None
                              for s, (begin, end) in enumerate(self.ranges)]
        # _same_batch: the fingerprints, version and digest, their negations, then each rank's end of fit
        self._fingerprint = torch.zeros(12 + self.world, dtype=torch.float64)
        # _update: squared norm, non-finite flag, loss sum, busy seconds, then the flags of the ranks that refuse the
        # step (Note [A step refused on every rank]) and each rank's busy seconds, all summed over the group
        self._flags = RefusalFlags(self.world)
        self._reduced = torch.zeros(4 + self._flags.size + self.world, dtype=torch.float64)
        self._clock = torch.zeros(1, dtype=torch.float64)  # _start_clock, then the schedule's wall (MAX)
        self._meter = _StageMeter({p.untyped_storage().data_ptr() for p in self.module.parameters()}, self.is_last)
        begin, end = self.ranges[self.stage]
        self._stage_grad = self.store.grad_slot(0)[begin:end]  # this stage's range of the gradient slot
        self._mean_grad = torch.zeros(end - begin) if self.replicas > 1 else None  # across replicas, fp32
        # Note [Parameters tied across processes]: one segment of _tied_grad per tied parameter (the same order on
        # every rank); the tied entries this rank holds but another stage owns, which it updates too
        entries = [self.store.entry(name) for name in self.tied]
        self._tied_grad = torch.zeros(sum(e.numel for e in entries))
        offsets = [sum(e.numel for e in entries[:i]) for i in range(len(entries))]
        held = set(names[self.stage])
        self._tied_parts = [(e.name, self._tied_grad[o:o + e.numel].view(e.shape)) for e, o in zip(entries, offsets)
                            if e.name in held]
        self._tied_ranges = [(e.offset, e.offset + e.numel) for e in entries
                             if e.name in held and self.tied[e.name][0] != self.stage]

    @property
    def buffers(self) -> dict:
        """name -> every persistent buffer of the model, in the engine's order: this rank's stage's own tensors (as
        its modules hold them now) and the CPU copies of the other stages' (Note [Buffers of stages across
        processes])."""
        return {name: slot[0]._buffers[slot[1]] if (slot := self._own_slots.get(name)) is not None
                else self._other_buffers[name] for name in self._buffer_names}

    @torch.no_grad()
    def _rank0_state(self, model: torch.nn.Module, group) -> None:
        """Rank 0's frozen parameters and buffers (BatchNorm statistics) into this rank's copies: its stage's, and its
        CPU copies of the other stages' buffers; the trainable parameters come with the store (Note [Every rank
        starts from rank 0's model], :func:`pyengine.distributed.receive_rank0_state`)."""
        held = collections.defaultdict(list)  # the model's name -> this rank's tensors holding it
        for name, t in itertools.chain(self.module.named_parameters(remove_duplicate=False),
                                       self.module.named_buffers(remove_duplicate=False)):
            held[name].append(t)
        for name, t in self.buffers.items():
            if all(t is not mine for mine in held[name]):
                held[name].append(t)
        self.engine.frozen = receive_rank0_state(model, held, group, self.works)

    def _ranks_of(self, stage: int, group) -> int:
        """The global rank of replica 0 of ``stage`` (group rank s * R + r runs stage s of replica r)."""
        return dist.get_global_rank(group, stage * self.replicas)

    def _subgroups(self, group):
        """(this replica's pipeline group, this stage's data-parallel group or None): new groups when R > 1, which
        every rank of the default group creates in the same order (Note [Replicas of stages across processes])."""
        self._created = []  # destroyed by close()
        if self.replicas == 1:
            return group, None
        S, R = self.num_stages, self.replicas
        ranks = lambda members: [dist.get_global_rank(group, g) for g in members]  # noqa: E731
        pipes = [dist.new_group(ranks([s * R + r for s in range(S)])) for r in range(R)]
        dps = [dist.new_group(ranks([s * R + r for r in range(R)])) for s in range(S)]
        self._created = [g for g in pipes + dps if g != dist.GroupMember.NON_GROUP_MEMBER]
        return pipes[self.replica], dps[self.stage]

    def _schedule_for(self, inputs: torch.Tensor, targets: torch.Tensor):
        """The schedule (and its ``PipelineStage``) for batches shaped like ``(inputs, targets)``: built at the first
        such batch, kept for the last ``SCHEDULES_KEPT`` shapes (Note [One schedule per batch shape])."""
        key = (tuple(inputs.shape), inputs.dtype, None if targets is None else (tuple(targets.shape), targets.dtype))
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        stage = _MeteredStage(self._wrapped, self.stage, self.num_stages, self.device, group=self._pipe_group,
                              meter=self._meter, **self._metadata(inputs))
        loss = weakref.WeakMethod(self._loss)  # the schedule keeps its loss function: no cycle back to self
        schedule = _SCHEDULE_CLASSES[self.schedule](stage, self.microbatches, loss_fn=lambda x, t: loss()(x, t),
                                                    scale_grads=True)
        self._schedules[key] = schedule
        if len(self._schedules) > SCHEDULES_KEPT:
            self._schedules.popitem(last=False)  # every rank drops the same one: they all see the same batches
        return schedule

    def _metadata(self, inputs: torch.Tensor) -> dict:
        """``PipelineStage``'s ``input_args`` and ``output_args`` for this rank's stage on batches (this replica's
        shard) shaped like ``inputs``; {} (torch infers them at the first step) where the fake forward fails
        (Note [Static stage metadata])."""
        microbatch = torch.tensor_split(inputs, self.microbatches)[0]
        try:
            metas = stage_inputs(self._split, microbatch, self.device, self._wrapped.context)
        except _StageOutputError as exc:  # the model's error, on every rank: not a shape the fake forward missed
            raise ValueError(f"mode='pipeline' across processes: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the same on every rank: each computes every stage's metadata
            warnings.warn(f"pyengine: the pipeline stages' input and output shapes for inputs of shape "
                          f"{tuple(inputs.shape)} could not be computed on fake tensors ({type(exc).__name__}: "
                          f"{exc}); torch.distributed.pipelining infers them at the first step instead, running every "
                          "stage's forward (and, with torch >= 2.14, its backward and the loss) once more "
                          "(Note [Static stage metadata] in pyengine/pipeline_distributed.py)", RuntimeWarning,
                          stacklevel=2)
            return {}
        s = self.stage
        return dict(input_args=metas[s], output_args=metas[s + 1] if s + 1 < len(metas) else metas[s])

    def _loss(self, x, targets):
        try:
            with self._meter.loss(), self._wrapped.context(x.device):
                loss = checked_loss(self.engine.loss_fn(self.module, batch_like(
                    self._kind, x, None if self._targetless else targets)))
        except Exception as exc:  # this rank's own failure (Note [Naming the stage that failed])
            raise self._wrapped.failure(exc) from exc
        return loss if self._scale is None else loss * self._scale  # Note [Loss scaling]

    def step(self, batch) -> dict:
        """One step of this rank's stage on ``(inputs, targets)`` (the same batch on every rank), then the update of
        its range of the store (Note [Distributed pipeline store]). A collective: every rank must call it."""
        engine, m = self.engine, self.microbatches
        start = time.perf_counter()
        self._check_usable()
        check_pair(batch)
        inputs, targets = batch
        self.steps += 1
        self._enter(f"step {self.steps}")  # Note [Naming the stage that failed]
        try:
            same, same_version, same_optimizer = self._same_batch(inputs, targets)
            ended = self._peer_end(self._ends())  # Note [Ranks whose fits end at different steps] (distributed.py)
        except BaseException as exc:
            self.broken = True
            raise self._failure(exc) from exc
        if ended is not None:  # another rank's fit ended here: every rank's step is refused, before any work
            self.steps -= 1  # not begun: the phases' names stay alike
            try:
                raise ended
            finally:  # Note [No reference cycle through the engine]
                ended = None
        # every rank raises (the same answers everywhere); the group stays usable
        if not same_version:
            raise DistributedError(
                f"rank {self.rank}: the ranks' engines hold different states (this rank's version: {engine.version}): "
                "every rank must load the same state (load_state_dict or checkpoint.load_engine on every rank); this "
                "step was refused on every rank")
        if not same_optimizer:
            raise DistributedError(
                f"rank {self.rank}: the ranks' engine.optimizer settings or learning rates differ (this rank's: "
                f"{_update_settings(engine)}): a change between steps must be made on every rank, and "
                "lr_schedule must give every rank the same; this step was refused on every rank")
        problem = _batch_problem(inputs, targets)
        if problem is not None:  # every rank given this batch raises the same; the group stays usable
            raise ValueError(problem)
        if not same:  # every rank raises (the same answer everywhere); the group stays usable
            raise ValueError(f"rank {self.rank}: the ranks of a pipeline over a process group were given different "
                             "batches; every rank must call step() with the same (inputs, targets) (the first rank "
                             "runs the inputs, the last scores against the targets): do not shard the data per rank "
                             "(DistributedSampler) in mode='pipeline'")
        # inputs and targets of one size (the same batch on every rank: every rank raises, or none)
        samples = batch_size(inputs if targets is None else (inputs, targets))
        # replica r's: shards[.][r]; targets None (a loss that needs none): None for every replica
        shards = [[None] * self.replicas if t is None else torch.tensor_split(t, self.replicas)
                  for t in (inputs, targets)]
        sizes = [batch_size(x) for x in shards[0]]
        for r in range(self.replicas):  # the same batch on every rank: every rank raises, or none
            where = "" if self.replicas == 1 else f" (replica {r}'s shard)"
            _check_equal_split(shards[0][r], m, "inputs" + where)
            if targets is not None:
                _check_equal_split(shards[1][r], m, "targets" + where)
        inputs, targets = shards[0][self.replica], shards[1][self.replica]
        self._targetless = targets is None  # Note [Batches without targets across processes]
        self._kind = type(batch)
        with torch.no_grad():
            for name, p in self.params:
                p.copy_(self._master[name])
        self._versions = [p._version for _, p in self.params]  # Note [Weights changed in place by a step]
        self.followed.mark()  # Note [Model state the engine does not follow]
        self.module.zero_grad(set_to_none=True)
        pulled = time.perf_counter()
        losses = []
        # every rank's scale is the same: each takes the same admit_update decisions (the flag is all-reduced)
        self._scale = engine.loss_scale_now()
        self._meter.start_step()
        self._refused = False
        try:
            self._share_buffers()
            saved = self._kept_buffers.take()  # Note [A step refused on every rank]: put back if it is
            schedule = self._schedule_for(inputs, targets)
            began = self._start_clock()  # Note [Bubble across processes]
            if self.is_last and targets is None:  # Note [Batches without targets across processes]
                targets = torch.empty(batch_size(inputs), 0)
            _run_schedule(schedule, self.device, m, inputs if self.is_first else None,
                          targets if self.is_last else None, losses)
            scheduled = time.perf_counter()
            loss_sum = sum(float(l.detach()) for l in losses)  # the schedule's losses are scaled: unscale the sum
            loss_sum = loss_sum if self._scale is None else loss_sum / self._scale
            meter = self._meter
            with engine.phase("update"):
                applied, loss_sum, bubble, wall, stage_busy = self._update(
                    loss_sum, sizes[self.replica] / samples, meter.busy, scheduled - began, self._scale, saved)
        except FloatingPointError:
            # nonfinite="raise" (Engine.admit_update): every rank took this decision from the same all-reduced
            # flag, after the update's collectives, so the group is still in step: no rank failed, the engine stays
            # usable, as in one process and in multi-node hybrid (it was taken for a failed rank: every later step
            # refused)
            raise
        except BaseException as exc:
            if self.failed_alone:  # Note [A step that fails on one rank after its last collective] (distributed.py)
                raise
            if self._refused:  # Note [A step refused on every rank]: the group is in step
                self._refused = False
                raise
            self.broken = True
            raise self._failure(exc) from exc
        end = time.perf_counter()
        return step_metrics(engine, loss=loss_sum / m, samples=samples, wall=end - start,
                            compute=scheduled - pulled, update=end - scheduled, transfer_wait=0.0,
                            copy_back=pulled - start, applied=applied, loss_scale=self._scale, stages=self.num_stages,
                            replicas=self.replicas, microbatches=m, schedule=self.schedule,
                            stage_sizes=list(self.sizes), schedule_s=wall, stage=self.stage,
                            replica=self.replica, busy_s=meter.busy, stage_busy_s=stage_busy, bubble_fraction=bubble,
                            activation_peak=meter.memory.peak_count, activation_peak_bytes=meter.memory.peak_bytes,
                            bubble_ideal=(self.num_stages - 1) / (m + self.num_stages - 1))

    def _check_usable(self) -> None:
        """A DistributedError at once after a failed step (or gather): the peers may still be blocked in its
        exchanges, so a further collective would wait for the group's timeout (Note [Naming the stage that
        failed])."""
        if self.broken:
            raise DistributedError(f"rank {self.rank}: an earlier step failed; the group is no longer usable")

    def _failure(self, exc: BaseException) -> BaseException:
        """What a failed step raises (Note [Naming the stage that failed]): this rank's own StageError, recorded for
        the peers; a failed exchange as DistributedError naming the rank that failed as far as the rendezvous store
        tells; anything else as it is, recorded."""
        own, seen = exc, set()
        while own is not None and not isinstance(own, StageError) and id(own) not in seen:
            seen.add(id(own))
            own = own.__cause__ or own.__context__
        if isinstance(own, StageError):
            self._record_failure(own)
            return own
        if isinstance(exc, RuntimeError) and not isinstance(exc, DistributedError):
            cause = self._explain() or "a peer rank died, raised or timed out"
            return DistributedError(f"rank {self.rank}: step {self.steps} of the pipeline failed "
                                    f"({type(exc).__name__}: {exc}); {cause}")
        self._record_failure(exc)
        return exc

    @torch.no_grad()
    def _same_batch(self, inputs, targets) -> tuple[bool, bool, bool]:
        """Whether every rank was given the same batch, whether the ranks' engines are at the same version, and
        whether their optimizers' settings are the same (the same answers on every rank; a collective).

        Note [The same batch on every rank]
        The first rank runs the inputs, the last rank scores the outputs against its targets: with a different batch
        per rank (a DistributedSampler per rank, as for data parallelism) the pipeline would train on inputs paired
        with another batch's targets, silently. So before any work each rank takes a fingerprint of its batch (its
        sizes and the CRC-32 of the dtypes, shapes and bytes of inputs and targets) and one small all-reduce (MAX of
        the fingerprint and of its negation) tells every rank whether they all agree. A checksum of the bytes, not a
        floating-point sum: a sum's last bits depend on how many intra-op threads split it, and ranks may run
        different counts. Targets None, and a batch this pipeline cannot run (:func:`_batch_problem`, which step()
        raises after this exchange, so that every rank takes part in it whatever it was given), have fingerprints of
        their own. The same all-reduce carries the engine's version and its optimizer's digest (Note [Every rank at
        the same version] in pyengine/distributed.py: a state loaded on rank 0 only trained on, a mix of two
        states; an lr changed on one rank only too), and a slot per rank for its end of fit, zero here (:meth:`end_fit`
        sets its own: Note [Ranks whose fits end at different steps], ibid.)."""
        both = self._fingerprint  # Note [Gloo's works are released by the thread that waits]
        (both[0], both[2]), (both[1], both[3]) = _fingerprint(inputs), _fingerprint(targets)
        both[4], both[5] = self.engine.version, update_digest(self.engine)
        both[6:12] = -both[:6]
        both[12:] = 0  # no end of fit here: :meth:`end_fit` sends this rank's
        self.works.run(dist.all_reduce, both, op=dist.ReduceOp.MAX, group=self.group)
        alike = both[:6] == -both[6:12]
        return bool(alike[:4].all()), bool(alike[4]), bool(alike[5])

    def _ends(self) -> list[int]:
        """Each rank's end of fit as the last :meth:`_same_batch` or :meth:`end_fit` exchange told (0: none)."""
        return [int(v) for v in self._fingerprint[12:].tolist()]

    def end_fit(self, engine, error: BaseException | None = None) -> list[int]:
        """This rank's :meth:`Engine.fit` ends (``error``: raising it next), told to the other ranks in the shape of
        a step's first exchange, which theirs pair with (Note [Ranks whose fits end at different steps] in
        pyengine/distributed.py); returns the ranks that were stepping (their step refused, their fit ended here).
        Raises PeerEndedFit when another rank's fit raised at the same point. Nothing after a failed step."""
        def exchange() -> list[int]:
            both = self._fingerprint
            both.zero_()  # the fingerprints of no batch: a rank stepping reads the ends first
            both[12 + self.rank] = _ENDED if error is None else _RAISED
            with _collective("all-reduce of the end of fit", self.rank, self._explain):
                self.works.run(dist.all_reduce, both, op=dist.ReduceOp.MAX, group=self.group)
            return self._ends()

        return self._end_fit_with(exchange, error)

    @torch.no_grad()
    def _share_buffers(self) -> None:
        """DDP's broadcast_buffers across the replicas of this rank's stage: replica 0's buffers to the others at the
        start of every step (Note [Replicas of stages across processes])."""
        if self._dp_group is None or not self._own_buffers:
            return
        source = self._ranks_of(self.stage, self.group)
        buffers = self.buffers
        tensors = [buffers[name] for name, _ in self._own_buffers]  # as the modules hold them now
        # one broadcast of their bytes, through a packet kept for every step (Note [Tensors travel as bytes])
        if self._replica_packet is None or not self._replica_packet.fits(tensors):
            self._replica_packet = BytePacket(tensors)
        if self.replica == 0:
            self._replica_packet.pack(tensors)
        self.works.run(dist.broadcast, self._replica_packet.flat, src=source, group=self._dp_group)
        if self.replica != 0:  # into whole tensors: a forward may have assigned an expanded one (replica_of's doc)
            self._replica_packet.unpack(whole_buffers(self.module, tensors))

    @torch.no_grad()
    def _start_clock(self) -> float:
        """The start of the schedule's common clock (Note [Bubble across processes]): a barrier over the group (one
        all-reduce of a kept tensor: Note [Gloo's works are released by the thread that waits]), then this rank's
        time."""
        self._clock.zero_()
        self.works.run(dist.all_reduce, self._clock, group=self.group)
        return time.perf_counter()

    def _refusal(self) -> Exception | None:
        """Why this rank's stage refuses the step it just computed (Note [A step refused on every rank]), or None:
        the in-process pipeline's RuntimeError of a parameter without a gradient under unused="error", or its
        ValueError of state written, word for word (checked in that order there too)."""
        try:
            check_unused(self.params, self.unused, self.tied)
        except RuntimeError as exc:
            return exc
        where = f"stage {self.stage} (replica {self.replica})"
        try:
            check_weights_unchanged([name for (name, p), v in zip(self.params, self._versions) if p._version != v],
                                    where)
            self.followed.check(where)
        except ValueError as exc:
            return exc
        return None

    @torch.no_grad()
    def _update(self, loss_sum: float, weight: float, busy: float, elapsed: float,
                scale: float | None, saved: list[tuple]) -> tuple[bool, float, float, float, list[float]]:
        """Gradients -> slot 0 (across replicas: their weighted mean, ``weight`` = this replica's share of the batch),
        all-reduced norm, non-finite flag, loss, busy seconds and the ranks that refuse the step, the schedule's wall
        (the most ``elapsed`` seconds since :meth:`_start_clock` over the ranks), then the fused update of this rank's
        range (Note [Distributed pipeline store]). Returns (applied, the loss summed over micro-batches, weighted
        across replicas, the bubble fraction, the wall: Note [Bubble across processes], and each stage's busy
        seconds, the mean over its replicas, as the in-process pipeline's ``stage_busy_s``). ``scale``: the step's
        loss scale; ``saved``: the stage's buffers before the schedule (:meth:`KeptBufferCopies.take`).

        A stage's refusal (Note [A step refused on every rank] in pyengine/distributed.py): its flag travels in the
        all-reduce of the norm, and every rank raises after the clock's, this method's last collective, before
        ``begin_update``. The stage's buffers are put back to their values before the schedule (a BatchNorm's
        statistics of the refused batch), as the in-process pipeline does after a failed step; the next pull puts
        the trainable weights back. Cost: a copy of the stage's buffers a step."""
        refusal = self._refusal()
        _grads_to_slot(self.params, self._slot)
        slot = self.store.grad_slot(0)
        begin, end = self.ranges[self.stage]
        if self.tied:  # this rank's share, before the replicas' reduction (Note [Parameters tied across processes])
            self._tied_grad.zero_()
            for name, part in self._tied_parts:
                part.copy_(self._slot[name]).mul_(weight)  # in fp32, also when the slot is bf16 (autocast)
        if self._dp_group is not None:  # Note [Replicas of stages across processes]
            mean = self._mean_grad
            mean.copy_(self._stage_grad).mul_(weight)
            self.works.run(dist.all_reduce, mean, group=self._dp_group)
            self._stage_grad.copy_(mean)
        if self.tied:
            self.works.run(dist.all_reduce, self._tied_grad, group=self.group)
            for name, part in self._tied_parts:
                self._slot[name].copy_(part)
        norm, nonfinite = ops.mean_grad_norm([self._stage_grad])
        reduced = self._reduced  # Note [Gloo's works are released by the thread that waits]
        # every stage's squared norm once (from replica 0; the replicas hold the same mean gradient)
        reduced[0] = norm.double().square() if self.replica == 0 else 0.0
        reduced[1], reduced[2], reduced[3] = nonfinite.double(), loss_sum * weight, busy
        reduced[4:] = 0.0
        flags_end = 4 + self._flags.size
        self._flags.put(reduced[4:flags_end], self.rank, refusal)
        reduced[flags_end + self.rank] = busy
        self.works.run(dist.all_reduce, reduced, group=self.group)
        self._clock[0] = elapsed
        self.works.run(dist.all_reduce, self._clock, op=dist.ReduceOp.MAX, group=self.group)
        flags = self._flags.read(reduced[4:flags_end])
        if any(flags):  # every rank raises, after the last collective of the step: the group is in step
            self._refused = True
            put_back_saved(saved)
            if refusal is not None:  # the StageError of the in-process pipeline
                raise self._wrapped.failure(refusal) from refusal
            raise refused_step_error(self.rank, "the stage of", flags)
        self.engine.begin_update()  # Note [A step's update under the mutex]
        wall, ranks = float(self._clock[0]), dist.get_world_size(self.group)
        bubble = max(0.0, 1.0 - float(reduced[3]) / (ranks * wall)) if wall > 0 else 0.0
        each = reduced[flags_end:].tolist()  # group rank s * R + r runs stage s of replica r
        stage_busy = [sum(each[s * self.replicas:(s + 1) * self.replicas]) / self.replicas
                      for s in range(self.num_stages)]
        if not self.engine.admit_update(reduced[1].item() != 0.0, [], loss_scale=scale):
            return False, float(reduced[2]), bubble, wall, stage_busy
        norm = reduced[0].sqrt().float().reshape(())
        try:
            for first, last in [(begin, end)] + self._tied_ranges:  # Note [Parameters tied across processes]
                self.engine.update_range(first, last, [slot], None, norm, loss_scale=scale)
        except BaseException:
            self.failed_alone = True  # Note [A step that fails on one rank after its last collective] (distributed.py)
            raise
        return True, float(reduced[2]), bubble, wall, stage_busy

    def gather(self) -> None:
        """Brings every stage's range of the weights and Adam state into this rank's store (a collective; a no-op
        when no update happened since the last one, which every rank agrees on: ``version`` is the same on all).
        After a failed step a DistributedError at once (:meth:`_check_usable`), not a wait for the group's timeout."""
        self._check_usable()
        now = (self.engine.version, self.steps)  # buffers change in a skipped step too
        if self._gathered == now:
            return
        self._enter(f"the gather of the weights after step {self.steps}")
        try:
            with _collective("the gather of every stage's weights, Adam state and buffers", self.rank,
                             self._explain):
                for view, src in self._gather_views:
                    self.works.run(dist.broadcast, view, src=src, group=self.group)
                with torch.no_grad():  # Note [Buffers of stages across processes]
                    buffers = self.buffers
                    for name, exchanged, src in self._buffer_exchange:
                        mine = buffers[name]
                        sending = src == dist.get_rank()
                        if sending and exchanged is not mine:
                            exchanged.copy_(mine)  # an own buffer goes through a CPU tensor of its own
                        # as bytes: Note [Tensors travel as bytes] (a CPU tensor of its own, contiguous)
                        self.works.run(dist.broadcast, as_bytes(exchanged), src=src, group=self.group)
                        if not sending and exchanged is not mine:
                            mine.copy_(exchanged)  # a replica of the owning stage: replica 0's values
        except BaseException:
            self.broken = True
            raise
        self.store.refresh_shadow()  # the other stages' weights (Note [The shadow follows the master weights])
        self._gathered = now

    def close(self) -> None:
        """Destroys the subgroups this pipeline created (replicas across processes); nothing else to stop: the
        schedule runs on the calling thread. Later gathers use the whole group only."""
        self._schedules.clear()
        for group in self._created:
            if dist.is_initialized():
                with contextlib.suppress(ValueError, RuntimeError):  # already destroyed with the default group
                    dist.destroy_process_group(group)
        self._created = []


def check_engine_options(model: torch.nn.Sequential, devices, stages, microbatches, schedule, balance, group) -> int:
    """ValueErrors for ``Engine(mode="pipeline")`` with a process group; returns S (the group's size, or ``stages``
    when R = size / stages replicas of each stage are asked for)."""
    world = dist.get_world_size(group)
    if stages is not None and (not _is_int(stages) or stages < 1 or world % stages):
        raise ValueError(f"with a process group of {world} ranks, stages must be None (one stage per rank) or a "
                         f"divisor of {world} (R = {world} / stages replicas of each stage); got stages={stages!r}")
    stages = world if stages is None else stages
    if stages < world and dist.get_world_size() != world:
        raise ValueError("replicas of stages across processes (stages < the group's size) need the default process "
                         "group (every rank of the job): they create subgroups, which every rank must join")
    check_options(len(model), world, stages, microbatches, schedule, balance if balance != "time" else "params")
    if schedule == "1f1b" and microbatches < stages:
        raise ValueError(f"schedule='1f1b' across processes needs microbatches >= stages (torch.distributed."
                         f"pipelining's Schedule1F1B); got microbatches={microbatches} for {stages} stages: use "
                         f"microbatches >= {stages} or schedule='gpipe'")
    if len(devices) != 1:
        raise ValueError(f"with a process group each rank runs one stage on one device: pass one device per rank; "
                         f"got {len(devices)} devices")
    return stages
