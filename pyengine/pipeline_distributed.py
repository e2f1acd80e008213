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
stages across processes]); the weights every rank starts from are rank 0's (broadcast at construction), and
parameters tied across stages stay tied (Note [Parameters tied across processes]). The schedule scales the
gradients by 1/M (``scale_grads``), so the step is one step of AdamW on the whole batch's mean gradient.
torch.distributed.pipelining sizes its receive buffers from the first micro-batch, so every micro-batch must have
the same size: the batch must be a multiple of M (checked, with a clear error).
"""
from __future__ import annotations

import collections
import contextlib
import copy
import time
import weakref
import zlib

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from . import ops
from .metrics import step_metrics
from .distributed import DistributedError, _collective, _FailureNaming
from .pipeline import (StageError, _Activations, _check_sizes, _is_int, _param_costs, check_options, owned_names,
                       partition, split_layers, stage_range, stage_store_names)
from .workers import batch_size

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
    if balance == "params":
        return partition(_param_costs([layer for _, layer in layers]), stages)
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
    for a micro-batch's receives before calling them, so the time is the stage's compute, not its waiting.

    Note [Shape inference leaves the buffers alone]
    At its first step a ``PipelineStage`` runs its module once more to learn the shapes of its outputs. torch 2.11
    runs it on zeros, under no_grad but in training mode: every BatchNorm of the stage took a batch of zeros into its
    running statistics (running_var pulled 10 % towards 0, one batch more counted), which the in-process pipeline
    and single-device training never see. Newer torch backs the buffers up around its (renamed) metadata inference
    itself; on torch that still has ``_shape_inference`` the override below does the same. Tested: the BatchNorm
    runs of tests/test_pipeline.py across processes (they failed on torch 2.11 without it), and a unit test that
    stands in for torch 2.11's inference. The inference forward still draws from the RNG (a dropout layer's mask).
    """

    def __init__(self, *args, meter: _StageMeter, **kwargs):
        super().__init__(*args, **kwargs)
        self._pyengine_meter = meter

    def _shape_inference(self, *args, **kwargs):
        with buffers_restored(self.submod):
            return super()._shape_inference(*args, **kwargs)

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        with self._pyengine_meter.forward(fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        with self._pyengine_meter.backward(bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)


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
        return torch.autocast(device.type, dtype=self.autocast, enabled=self.autocast is not None)

    def forward(self, x):
        if self.last:
            # A view, so the output has its own autograd node rather than being the received buffer itself. With
            # torch 2.11, returning x unchanged left the input without a gradient ("has gradients None ... expecting
            # to send gradients to stage 0"); with the view the pipeline tests across processes pass on 2.11 (CPU).
            return x.view_as(x)
        try:
            with self.context(x.device):
                return self.layers(x)
        except Exception as exc:  # this rank's own failure (Note [Naming the stage that failed])
            raise StageError(self.stage, self.replica, self.device, exc) from exc


def batch_checksum(t: torch.Tensor) -> float:
    """CRC-32 of a tensor's bytes (any dtype, any device), as a float (exact: < 2**32). The same data gives the same
    value whatever the thread count, unlike a floating-point sum (Note [The same batch on every rank])."""
    data = t.detach().to("cpu").contiguous().reshape(-1)
    return float(zlib.crc32(data.view(torch.uint8).numpy()))


class DistributedPipeline(_FailureNaming):
    """``Engine(mode="pipeline")`` over a process group of S ranks: rank s builds the same split of the model as every
    other rank, keeps stage s on its one device and runs it under ``torch.distributed.pipelining``'s GPipe / 1F1B
    schedule; built by :class:`~pyengine.Engine` when it has a process group.

    Every rank calls ``engine.step((inputs, targets))`` with the same batch: rank 0 feeds the inputs, the last rank
    the targets. The batch must split into M equal micro-batches (torch.distributed.pipelining's stages need equal
    shapes); its size may change from step to step (Note [One schedule per batch shape]).

    Note [Engine loss on the last process]
    The Engine's contract is ``loss_fn(last_stage, (activations, targets))``. The schedule calls its loss function as
    ``loss(output, target)`` on the last stage's output, so the last stage's module passes its input activations
    through unchanged and the loss runs the last stage's layers on them: autograd then reaches those layers'
    parameters and the received activations exactly as in the in-process pipeline. The layers stay submodules of the
    module the library holds, so its ``scale_grads`` (1/M) and ``zero_grad`` cover them.

    Note [One schedule per batch shape]
    A ``PipelineStage`` learns the shapes of its activations at its first step and sizes its receive buffers from
    them for good: a later batch of another shape (the short last batch of an epoch, another sequence length) would be
    received into the old buffers, an error or, for a smaller message, stale rows read as data. So each batch shape
    (inputs' and targets' shapes and dtypes, the same on every rank) gets its own stage and schedule, built at its
    first batch (every rank builds it at the same step, so the shape exchange of its first step matches); the last
    ``SCHEDULES_KEPT`` shapes are kept, the oldest dropped first, the same on every rank.

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
    the owner's range). Every rank starts from rank 0's weights (the construction broadcasts them), so the copies'
    weights and Adam state start equal, and gather() and load_state_dict() keep them so.

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
    naming an address. So a rank's own failure (its layers' forward or the loss raising: a :class:`StageError`
    naming its stage, as in process) is recorded in the rendezvous store before it leaves the step, and a rank whose
    exchange fails raises :class:`~pyengine.distributed.DistributedError` naming the rank that failed from that
    record, or the rank that never reached this step (the check-ins of every step and gather), exactly as the
    multi-node hybrid engine does (Note [Naming the rank that failed], Note [Naming a rank that died between steps]
    in :mod:`pyengine.distributed`). After a failed step the engine refuses further steps.

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
                 autocast: torch.dtype | None, group):
        # weak: Note [No reference cycle through the engine] (pyengine.pipeline)
        self.engine, self.store, self.group = weakref.proxy(engine), engine.store, group
        world = dist.get_world_size(group)
        self.num_stages, self.replicas = stages, world // stages  # Note [Replicas of stages across processes]
        self.stage, self.replica = divmod(dist.get_rank(group), self.replicas)
        self.microbatches, self.schedule, self.autocast = microbatches, schedule, autocast
        self._pipe_group, self._dp_group = self._subgroups(group)
        self.stages: list = []  # no in-process stages: Engine._replica_buffers reads self.buffers
        self.layers = list(model._modules.items())
        self.sizes = _stage_sizes(self.layers, self.num_stages, balance)
        modules = split_layers(self.layers, self.sizes)
        store_names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
        names, self.tied = stage_store_names(store_names, modules)  # Note [Parameters tied across processes]
        self.ranges = [stage_range(self.store, s, owned_names(stage_names, s, self.tied))
                       for s, stage_names in enumerate(names)]
        if not names[self.stage]:
            raise ValueError(f"stage {self.stage} has no trainable parameters; choose another balance")
        self.device = engine.devices[0]
        self.module = copy.deepcopy(modules[self.stage]).to(self.device)
        # each rank its own generator (global index = rank), seeded per step: the data-parallel replicas of a stage
        # draw different masks (Note [Random numbers of concurrent workers] in pyengine/rng.py)
        engine.worker_rng(self.device, 0).install(self.module, engine.random_modules)
        # (store name, this rank's copy): a tied parameter's store name is its first name in the model
        self.params = list(zip(names[self.stage], (p for p in self.module.parameters() if p.requires_grad)))
        self._master, self._slot = self.store.views(self.store.param), self.store.views(self.store.grad_slot(0))
        self._gathered = (engine.version, 0)  # (version, steps) at the last gather: every rank starts equal
        self._scale = None  # the step's loss scale, which _loss multiplies in (Note [Loss scaling])
        # Note [Buffers of stages across processes]
        # A stage's persistent buffers (BatchNorm statistics) live, and change, on its own rank only. ``buffers``
        # holds every persistent buffer of the model: this rank's stage's own tensors, and a CPU copy of every other
        # stage's, which gather() refreshes from the owning rank (as it does the weights). Engine reads and writes
        # buffers through it (buffers_state_dict, load_state_dict). Non-persistent buffers (a causal mask) are
        # constants each stage's copy of its layers already holds.
        own = dict(self.module.named_buffers())
        owner = {name: s for s, m in enumerate(modules) for name, _ in m.named_buffers()}
        originals = dict(model.named_buffers())
        self.buffers = {name: own[name] if owner[name] == self.stage else originals[name].detach().to("cpu", copy=True)
                        for name in engine.buffer_names}
        self._buffer_exchange = [(name, self.buffers[name] if self.buffers[name].device.type == "cpu"
                                  else self.buffers[name].to("cpu", copy=True), self._ranks_of(owner[name], group))
                                 for name in engine.buffer_names]
        self._own_buffers = [(name, exchanged) for name, exchanged, src in self._buffer_exchange
                             if owner[name] == self.stage]
        self.is_first, self.is_last = self.stage == 0, self.stage == self.num_stages - 1
        self._wrapped = _PipelinedLayers(self.module, autocast, self.is_last, self.stage, self.replica, self.device)
        self.steps = 0  # steps begun
        self._start_naming(group, "pipeline")  # Note [Naming the stage that failed]
        self._enter("the construction of the engine")
        with _collective("broadcast of the initial weights from rank 0", self.rank, self._explain):
            dist.broadcast(self.store.param, src=dist.get_global_rank(group, 0), group=group)
        self._schedules: collections.OrderedDict = collections.OrderedDict()  # Note [One schedule per batch shape]
        # Note [Collective tensors outlive their work]
        # A gloo collective's work keeps its tensors and is released on gloo's worker thread, possibly after the
        # call returned. If that release drops the last reference of a tensor whose Python object is gone, the
        # worker thread takes the GIL to free that object; during interpreter shutdown taking the GIL ends the
        # thread inside a destructor (std::terminate: "terminate called without an active exception"; a spawned
        # test rank aborted so at exit, the core showed gloo's runLoop freeing a broadcast of gather()). So every
        # tensor this class passes to a collective is a buffer it keeps. (Destroying the group before exit, which
        # joins those threads, is the other half: Note [No reference cycle through the engine].)
        flats = [self.store.param, self.store.exp_avg, self.store.exp_avg_sq, self.store.max_exp_avg_sq]
        self._gather_views = [(flat[begin:end], self._ranks_of(s, group)) for flat in flats if flat is not None
                              for s, (begin, end) in enumerate(self.ranges)]
        self._fingerprint = torch.zeros(8, dtype=torch.float64)  # _same_batch
        # _update: squared norm, non-finite flag, loss sum, busy seconds (summed over the group)
        self._reduced = torch.zeros(4, dtype=torch.float64)
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
        key = (tuple(inputs.shape), inputs.dtype, tuple(targets.shape), targets.dtype)
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        stage = _MeteredStage(self._wrapped, self.stage, self.num_stages, self.device, group=self._pipe_group,
                              meter=self._meter)
        loss = weakref.WeakMethod(self._loss)  # the schedule keeps its loss function: no cycle back to self
        schedule = _SCHEDULE_CLASSES[self.schedule](stage, self.microbatches, loss_fn=lambda x, t: loss()(x, t),
                                                    scale_grads=True)
        self._schedules[key] = schedule
        if len(self._schedules) > SCHEDULES_KEPT:
            self._schedules.popitem(last=False)  # every rank drops the same one: they all see the same batches
        return schedule

    def _loss(self, x, targets):
        try:
            with self._meter.loss(), self._wrapped.context(x.device):
                loss = self.engine.loss_fn(self.module, (x, targets))
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise ValueError("loss_fn(last_stage, (activations, targets)) must return a scalar tensor (the mean "
                                 f"loss over the micro-batch); got {shape}")
        except Exception as exc:  # this rank's own failure (Note [Naming the stage that failed])
            raise StageError(self.stage, self.replica, self.device, exc) from exc
        return loss if self._scale is None else loss * self._scale  # Note [Loss scaling]

    def step(self, batch) -> dict:
        """One step of this rank's stage on ``(inputs, targets)`` (the same batch on every rank), then the update of
        its range of the store (Note [Distributed pipeline store]). A collective: every rank must call it."""
        engine, m = self.engine, self.microbatches
        start = time.perf_counter()
        if self.broken:
            raise DistributedError(f"rank {self.rank}: an earlier step failed; the group is no longer usable")
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError("mode='pipeline' needs each batch as (inputs, targets); got "
                             f"{type(batch).__name__}")
        inputs, targets = batch
        self.steps += 1
        self._enter(f"step {self.steps}")  # Note [Naming the stage that failed]
        try:
            same = self._same_batch(inputs, targets)
        except BaseException as exc:
            self.broken = True
            raise self._failure(exc) from exc
        if not same:  # every rank raises (the same answer everywhere); the group stays usable
            raise ValueError(f"rank {self.rank}: the ranks of a pipeline over a process group were given different "
                             "batches; every rank must call step() with the same (inputs, targets) (the first rank "
                             "runs the inputs, the last scores against the targets): do not shard the data per rank "
                             "(DistributedSampler) in mode='pipeline'")
        samples = batch_size(inputs)
        shards = [torch.tensor_split(t, self.replicas) for t in (inputs, targets)]  # replica r's: shards[.][r]
        sizes = [batch_size(x) for x in shards[0]]
        for r in range(self.replicas):  # the same batch on every rank: every rank raises, or none
            where = "" if self.replicas == 1 else f" (replica {r}'s shard)"
            _check_equal_split(shards[0][r], m, "inputs" + where)
            _check_equal_split(shards[1][r], m, "targets" + where)
        inputs, targets = shards[0][self.replica], shards[1][self.replica]
        with torch.no_grad():
            for name, p in self.params:
                p.copy_(self._master[name])
        self.module.zero_grad(set_to_none=True)
        pulled = time.perf_counter()
        losses = []
        # every rank's scale is the same: each takes the same admit_update decisions (the flag is all-reduced)
        self._scale = engine.loss_scale_now()
        self._meter.start_step()
        try:
            self._share_buffers()
            schedule = self._schedule_for(inputs, targets)
            began = self._start_clock()  # Note [Bubble across processes]
            _run_schedule(schedule, self.device, m, inputs if self.is_first else None,
                          targets if self.is_last else None, losses)
            scheduled = time.perf_counter()
            engine.count("steps")
            loss_sum = sum(float(l.detach()) for l in losses)  # the schedule's losses are scaled: unscale the sum
            loss_sum = loss_sum if self._scale is None else loss_sum / self._scale
            meter = self._meter
            with engine.phase("update"):
                applied, loss_sum, bubble, wall = self._update(loss_sum, sizes[self.replica] / samples, meter.busy,
                                                               scheduled - began, self._scale)
        except BaseException as exc:
            self.broken = True
            raise self._failure(exc) from exc
        end = time.perf_counter()
        return step_metrics(engine, loss=loss_sum / m, samples=samples, wall=end - start,
                            compute=scheduled - pulled, update=end - scheduled, transfer_wait=0.0,
                            copy_back=pulled - start, applied=applied, loss_scale=self._scale, stages=self.num_stages,
                            replicas=self.replicas, microbatches=m, schedule=self.schedule,
                            stage_sizes=list(self.sizes), schedule_s=wall, stage=self.stage,
                            replica=self.replica, busy_s=meter.busy, bubble_fraction=bubble,
                            activation_peak=meter.memory.peak_count, activation_peak_bytes=meter.memory.peak_bytes,
                            bubble_ideal=(self.num_stages - 1) / (m + self.num_stages - 1))

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
    def _same_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> bool:
        """Whether every rank was given the same batch (the same answer on every rank; a collective).

        Note [The same batch on every rank]
        The first rank runs the inputs, the last rank scores the outputs against its targets: with a different batch
        per rank (a DistributedSampler per rank, as for data parallelism) the pipeline would train on inputs paired
        with another batch's targets, silently. So before any work each rank takes a fingerprint of its batch (its
        sizes and the CRC-32 of the bytes of inputs and targets) and one small all-reduce (MAX of the fingerprint and
        of its negation) tells every rank whether they all agree. A checksum of the bytes, not a floating-point sum:
        a sum's last bits depend on how many intra-op threads split it, and ranks may run different counts."""
        both = self._fingerprint  # Note [Collective tensors outlive their work]
        both[0], both[1], both[2], both[3] = float(inputs.numel()), float(targets.numel()), \
            batch_checksum(inputs), batch_checksum(targets)
        both[4:] = -both[:4]
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        return torch.equal(both[:4], -both[4:])

    @torch.no_grad()
    def _share_buffers(self) -> None:
        """DDP's broadcast_buffers across the replicas of this rank's stage: replica 0's buffers to the others at the
        start of every step (Note [Replicas of stages across processes])."""
        if self._dp_group is None or not self._own_buffers:
            return
        source = self._ranks_of(self.stage, self.group)
        for name, exchanged in self._own_buffers:
            mine = self.buffers[name]
            if self.replica == 0 and exchanged is not mine:
                exchanged.copy_(mine)
            dist.broadcast(exchanged, src=source, group=self._dp_group)
            if exchanged is not mine:
                mine.copy_(exchanged)

    @torch.no_grad()
    def _start_clock(self) -> float:
        """The start of the schedule's common clock (Note [Bubble across processes]): a barrier over the group (one
        all-reduce of a kept tensor: Note [Collective tensors outlive their work]), then this rank's time."""
        self._clock.zero_()
        dist.all_reduce(self._clock, group=self.group)
        return time.perf_counter()

    @torch.no_grad()
    def _update(self, loss_sum: float, weight: float, busy: float, elapsed: float,
                scale: float | None) -> tuple[bool, float, float, float]:
        """Gradients -> slot 0 (across replicas: their weighted mean, ``weight`` = this replica's share of the batch),
        all-reduced norm, non-finite flag, loss and busy seconds, the schedule's wall (the most ``elapsed`` seconds
        since :meth:`_start_clock` over the ranks), then the fused update of this rank's range (Note [Distributed
        pipeline store]). Returns (applied, the loss summed over micro-batches, weighted across replicas, the bubble
        fraction, the wall: Note [Bubble across processes]). ``scale``: the step's loss scale."""
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
            dist.all_reduce(mean, group=self._dp_group)
            self._stage_grad.copy_(mean)
        if self.tied:
            dist.all_reduce(self._tied_grad, group=self.group)
            for name, part in self._tied_parts:
                self._slot[name].copy_(part)
        norm, nonfinite = ops.mean_grad_norm([self._stage_grad])
        reduced = self._reduced  # Note [Collective tensors outlive their work]
        # every stage's squared norm once (from replica 0; the replicas hold the same mean gradient)
        reduced[0] = norm.double().square() if self.replica == 0 else 0.0
        reduced[1], reduced[2], reduced[3] = nonfinite.double(), loss_sum * weight, busy
        dist.all_reduce(reduced, group=self.group)
        self._clock[0] = elapsed
        dist.all_reduce(self._clock, op=dist.ReduceOp.MAX, group=self.group)
        wall, ranks = float(self._clock[0]), dist.get_world_size(self.group)
        bubble = max(0.0, 1.0 - float(reduced[3]) / (ranks * wall)) if wall > 0 else 0.0
        if not self.engine.admit_update(reduced[1].item() != 0.0, [], loss_scale=scale):
            return False, float(reduced[2]), bubble, wall
        norm = reduced[0].sqrt().float().reshape(())
        for first, last in [(begin, end)] + self._tied_ranges:  # Note [Parameters tied across processes]
            self.engine.update_range(first, last, [slot], None, norm, loss_scale=scale)
        return True, float(reduced[2]), bubble, wall

    def gather(self) -> None:
        """Brings every stage's range of the weights and Adam state into this rank's store (a collective; a no-op
        when no update happened since the last one, which every rank agrees on: ``version`` is the same on all)."""
        now = (self.engine.version, self.steps)  # buffers change in a skipped step too
        if self._gathered == now:
            return
        self._enter(f"the gather of the weights after step {self.steps}")
        with _collective("the gather of every stage's weights, Adam state and buffers", self.rank, self._explain):
            for view, src in self._gather_views:
                dist.broadcast(view, src=src, group=self.group)
            with torch.no_grad():  # Note [Buffers of stages across processes]
                for name, exchanged, src in self._buffer_exchange:
                    mine = self.buffers[name]
                    if src == dist.get_rank() and exchanged is not mine:
                        exchanged.copy_(mine)  # a stage on a GPU: its buffer goes through a CPU copy
                    dist.broadcast(exchanged, src=src, group=self.group)
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
