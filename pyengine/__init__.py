"""pyengine: train one PyTorch model on many workers.

The master fp32 weights and the Adam state live in host memory (:class:`HostStore`); every worker holds a replica;
gradients stream to the host while backward runs (:class:`GradientStreamer`); one fused kernel averages the G
gradients and applies AdamW (:mod:`pyengine.ops`). :class:`Engine` runs the hybrid, sync, async and pipeline schedules.
"""
import signal as _signal
import sys as _sys
import threading as _threading


def _interrupted_while_starting():
    """Ends ``python -m pyengine`` interrupted before its main() runs (its imports): one line, exit 130."""
    print("pyengine: interrupted while starting; nothing was written", file=_sys.stderr, flush=True)
    raise SystemExit(130) from None


def _started_as_command() -> bool:
    """Whether this import is the start of ``python -m pyengine ...``. While runpy locates the module of ``-m``,
    sys.argv[0] is "-m"; the module is the word after the interpreter's first "-m" (later ones are the program's)."""
    argv = getattr(_sys, "orig_argv", [])
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    return _sys.argv[:1] == ["-m"] and module.split(".")[0] == "pyengine"


# `python -m pyengine ...` imports this package (torch, numpy with it: seconds) before its main() can catch a Ctrl-C.
# Started that way, the first Ctrl-C waits for the imports (one landing inside numpy's import has left it half
# imported, and what surfaced was another error: Note [Ctrl-C while the data's libraries import] in cli.py), then
# ends the command with one line and exit 130, as main() does; a second one gets out at once. Imported by anything
# else, an interrupt is the importer's.
_pressed = []
_deferring = (_started_as_command() and _threading.current_thread() is _threading.main_thread()
              and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler)
if _deferring:
    def _defer(signum, frame):
        _pressed.append(signum)
        if len(_pressed) > 1:
            raise KeyboardInterrupt

    _signal.signal(_signal.SIGINT, _defer)
try:
    from . import ops
    from ._C import with_cuda
    from .engine import Engine, StageError, WorkerError
    from .optim import AdamW, WarmupCosine
    from .scaler import LossScaler
    from .store import HostStore
    from .streamer import GradientStreamer, pipelined_update
except KeyboardInterrupt:
    if _started_as_command():
        _interrupted_while_starting()
    raise
finally:
    if _deferring:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
if _pressed:
    _interrupted_while_starting()

__all__ = ["AdamW", "Engine", "GradientStreamer", "HostStore", "LossScaler", "StageError", "WorkerError",
           "WarmupCosine", "ops", "pipelined_update", "with_cuda"]
__version__ = "0.1.0"
