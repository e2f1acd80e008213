"""Async schedule (Zhang et al., ICASSP 2013): every worker loops on its own — pull a snapshot of the weights under
the store's mutex, compute on its next mini-batch(es), push — and the host applies every push at once, under the
mutex, with the fused kernel at G = 1.

Note [Async pushes and staleness]
``engine.mutex`` guards the master weights, the Adam state and ``engine.version``: a pull (store -> replica) and a
push (fused update from the worker's slot) each hold it for their whole duration, so a replica never sees a
half-applied update and every push is applied exactly once, in the order the mutex grants. A worker's slot is
written only by its own streamer, outside the mutex, while the worker computes: no other thread reads it then.
Staleness of a push = version at apply - version at pull. With ``max_staleness=s`` a push older than s refreshes
(pull again, recompute the same mini-batches) instead of applying; ``staleness_lr="inverse"`` scales lr by
1 / (1 + staleness). ``batch_schedule`` is asked, under the mutex, about the version the worker pulls when it takes
new mini-batches: the mini-batches of a push follow the weights it first computed them on (a refresh recomputes
the same mini-batches on newer weights, whatever the schedule says of those).

Note [Reading the state while async workers run]
The readers of the engine's state (``state_dict``, ``master_state_dict``, ``optimizer_state_dict``, ``stats``) and
``load_state_dict`` hold the same (re-entrant) mutex, so a state taken from any thread during a fit lies between two
pushes: its weights, Adam state, version and counters agree, and it loads. The buffers (BatchNorm statistics) come
from the source replica (worker ``engine.buffer_source``), whose forward runs outside the mutex: while it computes,
readers get the copy taken when it pulled, i.e. its buffers as of its last push. That copy also puts them back when
its push is not applied (a refresh recomputes the same mini-batches: counted once; a stop discards the push; the
worker fails: Note [A failed step leaves the buffers alone] in engine.py).

``close()`` or ``engine.stop()`` from another thread during a fit: the push being applied completes (both take or
check under the mutex) and none is applied after; close() then waits for the workers, whose computations in flight
are discarded. ``load_state_dict`` is refused during an async fit: the workers compute on the weights they pulled.
"""
from __future__ import annotations

import numbers
import threading
import time

from .metrics import step_metrics
from .workers import WorkerError, batch_size, deferred_interrupt, set_worker_threads


class _BatchSource:
    """Thread-safe source of mini-batches: ``epochs`` passes over ``batches`` (None: until the steps are done).

    An epoch that yields nothing (an empty or exhausted one-shot iterable) ends the source. ``pushes``: how many
    takes it serves at most (fit's ``steps``; None: no limit). Each take feeds one push (a refresh computes the same
    mini-batches again), so no batch is taken that no push of this fit would use: with G workers, the G - 1 that
    would take one past the last push find none and end, and a generator keeps those batches for a later fit.
    """

    def __init__(self, batches, epochs, pushes=None):
        self._batches, self._epochs, self._pushes = batches, epochs, pushes
        self._epoch, self._it = 0, iter(batches)
        self._fresh, self._done = True, False
        self._lock = threading.Lock()
        self.taken = 0  # mini-batches handed out

    def take(self, k: int) -> tuple[list[int], list]:
        """Up to ``k`` mini-batches (fewer or none once the source ends) and their ordinals: the places they had in
        the order this source handed mini-batches out (0, 1, ...; consecutive, as they are taken under a lock)."""
        out = []
        with self._lock:
            first = self.taken
            if self._pushes is not None:
                if self._pushes <= 0:
                    return [], []
                self._pushes -= 1
            while len(out) < k and not self._done:
                try:
                    out.append(next(self._it))
                    self.taken += 1
                    self._fresh = False
                except StopIteration:
                    self._epoch += 1
                    if self._fresh or (self._epochs is not None and self._epoch >= self._epochs):
                        self._done = True
                    else:
                        try:
                            self._it, self._fresh = iter(self._batches), True
                        except BaseException as exc:  # noqa: BLE001 - a new epoch's iter() failed: the iterable's own
                            # error too (SystemExit, KeyboardInterrupt as well: raised by fit as themselves)
                            self._done = True
                            raise _AsItself(exc) from exc
                except BaseException as exc:  # noqa: BLE001 - the iterable's own error: fit raises it as itself
                    self._done = True
                    raise _AsItself(exc) from exc
        return list(range(first, first + len(out))), out


class _AsItself(Exception):
    """An error that is not the worker's (a callback's, or the ``batches`` iterable's), carried out of a worker's
    loop so that fit raises it as itself, as sync and hybrid do."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _closed_during_fit() -> RuntimeError:
    return RuntimeError("this Engine was closed while fit() was running (every push before it is applied; the "
                        "computations in flight are discarded); to end fit and keep the engine, call engine.stop()")


def minibatches_per_push(engine, version: int) -> int:
    """``accumulate``, or ``batch_schedule(version)`` checked: an int >= 1 (not rounded from anything else)."""
    if engine.batch_schedule is None:
        return engine.accumulate
    k = engine.batch_schedule(version)
    if not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 1:  # numpy's integers are ints too
        raise ValueError(f"batch_schedule({version}) must return the number of mini-batches of the next push, an "
                         f"int >= 1; got {k!r}")
    return int(k)


class AsyncRun:
    """The async fit running now, as ``engine._async_run``: its stop flag, an event set once its workers have all
    ended, the threads that run its workers now (``close()`` from one of them, a callback, must not wait for them;
    from the caller's thread, a signal handler's, it waits for the worker threads' own events: ``finished`` is
    set on that thread after its handler returns), and the source replica's buffers as of its last push while it
    computes (None otherwise)."""

    def __init__(self):
        self.stop = threading.Event()
        self.finished = threading.Event()
        self.caller = threading.get_ident()  # the thread that called fit (Engine.close: a signal handler's)
        self.threads: set[int] = set()  # the caller's too while a lone CPU worker runs on it
        self.workers_done: list[tuple[threading.Thread, threading.Event]] = []  # each worker thread and the event
        # it sets as its last act
        self.buffers: list | None = None
        # a lone worker's torch generators as of its pull, while it computes (Note [A failed step leaves the
        # generators alone], engine.py): put back when its push is not applied, read by state readers meanwhile
        self.generators: tuple | None = None
        self.running: list[threading.Event] = []  # workers' done events, when fit raised with workers left running


def run_async(engine, batches, *, steps, epochs, callbacks) -> None:
    run = AsyncRun()
    with engine.mutex:
        engine._check_open()
        engine._async_run = run
    try:
        _run_async(engine, run, batches, steps=steps, epochs=epochs, callbacks=callbacks)
    finally:
        if run.running:  # left by a second Ctrl-C: the run ends when they do, and close() waits for that
            run.threads.discard(threading.get_ident())  # this thread leaves fit now: no callback of it any more
            # not a daemon, as the workers (Note [Async threads are not daemons])
            threading.Thread(target=_end_when_stopped, args=(engine, run), name="pyengine-async-end",
                             daemon=False).start()
        else:
            _end(engine, run)


def _raise_first(engine, errors: list) -> None:
    """Raises the first worker error of a run. A lone CPU worker's loop ran on the calling thread, so its
    exception's frames link back to _run_async's (Note [A task's exception and its callers' frames] in engine.py):
    the list is emptied and the exception kept in this frame only, or they would be a cycle through the engine."""
    index, exc, own_thread = errors[0]
    errors.clear()
    try:
        if isinstance(exc, _AsItself):
            raise exc.error
        if not own_thread and not isinstance(exc, Exception):  # Ctrl-C on the calling thread: as itself
            raise exc
        if engine._closed:  # close() from a callback: the other workers' transfers were shut under them
            raise _closed_during_fit() from exc
        raise WorkerError(index, engine.devices[index], exc) from exc
    finally:  # this frame is in the raised error's traceback: it must not hold the error (a cycle)
        exc = None


def _end(engine, run) -> None:
    with engine.mutex:
        engine._async_run = None
    run.finished.set()


def _end_when_stopped(engine, run) -> None:
    for event in run.running:
        event.wait()
    _end(engine, run)


def _run_async(engine, run, batches, *, steps, epochs, callbacks) -> None:
    source = _BatchSource(batches, epochs, pushes=steps)
    stop = run.stop
    pushes_before = engine.stats()["pushes"]  # ``steps`` counts this call's pushes
    errors: list[tuple[int, BaseException, bool]] = []  # (worker, error, on a thread of its own)

    def push(worker, pulled, scale, loss, samples, compute, wait, copy_back, ordinals, wall_start) -> dict | None:
        """Under the mutex: apply the push (its metrics, recorded in the history) or ask for a refresh (None).
        ``ordinals``: of its mini-batches in this fit's order of ``batches`` (the metrics' ``batches``).
        ``wall_start``: when the worker began to wait for its first pull of them (its data's loading left out),
        so the wall counts the waits for the store's mutex and the computations a refresh discarded (the sum of
        the parts did not: 2 ms reported against 13-22 ms with 3 workers and a 10 ms callback)."""
        start = time.perf_counter()
        try:  # the optimizer's settings (changed between pushes) and lr_schedule's value: the caller's error, raised
            # by fit as itself, as sync and hybrid raise it (apply_push would ask it before it counts)
            engine.check_update(engine.version + 1)
        except BaseException as exc:  # noqa: BLE001 - a SystemExit from lr_schedule too, as in sync and hybrid
            raise _AsItself(exc) from exc
        pushed = engine.apply_push(pulled, [worker.index], loss_scale=scale, checked=True)
        if pushed is None:
            return None
        applied, staleness = pushed
        end = time.perf_counter()
        metrics = step_metrics(engine, loss=loss, samples=samples, wall=end - wall_start,
                               compute=compute, update=end - start, transfer_wait=wait,
                               copy_back=copy_back, applied=applied, worker=worker.index, version_at_pull=pulled,
                               version_at_apply=engine.version - int(applied), staleness=staleness,
                               lr_divisor=engine.staleness_divisor(staleness), loss_scale=scale, batches=ordinals)
        engine._record(metrics)
        return metrics

    def pushed(worker) -> None:
        """Under the mutex: the push of ``worker`` counts (applied, skipped, or raised for a non-finite gradient, as
        a step of sync and hybrid that raises for one keeps its statistics): its buffers stay."""
        if worker.index == engine.buffer_source:
            run.buffers = None  # its buffers are those of the push just made
        run.generators = None  # and the draws of its forwards count

    def called_back(metrics) -> None:
        """Under the mutex, after a push: the callbacks, then whether the run is done. A callback's error ends the
        run and is raised as itself (as in sync and hybrid), not as the worker's."""
        try:
            for callback in callbacks:
                callback(engine, metrics)
        except BaseException as exc:  # noqa: BLE001 - re-raised by fit as itself
            raise _AsItself(exc) from exc
        if engine.stop_requested or (steps is not None and engine.stats()["pushes"] - pushes_before >= steps):
            stop.set()

    def stopped() -> bool:
        """Under the mutex: the run is stopped (by itself, :meth:`Engine.stop` from any thread) or the engine
        closed; a worker then takes no further batch and applies no further push."""
        return stop.is_set() or engine.stop_requested or engine._closed

    def pull(worker, refresh: bool = False) -> tuple[int, float | None, float, int | None, list | None] | None:
        """Under the mutex: the snapshot of the weights, its version, the loss scale to compute with, the seconds the
        copy of the weights took (the push reports it as its copy back), the mini-batches a push from this version
        takes, and (the buffers' source replica) the copy of its buffers (Note [Reading the state while async
        workers run]). None when the run stopped meanwhile (a worker waits here for the mutex while another's push
        ends the run): the worker ends without taking a batch, which a later fit gets."""
        with engine.mutex, engine.phase("pull", worker.index):
            try:
                start = time.perf_counter()
                # Note [Random numbers of concurrent workers]: seeded from the pushes applied by now, a refresh too
                # (pushes landed since its first pull: it recomputes its batches with new draws)
                if worker.rng is not None:
                    worker.rng.begin_step(engine._counters["pushes"])
                worker.pull(wait=True)
                if stopped():  # while this worker waited for the mutex: it takes no batch, the schedule is not asked
                    return None
                try:  # a setting's error, not the worker's: raised by fit as itself, as sync and hybrid raise it
                    # (a refresh computes the same mini-batches again: the schedule is asked of new ones only)
                    k = None if refresh else minibatches_per_push(engine, engine.version)
                except BaseException as exc:  # noqa: BLE001 - a KeyboardInterrupt from batch_schedule too
                    raise _AsItself(exc) from exc
                if stopped():  # by the batch schedule itself
                    return None
                run.generators = engine._global_generators()  # None unless the worker draws from torch's own
                saved = None
                if worker.index == engine.buffer_source:
                    saved = engine._snapshot_source_buffers({worker.index: None})
                    run.buffers = engine.copies_for_readers(saved)
                return engine.version, engine.loss_scale_now(), time.perf_counter() - start, k, saved
            except BaseException:
                stop.set()  # before the mutex is released: no other push lands after it (Note [The push that ends
                raise  # a run]), whatever failed here (the batch schedule, the copy of the weights, the snapshot)

    def unpushed(saved) -> None:
        """The source replica's computation was not applied: its buffers go back to the copy, and a lone worker's
        draws are undone (under the mutex): the pushes after it draw what they would have had it never been tried."""
        if saved is not None:
            engine._restore_source_buffers(saved)
        if run.generators is not None:
            engine._set_global_generators(run.generators)
            run.generators = None

    def loop(worker, own_thread=True):
        saved = None
        ident = threading.get_ident()
        try:
            if own_thread:
                run.threads.add(ident)
                set_worker_threads(engine.devices, engine._intra_op_threads)
            while not stop.is_set():
                wall_start = time.perf_counter()
                pulled = pull(worker)
                if pulled is None:
                    return
                pulled, scale, copied, k, saved = pulled
                taking = time.perf_counter()
                ordinals, minibatches = source.take(k)
                wall_start += time.perf_counter() - taking  # the data's loading is not the push's
                if not minibatches:
                    return
                try:  # the data's fault, not the worker's: raised as itself, as hybrid and sync raise it
                    sizes = [batch_size(b) for b in minibatches]
                    if 0 in sizes:
                        raise ValueError("a batch of 0 samples: a push needs at least one sample in every mini-batch")
                except ValueError as exc:
                    raise _AsItself(exc) from exc
                samples = sum(sizes)
                while not stop.is_set():
                    with engine.phase("forward_backward+transfer", worker.index):
                        loss, compute, wait, _ = worker.compute(engine.loss_fn, minibatches, loss_scale=scale)
                    # Note [Ctrl-C inside a step]: a push is applied whole (the lone CPU worker runs here, on the
                    # calling thread, where Ctrl-C lands)
                    with engine.mutex:
                        try:
                            with deferred_interrupt("an async push", engine._abandon):
                                # stopped (by this run or engine.stop() from any thread) or closed: the computation
                                # is discarded
                                if stopped():
                                    unpushed(saved)
                                    return
                                with engine.phase("push", worker.index):
                                    raised = engine._counters["raised_steps"]
                                    try:
                                        metrics = push(worker, pulled, scale, loss, samples, compute, wait, copied,
                                                       ordinals, wall_start)
                                    except FloatingPointError as exc:
                                        if engine._counters["raised_steps"] == raised:
                                            raise
                                        saved = None  # nonfinite="raise": counted, and raised by fit as itself
                                        pushed(worker)  # (as in sync and hybrid: not a failure of the worker)
                                        raise _AsItself(exc) from exc
                                if metrics is not None:
                                    saved = None
                                    pushed(worker)
                                else:
                                    unpushed(saved)  # a refresh: the same mini-batches are computed again
                            # the push is whole: the callbacks run outside the deferral, as after a step of sync
                            # and hybrid (a Ctrl-C in a slow callback raises at once; a second one abandoned the
                            # engine, its state complete), still under the mutex: no push lands meanwhile
                            if metrics is not None:
                                called_back(metrics)
                                break
                        except BaseException:
                            # Note [The push that ends a run]: the run stops before the mutex is released, so no
                            # other worker's push is applied after this one's error (a callback's, a pull's, a non-finite
                            # gradient raised, a Ctrl-C held until the push was whole); set after the mutex, a
                            # waiting worker took it in between and applied one more push (1 run in 3, 2 workers)
                            stop.set()
                            raise
                    pulled = pull(worker, refresh=True)
                    if pulled is None:
                        return
                    pulled, scale, copied, _, saved = pulled
        except BaseException as exc:  # noqa: BLE001 - reported to the caller with the worker's index
            stop.set()  # first: no other worker's push is applied once this one failed
            errors.append((worker.index, exc, own_thread))  # before anything that may raise: fit raises it
            try:
                with engine.mutex:
                    unpushed(saved)
            except BaseException as undo:  # noqa: BLE001 - told with the error fit raises
                # fit raises the run's first error (_raise_first), which may be another worker's: the note goes on
                # that one (on this worker's own error it died unseen), naming this worker then
                _, first, _ = errors[0]
                told = first.error if isinstance(first, _AsItself) else first
                whose = "" if first is exc else \
                    f"worker {worker.index}'s push failed too ({type(exc).__name__}: {exc}), and "
                if hasattr(told, "add_note"):  # Python >= 3.11
                    told.add_note(f"{whose}putting back the buffers of its replica failed too: {type(undo).__name__}: "
                                  f"{undo} (the state's buffers may count this computation's batch)")
        finally:
            if own_thread:  # a thread started after this one ended may get its id (close() compares ids)
                run.threads.discard(ident)

    if engine.inline_worker:  # Note [One CPU worker runs on the calling thread] in engine.py
        run.threads.add(threading.get_ident())
        loop(engine.workers[0], own_thread=False)
    else:
        # Note [Joining after Ctrl-C]
        # The calling thread waits on an Event per worker that the worker's thread sets as its last act, not on
        # Thread.join(): in Python 3.11 a join interrupted by KeyboardInterrupt marks the thread stopped while it
        # still runs (threading's _wait_for_tstate_lock releases the lock the live thread holds), so a second join
        # returns at once and a worker would be left pushing after fit raised (seen: tests/test_engine.py,
        # test_ctrl_c_during_async_fit_stops_every_worker, under load). Event.wait has no such state.
        done = [threading.Event() for _ in engine.workers]

        def run_worker(worker, finished):
            try:
                loop(worker)
            finally:
                finished.set()

        # Note [Async threads are not daemons]
        # fit joins its workers, except after a second Ctrl-C: it raises while they finish their current push (the
        # stop is set), and a script that lets the KeyboardInterrupt end it exits meanwhile. Daemon threads were
        # then killed by the interpreter's finalization inside torch's native frames: "terminate called without an
        # active exception", the process aborted (SIGABRT, a core dump) instead of exiting with 130. As threads of
        # their own they are joined at exit (threading's shutdown), as the hybrid and sync thread pools' are; the
        # exit waits at most their current push. daemon=False said: a thread takes its creator's flag, and a fit
        # called on a daemon thread made daemon workers, which a script that ended meanwhile killed so (SIGABRT).
        threads = [threading.Thread(target=run_worker, args=(w, e), name=f"pyengine-async-{w.index}", daemon=False)
                   for w, e in zip(engine.workers, done)]
        run.workers_done = list(zip(threads, done))
        try:
            for t in threads:
                t.start()
            for e in done:
                e.wait()
            for t in threads:  # each has set its event: only its exit is left
                t.join()
        except BaseException:  # Ctrl-C here: stop the workers after their current push, leave none running
            stop.set()
            started = [(t, e) for t, e in zip(threads, done) if t.ident is not None]  # start() interrupted too
            try:
                for t, e in started:
                    e.wait()
                    t.join()
            except BaseException:  # a second Ctrl-C while they finish: the engine is given up, as at a second
                engine._abandon()  # Ctrl-C inside a step; close() still waits for them (run_async)
                run.running = [e for _, e in started]
                raise
            for worker in engine.workers:
                worker.streamer.reset()
            raise
    if errors:
        for worker in engine.workers:
            worker.streamer.reset()
        _raise_first(engine, errors)
    if engine._closed:
        raise _closed_during_fit()
    if steps and not source.taken and not engine.stop_requested:  # as hybrid and sync: steps asked, none possible
        raise ValueError("batches is empty")
