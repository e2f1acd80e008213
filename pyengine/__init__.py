"""pyengine: train one PyTorch model on many workers.

The master fp32 weights and the Adam state live in host memory (:class:`HostStore`); every worker holds a replica;
gradients stream to the host while backward runs (:class:`GradientStreamer`); one fused kernel averages the G
gradients and applies AdamW (:mod:`pyengine.ops`). :class:`Engine` runs the hybrid, sync, async and pipeline schedules.
"""
from . import ops
from ._C import with_cuda
from .engine import Engine, StageError, WorkerError
from .optim import AdamW, WarmupCosine
from .scaler import LossScaler
from .store import HostStore
from .streamer import GradientStreamer, pipelined_update

__all__ = ["AdamW", "Engine", "GradientStreamer", "HostStore", "LossScaler", "StageError", "WorkerError",
           "WarmupCosine", "ops", "pipelined_update", "with_cuda"]
__version__ = "0.1.0"
