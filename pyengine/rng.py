"""Random numbers of workers that run at the same time: one generator per worker, so runs are reproducible.

Note [Random numbers of concurrent workers]
torch has one default generator per device, shared by every thread. Workers that compute at the same time (hybrid
and async with G > 1, pipeline stages in threads, every worker of a process group) would draw their dropout masks
from it in an order set by thread timing, and two runs with the same seed would differ. So each such worker owns a
``torch.Generator`` on its device, and the modules of its replica that draw random numbers (:data:`RANDOM_MODULES`:
the dropout family, RReLU, MultiheadAttention, and the classes given as ``Engine(random_modules=...)``) run with the
device's default generator swapped for the worker's: under one process-wide lock, the default generator's state is
saved, the worker's put in, the module's forward run, and the states swapped back. The lock is held for those
modules' forwards only (a dropout is a small op next to the matmuls around it; a MultiheadAttention with dropout > 0
is serialised across workers whole, its price); a module in eval mode or with p = 0 draws nothing and takes no lock.
CUDA kernels take their random offsets from the generator when they are launched, on the host, so the swap orders
them as well. A random module inside another runs on the state already swapped in.

The worker's generator is seeded afresh at the start of every step (or async push) from (seed, global worker index,
step), the global index counting the workers of a process group's lower ranks first (:meth:`Engine.worker_rng`;
ranks may have different numbers of workers, and no two workers of the group share an index): the draws are a pure
function of those, so a run resumed from a checkpoint draws what the uninterrupted run drew with no generator state
saved, whatever devices or how many workers it resumes on, on every rank of a process group alike.

An activation checkpoint (``torch.utils.checkpoint``) recomputes its region's forward during backward and restores
torch's default generator first so that the recomputed masks equal the forward's; a routed module would instead
draw the worker's generator's next numbers. So the worker's generator is restored the same way, at the same moments:
the checkpoint reads the CPU generator's state (``torch.get_rng_state``) when its region's forward starts and sets
that very tensor back (``torch.set_rng_state``) before the recomputation. A state tensor read in a forward gets a
mark (:class:`_Mark`, kept beside the tensor, not in it), which the next routed forward on that thread settles with
its worker's generator state: the state the region's draws start from, since only routed forwards move that
generator. Setting a settled mark inside a backward makes the thread's routed forwards of that worker replay from
its state, one after another as the region's forward drew, until the next ``set_rng_state`` (the checkpoint's own
restore when the recomputation ends). So a layer called outside and inside a region, in several regions, or once per
micro-batch recomputes each call's own masks. A checkpoint nested in a region reads its state during the outer
recomputation, inside the backward: that mark is settled at once, with the state the replay has reached. Where no
mark applies (``preserve_rng_state=False``, a checkpoint inside a routed module's forward), a recomputation replays
the oldest recorded state of that module in this step: right for a module called once per micro-batch (in a GPipe
stage, M forwards then M backwards in micro-batch order), not for one called in several such regions.

Note [Checkpoints beside concurrent workers]
``torch.utils.checkpoint`` (with ``preserve_rng_state=True``, its default) reads torch's generator states at the
forward and, around each recomputation, saves them, sets the forward's and restores the saved ones, through
``torch.get_rng_state``/``set_rng_state`` (``torch.cuda``'s for a device), without any lock of ours. A worker's
recomputation that did so while another worker's random module had its own state swapped in changed the numbers
that module was drawing (and the state saved back into its generator): measured, 5 % of the recomputed dropout
masks of 2 x 2 pipeline stages differed from their forwards', so the gradients were not those of the loss, and runs
with one seed differed. So once a process has a WorkerRNG, those four functions take the swap's lock when called
inside a backward pass, where the recomputations run (:func:`_guard_generator_functions`; a reentrant lock, since a
routed module's forward may call them): a recomputation's generator work then falls between two routed forwards,
never inside one. Outside a backward they take no lock: a routed forward holds the lock while it runs the module's
code, and a thread compiling with torch.compile (which reads the generators' states) while that code waited for the
compiler deadlocked the two. A forked child gets a lock of its own (one held by a thread of the parent at the fork
would never be released there).

What stays on the shared generator: random numbers drawn outside routed modules (``torch.rand`` or ``F.dropout``
called in a ``forward`` or a ``loss_fn``). With concurrent workers such a draw can land while another worker's state
is swapped in, so it takes numbers from that worker's stream too: a model with unrouted randomness is not
reproducible with concurrent workers; list the module classes that draw in ``random_modules``. A lone worker (G = 1,
no process group) and sync mode (one worker at a time) draw from torch's default generator, as single-device
training with the same seed does.
"""
from __future__ import annotations

import collections
import functools
import operator
import os
import threading
import weakref

import torch
import torch.utils.weak

__all__ = ["RANDOM_MODULES", "WorkerRNG", "worker_seed"]

_DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
             torch.nn.FeatureAlphaDropout)
# Module classes whose forward draws random numbers in training; each is routed when it would draw.
RANDOM_MODULES = (*_DROPOUTS, torch.nn.RReLU, torch.nn.MultiheadAttention)

_SWAP = threading.RLock()  # Note [Random numbers of concurrent workers]; reentrant: Note [Checkpoints beside ...]
_ACTIVE = threading.local()  # .rng: the WorkerRNG whose state is swapped in on this thread, if any
# .pending: weak references to the marks read on this thread that no routed forward has settled yet; .replay: while a
# checkpoint recomputes on this thread, [WorkerRNG, the state its next routed forward starts from] (Note [Random ...])
_MARKS = torch.utils.weak.WeakIdKeyDictionary()  # a state tensor read by torch.get_rng_state -> its _Mark
_MARKS_LOCK = threading.Lock()


def _index(value, name: str, least: int, below: int | None) -> int:
    """``value`` as an int (numpy's too) in [least, below), or a ValueError naming ``name``."""
    try:
        index = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        index = None
    if index is None or index < least or (below is not None and index >= below):
        bound = f"in [{least}, {below})" if below is not None else f">= {least}"
        raise ValueError(f"worker_seed: {name} must be an int {bound}; got {value!r}")
    return index


def worker_seed(seed: int, worker: int, step: int) -> int:
    """The seed of worker ``worker``'s generator at step ``step``: a pure function of the three, distinct per worker
    and per step (a 64-bit mix, so that nearby seeds, workers and steps give unrelated streams). ``seed``: an int
    in [-2**63, 2**64) (torch.manual_seed's range: 2**64 mixed like 0); ``worker``, ``step``: ints >= 0."""
    seed, worker, step = (_index(value, name, least, below) for value, name, least, below in (
        (seed, "seed", -2**63, 2**64), (worker, "worker", 0, None), (step, "step", 0, None)))
    x = (seed * 0x9E3779B97F4A7C15 + worker * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB) % 2**64
    return splitmix64(x) % 2**63


def splitmix64(x: int) -> int:
    """splitmix64's finaliser of ``x`` modulo 2**64: every output bit depends on every input bit."""
    x %= 2**64
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * mult) % 2**64
    return x ^ (x >> 31)


def cpu_generator_seed(seed: int, value: int | None = None) -> int:
    """What to give torch's CPU generator for ``seed`` (``value``: a number derived from it, default the seed itself).
    The generator (mt19937) keeps the low 32 bits of its seed only, so seeds that differ above bit 32 (5 and
    5 + 2**32) drew the same numbers: a seed in [0, 2**32) gives ``value`` as it always did, a larger one (or a
    negative one) ``value`` mixed so that its high bits count."""
    value = seed if value is None else value
    return value if 0 <= seed < 2**32 else splitmix64(value) % 2**32


def _swap_lock_of_the_child() -> None:
    """A forked child's own swap and marks locks (Note [Checkpoints beside concurrent workers])."""
    global _SWAP, _MARKS_LOCK
    _SWAP, _MARKS_LOCK = threading.RLock(), threading.Lock()


os.register_at_fork(after_in_child=_swap_lock_of_the_child)

_GENERATOR_FUNCTIONS = ((torch, "get_rng_state"), (torch, "set_rng_state"), (torch.random, "get_rng_state"),
                        (torch.random, "set_rng_state"), (torch.cuda, "get_rng_state"), (torch.cuda, "set_rng_state"),
                        (torch.cuda.random, "get_rng_state"), (torch.cuda.random, "set_rng_state"))


def _guard_generator_functions() -> None:
    """Note [Checkpoints beside concurrent workers]: torch's functions that read or set the default generators' states
    (as ``torch.utils.checkpoint`` and ``torch.random.fork_rng`` call them) take :data:`_SWAP`, once per process;
    each does what it did, and the CPU generator's pair also marks and replays (Note [Random numbers of concurrent
    workers])."""
    with _SWAP:
        wrapped = {}
        for module, name in _GENERATOR_FUNCTIONS:
            function = getattr(module, name)
            if getattr(function, "_pyengine_guarded", False):
                continue
            if function not in wrapped:
                role = (module in (torch, torch.random)) and name[:3]  # "get"/"set" for the CPU generator
                wrapped[function] = _guarded(function, role or None)
            setattr(module, name, wrapped[function])


class _Mark:
    """Where a forward read the CPU generator's state: ``rng``/``state`` are the worker's generator and its state at
    the next routed forward on that thread (None until then). :data:`_MARKS` holds it as long as the state tensor
    lives (as long as the checkpoint that keeps the tensor to restore)."""
    __slots__ = ("rng", "state", "__weakref__")

    def __init__(self):
        self.rng = self.state = None


def _mark(state: torch.Tensor, settled: list | None = None) -> None:
    """Marks a state tensor read outside any backward, unless inside a routed forward (whose draws are on torch's own
    generator then, which torch restores itself); the thread's next routed forward settles the mark. ``settled``:
    the thread's replay ([WorkerRNG, state]) when read inside a recomputation (a checkpoint nested in the region
    recomputed): settled at once, with the state the recomputation's next draw starts from."""
    if getattr(_ACTIVE, "rng", None) is not None:
        return
    mark = _Mark()
    with _MARKS_LOCK:
        _MARKS[state] = mark
    if settled is not None:
        mark.rng, mark.state = settled
        return
    pending = _ACTIVE.__dict__.setdefault("pending", [])
    if len(pending) >= 64:  # a thread that reads states and runs no routed forward keeps only the live marks
        pending[:] = [ref for ref in pending if ref() is not None]
    pending.append(weakref.ref(mark))


def _settle(rng: "WorkerRNG", state: torch.Tensor) -> None:
    """Settles the thread's pending marks with ``rng`` and the state its forward starts from."""
    pending = getattr(_ACTIVE, "pending", None)
    while pending:
        mark = pending.pop()()
        if mark is not None:
            mark.rng, mark.state = rng, state


def _guarded(function, role: str | None):
    @functools.wraps(function)
    def guarded(*args, **kwargs):
        if torch._C._current_graph_task_id() == -1:  # not inside a backward: no recomputation (Note [Checkpoints ...])
            result = function(*args, **kwargs)
            if role == "get":
                _mark(result)
            return result
        with _SWAP:
            result = function(*args, **kwargs)
        if role == "get" and getattr(_ACTIVE, "replay", None) is not None:  # a checkpoint inside a recomputation
            _mark(result, settled=_ACTIVE.replay)
        if role == "set":  # a settled mark starts a replay on this thread; any other state ends one
            state = args[0] if args else kwargs.get("new_state")
            with _MARKS_LOCK:
                mark = _MARKS.get(state) if isinstance(state, torch.Tensor) else None
            _ACTIVE.replay = [mark.rng, mark.state] if mark is not None and mark.rng is not None else None
        return result

    guarded._pyengine_guarded = True
    return guarded


def _draws(module: torch.nn.Module) -> bool:
    """Whether ``module``'s next forward draws random numbers (a known random module with nothing to draw does not)."""
    if not module.training:
        return False
    if isinstance(module, _DROPOUTS):
        return module.p > 0
    if isinstance(module, torch.nn.MultiheadAttention):
        return module.dropout > 0
    return True


class _Routed:
    """A module's ``forward`` attribute while routed: the class's forward through :meth:`WorkerRNG.run`. It holds the
    module weakly (a strong reference would make every routed module a reference cycle, freed only by the garbage
    collector, and a dropped engine's replicas with it). A copy of the module (``copy.deepcopy``, pickling) is not
    routed: it gets an :class:`_Unrouted` forward. Copied as it was, its forward ran the original module (the weak
    reference is copied as it is) on a copy of the original's generator: an eval-mode copy still dropped, and the
    replicas of an engine built from another engine's replica trained the original's weights."""

    def __init__(self, rng: "WorkerRNG", module: torch.nn.Module):
        own = module.__dict__.get("forward")  # a forward set on the instance (rare) is kept, strongly
        if isinstance(own, (_Routed, _Unrouted)):  # routed by another generator, or a copy of a routed module
            own = own.own
        self.rng, self.module, self.own = rng, weakref.ref(module), own
        self.forward = type(module).forward if own is None else (lambda _, *args, **kwargs: own(*args, **kwargs))

    def __call__(self, *args, **kwargs):
        module = self.module()
        if not _draws(module):
            return self.forward(module, *args, **kwargs)
        return self.rng.run(module, self.forward, *args, **kwargs)

    def __reduce__(self):  # copy.deepcopy and pickle: the copy's module, memoized before its attributes
        return _Unrouted, (self.module(), self.own)


class _Unrouted:
    """The ``forward`` attribute of a copy of a routed module: the module's own forward, as before it was routed
    (its module held weakly, as :class:`_Routed` holds it)."""

    def __init__(self, module: torch.nn.Module, own=None):
        self.module, self.own = weakref.ref(module), own

    def __call__(self, *args, **kwargs):
        if self.own is not None:
            return self.own(*args, **kwargs)
        module = self.module()
        return type(module).forward(module, *args, **kwargs)

    def __reduce__(self):
        return _Unrouted, (self.module(), self.own)


class WorkerRNG:
    """The generator of one concurrent worker on ``device``; :meth:`begin_step` seeds it for a step. Every routed
    forward keeps the state it started from (~5 KB on the CPU) until the next :meth:`begin_step`, for a
    recomputation that finds no mark: used outside an Engine, call it once per step."""

    def __init__(self, device: torch.device, seed: int, worker: int):
        _guard_generator_functions()  # Note [Checkpoints beside concurrent workers]
        self.device = torch.device(device)
        self.seed, self.worker = seed, worker
        self.generator = torch.Generator(self.device)
        self._replay: dict[int, collections.deque] = {}  # id(module) -> states its forwards started from
        self.begin_step(0)

    def begin_step(self, step: int) -> None:
        """Seeds the generator for step ``step`` (hybrid, sync, pipeline: the step count; async: a push's key) and
        forgets the previous step's recorded states."""
        self.generator.manual_seed(worker_seed(self.seed, self.worker, step))
        self._replay.clear()

    def _default(self) -> torch.Generator:
        if self.device.type == "cuda":
            return torch.cuda.default_generators[self.device.index]
        return torch.default_generator

    def run(self, module: torch.nn.Module, forward, *args, **kwargs):
        """``forward(module, *args, **kwargs)`` drawing from this worker's generator instead of the device's default
        (a recomputation inside backward replays the state the module's forward started from)."""
        if getattr(_ACTIVE, "rng", None) is self:  # inside another of this worker's random modules: swapped in
            return forward(module, *args, **kwargs)
        recompute = torch._C._current_graph_task_id() != -1
        replay = getattr(_ACTIVE, "replay", None) if recompute else None
        replay = replay if replay is not None and replay[0] is self else None
        records = self._replay.setdefault(id(module), collections.deque())
        if recompute and replay is None and not records:
            raise RuntimeError(f"{type(module).__name__} ran inside backward with no forward of this step to replay "
                               "(Note [Random numbers of concurrent workers] in pyengine/rng.py)")
        default = self._default()
        with _SWAP:
            saved = default.get_state()
            if replay is not None:  # a checkpoint's recomputation, from the state its region's forward started at
                default.set_state(replay[1])
            elif recompute:
                default.set_state(records.popleft())
            else:
                records.append(self.generator.get_state())
                _settle(self, records[-1])
                default.set_state(records[-1])
            _ACTIVE.rng = self
            try:
                return forward(module, *args, **kwargs)
            finally:
                _ACTIVE.rng = None
                if replay is not None:
                    replay[1] = default.get_state()
                elif not recompute:
                    self.generator.set_state(default.get_state())
                default.set_state(saved)

    def install(self, model: torch.nn.Module, classes=()) -> int:
        """Routes the random modules of ``model`` (:data:`RANDOM_MODULES` and ``classes``) through :meth:`run`;
        returns how many. ``model`` must be this worker's own replica; a module is routed once by this generator (one
        routed by another is routed to this one). ``classes``: a tuple or list of ``nn.Module`` subclasses, checked
        before any module is routed."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"WorkerRNG.install: model must be an nn.Module; got {type(model).__name__}")
        if not isinstance(classes, (tuple, list)) or not all(
                isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes):
            raise TypeError(f"WorkerRNG.install: classes must be a tuple of nn.Module subclasses; got {classes!r}")
        count = 0
        for module in model.modules():
            routed = module.__dict__.get("forward")
            if isinstance(module, (*RANDOM_MODULES, *classes)) and not (isinstance(routed, _Routed)
                                                                        and routed.rng is self):
                module.forward = _Routed(self, module)  # routed by another generator before: this one now
                count += 1
        return count
