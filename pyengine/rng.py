"""Random numbers of workers that run at the same time: one generator per worker, so runs are reproducible.

Note [Random numbers of concurrent workers]
torch has one default generator per device, shared by every thread. Workers that compute at the same time (hybrid
and async with G > 1, pipeline stages in threads) would draw their dropout masks from it in an order set by thread
timing, and two runs with the same seed would differ. So each such worker owns a ``torch.Generator`` on its device,
seeded from (seed, worker), and the modules of its replica that draw random numbers (:data:`RANDOM_MODULES`: the
dropout family, RReLU, MultiheadAttention) run with the device's default generator swapped for the worker's: under
one process-wide lock, the default generator's state is saved, the worker's state put in, the module's forward run,
and the states swapped back. The lock is held for those modules' forwards only (a dropout is a small op next to the
matmuls around it; a MultiheadAttention with dropout > 0 is serialised across workers whole, its price), and a module
in eval mode or with p = 0 draws nothing and takes no lock. CUDA kernels take their random offsets from the generator
when they are launched, on the host, so the swap orders them as well. A random module inside another (a
MultiheadAttention inside a layer listed by the user) runs on the state already swapped in.

What stays on the shared generator: random numbers drawn outside these modules (``torch.rand`` or
``F.dropout`` called in a ``forward`` or a ``loss_fn``). With concurrent workers those are not reproducible across
runs; list the module classes that draw them in ``Engine(random_modules=...)`` to route them too. A lone worker
(G = 1) and sync mode (one worker at a time) keep drawing from torch's default generator, exactly as single-device
training with the same seed would.
"""
from __future__ import annotations

import functools
import threading

import torch

__all__ = ["RANDOM_MODULES", "WorkerRNG", "worker_seed"]

_DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
             torch.nn.FeatureAlphaDropout)
# Module classes whose forward draws random numbers in training; each is routed when it would draw.
RANDOM_MODULES = (*_DROPOUTS, torch.nn.RReLU, torch.nn.MultiheadAttention)

_SWAP = threading.Lock()  # Note [Random numbers of concurrent workers]
_ACTIVE = threading.local()  # .rng: the WorkerRNG whose state is swapped in on this thread, if any


def worker_seed(seed: int, worker: int) -> int:
    """The seed of worker ``worker``'s generator: distinct per worker, a pure function of (seed, worker)."""
    return (seed * 1_000_003 + (worker + 1) * 0x9E3779B97F4A7C15) % 2**63


def _draws(module: torch.nn.Module) -> bool:
    """Whether ``module``'s next forward draws random numbers (a known random module with nothing to draw does not)."""
    if not module.training:
        return False
    if isinstance(module, _DROPOUTS):
        return module.p > 0
    if isinstance(module, torch.nn.MultiheadAttention):
        return module.dropout > 0
    return True


class WorkerRNG:
    """The generator of one concurrent worker on ``device``, seeded with :func:`worker_seed` ``(seed, worker)``."""

    def __init__(self, device: torch.device, seed: int, worker: int):
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device)
        self.generator.manual_seed(worker_seed(seed, worker))

    def _default(self) -> torch.Generator:
        if self.device.type == "cuda":
            return torch.cuda.default_generators[self.device.index]
        return torch.default_generator

    def run(self, forward, *args, **kwargs):
        """``forward(*args, **kwargs)`` drawing from this worker's generator instead of the device's default."""
        if getattr(_ACTIVE, "rng", None) is self:  # inside another of this worker's random modules: swapped in
            return forward(*args, **kwargs)
        default = self._default()
        with _SWAP:
            saved = default.get_state()
            default.set_state(self.generator.get_state())
            _ACTIVE.rng = self
            try:
                return forward(*args, **kwargs)
            finally:
                _ACTIVE.rng = None
                self.generator.set_state(default.get_state())
                default.set_state(saved)

    def install(self, model: torch.nn.Module, classes=()) -> int:
        """Routes the random modules of ``model`` (:data:`RANDOM_MODULES` and ``classes``) through :meth:`run`;
        returns how many. The wrapper is an instance attribute ``forward`` of each module (``model`` must be this
        worker's own replica)."""
        classes = tuple(classes)
        count = 0
        for module in model.modules():
            if isinstance(module, classes):
                module.forward = functools.partial(self.run, module.forward)
            elif isinstance(module, RANDOM_MODULES):
                module.forward = functools.partial(self._maybe_run, module, module.forward)
            else:
                continue
            count += 1
        return count

    def _maybe_run(self, module, forward, *args, **kwargs):
        if not _draws(module):
            return forward(*args, **kwargs)
        return self.run(forward, *args, **kwargs)

    def get_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)
