"""Checkpoints of ``python -m pyengine train``: atomic, versioned, validated.

File layout (``step-00000123.pyeckpt``)::

    magic  b"PYENGINE-CKPT\\n"      14 bytes
    header little-endian u32 format version, u64 payload length, 32-byte SHA-256 of the payload
    payload torch.save({...}) bytes (loaded with weights_only=True: tensors and plain containers only)

Writing goes to a temporary file in the same directory, is fsynced, then renamed over the final name (and the
directory fsynced), so a crash leaves either the old set of checkpoints or the new one, never a half file under a
checkpoint's name. Loading checks magic, version, length and hash before unpickling anything, so a truncated,
corrupted or foreign file is a :class:`CheckpointError` that says which, never a crash or a partial load.

Engines across processes (:func:`save_engine`, :func:`load_engine`): a checkpoint always holds the **full** training
state, whatever wrote it. A sharded engine (``shard_update=True``) gathers its Adam state from every rank while
saving, so saving is a collective (every rank calls :func:`save_engine`; rank 0 of the group writes); loading is
not: every rank reads the same file and a sharded engine keeps its own slice. So a checkpoint of P sharded ranks
resumes a single-process engine, a replicated run or a sharded run with another P.
"""
from __future__ import annotations

import collections
import hashlib
import io
import os
import re
import struct
import tempfile
import time
from pathlib import Path

import torch

__all__ = ["CheckpointError", "FORMAT_VERSION", "save", "load", "save_engine", "load_engine", "latest",
           "list_checkpoints", "prune"]

MAGIC = b"PYENGINE-CKPT\n"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<IQ32s")
_NAME = re.compile(r"step-([0-9]{8,})\.pyeckpt")  # fullmatch: "$" took a name ending in a newline, \d other digits
SUFFIX = ".pyeckpt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what is wrong with it."""


def path_for(directory, step: int) -> Path:
    """The file of ``step`` (an int >= 0) in ``directory``."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint: step must be an int >= 0; got {step!r}")  # -1 made a name no listing sees
    return Path(directory) / f"step-{step:08d}{SUFFIX}"


# What a payload may hold: what torch.load(weights_only=True) reads back (tensors, numbers, strings, plain
# containers). A payload of anything else would be written, and then never load.
_LEAVES = (torch.Tensor, str, bytes, int, float, bool, type(None), torch.dtype, torch.Size, torch.device)
_CONTAINERS = (dict, list, tuple, collections.OrderedDict, collections.Counter)


def _check_payload(value, where: str = "payload", seen: set | None = None) -> None:
    """ValueError naming the first entry of ``value`` that a checkpoint cannot hold. A container or tensor met again
    (shared, or a cycle) is checked once, as torch.save writes it once: walked at every reference, a payload of N
    nested dicts each holding the next twice took 2**N visits (1.8 s for N = 20), and a list holding itself raised
    RecursionError."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor) or type(value) in _CONTAINERS:
        if id(value) in seen:  # the payload holds every object walked: no id is reused during the walk
            return
        seen.add(id(value))
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, torch.nn.Parameter):  # weights_only=True refuses to rebuild a subclass
            raise ValueError(f"checkpoint: {where} is a {type(value).__qualname__}, a tensor subclass that a "
                             "checkpoint cannot read back (weights_only=True); store a plain tensor "
                             "(tensor.as_subclass(torch.Tensor))")
        if value.is_meta:
            raise ValueError(f"checkpoint: {where} is a meta tensor: it has no values to save")
        for name, item in vars(value).items():  # torch.save keeps a tensor's Python attributes: read back too
            _check_payload(item, f"{where}.{name}", seen)
        return
    if type(value) in _LEAVES:
        return
    if type(value) in _CONTAINERS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(value, dict):
                _check_payload(key, f"a key of {where}", seen)
            _check_payload(item, f"{where}[{key!r}]", seen)
        return
    raise ValueError(f"checkpoint: {where} is a {type(value).__qualname__}; a checkpoint holds tensors, numbers, "
                     "strings and dicts, lists and tuples of them (it is read back with weights_only=True)")


# A temporary file older than this is one a writer left when it crashed before its rename; younger ones may be
# another writer's, still being written (two savers into one folder deleted each other's files).
STALE_TMP_S = 3600.0


def _process_umask() -> int:
    mask = os.umask(0o022)  # read by setting: at import, before any thread of this package writes a file
    os.umask(mask)
    return mask


_UMASK = _process_umask()


def save(directory, step: int, payload: dict, keep: int | None = None) -> Path:
    """Writes ``payload`` as the checkpoint of ``step`` atomically; then keeps only the newest ``keep`` (None: all;
    otherwise an int >= 1, checked before anything is written)."""
    if keep is not None:
        _check_keep(keep, "save")
    final = path_for(directory, step)
    if not isinstance(payload, dict):
        raise ValueError(f"checkpoint.save: payload must be a dict; got {type(payload).__name__}")
    _check_payload(payload)
    directory = Path(directory)
    if keep is not None:  # written, then pruned at once: refused before anything is written
        newer = [p for p in list_checkpoints(directory) if step_of(p) > step]
        if len(newer) >= keep:
            raise ValueError(f"checkpoint.save: step {step} is older than the newest {keep} kept in {directory} "
                             f"(up to {newer[-1].name}): pruning would delete it at once; save it with keep=None or "
                             "elsewhere")
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    now = time.time()
    for stale in directory.glob(f".step-*{SUFFIX}.*.tmp"):  # a writer that crashed before its rename
        try:
            if now - stale.stat().st_mtime > STALE_TMP_S:
                stale.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:  # the file object owns the descriptor: closed whatever fails below
            try:  # mkstemp's 0600 would keep the run's other users from resuming it
                os.fchmod(f.fileno(), 0o666 & ~_UMASK)
            except OSError:  # a filesystem without Unix permissions (vfat, some network mounts): its own modes
                pass
            f.write(MAGIC)
            f.write(_HEADER.pack(FORMAT_VERSION, len(data), hashlib.sha256(data).digest()))
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)
    if created:  # the new folder's own entry, or a power loss could lose the folder with the checkpoint
        _fsync_dir(directory.parent)
    if keep is not None:
        prune(directory, keep)
    return final


def load(path) -> dict:
    """Reads and validates a checkpoint file; raises :class:`CheckpointError` with the reason."""
    path = Path(path)
    try:  # the header, then the payload it announces as one bytes object: one copy of the file in memory (a read
        # of the whole file, sliced, held two; so did read() of the rest, which grows its buffer to fit)
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + _HEADER.size)
            data, available = b"", 0
            if head.startswith(MAGIC) and len(head) == len(MAGIC) + _HEADER.size:
                available = os.fstat(f.fileno()).st_size - len(head)
                length = _HEADER.unpack(head[len(MAGIC):])[1]
                if length <= available:  # a header saying more (truncated, corrupted) reads nothing
                    data = f.read(length)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None
    if not head.startswith(MAGIC):
        if MAGIC.startswith(head):
            raise CheckpointError(f"checkpoint {path} is truncated ({len(head)} bytes, not even a header)")
        raise CheckpointError(f"{path} is not a pyengine checkpoint (no {MAGIC[:-1].decode()} header; "
                              "is it a file from another program?)")
    if len(head) < len(MAGIC) + _HEADER.size:
        raise CheckpointError(f"checkpoint {path} is truncated ({len(head)} bytes, header incomplete)")
    version, length, digest = _HEADER.unpack(head[len(MAGIC):])
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {version}; this pyengine reads version "
                              f"{FORMAT_VERSION}")
    if available != length or len(data) != length:
        what = "is truncated" if available < length else "has trailing bytes"
        raise CheckpointError(f"checkpoint {path} {what}: payload is {available} bytes, header says {length} "
                              "(an interrupted copy?)")
    if hashlib.sha256(data).digest() != digest:
        raise CheckpointError(f"checkpoint {path} is corrupted: its SHA-256 does not match the header")
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - hash matched, so this is a payload this version cannot read
        raise CheckpointError(f"checkpoint {path} could not be decoded: {type(exc).__name__}: {exc}") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(payload).__name__}, not a pyengine training state")
    return payload


def save_engine(directory, step: int, engine, keep: int | None = None, **extra) -> Path:
    """Checkpoint of ``engine``: ``{"engine": engine.state_dict(), **extra}`` written as :func:`save` does.

    With a process group (``engine.process_group``) this is a collective: every rank must call it with the same
    ``step``. Every rank takes the state (a sharded engine all-gathers its Adam state there, so the file holds the
    full state), rank 0 of the group writes the file and then tells every rank whether it could, so on return the
    file exists for every rank. The file holds every rank's counters (``stats()``), and :func:`load_engine` gives
    each rank of a group of the same size its own (an async client's pushes are not the server's). Returns the
    path rank 0 wrote, on every rank; ranks that pass different steps are refused on every rank (ValueError)
    before anything is written, and so are a hybrid or pipeline engine's ranks at different versions (one loaded
    another state alone: :class:`pyengine.distributed.DistributedError`, Note [A checkpoint of ranks at different
    versions]). When rank 0's write fails (disk full,
    no permission), every rank raises :class:`CheckpointError` naming the file and rank 0's error, and the group
    stays in step: a rank that catches it may train on.
    """
    group = engine.process_group
    if group is None:
        return save(directory, step, dict(extra, engine=engine.state_dict()), keep=keep)
    import torch.distributed as dist

    from . import distributed

    # Note [A checkpoint of ranks at different versions]
    # The step and the version are exchanged before the state is taken. A hybrid or pipeline engine's ranks hold one
    # state between them (Note [Every rank at the same version] in pyengine/distributed.py); a rank that loaded
    # another state alone (a resume on rank 0 only) would make the state a mix: a sharded engine's Adam state is
    # gathered from every rank's slice (rank 0's parts of one state, rank 1's of another, written without a word),
    # and a distributed pipeline's is gathered from every stage's rank, each holding its own state (its gather even
    # counts on every rank being at the same version). Refused on every rank alike, as the next step would be,
    # before anything is gathered or written. An async run's ranks are at different versions by design.
    with distributed.engine_exchange(engine, f"the exchange of the steps and versions for checkpoint step {step}"):
        gathered = distributed.all_gather_object((step, engine.version), group, engine.collective_works)
    steps = [s for s, _ in gathered]
    if any(s != steps[0] for s in steps):  # on every rank alike (each has the whole list): nothing is written
        raise ValueError(f"save_engine: every rank of the group must pass the same step; got {steps} (rank i's at "
                         "index i)")
    versions = [v for _, v in gathered]
    if engine.mode != "async" and any(v != versions[0] for v in versions):
        raise distributed.DistributedError(
            f"rank {dist.get_rank(group)}: save_engine: the ranks' engines hold different states (versions "
            f"{versions}, rank i's at index i): every rank must load the same state (load_state_dict or "
            "checkpoint.load_engine on every rank); nothing was written")
    payload = dict(extra, engine=engine.state_dict())
    # Note [Every rank resumes its own counters]: an async run's ranks count different things (a client its own
    # pushes and refreshes, a server the pushes it applied), and a client's count seeds its next push's draws; rank
    # 0 writes the file, so every rank's counters travel in it, and load_state_dict takes its own rank's
    with distributed.engine_exchange(engine, f"the exchange of the counters for checkpoint step {step}"):
        payload["engine"]["ranks"] = distributed.all_gather_object(
            {k: payload["engine"][k] for k in ("counters", "staleness")}, group, engine.collective_works)

    path, failure, error = path_for(directory, step), None, None
    if dist.get_rank(group) == 0:
        try:
            path = save(directory, step, payload, keep=keep)
        except Exception as exc:  # noqa: BLE001 - shared with every rank below, then raised here too
            failure, error = f"{type(exc).__name__}: {exc}", exc
    with distributed.engine_exchange(engine, f"rank 0's word on its write of checkpoint step {step}"):
        failure, written = distributed.broadcast_object((failure, str(path)), group, works=engine.collective_works)
    try:
        if failure is not None:
            raise CheckpointError(f"rank 0 could not write checkpoint {written}: {failure}") from error
    finally:  # the frame must not hold its own exception (its traceback holds the frame, and so the engine)
        error = None
    return Path(written)  # rank 0's: another rank's directory may name another place (a relative path, say)


def load_engine(path, engine) -> dict:
    """Loads a checkpoint of :func:`save_engine` (or of ``python -m pyengine train``) into ``engine`` with
    :meth:`Engine.load_state_dict` and returns its payload. Not a collective: a sharded engine's ranks each read the
    file and keep their slice of the Adam state."""
    payload = load(path)
    if not isinstance(payload.get("engine"), dict):
        raise CheckpointError(f"checkpoint {path} holds no engine state (keys: {sorted(payload)})")
    engine.load_state_dict(payload["engine"])
    return payload


def step_of(path) -> int:
    """The step of a checkpoint file named by :func:`path_for`."""
    match = _NAME.fullmatch(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not named like a checkpoint (step-<step>{SUFFIX})")
    return int(match.group(1))


def list_checkpoints(directory) -> list[Path]:
    """Checkpoint files in ``directory``, oldest step first (a folder of a checkpoint's name is none: pruning it
    would fail, resuming from it too)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.fullmatch(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def latest(directory) -> Path | None:
    files = list_checkpoints(directory)
    return files[-1] if files else None


def prune(directory, keep: int) -> None:
    """Deletes all but the newest ``keep`` checkpoints (an int >= 1: pruning never deletes the newest)."""
    _check_keep(keep, "prune")
    for path in list_checkpoints(directory)[:-keep]:
        path.unlink(missing_ok=True)


def _check_keep(keep, where: str) -> None:
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        none = " or None" if where == "save" else ""
        raise ValueError(f"checkpoint.{where}: keep must be an int >= 1 (the newest checkpoints kept){none}; got "
                         f"{keep!r}")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
