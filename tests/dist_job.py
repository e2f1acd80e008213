"""One rank of a multi-process test (tests/test_distributed.py starts P of these with a torchrun-like environment).

    python tests/dist_job.py SCENARIO OUT_DIR SEED

Each rank writes ``OUT_DIR/rank<r>.pt`` with what the test checks; the data is generated from SEED the same way in
every rank and in the test, so the test can rebuild the concatenated batches and the reference.
"""
import datetime
import gc
import os
import sys
import tempfile
import threading
import time
import warnings
import weakref

import torch

import pyengine
from pyengine import checkpoint, distributed

OPT = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.01)
D_IN, HIDDEN, CLASSES = 10, 24, 3


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES))


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def global_batches(seed, count, size):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, D_IN, generator=g), torch.randint(0, CLASSES, (size,), generator=g))
            for _ in range(count)]


def rank_slice(batch, rank, world):
    """Rank r's part of a global batch: torch.tensor_split, so sizes differ by at most one (uneven when needed)."""
    return tuple(torch.tensor_split(t, world)[rank] for t in batch)


def client_batch(seed, rank, index, size=16):
    g = torch.Generator().manual_seed(seed * 1000 + rank * 100 + index)
    return torch.randn(size, D_IN, generator=g), torch.randint(0, CLASSES, (size,), generator=g)


HYBRID = dict(steps=6, batch=37, clip=0.05)


def hybrid(seed, rank, world):
    """Replicated and sharded engines (2 local CPU workers each, each worker's shard in 3 micro-batches: the sizes
    every forward saw are recorded) on this rank's part of the same global batches. Then a step whose batch is too
    small for the micro-batches on rank 1 only: every rank must refuse it (ValueError) and train on."""
    batches = [rank_slice(b, rank, world) for b in global_batches(seed, HYBRID["steps"], HYBRID["batch"])]
    out = {}
    for name, shard in (("replicated", False), ("sharded", True)):
        opt = pyengine.AdamW(**OPT, max_grad_norm=HYBRID["clip"])
        forwards = []

        def recording_loss(model, batch):
            forwards.append(batch[0].shape[0])
            return loss_fn(model, batch)

        with pyengine.Engine(make_model(), recording_loss, devices=["cpu"] * 2, optimizer=opt, pin=False,
                             bucket_mb=0.0003, first_bucket_mb=0.0002, shard_update=shard, microbatches=3) as engine:
            metrics = [engine.step(b) for b in batches]
            out[name] = dict(master=engine.master_state_dict(), optimizer=engine.optimizer_state_dict(),
                             stats=engine.stats(), samples=[m["samples"] for m in metrics],
                             buckets=len(engine.workers[0].streamer.buckets), forwards=sorted(forwards))
            if name == "replicated":
                small = tuple(t[:4] for t in batches[0]) if rank == 1 else batches[0]  # 2 + 2 samples < 3
                try:
                    engine.step(small)
                    out["refused"] = None
                except ValueError as exc:
                    out["refused"] = str(exc)
                out["after_refusal"] = dict(applied=engine.step(batches[1])["applied"], version=engine.version)
    out["bn"] = bn_buffers(batches)
    try:  # not supported together: refused at construction
        pyengine.Engine(make_model(), loss_fn, devices=["cpu"], pin=False, shard_update=True,
                        optimizer=pyengine.AdamW(**OPT, no_decay=("bias",)))
        out["no_decay_sharded"] = None
    except ValueError as exc:
        out["no_decay_sharded"] = str(exc)
    return out


def kept_works(seed, rank, world, out_dir):
    """Note [Gloo's works are released by the thread that waits]: every collective an engine issues (hybrid steps,
    replicated and sharded with its update's all-gathers; a pipeline across processes: its steps and its gather;
    a checkpoint) is issued with async_op=True and its work is kept by the engine (gc is off: only references keep
    it). Returns, per kind, how many collectives were issued, how many blocking and how many works not kept."""
    import torch.distributed as dist

    issued = []

    def recording(fn):
        def call(*args, **kwargs):
            work = fn(*args, **kwargs)
            issued.append((kwargs.get("async_op", False), work))
            return work
        return call

    patched = {(dist, name): getattr(dist, name) for name in ("all_reduce", "broadcast")}
    patched[(distributed, "_all_gather_flat")] = distributed._all_gather_flat
    for (module, name), fn in patched.items():
        setattr(module, name, recording(fn))

    def count(engine) -> dict:
        kept = {id(w) for w in engine.collective_works.works}
        return dict(issued=len(issued), blocking=sum(not a for a, _ in issued),
                    not_kept=sum(id(w) not in kept for _, w in issued))

    out = {}
    try:
        batches = [rank_slice(b, rank, world) for b in global_batches(seed, 3, 16)]
        for name, shard in (("replicated", False), ("sharded", True)):
            with pyengine.Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=pyengine.AdamW(**OPT),
                                 pin=False, bucket_mb=0.0003, first_bucket_mb=0.0002, shard_update=shard) as engine:
                issued.clear()
                for b in batches:
                    engine.step(b)
                checkpoint.save_engine(os.path.join(out_dir, name), 1, engine)
                out[name] = count(engine)
        with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], mode="pipeline", microbatches=2,
                             optimizer=pyengine.AdamW(**OPT), pin=False) as engine:
            issued.clear()
            for b in global_batches(seed, 2, 8):
                engine.step(b)
            engine.master_state_dict()
            out["pipeline"] = count(engine)
        # the storages the kept works hold, after each hybrid step of a model with buffers (shared every step): a
        # new buffer for their bytes each step was held by its work, one copy more per step
        with pyengine.Engine(make_bn_model(), loss_fn, devices=["cpu"], optimizer=pyengine.AdamW(**OPT),
                             pin=False) as engine:
            out["held"] = []
            for b in batches * 2:
                engine.step(b)
                out["held"].append(len({t.untyped_storage().data_ptr() for w in engine.collective_works.works
                                        for t in w.result()}))
    finally:
        for (module, name), fn in patched.items():
            setattr(module, name, fn)
    return out


FP16 = dict(steps=12, batch=26, poisoned=6, scaler=dict(init_scale=2.0 ** 24, growth_interval=3))


def fp16_batches(seed):
    """The global batches of the float16 scenario: one input of batch ``poisoned`` beyond float16's range."""
    batches = global_batches(seed + 1, FP16["steps"], FP16["batch"])
    batches[FP16["poisoned"]][0][0, 0] = 1e6
    return batches


def hybrid_fp16(seed, rank, world):
    """Float16 autocast with dynamic loss scaling (Note [Loss scaling]), replicated and sharded, 2 local CPU
    workers: each step's scale and applied flag, and the weights (identical on every rank: every rank takes the same
    decisions)."""
    batches = [rank_slice(b, rank, world) for b in fp16_batches(seed)]
    out = {}
    for name, shard in (("replicated", False), ("sharded", True)):
        with pyengine.Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=pyengine.AdamW(**OPT), pin=False,
                             autocast=torch.float16, loss_scale=pyengine.LossScaler(**FP16["scaler"]),
                             shard_update=shard) as engine:
            metrics = [engine.step(b) for b in batches]
            out[name] = dict(master=engine.master_state_dict(), trajectory=[(m["loss_scale"], m["applied"])
                                                                            for m in metrics])
    return out


def async_fp16(seed, rank, world):
    """Float16 autocast with dynamic loss scaling in multi-server async (2 servers, the others clients): the scale
    starts too high (pushes overflow and back it off), then grows every 3 applied pushes. Servers record every push
    with the scale it was computed with."""
    servers = 2
    batches = [client_batch(seed, rank, i) for i in range(40)] if rank >= servers else []
    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(**OPT),
                         pin=False, servers=servers, autocast=torch.float16,
                         loss_scale=pyengine.LossScaler(**FP16["scaler"])) as engine:
        engine.fit(batches, steps=24)
        history = [{k: m[k] for k in ("rank", "push_id", "applied", "loss_scale", "server")}
                   for m in engine.history if "server" in m]
        return dict(history=history, stats=engine.stats(), master=engine.master_state_dict())


def make_bn_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.BatchNorm1d(HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, CLASSES))


def bn_buffers(batches):
    """A BatchNorm model: per step, the master weights before it and worker 0's buffers after it."""
    record = dict(master=[], buffers=[])
    with pyengine.Engine(make_bn_model(), loss_fn, devices=["cpu"] * 2, optimizer=pyengine.AdamW(**OPT),
                         pin=False) as engine:
        for b in batches[:3]:
            record["master"].append(engine.master_state_dict())
            engine.step(b)
            record["buffers"].append(engine.buffers_state_dict())
    return record


def nonfinite_raise(seed, rank, world):
    """nonfinite="raise", replicated and sharded, 2 local workers: a good step, a step whose batch has a NaN on rank
    1 only (every rank gets the non-finite reduced gradient), then a good step. What each step did or raised."""
    batches = [rank_slice(b, rank, world) for b in global_batches(seed, 3, 16)]
    if rank == 1:
        batches[1][0][0, 0] = float("nan")
    out = {}
    for name, shard in (("replicated", False), ("sharded", True)):
        with pyengine.Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=pyengine.AdamW(**OPT), pin=False,
                             nonfinite="raise", shard_update=shard) as engine:
            steps = []
            for b in batches:
                try:
                    steps.append(engine.step(b)["applied"])
                except Exception as exc:  # noqa: BLE001 - recorded for the test
                    steps.append(f"{type(exc).__name__}: {exc}")
            out[name] = dict(steps=steps, stats=engine.stats(), recorded=engine.recorded_failure(),
                             master=engine.master_state_dict())
            engine.optimizer.no_decay = ("bias",)  # refused when made with shard_update=True: and when set later
            try:
                engine.step(batches[2])
                out[name]["no_decay"] = "applied"
            except ValueError as exc:
                out[name]["no_decay"] = str(exc)
            engine.optimizer.no_decay = ()
            out[name]["after"] = engine.step(batches[2])["applied"]
    return out


class WritesWhenArmed(torch.nn.Module):
    """A layer that, at the forward after ``armed`` is set to a kind, writes state the engine does not follow once,
    before it uses it: a trainable weight in place ("weight"), a frozen parameter ("frozen"), a persistent buffer
    registered as None ("none-buffer"); or leaves its parameter ``extra`` out of its forwards until disarmed
    ("unused": no gradient, refused under unused="error")."""

    def __init__(self):
        super().__init__()
        self.l, self.armed = torch.nn.Linear(D_IN, HIDDEN), None
        self.frozen = torch.nn.Parameter(torch.zeros(D_IN), requires_grad=False)
        self.extra = torch.nn.Parameter(torch.zeros(HIDDEN))
        self.register_buffer("late", None)

    def forward(self, x):
        kind = self.armed
        if kind != "unused":
            self.armed = None
        with torch.no_grad():
            if kind == "weight":
                self.l.weight.clamp_(-10.0, 10.0)
            elif kind == "frozen":
                self.frozen.add_(0.5)
            elif kind == "none-buffer":
                self.late = x.mean(0)
        out = self.l(x + self.frozen)
        return out if kind == "unused" else out + self.extra


def writing_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(WritesWhenArmed(), torch.nn.BatchNorm1d(HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, CLASSES))


# (kind, the rank whose worker 1 writes, or leaves a parameter without a gradient)
UNFOLLOWED = [("weight", 1), ("none-buffer", 0), ("frozen", 1), ("unused", 0), ("unused", 1)]


def unfollowed_state(seed, rank, world):
    """Replicated and sharded, 2 local workers: for each (kind, rank) of UNFOLLOWED a good step, a step whose worker
    1 on that rank writes state the engine does not follow (or, under the engines' unused="error", leaves a
    parameter without a gradient), then two good steps; and the same engine on the same batches without the
    refused one. What each step raised, the stats, the master weights and buffers of both."""
    batches = [rank_slice(b, rank, world) for b in global_batches(seed, 4, 16)]
    out = {}
    for name, shard in (("replicated", False), ("sharded", True)):
        for kind, writer in UNFOLLOWED:
            runs = {}
            for run, indices in (("refused", [0, 1, 2, 3]), ("skipped", [0, 2, 3])):
                with pyengine.Engine(writing_model(), loss_fn, devices=["cpu"] * 2, optimizer=pyengine.AdamW(**OPT),
                                     pin=False, shard_update=shard, unused="error") as engine:
                    steps = []
                    for i in indices:
                        if i == 1 and rank == writer:
                            engine.workers[1].replica[0].armed = kind
                        try:
                            steps.append(engine.step(batches[i])["applied"])
                        except Exception as exc:  # noqa: BLE001 - recorded for the test
                            steps.append(f"{type(exc).__name__}: {exc}")
                        engine.workers[1].replica[0].armed = None
                    runs[run] = dict(steps=steps, stats=engine.stats(), version=engine.version,
                                     recorded=engine.recorded_failure(), master=engine.master_state_dict(),
                                     buffers=engine.buffers_state_dict())
            out[name, kind, writer] = runs
    return out


def load_divergence(seed, rank, world, out_dir):
    """Replicated and sharded: after 2 steps rank 0 alone loads the state of step 1 (a resume on rank 0 only); a
    checkpoint and the next step must fail on every rank (the checkpoint writing nothing). Then rank 1 loads it too,
    and both train on. Then an lr changed on rank 0 only, and an lr_schedule that differs between the ranks at a
    step the construction does not compare: refused on every rank."""
    batches = [rank_slice(b, rank, world) for b in global_batches(seed, 3, 16)]
    out = {}
    for name, shard in (("replicated", False), ("sharded", True)):
        with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], optimizer=pyengine.AdamW(**OPT), pin=False,
                             shard_update=shard) as engine:
            engine.step(batches[0])
            state = engine.state_dict()
            engine.step(batches[1])
            if rank == 0:
                engine.load_state_dict(state)
            try:  # Note [A checkpoint of ranks at different versions]
                checkpoint.save_engine(os.path.join(out_dir, f"diverged-{name}"), 2, engine)
                save_error = None
            except distributed.DistributedError as exc:
                save_error = str(exc)
            try:
                engine.step(batches[1])
                error = None
            except distributed.DistributedError as exc:
                error = str(exc)
            if rank == 1:
                engine.load_state_dict(state)
            engine.step(batches[1])
            if rank == 0:  # an lr changed on rank 0 only (under `if rank == 0:`): refused on every rank, then undone
                engine.optimizer.lr *= 2
            try:
                engine.step(batches[2])
                lr_error = None
            except distributed.DistributedError as exc:
                lr_error = str(exc)
            engine.optimizer.lr = OPT["lr"]
            engine.step(batches[2])
            out[name] = dict(error=error, save_error=save_error, lr_error=lr_error, version=engine.version,
                             master=engine.master_state_dict())
    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], mode="pipeline", microbatches=2,
                         optimizer=pyengine.AdamW(**OPT), pin=False) as engine:  # a stage per rank
        full = global_batches(seed, 2, 8)
        engine.step(full[0])
        state = engine.state_dict()
        engine.step(full[1])
        if rank == 0:
            engine.load_state_dict(state)
        try:
            checkpoint.save_engine(os.path.join(out_dir, "diverged-pipeline"), 2, engine)
            out["pipeline"] = dict(save_error=None)
        except distributed.DistributedError as exc:
            out["pipeline"] = dict(save_error=str(exc))
    # an lr_schedule that differs between the ranks from update 6 on (rank 0: 0.5 from step 5, rank 1 from step 6):
    # alike at the steps the construction compares (0..3, 10, ...), so only the step's check sees it
    schedule = lambda s: 0.5 if s >= 5 + rank else 1.0  # noqa: E731
    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], optimizer=pyengine.AdamW(**OPT), pin=False,
                         lr_schedule=schedule) as engine:
        errors = []
        for i in range(7):
            try:
                engine.step(batches[i % len(batches)])
            except distributed.DistributedError as exc:
                errors.append((i, str(exc)))
        out["schedule"] = dict(errors=errors, version=engine.version, master=engine.master_state_dict())
    return out


ASYNC = dict(pushes=24, per_client=40)


def asynchronous(seed, rank, world, out_dir):
    """Rank 0 serves; the others push gradients of their own mini-batches (max_staleness=0 forces refreshes). After
    the first run a checkpoint is saved and loaded into a fresh engine on every rank: its stats are recorded."""
    batches = [client_batch(seed, rank, i) for i in range(ASYNC["per_client"])] if rank else []

    def make_engine():
        return pyengine.Engine(make_model(), loss_fn, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(**OPT),
                               pin=False, max_staleness=0)

    mid_run = []

    def read_state_once(engine, metrics):  # Note [A state during a multi-node async run]
        if not mid_run:
            try:
                mid_run.append(engine.state_dict()["version"])
            except RuntimeError as exc:
                mid_run.append(str(exc))

    with make_engine() as engine:
        with warnings.catch_warnings(record=True) as enough:
            warnings.simplefilter("always")
            engine.fit(batches, steps=ASYNC["pushes"], callbacks=[read_state_once])
        out = dict(mid_run=mid_run, history=[{k: m[k] for k in ("rank", "push_id", "version_at_pull", "applied") +
                             (("staleness", "version_at_apply") if rank == 0 else ())} for m in engine.history],
                   stats=engine.stats(), master=engine.master_state_dict())
        path = checkpoint.save_engine(os.path.join(out_dir, "ckpt"), 1, engine)
        with make_engine() as resumed:
            checkpoint.load_engine(path, resumed)
            out["resumed_stats"] = resumed.stats()
        with warnings.catch_warnings(record=True) as short:  # 2 batches per client (one pass) for 100 pushes
            warnings.simplefilter("always")
            engine.fit(iter(batches[:2]) if rank else [], steps=100)
        out["warnings"] = [[str(w.message) for w in caught] for caught in (enough, short)]
        return out


def async_close(seed, rank, world, who):
    """Note [Closing a multi-node async run]: rank 0 serves, rank 1 pushes (200 mini-batches, steps=200); ``who``
    closes the engine during fit: "server" (rank 0, from another thread after push 5), "callback" (rank 0's
    callback at push 5) or "client" (rank 1, from another thread after its push 5). Records what fit raised, the
    pushes counted, and whether close() returned only after the run had ended (nothing counted or computed after)."""
    batches = [client_batch(seed, rank, i % 4) for i in range(200)] if rank else []
    closing_rank = 1 if who == "client" else 0
    fifth, times = threading.Event(), {}

    calls = [0]

    def slow_loss(model, batch):  # push 6 takes 2 s: a close() just after push 5 comes before push 6 arrives
        calls[0] += 1
        time.sleep(2.0 if calls[0] == 6 else 0.05)
        return loss_fn(model, batch)

    def counted(engine, metrics):
        if engine.stats()["pushes"] == 5:
            if who == "callback":
                engine.close()
            fifth.set()

    engine = pyengine.Engine(make_model(), slow_loss, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(**OPT),
                             pin=False)

    def closer():
        if who == "client":  # no callbacks on a client: its own count of pushes sent
            while engine.stats()["pushes"] < 5:
                time.sleep(0.01)
        else:
            fifth.wait(60)
        engine.close()
        # what the run had done as close() returned, and whether it had ended (a time stamp against one the caller
        # takes after fit is a race: fit raises on its thread just after the run ends, and close() may return first)
        times["closed"] = (engine.stats()["pushes"], calls[0], engine._async_run is None)

    thread = None
    if who != "callback" and rank == closing_rank:
        thread = threading.Thread(target=closer)
        thread.start()
    error = None
    try:
        engine.fit(batches, steps=200, callbacks=[counted] if rank == 0 else [])
    except Exception as exc:  # noqa: BLE001 - reported
        error = f"{type(exc).__name__}: {exc}"
    if thread is not None:
        thread.join(60)
    pushes = engine.stats()["pushes"]
    engine.close()
    # close() returned only once the run had ended: nor push counted, nor loss computed after it returned
    return {"error": error, "pushes": pushes,
            "close_after_fit": times["closed"] == (pushes, calls[0], True) if "closed" in times else None}


def async_refresh_at_stop(seed, rank, world, servers, out_dir):
    """``servers`` server ranks, then two clients that both pull the first weights before either pushes (a barrier
    of files in the loss), so that max_staleness=0 refuses the second push to arrive; rank 0 calls stop() as it
    refuses it, so that client's next header is STOP, with the REFRESH decision (K = 1: in its own field; K > 1: in
    the decision header, after which the pull brings STOP). Records every rank's stats."""
    batches = [client_batch(seed, rank, i) for i in range(50)] if rank >= servers else []
    first = threading.Event()

    def barrier_loss(model, batch):
        if not first.is_set():
            first.set()
            open(os.path.join(out_dir, f"pulled{rank}"), "w").close()
            deadline = time.monotonic() + 30
            while not all(os.path.exists(os.path.join(out_dir, f"pulled{r}")) for r in range(servers, world)):
                if time.monotonic() > deadline:
                    raise TimeoutError("the other client never pulled")
                time.sleep(0.01)
        return loss_fn(model, batch)

    with pyengine.Engine(make_model(), barrier_loss, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(**OPT),
                         pin=False, max_staleness=0, servers=servers) as engine:
        if rank == 0:
            apply_push = engine.apply_push

            def stop_at_refresh(*args, **kwargs):
                pushed = apply_push(*args, **kwargs)
                if pushed is None:
                    engine.stop()
                return pushed

            engine.apply_push = stop_at_refresh
        try:
            engine.fit(batches, steps=50)
        finally:
            vars(engine).pop("apply_push", None)  # the wrapper holds the engine: no cycle (gc is off)
        return {"stats": engine.stats(), "history": [m["push_id"] for m in engine.history]}


def async_client_callback(seed, rank, world):
    """Rank 0 serves, rank 1 pushes with a callback that stops it after rank 0 applied its third push (a client's
    callbacks were never called). Records the pushes each rank's callbacks saw, the pushes rank 0 applied and the
    warnings (rank 0 is given batches too, which a server does not train on)."""
    batches = [client_batch(seed, rank, i % 4) for i in range(50 if rank else 2)]  # the server's are not used
    seen, taken = [], []

    def counted():  # the client's batches, counted as fit takes them
        for b in batches:
            taken.append(1)
            yield b

    def callback(engine, metrics):
        seen.append(metrics["push_id"] if rank else engine.stats()["pushes"])
        if rank and metrics["push_id"] == 3:
            engine.stop()

    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(**OPT),
                         pin=False) as engine:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # rank 0: its unused batches, and the client stopped before 50 pushes
            engine.fit(counted() if rank else batches, steps=50, callbacks=[callback])
        return {"seen": seen, "pushes": engine.stats()["pushes"], "warnings": [str(w.message) for w in caught],
                "where": [os.path.basename(w.filename) for w in caught], "taken": len(taken)}


def async_client_raises(seed, rank, world, how):
    """Rank 0 serves, rank 1 pushes; rank 1 fails outside its computation: ``"callback"``, its fit callback raises at
    its second applied push (after checking the metrics it is given); ``"iter"``, its batches iterable cannot start
    a second epoch. Each rank records what its fit raised and after how many seconds."""
    data = [client_batch(seed, rank, i) for i in range(3)] if rank else []

    class Vanishing:
        def __init__(self):
            self.epochs = 0

        def __iter__(self):
            self.epochs += 1
            if self.epochs > 1:
                raise OSError("epoch 2 cannot open")
            return iter(data)

    def callback(engine, metrics):
        assert {"push_id", "rank", "applied", "version_at_pull", "loss", "samples"} <= set(metrics), metrics
        if rank and metrics["push_id"] == 2:
            raise RuntimeError("the callback refuses push 2")

    began = time.monotonic()
    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(**OPT),
                         pin=False) as engine:
        try:
            if how == "iter":
                engine.fit(Vanishing() if rank else [], epochs=2)
            else:
                engine.fit(data if rank else [], steps=50, callbacks=[callback])
            error = None
        except Exception as exc:  # noqa: BLE001 - reported
            error = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - began}


def make_frozen_model(seed=0):
    """make_model with its first Linear frozen (a pretrained layer, say), a frozen float8 parameter, an int16
    non-persistent buffer and persistent int16 and float8 buffers (dtypes gloo does not broadcast: their bytes
    travel, at the construction and at every step)."""
    model = make_model(seed)
    model[0].requires_grad_(False)
    torch.manual_seed(seed + 100)
    model[2].register_parameter("scale8", torch.nn.Parameter(torch.randn(5).to(torch.float8_e4m3fn),
                                                             requires_grad=False))
    model[2].register_buffer("codes", torch.randint(-300, 300, (3,), dtype=torch.int16), persistent=False)
    model[2].register_buffer("levels", torch.randint(-300, 300, (4,), dtype=torch.int16))
    model[2].register_buffer("levels8", torch.randn(2).to(torch.float8_e5m2))
    return model


def frozen_rank0(seed, rank, world):
    """Note [Every rank starts from rank 0's model]: a model with a frozen first layer, built from another seed on
    each rank, in replicated and sharded hybrid (2 local workers) and multi-node async (rank 0 serves): every
    replica's frozen layer after construction (async: after a fit) and after its steps, and the master weights."""
    batches = [rank_slice(b, rank, world) for b in global_batches(seed, 2, 16)]

    def frozen(engine):
        return [{**{n: p.detach().clone() for n, p in w.replica.named_parameters() if not p.requires_grad},
                 **{k: getattr(w.replica[2], k).clone() for k in ("codes", "levels", "levels8")}}
                for w in engine.workers]

    def exported(engine):  # copy_to into a model of this rank's seed: the model trained, rank 0's frozen layer
        model = make_frozen_model(seed=rank)
        engine.copy_to(model)
        return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

    out = {}
    for name, shard in (("replicated", False), ("sharded", True)):
        with pyengine.Engine(make_frozen_model(seed=rank), loss_fn, devices=["cpu"] * 2, pin=False,
                             optimizer=pyengine.AdamW(**OPT), shard_update=shard) as engine:
            built = frozen(engine)
            for b in batches:
                engine.step(b)
            out[name] = dict(frozen=built + frozen(engine), master=engine.master_state_dict(),
                             exported=exported(engine))
    pushes = [client_batch(seed, rank, i) for i in range(3)] if rank else []
    with pyengine.Engine(make_frozen_model(seed=rank), loss_fn, devices=["cpu"], mode="async", pin=False,
                         optimizer=pyengine.AdamW(**OPT), max_staleness=0) as engine:
        engine.fit(pushes, steps=2)
        out["async"] = dict(frozen=frozen(engine), master=engine.master_state_dict(), exported=exported(engine))
    return out


LOW = torch.bfloat16  # the low-precision scenarios' model dtype


def low_loss(model, batch):
    x, y = batch  # x already bfloat16: a pipeline's first stage reads it as it is
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def low_batch(batch):
    return batch[0].to(LOW), batch[1]


def shadow_checks(engine, replicas=True) -> dict:
    """Note [The shadow follows the master weights]: whether the store's shadow is its master weights rounded, and
    (``replicas``) whether every replica, or what this rank's pipeline stage copies at its next step, holds them."""
    store = engine.store
    ok = dict(shadow=store.shadow is not None and store.shadow.dtype == LOW
              and torch.equal(store.shadow, store.param.to(LOW)))
    master = store.views(store.param)
    if not replicas:
        return ok
    if engine.pipeline is not None:
        params = [(name, engine.pipeline._master[name]) for name, _ in engine.pipeline.params]
    else:
        for worker in engine.workers:
            worker.streamer.wait_weights()
        params = [item for w in engine.workers for item in w.replica.named_parameters()]
    ok["replicas"] = all(torch.equal(p.detach(), master[name].to(LOW)) for name, p in params)
    return ok


def low_precision(seed, rank, world):
    """A bfloat16 model, built from another seed on each rank (rank 0's weights are broadcast), in replicated and
    sharded hybrid (2 local workers) and a pipeline across the ranks: :func:`shadow_checks` after construction
    and after each step (the pipeline's after its gather), and the master weights."""
    batches = [low_batch(rank_slice(b, rank, world)) for b in global_batches(seed, 3, 16)]
    out = {}
    for name, shard in (("replicated", False), ("sharded", True)):
        with pyengine.Engine(make_model(seed=rank).to(LOW), low_loss, devices=["cpu"] * 2, pin=False,
                             optimizer=pyengine.AdamW(**OPT), bucket_mb=1e-5, first_bucket_mb=1e-5,
                             shard_update=shard) as engine:
            checks = [shadow_checks(engine)]
            for b in batches:
                engine.step(b)
                checks.append(shadow_checks(engine))
            out[name] = dict(checks=checks, master=engine.master_state_dict())
    with pyengine.Engine(make_model(seed=rank).to(LOW), low_loss, devices=["cpu"], mode="pipeline", microbatches=2,
                         optimizer=pyengine.AdamW(**OPT), pin=False) as engine:
        checks = [shadow_checks(engine)]
        for b in global_batches(seed, 2, 8):
            engine.step(low_batch(b))
            engine.master_state_dict()  # gathers every stage's weights into this rank's store
            checks.append(shadow_checks(engine))
        out["pipeline"] = dict(checks=checks, master=engine.master_state_dict())
    return out


def low_precision_async(seed, rank, world):
    """A bfloat16 model, built from another seed on each rank, in multi-node async with 2 servers (ranks 0, 1) and
    the other ranks clients: at every forward of a client, whether its replica holds the weights it received
    (rounded); :func:`shadow_checks` after construction and after the fit (the shadow: the store's ends of a run
    write every rank's weights, and a server's replica computes nothing), the master weights and the dtypes of the
    tensors each rank sent during the fit."""
    forwards, held = [], {}  # held: the store, not the engine (Note [No reference cycle through the engine])

    def checking_loss(model, batch):
        master = held["store"].views(held["store"].param)
        forwards.append(all(torch.equal(p.detach(), master[n].to(LOW)) for n, p in model.named_parameters()))
        return low_loss(model, batch)

    pushes = [low_batch(client_batch(seed, rank, i)) for i in range(6)] if rank >= 2 else []
    sent, send = [], torch.distributed.send  # the dtypes of the weights a server sends (Note [An async pull ...])

    def recording_send(tensor, *args, **kwargs):
        sent.append(str(tensor.dtype))
        return send(tensor, *args, **kwargs)

    with pyengine.Engine(make_model(seed=rank).to(LOW), checking_loss, devices=["cpu"], mode="async", pin=False,
                         optimizer=pyengine.AdamW(**OPT), servers=2, max_staleness=0) as engine:
        held["store"] = engine.store
        checks = [shadow_checks(engine)]
        torch.distributed.send = recording_send
        try:
            engine.fit(pushes, steps=4)
        finally:
            torch.distributed.send = send
        checks.append(shadow_checks(engine, replicas=False))
        out = dict(checks=checks, forwards=forwards, master=engine.master_state_dict(), sent=sent)
    if rank == 2:  # max_staleness=0, one client: sequential training on its pushes from rank 0's weights
        with pyengine.Engine(make_model(seed=0).to(LOW), low_loss, devices=["cpu"], mode="async", pin=False,
                             optimizer=pyengine.AdamW(**OPT), max_staleness=0, process_group=None) as alone:
            alone.fit(pushes, steps=4)
            out["alone"] = alone.master_state_dict()
    return out


# 3 pushes; on 2 local workers 4/4 then 2/1; 1/- then 1/- (worker 1 sits this push out); 1/- then 3/3
ACCUMULATE = dict(sizes=(8, 3, 1, 1, 1, 6), accumulate=2)


def async_accumulate(seed, rank, world):
    """Rank 0 serves; rank 1 pushes with 2 local workers and accumulate=2 over mini-batches of different sizes, so
    each mini-batch splits its own way between the workers (max_staleness=0: sequential)."""
    batches = [client_batch(seed, rank, i, size=n) for i, n in enumerate(ACCUMULATE["sizes"])] if rank else []
    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"] * (2 if rank else 1), mode="async", pin=False,
                         optimizer=pyengine.AdamW(**OPT), accumulate=ACCUMULATE["accumulate"],
                         max_staleness=0) as engine:
        engine.fit(batches, epochs=1)
        return dict(history=engine.history, master=engine.master_state_dict())


SHARD = dict(steps=3, more=2, batch=29, ckpt_step=3)
SHARD_ENGINE = dict(devices=["cpu"] * 2, pin=False, bucket_mb=1e-5, first_bucket_mb=1e-5)  # one bucket per parameter
SHARD_SCHEDULE = pyengine.WarmupCosine(warmup_steps=2, total_steps=6)  # updates 4 and 5 at factors 0.854 and 0.5


def shard_state(seed, rank, world, amsgrad, out_dir):
    """A sharded engine: its store's size and ranges, a checkpoint after SHARD["steps"] steps (a collective), the
    weights and gathered state after SHARD["more"] further steps. Then a full state from a single-process engine
    loaded into a fresh sharded engine (each rank keeps its slice), and both continued side by side (these two with
    a learning-rate schedule, which the sharded update follows too)."""
    globals_ = global_batches(seed, SHARD["steps"] + SHARD["more"], SHARD["batch"])
    batches = [rank_slice(b, rank, world) for b in globals_]
    out = {}
    with pyengine.Engine(make_model(), loss_fn, optimizer=pyengine.AdamW(**OPT, amsgrad=amsgrad), shard_update=True,
                         **SHARD_ENGINE) as engine:
        store = engine.store
        out["store"] = dict(nbytes=store.nbytes, numel=store.numel, workers=store.workers,
                            state_ranges=list(store.state_ranges), state_numel=store.state_numel,
                            buckets=[(b.begin, b.end) for b in engine.workers[0].streamer.buckets])
        for b in batches[:SHARD["steps"]]:
            engine.step(b)
        checkpoint.save_engine(os.path.join(out_dir, "ckpt"), SHARD["ckpt_step"], engine, note="sharded")
        for b in batches[SHARD["steps"]:]:
            engine.step(b)
        out["continued"] = dict(master=engine.master_state_dict(), optimizer=engine.optimizer_state_dict())
    with pyengine.Engine(make_model(), loss_fn, optimizer=pyengine.AdamW(**OPT, amsgrad=amsgrad), process_group=None,
                         lr_schedule=SHARD_SCHEDULE, **SHARD_ENGINE) as single:
        for b in globals_[:SHARD["steps"]]:
            single.step(b)
        full = single.state_dict()
        with pyengine.Engine(make_model(seed=1), loss_fn, optimizer=pyengine.AdamW(**OPT, amsgrad=amsgrad),
                             shard_update=True, lr_schedule=SHARD_SCHEDULE, **SHARD_ENGINE) as sharded:
            sharded.load_state_dict(full)
            names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
            out["loaded_packed"] = {n: getattr(sharded.store, n).clone() for n in names}
            out["single_full"] = {n: getattr(single.store, n).clone() for n in names}
            for b, g in zip(batches[SHARD["steps"]:], globals_[SHARD["steps"]:]):
                sharded.step(b)
                single.step(g)
            out["loaded"] = dict(master=sharded.master_state_dict(), optimizer=sharded.optimizer_state_dict(),
                                 single_master=single.master_state_dict(),
                                 single_optimizer=single.optimizer_state_dict())
    return out


FAILING, ENDED = "pyengine-test: failing at", "pyengine-test: ended at"  # wall-clock stamps in the logs


def _stamp(what: str) -> None:
    """Prints ``what`` with the wall-clock time: the test measures how long the others took to notice a failure
    from these (not from the launch, which counts every process's imports on a loaded machine)."""
    print(f"{what} {time.time():.3f}", flush=True)


def _exit_now():
    _stamp(FAILING)
    os._exit(17)


def _fail(how, rank=1):
    """This rank fails: ``"exit"`` (status 17), ``"raise"`` or ``"hang"``."""
    _stamp(FAILING)
    if how == "exit":
        os._exit(17)
    if how == "raise":
        raise RuntimeError(f"rank {rank} fails on purpose")
    time.sleep(600)  # "hang": alive but silent; the group's timeout must end the others' wait


def failure(seed, rank, world, how):
    """Rank 1 dies, raises or hangs at its fourth hybrid step; the others must raise, not hang."""
    batches = [rank_slice(b, rank, world) for b in global_batches(seed, 50, 16)]
    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], optimizer=pyengine.AdamW(**OPT),
                         pin=False) as engine:
        for i, b in enumerate(batches):
            if rank == 1 and i == 3:
                _fail(how)
            engine.step(b)
    return {}


def death_between_steps(seed, rank, world, shard, dying, out_dir=None):
    """Rank ``dying`` exits (os._exit: no exception, nothing recorded) after its third hybrid step completed, before
    its fourth; the others (several buckets) must raise DistributedError naming it. With ``shard`` (the sharded
    update) they first gather the optimizer state (a collective: a checkpoint between steps) and fail in it; with
    ``out_dir`` (replicated) they first save a checkpoint there (checkpoint.save_engine) and fail in it."""
    batches = [rank_slice(b, rank, world) for b in global_batches(seed, 50, 16)]
    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], optimizer=pyengine.AdamW(**OPT), pin=False,
                         bucket_mb=0.0003, first_bucket_mb=0.0002, shard_update=shard) as engine:
        for i, b in enumerate(batches):
            if i == 3 and rank == dying:
                _exit_now()
            if i == 3 and shard:
                engine.optimizer_state_dict()
            if i == 3 and out_dir is not None:
                try:
                    checkpoint.save_engine(os.path.join(out_dir, "checkpoints"), 3, engine)
                except distributed.DistributedError:  # a rank that catches it and steps on is refused at once
                    began = time.monotonic()
                    try:
                        engine.step(b)
                    except distributed.DistributedError as refused:
                        print(f"the next step refused after {time.monotonic() - began:.3f} s: {refused}", flush=True)
                    raise
            engine.step(b)
    return {}


def async_gone_before_run(seed, rank, world, how):
    """Multi-node async: a first fit() completes; then rank 1 fails outside any run, before the second: ``"exit"``
    (os._exit, nothing said) or ``"record"`` (Engine.record_failure with its error, then exit, as a data loader's
    failure under the CLI). Rank 0 (the server) must name rank 1 in the second run's opening exchange."""
    data = [client_batch(seed, rank, i) for i in range(3)]
    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(**OPT),
                         pin=False) as engine:
        engine.fit(data if rank else [], steps=2)
        if rank == 1:
            if how == "record":
                engine.record_failure(RuntimeError("rank 1's data loader broke"))
            _exit_now()
        engine.fit(data if rank else [], steps=2)
    return {}


def failure_in_loss(seed, rank, world, how="raise"):
    """Rank 1's loss raises in one of its two local workers at its fourth hybrid step, while the reducer thread
    waits for that worker's buckets; the others are then in that step's collectives and must raise naming rank 1.
    ``how="exit"``: rank 1 exits there instead (os._exit, nothing recorded)."""
    batches = [rank_slice(b, rank, world) for b in global_batches(seed, 50, 16)]
    calls = []

    def failing_loss(model, batch):
        calls.append(1)
        if rank == 1 and len(calls) == 7:  # two workers, one call each per step: worker 0 or 1 of step 4
            _fail(how)
        return loss_fn(model, batch)

    with pyengine.Engine(make_model(), failing_loss, devices=["cpu"] * 2, optimizer=pyengine.AdamW(**OPT),
                         pin=False) as engine:
        for b in batches:
            engine.step(b)
    return {}


def reducer_after_failure(seed, rank, world):
    """Rank 1's loss raises in one of its two local workers at its second step. Its reducer thread waited for that
    worker's buckets for good, holding the engine (store, workers, group) until close(); it now ends by itself.
    Each rank reports its step's error and the reducer threads still alive up to 5 s after it, before close()."""
    batches = [rank_slice(b, rank, world) for b in global_batches(seed, 3, 16)]
    calls = []

    def failing_loss(model, batch):
        calls.append(1)
        if rank == 1 and len(calls) == 3:
            raise RuntimeError("injected")
        return loss_fn(model, batch)

    def reducers():
        return [t.name for t in threading.enumerate() if t.name == "pyengine-reducer"]

    with pyengine.Engine(make_model(), failing_loss, devices=["cpu"] * 2, optimizer=pyengine.AdamW(**OPT),
                         pin=False) as engine:
        error = None
        try:
            for b in batches:
                engine.step(b)
        except Exception as exc:  # noqa: BLE001 - reported
            error = type(exc).__name__
        deadline = time.monotonic() + 5.0
        while reducers() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"error": error, "reducers": reducers()}


def bad_local_batch(seed, rank, world):
    """Rank 1's fourth local batch has 1 sample for its 2 workers (a data set's uneven tail), and its sixth one label
    fewer than inputs (a batch that cannot be split): every rank refuses those steps together, each with its
    ValueError, and trains on from there. Records the errors, the version and the master weights after 7 batches
    (5 steps)."""
    batches = [rank_slice(b, rank, world) for b in global_batches(seed, 7, 16)]
    spoilt = {3: lambda b: tuple(t[:1] for t in b), 5: lambda b: (b[0], b[1][:-1])}
    errors = []
    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=pyengine.AdamW(**OPT),
                         pin=False) as engine:
        for i, b in enumerate(batches):
            try:
                engine.step(spoilt[i](b) if rank == 1 and i in spoilt else b)
            except ValueError as exc:
                errors.append((i, str(exc)))
        return {"errors": errors, "version": engine.version, "master": engine.master_state_dict()}


def async_failure(seed, rank, world):
    """The last rank (a client) dies after a few pushes: the server must raise."""
    batches = [client_batch(seed, rank, i) for i in range(200)] if rank else []
    calls = []

    def dying_loss(model, batch):
        calls.append(1)
        if rank == world - 1 and len(calls) == 4:
            _exit_now()  # mid-computation, between two exchanges with the server
        return loss_fn(model, batch)

    with pyengine.Engine(make_model(), dying_loss, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(**OPT),
                         pin=False) as engine:
        engine.fit(batches, steps=1000)
    return {}


SHARDED = dict(servers=2, pushes=14, free_pushes=10, per_client=30, clip=0.05, poison=2)
# the sequential run's lr schedule: every shard must use the coordinating server's step for it, as for the bias
# correction; and its biases without weight decay (the servers' shard spans cut through parameters)
SHARDED_SCHEDULE = pyengine.WarmupCosine(warmup_steps=3, total_steps=16, min_factor=0.1)
SHARDED_NO_DECAY = ("bias",)


def poisoned_batch(seed, rank, index):
    """Client ``rank``'s mini-batch ``index`` with a third entry: 0 per sample, or inf per sample for the poisoned
    index SHARDED["poison"], whose gradient is then inf in the last layer's bias only (the last server's shard)."""
    x, y = client_batch(seed, rank, index)
    flag = float("inf") if index == SHARDED["poison"] else 0.0
    return x, y, torch.full((len(y),), flag)


def poisoned_loss(model, batch):
    x, y, flag = batch
    return loss_fn(model, (x, y)) + flag.max() * model[2].bias.sum()


def _push_record(engine):
    return [{k: m[k] for k in ("rank", "push_id", "applied", "version_at_pull", "staleness", "server", "adam_step",
                               "lr")}
            for m in engine.history if "server" in m]


def async_sharded(seed, rank, world):
    """SHARDED["servers"] server ranks, the others clients. First max_staleness=0 with clipping, an lr schedule and
    one poisoned push (a sequential reference exists); then unbounded staleness with inverse lr and accumulate=2
    (only the bookkeeping is checked). Also records the errors for a bad number of servers."""
    servers = SHARDED["servers"]
    out = {"errors": []}
    for bad in (world, world + 3):
        try:
            pyengine.Engine(make_model(), loss_fn, devices=["cpu"], mode="async", pin=False, servers=bad)
        except ValueError as exc:
            out["errors"].append(str(exc))
    batches = [poisoned_batch(seed, rank, i) for i in range(SHARDED["per_client"])] if rank >= servers else []
    runs = (("sequential", dict(max_staleness=0, lr_schedule=SHARDED_SCHEDULE), SHARDED["pushes"], batches),
            ("free", dict(staleness_lr="inverse", accumulate=2), SHARDED["free_pushes"], [b[:2] for b in batches]))
    for name, options, pushes, data in runs:
        opt = pyengine.AdamW(**OPT, max_grad_norm=SHARDED["clip"] if name == "sequential" else None,
                             no_decay=SHARDED_NO_DECAY if name == "sequential" else ())
        with pyengine.Engine(make_model(), poisoned_loss if name == "sequential" else loss_fn, devices=["cpu"],
                             mode="async", optimizer=opt, pin=False, servers=servers, **options) as engine:
            mid_run = []

            def read_state_once(engine, metrics):  # Note [A state during a multi-node async run]: refused
                if not mid_run:
                    try:
                        mid_run.append(engine.state_dict()["version"])
                    except RuntimeError as exc:
                        mid_run.append(str(exc))

            engine.fit(data, steps=pushes, callbacks=[read_state_once] if name == "sequential" else ())
            out.setdefault("mid_run", mid_run)
            out[name] = dict(history=_push_record(engine) if rank < servers else engine.history,
                             stats=engine.stats(), master=engine.master_state_dict(),
                             optimizer=engine.optimizer_state_dict())
    return out


def async_client_steps(seed, rank, world):
    """Rank 0 serves with no steps; rank 1 (a client) fits 4 batches with steps=3 (its steps were ignored and its
    list cycled for ever: the run never ended). A BatchNorm model: records each rank's counters, master weights and
    buffers (Note [The servers hold a client's statistics])."""
    batches = [client_batch(seed, rank, i) for i in range(4)] if rank else []
    with pyengine.Engine(make_bn_model(), loss_fn, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(**OPT),
                         pin=False) as engine:
        engine.fit(batches, **({"steps": 3} if rank else {}))
        return {"stats": engine.stats(), "version": engine.version, "master": engine.master_state_dict(),
                "buffers": engine.buffers_state_dict()}


def async_nonfinite_raise(seed, rank, world):
    """One server; the client's third push is non-finite under nonfinite="raise": what each rank's fit raised, then a
    fit on clean batches (one server holds the whole store: the engine goes on)."""
    poisoned = [poisoned_batch(seed, rank, i) for i in range(6)] if rank else []
    clean = [(x, y, torch.zeros(len(y))) for x, y, _ in poisoned]
    out = {}
    with pyengine.Engine(make_model(), poisoned_loss, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(**OPT),
                         pin=False, nonfinite="raise") as engine:
        try:
            engine.fit(poisoned, steps=6)
            out["first"] = "returned"
        except Exception as exc:  # noqa: BLE001 - what it raised is the test's subject
            out["first"] = f"{type(exc).__name__}: {exc}"
        engine.fit(clean, steps=3)
        out["stats"] = engine.stats()
    return out


def async_split_after_failure(seed, rank, world):
    """Note [A failed run of several servers]: 2 servers, one client whose third push is non-finite under
    nonfinite="raise". Every rank's first fit fails; then each records what a second fit and the state readers
    raise (the next fit trained on a store whose server-1 shard had gone back to the failed run's start)."""
    batches = [poisoned_batch(seed, rank, i) for i in range(SHARDED["per_client"])] if rank >= 2 else []
    out = {}

    class NoData:  # iter() raises (it left the next run's start out of step: every rank timed out there)
        def __iter__(self):
            raise ValueError("no data today")

    def no_item():  # fails at its first item
        raise ValueError("no data today")
        yield

    # a run that fails before any push is applied changes no shard: the next one goes on
    with pyengine.Engine(make_model(), poisoned_loss, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(**OPT),
                         pin=False, servers=2) as engine:
        for how, data in (("early", NoData()), ("first", no_item())):
            try:
                engine.fit(data if rank >= 2 else [], steps=3)
                out[how] = "returned"
            except Exception as exc:  # noqa: BLE001 - what it raised is the test's subject
                out[how] = f"{type(exc).__name__}: {exc}"
        engine.fit(batches[:2], steps=2)
        out["after_early"] = engine.version
    with pyengine.Engine(make_model(), poisoned_loss, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(**OPT),
                         pin=False, servers=2, nonfinite="raise") as engine:
        for what, call in (("fit", lambda: engine.fit(batches, steps=SHARDED["pushes"])),
                           ("again", lambda: engine.fit(batches, steps=SHARDED["pushes"])),
                           ("state", engine.state_dict), ("master", engine.master_state_dict),
                           ("save", lambda: checkpoint.save_engine(tempfile.mkdtemp(), 1, engine))):
            try:
                call()
                out[what] = "returned"
            except Exception as exc:  # noqa: BLE001 - what each call raised is the test's subject
                out[what] = f"{type(exc).__name__}: {exc}"
    return out


def async_client_failure(seed, rank, world, servers, how):
    """``servers`` server ranks; the last rank (a client) exits, raises or hangs mid-computation after a few pushes:
    every other rank must raise DistributedError naming it."""
    batches = [client_batch(seed, rank, i) for i in range(200)] if rank >= servers else []
    calls = []

    def failing_loss(model, batch):
        calls.append(1)
        if rank == world - 1 and len(calls) == 4:
            _fail(how, rank)
        return loss_fn(model, batch)

    with pyengine.Engine(make_model(), failing_loss, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(**OPT),
                         pin=False, servers=servers) as engine:
        engine.fit(batches, steps=1000)
    return {}


def async_server_failure(seed, rank, world, servers, how):
    """``servers`` server ranks; server ``servers - 1`` (rank 0, the coordinator, when it is the only one) exits,
    raises or hangs in a callback after applying its fourth push (hang: holding the server's mutex, as an update that
    never ends): every other rank must raise DistributedError naming it."""
    failing = servers - 1
    batches = [client_batch(seed, rank, i) for i in range(200)] if rank >= servers else []

    def failing_callback(engine, metrics):
        if rank == failing and len(engine.history) == 4:
            _fail(how, rank)

    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(**OPT),
                         pin=False, servers=servers) as engine:
        engine.fit(batches, steps=1000, callbacks=[failing_callback])
    return {}


def async_server_code_raises(seed, rank, world, servers):
    """``servers`` server ranks; server ``servers - 1``'s own code raises (outside any exchange: a stand-in for a
    bug or a failed allocation) while it prepares the weights for its client's fourth pull: the client waits for
    them, and must raise DistributedError naming that server at once, not at the group's timeout."""
    failing = servers - 1
    batches = [client_batch(seed, rank, i) for i in range(200)] if rank >= servers else []
    if rank == failing:
        stopped, calls = distributed.AsyncServer._stopped, []

        def raising(self):
            if sys._getframe(1).f_code.co_name == "_send_header":
                calls.append(1)
                if len(calls) == 4:
                    _stamp(FAILING)
                    raise MemoryError(f"rank {rank}'s own code fails on purpose")
            return stopped(self)

        distributed.AsyncServer._stopped = raising
    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(**OPT),
                         pin=False, servers=servers) as engine:
        engine.fit(batches, steps=1000)
    return {}


def async_finished_client(seed, rank, world, servers, how):
    """``servers`` server ranks; the first client runs out of data after two pushes and ends normally, then the last
    rank (a client) exits or raises: the finished client must raise DistributedError naming it too."""
    count = 2 if rank == servers else 200
    batches = [client_batch(seed, rank, i) for i in range(count)] if rank >= servers else []
    calls = []

    def failing_loss(model, batch):
        calls.append(1)
        if rank == world - 1 and len(calls) == 6:
            time.sleep(1.0)  # the first client has long ended
            _fail(how, rank)
        return loss_fn(model, batch)

    with pyengine.Engine(make_model(), failing_loss, devices=["cpu"], mode="async", optimizer=pyengine.AdamW(**OPT),
                         pin=False, servers=servers) as engine:
        engine.fit(batches, steps=1000, epochs=1)  # one pass: the first client runs out of data
    return {}


def overlap(seed, rank, world):
    """Hybrid (replicated and sharded), 2 local workers, several buckets; the first layer's weight gradient (the last
    bucket) is held back 1.0 s in backward, so the earlier buckets' allreduce can only be launched before the workers
    finish if it overlaps backward. Returns each step's overlapped_buckets and the bucket count."""
    batches = [rank_slice(b, rank, world) for b in global_batches(seed, 3, 24)]
    hooked = set()

    def slow_first_layer_loss(model, batch):
        if id(model) not in hooked:  # once per replica
            hooked.add(id(model))
            model[0].weight.register_hook(lambda grad: (time.sleep(1.0), grad)[1])
        return loss_fn(model, batch)

    out = {}
    for name, shard in (("replicated", False), ("sharded", True)):
        with pyengine.Engine(make_model(), slow_first_layer_loss, devices=["cpu"] * 2, pin=False,
                             optimizer=pyengine.AdamW(**OPT), bucket_mb=0.0003, first_bucket_mb=0.0002,
                             shard_update=shard) as engine:
            out[name] = dict(overlapped=[engine.step(b)["overlapped_buckets"] for b in batches],
                             buckets=len(engine.workers[0].streamer.buckets))
    return out


def dropout_resume(seed, rank, world):
    """One worker per rank (the torchrun layout), a model with dropout: the first step's masks of each rank, and the
    weights of 3 straight steps against 1 step, rank 0's state loaded on every rank (as the CLI's checkpoint), then
    2 more steps (Note [Random numbers of concurrent workers])."""
    batches = [rank_slice(b, rank, world) for b in global_batches(seed, 3, 16)]
    masks = []

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(D_IN, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, CLASSES))

    def recording_loss(m, batch):
        hidden = m[1](m[0](batch[0]))
        masks.append(hidden == 0)
        return torch.nn.functional.cross_entropy(m[2](hidden), batch[1])

    def engine():
        return pyengine.Engine(model(), recording_loss, devices=["cpu"], pin=False, seed=seed)

    with engine() as straight:
        for b in batches:
            straight.step(b)
        expected = straight.master_state_dict()
    first_mask = masks[0]
    with engine() as first:
        first.step(batches[0])
        state = [first.state_dict() if rank == 0 else None]
    torch.distributed.broadcast_object_list(state, src=0)
    with engine() as resumed:
        resumed.load_state_dict(state[0])
        for b in batches[1:]:
            resumed.step(b)
        got = resumed.master_state_dict()
    return dict(first_mask=first_mask, resumed_equal=all(torch.equal(expected[k], got[k]) for k in expected))


def dropout_uneven(seed, rank, world):
    """Rank 0 with 2 local workers, rank 1 with 1, a model with dropout, one step with 2 samples per worker: each
    worker's mask."""
    masks = []

    def recording_loss(m, batch):
        hidden = m[1](m[0](batch[0]))
        masks.append(hidden == 0)
        return torch.nn.functional.cross_entropy(m[2](hidden), batch[1])

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, CLASSES))
    workers = 2 if rank == 0 else 1
    with pyengine.Engine(model, recording_loss, devices=["cpu"] * workers, pin=False, seed=seed) as engine:
        engine.step(global_batches(seed + rank, 1, 2 * workers)[0])
    return dict(masks=masks)


def save_fails(seed, rank, world, out_dir):
    """checkpoint.save_engine where rank 0 cannot write (its directory is a file): every rank must raise the same
    CheckpointError naming rank 0's file and error, and the group stays in step: each rank catches it and trains on."""
    blocker = os.path.join(out_dir, "not-a-directory")
    if rank == 0:
        open(blocker, "w").close()
    batches = [rank_slice(b, rank, world) for b in global_batches(seed, 3, 12)]
    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], optimizer=pyengine.AdamW(**OPT), pin=False) as eng:
        eng.step(batches[0])
        try:
            checkpoint.save_engine(os.path.join(blocker, "ckpt"), 1, eng)
            error = None
        except checkpoint.CheckpointError as exc:
            error = str(exc)
        try:  # each rank another step: refused on every rank, nothing written
            checkpoint.save_engine(os.path.join(out_dir, "steps"), 1 + rank, eng)
            steps_error = None
        except ValueError as exc:
            steps_error = str(exc)
        # each rank another directory: every rank returns the file rank 0 wrote
        returned = checkpoint.save_engine(os.path.join(out_dir, f"dir-of-rank-{rank}"), 1, eng)
        for batch in batches[1:]:
            eng.step(batch)
        return {"error": error, "version": eng.version, "weights": eng.master_state_dict(), "steps_error": steps_error,
                "returned": str(returned), "exists": os.path.exists(returned)}


def uneven_steps(seed, rank, world, shard):
    """Rank 0 steps 4 batches, rank 1 3 (uneven data, stepped by hand), then each saves a checkpoint: rank 0's fourth
    step meets rank 1's checkpoint exchange (Note [Exchanges that pair up wrongly]). Each rank records its error, then
    whether the next step is refused at once."""
    batches = [rank_slice(b, rank, world) for b in global_batches(seed, 4 - rank, 12)]
    out = {}
    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], optimizer=pyengine.AdamW(**OPT), pin=False,
                         shard_update=shard) as engine:
        try:
            for batch in batches:
                engine.step(batch)
            checkpoint.save_engine(tempfile.mkdtemp(), 3, engine)
            out["error"] = None
        except distributed.DistributedError as exc:
            out["error"] = str(exc)
        try:
            engine.step(batches[0])
            out["next"] = None
        except distributed.DistributedError as exc:
            out["next"] = str(exc)
    return out


# Note [Ranks whose fits end at different steps]: what the last rank does in fit while the others fit 4 batches
FIT_ENDS = {
    "even": lambda engine, batches: engine.fit(batches),  # 4 batches too: no warning anywhere
    "data": lambda engine, batches: engine.fit(batches[:3]),  # its data ends a batch early
    "steps": lambda engine, batches: engine.fit(batches, steps=2),
    "stop": lambda engine, batches: engine.fit(batches, callbacks=[
        lambda e, m: e.stop() if e.version == 2 else None]),
    "callback": lambda engine, batches: engine.fit(batches, callbacks=[
        lambda e, m: (_ for _ in ()).throw(ValueError("the callback's own error")) if e.version == 2 else None]),
    "iterator": lambda engine, batches: engine.fit(_raising_after(batches, 3)),
    "empty": lambda engine, batches: engine.fit([], steps=4),
    "zero": lambda engine, batches: engine.fit(batches, steps=0),
    # its step 3 raises before its first collective: an lr its own callback set after step 2 is refused
    "schedule": lambda engine, batches: engine.fit(batches, callbacks=[
        lambda e, m: setattr(e.optimizer, "lr", float("inf")) if e.version == 2 else None]),
    "argument": lambda engine, batches: engine.fit(batches, steps=-1),  # refused by fit's checks on that rank alone
    "everywhere": lambda engine, batches: engine.fit(batches, steps=-1),  # refused by every rank's checks alike
    "by-hand": None,  # the others step by hand while the last rank's fit over no batch ends at once
}


def _raising_after(batches, n):
    yield from batches[:n]
    raise OSError("the loader's own error")


def fits_end(seed, rank, world, kind, case):
    """Every rank but the last fits its 4 batches; the last does FIT_ENDS[case] (by-hand: the others call step()
    4 times while the last fits []). ``kind``: hybrid "replicated" or "sharded" (each rank its part of each
    batch), "pipeline" (a stage per rank, each given the whole batches) or "pipeline-replicas" (2 stages x
    world / 2 replicas, each rank given the whole batches: Note [Replicas of stages across processes]). Each rank
    records what fit (or its steps) raised and warned, its version, its master weights, and whether the group is
    usable after: one step more on every rank, then a checkpoint."""
    whole = global_batches(seed, 4, 12)
    pipeline = kind.startswith("pipeline")
    batches = whole if pipeline else [rank_slice(b, rank, world) for b in whole]
    last = rank == world - 1
    out = {"error": None, "type": None}
    mode = (dict(mode="pipeline", microbatches=2, **(dict(stages=2) if kind == "pipeline-replicas" else {}))
            if pipeline else dict(shard_update=kind == "sharded"))
    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], optimizer=pyengine.AdamW(**OPT), pin=False,
                         **mode) as engine:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if case == "by-hand":
                    if last:
                        engine.fit([])
                    else:
                        for batch in batches:
                            engine.step(batch)
                else:
                    (FIT_ENDS[case] if last or case == "everywhere" else FIT_ENDS["even"])(engine, batches)
            except Exception as exc:  # noqa: BLE001 - recorded
                out["error"], out["type"] = str(exc), type(exc).__name__
        out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        out["version"] = engine.version
        out["master"] = engine.master_state_dict()
        engine.optimizer.lr = OPT["lr"]  # as before the schedule case's callback
        engine.step(batches[0])  # the group is usable: every rank steps once more
        naming = engine.dist if engine.dist is not None else engine.pipeline
        out["phase"] = (naming.phase, naming.phase_name)  # alike: a failure would be named right
        checkpoint.save_engine(tempfile.mkdtemp(), engine.version, engine)
        out["after"] = engine.version
    return out


def fails_alone(seed, rank, world, kind, where):
    """Note [A step that fails on one rank after its last collective]: every rank fits its 4 batches; the last rank's
    step 3 raises after its last collective (``where``: its copy back into the replica, or its update of the reduced
    gradient; a pipeline stage's update of its range). ``kind`` as fits_end's. Each rank records what fit raised
    and its version; the failing rank what its next step() raised (the others do not step: that is a collective).
    Then every rank loads the state its callback saved after step 2, the failure gone, and fits batches 3 and 4:
    its version and master weights."""
    whole = global_batches(seed, 4, 12)
    pipeline = kind == "pipeline"
    batches = whole if pipeline else [rank_slice(b, rank, world) for b in whole]
    last = rank == world - 1
    out = {"error": None, "type": None, "refused": None}
    mode = dict(mode="pipeline", microbatches=2) if pipeline else dict(shard_update=kind == "sharded")
    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], optimizer=pyengine.AdamW(**OPT), pin=False,
                         **mode) as engine:
        saved = {}

        def keep(e, metrics):
            if e.version == 2:
                saved["state"] = e.state_dict()

        def failing(original, what):
            def call(*args, **kwargs):
                if engine.version == 3:  # step 3 counted (its update began)
                    raise RuntimeError(f"rank {rank}'s {what} error")
                return original(*args, **kwargs)
            return call

        target, name = (engine.workers[0], "pull") if where == "copy-back" else (engine, "update_range")
        if last:
            setattr(target, name, failing(getattr(target, name), where.replace("-", " ")))
        try:
            engine.fit(batches, callbacks=[keep])
        except Exception as exc:  # noqa: BLE001 - recorded
            out["error"], out["type"] = str(exc), type(exc).__name__
        out["version"] = engine.version
        if last:
            try:
                engine.step(batches[0])
            except RuntimeError as exc:
                out["refused"] = str(exc)
            delattr(target, name)  # the instance's failing method: the class's again
        engine.load_state_dict(saved["state"])
        engine.fit(batches[2:])
        out["after"] = engine.version
        out["master"] = engine.master_state_dict()
    return out


def fits_end_first(seed, rank, world):
    """Rank 0's fit takes 2 of its batches, the other ranks' all 4 (replicated): the ranks still stepping (several)
    end with rank 0. Records what each warned, its version, master weights, and one step more."""
    batches = [rank_slice(b, rank, world) for b in global_batches(seed, 4, 12)]
    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], optimizer=pyengine.AdamW(**OPT), pin=False) as engine:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.fit(batches[:2] if rank == 0 else batches)
        out = {"warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
               "version": engine.version, "master": engine.master_state_dict()}
        engine.step(batches[0])
        out["after"] = engine.version
    return out


def fits_raise_together(seed, rank, world):
    """Every rank but rank 0 fits with a callback that raises after step 2 (each its own error), rank 0 fits its 4
    batches (replicated): rank 0's fit raises PeerEndedFit naming every error, each other rank raises its own.
    Records what each raised and warned, its version, master weights, and one step more."""
    batches = [rank_slice(b, rank, world) for b in global_batches(seed, 4, 12)]
    out = {"error": None, "type": None}

    def failing(engine, metrics):
        if engine.version == 2:
            raise ValueError(f"rank {rank}'s callback error")

    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"], optimizer=pyengine.AdamW(**OPT), pin=False) as engine:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                engine.fit(batches, callbacks=[failing] if rank else [])
            except Exception as exc:  # noqa: BLE001 - recorded
                out["error"], out["type"] = str(exc), type(exc).__name__
        out.update(warnings=[str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
                   version=engine.version, master=engine.master_state_dict())
        engine.step(batches[0])
        out["after"] = engine.version
    return out


class Masked(torch.nn.Module):
    """Tanh times a persistent buffer registered expanded, which the forward assigns expanded again (a mask)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.ones(1, HIDDEN).expand(2, HIDDEN))

    def forward(self, x):
        self.mask = self.mask[:1].expand(2, HIDDEN)
        return x.tanh() * self.mask[0]


def expanded_buffers(seed, rank, world):
    """make_model with its Tanh as Masked: a replicated hybrid engine (2 local workers) on this rank's part of 3
    batches, then a pipeline (a stage per rank) on the whole batches. Records each's version, master weights and
    buffers (Note [Buffers that are not saved]: the construction failed, copy_ into an expanded view)."""
    out = {}
    for kind in ("hybrid", "pipeline"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), Masked(), torch.nn.Linear(HIDDEN, CLASSES))
        whole = global_batches(seed, 3, 12)
        options = dict(mode="pipeline", microbatches=2) if kind == "pipeline" else dict(devices=["cpu"] * 2)
        with pyengine.Engine(model, loss_fn, optimizer=pyengine.AdamW(**OPT), pin=False,
                             **{"devices": ["cpu"], **options}) as engine:
            engine.fit(whole if kind == "pipeline" else [rank_slice(b, rank, world) for b in whole])
            out[kind] = dict(version=engine.version, master=engine.master_state_dict(),
                             buffers=engine.state_dict()["buffers"])
    return out


def shard_one_rank(seed, rank, world):
    """A group of 1 rank (torchrun --nproc-per-node 1): shard_update=True with process_group="auto"."""
    try:
        pyengine.Engine(make_model(), loss_fn, devices=["cpu"], pin=False, shard_update=True)
        return dict(error=None)
    except ValueError as exc:
        return dict(error=str(exc))


MISMATCHES = {  # Note [Every rank's engine alike]: what rank 1 changes, one case at a time
    "lr": lambda rank: dict(optimizer=pyengine.AdamW(**{**OPT, "lr": OPT["lr"] * (1 + rank)})),
    "shape": lambda rank: dict(model=torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN + rank), torch.nn.Tanh(),
                                                          torch.nn.Linear(HIDDEN + rank, CLASSES))),
    "shard_update": lambda rank: dict(shard_update=rank == 1),
    "mode": lambda rank: dict(mode="async" if rank == 1 else "hybrid"),
    "seed": lambda rank: dict(seed=rank),
    "eval": lambda rank: dict(model=make_model().train(rank == 0)),  # rank 1's model in eval mode
    # what may differ, or is alike: accepted by the check
    "microbatches": lambda rank: dict(microbatches=1 + 3 * rank),  # hybrid: a local memory setting
    "nan": lambda rank: dict(bucket_mb=float("nan")),  # alike (NaN equals NaN): the bucket check then refuses it
    # rank 1 fails its own checks first: rank 0 names it
    "local": lambda rank: dict(devices=["meta"] if rank == 1 else ["cpu"]),
}


def mismatch(seed, rank, world):
    """Engines built differently on rank 1, one case at a time: every rank must raise the same ValueError at once.
    Then engines built alike (rank 1 with another number of local workers, which may differ) train a step."""
    out = {"errors": {}}
    for case, change in MISMATCHES.items():
        options = dict(model=make_model(), devices=["cpu"], optimizer=pyengine.AdamW(**OPT), pin=False)
        options.update(change(rank))
        start = time.monotonic()
        try:
            with pyengine.Engine(options.pop("model"), loss_fn, **options) as engine:
                engine.step(rank_slice(global_batches(seed, 1, 12)[0], rank, world))
            out["errors"][case] = None
        except ValueError as exc:
            out["errors"][case] = (str(exc), time.monotonic() - start)
    batch = rank_slice(global_batches(seed, 1, 12)[0], rank, world)
    with pyengine.Engine(make_model(), loss_fn, devices=["cpu"] * (1 + rank), optimizer=pyengine.AdamW(**OPT),
                         pin=False) as engine:
        out["applied"] = engine.step(batch)["applied"]
        out["master"] = engine.master_state_dict()
    return out


def main():
    scenario, out_dir, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    gc.disable()  # only reference counting may free the engines: checked at the end
    # The group's timeout (2-3 s in the hang scenarios) also bounds its rendezvous: every rank first waits here, as
    # long as it takes, for every other to have started (a loaded machine imports torch at different paces)
    started = torch.distributed.FileStore(os.path.join(out_dir, "started"), int(os.environ["WORLD_SIZE"]))
    started.set_timeout(datetime.timedelta(seconds=120))
    started.set(f"rank{os.environ['RANK']}", "up")
    started.wait([f"rank{r}" for r in range(int(os.environ["WORLD_SIZE"]))])
    distributed.init_process_group("gloo", timeout_s=float(os.environ.get("PYENGINE_TEST_PG_TIMEOUT", "20")))
    del started
    group = weakref.ref(torch.distributed.group.WORLD)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    scenarios = {"hybrid": hybrid, "async": lambda s, r, w: asynchronous(s, r, w, out_dir), "async-failure": async_failure,
                 "shard-state": lambda s, r, w: shard_state(s, r, w, False, out_dir),
                 "shard-state-amsgrad": lambda s, r, w: shard_state(s, r, w, True, out_dir),
                 "async-sharded": async_sharded,
                 **{f"async-client-{how}-{k}": lambda s, r, w, k=k, how=how: async_client_failure(s, r, w, k, how)
                    for how in ("exit", "raise") for k in (1, 2)},
                 **{f"async-finished-{how}-{k}": lambda s, r, w, k=k, how=how: async_finished_client(s, r, w, k, how)
                    for how in ("exit", "raise") for k in (1, 2)},
                 **{f"async-server-{how}-{k}": lambda s, r, w, k=k, how=how: async_server_failure(s, r, w, k, how)
                    for how in ("exit", "raise") for k in (1, 2)},
                 **{f"async-server-code-raises-{k}": lambda s, r, w, k=k: async_server_code_raises(s, r, w, k)
                    for k in (1, 2)},
                 **{f"async-{who}-hang-{k}": lambda s, r, w, k=k, run=run: run(s, r, w, k, "hang")
                    for who, run in (("server", async_server_failure), ("client", async_client_failure))
                    for k in (1, 2)},
                 **{f"death-{name}-{d}": lambda s, r, w, shard=shard, d=d: death_between_steps(s, r, w, shard, d)
                    for name, shard in (("replicated", False), ("sharded", True)) for d in (0, 1)},
                 "death-checkpoint-1": lambda s, r, w: death_between_steps(s, r, w, False, 1, out_dir),
                 "kept-works": lambda s, r, w: kept_works(s, r, w, out_dir),
                 "failure-loss": failure_in_loss, "failure-loss-exit": lambda s, r, w: failure_in_loss(s, r, w, "exit"),
                 "overlap": overlap, "bad-local-batch": bad_local_batch, "reducer-after-failure": reducer_after_failure, "mismatch": mismatch, "dropout-resume": dropout_resume,
                 "dropout-uneven": dropout_uneven, "nonfinite-raise": nonfinite_raise, "unfollowed-state": unfollowed_state,
                 "shard-one-rank": shard_one_rank,
                 **{f"uneven-steps-{name}": lambda s, r, w, shard=shard: uneven_steps(s, r, w, shard)
                    for name, shard in (("replicated", False), ("sharded", True))},
                 **{f"fit-ends-{case}-{kind}": lambda s, r, w, kind=kind, case=case: fits_end(s, r, w, kind, case)
                    for kind in ("replicated", "sharded", "pipeline", "pipeline-replicas") for case in FIT_ENDS},
                 **{f"fails-alone-{where}-{kind}": lambda s, r, w, kind=kind, where=where: fails_alone(s, r, w, kind,
                                                                                                     where)
                    for kind, where in (("replicated", "copy-back"), ("sharded", "copy-back"),
                                        ("replicated", "update"), ("pipeline", "update"))},
                 "fit-ends-first": fits_end_first, "fits-raise-together": fits_raise_together,
                 "expanded-buffers": expanded_buffers,
                 "save-fails": lambda s, r, w: save_fails(s, r, w, out_dir),
                 **{f"async-gone-{how}": lambda s, r, w, how=how: async_gone_before_run(s, r, w, how)
                    for how in ("exit", "record")}, "load-divergence": lambda s, r, w: load_divergence(s, r, w, out_dir), "hybrid-fp16": hybrid_fp16,
                 "low-precision": low_precision, "low-precision-async": low_precision_async,
                 "frozen-rank0": frozen_rank0, "async-client-callback": async_client_callback,
                 "async-client-steps": async_client_steps, "async-split": async_split_after_failure,
                 "async-nonfinite-raise": async_nonfinite_raise,
                 **{f"async-refresh-stop-{k}": lambda s, r, w, k=k: async_refresh_at_stop(s, r, w, k, out_dir)
                    for k in (1, 2)},
                 **{f"async-client-raises-{how}": lambda s, r, w, how=how: async_client_raises(s, r, w, how)
                    for how in ("callback", "iter")},
                 **{f"async-close-{who}": lambda s, r, w, who=who: async_close(s, r, w, who)
                    for who in ("server", "callback", "client")},
                 "async-fp16": async_fp16, "async-accumulate": async_accumulate,
                 **{f"failure-{how}": lambda s, r, w, how=how: failure(s, r, w, how)
                    for how in ("exit", "raise", "hang")}}
    try:
        result = scenarios[scenario](seed, rank, world)
    except BaseException:
        _stamp(ENDED)
        raise
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    del result
    torch.distributed.destroy_process_group()
    # the scenario's engines are gone, so destroy_process_group() freed the group (no reference cycle kept it for
    # interpreter shutdown: Note [No reference cycle through the engine])
    with open(os.path.join(out_dir, f"rank{rank}.teardown"), "w") as f:
        f.write("group alive" if group() is not None else "group freed")


if __name__ == "__main__":
    main()
