"""Loss scaling for float16 autocast: :class:`LossScaler`, torch.amp.GradScaler's update rule, kept by the engine.

Note [Loss scaling]
Under float16 autocast the backward pass runs in float16, whose smallest subnormal is 2^-24 (6e-8): the gradients of
a large model, or of a loss with a small scale, flush to zero there, and again in the float16 gradient slots that
carry them to the host. Every worker therefore multiplies its loss by the scale S before backward (every micro-batch,
the pipeline's last stage too, in process and across processes), so the gradients in the slots are S times the true
ones (a worker's sum over micro-batches must fit float16 too: an overflow there backs off as well); the fused update
divides them by S (its ``grad_scale``; exact while S is a power of two) and clips by the norm / S. A step whose
gradient is not finite is skipped and S multiplied by ``backoff_factor``; after ``growth_interval`` applied steps in a
row S is multiplied by ``growth_factor``: torch.amp.GradScaler's rule, step for step (tested against it). Two rules
of our own:
- ``min_scale``: at that scale an overflow is no longer the scale's fault; the engine's ``nonfinite`` policy decides
  (``"raise"`` raises, ``"skip"`` skips at that scale). torch has no floor; DeepSpeed's ``min_loss_scale`` is one.
- async: a push divides by the scale it was computed with (taken with its snapshot). A push computed at a scale
  above the current one that overflows was already answered by a backoff: it is skipped without another, so G
  workers overflowing together halve the scale once, not G times; a push at another scale than the current one does
  not count towards growth. A push computed at a scale below the current one (it grew since the pull) that overflows
  backs off from the scale it overflowed at, so the scale never lands back on one known to overflow.
- async across processes: the coordinating server (rank 0) holds the scale that decides: a client computes with the
  scale that came with rank 0's snapshot and sends it with its push; the other servers divide their shards by it
  and skip exactly the pushes rank 0 skipped. Every rank gets rank 0's scaler state at the end of the run.
"""
from __future__ import annotations

import copy
import math
import numbers
import struct
import warnings

import torch

__all__ = ["LossScaler"]


_F32_TINY = 2.0 ** -126  # the smallest normal float32


def _f32(value: float) -> float:
    """``value`` rounded to float32 (inf beyond its range), as torch keeps the scale."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _finite(value) -> float | None:
    """``value`` as a finite float, or None when it is not a finite real number (an int past float's range too:
    math.isfinite raised OverflowError on 10**400)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's floats and ints are real too
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _check_used(used, what: str) -> None:
    """A scale a gradient was computed with: a finite number > 0 (0, -1, None or NaN once backed the scale off to
    its minimum, or counted nothing, without a word)."""
    value = _finite(used)
    if value is None or value <= 0:
        raise ValueError(f"LossScaler.{what}: used must be the scale the gradient was computed with, a finite "
                         f"number > 0; got {used!r}")


def _factor(name: str, value, least: float) -> float:
    if _finite(value) is None or value <= least:
        raise ValueError(f"LossScaler: {name} must be a finite number > {least}; got {value!r}")
    return value


def _positive(name: str, value) -> float:
    """``value`` as a float32 scale: a normal float32 > 0 (a smaller one would divide the gradients by 0)."""
    if _finite(value) is None or not _F32_TINY <= _f32(value) < math.inf:
        raise ValueError(f"LossScaler: {name} must be a normal float32 > 0; got {value!r}")
    return _f32(value)


class LossScaler:
    """The loss scale of float16 training (see Note [Loss scaling]); pass one as ``Engine(loss_scale=...)``.

    Args:
        init_scale: the first scale (torch.amp.GradScaler's default, 2^16).
        growth_factor: multiplies the scale after ``growth_interval`` applied steps in a row (> 1).
        backoff_factor: multiplies the scale at a step with a non-finite gradient, which is skipped (in (0, 1)).
        growth_interval: applied steps in a row before the scale grows (an int >= 1).
        min_scale: the scale never backs off below this; at it, a non-finite gradient goes to the engine's
            ``nonfinite`` policy.
        dynamic: False: a static scale (``init_scale`` always; every non-finite gradient goes to ``nonfinite``).

    ``scale`` is the current scale and ``growth_tracker`` the applied steps since the last change; both are in the
    engine's :meth:`~pyengine.Engine.state_dict` (the rule itself is the engine's configuration, as its lr
    schedule: a loaded tracker at or past ``growth_interval`` grows the scale at the next applied step). The scale,
    and every new scale are float32, as torch.amp.GradScaler keeps them (each product is taken in double and
    rounded, as torch's kernels do), so the scales are GradScaler's bit for bit with any factors; a growth past
    float32's range is not taken.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0, dynamic: bool = True):
        self.init_scale = _positive("init_scale", init_scale)
        # the factors stay doubles: torch multiplies its float32 scale by them in double, then rounds to float32
        self.growth_factor = float(_factor("growth_factor", growth_factor, 1.0))
        self.backoff_factor = float(_factor("backoff_factor", backoff_factor, 0.0))
        if self.backoff_factor >= 1.0:
            raise ValueError(f"LossScaler: backoff_factor must be in (0, 1); got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, numbers.Integral) \
                or growth_interval < 1:
            raise ValueError(f"LossScaler: growth_interval must be an int >= 1; got {growth_interval!r}")
        self.growth_interval = int(growth_interval)
        self.min_scale = _positive("min_scale", min_scale)
        if not isinstance(dynamic, bool):
            raise TypeError(f"LossScaler: dynamic must be a bool; got {dynamic!r}")
        # a static scale never backs off, so its floor does not bound it (LossScaler(0.5, dynamic=False) was
        # refused by the default min_scale 1.0, though Engine(loss_scale=0.5) builds that scaler)
        if dynamic and self.min_scale > self.init_scale:
            raise ValueError(f"LossScaler: min_scale ({min_scale!r}) must be <= init_scale ({init_scale!r})")
        self.dynamic = dynamic
        self.reset()

    def reset(self) -> None:
        """Back to ``init_scale`` with no applied steps counted."""
        self.scale = self.init_scale
        self.growth_tracker = 0

    def __repr__(self) -> str:
        return (f"LossScaler(scale={self.scale}, growth_tracker={self.growth_tracker}, growth_factor="
                f"{self.growth_factor}, backoff_factor={self.backoff_factor}, growth_interval={self.growth_interval}, "
                f"min_scale={self.min_scale}, dynamic={self.dynamic})")

    def overflow(self, used: float) -> bool:
        """A gradient computed at scale ``used`` is not finite: True when the scale answers it (the step is skipped
        and the scale backed off, or was already backed off below ``used``); False when it cannot (static, or at
        ``min_scale``): the engine's ``nonfinite`` policy decides."""
        _check_used(used, "overflow")
        if not self.dynamic:
            return False
        if used > self.scale:  # answered by an earlier backoff (async: Note [Loss scaling])
            return True
        self.growth_tracker = 0
        # async: the scale may have grown since this push's pull; the backoff is from the scale that overflowed,
        # so the new one is below it (Note [Loss scaling]). One scale in sync and hybrid: used == self.scale.
        overflowed = min(self.scale, used)
        if overflowed <= self.min_scale:
            self.scale = self.min_scale
            return False
        self.scale = max(_f32(overflowed * self.backoff_factor), self.min_scale)
        return True

    def applied(self, used: float) -> None:
        """A step computed at scale ``used`` was applied: counts towards growth (GradScaler's rule; a new scale that
        is not finite is not taken)."""
        _check_used(used, "applied")
        if not self.dynamic or used != self.scale:
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            grown = _f32(self.scale * self.growth_factor)  # the product in double, rounded to float32: torch's
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    @staticmethod
    def check_state_dict(sd) -> None:
        """Raises ValueError unless ``sd`` is a :meth:`state_dict`."""
        if not isinstance(sd, dict) or set(sd) != {"growth_tracker", "scale"}:
            found = list(sd) if isinstance(sd, dict) else type(sd).__name__
            raise ValueError(f"the state's loss scaler must be {{'scale': float, 'growth_tracker': int}}; got {found}")
        scale, tracker = sd["scale"], sd["growth_tracker"]
        if _finite(scale) is None or not _F32_TINY <= _f32(scale) < math.inf:
            raise ValueError(f"the state's loss scale must be a normal float32 > 0; got {scale!r}")
        if isinstance(tracker, bool) or not isinstance(tracker, int) or tracker < 0:
            raise ValueError(f"the state's loss scaler growth_tracker must be an int >= 0; got {tracker!r}")

    def load_state_dict(self, sd: dict | None) -> None:
        """Restores :meth:`state_dict`; None (a state saved without loss scaling) starts afresh (:meth:`reset`). A
        static scaler keeps its own scale: the scale is its configuration. A saved scale below this scaler's
        ``min_scale`` (saved with a lower one) starts at ``min_scale``, with a warning: below its floor, the first
        overflow "backed off" to ``min_scale``, up, and left the step to ``nonfinite``."""
        scale, tracker, warning = self.loaded(sd)
        if warning is not None:
            warnings.warn(f"LossScaler.load_state_dict: {warning}", RuntimeWarning, stacklevel=2)
        self.scale, self.growth_tracker = scale, tracker

    def loaded(self, sd: dict | None) -> tuple[float, int, str | None]:
        """What :meth:`load_state_dict` would set, changing nothing: ``(scale, growth_tracker, warning)``, the
        warning's text or None. For a caller that warns before it writes anything (the engine's load: a warning
        turned into an error must leave it as it was). Raises ValueError for an invalid ``sd``."""
        if sd is None:
            return self.init_scale, 0, None
        self.check_state_dict(sd)
        if not self.dynamic:
            return self.scale, self.growth_tracker, None
        scale, tracker = _f32(sd["scale"]), sd["growth_tracker"]
        if scale < self.min_scale:
            return self.min_scale, 0, (f"the state's loss scale {scale} is below this scaler's min_scale "
                                       f"{self.min_scale} (it was saved with a lower one): the scale starts at "
                                       f"{self.min_scale}")
        return scale, tracker, None


def make_scaler(loss_scale, autocast) -> LossScaler | None:
    """The engine's scaler for its ``loss_scale`` option: ``"auto"`` (dynamic under float16 autocast, else none),
    ``"dynamic"``, None (no scaling), a number (a static scale) or a :class:`LossScaler`."""
    if isinstance(loss_scale, str) and loss_scale == "auto":
        return LossScaler() if autocast is torch.float16 else None
    if loss_scale is None:
        return None
    if isinstance(loss_scale, LossScaler):  # a copy: the engine's scale moves, the object given is configuration
        return copy.deepcopy(loss_scale)  # (shared, two engines moved one scale, and a third started from it)
    if isinstance(loss_scale, str) and loss_scale == "dynamic":
        return LossScaler()
    if isinstance(loss_scale, numbers.Real) and not isinstance(loss_scale, bool):  # numpy's too (np.float32 was not)
        scale = _positive("the static loss_scale", loss_scale)
        return LossScaler(init_scale=scale, min_scale=scale, dynamic=False)
    raise ValueError(f"loss_scale must be 'auto', 'dynamic', None, a number > 0 or a pyengine.LossScaler; got "
                     f"{loss_scale!r}")


def grad_scale_tensor(scale: float | None) -> torch.Tensor | None:
    """The fused kernel's ``grad_scale`` for a step computed at ``scale`` (None: unscaled)."""
    return None if scale is None else torch.tensor([scale], dtype=torch.float32)
