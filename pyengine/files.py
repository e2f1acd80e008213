"""Writing a run's files so that a crash, a kill or a full disk leaves the old file or the new one, never a half.

A resume rewrites its run's files (metrics, summary, plots, the Chrome trace) over the previous good ones, so each
is written to a temporary file beside it, fsynced and renamed over it (:func:`replace_file`). Checkpoints have a
writer of their own (:func:`pyengine.checkpoint.save`: unique temporary names for concurrent savers, the folder
fsynced too).
"""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Callable

__all__ = ["replace_file"]


def replace_file(path, write: Callable[[Path], None]) -> None:
    """Replaces the file ``path`` atomically: ``write(tmp)`` writes the new contents to ``tmp``, a temporary file in
    the same folder (``.<stem>.tmp<suffix>``: the suffix tells writers such as matplotlib's savefig the format),
    which is then fsynced and renamed over ``path``. If anything fails the temporary file is removed and ``path``
    is left as it was. ``path``: a str, bytes or path-like.

    A symbolic link stays a link: the file it points to is replaced (the link was replaced by a plain file). A
    path that exists and is no regular file (``/dev/null``, a named pipe) is written in place: a rename over it
    replaced the device with a plain file (run as root, ``--trace /dev/null`` replaced the system's)."""
    if not os.fsdecode(path):
        raise ValueError("the file name is empty")  # Path("") is ".": the error named the current folder
    path = Path(os.fsdecode(path))
    if path.is_dir():  # the errors below named the temporary file, not the path given
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", str(path))
    if not path.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, f"its folder {str(path.parent)!r} does not exist", str(path))
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file() and not path.is_dir():  # a device, a pipe, a socket: its own writes
        write(path)
        return
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.filename != str(tmp):
            raise
        try:  # the path given, not the temporary file (.<stem>.tmp<suffix>) that the error named
            named = type(exc)(exc.errno, f"{exc.strerror} (writing it through {tmp.name})", str(path))
        except Exception:  # noqa: BLE001 - an OSError subclass of other arguments: as it came
            raise exc from None
        raise named from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
