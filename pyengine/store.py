"""The host parameter store: fp32 master weights, Adam state, an optional low-precision shadow and one gradient slot
per worker, all in one host arena allocated once at its exact size.

The arena is pinned (``cudaHostAlloc``) when a CUDA device is usable, so the copies to and from the replicas run at
full link bandwidth on a copy stream; otherwise it is page-aligned memory with transparent huge pages advised and every
page touched at creation. Every tensor the store hands out is a view of the arena: it keeps the arena alive, so
nothing dangles when the store object goes first.

Layout: the trainable parameters in **reverse registration order** (the order backward produces their gradients, so
every DDP-style bucket of the :class:`~pyengine.GradientStreamer` is one contiguous range), each starting on a 64-byte
boundary in every buffer. The same element offsets hold in all flat buffers; padding elements are zero.
"""
from __future__ import annotations

import warnings
from typing import Iterable, NamedTuple

import torch

from . import _C

__all__ = ["HostStore", "LayoutEntry"]

_ALIGN_BYTES = 64
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SHADOW_DTYPES = (torch.bfloat16, torch.float16)
_warned_unpinned = False


class LayoutEntry(NamedTuple):
    """Where one parameter lives in the flat buffers: elements ``[offset, offset + numel)``, shaped ``shape``."""

    name: str
    shape: torch.Size
    offset: int
    numel: int


def _trainable(model_or_named_parameters) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, param) of the trainable parameters in registration order, each tensor once (shared ones by first name)."""
    if isinstance(model_or_named_parameters, torch.nn.Module):
        named: Iterable = model_or_named_parameters.named_parameters()
    else:
        named = model_or_named_parameters
    seen, out = set(), []
    for item in named:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError("HostStore: expected an nn.Module or an iterable of (name, tensor) pairs; got an item of "
                            f"type {type(item).__name__}")
        name, param = item
        if not param.requires_grad or id(param) in seen:
            continue
        if not param.is_floating_point():
            raise TypeError(f"HostStore: parameter {name!r} must be floating point; got {param.dtype}")
        seen.add(id(param))
        out.append((name, param))
    if not out:
        raise ValueError("HostStore: the model has no trainable parameters (requires_grad=True)")
    return out


def _warn_unpinned_once(reason: str) -> None:
    global _warned_unpinned
    if not _warned_unpinned:
        _warned_unpinned = True
        warnings.warn(f"HostStore(pin='auto'): {reason}; the arena is pageable host memory", RuntimeWarning,
                      stacklevel=3)


class HostStore:
    """One host arena holding everything the host-side optimizer step touches.

    Args:
        model_or_named_parameters: an ``nn.Module`` or an iterable of ``(name, parameter)``. Frozen parameters
            (``requires_grad=False``) are left out; a tensor registered under several names appears once. The master
            weights are initialised from these parameters.
        workers: G, the number of gradient slots.
        grad_dtype: dtype of the gradient slots (float32, bfloat16 or float16).
        pin: ``True`` (pinned or a clear error), ``False`` (pageable), or ``"auto"`` (pinned when a CUDA device is
            usable, else pageable with one warning).
        shadow_dtype: None, or bfloat16/float16 for a low-precision copy of the weights written by the update and
            shipped back to the replicas (half the bytes of the fp32 master).
        amsgrad: also hold ``max_exp_avg_sq``.
        max_bytes: refuse to allocate an arena larger than this many bytes.

    Attributes: ``param``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` (or None), ``shadow`` (or None): flat 1-D
    views of the arena, ``numel`` elements each; ``layout``, ``names``, ``numel``, ``nbytes``, ``pinned``, ``workers``,
    ``grad_dtype``.
    """

    def __init__(self, model_or_named_parameters, workers: int = 1, grad_dtype: torch.dtype = torch.float32,
                 pin="auto", shadow_dtype: torch.dtype | None = None, amsgrad: bool = False,
                 max_bytes: int | None = None):
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"HostStore: workers must be an int >= 1; got {workers!r}")
        if grad_dtype not in _GRAD_DTYPES:
            raise ValueError(f"HostStore: grad_dtype must be one of {_GRAD_DTYPES}; got {grad_dtype}")
        if shadow_dtype is not None and shadow_dtype not in _SHADOW_DTYPES:
            raise ValueError(f"HostStore: shadow_dtype must be None or one of {_SHADOW_DTYPES}; got {shadow_dtype}")
        if pin not in (True, False, "auto"):
            raise ValueError(f"HostStore: pin must be True, False or 'auto'; got {pin!r}")
        named = _trainable(model_or_named_parameters)
        self.workers = workers
        self.grad_dtype = grad_dtype
        self._layout_params(named, [grad_dtype] + ([shadow_dtype] if shadow_dtype is not None else []))
        sections = [("param", torch.float32), ("exp_avg", torch.float32), ("exp_avg_sq", torch.float32)]
        if amsgrad:
            sections.append(("max_exp_avg_sq", torch.float32))
        if shadow_dtype is not None:
            sections.append(("shadow", shadow_dtype))
        sections += [(f"grad{g}", grad_dtype) for g in range(workers)]
        self.nbytes = sum(self.numel * dtype.itemsize for _, dtype in sections)
        if max_bytes is not None and self.nbytes > max_bytes:
            raise ValueError(
                f"HostStore: the arena needs {self.nbytes} bytes ({self.nbytes / 2**20:.1f} MiB: {self.numel} "
                f"elements x [{', '.join(f'{n} {d}' for n, d in sections)}]) but max_bytes is {max_bytes}; lower "
                "workers, use a 2-byte grad_dtype, drop the shadow, or raise max_bytes")
        self._arena, self.pinned = self._allocate(pin)
        views, byte_offset = {}, 0
        for name, dtype in sections:
            size = self.numel * dtype.itemsize
            views[name] = self._arena[byte_offset:byte_offset + size].view(dtype)
            byte_offset += size
        self.param, self.exp_avg, self.exp_avg_sq = views["param"], views["exp_avg"], views["exp_avg_sq"]
        self.max_exp_avg_sq = views.get("max_exp_avg_sq")
        self.shadow = views.get("shadow")
        self._grad_slots = [views[f"grad{g}"] for g in range(workers)]
        self.load_from(named)

    def _layout_params(self, named, narrow_dtypes) -> None:
        # The same element offsets in every buffer, 64-byte aligned in the narrowest one (hence in all of them).
        align = _ALIGN_BYTES // min(dtype.itemsize for dtype in [torch.float32, *narrow_dtypes])
        self.layout, offset = [], 0
        for name, param in reversed(named):
            self.layout.append(LayoutEntry(name, param.shape, offset, param.numel()))
            offset += -(-param.numel() // align) * align
        self.numel = offset
        self.names = [entry.name for entry in self.layout]
        self._index = {entry.name: entry for entry in self.layout}

    def _allocate(self, pin) -> tuple[torch.Tensor, bool]:
        if pin is False:
            return _C._allocate_arena(self.nbytes, False), False
        if not _C._pinned_allocation_available():
            if pin is True:
                raise RuntimeError(
                    f"HostStore: pin=True asks for {self.nbytes} bytes ({self.nbytes / 2**20:.1f} MiB) of pinned "
                    "memory, but no CUDA device is usable (or pyengine was built without CUDA); pass pin=False for "
                    "pageable memory")
            _warn_unpinned_once("no usable CUDA device")
            return _C._allocate_arena(self.nbytes, False), False
        try:
            return _C._allocate_arena(self.nbytes, True), True
        except RuntimeError as error:
            if pin is True:
                raise
            _warn_unpinned_once(f"pinned allocation failed ({error})")
            return _C._allocate_arena(self.nbytes, False), False

    def grad_slot(self, worker: int) -> torch.Tensor:
        """Worker ``worker``'s gradient slot: a flat 1-D ``grad_dtype`` view of ``numel`` elements."""
        if not isinstance(worker, int) or not 0 <= worker < self.workers:
            raise IndexError(f"HostStore.grad_slot: worker must be an int in [0, {self.workers}); got {worker!r}")
        return self._grad_slots[worker]

    def entry(self, name: str) -> LayoutEntry:
        """The layout entry of parameter ``name``."""
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"HostStore: no trainable parameter named {name!r}") from None

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """name -> view of ``flat`` (one of the store's flat buffers, or any 1-D tensor of ``numel`` elements) shaped
        like the parameter. Views, not copies: writing them writes ``flat``."""
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise ValueError(f"HostStore.views: expected a 1-D tensor of {self.numel} elements; got shape "
                             f"{tuple(flat.shape)}")
        return {e.name: flat[e.offset:e.offset + e.numel].view(e.shape) for e in self.layout}

    def _named(self, model_or_named_parameters, what: str) -> dict[str, torch.Tensor]:
        named = (dict(model_or_named_parameters.named_parameters())
                 if isinstance(model_or_named_parameters, torch.nn.Module) else dict(model_or_named_parameters))
        missing = [name for name in self.names if name not in named]
        if missing:
            raise KeyError(f"HostStore.{what}: the model has no parameter named {missing[:5]} (of {len(missing)})")
        for entry in self.layout:
            if named[entry.name].shape != entry.shape:
                raise ValueError(f"HostStore.{what}: parameter {entry.name!r} has shape "
                                 f"{tuple(named[entry.name].shape)}; the store holds {tuple(entry.shape)}")
        return named

    @torch.no_grad()
    def load_from(self, model_or_named_parameters) -> None:
        """Copy the model's parameters (by name) into the fp32 master weights (and the shadow)."""
        named = self._named(model_or_named_parameters, "load_from")
        for name, view in self.views(self.param).items():
            view.copy_(named[name].detach())
        if self.shadow is not None:
            self.shadow.copy_(self.param)

    @torch.no_grad()
    def copy_to(self, model_or_named_parameters) -> None:
        """Copy the fp32 master weights into the model's parameters (by name, converted to their dtype/device)."""
        named = self._named(model_or_named_parameters, "copy_to")
        for name, view in self.views(self.param).items():
            named[name].copy_(view)

    def __repr__(self) -> str:
        return (f"HostStore({len(self.layout)} params, numel={self.numel}, workers={self.workers}, "
                f"grad_dtype={self.grad_dtype}, nbytes={self.nbytes}, pinned={self.pinned})")
