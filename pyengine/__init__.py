"""pyengine: train one PyTorch model on many workers.

The master fp32 weights and the Adam state live in host memory; every worker holds a replica; gradients stream to the
host while backward runs; one fused kernel averages the G gradients and applies AdamW. See README.md.
"""
from . import ops
from ._C import with_cuda
from .store import HostStore
from .streamer import GradientStreamer, pipelined_update

__all__ = ["GradientStreamer", "HostStore", "ops", "pipelined_update", "with_cuda"]
__version__ = "0.1.0"
