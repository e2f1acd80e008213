"""Optimizer configuration of the engine: the options of the fused mean-gradient AdamW kernel.

:class:`AdamW` holds hyper-parameters only; the state (exp_avg, exp_avg_sq, ...) lives in the host store. Its
:meth:`torch_state_dict` builds a dict with the same keys and values as ``torch.optim.AdamW.state_dict()`` for the
same model, so users can move between the two (:meth:`load_torch_state_dict` goes the other way).
:class:`WarmupCosine` is a learning-rate schedule for ``Engine(lr_schedule=...)``.
"""
from __future__ import annotations

import math
import zlib
import numbers
import warnings
from dataclasses import asdict, dataclass

import torch

from .ops import bool_or_complex

__all__ = ["AdamW", "WarmupCosine", "check_lr_factor"]

_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_TINY = float(torch.finfo(torch.float32).tiny)


@dataclass
class AdamW:
    """AdamW (``adamw=False``: Adam with L2 weight decay) as torch.optim defines it, plus global-norm clipping.

    Args:
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW``, except that eps must be > 0 (at least
            float32's smallest normal number): with eps = 0 an element whose gradients are all 0 becomes NaN.
        max_grad_norm: clip the mean gradient to this global L2 norm (None: no clipping).
        adamw: True for decoupled weight decay (AdamW), False for Adam's L2 penalty.
        no_decay: names of parameters without weight decay: a parameter whose name contains any of these strings
            (e.g. ``("bias", "norm")``). Its :meth:`torch_state_dict` then has two groups, as the usual torch
            recipe builds them: the decayed parameters in model order with ``weight_decay``, then the others with 0.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    amsgrad: bool = False
    maximize: bool = False
    max_grad_norm: float | None = None
    adamw: bool = True
    no_decay: tuple[str, ...] = ()

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Checks the settings (TypeError / ValueError naming the field) and normalizes them (numbers to float,
        betas and no_decay to tuples). Run when made and by :meth:`check_update`, before every update: the fields
        may be changed between steps, and a bad value raises before the update is counted."""
        def number(value, name):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"AdamW: {name} must be a number; got {value!r}")
            try:
                return float(value)
            except OverflowError:  # an int past float's range: a value error like inf's
                raise ValueError(f"AdamW: {name} must be a finite number; got {value!r}") from None

        if getattr(self.betas, "ndim", None) == 1 and hasattr(self.betas, "tolist"):  # a 1-D tensor or array
            self.betas = tuple(self.betas.tolist())
        if not isinstance(self.betas, (tuple, list)):  # a set's order would swap them; a dict gives its keys
            raise TypeError(f"AdamW: betas must be a tuple of two numbers in [0, 1); got {type(self.betas).__name__} "
                            f"{self.betas!r}")
        if len(self.betas) != 2:
            raise ValueError(f"AdamW: betas must be two numbers in [0, 1); got {self.betas!r}")
        self.betas = tuple(number(b, f"betas[{i}]") for i, b in enumerate(self.betas))
        for name in ("lr", "eps", "weight_decay"):
            setattr(self, name, number(getattr(self, name), name))
        if self.max_grad_norm is not None:
            self.max_grad_norm = number(self.max_grad_norm, "max_grad_norm")
        if isinstance(self.no_decay, (str, bytes)) or not isinstance(self.no_decay, (tuple, list)) or not all(
                isinstance(s, str) and s for s in self.no_decay):
            raise TypeError(f"AdamW: no_decay must be a tuple of non-empty strings (parts of parameter names); "
                            f"got {self.no_decay!r}")
        self.no_decay = tuple(self.no_decay)
        for name in ("amsgrad", "maximize", "adamw"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"AdamW: {name} must be True or False; got {getattr(self, name)!r}")
        # asked before every update: each message is formatted only when its check fails (formatting them all
        # made this ~20 us a call)
        f32, tiny = _F32_MAX, _F32_TINY  # the update computes in float32
        if not 0 <= self.lr <= f32:
            self._refuse(f"lr must be a number in [0, {f32:.4g}] (float32's range); got {self.lr}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            self._refuse(f"betas must be two numbers in [0, 1); got {self.betas}")
        if not tiny <= self.eps <= f32:
            # eps = 0: an element whose gradients have all been 0 so far divides 0 by 0 (NaN in the master weights)
            self._refuse(f"eps must be a number in [{tiny:.4g}, {f32:.4g}] (float32's normal numbers: with eps = 0 "
                         f"an element whose gradients are all 0 divides 0 by 0); got {self.eps}")
        if not 0 <= self.weight_decay <= f32:
            self._refuse(f"weight_decay must be a number in [0, {f32:.4g}] (float32's range); got {self.weight_decay}")
        if not (self.max_grad_norm is None or self.max_grad_norm > 0):
            self._refuse(f"max_grad_norm must be > 0 or None; got {self.max_grad_norm}")

    @staticmethod
    def _refuse(message: str) -> None:
        raise ValueError(f"AdamW: {message}")

    def check_update(self, step: int, lr: float | None = None) -> None:
        """Raises ValueError where the fused update ``step`` (at ``lr``, default ``self.lr``) would refuse these
        settings: lr, eps, weight_decay or the float32 scalars derived from them (lr / (1 - beta1^step), 1 - lr *
        weight_decay) beyond float32's range. The kernel's own check (``pyengine._C._check_update_hyper``), after
        :meth:`validate` (the fields may have been changed since the last update). ``step``: an int >= 1."""
        from . import _C
        self.validate()
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"AdamW.check_update: step must be an int >= 1 (updates count from 1); got {step!r}")
        _C._check_update_hyper(float(self.lr if lr is None else lr), self.betas[0], float(self.eps),
                               float(self.weight_decay), step)

    def kernel_kwargs(self, lr: float | None = None) -> dict:
        """Keyword arguments of ``torch.ops.pyengine.mean_grad_adamw_`` (all but tensors, step and clipping)."""
        return dict(lr=float(self.lr if lr is None else lr), beta1=self.betas[0], beta2=self.betas[1],
                    eps=float(self.eps), weight_decay=float(self.weight_decay), adamw=self.adamw,
                    maximize=self.maximize, amsgrad=self.amsgrad)

    def config(self) -> dict:
        return asdict(self)

    def digest(self) -> int:
        """A 32-bit digest of the settings (CRC-32 of the repr: floats print exactly), the same in every process
        holding the same ones; the ranks of a group compare it at every step (Note [Every rank at the same
        version])."""
        return zlib.crc32(repr(self).encode())

    def decays(self, name: str) -> bool:
        """Whether the parameter ``name`` gets weight decay (``no_decay`` names none of its parts)."""
        return not any(part in name for part in self.no_decay)

    def param_groups(self, names: list[str]) -> list[tuple[list[str], float]]:
        """``names`` (model order) as torch's param groups: ``(names, weight_decay)``, one group without
        ``no_decay``, else the decayed parameters then the others (weight decay 0)."""
        if not self.no_decay:
            return [(list(names), self.weight_decay)]
        return [([n for n in names if self.decays(n)], self.weight_decay),
                ([n for n in names if not self.decays(n)], 0.0)]

    def torch_state_dict(self, store, step: int, names: list[str], full_state: dict | None = None,
                         scheduled_lr: float | None = None) -> dict:
        """The optimizer state in ``torch.optim.AdamW.state_dict()`` form; ``names`` are the trainable parameters
        in ``model.parameters()`` order, which is how torch indexes them. ``full_state``: flat full-size state
        buffers by name, needed when the store holds part of the state only (``state_ranges``; see
        :func:`pyengine.distributed.gather_optimizer_state`). ``scheduled_lr``: with a learning-rate schedule, the
        group holds it as ``lr`` and ``self.lr`` as ``initial_lr`` (the key torch's ``LambdaLR`` adds). Each
        ``step`` is a float64 tensor (torch's float32 is exact up to 2**24 updates only; torch loads either)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:  # -1 gave an empty state, 1.5 a step
            raise ValueError(f"torch_state_dict: step must be an int >= 0 (updates applied); got {step!r}")
        if full_state is None and store.state_ranges is not None:
            raise ValueError("the store holds part of the Adam state only (state_ranges); pass full_state, e.g. "
                             "pyengine.distributed.gather_optimizer_state(engine)")
        buffers = self._state_buffers(store) if full_state is None else {k: full_state[k] for k in
                                                                          self._state_buffers(store)}
        views = {name: store.views(flat) for name, flat in buffers.items()}
        groups = self.param_groups(names)
        state = {}
        if step > 0:
            for index, name in enumerate(n for group_names, _ in groups for n in group_names):
                entry = {"step": torch.tensor(float(step), dtype=torch.float64)}  # float32 is exact to 2**24 only
                for key in views:
                    entry[key] = views[key][name].detach().clone()
                state[index] = entry
        param_groups, start = [], 0
        for group_names, weight_decay in groups:
            group = dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=weight_decay,
                         amsgrad=self.amsgrad, maximize=self.maximize, foreach=None, capturable=False,
                         differentiable=False, fused=None, decoupled_weight_decay=self.adamw,
                         params=list(range(start, start + len(group_names))))
            if scheduled_lr is not None:
                group.update(lr=scheduled_lr, initial_lr=self.lr)
            param_groups.append(group)
            start += len(group_names)
        return {"state": state, "param_groups": param_groups}

    def load_torch_state_dict(self, store, state_dict: dict, names: list[str], *, checked_step: int | None = None
                              ) -> int:
        """Copies a ``torch.optim.AdamW.state_dict()`` into the store (a store with ``state_ranges`` keeps only its
        ranges of it); returns its step count (0 for a state saved before any update: the store's moments are zeroed,
        as a fresh optimizer's). Everything is checked (:meth:`check_torch_state_dict`) before the store is written;
        ``checked_step``: what that check returned for this very state, when the caller ran it
        already (it reads every value: not twice); without it, hyper-parameters in the groups that differ from this
        AdamW's (:meth:`group_differences`, never read) are warned about."""
        if checked_step is None:
            step = self.check_torch_state_dict(store, state_dict, names)
            differing = self.group_differences(state_dict, names)
            if differing:
                warnings.warn(f"load_torch_state_dict: the state's param_groups hold {differing}; they are not read: "
                              f"this AdamW's settings drive the update", stacklevel=2)
        else:
            step = checked_step
        if step == 0:  # a state saved before any update: a fresh optimizer's moments are zeros
            for flat in self._state_buffers(store).values():
                flat.zero_()
            return 0
        state = state_dict["state"]
        names = [n for group_names, _ in self.param_groups(names) for n in group_names]  # torch's index order
        for key, flat in self._state_buffers(store).items():
            full = flat if store.state_ranges is None else torch.zeros(store.numel)
            views = store.views(full)
            for index, name in enumerate(names):
                with torch.no_grad():  # a state tensor that requires grad must not tie the store to autograd
                    views[name].copy_(state[index][key].detach())
            if full is not flat:
                store.load_state_from_full(flat, full)
        return step

    def group_differences(self, state_dict: dict, names: list[str], *, scheduled: bool = False) -> dict:
        """The hyper-parameters of a ``torch.optim`` state's ``param_groups`` that differ from these settings, as
        ``{"param_groups[g]['key']": value}``. Loading reads the groups' layout only: these settings drive the
        update, so a group's values are never used (editing a saved group's lr, a torch habit, changes nothing;
        the callers warn). ``lr``: a group's ``initial_lr`` (an lr schedule's base) when it has one, else its ``lr``
        unless ``scheduled`` (then ``lr`` is a scheduled value, not a setting). Keys a group lacks are skipped."""
        def same(saved, mine) -> bool:
            try:
                if isinstance(mine, tuple):
                    return len(saved) == len(mine) and all(float(s) == m for s, m in zip(saved, mine))
                return (bool(saved) == mine) if isinstance(mine, bool) else float(saved) == mine
            except (TypeError, ValueError, RuntimeError):  # not numbers (or a tensor of several)
                return False

        differences = {}
        for g, (group, (_, weight_decay)) in enumerate(zip(state_dict["param_groups"], self.param_groups(names))):
            if not isinstance(group, dict):
                continue
            lr_key = "initial_lr" if "initial_lr" in group else None if scheduled else "lr"
            mine = {lr_key: self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": weight_decay,
                    "amsgrad": self.amsgrad, "maximize": self.maximize, "decoupled_weight_decay": self.adamw}
            for key, value in mine.items():
                if key is not None and key in group and not same(group[key], value):
                    differences[f"param_groups[{g}][{key!r}]"] = group[key]
        return differences

    def check_torch_state_dict(self, store, state_dict: dict, names: list[str]) -> int:
        """Validates a ``torch.optim.AdamW.state_dict()`` for :meth:`load_torch_state_dict` without writing
        anything; returns its step count (0 for an optimizer that has not stepped)."""
        groups = self.param_groups(names)
        what = "one group" if len(groups) == 1 else \
            "two groups (AdamW(no_decay=...): the decayed parameters, then the others)"
        if (not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}
                or not isinstance(state_dict["param_groups"], (list, tuple))
                or len(state_dict["param_groups"]) != len(groups) or not isinstance(state_dict["state"], dict)):
            raise ValueError(f"expected a torch.optim state_dict with keys 'state' and 'param_groups' and {what}")
        start = 0
        for g, (group_names, _) in enumerate(groups):
            group = state_dict["param_groups"][g]
            # a group as torch.optim saves it: a dict with its params' indices (torch refuses one without them;
            # 5, {} or {"params": None} loaded here without a word)
            if not isinstance(group, dict) or "params" not in group:
                raise ValueError(f"param_groups[{g}] must be a dict with the indices of its params, as "
                                 f"torch.optim.AdamW.state_dict() saves it ({what}); got {type(group).__name__} "
                                 f"{group!r:.100}")
            params = group["params"]
            if (not isinstance(params, (list, tuple)) or any(type(i) is not int for i in params)
                    or list(params) != list(range(start, start + len(group_names)))):
                frozen = (" (a torch optimizer over model.parameters() holds the frozen parameters too: build it over "
                          "the trainable ones, [p for p in model.parameters() if p.requires_grad], as the engine "
                          "does)") if isinstance(params, (list, tuple)) and len(params) > len(group_names) else ""
                raise ValueError(f"param_groups[{g}] holds params {params}; expected {len(group_names)} params from "
                                 f"index {start} ({what}){frozen}")
            self._check_param_names(group, g, group_names, names)
            start += len(group_names)
        decay = state_dict["param_groups"][1].get("weight_decay", 0.0) if len(groups) == 2 else 0.0
        if not (isinstance(decay, numbers.Real) and not isinstance(decay, bool) and decay == 0.0):
            raise ValueError(f"param_groups[1] has weight_decay {state_dict['param_groups'][1]['weight_decay']}; "
                             f"expected 0 ({what})")
        names = [n for group_names, _ in groups for n in group_names]  # torch's index order
        state = state_dict["state"]
        if not state:
            return 0
        if set(state) != set(range(len(names))):
            raise ValueError(f"optimizer state covers params {sorted(state, key=repr)}; the model has {len(names)}")
        keys = ("step", *self._state_buffers(store))
        views = store.views(store.param)
        for index, name in enumerate(names):
            entry = state[index]
            missing = [k for k in keys if not isinstance(entry, dict) or k not in entry]
            if missing:
                raise ValueError(f"optimizer state[{index}] (param {name!r}) lacks {missing}")
            if "max_exp_avg_sq" in entry and "max_exp_avg_sq" not in keys:  # it would be dropped
                raise ValueError(f"optimizer state[{index}] (param {name!r}) has max_exp_avg_sq (saved with "
                                 "amsgrad=True); this store has no room for it: build with AdamW(amsgrad=True)")
            step_value = entry["step"]
            if isinstance(step_value, (bool, str, bytes)) or (isinstance(step_value, torch.Tensor) and (
                    step_value.dtype == torch.bool or step_value.numel() != 1)):
                raise ValueError(f"optimizer state[{index}]['step'] (param {name!r}) must be a number or a "
                                 f"one-element tensor; got {step_value!r}")
            for key in keys[1:]:
                value = entry[key]
                if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.is_meta \
                        or value.layout != torch.strided or tuple(value.shape) != tuple(views[name].shape):
                    found = (f"{value.dtype} {tuple(value.shape)}{' on meta' if value.is_meta else ''}"
                             f"{'' if value.layout == torch.strided else f' ({value.layout})'}"
                             if isinstance(value, torch.Tensor) else type(value).__name__)
                    raise ValueError(f"optimizer state[{index}][{key!r}]: expected a floating tensor of shape "
                                     f"{tuple(views[name].shape)} (param {name!r}); got {found}")
                check_state_values(value, f"optimizer state[{index}][{key!r}] (param {name!r})",
                                   nonnegative=key != "exp_avg")
        try:
            steps = {float(state[index]["step"]) for index in range(len(names))}
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"optimizer state: every 'step' must be a number; {exc}") from None
        if len(steps) != 1:
            raise ValueError(f"every param must be at the same step; got steps {sorted(steps)}")
        step = steps.pop()
        if not (step >= 1 and math.isfinite(step) and step == int(step)):
            raise ValueError(f"optimizer state: the step must be a whole number >= 1; got {step}")
        return int(step)

    @staticmethod
    def _check_param_names(group: dict, g: int, group_names: list[str], names: list[str]) -> None:
        """A group's ``param_names`` (torch >= 2.6 saves them for an optimizer built from ``named_parameters()``)
        against the names this layout puts at its indices. torch loads by index and never reads them; here a state
        whose names put another of this model's parameters at an index is refused, since each moment would go to the
        wrong parameter (of the same shape, silently). Names that are none of this model's (a wrapper's prefix,
        ``module.``) are not compared: the state loads by index, as in torch."""
        if "param_names" not in group:
            return
        saved = group["param_names"]
        if not isinstance(saved, (list, tuple)) or len(saved) != len(group_names) or not all(
                isinstance(n, str) for n in saved):
            raise ValueError(f"param_groups[{g}]['param_names'] must be a list of {len(group_names)} names, one per "
                             f"param of the group; got {saved!r:.200}")
        known = set(names)
        two = ", the decayed ones in the first group, the others in the second" if len(group_names) != len(names) \
            else ""
        for index, (theirs, mine) in enumerate(zip(saved, group_names)):
            if theirs != mine and theirs in known:
                raise ValueError(f"param_groups[{g}]['param_names'][{index}] is {theirs!r} where this model's order "
                                 f"puts {mine!r}: the state's optimizer was built over the parameters in another "
                                 f"order, and each moment would go to the wrong parameter: build the torch "
                                 f"optimizer over the trainable parameters in model.named_parameters() order"
                                 f"{two} (nothing was loaded)")

    def _state_buffers(self, store) -> dict:
        buffers = {"exp_avg": store.exp_avg, "exp_avg_sq": store.exp_avg_sq}
        if store.max_exp_avg_sq is not None:  # the store's buffers (amsgrad when it was made), not the field now
            buffers["max_exp_avg_sq"] = store.max_exp_avg_sq
        return buffers


def check_state_values(value: torch.Tensor, what: str, nonnegative: bool = False) -> None:
    """Note [A state's values are checked]
    The engine never writes a non-finite weight or moment (a non-finite gradient is skipped or raises), and Adam's
    second moments are never negative; a state that holds such values is damaged (or was written by other code),
    and training from it goes wrong with no word: a NaN weight makes every later loss NaN, so every later step is
    skipped; a negative exp_avg_sq makes its square root NaN. So the values of a loaded state (the master weights,
    exp_avg, exp_avg_sq, max_exp_avg_sq) are checked, in float32 as they are stored (a float64 value beyond float32's
    range is infinite there): ValueError naming ``what`` and how many values are bad."""
    value = value.detach().to(torch.float32)
    bad = value.numel() - int(torch.isfinite(value).sum())
    if bad:
        raise ValueError(f"{what} holds {bad} non-finite value(s) (NaN, inf, or beyond float32's range) of "
                         f"{value.numel()}: a diverged or damaged state; resume from an earlier one")
    if nonnegative:
        negative = int((value < 0).sum())
        if negative:
            raise ValueError(f"{what} holds {negative} negative value(s) of {value.numel()}: Adam's second moments "
                             "are >= 0 (a damaged state)")


def check_lr_factor(factor, step: int) -> float:
    """``factor`` as a float, checked: a learning-rate schedule's value for ``step`` (updates applied before this
    one) must be a finite number >= 0."""
    try:
        value = None if isinstance(factor, (str, bytes)) or bool_or_complex(factor) else float(factor)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        value = None
    if value is None or not math.isfinite(value) or value < 0:
        raise ValueError(f"lr_schedule({step}) returned {factor!r}; it must return a finite number >= 0 (the factor "
                         "on the optimizer's lr)")
    return value


@dataclass(frozen=True)
class WarmupCosine:
    """A learning-rate schedule for ``Engine(lr_schedule=...)``: the factor on ``AdamW.lr`` of the update that
    follows ``step`` applied updates (``torch.optim.lr_scheduler.LambdaLR``'s ``lr_lambda`` convention).

    Linear warmup over the first ``warmup_steps`` updates, ``(step + 1) / warmup_steps``; then 1 when
    ``total_steps`` is None, else a cosine from 1 down to ``min_factor`` that reaches it at ``step ==
    total_steps``, the update after the first ``total_steps`` (the last of ``total_steps`` updates still has a small
    lr), and keeps it after. Not part of a checkpoint (a checkpoint holds tensors, numbers and plain containers):
    give the engine that loads one the same schedule.
    """

    warmup_steps: int = 0
    total_steps: int | None = None
    min_factor: float = 0.0

    def __post_init__(self):
        def whole(value, name, least):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise ValueError(f"WarmupCosine: {name} must be an integer >= {least}; got {value!r}")

        whole(self.warmup_steps, "warmup_steps", 0)
        if self.total_steps is not None:
            whole(self.total_steps, "total_steps", max(1, self.warmup_steps))
        if isinstance(self.min_factor, bool) or not isinstance(self.min_factor, numbers.Real) \
                or not 0.0 <= self.min_factor <= 1.0:
            raise ValueError(f"WarmupCosine: min_factor must be a number in [0, 1]; got {self.min_factor!r}")

    def __call__(self, step: int) -> float:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"WarmupCosine: step (updates applied so far) must be an integer >= 0; got {step!r}")
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        if step >= self.total_steps:  # also when the warmup takes every step: no cosine then, min_factor after
            return float(self.min_factor)
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_factor + (1.0 - self.min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
