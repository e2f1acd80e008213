"""Multi-process runs on localhost (gloo, CPU workers): each test starts P ranks of tests/dist_job.py with a
torchrun-like environment, bounds their time, and checks what they wrote against an independent reference
(torch.optim in float64 on the concatenated batches) and against each other (bit for bit)."""
import copy
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dist_job
import pyengine
import zygote
from conftest import fresh_seed
from zygote import free_port
from pyengine import checkpoint, cli, distributed

REPO = Path(__file__).resolve().parents[1]
JOB = Path(__file__).resolve().parent / "dist_job.py"


def launch(scenario, world, tmp_path, seed, timeout=70.0, pg_timeout=20.0, grace=15.0, main=0, hung=()):
    """Runs ``world`` ranks of ``scenario``. Waits up to ``timeout`` s for rank ``main``, then up to ``grace`` s more
    for the others but the ``hung`` ranks (which never end by themselves), and kills whatever still runs. Returns
    ([returncode, None if killed], [log], seconds until rank ``main`` ended). A launch whose port was taken between
    free_port() and rank 0's bind (another process got it meanwhile) is run again once on another port."""
    for attempt in range(2):
        if attempt:  # the ranks' start barrier (dist_job.main) of the first attempt: the rest is written anew
            (tmp_path / "started").unlink(missing_ok=True)
        codes, logs, seconds = _launch(scenario, world, tmp_path, seed, timeout, pg_timeout, grace, main, hung)
        if not any("EADDRINUSE" in log for log in logs):
            break
    return codes, logs, seconds


def _launch(scenario, world, tmp_path, seed, timeout, pg_timeout, grace, main, hung):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYENGINE_TEST_PG_TIMEOUT=str(pg_timeout))
    procs, paths = [], [tmp_path / f"rank{rank}.log" for rank in range(world)]
    start = time.monotonic()
    for rank, path in enumerate(paths):
        procs.append(zygote.start([str(JOB), scenario, str(tmp_path), str(seed)], dict(env, RANK=str(rank)), path,
                                  rank=rank))
    codes, seconds = [None] * world, None
    try:
        for rank in [main] + [r for r in range(world) if r != main and r not in hung] + list(hung):
            limit = start + timeout if rank == main else 0.0 if rank in hung else start + seconds + grace
            try:
                codes[rank] = procs[rank].wait(timeout=max(0.1, limit - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if rank == main:
                seconds = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    logs = [path.read_text() for path in paths]
    assert codes[main] is not None, f"{scenario}: rank {main} still running after {timeout} s:\n" + "\n".join(logs)
    return codes, logs, seconds


@pytest.mark.timeout(120)
def test_a_forked_process_runs_and_exits_as_a_fresh_interpreter_would(tmp_path, monkeypatch):
    """tests/zygote.py: a script, ``-m module`` or ``-c code`` gets its own argv, sys.path[0], environment, working
    directory and stdout/stderr files, a non-daemon thread is joined and atexit runs at its end, and its exit code
    is Popen's: sys.exit(n) -> n, an uncaught exception -> 1 (its traceback on stderr), killed -> -SIGKILL."""
    body = ("import atexit, os, sys, threading, time\n"
            "print('argv', sys.argv[1:], 'env', os.environ.get('JOB_VALUE'), 'stale', os.environ.get('JOB_STALE'))\n"
            "print('path0', repr(sys.path[0]), 'main', __name__, 'cwd', os.getcwd(), flush=True)\n"
            "atexit.register(lambda: print('atexit ran', flush=True))\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('thread joined', flush=True))).start()\n"
            "how = sys.argv[1]\n"
            "if how == 'raise': raise ValueError('from the job')\n"
            "if how == 'sleep': time.sleep(600)\n"
            "sys.exit(int(how))\n")
    (tmp_path / "job.py").write_text(body)
    work, lib = tmp_path / "work", tmp_path / "lib"
    work.mkdir()
    lib.mkdir()
    (lib / "jobmodule.py").write_text(body)  # found on the child's PYTHONPATH
    monkeypatch.setenv("JOB_STALE", "the server's")  # the server's own environment: not the child's
    server = zygote._Server()
    env = {k: v for k, v in os.environ.items() if k != "JOB_STALE"}
    kinds = {"script": ([str(tmp_path / "job.py")], repr(str(tmp_path))),
             "module": (["-m", "jobmodule"], repr(str(work))), "code": (["-c", body], repr(""))}
    started, sleeper = {}, None
    try:
        for kind, (argv, _) in kinds.items():
            for how in ("0", "3", "raise"):
                started[kind, how] = server.start([*argv, how], dict(env, JOB_VALUE=how, PYTHONPATH=f"{lib}:{REPO}"),
                                                  tmp_path / f"{kind}-{how}.out", tmp_path / f"{kind}-{how}.err", work)
        sleeper = server.start([str(tmp_path / "job.py"), "sleep"], env, tmp_path / "sleep.out")
        assert {key: p.wait(timeout=60) for key, p in started.items()} == {
            (kind, how): {"0": 0, "3": 3, "raise": 1}[how] for kind, how in started}
        assert sleeper.poll() is None
        sleeper.kill()
        assert sleeper.wait(timeout=30) == -signal.SIGKILL
    finally:  # none left running when an assertion failed
        for p in [*started.values(), sleeper]:
            if p is not None:
                p.kill()
    for (kind, how) in started:
        out, err = (tmp_path / f"{kind}-{how}.out").read_text(), (tmp_path / f"{kind}-{how}.err").read_text()
        assert f"argv ['{how}'] env {how} stale None" in out, out
        assert f"path0 {kinds[kind][1]} main __main__ cwd {work}" in out, out
        assert "thread joined" in out and "atexit ran" in out, out
        assert ("ValueError: from the job" in err) == (how == "raise"), err
    assert server.close() == 0  # its end of input ends it
    # ranks are forked from servers of their own: their string hashes differ as separate processes' do
    if "PYTHONHASHSEED" not in os.environ:
        hashes = []
        for rank in (0, 1):
            out = tmp_path / f"hash{rank}.out"
            assert zygote.start(["-c", "print(hash('pyengine'))"], env, out, rank=rank).wait(timeout=60) == 0
            hashes.append(out.read_text())
        assert hashes[0] != hashes[1], hashes


def results(tmp_path, world):
    """Each rank's result; also checks that its process group was freed at destroy_process_group()."""
    for r in range(world):
        teardown = (tmp_path / f"rank{r}.teardown").read_text()
        assert teardown == "group freed", f"rank {r}: the group outlived its engines"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture
def seed():
    return fresh_seed()


class Reference:
    """torch.optim.AdamW in float64 on one copy of the model (``extra``: more AdamW options, e.g. amsgrad)."""

    def __init__(self, **extra):
        self.model = copy.deepcopy(dist_job.make_model()).double()
        self.opt = torch.optim.AdamW(self.model.parameters(), foreach=False, **dist_job.OPT, **extra)

    def step(self, batch, clip=None):
        self.opt.zero_grad()
        x, y = batch
        dist_job.loss_fn(self.model, (x.double(), y)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.opt.step()

    def assert_matches(self, master, rtol=1e-5):
        for name, p in self.model.named_parameters():
            scale = p.detach().abs().max().item()
            torch.testing.assert_close(master[name].double(), p.detach(), rtol=rtol, atol=rtol * scale, msg=name)


def assert_identical(a, b, what):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs between ranks"


_IMPORTS = """
import sys, weakref
import torch
import torch.distributed as dist
import pyengine
from pyengine import distributed
print("imported:", "pyengine.pipeline_distributed" in sys.modules, "torch._dynamo" in sys.modules)
init = distributed.init_process_group if sys.argv[1] == "pyengine" else dist.init_process_group
init("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
group = weakref.ref(dist.group.WORLD)
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
with pyengine.Engine(model, lambda m, b: m(b[0]).square().mean(), devices=["cpu"], mode="pipeline",
                     process_group=dist.group.WORLD) as engine:
    engine.step((torch.randn(4, 3), torch.zeros(4)))
del engine
dist.destroy_process_group()
print("group after destroy:", "alive" if group() is not None else "freed")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("init", ["pyengine", "torch"])
def test_import_pyengine_leaves_the_distributed_pipeline_unimported_and_its_import_keeps_no_group(tmp_path, init):
    """Note [Importing the distributed pipeline]: `import pyengine` leaves torch.distributed.pipelining (and
    torch._dynamo: seconds) unimported; a pipeline across processes built on a group that exists (made by
    pyengine's init_process_group or torch's) imports them then, and the group is still freed by
    destroy_process_group() (torch.distributed.nn.functional imported after the group would keep it alive)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _IMPORTS, init, str(free_port())], env=env, capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    assert "imported: False False" in done.stdout and "group after destroy: freed" in done.stdout, done.stdout


@pytest.mark.timeout(90)
def test_every_collective_an_engine_issues_keeps_its_work(tmp_path, seed):
    """Note [Gloo's works are released by the thread that waits]: a work whose last reference gloo's worker thread
    drops takes the GIL there, which at interpreter shutdown aborted the process ("terminate called without an
    active exception"). Checked by reference: every collective of hybrid steps (replicated, sharded), of a
    checkpoint, and of a pipeline across processes (steps and gather) is issued with async_op=True and its work is
    kept by the engine."""
    codes, logs, _ = launch("kept-works", 2, tmp_path, seed)
    assert codes == [0, 0], "\n".join(logs)
    for rank in results(tmp_path, 2):
        for kind in ("replicated", "sharded", "pipeline"):
            assert rank[kind]["issued"] >= 3 * 3 and rank[kind]["blocking"] == 0 == rank[kind]["not_kept"], \
                (kind, rank[kind])
        # the same storages after every step (a step's buffer sharing reuses its byte buffer)
        assert len(set(rank["held"][1:])) == 1, rank["held"]


@pytest.mark.timeout(90)
def test_hybrid_equals_one_big_batch_and_sharded_equals_replicated(tmp_path, seed):
    world = 3  # uneven shards (13/12/12 samples, then 7/6 on two local workers) and bucket parts with a tail
    codes, logs, _ = launch("hybrid", world, tmp_path, seed)
    assert codes == [0] * world, "\n".join(logs)
    ranks = results(tmp_path, world)
    reference = Reference()
    for batch in dist_job.global_batches(seed, dist_job.HYBRID["steps"], dist_job.HYBRID["batch"]):
        reference.step(batch, clip=dist_job.HYBRID["clip"])
    for kind in ("replicated", "sharded"):
        for r in ranks[1:]:
            assert_identical(ranks[0][kind]["master"], r[kind]["master"], kind)
            for i, state in ranks[0][kind]["optimizer"]["state"].items():
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(state[key], r[kind]["optimizer"]["state"][i][key]), (kind, key)
        first = ranks[0][kind]
        assert first["buckets"] >= 2, "the test must cover several buckets"
        for r, rank in enumerate(ranks):  # microbatches=3: each worker's shard in 3 forwards
            local = [len(t) for t in torch.tensor_split(torch.empty(dist_job.HYBRID["batch"]), world)][r]
            expected = [len(m) for n in (len(t) for t in torch.tensor_split(torch.empty(local), 2))
                        for m in torch.tensor_split(torch.empty(n), 3)]
            assert rank[kind]["forwards"] == sorted(expected * dist_job.HYBRID["steps"]), (kind, r)
        assert first["samples"] == [dist_job.HYBRID["batch"]] * dist_job.HYBRID["steps"]
        assert first["stats"]["applied_updates"] == dist_job.HYBRID["steps"]
        reference.assert_matches(first["master"])
        ref_state = reference.opt.state_dict()["state"]
        for i, state in first["optimizer"]["state"].items():
            torch.testing.assert_close(state["exp_avg"].double(), ref_state[i]["exp_avg"], rtol=1e-4, atol=1e-7)
    for name, value in ranks[0]["replicated"]["master"].items():
        torch.testing.assert_close(ranks[0]["sharded"]["master"][name], value, rtol=1e-6, atol=1e-7)
    for rank in ranks:
        assert rank["no_decay_sharded"].startswith("AdamW(no_decay=...) with shard_update=True is not supported")
    # a shard too small for the micro-batches on rank 1 alone: every rank refused that step, then trained on
    assert "rank 1's worker 0's shard of 2 samples cannot be split into microbatches=3" in ranks[1]["refused"]
    for r in (0, 2):
        assert ranks[r]["refused"] == "rank %d: rank 1 has a worker's shard too small for " \
            "microbatches=3; this step was refused on every rank" % r
    for rank in ranks:
        assert rank["after_refusal"] == dict(applied=True, version=dist_job.HYBRID["steps"] + 1)
    # Buffers, as DDP's broadcast_buffers: every step starts, on every rank and worker, from rank 0's worker 0
    # buffers; worker 0 of rank r then updates them on its own shard. Reference: a float64 copy with the step's
    # master weights that starts from rank 0's buffers of the previous step and sees that shard.
    start = dict(dist_job.make_bn_model().named_buffers())
    batches = dist_job.global_batches(seed, dist_job.HYBRID["steps"], dist_job.HYBRID["batch"])
    for t in range(3):
        for r, rank in enumerate(ranks):
            bn = dist_job.make_bn_model().double()
            with torch.no_grad():
                for name, p in bn.named_parameters():
                    p.copy_(rank["bn"]["master"][t][name])
                for name, b in bn.named_buffers():
                    b.copy_(start[name])
                x = torch.tensor_split(dist_job.rank_slice(batches[t], r, world)[0], 2)[0]  # worker 0's shard
                bn(x.double())
            for name, b in bn.named_buffers():
                got = rank["bn"]["buffers"][t][name]
                torch.testing.assert_close(got.to(b.dtype), b, rtol=1e-5, atol=1e-6, msg=f"step {t} rank {r} {name}")
        start = ranks[0]["bn"]["buffers"][t]


@pytest.mark.timeout(90)
def test_dropout_masks_differ_across_ranks_and_resume_from_rank_0s_state(tmp_path, seed):
    """Note [Random numbers of concurrent workers]: each rank's worker has its own generator (with one worker per
    rank too: not the same masks on every rank), seeded per step, so every rank resumed from rank 0's state draws
    what it drew in the uninterrupted run."""
    codes, logs, _ = launch("dropout-resume", 2, tmp_path, seed)
    assert codes == [0, 0], "\n".join(logs)
    ranks = results(tmp_path, 2)
    assert all(r["resumed_equal"] for r in ranks), [r["resumed_equal"] for r in ranks]
    assert not torch.equal(ranks[0]["first_mask"], ranks[1]["first_mask"])


@pytest.mark.timeout(90)
def test_dropout_masks_differ_across_workers_of_ranks_with_different_worker_counts(tmp_path, seed):
    """Rank 0 with 2 workers, rank 1 with 1: each worker of the group has its own generator (the global worker index
    counts the lower ranks' workers first), so no two draw the same masks."""
    codes, logs, _ = launch("dropout-uneven", 2, tmp_path, seed)
    assert codes == [0, 0], "\n".join(logs)
    ranks = results(tmp_path, 2)
    masks = ranks[0]["masks"] + ranks[1]["masks"]
    assert len(masks) == 3
    same = [(a, b) for a in range(3) for b in range(a + 1, 3) if torch.equal(masks[a], masks[b])]
    assert not same, f"masks {same} (rank 0's two workers', then rank 1's) are the same"


def test_hybrid_fp16_loss_scaling_equals_grad_scaler(tmp_path, seed):
    """Float16 autocast with dynamic loss scaling across 2 processes x 2 workers, replicated and sharded: every rank
    takes GradScaler's decisions step for step (backoffs from a scale that overflows, growth, a poisoned batch
    skipped) on the same 4 shards, and the weights follow GradScaler + torch.optim.AdamW."""
    from test_scaler import GradScalerReference, assert_close_to

    world = 2
    codes, logs, _ = launch("hybrid-fp16", world, tmp_path, seed)
    assert codes == [0] * world, "\n".join(logs)
    ranks = results(tmp_path, world)
    reference = GradScalerReference(dist_job.make_model(), dist_job.FP16["scaler"], **dist_job.OPT)
    expected = []
    for batch in dist_job.fp16_batches(seed):
        shards = []  # rank r's slice, split between its 2 workers
        for r in range(world):
            x, y = dist_job.rank_slice(batch, r, world)
            shards += list(zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2)))
        expected.append(reference.step([[s] for s in shards]))  # each worker's shard alone
    assert any(not applied for _, applied in expected) and len({s for s, _ in expected}) > 2
    for kind in ("replicated", "sharded"):
        for rank in ranks:
            assert rank[kind]["trajectory"] == expected, kind
        assert_identical(ranks[0][kind]["master"], ranks[1][kind]["master"], kind)

        class Engine:  # assert_close_to's view of a result
            @staticmethod
            def master_state_dict(kind=kind):
                return ranks[0][kind]["master"]

        assert_close_to(Engine, reference, 5e-4)


@pytest.mark.timeout(120)
def test_hybrid_and_async_ranks_take_rank_0s_frozen_parameters(tmp_path, seed):
    """Note [Every rank starts from rank 0's model]: ranks build a model with a frozen layer, a frozen float8
    parameter and int16 / float8 buffers from different seeds; every replica of every rank holds rank 0's from the
    construction on, and keeps them through the steps (before, each hybrid and async rank trained on its own frozen
    layer; a persistent int16 or float8 buffer failed every hybrid step: gloo refuses their dtypes); an async client
    keeps its own buffers, whose persistent ones the server takes at the end of the run (Note [The servers hold a
    client's statistics])."""
    world = 2
    codes, logs, _ = launch("frozen-rank0", world, tmp_path, seed, timeout=90.0)
    assert codes == [0] * world, "\n".join(logs)
    ranks = results(tmp_path, world)
    def frozen(seed):
        model = dist_job.make_frozen_model(seed=seed)
        return {**{n: p.detach() for n, p in model.named_parameters() if not p.requires_grad},
                **{k: getattr(model[2], k) for k in ("codes", "levels", "levels8")}}

    def same(a, b):  # float8 has no equality kernel: its bytes
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    expected, mine = frozen(0), frozen(1)
    assert set(expected) == {"0.weight", "0.bias", "2.scale8", "codes", "levels", "levels8"}
    assert not any(same(expected[n], mine[n]) for n in expected)
    for kind, copies in (("replicated", 4), ("sharded", 4), ("async", 1)):
        for r, rank in enumerate(ranks):
            assert len(rank[kind]["frozen"]) == copies, (kind, r)
            for held in rank[kind]["frozen"]:
                # an async client's buffers are its own; the server takes the persistent ones at the end of fit
                # (Note [Buffers that are not saved]: across processes only those travel)
                kept = ("codes", "levels", "levels8") if kind == "async" and r == 1 else \
                    ("levels", "levels8") if kind == "async" else ()
                want = dict(expected, **{k: mine[k] for k in kept})
                assert held.keys() == want.keys() and all(same(held[n], want[n]) for n in held), (kind, r)
            # copy_to writes them too: rank 1's export held its own frozen layer, not the one it trained with
            exported = rank[kind]["exported"]
            assert exported.keys() == {"0.weight", "0.bias", "2.scale8"}, (kind, r)
            assert all(same(exported[n], expected[n]) for n in exported), (kind, r)
        assert_identical(ranks[0][kind]["master"], ranks[1][kind]["master"], kind)


@pytest.mark.timeout(120)
def test_low_precision_replicas_pull_the_shadow_of_every_write(tmp_path, seed):
    """Note [The shadow follows the master weights]: a bfloat16 model built from another seed on each rank. The
    store's shadow is its master weights rounded, and every replica (pipeline: stage) holds the shadow's bits, after
    the broadcast of rank 0's weights, after every hybrid step (replicated; sharded: the all-gather of the updated
    parts) and after a pipeline's gathers; every rank ends with the same master weights. Multi-node async (2 servers,
    1 client): the client computes every push on the weights it received, and after the fit (whose ends share the
    store) every rank's shadow is its weights rounded."""
    world = 2
    codes, logs, _ = launch("low-precision", world, tmp_path, seed, timeout=90.0)
    assert codes == [0] * world, "\n".join(logs)
    ranks = results(tmp_path, world)
    for kind, checks in (("replicated", 4), ("sharded", 4), ("pipeline", 3)):
        for r, rank in enumerate(ranks):
            got = rank[kind]["checks"]
            assert len(got) == checks and all(c == dict(shadow=True, replicas=True) for c in got), (kind, r, got)
        assert_identical(ranks[0][kind]["master"], ranks[1][kind]["master"], kind)
    world = 3
    codes, logs, _ = launch("low-precision-async", world, tmp_path, seed, timeout=90.0)
    assert codes == [0] * world, "\n".join(logs)
    ranks = results(tmp_path, world)
    for r, rank in enumerate(ranks):
        assert rank["checks"] == [dict(shadow=True, replicas=True), dict(shadow=True)], r
        assert_identical(ranks[0]["master"], rank["master"], f"rank {r}")
    assert len(ranks[2]["forwards"]) >= 4 and all(ranks[2]["forwards"]), ranks[2]["forwards"]
    # the same pushes in one process: the client computed on the servers' weights
    assert_identical(ranks[2]["alone"], ranks[0]["master"], "one process")
    # a server sends its weights as the replicas' dtype, half the bytes (they went as float32: Note [An async pull
    # sends the replicas' dtype]); besides, only headers (float64) and the failure text (uint8) cross
    for r in (0, 1):
        assert "torch.float32" not in ranks[r]["sent"] and "torch.bfloat16" in ranks[r]["sent"], ranks[r]["sent"]


@pytest.mark.timeout(120)
def test_async_fp16_servers_follow_the_coordinators_loss_scale(tmp_path, seed):
    """Multi-server async under float16 with dynamic loss scaling: rank 0's history replays LossScaler's rule push
    by push (the scale each push was computed with came from rank 0's snapshot; overflows back it off once per
    scale, applied pushes grow it); the other server skipped exactly the pushes rank 0 skipped, dividing by the same
    scales; every rank ends with rank 0's scale and the same weights."""
    world, servers = 4, 2
    codes, logs, _ = launch("async-fp16", world, tmp_path, seed, timeout=100.0)
    assert codes == [0] * world, "\n".join(logs)
    ranks = results(tmp_path, world)
    first = ranks[0]["history"]
    assert len(first) == 24 and all(m["loss_scale"] for m in first)
    replay = pyengine.LossScaler(**dist_job.FP16["scaler"])
    for m in first:
        if m["applied"]:
            replay.applied(m["loss_scale"])
        else:
            assert replay.overflow(m["loss_scale"]), m
    skipped = sum(not m["applied"] for m in first)
    assert 0 < skipped < len(first) and len({m["loss_scale"] for m in first}) > 2
    key = lambda m: (m["rank"], m["push_id"], m["applied"], m["loss_scale"])  # noqa: E731
    assert sorted(map(key, ranks[1]["history"])) == sorted(map(key, first))
    for r, rank in enumerate(ranks):
        assert rank["stats"]["loss_scale"] == replay.scale, f"rank {r}"
        assert_identical(ranks[0]["master"], rank["master"], f"rank {r}")
        assert all(torch.isfinite(v).all() for v in rank["master"].values())
    assert ranks[1]["stats"]["skipped_steps"] == ranks[0]["stats"]["skipped_steps"] == skipped


@pytest.mark.timeout(90)
def test_nonfinite_raise_raises_on_every_rank_and_the_engine_trains_on(tmp_path, seed):
    """nonfinite="raise" across processes, replicated and sharded: a NaN in rank 1's batch makes every rank raise
    FloatingPointError together (a decision from the same reduced norm), no rank is recorded as failed, and the next
    step trains on, as in one process: the weights are those of the two good steps. Then optimizer.no_decay set on
    the sharded engine is refused at the next step (it trained with one decay for all), and the engine goes on."""
    codes, logs, _ = launch("nonfinite-raise", 2, tmp_path, seed)
    assert codes == [0, 0], "\n".join(logs)
    ranks = results(tmp_path, 2)
    reference = Reference()
    for i, batch in enumerate(dist_job.global_batches(seed, 3, 16)):
        if i != 1:
            reference.step(batch)
    for kind in ("replicated", "sharded"):
        for r, rank in enumerate(ranks):
            first, raised, last = rank[kind]["steps"]
            assert first is True and last is True, (kind, r, rank[kind]["steps"])
            assert raised.startswith("FloatingPointError: non-finite gradient at step 2"), (kind, r, raised)
            assert rank[kind]["recorded"] is None, (kind, r)
            stats = rank[kind]["stats"]
            assert (stats["steps"], stats["applied_updates"], stats["raised_steps"]) == (3, 2, 1), (kind, r)
        assert_identical(ranks[0][kind]["master"], ranks[1][kind]["master"], kind)
        reference.assert_matches(ranks[0][kind]["master"])
        for rank in ranks:  # no_decay set after construction: the sharded update decayed the biases, silently
            if kind == "sharded":
                assert rank[kind]["no_decay"].startswith("engine.optimizer.no_decay was set to ('bias',) after the "
                                                         "engine was made with shard_update=True"), rank[kind]
            else:
                assert rank[kind]["no_decay"] == "applied", rank[kind]
            assert rank[kind]["after"] is True


@pytest.mark.timeout(120)
def test_state_the_engine_does_not_follow_is_refused_on_every_rank(tmp_path, seed):
    """Note [A step refused on every rank]: a worker whose step wrote a trainable weight in place, a frozen
    parameter, or set a persistent buffer registered as None failed its rank alone: the peers waited in the step's
    all-reduces until that process exited (the group broken). Now, replicated and sharded, every rank refuses the
    step together: the writing rank raises the WorkerError of one process, the other a DistributedError naming it,
    no rank is recorded as failed, and nothing of the step counts: the engine goes on bit for bit as the same
    engine that never saw the refused batch (weights, Adam state's effect, BatchNorm statistics, stats), except
    for a frozen parameter written, which stays written on its replica as in one process. A parameter without a
    gradient under unused="error" (its rank raised from the backward, the peers blocked: the group broken) is
    refused the same way."""
    codes, logs, _ = launch("unfollowed-state", 2, tmp_path, seed)
    assert codes == [0, 0], "\n".join(logs)
    ranks = results(tmp_path, 2)
    what = {"weight": "ValueError: worker 1's replica: the step wrote the trainable parameter(s) '0.l.weight' in "
                      "place",
            "frozen": "ValueError: worker 1's replica: the step wrote the frozen parameter(s) '0.frozen' in place",
            "none-buffer": "ValueError: worker 1's replica: the step set the buffer(s) '0.late', registered as None "
                           "when the engine was built",
            "unused": "RuntimeError: GradientStreamer(worker=1): 1 parameter(s) received no gradient in this step: "
                      "['0.extra']; pass unused='zero'"}
    for name in ("replicated", "sharded"):
        for kind, writer in dist_job.UNFOLLOWED:
            for r, rank in enumerate(ranks):
                refused, skipped = rank[name, kind, writer]["refused"], rank[name, kind, writer]["skipped"]
                first, raised, *rest = refused["steps"]
                assert first is True and rest == [True, True], (name, kind, r, refused["steps"])
                if r == writer:
                    assert raised.startswith(f"WorkerError: worker 1 (cpu) failed: {what[kind]}"), \
                        (name, kind, r, raised)
                else:
                    why = ("had trainable parameter(s) that received no gradient, with unused='error'"
                           if kind == "unused" else "wrote state the engine does not follow")
                    assert raised == (f"DistributedError: rank {r}: the step was refused on every rank: a worker of "
                                      f"rank {writer} {why} (its own error names it and the remedy); nothing of the "
                                      "step was applied, the group stays usable"), (name, kind, r, raised)
                assert refused["recorded"] is None and refused["version"] == 3, (name, kind, r)
                assert refused["stats"]["steps"] == skipped["stats"]["steps"] == 3, (name, kind, r)
                if kind != "frozen":  # the written frozen parameter stays on rank `writer`'s worker 1
                    assert_identical(refused["master"], skipped["master"], f"{name} {kind} rank {r}")
                    assert_identical(refused["buffers"], skipped["buffers"], f"{name} {kind} rank {r} buffers")
            assert_identical(ranks[0][name, kind, writer]["refused"]["master"],
                             ranks[1][name, kind, writer]["refused"]["master"], f"{name} {kind}")


def test_a_refused_step_names_each_refusing_rank_and_why():
    """refused_step_error (Note [A step refused on every rank]): the peers' error groups the refusing ranks by
    the reason each one's flag carries (refusal_flag: state written, or no gradient under unused="error")."""
    assert distributed.refusal_flag(None) == 0.0
    wrote, unused = distributed.refusal_flag(ValueError("w")), distributed.refusal_flag(RuntimeError("u"))
    assert wrote and unused and wrote != unused
    exc = distributed.refused_step_error(0, "a worker of", [0.0, wrote, unused, wrote])
    assert isinstance(exc, distributed.DistributedError)
    assert str(exc) == ("rank 0: the step was refused on every rank: a worker of ranks 1, 3 wrote state the engine "
                        "does not follow and a worker of rank 2 had trainable parameter(s) that received no "
                        "gradient, with unused='error' (its own error names it and the remedy); nothing of the step "
                        "was applied, the group stays usable")


@pytest.mark.parametrize("world", [1, 2, 3, 8, 32, 33, 34, 64])
def test_every_ranks_refusal_flag_comes_back_from_the_summed_region(world, seed):
    """RefusalFlags: each rank puts its flag into a zeroed float64 region, the regions are summed (as the step's
    all-reduce does, in a random order), and every rank reads back every rank's flag exactly: packed as base-3
    digits of one element up to 33 ranks (the largest sum, 3**33 - 1, is exact in float64), one element per rank
    beyond."""
    gen = torch.Generator().manual_seed(seed)
    refusals = [None, ValueError("wrote"), RuntimeError("no gradient")]
    flags = distributed.RefusalFlags(world)
    assert flags.size == (1 if world <= 33 else world)
    for pattern in ("random", "all_unused", "none"):
        if pattern == "random":
            picks = torch.randint(0, 3, (world,), generator=gen).tolist()
        else:
            picks = [2 if pattern == "all_unused" else 0] * world
        regions = []
        for rank, pick in enumerate(picks):
            region = torch.zeros(2 + flags.size, dtype=torch.float64)[1:1 + flags.size]  # a view, as in the step
            flags.put(region, rank, refusals[pick])
            regions.append(region)
        total = torch.zeros(flags.size, dtype=torch.float64)
        for r in torch.randperm(world, generator=gen).tolist():
            total += regions[r]
        expected = [distributed.refusal_flag(refusals[pick]) for pick in picks]
        assert flags.read(total) == expected, (world, pattern)

@pytest.mark.timeout(90)
def test_ranks_that_loaded_different_states_refuse_the_next_step(tmp_path, seed):
    """Note [Every rank at the same version]: rank 0 alone loads an earlier state; the next step raises on every
    rank naming the ranks' versions (before, they trained on with different weights), and once rank 1 loads it too
    both train on alike: equal to steps on batches 0, 1, 2. A checkpoint between is refused on every rank (Note [A
    checkpoint of ranks at different versions]). An lr changed between steps on rank 0 only is refused
    likewise, and so is an lr_schedule that differs between the ranks at a step the construction does not compare."""
    codes, logs, _ = launch("load-divergence", 2, tmp_path, seed)
    assert codes == [0, 0], "\n".join(logs)
    ranks = results(tmp_path, 2)
    reference = Reference()
    for batch in dist_job.global_batches(seed, 3, 16):
        reference.step(batch)
    for kind in ("replicated", "sharded"):
        for r, rank in enumerate(ranks):
            assert rank[kind]["error"] == (
                f"rank {r}: the ranks' engines hold different states (version 1 on rank 0; version 2 on rank 1): "
                "every rank must load the same state (load_state_dict or checkpoint.load_engine on every rank); this "
                "step was refused on every rank"), (kind, rank[kind]["error"])
            # a checkpoint of the two states is refused too (a sharded one was a mix of rank 0's and rank 1's
            # slices of the Adam state, written without a word), and writes nothing
            assert rank[kind]["save_error"] == (
                f"rank {r}: save_engine: the ranks' engines hold different states (versions [1, 2], rank i's at "
                "index i): every rank must load the same state (load_state_dict or checkpoint.load_engine on every "
                "rank); nothing was written"), (kind, rank[kind]["save_error"])
            assert not (tmp_path / f"diverged-{kind}").exists() or not any((tmp_path / f"diverged-{kind}").iterdir())
            # then an lr changed on rank 0 only: refused on every rank (the ranks' weights drifted apart for good)
            lr = dist_job.OPT['lr'] * (2 - r)
            assert rank[kind]["lr_error"] == (
                f"rank {r}: the ranks' engine.optimizer settings or learning rates differ (the ranks alike: rank 0 | "
                f"rank 1; this rank's: {pyengine.AdamW(**dict(dist_job.OPT, lr=lr))!r}, lr {lr!r} for update 3): a "
                "change between steps must be made on every rank, and lr_schedule must give every rank the same; this "
                "step was refused on every rank"), (kind, rank[kind]["lr_error"])
            assert rank[kind]["version"] == 3, kind
        assert_identical(ranks[0][kind]["master"], ranks[1][kind]["master"], kind)
        reference.assert_matches(ranks[0][kind]["master"])
    for r, rank in enumerate(ranks):  # a pipeline's checkpoint (each rank a stage): refused alike (written before)
        assert rank["pipeline"]["save_error"] == (
            f"rank {r}: save_engine: the ranks' engines hold different states (versions [1, 2], rank i's at index "
            "i): every rank must load the same state (load_state_dict or checkpoint.load_engine on every rank); "
            "nothing was written"), rank["pipeline"]["save_error"]
    assert not (tmp_path / "diverged-pipeline").exists() or not any((tmp_path / "diverged-pipeline").iterdir())
    # an lr_schedule that gives the ranks different lrs at update 6 (alike at the steps the construction compares):
    # refused on every rank at that step (the ranks trained apart, silently), and again at the next try
    for r, rank in enumerate(ranks):
        lr = dist_job.OPT["lr"] * (0.5 if r == 0 else 1.0)
        error = (f"rank {r}: the ranks' engine.optimizer settings or learning rates differ (the ranks alike: rank 0 | "
                 f"rank 1; this rank's: {pyengine.AdamW(**dist_job.OPT)!r}, lr {lr!r} for update 6): a change between "
                 "steps must be made on every rank, and lr_schedule must give every rank the same; this step was "
                 "refused on every rank")
        assert rank["schedule"]["errors"] == [(5, error), (6, error)], rank["schedule"]["errors"]
        assert rank["schedule"]["version"] == 5
    assert_identical(ranks[0]["schedule"]["master"], ranks[1]["schedule"]["master"], "schedule")


def owned_elements(buckets, rank, world):
    """Elements of each bucket that rank owns in the sharded update: part r of ceil(n / P) elements, clipped."""
    sizes = []
    for begin, end in buckets:
        n = end - begin
        part = -(-n // world)
        sizes.append(max(0, min(part, n - rank * part)))
    return sizes


def assert_state_close(got, want, keys, rtol=1e-5, atol=1e-7):
    """Two torch.optim-form optimizer states, element by element (``want`` may be float64)."""
    assert sorted(got["state"]) == sorted(want["state"])
    for i, state in want["state"].items():
        assert float(got["state"][i]["step"]) == float(state["step"])
        for key in keys:
            torch.testing.assert_close(got["state"][i][key].double(), state[key].double(), rtol=rtol, atol=atol,
                                       msg=f"param {i} {key}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,amsgrad", [(2, False), (3, True)])
def test_sharded_store_holds_one_pth_of_the_state_and_checkpoints_are_full(tmp_path, seed, world, amsgrad):
    codes, logs, _ = launch("shard-state-amsgrad" if amsgrad else "shard-state", world, tmp_path, seed, timeout=90.0)
    assert codes == [0] * world, "\n".join(logs)
    ranks = results(tmp_path, world)
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    full_store = pyengine.HostStore(dist_job.make_model(), workers=2, pin=False, amsgrad=amsgrad)

    # Memory: param and the G fp32 gradient slots full size, the Adam state only over the owned elements.
    owned = []
    for r, rank in enumerate(ranks):
        info = rank["store"]
        assert info["numel"] == full_store.numel and len(info["buckets"]) >= 3  # the ring buffers are reused
        sizes = owned_elements(info["buckets"], r, world)
        assert [hi - lo for lo, hi in info["state_ranges"]] == sizes
        assert info["state_numel"] == sum(sizes)
        padded = -(-sum(sizes) // 16) * 16
        expected = 4 * info["numel"] * (1 + info["workers"]) + 4 * padded * len(keys)
        assert info["nbytes"] == expected
        assert full_store.nbytes - info["nbytes"] == 4 * len(keys) * (info["numel"] - padded)
        assert info["nbytes"] < full_store.nbytes
        owned += [range(lo, hi) for lo, hi in info["state_ranges"]]
    assert sorted(i for r in owned for i in r) == list(range(full_store.numel))  # the ranks' ranges partition it

    # The checkpoint of the sharded run holds the full state: a single-process engine resumes from it.
    batches = dist_job.global_batches(seed, dist_job.SHARD["steps"] + dist_job.SHARD["more"], dist_job.SHARD["batch"])
    ckpt = checkpoint.path_for(tmp_path / "ckpt", dist_job.SHARD["ckpt_step"])
    opt = pyengine.AdamW(**dist_job.OPT, amsgrad=amsgrad)
    with pyengine.Engine(dist_job.make_model(seed=1), dist_job.loss_fn, optimizer=opt, **dist_job.SHARD_ENGINE) as one:
        payload = checkpoint.load_engine(ckpt, one)
        assert payload["note"] == "sharded" and one.version == dist_job.SHARD["steps"]
        for b in batches[dist_job.SHARD["steps"]:]:
            one.step(b)
        resumed = dict(master=one.master_state_dict(), optimizer=one.optimizer_state_dict())
    reference = Reference(amsgrad=amsgrad)
    for b in batches:
        reference.step(b)
    reference.assert_matches(resumed["master"])
    assert_state_close(resumed["optimizer"], reference.opt.state_dict(), keys, rtol=1e-4)
    for rank in ranks:
        assert_identical(ranks[0]["continued"]["master"], rank["continued"]["master"], "sharded, continued")
        for name, value in resumed["master"].items():
            torch.testing.assert_close(rank["continued"]["master"][name], value, rtol=1e-5, atol=1e-7)
        assert_state_close(rank["continued"]["optimizer"], resumed["optimizer"], keys)

    # A full state loaded into a sharded engine: each rank holds exactly its slices, then trains on as one process.
    for r, rank in enumerate(ranks):
        for key in keys:
            packed, full, at = rank["loaded_packed"][key], rank["single_full"][key], 0
            assert packed.numel() == rank["store"]["state_numel"]
            for lo, hi in rank["store"]["state_ranges"]:
                assert torch.equal(packed[at:at + hi - lo], full[lo:hi]), (r, key, lo, hi)
                at += hi - lo
        loaded = rank["loaded"]
        for name, value in loaded["single_master"].items():
            torch.testing.assert_close(loaded["master"][name], value, rtol=1e-5, atol=1e-7)
        assert_state_close(loaded["optimizer"], loaded["single_optimizer"], keys)


@pytest.mark.timeout(120)
def test_async_applies_every_push_exactly_once(tmp_path, seed):
    world = 3
    codes, logs, _ = launch("async", world, tmp_path, seed, timeout=90.0)  # from spawn
    assert codes == [0] * world, "\n".join(logs)
    server, *clients = results(tmp_path, world)
    applied = [(m["rank"], m["push_id"]) for m in server["history"]]
    assert len(applied) == len(set(applied)) == dist_job.ASYNC["pushes"] == server["stats"]["pushes"]
    assert server["stats"]["applied_updates"] == dist_job.ASYNC["pushes"]
    assert [m["version_at_apply"] for m in server["history"]] == list(range(dist_job.ASYNC["pushes"]))
    assert all(m["staleness"] == 0 for m in server["history"])  # max_staleness=0
    assert server["stats"]["staleness_histogram"] == {0: dist_job.ASYNC["pushes"]}
    assert server["stats"]["refreshes"] == sum(c["stats"]["refreshes"] for c in clients)
    for rank, client in enumerate(clients, start=1):
        ids = [i for r, i in applied if r == rank]
        assert ids == list(range(1, len(ids) + 1)), f"rank {rank}: pushes lost or reordered: {ids}"
        assert [m["push_id"] for m in client["history"]] == ids, f"rank {rank}: acknowledgements differ"
        assert client["stats"]["pushes"] - client["stats"]["refreshes"] in (len(ids), len(ids) + 1)
    # Note [A state during a multi-node async run]: a client's state read during the run said version 0 with no Adam
    # state (its store holds the weights it pulled): refused; rank 0 of one server reads the state of its updates
    assert server["mid_run"] == [1], server["mid_run"]
    # (a client reads it in its callback, after a push the run applied: under max_staleness=0 another client may win
    # every push)
    pushed = [r for r in range(1, world) if any(rank == r for rank, _ in applied)]
    assert pushed and all(clients[r - 1]["mid_run"][0].startswith(
        f"rank {r}: the state is read during a multi-node async run") for r in pushed), [c["mid_run"] for c in clients]
    # a checkpoint resumes every rank's own counters: a client's pushes are not the server's
    assert [r["resumed_stats"] for r in (server, *clients)] == [r["stats"] for r in (server, *clients)]
    assert server["stats"] != clients[0]["stats"]
    # fit's "batches ran out" warning: `steps` counts the run's pushes, which the server counts, not a client; the
    # second fit's clients bring 2 batches each (a one-shot iterator) for 100 pushes
    ran_out = f"fit: the batches ran out after {2 * (world - 1)} of the 100 steps asked"
    assert server["warnings"] == [[], [ran_out]], server["warnings"]
    assert all(c["warnings"] == [[], []] for c in clients), [c["warnings"] for c in clients]
    # max_staleness=0: every applied push was computed at the current weights, so the run is sequential training on
    # the applied mini-batches in the server's order
    reference = Reference()
    for rank, push_id in applied:
        reference.step(dist_job.client_batch(seed, rank, push_id - 1))
    reference.assert_matches(server["master"])


@pytest.mark.timeout(120)
def test_async_client_with_workers_accumulates_minibatches_split_unevenly(tmp_path, seed):
    """A client's local workers split each mini-batch its own way (8 samples 4/4, then 3 samples 2/1): a push is the
    sum over its mini-batches of each one's mean gradient, as single-node async's accumulate, and its loss the mean
    of their mean losses. A 1-sample mini-batch (a data set's tail) feeds one worker (it stopped the whole run), and
    a push of 1-sample mini-batches only leaves the other worker's slot, an earlier push's gradient, out."""
    codes, logs, _ = launch("async-accumulate", 2, tmp_path, seed, timeout=90.0)  # from spawn
    assert codes == [0, 0], "\n".join(logs)
    server, client = results(tmp_path, 2)
    batches = [dist_job.client_batch(seed, 1, i, size=n) for i, n in enumerate(dist_job.ACCUMULATE["sizes"])]
    k = dist_job.ACCUMULATE["accumulate"]
    assert [(m["push_id"], m["samples"], m["applied"]) for m in server["history"]] == \
        [(p + 1, sum(len(b[1]) for b in batches[p * k:(p + 1) * k]), True) for p in range(len(batches) // k)]
    reference = Reference()
    for push, m in enumerate(server["history"]):
        reference.opt.zero_grad()
        losses = []
        for x, y in batches[push * k:(push + 1) * k]:  # backward per mini-batch: the gradients sum
            loss = dist_job.loss_fn(reference.model, (x.double(), y))
            loss.backward()
            losses.append(loss.item())
        reference.opt.step()
        assert m["loss"] == pytest.approx(sum(losses) / k, rel=1e-5), push
    reference.assert_matches(server["master"])
    assert_identical(server["master"], client["master"], "async accumulate")


# Rank 1 exits, raises or hangs between hybrid steps (after its third): nothing recorded; rank 0 names it from the
# ranks' check-ins (Note [Naming a rank that died between steps]).
BETWEEN_STEPS = "rank 1 never reached step 4 (rank 0 did; this rank waited"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario,world,pg_timeout,culprit,named", [
    ("failure-exit", 2, 20.0, "Connection", BETWEEN_STEPS),  # gloo: "closed by peer" or "reset by peer"
    ("failure-raise", 2, 20.0, "Connection", BETWEEN_STEPS),  # gloo: "closed by peer" or "reset by peer"
    ("failure-hang", 2, 2.0, "Timed out", BETWEEN_STEPS),
    ("async-failure", 2, 20.0, "receive from rank 1", "the async run stopped because rank 1 failed"),
])
def test_a_failing_rank_ends_the_run_with_an_error(tmp_path, seed, scenario, world, pg_timeout, culprit, named):
    # the hanging rank never ends by itself: killed as soon as rank 0 is done
    codes, logs, seconds = launch(scenario, world, tmp_path, seed, timeout=90.0, pg_timeout=pg_timeout,
                                  grace=0.0 if scenario == "failure-hang" else 15.0)
    assert codes[0] == 1, logs[0]  # its error, uncaught (an abort at exit: -6)
    error = distributed_error(logs[0])
    assert "DistributedError: rank 0:" in error and culprit in error and named in error, logs[0]
    # the check-ins wait PRESENCE_WAIT_S (5 s); the group's timeout is 20 s (2 s for failure-hang)
    assert noticed_after(logs, 1, survivors=[0]) < 15


@pytest.mark.timeout(90)
def test_ranks_whose_engines_differ_all_refuse_at_construction(tmp_path, seed):
    """Note [Every rank's engine alike]: another lr or seed would train on with drifting weights, a model in eval mode
    on one rank with other gradients, another shape made gloo abort the process in native code, another mode or
    shard_update hung until the timeout. Each is one
    ValueError on every rank, at once, naming what differs; the group still serves engines built alike."""
    codes, logs, _ = launch("mismatch", 2, tmp_path, seed)
    assert codes == [0, 0], "\n".join(logs)
    ranks = results(tmp_path, 2)
    named = {"lr": "optimizer: rank 0 has lr=0.01, rank 1 lr=0.02",
             "shape": "parameters: rank 0 has [0] = ('0.weight', (24, 10), 'torch.float32', True), rank 1 [0] = "
                      "('0.weight', (25, 10), 'torch.float32', True)",
             "shard_update": "shard_update: rank 0 has False, rank 1 True",
             "mode": "mode: rank 0 has 'hybrid', rank 1 'async'",
             "seed": "seed: rank 0 has 0, rank 1 1",
             "eval": "modules_in_eval_mode: rank 0 has 0 entries, rank 1 4 entries"}
    for r, rank in enumerate(ranks):
        for case, text in named.items():
            assert rank["errors"][case] is not None, (r, case)
            message, seconds = rank["errors"][case]
            assert f"rank {r}: the 2 ranks' engines are not configured alike" in message and text in message, message
            assert seconds < 5, (r, case, seconds)  # at once, not after the group's timeout (20 s here)
        assert rank["applied"]
        assert rank["errors"]["microbatches"] is None  # hybrid's micro-batches may differ: the same step
        message, _ = rank["errors"]["nan"]  # NaN on both ranks is alike: refused by the check of the value itself
        assert "configured alike" not in message and "bucket_mb" in message, message
    # rank 1's own check of its devices failed: it raises its own error, rank 0 one that names it, both at once
    # (before, rank 0 failed in its first collective and named no rank)
    message, seconds = ranks[1]["errors"]["local"]
    assert message == "devices: 'meta' is neither 'cpu' nor 'cuda:i'" and seconds < 5, message
    message, seconds = ranks[0]["errors"]["local"]
    assert message == ("rank 0: rank 1 could not build its Engine: ValueError: devices: 'meta' is neither 'cpu' nor "
                       "'cuda:i'") and seconds < 5, message
    for name, value in ranks[0]["master"].items():
        assert torch.equal(value, ranks[1]["master"][name]), name


def test_option_errors():
    model = dist_job.make_model()
    with pytest.raises(ValueError, match="shard_update=True .* needs a process group"):
        pyengine.Engine(model, dist_job.loss_fn, devices=["cpu"], shard_update=True)
    with pytest.raises(ValueError, match="process_group must be"):
        pyengine.Engine(model, dist_job.loss_fn, devices=["cpu"], process_group="world")
    with pytest.raises(ValueError, match="environment lacks"):
        env = {k: os.environ.pop(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k in os.environ}
        try:
            distributed.init_process_group()
        finally:
            os.environ.update(env)
    # a timeout the group cannot take: one clear error, before any rendezvous (it was an OverflowError, gloo's
    # "Invalid timeout" or a TypeError)
    for bad in (float("inf"), float("nan"), 1e13, "60", True, 0, -1.0):
        with pytest.raises(ValueError, match="timeout_s must be a number of seconds > 0 and at most 604800"):
            distributed.init_process_group(timeout_s=bad, init_method="file:///nonexistent/never-used")
    assert distributed.MAX_TIMEOUT_S == cli._DIST_TIMEOUT_MAX_S


@pytest.mark.timeout(60)
@pytest.mark.timeout(120)
def test_a_launch_whose_port_was_taken_meanwhile_runs_again_on_another(tmp_path, seed, monkeypatch):
    """launch(): free_port() closes its port before rank 0 binds it; a port taken in between (EADDRINUSE) gets a
    second launch on a fresh port instead of a failed test."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = free_port
    monkeypatch.setattr(sys.modules[__name__], "free_port", lambda: ports.pop(0) if ports else real())
    with taken:
        codes, logs, _ = launch("shard-one-rank", 1, tmp_path, seed)
    assert not ports and codes == [0], logs[0]
    assert "EADDRINUSE" not in logs[0] and results(tmp_path, 1)[0]["error"] is not None


def test_shard_update_on_a_group_of_one_rank_says_so(tmp_path, seed):
    """torchrun with 1 rank: "auto" runs the process alone, and shard_update=True says why it cannot shard (not that
    the process should run under torchrun, which it does)."""
    codes, logs, _ = launch("shard-one-rank", 1, tmp_path, seed)
    assert codes == [0], logs[0]
    error = results(tmp_path, 1)[0]["error"]
    assert error is not None and "the default torch.distributed group has only 1 rank (WORLD_SIZE=1)" in error, error
    assert "run under torchrun" not in error, error


def test_a_checkpoint_rank_0_cannot_write_raises_on_every_rank_and_the_group_trains_on(tmp_path, seed):
    """save_engine: rank 0 writes; when it cannot, every rank raises CheckpointError naming rank 0's file and error
    (the others got a bare gloo error from the barrier rank 0 never reached), and the ranks stay in step. Ranks that
    pass different steps are refused; every rank returns the path rank 0 wrote."""
    codes, logs, _ = launch("save-fails", 2, tmp_path, seed)
    assert codes == [0, 0], "\n".join(logs)
    ranks = results(tmp_path, 2)
    blocked = str(tmp_path / "not-a-directory" / "ckpt")
    for r, rank in enumerate(ranks):
        error = rank["error"]
        assert error is not None and error.startswith(f"rank 0 could not write checkpoint {blocked}"), (r, error)
        assert "NotADirectoryError" in error, (r, error)
        assert rank["version"] == 3, (r, rank["version"])
        # ranks passing different steps are refused alike; each rank returned the path rank 0 wrote (rank 1 returned
        # the file of its own directory, which did not exist)
        assert "every rank of the group must pass the same step; got [1, 2]" in rank["steps_error"], rank
        assert rank["returned"] == str(tmp_path / "dir-of-rank-0" / "step-00000001.pyeckpt") and rank["exists"], rank
    assert not (tmp_path / "steps").exists()
    for name, tensor in ranks[0]["weights"].items():
        assert torch.equal(tensor, ranks[1]["weights"][name]), name


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["replicated", "sharded"])
def test_ranks_in_different_calls_are_told_so_on_every_rank(tmp_path, seed, kind):
    """Note [Exchanges that pair up wrongly]: rank 0's fourth step meets rank 1's checkpoint (its data ran out a
    batch earlier; both step by hand). Rank 0 said the ranks hold different states (version 0 on rank 1: the length
    of rank 1's pickle) and rank 1 aborted in gloo (replicated); sharded, rank 0 aborted. Now each rank raises
    naming both phases, and the next step is refused at once."""
    codes, logs, seconds = launch(f"uneven-steps-{kind}", 2, tmp_path, seed)
    assert codes == [0, 0], "\n".join(logs)
    phases = ["step 4", "the exchange of the steps and versions for checkpoint step 3"]
    for r, rank in enumerate(results(tmp_path, 2)):
        assert rank["error"] is not None and rank["error"].startswith(f"rank {r}: "), rank
        assert "the collectives paired up wrongly" in rank["error"], rank["error"]
        assert rank["error"].endswith(
            f"the ranks made different calls: this rank is in {phases[r]}, while rank {1 - r} is in "
            f"{phases[1 - r]}: every rank must make the same engine calls in the same order (step, fit, "
            "checkpoint.save_engine, and state_dict or master_state_dict of a sharded engine: collectives)"), \
            rank["error"]
        assert rank["next"] == f"rank {r}: an earlier step failed; the group is no longer usable", rank["next"]
    assert seconds < 30  # no wait for the group's timeout (20 s)


FIT_END_WARNING = ("fit: this rank's fit ended after {n} steps (its batches ran out, its steps were done, or stop()) "
                   "while rank 0 had a batch for another: every rank's fit ended here (give every rank as many "
                   "batches: a sampler that pads, or steps=)")
PEER_END_WARNING = ("fit: the fit of rank 1 ended (its batches ran out, its steps were done, or stop()) while this "
                    "rank had a batch for step {next} of this call: every rank's fit ended there (that batch and any "
                    "after it were not trained; give every rank as many batches: a sampler that pads, or steps=)")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case,kind", [(c, "replicated") for c in dist_job.FIT_ENDS] +
                         [("data", "sharded"), ("callback", "sharded")] +
                         [(c, "pipeline") for c in ("data", "stop", "callback", "schedule", "by-hand", "argument",
                                                    "everywhere")])
def test_ranks_whose_fits_end_at_different_steps_end_together(tmp_path, seed, case, kind):
    """Note [Ranks whose fits end at different steps]: rank 0 fits 4 batches while rank 1's data end after 3 (or it
    asks 2 steps, or stops after 2): rank 0 waited in its next step's first collective for the group's timeout. Now
    both fits end at the same step, each rank warned of the other's end, with the same weights (those of a run of
    that many steps), and the group usable. When rank 1's fit raises (its callback, its iterator, steps asked of
    no batch, fit's own argument checks on rank 1 alone), rank 0's fit raises PeerEndedFit naming that error; rank 0
    stepping by hand while rank 1's fit ends gets PeerEndedFit from its step; both ranks refusing their arguments
    raise their own errors at once. The same for a pipeline across processes (a stage per rank)."""
    codes, logs, seconds = launch(f"fit-ends-{case}-{kind}", 2, tmp_path, seed)
    assert codes == [0, 0], "\n".join(logs)
    assert seconds < 30, seconds  # no wait for the group's timeout (20 s)
    ranks = results(tmp_path, 2)
    trained = {"even": 4, "data": 3, "steps": 2, "stop": 2, "callback": 2, "iterator": 3, "empty": 0,
               "by-hand": 0, "zero": 0, "schedule": 2, "argument": 0, "everywhere": 0}[case]
    assert [r["version"] for r in ranks] == [trained, trained], ranks
    assert [r["after"] for r in ranks] == [trained + 1] * 2  # the group is usable: one more step on every rank
    # the ranks' phases alike after it (a refused step is not counted: a later failure is not "different calls")
    assert ranks[0]["phase"] == ranks[1]["phase"] and ranks[0]["phase"][1] == f"step {trained + 1}", ranks
    assert_identical(ranks[0]["master"], ranks[1]["master"], case)
    reference = Reference()
    for batch in dist_job.global_batches(seed, trained, 12):
        reference.step(batch)
    reference.assert_matches(ranks[0]["master"])
    own = {"callback": "ValueError: the callback's own error", "iterator": "OSError: the loader's own error",
           "empty": "ValueError: batches is empty",
           "argument": "ValueError: fit: steps must be an int >= 0 or None; got -1"}.get(case)
    if case == "schedule":  # its lr refused by check_update, before its step's first collective
        assert ranks[1]["type"] == "ValueError" and "lr" in ranks[1]["error"], ranks[1]
        own = f"ValueError: {ranks[1]['error'].splitlines()[0]}"
    if case == "even":
        assert [r["warnings"] for r in ranks] == [[], []] and [r["error"] for r in ranks] == [None, None]
    elif case == "everywhere":  # each rank refuses its own arguments, and their ends meet: no wait, no PeerEndedFit
        assert [(r["type"], r["error"]) for r in ranks] == [
            ("ValueError", "fit: steps must be an int >= 0 or None; got -1")] * 2, ranks
        assert [r["warnings"] for r in ranks] == [[], []], ranks
    elif own is not None:  # rank 1 raised its own error; rank 0's fit raised naming it; nobody warned of an end
        assert f"{ranks[1]['type']}: {ranks[1]['error']}" == own, ranks[1]
        assert ranks[0]["type"] == "PeerEndedFit", ranks[0]
        assert ranks[0]["error"] == (f"rank 0: the fit of rank 1 raised (rank 1: {own}): this rank's step was "
                                     "refused (inside fit, its fit ends here too); the group stays usable"), \
            ranks[0]["error"]
        assert ranks[0]["warnings"] == [] and ranks[1]["warnings"] == [], ranks
    elif case == "by-hand":  # rank 0's own step() met rank 1's end of fit: raised, not a warning
        assert ranks[0]["type"] == "PeerEndedFit" and ranks[0]["error"] == (
            "rank 0: the fit of rank 1 ended (its batches ran out, its steps were done, or stop()) while this rank "
            "had a batch for another step: that step was refused on every rank"), ranks[0]
        assert ranks[1]["error"] is None and ranks[1]["warnings"] == [
            FIT_END_WARNING.format(n=0), "fit: batches (list) gave no batch: nothing was trained"], ranks[1]
    else:
        assert [r["error"] for r in ranks] == [None, None], ranks
        assert ranks[0]["warnings"] == [PEER_END_WARNING.format(next=trained + 1)], ranks[0]
        assert ranks[1]["warnings"] == [FIT_END_WARNING.format(n=trained)], ranks[1]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind,where", [("replicated", "copy-back"), ("sharded", "copy-back"),
                                        ("replicated", "update"), ("pipeline", "update")])
def test_a_step_failing_on_one_rank_after_its_last_collective_ends_every_fit(tmp_path, seed, kind, where):
    """Note [A step that fails on one rank after its last collective]: rank 1's step 3 raises in its copy back
    (hybrid, replicated or sharded) or its update (hybrid replicated; a pipeline stage's range): rank 0's fit waited
    in step 4 for the group's timeout (20 s). Now rank 1's fit raises its error and tells rank 0, whose fit raises
    PeerEndedFit naming it at once; rank 1's engine refuses its next step; every rank loading the state of step 2
    trains on, as an uninterrupted run of 4 steps."""
    codes, logs, seconds = launch(f"fails-alone-{where}-{kind}", 2, tmp_path, seed)
    assert codes == [0, 0], "\n".join(logs)
    assert seconds < 15, seconds  # no wait for the group's timeout (20 s)
    ranks = results(tmp_path, 2)
    own = f"RuntimeError: rank 1's {where.replace('-', ' ')} error"
    if where == "copy-back":  # on the worker's thread
        own = f"WorkerError: worker 0 (cpu) failed: {own}"
    assert f"{ranks[1]['type']}: {ranks[1]['error']}" == own, ranks[1]
    assert ranks[0]["type"] == "PeerEndedFit" and ranks[0]["error"] == (
        f"rank 0: the fit of rank 1 raised (rank 1: {own}): this rank's step was refused (inside fit, its fit ends "
        "here too); the group stays usable"), ranks[0]
    assert [r["version"] for r in ranks] == [3, 3], ranks
    assert ranks[1]["refused"].startswith(f"step 3 failed inside its update ({own})"), ranks[1]["refused"]
    assert [r["after"] for r in ranks] == [4, 4], ranks
    assert_identical(ranks[0]["master"], ranks[1]["master"], "after the state was loaded")
    reference = Reference()
    for batch in dist_job.global_batches(seed, 4, 12):
        reference.step(batch)
    reference.assert_matches(ranks[0]["master"])


@pytest.mark.timeout(90)
def test_the_first_rank_s_fit_ending_ends_every_other_rank_s(tmp_path, seed):
    """Note [Ranks whose fits end at different steps] with 3 ranks: rank 0's data end after 2 steps while ranks 1
    and 2 have 4 batches; every fit ends after step 2 (rank 0 names both ranks it stopped, each of them rank 0),
    alike and usable."""
    codes, logs, seconds = launch("fit-ends-first", 3, tmp_path, seed)
    assert codes == [0, 0, 0], "\n".join(logs)
    assert seconds < 30, seconds
    ranks = results(tmp_path, 3)
    assert [r["version"] for r in ranks] == [2, 2, 2] and [r["after"] for r in ranks] == [3, 3, 3], ranks
    for r in ranks[1:]:
        assert_identical(ranks[0]["master"], r["master"], "after the uneven end")
        assert r["warnings"] == [PEER_END_WARNING.replace("rank 1", "rank 0").format(next=3)], r["warnings"]
    assert ranks[0]["warnings"] == [FIT_END_WARNING.replace("rank 0", "ranks 1, 2").format(n=2)], ranks[0]
    reference = Reference()
    for batch in dist_job.global_batches(seed, 2, 12):
        reference.step(batch)
    reference.assert_matches(ranks[0]["master"])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", ["data", "callback"])
def test_fits_of_pipeline_stages_with_replicas_end_together(tmp_path, seed, case):
    """Note [Ranks whose fits end at different steps] on a pipeline of 2 stages x 2 replicas (4 ranks: Note
    [Replicas of stages across processes]): rank 3 (stage 1 of replica 1) alone ends its fit after 3 batches, or its
    callback raises after step 2; every rank's fit ends at that step (each other rank warned, or raising
    PeerEndedFit naming rank 3's error), the ranks' weights alike and those of that many steps, the group usable."""
    codes, logs, seconds = launch(f"fit-ends-{case}-pipeline-replicas", 4, tmp_path, seed, timeout=120)
    assert codes == [0] * 4, "\n".join(logs)
    assert seconds < 60, seconds  # no wait for the group's timeout (20 s) at either end
    ranks = results(tmp_path, 4)
    trained = {"data": 3, "callback": 2}[case]
    assert [r["version"] for r in ranks] == [trained] * 4 and [r["after"] for r in ranks] == [trained + 1] * 4
    for r in ranks[1:]:
        assert_identical(ranks[0]["master"], r["master"], case)
    assert len({r["phase"] for r in ranks}) == 1 and ranks[0]["phase"][1] == f"step {trained + 1}", ranks
    reference = Reference()
    for batch in dist_job.global_batches(seed, trained, 12):
        reference.step(batch)
    reference.assert_matches(ranks[0]["master"])
    if case == "data":
        assert [r["error"] for r in ranks] == [None] * 4, ranks
        for r in ranks[:3]:
            assert r["warnings"] == [PEER_END_WARNING.replace("rank 1", "rank 3").format(next=trained + 1)], r
        assert ranks[3]["warnings"] == [FIT_END_WARNING.replace("rank 0", "ranks 0, 1, 2").format(n=trained)]
    else:
        assert ranks[3]["type"] == "ValueError" and ranks[3]["error"] == "the callback's own error", ranks[3]
        for i, r in enumerate(ranks[:3]):
            assert r["type"] == "PeerEndedFit" and r["error"] == (
                f"rank {i}: the fit of rank 3 raised (rank 3: ValueError: the callback's own error): this rank's "
                "step was refused (inside fit, its fit ends here too); the group stays usable"), r
            assert r["warnings"] == [], r


@pytest.mark.timeout(90)
def test_fits_of_ranks_raising_at_one_step_end_together(tmp_path, seed):
    """Note [Ranks whose fits end at different steps] with 3 ranks whose ranks 1 and 2 raise at the same step (each
    its callback's own error): each raises its own, rank 0's fit raises PeerEndedFit naming both ranks and both
    errors; the weights alike, those of 2 steps, and the group usable."""
    codes, logs, seconds = launch("fits-raise-together", 3, tmp_path, seed)
    assert codes == [0, 0, 0], "\n".join(logs)
    assert seconds < 30, seconds
    ranks = results(tmp_path, 3)
    assert [r["version"] for r in ranks] == [2, 2, 2] and [r["after"] for r in ranks] == [3, 3, 3], ranks
    for r in ranks[1:]:
        assert_identical(ranks[0]["master"], r["master"], "after the errors")
    for i in (1, 2):
        assert ranks[i]["type"] == "ValueError" and ranks[i]["error"] == f"rank {i}'s callback error", ranks[i]
    assert ranks[0]["type"] == "PeerEndedFit" and ranks[0]["error"] == (
        "rank 0: the fit of ranks 1, 2 raised (rank 1: ValueError: rank 1's callback error; rank 2: ValueError: "
        "rank 2's callback error): this rank's step was refused (inside fit, its fit ends here too); the group "
        "stays usable"), ranks[0]
    assert [r["warnings"] for r in ranks] == [[], [], []], ranks
    reference = Reference()
    for batch in dist_job.global_batches(seed, 2, 12):
        reference.step(batch)
    reference.assert_matches(ranks[0]["master"])


@pytest.mark.timeout(90)
def test_a_persistent_buffer_registered_and_assigned_expanded_trains_across_processes(tmp_path, seed):
    """Note [Buffers that are not saved]: a persistent buffer registered as an expanded view failed the engine's
    construction on every rank (its broadcast from rank 0 wrote into the view: "more than one element of the
    written-to tensor refers to a single memory location"); one the forward assigns expanded again failed every
    step's buffer broadcast. Multi-node hybrid (2 local workers per rank) and a pipeline (a stage per rank) now
    train on it as on make_model: alike on both ranks and equal to float64 AdamW."""
    codes, logs, _ = launch("expanded-buffers", 2, tmp_path, seed)
    assert codes == [0, 0], "\n".join(logs)
    ranks = results(tmp_path, 2)
    reference = Reference()
    for batch in dist_job.global_batches(seed, 3, 12):
        reference.step(batch)
    for kind in ("hybrid", "pipeline"):
        runs = [r[kind] for r in ranks]
        assert [r["version"] for r in runs] == [3, 3], kind
        assert_identical(runs[0]["master"], runs[1]["master"], kind)
        reference.assert_matches(runs[0]["master"])
        for r in runs:
            assert list(r["buffers"]) == ["1.mask"] and torch.equal(r["buffers"]["1.mask"],
                                                                   torch.ones(2, dist_job.HIDDEN)), kind


def _naming(rank, world, store):
    """A _FailureNaming of ``rank`` over an in-process store (no process group): what _explain reads."""
    naming = distributed._FailureNaming()
    naming.rank, naming.world, naming.broken, naming.phase = rank, world, False, 0
    naming.rendezvous = distributed._Rendezvous.__new__(distributed._Rendezvous)
    naming.rendezvous.prefix, naming.rendezvous.store = "test/", store
    return naming


def test_ranks_in_different_phases_of_one_count_are_told_they_made_different_calls(monkeypatch):
    """Rank 0 alone gathers a sharded engine's state while rank 1 steps: both are at their 2nd phase, and the error
    says the ranks made different calls, naming both phases (it said the peer "reached the gather too and died inside
    it"). Ranks in the same phase still get the old explanation."""
    monkeypatch.setattr(distributed, "PRESENCE_WAIT_S", 0.0)
    store = torch.distributed.HashStore()
    rank0, rank1 = _naming(0, 2, store), _naming(1, 2, store)
    for naming in (rank0, rank1):
        naming._enter("the construction of the engine")
    rank0._enter("the gather of the optimizer state after step 1")
    rank1._enter("step 2")
    for naming, mine, other in ((rank0, "the gather of the optimizer state after step 1", "step 2"),
                                (rank1, "step 2", "the gather of the optimizer state after step 1")):
        text = naming._explain()
        assert text.startswith(f"the ranks made different calls: this rank is in {mine}, while rank "
                               f"{1 - naming.rank} is in {other}: every rank must make the same engine calls"), text
    alike = [_naming(r, 2, torch.distributed.HashStore()) for r in (0, 1)]
    alike[1].rendezvous.store = alike[0].rendezvous.store
    for phase in ("the construction of the engine", "step 1"):
        for naming in alike:
            naming._enter(phase)
    assert alike[0]._explain().startswith("rank 1, the only peer, reached step 1 too"), alike[0]._explain()
    late = _naming(0, 2, torch.distributed.HashStore())  # a rank that never checked in is missing, not elsewhere
    late._enter("the construction of the engine")
    assert late._explain().startswith("rank 1 never reached the construction of the engine"), late._explain()
    # an end of fit and a step pair up (Note [Ranks whose fits end at different steps]): no calls that differ
    ending = [_naming(r, 2, store) for store in [torch.distributed.HashStore()] for r in (0, 1)]
    ending[0]._enter("the end of fit")
    ending[1]._enter("step 4")
    for naming in ending:
        assert naming._explain().startswith(f"rank {1 - naming.rank}, the only peer, reached {naming.phase_name} "
                                            "too"), naming._explain()


def applied_ids(history, rank):
    """The ids of the pushes of ``rank`` that ``history`` holds (applied or skipped), in its order."""
    return [m["push_id"] for m in history if m["rank"] == rank]


@pytest.mark.timeout(150)
def test_sharded_async_servers_apply_every_push_exactly_once_and_match_sequential_adamw(tmp_path, seed):
    world, servers = 4, dist_job.SHARDED["servers"]
    codes, logs, _ = launch("async-sharded", world, tmp_path, seed, timeout=120.0)
    assert codes == [0] * world, "\n".join(logs)
    ranks = results(tmp_path, world)
    # Note [A state during a multi-node async run]: rank 0's state mixed its shard's updates with the other
    # servers' shards at the run's start (zero Adam moments there): refused on every rank during the run. A client
    # reads it in its callback, after a push the run applied: under max_staleness=0 another client may win every
    # push of the run (seen: 11 of a client's 12 pushes came stale, its 12th in flight at the run's end)
    applied = {m["rank"] for m in ranks[0]["sequential"]["history"] if m["applied"]}
    assert any(r >= servers for r in applied), ranks[0]["sequential"]["history"]
    for r, rank in enumerate(ranks):
        if r >= servers and r not in applied and not rank["mid_run"]:
            continue
        assert rank["mid_run"][0].startswith(f"rank {r}: the state is read during a multi-node async run"), rank
        assert ("each of the 2 servers holds its shard's updates" in rank["mid_run"][0]) == (r < servers), rank
    for r, rank in enumerate(ranks):
        assert rank["errors"][0].startswith(f"servers={world} leaves no client rank in a process group of {world}")
        assert rank["errors"][1].startswith(f"servers={world + 3} leaves no client rank"), rank["errors"]
    for name, pushes in (("sequential", dist_job.SHARDED["pushes"]), ("free", dist_job.SHARDED["free_pushes"])):
        runs = [rank[name] for rank in ranks]
        first = runs[0]["history"]
        keys = [(m["rank"], m["push_id"]) for m in first]
        assert len(keys) == len(set(keys)) == pushes, f"{name}: {keys}"
        for s in range(servers):  # exactly once on every server: the same pushes, with the same decisions
            history, stats = runs[s]["history"], runs[s]["stats"]
            assert {m["server"] for m in history} == {s}
            assert len(history) == stats["pushes"] == pushes, f"{name}: server {s}"
            assert sorted((m["rank"], m["push_id"], m["applied"], m["staleness"]) for m in history) == \
                sorted((m["rank"], m["push_id"], m["applied"], m["staleness"]) for m in first), f"{name}: server {s}"
            assert stats["staleness_histogram"] == runs[0]["stats"]["staleness_histogram"]
            assert stats["version"] == runs[0]["stats"]["version"] == stats["applied_updates"]
            # one bias correction per push on every shard: rank 0's Adam step, whatever order a server applied in
            steps = {(m["rank"], m["push_id"]): m["adam_step"] for m in history if m["applied"]}
            assert steps == {(m["rank"], m["push_id"]): m["adam_step"] for m in first if m["applied"]}, \
                f"{name}: server {s}"
        assert sorted(m["adam_step"] for m in first if m["applied"]) == \
            list(range(1, runs[0]["stats"]["applied_updates"] + 1)), name
        # every refresh rank 0 ordered, some client counted (K > 1: learnt from the decision header)
        assert runs[0]["stats"]["refreshes"] == sum(runs[c]["stats"]["refreshes"] for c in range(servers, world))
        for c in range(servers, world):
            ids = applied_ids(first, c)
            assert ids == list(range(1, len(ids) + 1)), f"{name}, rank {c}: pushes lost or reordered: {ids}"
            # a push skipped as non-finite is one on the client too (it was recorded as applied there)
            decided = [(m["push_id"], m["applied"]) for m in first if m["rank"] == c]
            assert [(m["push_id"], m["applied"]) for m in runs[c]["history"]] == decided, \
                f"{name}, rank {c}: acknowledgements differ"
            assert runs[c]["stats"]["skipped_steps"] == sum(not applied for _, applied in decided), (name, c)
        for r in range(1, world):  # the end of a run gives every rank the whole store
            assert_identical(runs[0]["master"], runs[r]["master"], f"{name}, rank {r}")
    # staleness_lr="inverse": a push's metrics hold the lr it was applied with (stale pushes are likely here, not
    # certain: tests/test_engine.py makes them certain in one process)
    free = [m for m in ranks[0]["free"]["history"] if m["applied"]]
    assert all(m["lr"] == pytest.approx(dist_job.OPT["lr"] / (1 + m["staleness"]), rel=1e-12) for m in free)
    sequential = [rank["sequential"] for rank in ranks]
    history = sequential[0]["history"]

    def applied_order(h):
        return [(m["rank"], m["push_id"]) for m in h if m["applied"]]

    # max_staleness=0 puts the applied pushes in one order on every server (each saw all earlier ones on every
    # shard); a push skipped as non-finite changes no shard, so another server may record it before or after a push
    # rank 0 decided later (seen once: server 1 took (2, 8) before the skipped (3, 3)). The sets and decisions are
    # equal on every server (above).
    assert applied_order(sequential[1]["history"]) == applied_order(history)
    assert all(m["staleness"] == 0 for m in history)
    poisoned = [m for m in history if m["push_id"] == dist_job.SHARDED["poison"] + 1]
    assert poisoned, "no client reached its poisoned mini-batch"
    assert [m for m in history if not m["applied"]] == poisoned
    for s in range(servers):  # the poisoned gradient is inf in the last shard only: skipped by every server
        assert sequential[s]["stats"]["skipped_steps"] == len(poisoned)
    # max_staleness=0: every applied push saw every earlier one on every shard: sequential AdamW in rank 0's order,
    # clipped by the norm of the whole gradient, its lr following LambdaLR with the same schedule, the biases in a
    # param group without weight decay
    reference = Reference()
    named = list(reference.model.named_parameters())
    decayed = [p for n, p in named if not any(s in n for s in dist_job.SHARDED_NO_DECAY)]
    kept = [p for n, p in named if any(s in n for s in dist_job.SHARDED_NO_DECAY)]
    reference.opt = torch.optim.AdamW([{"params": decayed}, {"params": kept, "weight_decay": 0.0}], foreach=False,
                                      **dist_job.OPT)
    scheduler = torch.optim.lr_scheduler.LambdaLR(reference.opt, dist_job.SHARDED_SCHEDULE)
    for m in history:
        if m["applied"]:
            reference.step(dist_job.client_batch(seed, m["rank"], m["push_id"] - 1), clip=dist_job.SHARDED["clip"])
            scheduler.step()
    reference.assert_matches(sequential[0]["master"])
    ref_state = reference.opt.state_dict()["state"]
    for i, state in sequential[0]["optimizer"]["state"].items():
        torch.testing.assert_close(state["exp_avg_sq"].double(), ref_state[i]["exp_avg_sq"], rtol=1e-4, atol=1e-9)
        assert state["step"] == ref_state[i]["step"]


def assert_every_other_rank_names(failed, codes, logs, how):
    """Every rank but ``failed`` ended with a DistributedError saying the async run stopped because ``failed`` failed;
    ``failed`` itself exited with 17 (``how="exit"``) or raised its own error."""
    for r in range(len(codes)):
        if r == failed:
            continue
        assert codes[r] == 1, f"rank {r} (1: its error, uncaught; -6: an abort at exit):\n{logs[r]}"
        assert f"DistributedError: rank {r}: the async run stopped because rank {failed} failed" in logs[r], logs[r]
    if how == "exit":
        assert codes[failed] == 17, logs[failed]
    else:
        assert codes[failed] not in (0, None) and f"rank {failed} fails on purpose" in logs[failed], logs[failed]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("servers,world,how", [(1, 3, "exit"), (2, 4, "exit"), (2, 4, "raise")])
def test_a_failing_async_client_ends_every_other_rank_with_an_error_naming_it(tmp_path, seed, servers, world, how):
    failed = world - 1
    codes, logs, _ = launch(f"async-client-{how}-{servers}", world, tmp_path, seed, timeout=90.0)
    assert_every_other_rank_names(failed, codes, logs, how)
    if how == "raise":
        for r in range(world - 1):  # the failed rank's own error, passed on: in every other rank's error
            assert f"failed: WorkerError: worker 0 (cpu) failed: RuntimeError: rank {failed} fails on purpose" in \
                distributed_error(logs[r]), logs[r]
    assert noticed_after(logs, failed) < 10


def test_servers_option_errors():
    model = dist_job.make_model()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="servers must be an integer >= 1"):
            pyengine.Engine(model, dist_job.loss_fn, devices=["cpu"], mode="async", pin=False, servers=bad)
    with pytest.raises(ValueError, match="servers=2 shards the store .* needs mode='async' and a process group"):
        pyengine.Engine(model, dist_job.loss_fn, devices=["cpu"], mode="async", pin=False, servers=2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("servers,world,how", [(1, 3, "exit"), (1, 3, "raise"), (2, 4, "exit"), (2, 4, "raise")])
def test_a_failing_async_server_ends_every_other_rank_with_an_error_naming_it(tmp_path, seed, servers, world, how):
    failed = servers - 1  # rank 0 (the coordinator) when it is the only server, else rank 1
    codes, logs, _ = launch(f"async-server-{how}-{servers}", world, tmp_path, seed, timeout=90.0, grace=15.0)
    assert_every_other_rank_names(failed, codes, logs, how)
    assert noticed_after(logs, failed) < 10


@pytest.mark.timeout(120)
@pytest.mark.parametrize("servers,world", [(1, 2), (2, 3)])
def test_an_async_servers_own_error_outside_an_exchange_is_told_to_its_client_at_once(tmp_path, seed, servers, world):
    """A server's own code raises (not an exchange, not a push's update: a stand-in for a bug or a failed allocation)
    while its client waits for the weights of a pull: the client is sent ABORT naming the server and the error, and
    raises at once with them; before, nothing was sent, and the client learned only that the server's connection
    closed once its process ended (gloo's "Connection closed by peer"), not why."""
    failed = servers - 1
    codes, logs, _ = launch(f"async-server-code-raises-{servers}", world, tmp_path, seed, timeout=90.0,
                            pg_timeout=60.0, grace=15.0, main=world - 1)
    for r, error in survivor_errors(codes, logs, range(world)):
        assert f"the async run stopped because rank {failed} failed: serving rank {world - 1} raised MemoryError: " \
               f"rank {failed}'s own code fails on purpose" in error, error
    assert noticed_after(logs, failed) < 15


def noticed_after(logs, failed, survivors=None) -> float:
    """Seconds from rank ``failed``'s failure to the last of ``survivors`` (default: every other rank) ending with an
    error, from the wall-clock stamps dist_job prints (load on the machine slows the imports before, not this)."""
    def stamp(log, what):
        found = re.findall(rf"^{re.escape(what)} ([0-9.]+)$", log, re.MULTILINE)
        assert found, f"no '{what}' line in:\n{log}"
        return float(found[-1])
    survivors = [r for r in range(len(logs)) if r != failed] if survivors is None else survivors
    took = max(stamp(logs[r], dist_job.ENDED) for r in survivors) - stamp(logs[failed], dist_job.FAILING)
    print(f"noticed after {took:.2f} s")
    return took


def distributed_error(log: str) -> str:
    """The last line of a rank's log that reports a DistributedError ("" if none)."""
    lines = [line for line in log.splitlines() if "DistributedError: " in line]
    return lines[-1] if lines else ""


def survivor_errors(codes, logs, ranks):
    """(rank, its DistributedError line) for each of ``ranks``, after checking that each failed with an error that
    names itself."""
    for r in ranks:
        assert codes[r] == 1, f"rank {r} (1: its error, uncaught; -6: an abort at exit):\n{logs[r]}"
        error = distributed_error(logs[r])
        assert error.startswith(f"[rank{r}]: pyengine.distributed.DistributedError: rank {r}: "), logs[r]
        yield r, error


@pytest.mark.timeout(120)
@pytest.mark.parametrize("servers,world,how", [(1, 3, "raise"), (2, 4, "exit")])
def test_a_client_that_ended_normally_learns_which_rank_failed_after_it(tmp_path, seed, servers, world, how):
    finished, failed = servers, world - 1
    codes, logs, _ = launch(f"async-finished-{how}-{servers}", world, tmp_path, seed, timeout=90.0, grace=15.0)
    assert noticed_after(logs, failed) < 10
    for r in range(world - 1):
        assert codes[r] == 1, f"rank {r} (1: its error, uncaught; -6: an abort at exit):\n{logs[r]}"
        assert f"rank {r}: the async run stopped because rank {failed} failed" in distributed_error(logs[r]), logs[r]
    # the finished client learns it from the servers' end-of-run message, with what the failed rank said
    error = distributed_error(logs[finished])
    assert any(error.endswith(f"(reported by rank {s})") for s in range(servers)), error
    if how == "raise":
        assert f"RuntimeError: rank {failed} fails on purpose" in error, error


@pytest.mark.timeout(120)
def test_a_hybrid_rank_whose_loss_raises_mid_step_ends_the_others_with_an_error_naming_it(tmp_path, seed):
    world = 3
    codes, logs, _ = launch("failure-loss", world, tmp_path, seed, timeout=90.0, grace=15.0)
    assert noticed_after(logs, 1) < 10
    assert codes[1] not in (0, None) and "rank 1 fails on purpose" in logs[1], logs[1]
    for r, error in survivor_errors(codes, logs, (0, 2)):
        # named through the rendezvous store (Note [Naming the rank that failed]), with rank 1's own error
        assert re.search(r"; rank 1 failed: WorkerError: worker [01] \(cpu\) failed: RuntimeError: rank 1 fails on "
                         r"purpose$", error), error


@pytest.mark.timeout(120)
def test_a_failed_hybrid_step_leaves_no_reducer_waiting(tmp_path, seed):
    """A local worker's failure mid-step: the reducer thread, waiting for that worker's buckets, waited for good and
    held the engine until close(); it now ends by itself, on the failed rank and on the one its failure ended."""
    codes, logs, _ = launch("reducer-after-failure", 2, tmp_path, seed, timeout=90.0, grace=15.0)
    assert codes == [0, 0], "\n".join(logs)
    ranks = results(tmp_path, 2)
    assert [r["error"] for r in ranks] == ["DistributedError", "WorkerError"], ranks
    assert [r["reducers"] for r in ranks] == [[], []], ranks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("who", ["server", "callback", "client"])
def test_closing_a_multi_node_async_run_ends_it_cleanly(tmp_path, seed, who):
    """Note [Closing a multi-node async run]: close() on rank 0 during fit (another thread, or a callback) returned at
    once while the pushes went on to the last, and fit returned normally; on a client it closed the transfers under
    its worker and failed the run on every rank as that rank's error. Now rank 0's close stops the run after the push
    being applied (a callback's: exactly 5 pushes), a client's ends its part, close() returns after that rank's fit
    ended, and the closed rank's fit raises RuntimeError while the other ends normally. Closed between two pushes
    (from another thread while the client computes push 6), rank 0 applies none more (it applied the next)."""
    codes, logs, _ = launch(f"async-close-{who}", 2, tmp_path, seed, timeout=90.0, grace=15.0)
    assert codes == [0, 0], "\n".join(logs)
    ranks = results(tmp_path, 2)
    closed = 1 if who == "client" else 0
    assert ranks[closed]["error"].startswith("RuntimeError: this Engine was closed while fit() was running"), ranks
    assert ranks[1 - closed]["error"] is None, ranks
    if who != "client":  # rank 0 closed after push 5 (its callback, or another thread while push 6 computes)
        assert ranks[0]["pushes"] == 5, ranks
    else:
        assert 5 <= ranks[0]["pushes"] < 200, ranks
    if who != "callback":
        assert ranks[closed]["close_after_fit"] is True, ranks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("servers", [1, 2])
def test_async_refresh_is_counted_by_its_client_when_the_run_stops_after_it(tmp_path, seed, servers):
    """A client counted a refresh only when its next pull said go on: a push refused as too stale just before the run
    stopped was counted by rank 0 and by no client (18 refreshes against 17, in a fresh-clone run of the test above).
    Here rank 0 stops the run as it refuses a push; the client learns the decision with the STOP and counts it."""
    world = servers + 2
    codes, logs, _ = launch(f"async-refresh-stop-{servers}", world, tmp_path, seed, timeout=90.0, grace=15.0)
    assert codes == [0] * world, "\n".join(logs)
    ranks = results(tmp_path, world)
    server, clients = ranks[0], ranks[servers:]
    assert server["stats"]["refreshes"] == 1, server["stats"]
    assert sorted(c["stats"]["refreshes"] for c in clients) == [0, 1], [c["stats"] for c in clients]
    refused = next(c for c in clients if c["stats"]["refreshes"])
    assert refused["stats"]["pushes"] == 1 and refused["history"] == [], refused  # its first, never applied
    applied = [c["history"] for c in clients if not c["stats"]["refreshes"]][0]
    assert applied == list(range(1, server["stats"]["pushes"] + 1)), (applied, server["stats"])


@pytest.mark.timeout(120)
def test_a_multi_node_async_clients_callbacks_see_its_applied_pushes_and_may_stop_it(tmp_path, seed):
    """fit(callbacks=...) on a client was silently ignored: its callbacks now get each of its pushes that rank 0
    applied, and a stop() there ends the client's pushes (rank 0 applied exactly 3, then the run ended). A server
    given batches warns that it does not train on them."""
    codes, logs, _ = launch("async-client-callback", 2, tmp_path, seed, timeout=90.0, grace=15.0)
    assert codes == [0, 0], "\n".join(logs)
    ranks = results(tmp_path, 2)
    assert ranks[1]["seen"] == [1, 2, 3], ranks
    assert ranks[1]["taken"] == 3, "the client took a batch after its stop() and dropped it (a generator lost it)"
    assert ranks[0]["seen"] == [1, 2, 3] and ranks[0]["pushes"] == 3, ranks
    # the server's own batches are not trained on, and it says so (they were dropped silently)
    assert [where for w, where in zip(ranks[0]["warnings"], ranks[0]["where"]) if w.startswith(
        "fit: rank 0 is a parameter server (servers=1) and trains on no batches: its 2 are not used")] == \
        ["dist_job.py"], ranks[0]  # the line that called fit
    assert not any("parameter server" in w for w in ranks[1]["warnings"]), ranks[1]["warnings"]


@pytest.mark.timeout(120)
def test_a_multi_node_async_clients_steps_bound_its_pushes(tmp_path, seed):
    """fit(batches, steps=3) on a client pushes at most 3 times, as in one process (its steps were ignored and its 4
    batches cycled for ever: with a server given no steps, the run never ended). Note [The servers hold a client's
    statistics]: rank 0's state holds the client's BatchNorm statistics, as one process's holds its worker's (it
    held the untrained ones, and a checkpoint with them)."""
    codes, logs, _ = launch("async-client-steps", 2, tmp_path, seed, timeout=60.0)
    assert codes == [0, 0], "\n".join(logs)
    server, client = results(tmp_path, 2)
    assert client["stats"]["pushes"] == 3 and server["stats"]["pushes"] == 3 and server["version"] == 3, \
        (server, client)
    assert_identical(server["buffers"], client["buffers"], "buffers")  # the client's bytes
    assert_identical(server["master"], client["master"], "master")
    torch.set_num_threads(1)  # as the ranks ran (the conftest puts the count back)
    with pyengine.Engine(dist_job.make_bn_model(), dist_job.loss_fn, devices=["cpu"], mode="async",
                         optimizer=pyengine.AdamW(**dist_job.OPT), pin=False) as alone:
        alone.fit([dist_job.client_batch(seed, 1, i) for i in range(4)], steps=3)
        want = alone.buffers_state_dict()
        assert int(want["1.num_batches_tracked"]) == 3
        for name, value in {**want, **alone.master_state_dict()}.items():
            torch.testing.assert_close({**client["buffers"], **client["master"]}[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_a_nonfinite_push_under_raise_is_a_floating_point_error_on_every_rank(tmp_path, seed):
    """nonfinite="raise" across processes: rank 0 refuses the client's non-finite push, and every rank's fit raises
    FloatingPointError naming it, as in one process and in hybrid (it was a DistributedError blaming rank 0, which
    code catching FloatingPointError missed); with one server the engine then trains on."""
    codes, logs, _ = launch("async-nonfinite-raise", 2, tmp_path, seed, timeout=90.0)
    assert codes == [0, 0], "\n".join(logs)
    for rank, got in enumerate(results(tmp_path, 2)):
        assert got["first"].startswith(f"FloatingPointError: rank {rank}: the async run stopped because rank 0 "
                                       "failed: applying a push of rank 1 raised FloatingPointError: non-finite "
                                       "gradient"), (rank, got)
    server = results(tmp_path, 2)[0]
    assert server["stats"]["raised_steps"] == 1 and server["stats"]["applied_updates"] == 2 + 3, server["stats"]


@pytest.mark.timeout(120)
def test_after_a_failed_run_of_several_servers_the_engine_refuses_to_go_on(tmp_path, seed):
    """Note [A failed run of several servers]: with 2 servers, a run that failed (a non-finite push under
    nonfinite="raise") left server 1's pushes out of rank 0's store; the next fit began from rank 0's store and trained
    on with server 1's shard back at the failed run's start (4e-2 off one process). Now every rank refuses a further
    fit and its state, at once and saying why; a run that failed before any push was applied does not stop the
    next."""
    codes, logs, _ = launch("async-split", 3, tmp_path, seed, timeout=90.0)
    assert codes == [0, 0, 0], "\n".join(logs)
    for rank, got in enumerate(results(tmp_path, 3)):
        # a run that failed before any push was applied left every shard as it was: the next run trains
        assert "no data today" in got["early"] and "no data today" in got["first"], (rank, got)
        assert got["after_early"] == 2, (rank, got)
        assert got["fit"].startswith(f"FloatingPointError: rank {rank}: the async run stopped"), (rank, got)
        for what in ("again", "state", "master"):
            assert got[what].startswith(f"DistributedError: rank {rank}: an earlier async run failed, and with "
                                        "servers=2 each server's shard"), (rank, what, got)
        assert got["save"].startswith(f"DistributedError: rank {rank}: an earlier"), (rank, got)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["callback", "iter"])
def test_a_multi_node_async_clients_own_error_is_raised_as_itself_and_named_at_once(tmp_path, seed, how):
    """A client's callback that raised did so inside an exchange (server 0 was sending it the weights): both waited
    for the group's timeout and rank 0 was blamed. Its batches iterable's error at a new epoch came out as the
    private _AsItself wrapper. Each is now the client's own error, raised as itself there and named by rank 0 at
    once (the group's timeout is 20 s)."""
    codes, logs, _ = launch(f"async-client-raises-{how}", 2, tmp_path, seed, timeout=90.0, grace=15.0)
    assert codes == [0, 0], "\n".join(logs)
    ranks = results(tmp_path, 2)
    own = {"callback": "builtins.RuntimeError: the callback refuses push 2",
           "iter": "builtins.OSError: epoch 2 cannot open"}[how]
    assert ranks[1]["error"] == own, ranks
    assert ranks[0]["error"] == ("pyengine.distributed.DistributedError: rank 0: the async run stopped because "
                                 f"rank 1 failed: {own.split('.', 1)[1]} (reported by rank 1)"), ranks
    assert max(r["seconds"] for r in ranks) < 15, ranks


@pytest.mark.timeout(120)
def test_a_local_batch_too_small_for_the_workers_is_refused_by_every_rank(tmp_path, seed):
    """A rank whose own batch has fewer samples than its workers (a data set's uneven tail) failed its step, which
    broke the group (the others waited in the step's collectives until that rank exited or the group's timeout).
    Now every rank refuses that step together, as a shard too small for its micro-batches: each raises ValueError
    (the rank its own, the others naming why), nothing is trained, and the ranks train on alike."""
    codes, logs, seconds = launch("bad-local-batch", 2, tmp_path, seed, timeout=90.0, grace=15.0)
    assert codes == [0, 0], "\n".join(logs)
    assert seconds < 30  # no wait for the group's timeout (20 s)
    ranks = results(tmp_path, 2)
    assert ranks[1]["errors"] == [(3, "a batch of 1 samples cannot feed 2 workers; use a batch of at least 2"),
                                  (5, "every tensor of a batch must have the same size along dim 0; batch[0] has 8, "
                                      "batch[1] has 7")], ranks[1]
    # the others name the rank and why (a batch that cannot be split was said to have too few samples)
    assert ranks[0]["errors"] == [(3, "rank 0: rank 1 has a batch with fewer samples than its local workers; this "
                                      "step was refused on every rank"),
                                  (5, "rank 0: rank 1 has a batch that cannot be split on dim 0 (its own error says "
                                      "why); this step was refused on every rank")], ranks[0]
    assert [r["version"] for r in ranks] == [5, 5]
    assert_identical(ranks[0]["master"], ranks[1]["master"], "after the refused steps")
    reference = Reference()
    for i, batch in enumerate(dist_job.global_batches(seed, 7, 16)):
        if i not in (3, 5):
            reference.step(batch)
    reference.assert_matches(ranks[0]["master"])


@pytest.mark.timeout(90)
def test_hybrid_allreduce_of_early_buckets_overlaps_backward(tmp_path, seed):
    """Each bucket's allreduce is launched as soon as every local worker delivered it, while backward goes on: with
    the last bucket's gradient held back 1.0 s in backward, every bucket before it was launched before the workers
    finished (replicated and sharded, 2 ranks x 2 local workers; metric ``overlapped_buckets``). A step that reduced
    only after backward would report 0."""
    codes, logs, _ = launch("overlap", 2, tmp_path, seed, timeout=75)
    assert codes == [0, 0], "\n".join(logs)
    for out in results(tmp_path, 2):
        for name in ("replicated", "sharded"):
            buckets = out[name]["buckets"]
            assert buckets >= 2, buckets
            # the last bucket's launch may also beat the workers' return; every earlier one must
            assert all(buckets - 1 <= n <= buckets for n in out[name]["overlapped"]), (name, out[name])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["replicated", "sharded", "checkpoint"])
def test_a_hybrid_rank_that_dies_between_steps_is_named_by_the_others(tmp_path, seed, kind):
    """Rank 1 of 3 exits (os._exit: no exception, nothing recorded) after its third step; ranks 0 and 2 are in the
    fourth step's first collective (sharded: in a gather of the optimizer state first, as a checkpoint would;
    checkpoint: in checkpoint.save_engine's exchanges, which raised gloo's bare RuntimeError). They must raise
    DistributedError naming rank 1 from the ranks' check-ins, and saying which ranks did reach that phase (Note
    [Naming a rank that died between steps]), on the closed connection, long before the group's timeout."""
    codes, logs, _ = launch(f"death-{kind}-1", 3, tmp_path, seed, timeout=90.0, pg_timeout=60.0, grace=15.0)
    assert codes[1] == 17, logs[1]
    phase = {"replicated": "step 4", "sharded": "the gather of the optimizer state after step 3",
             "checkpoint": "the exchange of the steps and versions for checkpoint step 3"}[kind]
    for r in (0, 2) if kind == "checkpoint" else ():  # the group is broken: stepping on is refused at once
        refused = re.search(rf"the next step refused after ([0-9.]+) s: rank {r}: an earlier step failed; the group "
                            "is no longer usable", logs[r])
        assert refused and float(refused.group(1)) < 5, logs[r]  # not a wait for the group's 60 s timeout
    for r, error in survivor_errors(codes, logs, (0, 2)):
        assert re.search(rf"; rank 1 never reached {phase} \(ranks 0, 2 did; this rank waited [0-9.]+ s after "
                         r"reaching it\): it died, exited, raised or hangs before it; see its log$", error), error
        assert "Timed out" not in error, error
    assert noticed_after(logs, 1) < 15  # the check-ins wait PRESENCE_WAIT_S (5 s); the group's timeout is 60 s


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["exit", "record"])
def test_an_async_rank_gone_before_a_run_is_named_by_the_others(tmp_path, seed, how):
    """Multi-node async: rank 1 exits between two fit() calls, silently or after Engine.record_failure; rank 0's next
    run fails in its opening exchange and must name rank 1 (from the check-ins, or with the recorded error), not
    only "a peer rank died" (Note [Naming a rank that died between steps], AsyncNaming)."""
    codes, logs, _ = launch(f"async-gone-{how}", 2, tmp_path, seed, timeout=90.0, pg_timeout=60.0, grace=15.0)
    assert codes[1] == 17, logs[1]
    for r, error in survivor_errors(codes, logs, (0,)):
        assert "broadcast of the async store failed" in error, error
        if how == "exit":
            assert re.search(r"; rank 1 never reached the start of async run 2 \(fit\) \(rank 0 did; this rank waited "
                             r"[0-9.]+ s after reaching it\)", error), error
        else:
            assert error.endswith("; rank 1 failed: RuntimeError: rank 1's data loader broke"), error
    assert noticed_after(logs, 1) < 15  # the check-ins wait PRESENCE_WAIT_S (5 s); the group's timeout is 60 s


@pytest.mark.timeout(120)
def test_a_hybrid_rank_that_dies_inside_a_step_is_reported_as_such(tmp_path, seed):
    """Rank 1 of 3 exits inside its fourth step (in a worker's loss): every rank reached that step, so the others
    cannot name it from the check-ins; their errors must say that every rank reached step 4 and a peer died, exited,
    raised or hangs inside it (the limit of Note [Naming a rank that died between steps]), without waiting for the
    group's timeout."""
    codes, logs, _ = launch("failure-loss-exit", 3, tmp_path, seed, timeout=90.0, pg_timeout=60.0, grace=15.0)
    assert codes[1] == 17, logs[1]
    assert noticed_after(logs, 1) < 15  # the group's timeout is 60 s
    for r, error in survivor_errors(codes, logs, (0, 2)):
        assert error.endswith("; every rank (ranks 0, 1, 2) reached step 4, so a peer died, exited, raised or "
                              "hangs inside it (gloo's error names its address, not its rank); see the other ranks' "
                              "logs"), error


@pytest.mark.timeout(120)
def test_a_hybrid_rank_0_that_dies_between_steps_is_named_by_the_others(tmp_path, seed):
    """Rank 0 hosts the rendezvous store (a launch without torchrun's agent): when it dies between steps, the others
    cannot read the check-ins, and their errors say that the store's host, rank 0, is gone."""
    codes, logs, _ = launch("death-replicated-0", 3, tmp_path, seed, timeout=90.0, pg_timeout=60.0, grace=15.0)
    assert codes[0] == 17, logs[0]
    assert noticed_after(logs, 0) < 15  # the group's timeout is 60 s
    for r, error in survivor_errors(codes, logs, (1, 2)):
        assert re.search(r"; the rendezvous store is unreachable too \(.*\), so its host, rank 0, is gone \(died or "
                         r"exited\); see its log$", error), error


@pytest.mark.timeout(120)
@pytest.mark.parametrize("who,servers,world", [("server", 1, 3), ("server", 2, 4), ("client", 1, 3)])
def test_a_hanging_async_rank_ends_every_other_rank_with_an_error_naming_it(tmp_path, seed, who, servers, world):
    """A server hangs while applying a push, holding its mutex (the coordinator rank 0 when it is the only server,
    else rank 1), or the last client hangs mid-computation. Every other rank must raise DistributedError naming the
    hung rank within about twice the group's timeout (3 s here), including a rank whose own wait timed out first on
    a rank that was itself waiting for the hung one (Note [A timeout names the rank that hangs]); the hung rank is
    killed by the test."""
    hung = servers - 1 if who == "server" else world - 1
    main = world - 1 if hung != world - 1 else 0
    codes, logs, _ = launch(f"async-{who}-hang-{servers}", world, tmp_path, seed, timeout=90.0, pg_timeout=3.0,
                            grace=15.0, main=main, hung=[hung])
    assert codes[hung] is None, f"rank {hung} was to hang:\n{logs[hung]}"
    for r in range(world):
        if r != hung:
            assert codes[r] == 1, f"rank {r} (1: its error, uncaught; -6: an abort at exit):\n{logs[r]}"
            assert f"rank {r}: the async run stopped because rank {hung} failed: rank {hung} did not answer within " \
                   "the process group's timeout (3 s)" in distributed_error(logs[r]), logs[r]
    assert noticed_after(logs, hung) < 12  # about twice the group's timeout (3 s), with room for a loaded machine
