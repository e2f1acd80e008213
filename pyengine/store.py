"""The host parameter store: fp32 master weights, Adam state, an optional low-precision shadow and one gradient slot
per worker, all in one host arena allocated once at its exact size.

The arena is 2 MiB-aligned memory with transparent huge pages advised and every page touched at creation (the host's
update streams it; 4 KiB pages cost it 7-18 %), page-locked with ``cudaHostRegister`` when a CUDA device is usable,
so the copies to and from the replicas run at full link bandwidth on a copy stream (``cudaHostAlloc``'s 4 KiB pages
where the registration fails). Every tensor the store hands out is a view of the arena: it keeps the arena alive, so
nothing dangles when the store object goes first.

Layout: the trainable parameters in **reverse registration order** (the order backward produces their gradients, so
every DDP-style bucket of the :class:`~pyengine.GradientStreamer` is one contiguous range), each starting on a 64-byte
boundary in every buffer. The same element offsets hold in all flat buffers; padding elements are zero. The flat
buffers follow each other in the arena, a few hundred bytes apart where they would otherwise share their offsets
within 2 MiB pages (Note [Staggered sections]).

Partial Adam state (``state_ranges``): a process of a sharded update (ZeRO-1, :mod:`pyengine.distributed`) updates
only some element ranges of the flat layout, so it needs the Adam state of those ranges only. The store then packs
``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``) contiguously, range after range, each buffer padded to 64 bytes;
:meth:`HostStore.state_slice` maps a flat range to its packed slice. The master weights, the shadow and the gradient
slots stay full size.
"""
from __future__ import annotations

import bisect
import numbers
import operator
import threading
import warnings
import weakref
from typing import Iterable, NamedTuple, Sequence

import torch

from . import _C

__all__ = ["HostStore", "LayoutEntry", "huge_page_bytes", "layout_of", "replica_shadow_dtype"]

_ALIGN_BYTES = 64
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SHADOW_DTYPES = (torch.bfloat16, torch.float16)
_MAX_WORKERS = 1 << 16  # gradient slots of one store
_warned_unpinned = False


class LayoutEntry(NamedTuple):
    """Where one parameter lives in the flat buffers: elements ``[offset, offset + numel)``, shaped ``shape``."""

    name: str
    shape: torch.Size
    offset: int
    numel: int


def overlaps_itself(t: torch.Tensor) -> bool:
    """A view in which elements share memory (an expanded tensor: a stride 0 over a dimension of size > 1): it
    cannot be written in place."""
    return any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape))


def check_no_partial_overlap(named_parameters, who: str | None = None) -> None:
    """ValueError naming two parameters (one of them trainable) that are different tensors over overlapping memory
    (views of one tensor: ``Parameter(base[:4])`` and ``Parameter(base[2:5])``). The store gives every parameter
    its own master weights, so the replicas no longer shared those elements and copy_to wrote both into them, the
    last write winning: the model ended up other than master_state_dict() without a word. A tied parameter (the
    same tensor twice) is one parameter and is fine. ``who`` (``HostStore.copy_to``): the tensors are written, so
    any two that overlap are refused, trainable or not, and the message starts with it."""
    spans = {}  # storage -> [(first byte, end byte, name, trainable)]
    for name, param in named_parameters:  # tied ones come once
        if param.is_meta or param.numel() == 0:
            continue
        extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(param.shape, param.stride()))
        first = param.storage_offset() * param.element_size()
        spans.setdefault(param.untyped_storage().data_ptr(), []).append(
            (first, first + extent * param.element_size(), name, param.requires_grad))
    for held in spans.values():  # one parameter per storage, nearly always
        for i, (a0, a1, a, a_trained) in enumerate(held):
            for b0, b1, b, b_trained in held[i + 1:]:
                if b0 < a1 and a0 < b1 and who is not None:
                    raise ValueError(f"{who}: parameters {a!r} and {b!r} overlap in memory (views of one tensor, "
                                     "or one tensor twice); the store holds their weights apart, so their shared "
                                     "elements would be written twice, the last write winning: copy into a model "
                                     "whose parameters are separate tensors, like the one the store was made from")
                if b0 < a1 and a0 < b1 and (a_trained or b_trained):
                    raise ValueError(f"parameters {a!r} and {b!r} overlap in memory (views of one tensor); the "
                                     "engine holds each parameter's weights apart, so their shared elements would "
                                     "train as two: make them separate tensors (p.data = p.data.clone()), or one "
                                     "parameter used twice")


def check_initialized(name: str, param: torch.Tensor, who: str) -> None:
    """A lazy module's parameter (``torch.nn.LazyLinear`` before its first forward) has no shape yet to size the
    store with: refused naming it (torch's own error named neither the parameter nor the fix)."""
    if torch.nn.parameter.is_lazy(param):
        raise ValueError(f"{who}: parameter {name!r} is uninitialized (a lazy module, torch.nn.LazyLinear say): run "
                         "one forward of the model on a sample batch first, so that its parameters have their shapes")


def _trainable(model_or_named_parameters) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, param) of the trainable parameters in registration order, each tensor once (shared ones by first name)."""
    if isinstance(model_or_named_parameters, torch.nn.Module):
        named: Iterable = model_or_named_parameters.named_parameters()
    else:
        named = model_or_named_parameters
    seen, names, out = set(), set(), []
    for item in named:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError("HostStore: expected an nn.Module or an iterable of (name, tensor) pairs; got an item of "
                            f"type {type(item).__name__}")
        name, param = item
        check_initialized(name, param, "HostStore")
        if not param.requires_grad or id(param) in seen:
            continue
        if name in names:
            raise ValueError(f"HostStore: two different parameters are both named {name!r}; names must be unique")
        names.add(name)
        if not param.is_floating_point():
            raise TypeError(f"HostStore: parameter {name!r} must be floating point; got {param.dtype}")
        if param.layout != torch.strided:
            raise ValueError(f"HostStore: parameter {name!r} must be a dense (strided) tensor; got {param.layout} "
                             "(the store holds dense weights; a sparse gradient is refused likewise)")
        seen.add(id(param))
        out.append((name, param))
    if not out:
        raise ValueError("HostStore: the model has no trainable parameters (requires_grad=True)")
    return out


def replica_shadow_dtype(model_or_named_parameters) -> torch.dtype | None:
    """The shadow a store of these parameters holds for the trip back to replicas like them (``HostStore(...,
    shadow_dtype="auto")``, as the Engine makes it): their dtype when every trainable parameter is bfloat16, or
    every one float16; None otherwise (float32 replicas, or mixed dtypes, which a 2-byte copy would round)."""
    dtypes = {param.dtype for _, param in _trainable(model_or_named_parameters)}
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    return dtype if dtype in _SHADOW_DTYPES else None


def _padded(numel: int, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in the smallest multiple of 64 bytes that holds ``numel`` of them."""
    unit = _ALIGN_BYTES // dtype.itemsize
    return -(-numel // unit) * unit


_HUGE_PAGE = 2 << 20


def section_stagger(sizes: Sequence[int]) -> int:
    """Note [Staggered sections]
    Bytes left after each flat buffer of the arena, given the buffers' sizes in bytes (64-byte multiples): 0 unless
    every buffer would start at the same offset within a 2 MiB huge page, else a multiple of 64 of at most 2 KiB and
    one page in all (the slack of the size bound: parameter bytes x buffers + 64 B per tensor + one page).

    The update streams 4 + G buffers side by side. Where all of them sit at the same offset within their huge pages
    (buffers of 4 x numel bytes, a multiple of 2 MiB: numel = 2**25 puts them 128 MiB apart) the fused update ran
    1.2-1.5x slower on this project's Zen 5 machines than with the starts a few hundred bytes apart. Where they do
    not (two offsets, 1 MiB apart, were enough), the same stagger made it ~5 % slower (bench/RESULTS.md,
    2026-11-25): hence only then."""
    offsets, at, streamed = set(), 0, 0
    for size in sizes:
        if size:  # an empty buffer streams nothing
            offsets.add(at % _HUGE_PAGE)
            streamed += 1
        at += size
    if streamed < 2 or len(offsets) > 1:
        return 0
    return min(2048, 4096 // max(len(sizes) - 1, 1) // _ALIGN_BYTES * _ALIGN_BYTES)


def layout_of(model_or_named_parameters, grad_dtype: torch.dtype = torch.float32,
              shadow_dtype: torch.dtype | None = None) -> tuple[list[LayoutEntry], int]:
    """The flat layout a :class:`HostStore` with these dtypes gives these parameters, without allocating it:
    ``(entries, numel)``. The same element offsets in every buffer, 64-byte aligned in the narrowest one (hence in
    all of them), parameters in reverse registration order."""
    narrow = [torch.float32, grad_dtype] + ([shadow_dtype] if shadow_dtype is not None else [])
    align = _ALIGN_BYTES // min(dtype.itemsize for dtype in narrow)
    layout, offset = [], 0
    for name, param in reversed(_trainable(model_or_named_parameters)):
        layout.append(LayoutEntry(name, param.shape, offset, param.numel()))
        offset += -(-param.numel() // align) * align
    return layout, offset


def huge_page_bytes(address: int) -> int:
    """Bytes of transparent huge pages (AnonHugePages in /proc/self/smaps) backing the mapping that holds
    ``address``: how much of an arena (``store.param.untyped_storage().data_ptr()``) is on 2 MiB pages. 0 where
    there are none, or no /proc (not Linux)."""
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _whole(value) -> int | None:
    """``value`` as an int when it is one (numpy's too, as the other indices take them; not a bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _whole_range(lo, hi, numel: int) -> tuple[int, int] | None:
    """``(lo, hi)`` as ints with ``0 <= lo <= hi <= numel``, else None."""
    lo, hi = _whole(lo), _whole(hi)
    return (lo, hi) if lo is not None and hi is not None and 0 <= lo <= hi <= numel else None


def _check_state_ranges(state_ranges, numel: int) -> tuple[tuple[int, int], ...]:
    """``state_ranges`` as a tuple of (lo, hi); ValueError unless 0 <= lo <= hi <= numel, increasing, disjoint."""
    try:
        ranges = [tuple(r) for r in state_ranges]
    except TypeError:
        raise ValueError(f"HostStore: state_ranges must be None or a sequence of (lo, hi) pairs; got "
                         f"{type(state_ranges).__name__}") from None
    previous = 0
    for i, r in enumerate(ranges):
        if len(r) != 2 or any(_whole(v) is None for v in r):
            raise ValueError(f"HostStore: state_ranges[{i}] must be a pair of ints (lo, hi); got {r!r}")
        lo, hi = r = ranges[i] = (_whole(r[0]), _whole(r[1]))
        if not 0 <= lo <= hi <= numel:
            raise ValueError(f"HostStore: state_ranges[{i}] = {r} must satisfy 0 <= lo <= hi <= numel = {numel}")
        if lo < previous:
            raise ValueError(f"HostStore: state_ranges must be increasing and disjoint; state_ranges[{i}] = {r} "
                             f"starts before the previous range ends ({previous})")
        previous = hi
    return tuple(ranges)


def _warn_unpinned_once(reason: str) -> None:
    global _warned_unpinned
    if not _warned_unpinned:
        _warned_unpinned = True
        warnings.warn(f"HostStore(pin='auto'): {reason}; the arena is pageable host memory", RuntimeWarning,
                      stacklevel=3)


def check_pin(pin, who: str = "HostStore") -> None:
    """ValueError unless ``pin`` is True, False or "auto"."""
    if not (isinstance(pin, bool) or (isinstance(pin, str) and pin == "auto")):
        raise ValueError(f"{who}: pin must be True, False or 'auto'; got {pin!r}")


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
            shipped back to the replicas (half the bytes of the fp32 master), or ``"auto"``: the parameters' dtype
            when all of them are bfloat16 or all float16, else None (:func:`replica_shadow_dtype`). Note [The shadow
            follows the master weights].
        amsgrad: also hold ``max_exp_avg_sq``.
        max_bytes: refuse to allocate an arena larger than this many bytes.
        state_ranges: None (the Adam state covers the whole layout) or increasing, disjoint ``(lo, hi)`` element
            ranges of the flat layout (empty ones allowed): the Adam state then holds these ranges only, packed
            (see :meth:`state_slice`). The sharded update's owned ranges (:mod:`pyengine.distributed`).

    Attributes: ``param``, ``shadow`` (or None): flat 1-D views of the arena, ``numel`` elements each; ``exp_avg``,
    ``exp_avg_sq``, ``max_exp_avg_sq`` (or None): flat 1-D views of ``state_numel`` elements (``numel`` unless
    ``state_ranges`` is given); ``layout``, ``names``, ``numel``, ``state_ranges``, ``state_numel``, ``nbytes``,
    ``pinned``, ``workers``, ``grad_dtype``.
    """

    def __init__(self, model_or_named_parameters, workers: int = 1, grad_dtype: torch.dtype = torch.float32,
                 pin="auto", shadow_dtype: torch.dtype | str | None = None, amsgrad: bool = False,
                 max_bytes: int | None = None, state_ranges: Sequence[tuple[int, int]] | None = None):
        if not isinstance(workers, numbers.Integral) or isinstance(workers, bool) or not 1 <= workers <= _MAX_WORKERS:
            # 2**40 slots of an empty model passed every size check and built a list of 2**40 sections: killed
            raise ValueError(f"HostStore: workers must be an int in [1, {_MAX_WORKERS}]; got {workers!r}")
        workers = int(workers)
        if grad_dtype not in _GRAD_DTYPES:
            raise ValueError(f"HostStore: grad_dtype must be one of {_GRAD_DTYPES}; got {grad_dtype}")
        if shadow_dtype is not None and shadow_dtype != "auto" and shadow_dtype not in _SHADOW_DTYPES:
            raise ValueError(f"HostStore: shadow_dtype must be None, 'auto' or one of {_SHADOW_DTYPES}; got "
                             f"{shadow_dtype!r}")
        check_pin(pin)
        if not isinstance(amsgrad, bool):  # "no" would have been truthy: a buffer more than asked
            raise TypeError(f"HostStore: amsgrad must be True or False; got {type(amsgrad).__name__} {amsgrad!r}")
        if max_bytes is not None and (not isinstance(max_bytes, numbers.Integral) or isinstance(max_bytes, bool)
                                      or max_bytes < 0):
            raise ValueError(f"HostStore: max_bytes must be None or an int >= 0 (bytes); got {max_bytes!r}")
        max_bytes = None if max_bytes is None else int(max_bytes)
        named = _trainable(model_or_named_parameters)
        check_no_partial_overlap(named)
        if isinstance(shadow_dtype, str):
            shadow_dtype = replica_shadow_dtype(named)
        self.workers = workers
        self.grad_dtype = grad_dtype
        self.layout, self.numel = layout_of(named, grad_dtype, shadow_dtype)
        self.names = [entry.name for entry in self.layout]
        self._index = {entry.name: entry for entry in self.layout}
        self._set_state_ranges(state_ranges)
        state = [("exp_avg", torch.float32), ("exp_avg_sq", torch.float32)]
        if amsgrad:
            state.append(("max_exp_avg_sq", torch.float32))
        sections = [(name, dtype, self.numel) for name, dtype in [("param", torch.float32)]]
        sections += [(name, dtype, self.state_numel) for name, dtype in state]
        if shadow_dtype is not None:
            sections.append(("shadow", shadow_dtype, self.numel))
        fixed = list(sections)

        def refuse_past_max_bytes(nbytes: int) -> None:
            if max_bytes is None or nbytes <= max_bytes:
                return
            state_note = "" if self.state_ranges is None else f", Adam state {self.state_numel} elements"
            raise ValueError(
                f"HostStore: the arena needs {nbytes} bytes ({nbytes / 2**20:.1f} MiB: {self.numel} elements"
                f"{state_note} x [{', '.join(f'{n} {d}' for n, d, _ in fixed)}, {workers} x grad {grad_dtype}]) but "
                f"max_bytes is {max_bytes}; lower workers, use a 2-byte grad_dtype, drop the shadow, shard the update, "
                "or raise max_bytes")

        # first without the staggers (at most one page in all), before a list of `workers` sections is made: a
        # store of a million gradient slots was refused after seconds, in a message of 25 MB
        refuse_past_max_bytes(sum(_padded(n, dtype) * dtype.itemsize for _, dtype, n in fixed)
                              + workers * _padded(self.numel, grad_dtype) * grad_dtype.itemsize)
        sections += [(f"grad{g}", grad_dtype, self.numel) for g in range(workers)]
        sizes = [_padded(n, dtype) * dtype.itemsize for _, dtype, n in sections]
        stagger = section_stagger(sizes)  # Note [Staggered sections]
        self.nbytes = sum(sizes) + stagger * (len(sections) - 1)
        refuse_past_max_bytes(self.nbytes)
        self._arena, self.pinned = self._allocate(pin)
        views, byte_offset = {}, 0
        for name, dtype, n in sections:  # every section starts on a 64-byte boundary, `stagger` after the last
            views[name] = self._arena[byte_offset:byte_offset + n * dtype.itemsize].view(dtype)
            byte_offset += _padded(n, dtype) * dtype.itemsize + stagger
        self.param, self.exp_avg, self.exp_avg_sq = views["param"], views["exp_avg"], views["exp_avg_sq"]
        self.max_exp_avg_sq = views.get("max_exp_avg_sq")
        self.shadow = views.get("shadow")
        self._grad_slots = [views[f"grad{g}"] for g in range(workers)]
        self._slot_owners: dict[int, weakref.ref] = {}  # worker -> its GradientStreamer (Note [One writer a slot])
        self._slot_lock = threading.Lock()
        self._load_from(named, None)

    def _set_state_ranges(self, state_ranges) -> None:
        if state_ranges is None:
            self.state_ranges, self.state_numel = None, self.numel
            return
        self.state_ranges = _check_state_ranges(state_ranges, self.numel)
        self._range_lo = [lo for lo, _ in self.state_ranges]
        self._range_at, at = [], 0  # packed offset of each range
        for lo, hi in self.state_ranges:
            self._range_at.append(at)
            at += hi - lo
        self.state_numel = at

    def state_slice(self, lo: int, hi: int) -> slice:
        """The slice of the Adam state buffers (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) that holds flat
        elements ``[lo, hi)``: ``store.exp_avg[store.state_slice(lo, hi)]``. With full state it is ``slice(lo, hi)``;
        with ``state_ranges`` the range must lie inside one of them (IndexError otherwise)."""
        checked = _whole_range(lo, hi, self.numel)
        if checked is None:
            raise IndexError(f"HostStore.state_slice: expected ints 0 <= lo <= hi <= {self.numel}; got ({lo!r}, "
                             f"{hi!r})")
        lo, hi = checked
        if self.state_ranges is None:
            return slice(lo, hi)
        i = bisect.bisect_right(self._range_lo, lo) - 1
        if i < 0 or hi > self.state_ranges[i][1]:
            raise IndexError(f"HostStore.state_slice: elements [{lo}, {hi}) are not inside one of the held state "
                             f"ranges {_summary(self.state_ranges)}")
        start = self._range_at[i] + lo - self.state_ranges[i][0]
        return slice(start, start + hi - lo)

    @torch.no_grad()
    def load_state_from_full(self, packed: torch.Tensor, full: torch.Tensor) -> None:
        """Copies the held ranges of ``full`` (a flat Adam state buffer of ``numel`` elements) into ``packed`` (one
        of this store's state buffers)."""
        if full.dim() != 1 or full.numel() != self.numel:
            raise ValueError(f"HostStore.load_state_from_full: full must be a 1-D tensor of {self.numel} elements; "
                             f"got shape {tuple(full.shape)}")
        if packed.dim() != 1 or packed.numel() != self.state_numel:
            raise ValueError(f"HostStore.load_state_from_full: packed must be a 1-D tensor of {self.state_numel} "
                             f"elements; got shape {tuple(packed.shape)}")
        for lo, hi in self.state_ranges if self.state_ranges is not None else [(0, self.numel)]:
            packed[self.state_slice(lo, hi)] = full[lo:hi]

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
        return self._grad_slots[self._check_worker(worker, "grad_slot")]

    def _check_worker(self, worker, what: str) -> int:
        try:
            index = None if isinstance(worker, bool) else operator.index(worker)  # an int, or numpy's
        except TypeError:
            index = None
        if index is None or not 0 <= index < self.workers:
            raise IndexError(f"HostStore.{what}: worker must be an int in [0, {self.workers}); got "
                             f"{type(worker).__name__} {worker!r}")
        return index

    def claim_slot(self, worker: int, owner) -> None:
        """Note [One writer a slot]
        A GradientStreamer writes its worker's slot from its hooks and copy thread: two of them on one slot (the
        same ``worker=`` given twice) would write it at once, the update reading a mix of two replicas' gradients
        with no error. Each streamer claims its slot when it is made and gives it back on ``close()`` (or when it
        is collected: the store holds it weakly); a second claim while the first owner lives is a RuntimeError."""
        worker = self._check_worker(worker, "claim_slot")
        with self._slot_lock:
            holder = self._slot_owners.get(worker)
            holder = holder() if holder is not None else None
            if holder is not None and holder is not owner:
                raise RuntimeError(f"HostStore: worker {worker}'s gradient slot is already written by {holder!r}; "
                                   "two streamers on one slot would mix their gradients: close() that one first, "
                                   "or give this one another worker")
            self._slot_owners[worker] = weakref.ref(owner)

    def release_slot(self, worker: int, owner) -> None:
        """Gives back ``worker``'s slot if ``owner`` holds it (Note [One writer a slot])."""
        with self._slot_lock:
            holder = self._slot_owners.get(worker)
            if holder is not None and holder() in (owner, None):
                del self._slot_owners[worker]

    def entry(self, name: str) -> LayoutEntry:
        """The layout entry of parameter ``name``."""
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"HostStore: no trainable parameter named {name!r}") from None

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """name -> view of ``flat`` (one of the store's flat buffers, or any 1-D tensor of ``numel`` elements) shaped
        like the parameter. Views, not copies: writing them writes ``flat``."""
        if not isinstance(flat, torch.Tensor):
            raise TypeError(f"HostStore.views: expected a 1-D tensor of {self.numel} elements; got "
                            f"{type(flat).__name__}")
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise ValueError(f"HostStore.views: expected a 1-D tensor of {self.numel} elements; got shape "
                             f"{tuple(flat.shape)}")
        return {e.name: flat[e.offset:e.offset + e.numel].view(e.shape) for e in self.layout}

    def _named(self, model_or_named_parameters, what: str | None) -> dict[str, torch.Tensor]:
        """name -> parameter of the model, checked against the layout before anything is copied (a failure half
        way left some weights written, and the shadow behind them). ``what``: the method, for the messages (None:
        the constructor's own load)."""
        who = "HostStore" if what is None else f"HostStore.{what}"
        module = model_or_named_parameters if isinstance(model_or_named_parameters, torch.nn.Module) else None
        pairs = model_or_named_parameters.named_parameters() if module is not None else model_or_named_parameters
        named: dict[str, torch.Tensor] = {}
        for item in pairs:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                raise TypeError(f"{who}: expected an nn.Module or an iterable of (name, tensor) pairs; "
                                f"got an item of type {type(item).__name__}")
            name, param = item
            if name in named and named[name] is not param:
                raise ValueError(f"{who}: two different parameters are both named {name!r}")
            named[name] = param
        missing = [name for name in self.names if name not in named]
        if missing:
            tied = {} if module is None else dict(module.named_parameters(remove_duplicate=False))
            if all(name in tied for name in missing):  # named_parameters() names a tied tensor once
                first = {id(p): n for n, p in named.items()}
                ties = ", ".join(f"{name!r} (tied to {first.get(id(tied[name]), '?')!r})" for name in missing[:5])
                raise ValueError(f"{who}: the model ties parameters the store holds apart: {ties}; the store "
                                 "holds those of the model it was made from (tie or untie them alike)")
            raise KeyError(f"{who}: the model has no parameter named {missing[:5]} (of {len(missing)})")
        held = {id(named[name]) for name in self.names}  # a tied parameter may come under its other names too
        unheld = [name for name, param in named.items() if param.requires_grad and id(param) not in held]
        if unheld:
            raise ValueError(f"{who}: the model has trainable parameters the store does not hold: "
                             f"{unheld[:5]} (of {len(unheld)}); the store holds those of the model it was made from")
        for entry in self.layout:
            param = named[entry.name]
            if param.shape != entry.shape:
                raise ValueError(f"{who}: parameter {entry.name!r} has shape "
                                 f"{tuple(param.shape)}; the store holds {tuple(entry.shape)}")
            if param.is_meta or not param.is_floating_point() or param.layout != torch.strided:
                kind = ("a meta tensor (no storage)" if param.is_meta else f"{param.dtype}, not floating point"
                        if not param.is_floating_point() else f"{param.layout}, not a dense (strided) tensor")
                raise ValueError(f"{who}: parameter {entry.name!r} is {kind}")
            if what == "copy_to" and param.is_inference() and not torch.is_inference_mode_enabled():
                raise ValueError(f"{who}: parameter {entry.name!r} is an inference tensor (made under "
                                 "torch.inference_mode), which cannot be written in place outside it; copy into "
                                 "a model made outside inference mode")
            if what == "copy_to" and overlaps_itself(param):  # copy_ raised after the parameters before it
                raise ValueError(f"{who}: parameter {entry.name!r} is an expanded view (a stride 0: its elements "
                                 "share memory), which cannot be written in place; make it a whole tensor "
                                 "(p.data = p.data.clone())")
        if what == "copy_to":  # two views of one tensor were written twice, the last write winning
            check_no_partial_overlap([(name, named[name]) for name in self.names], who)
        return named

    @torch.no_grad()
    def load_from(self, model_or_named_parameters) -> None:
        """Copy the model's parameters (by name) into the fp32 master weights (and the shadow)."""
        self._load_from(model_or_named_parameters, "load_from")

    @torch.no_grad()
    def _load_from(self, model_or_named_parameters, what: str | None) -> None:
        named = self._named(model_or_named_parameters, what)
        for name, view in self.views(self.param).items():
            view.copy_(named[name].detach())
        self.refresh_shadow()

    @torch.no_grad()
    def refresh_shadow(self, lo: int = 0, hi: int | None = None) -> None:
        """Note [The shadow follows the master weights]
        The shadow (when the store has one) is what replicas pull: the Engine's workers and pipeline stages copy
        it, not ``param``, so it must hold ``param`` rounded to its dtype whenever a pull may start. The update
        writes both in one pass (``param_out``); every other writer of ``param`` calls this after writing elements
        ``[lo, hi)`` (default: all): :meth:`load_from`, ``Engine.load_state_dict``, and in
        :mod:`pyengine.distributed` and :mod:`pyengine.pipeline_distributed` the broadcasts of rank 0's weights,
        the sharded update's and the pipeline's gathers (an async client receives the shadow itself: Note [An async
        pull sends the replicas' dtype]). A writer that forgets leaves the replicas on the old weights with nothing
        to show for it but the loss: the tests pull after each such write and compare the replicas with the master
        weights rounded. No-op without a shadow."""
        hi = self.numel if hi is None else hi
        checked = _whole_range(lo, hi, self.numel)
        if checked is None:
            raise IndexError(f"HostStore.refresh_shadow: expected ints 0 <= lo <= hi <= {self.numel}; got ({lo!r}, "
                             f"{hi!r})")  # checked without a shadow too: a caller's bad range shows on every store
        lo, hi = checked
        if self.shadow is None:
            return
        self.shadow[lo:hi].copy_(self.param[lo:hi])

    @torch.no_grad()
    def copy_to(self, model_or_named_parameters) -> None:
        """Copy the fp32 master weights into the model's parameters (by name, converted to their dtype/device)."""
        named = self._named(model_or_named_parameters, "copy_to")
        for name, view in self.views(self.param).items():
            named[name].copy_(view)

    def __repr__(self) -> str:
        state = "" if self.state_ranges is None else f", state_numel={self.state_numel}"
        return (f"HostStore({len(self.layout)} params, numel={self.numel}{state}, workers={self.workers}, "
                f"grad_dtype={self.grad_dtype}, nbytes={self.nbytes}, pinned={self.pinned})")


def _summary(ranges) -> str:
    """The first few ranges, for error messages."""
    shown = ", ".join(f"[{lo}, {hi})" for lo, hi in ranges[:4])
    return f"{shown}, ... ({len(ranges)} ranges)" if len(ranges) > 4 else f"{shown or 'none'}"
