"""Phase timing for the engine: NVTX ranges (for Nsight Systems) and a Chrome trace of the phases per worker.

Every phase of a step runs inside :meth:`PhaseRecorder.phase`, which pushes an NVTX range named
``pyengine/<who>/<phase>`` when NVTX is usable (nothing when it is not, and negligible cost when no profiler is
attached) and records the span for :meth:`PhaseRecorder.write_chrome_trace` (chrome://tracing, Perfetto).
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time

import torch

from .files import replace_file

__all__ = ["PhaseRecorder"]


def _nvtx():
    try:
        torch.cuda.nvtx.range_push("pyengine")
        torch.cuda.nvtx.range_pop()
        return torch.cuda.nvtx
    except Exception:  # noqa: BLE001 - a torch without NVTX support: ranges become no-ops
        return None


class PhaseRecorder:
    """Thread-safe recorder of (who, phase, start, duration) spans; keeps the most recent ``capacity`` spans."""

    def __init__(self, capacity: int = 200_000):
        self._spans = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._origin = time.perf_counter()
        self._nvtx = _nvtx()

    @contextlib.contextmanager
    def phase(self, who: str, name: str, tid: int):
        if self._nvtx is not None:
            self._nvtx.range_push(f"pyengine/{who}/{name}")
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            if self._nvtx is not None:
                self._nvtx.range_pop()
            with self._lock:
                self._spans.append((who, name, tid, start - self._origin, end - start))

    def write_chrome_trace(self, path) -> None:
        """Writes the recorded spans as a Chrome trace (one row per worker, one for the host) to the file ``path``
        (a str or path-like: an int would be taken for a file descriptor, True for stdout, and closed)."""
        if not isinstance(path, (str, bytes, os.PathLike)):
            raise TypeError(f"trace: path must be a file name (str or path-like); got {type(path).__name__} {path!r}")
        with self._lock:
            spans = list(self._spans)
        events = [{"name": name, "cat": who, "ph": "X", "pid": 0, "tid": tid, "ts": start * 1e6, "dur": dur * 1e6}
                  for who, name, tid, start, dur in spans]
        names = {tid: who for who, _, tid, _, _ in spans}
        events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": who}}
                   for tid, who in sorted(names.items())]

        def write(tmp) -> None:
            with open(tmp, "w") as f:
                json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)

        replace_file(path, write)  # a resume rewrites it: a failed write (a full disk) left a truncated trace
