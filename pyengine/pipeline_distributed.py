"""Pipeline stages in separate processes: one process per stage, the transport and the GPipe / 1F1B schedules of
``torch.distributed.pipelining``, the master weights of each stage in its own host store, updated by the fused kernel.

    # every rank of a process group of S ranks (torchrun, or torch.multiprocessing.spawn + init_process_group)
    stage = DistributedPipelineStage(model, criterion, microbatches=4, schedule="1f1b", optimizer=pyengine.AdamW())
    metrics = stage.step(inputs=x if stage.is_first else None, targets=y if stage.is_last else None)

Every rank builds the same split of ``model`` (``balance="params"`` or a list of sizes) and keeps only its stage:
rank s runs stage s. ``criterion(output, targets_m)`` is the mean loss of a micro-batch on the last stage; the
schedule scales the gradients by 1/M (``scale_grads``), so the step is one step of AdamW on the whole batch's mean
gradient. torch.distributed.pipelining sizes its receive buffers from the first micro-batch, so every micro-batch
must have the same size: the batch must be a multiple of M (checked, with a clear error).

Note [Distributed pipeline update]
Each rank updates only its stage's parameters, from its own :class:`~pyengine.HostStore` (one gradient slot), with
the same fused kernel as the Engine. The global gradient norm (clipping) and the non-finite flag are all-reduced
over the group first, so every stage clips by the norm of the whole model's gradient and every stage skips (or
raises on) the same steps: the stages stay one consistent model. The step counter advances on every rank together.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from . import ops
from .optim import AdamW
from .pipeline import SCHEDULES, _check_sizes, _param_costs, as_sequential, partition, split_layers
from .store import HostStore
from .workers import batch_size

__all__ = ["DistributedPipelineStage"]

_SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class DistributedPipelineStage:
    """This process's stage of a pipeline whose stages are the ranks of ``group`` (see the module docstring).

    Args:
        model: the whole model as an ``nn.Sequential`` or a list of layers (the same on every rank).
        criterion: ``criterion(output, targets) -> scalar`` mean loss of a micro-batch (used on the last rank).
        microbatches: M >= 1.
        schedule: ``"1f1b"`` or ``"gpipe"``.
        balance: ``"params"`` or a list of S layer counts.
        optimizer: :class:`pyengine.AdamW` (default ``AdamW()``).
        device: this rank's device (``"cpu"`` or ``"cuda:i"``).
        group: the process group (default: the world); its size is S.
        nonfinite: ``"skip"`` or ``"raise"``, agreed over all stages.
        pin: the stage's host store memory (see :class:`~pyengine.HostStore`).
    """

    def __init__(self, model, criterion, *, microbatches: int, schedule: str = "1f1b", balance="params",
                 optimizer: AdamW | None = None, device="cpu", group=None, nonfinite: str = "skip", pin="auto"):
        if not dist.is_initialized():
            raise RuntimeError("DistributedPipelineStage needs an initialised process group "
                               "(torch.distributed.init_process_group) with one rank per stage")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}; got {schedule!r}")
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be an int >= 1; got {microbatches!r}")
        if nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite must be 'skip' or 'raise'; got {nonfinite!r}")
        self.group = group
        self.rank, self.num_stages = dist.get_rank(group), dist.get_world_size(group)
        layers = list(as_sequential(model)._modules.items())
        if self.num_stages > len(layers):
            raise ValueError(f"{self.num_stages} ranks (stages) but the model has {len(layers)} layers")
        if balance == "params":
            sizes = partition(_param_costs([layer for _, layer in layers]), self.num_stages)
        elif balance == "time":
            raise ValueError("balance='time' is not supported across processes; use 'params' or a list of sizes")
        else:
            sizes = _check_sizes(balance, len(layers), self.num_stages)
        self.sizes = sizes
        self.device = torch.device(device)
        self.module = split_layers(layers, sizes)[self.rank].to(self.device)
        self.params = [(name, p) for name, p in self.module.named_parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"stage {self.rank} has no trainable parameters; choose another balance")
        self.store = HostStore(self.params, workers=1, pin=pin, amsgrad=(optimizer or AdamW()).amsgrad)
        self.optimizer = optimizer if optimizer is not None else AdamW()
        self.microbatches, self.schedule_name, self.nonfinite = microbatches, schedule, nonfinite
        self.version = 0
        self.skipped_steps = 0
        self._master, self._slot = self.store.views(self.store.param), self.store.views(self.store.grad_slot(0))
        stage = PipelineStage(self.module, self.rank, self.num_stages, self.device, group=group)
        # every rank gets the criterion: a schedule without loss_fn runs forward only (and the ranks disagree)
        self._schedule = _SCHEDULE_CLASSES[schedule](stage, microbatches, loss_fn=criterion,
                                                     scale_grads=True)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.num_stages - 1

    def step(self, inputs=None, targets=None) -> dict:
        """One step: rank 0 passes ``inputs``, the last rank ``targets`` (others neither); every rank must call it.

        Returns ``{"loss": mean loss (last rank; None elsewhere), "applied": bool, "version", "wall_s",
        "schedule_s", "update_s"}``.
        """
        start = time.perf_counter()
        self._check_role(inputs, targets)
        with torch.no_grad():
            for name, p in self.params:
                p.copy_(self._master[name])
        self.module.zero_grad(set_to_none=True)
        m = self.microbatches
        kwargs = dict(arg_mbs=[()] * m, kwarg_mbs=[{}] * m)
        losses = []
        if self.is_first:
            kwargs["arg_mbs"] = [(x.to(self.device),) for x in self._split(inputs, "inputs")]
        if self.is_last:
            kwargs.update(target_mbs=[y.to(self.device) for y in self._split(targets, "targets")], losses=losses)
        self._schedule.step(**kwargs)
        scheduled = time.perf_counter()
        applied = self._update()
        end = time.perf_counter()
        loss = sum(float(l.detach()) for l in losses) / m if self.is_last else None
        return dict(loss=loss, applied=applied, version=self.version, wall_s=end - start,
                    schedule_s=scheduled - start, update_s=end - scheduled)

    def master_state_dict(self) -> dict:
        """This stage's fp32 master weights, named as in the whole model."""
        return {name: view.detach().clone() for name, view in self._master.items()}

    def _check_role(self, inputs, targets) -> None:
        if (inputs is not None) != self.is_first:
            raise ValueError(f"rank {self.rank}: inputs go to rank 0 only (got inputs={inputs is not None})")
        if (targets is not None) != self.is_last:
            raise ValueError(f"rank {self.rank}: targets go to the last rank ({self.num_stages - 1}) only "
                             f"(got targets={targets is not None})")

    def _split(self, tensor, what: str) -> list:
        n = batch_size(tensor)
        if n % self.microbatches:
            raise ValueError(f"{what}: a batch of {n} samples does not split into microbatches={self.microbatches} "
                             "equal micro-batches (torch.distributed.pipelining needs equal sizes)")
        return list(torch.tensor_split(tensor, self.microbatches))

    @torch.no_grad()
    def _update(self) -> bool:
        """Gradients -> slot, all-reduced norm and non-finite flag, fused AdamW (Note [Distributed pipeline update])."""
        for name, p in self.params:
            if p.grad is None:
                self._slot[name].zero_()
            else:
                self._slot[name].copy_(p.grad)
        slot = self.store.grad_slot(0)
        norm, nonfinite = ops.mean_grad_norm([slot])
        both = torch.stack([norm.double().square(), nonfinite.double()]).to(self.device)
        dist.all_reduce(both, group=self.group)
        if both[1].item() != 0.0:
            if self.nonfinite == "raise":
                raise FloatingPointError(f"non-finite gradient at step {self.version + 1} (some stage); the master "
                                         "weights keep the last complete update")
            self.skipped_steps += 1
            return False
        self.version += 1
        clip = self.optimizer.max_grad_norm or 0.0
        global_norm = both[0].sqrt().float().cpu().reshape(())
        torch.ops.pyengine.mean_grad_adamw_.default(
            self.store.param, self.store.exp_avg, self.store.exp_avg_sq, [slot], **self.optimizer.kernel_kwargs(),
            step=self.version, max_exp_avg_sq=self.store.max_exp_avg_sq, grad_scale=None, found_inf=None,
            weights=None, param_out=self.store.shadow, grad_norm=global_norm if clip else None,
            max_grad_norm=float(clip))
        return True
