"""pyengine: train one PyTorch model on many workers.

The master fp32 weights and the Adam state live in host memory (:class:`HostStore`); every worker holds a replica;
gradients stream to the host while backward runs (:class:`GradientStreamer`); one fused kernel averages the G
gradients and applies AdamW (:mod:`pyengine.ops`). :class:`Engine` runs the hybrid, sync, async and pipeline schedules.
"""
import sys as _sys

try:
    from . import ops
    from ._C import with_cuda
    from .engine import Engine, StageError, WorkerError
    from .optim import AdamW, WarmupCosine
    from .scaler import LossScaler
    from .store import HostStore
    from .streamer import GradientStreamer, pipelined_update
except KeyboardInterrupt:
    # `python -m pyengine ...` imports this package (torch with it: seconds) before its main() can catch a Ctrl-C.
    # Started that way, an interrupt here is the command's own start-up: one line and exit 130, as main() does.
    # Imported by anything else, the interrupt is the importer's. While runpy locates the module of `-m`, sys.argv[0]
    # is "-m"; the module is the word after the interpreter's first "-m" (later ones are the program's arguments).
    _argv = getattr(_sys, "orig_argv", [])
    _module = _argv[_argv.index("-m") + 1] if "-m" in _argv[:-1] else ""
    if _sys.argv[:1] == ["-m"] and _module.split(".")[0] == "pyengine":
        print("pyengine: interrupted while starting; nothing was written", file=_sys.stderr, flush=True)
        raise SystemExit(130) from None
    raise

__all__ = ["AdamW", "Engine", "GradientStreamer", "HostStore", "LossScaler", "StageError", "WorkerError",
           "WarmupCosine", "ops", "pipelined_update", "with_cuda"]
__version__ = "0.1.0"
