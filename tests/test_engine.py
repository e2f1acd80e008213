"""The engine's three schedules, each against a reference it does not share code with: torch.optim on one copy of
the model (float64), run step by step on the same batches."""
import collections
import copy
import functools
import gc
import json
import os
import pickle
import statistics
import threading
import time
import warnings
import weakref

import pytest
import torch

import pyengine
from pyengine import AdamW, Engine, WorkerError

from conftest import CUDA, loss_fn, make_batches

# eps = 1e-3: Adam's step m / (sqrt(v) + eps) moves by up to delta / eps for a gradient error delta. The replicas
# compute in fp32 (delta ~ 1e-7 of the gradient terms, ~1e-9 here) against a fp64 reference, so eps = 1e-3 bounds
# the difference at ~lr * 1e-6 per step for every element, instead of leaving elements whose gradient happens to be
# near zero to chance. The kernel's handling of small eps is covered by tests/test_ops.py with exact gradients.
OPT = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.01)


def make_model(seed=0, d_in=10, hidden=24, d_out=3, dropout=0.0):
    torch.manual_seed(seed)
    middle = [torch.nn.Dropout(dropout)] if dropout else []
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.Tanh(), *middle,
                               torch.nn.Linear(hidden, d_out))


class TorchReference:
    """One model in float64 trained by torch.optim.AdamW: the independent reference."""

    def __init__(self, model, **opt):
        self.model = copy.deepcopy(model).double()
        self.opt = torch.optim.AdamW(self.model.parameters(), foreach=False, **opt)

    def step(self, batches, clip=None):
        self.opt.zero_grad()
        for x, y in batches:
            loss_fn(self.model, (x.double(), y)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.opt.step()


def assert_matches(engine, reference, rtol=1e-5):
    master = engine.master_state_dict()
    assert list(master) == [n for n, p in reference.model.named_parameters() if p.requires_grad]  # the model's order
    for name, p in reference.model.named_parameters():
        scale = p.detach().abs().max().item()
        torch.testing.assert_close(master[name].double(), p.detach(), rtol=rtol, atol=rtol * scale, msg=name)


def assert_state_is(engine, before: dict, stats: dict, version: int) -> None:
    """The engine's weights, Adam state (its step too), version and counters are those of ``before`` (a
    state_dict) and ``stats``: nothing of a refused or failed step counted or was written."""
    after = engine.state_dict()
    assert engine.version == version and engine.stats() == stats
    for name, value in before["master"].items():
        assert torch.equal(after["master"][name], value), name
    for index, entry in before["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(after["optimizer"]["state"][index][key], value), (index, key)


# 1e-6 MiB (one byte): every parameter of make_model() gets its own bucket, so the per-bucket norm and update paths
# of the hybrid schedule run over four buckets (the default 25 MiB puts the whole model in one).
TINY_BUCKETS = dict(bucket_mb=1e-6, first_bucket_mb=1e-6)


@pytest.mark.parametrize("buckets", [{}, TINY_BUCKETS, dict(eager_mb=0), dict(TINY_BUCKETS, eager_mb=None)],
                         ids=["1-bucket", "4-buckets", "1-bucket-early-copies", "4-buckets-whole"])
@pytest.mark.parametrize("workers,batch", [(1, 32), (2, 32), (4, 67)], ids=["G1", "G2", "G4-uneven"])
def test_hybrid_equals_one_big_batch(rng, workers, batch, buckets, worker_device):
    model = make_model()
    reference = TorchReference(model, **OPT)
    with Engine(model, loss_fn, devices=[worker_device] * workers, optimizer=AdamW(**OPT), **buckets) as engine:
        assert len(engine.workers[0].streamer.buckets) == (4 if "bucket_mb" in buckets else 1)
        assert engine.workers[-1].streamer.eager_mb == buckets.get("eager_mb", 1.0)
        for b in make_batches(rng, 12, batch):
            engine.step(b)
            reference.step([b])
        assert_matches(engine, reference)
        assert engine.stats()["applied_updates"] == 12


_ENGINE_ON_CUDA_1 = """
import torch, pyengine
from pyengine import AdamW, Engine
model = torch.nn.Linear(8, 2)
with Engine(model, lambda m, b: m(b).square().mean(), devices=["cuda:1"], optimizer=AdamW(lr=1e-2), pin=True) as e:
    assert e.store.pinned
    e.step(torch.randn(4, 8))
print(torch._C._cuda_hasPrimaryContext(0), torch._C._cuda_hasPrimaryContext(1))
"""


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_cuda_an_engine_on_cuda_1_makes_no_context_on_cuda_0():
    """Note [Pinning under a context that exists]: pinning the store ran on the current device (0), and made a CUDA
    context there (hundreds of MiB of GPU 0) in a process that trains on cuda:1 alone, as each rank of a one-GPU-
    per-process job does. In a fresh process: this one may have made contexts already."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _ENGINE_ON_CUDA_1], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout, run.stderr[-2000:])
    assert run.stdout.split() == ["False", "True"], run.stdout


@CUDA
@pytest.mark.parametrize("mode", ["hybrid", "sync"])
def test_cuda_step_called_on_a_side_stream_waits_for_the_batch_written_there(rng, mode):
    """Note [A worker task runs on its caller's streams]: the workers run on pool threads, whose current stream is
    the default one; a batch written on the caller's stream behind a long kernel must still be read after it."""
    model = make_model()
    reference = TorchReference(model, **OPT)
    side = torch.cuda.Stream()
    with Engine(model, loss_fn, devices=["cuda:0"] * 2, mode=mode, optimizer=AdamW(**OPT)) as engine:
        for b in make_batches(rng, 4, 32):
            staged = tuple(t.cuda() for t in b)
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                batch = tuple(torch.zeros_like(t) for t in staged)
                torch.cuda._sleep(100_000_000)  # tens of milliseconds before the batch is written
                for dst, src in zip(batch, staged):
                    dst.copy_(src)
                engine.step(batch)
            reference.step([b])  # hybrid: one step on the whole batch; sync: one worker's step on it
        assert_matches(engine, reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_low_precision_model_trains_on_float32_master_weights(rng, workers, dtype, worker_device):
    """A model whose weights are bfloat16/float16: the replicas hold the float32 master weights rounded as torch
    rounds them, bit for bit, after every step (the update writes them into the store's shadow, which they pull),
    and each update is AdamW (float64 torch reference) on the mean of the replicas' own gradients. The reference's
    gradients come from a copy of the model holding the replicas' weights (the engine's master rounded), on the
    workers' device and shards (the same kernels: low-precision gradients of another device or summation order
    differ by whole ulps, which Adam does not damp below the tolerance); its own float64 master rounds the same way
    but for ties."""
    def low_loss(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y)

    model = make_model().to(dtype)
    reference = TorchReference(model, **OPT)
    twin = copy.deepcopy(model).to(worker_device)  # the reference's gradients, from the replicas' weights
    with Engine(model, low_loss, devices=[worker_device] * workers, optimizer=AdamW(**OPT)) as engine:
        # the replicas pull the store's shadow, which the update writes (Note [The shadow follows the master weights])
        assert engine.store.shadow is not None and engine.store.shadow.dtype == dtype
        for b in make_batches(rng, 5, 32):
            master = engine.master_state_dict()
            for worker in engine.workers:
                worker.streamer.wait_weights()  # the last step's copies back (the next forward waits for them too)
                for name, p in worker.replica.named_parameters():
                    assert p.dtype == dtype and torch.equal(p.detach().cpu(), master[name].to(dtype)), name
            twin.load_state_dict({name: value.to(dtype) for name, value in master.items()})
            reference.opt.zero_grad()
            for g in range(workers):
                shard = tuple(torch.tensor_split(t, workers)[g].to(worker_device) for t in b)
                twin.zero_grad()
                low_loss(twin, shard).backward()  # equal shards: the mean gradient is the shards' mean
                for p, q in zip(reference.model.parameters(), twin.parameters(), strict=True):
                    p.grad = q.grad.cpu().double() / workers + (0 if p.grad is None else p.grad)
            reference.opt.step()
            engine.step(b)
        assert_matches(engine, reference)
        assert engine.stats()["applied_updates"] == 5


@pytest.mark.parametrize("mode", ["hybrid", "sync", "async", "pipeline"])
def test_a_loaded_state_reaches_low_precision_replicas(rng, mode, worker_device):
    """Note [The shadow follows the master weights]: a bfloat16 model's replicas (pipeline: stages) pull the store's
    shadow, so a loaded state must rewrite it: after load_state_dict every replica holds the loaded master weights
    rounded, and the next step is the saved engine's next step, bit for bit."""
    def low_loss(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x.to(torch.bfloat16)).float(), y)

    def replicas(engine):
        if mode == "pipeline":
            for stage in (s for row in engine.pipeline.stages for s in row):
                with stage.context():
                    yield from stage.params
            return
        for worker in engine.workers:
            worker.streamer.wait_weights()
            yield from worker.replica.named_parameters()

    def step(engine, batch):  # async: one worker, one push per fit (a fixed order)
        return engine.fit([batch], steps=1) if mode == "async" else engine.step(batch)

    workers = 1 if mode == "async" else 2
    options = dict(devices=[worker_device] * workers, optimizer=AdamW(**OPT), mode=mode, **TINY_BUCKETS)
    if mode == "pipeline":
        options = dict(options, stages=2, microbatches=2, bucket_mb=25, first_bucket_mb=1)
    batches = [(x.to(torch.bfloat16), y) for x, y in make_batches(rng, 4, 32)]  # a pipeline's first stage reads x
    with Engine(make_model(seed=1).to(torch.bfloat16), low_loss, **options) as saved:
        for b in batches[:3]:
            step(saved, b)
        state = saved.state_dict()
        with Engine(make_model(seed=2).to(torch.bfloat16), low_loss, **options) as loaded:
            loaded.load_state_dict(state)
            if mode == "pipeline":
                for stage in (s for row in loaded.pipeline.stages for s in row):
                    stage.pull()
            if worker_device != "cpu":
                torch.cuda.synchronize()
            seen = 0
            for name, p in replicas(loaded):
                assert torch.equal(p.detach().cpu(), state["master"][name].to(torch.bfloat16)), name
                seen += 1
            assert seen == (4 if mode == "pipeline" else workers * 4)  # a pipeline: one replica in 2 stages
            step(saved, batches[3])
            step(loaded, batches[3])
            assert loaded.version == saved.version == 4
            for name, value in saved.master_state_dict().items():
                assert torch.equal(loaded.master_state_dict()[name], value), name


@pytest.mark.parametrize("buckets", [{}, TINY_BUCKETS], ids=["1-bucket", "4-buckets"])
def test_hybrid_with_clipping(rng, buckets, worker_device):
    opt = OPT
    model = make_model()
    reference = TorchReference(model, **opt)
    with Engine(model, loss_fn, devices=[worker_device] * 3, optimizer=AdamW(**opt, max_grad_norm=0.05),
                **buckets) as engine:
        for b in make_batches(rng, 10, 30):
            engine.step(b)
            reference.step([b], clip=0.05)
        assert_matches(engine, reference)


def test_hybrid_clips_a_mean_gradient_whose_float32_sum_overflows(worker_device):
    """Note [A finite mean whose float32 sum overflows] through the engine: each of 3 workers' gradient is 2e38, finite,
    and so is their mean, but not their float32 sum. The step was skipped as non-finite; it is torch.optim's step on
    the whole batch (clip_grad_norm_ of the mean, in float64)."""
    def huge_loss(model, batch):
        x, _ = batch
        return model(x).mean() * 2e38  # d loss / d w = 2e38 for every weight (x is all ones), on any share of x

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)  # norm of the mean gradient: 2e38 * sqrt(2), within float32
    reference = copy.deepcopy(model).double()
    opt = torch.optim.AdamW(reference.parameters(), foreach=False, **OPT)
    batch = (torch.ones(6, 2), torch.zeros(6, dtype=torch.long))
    with Engine(model, huge_loss, devices=[worker_device] * 3, optimizer=AdamW(**OPT, max_grad_norm=1.0),
                nonfinite="skip") as engine:
        for _ in range(3):
            engine.step(batch)
            opt.zero_grad()
            huge_loss(reference, (batch[0].double(), None)).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            opt.step()
        assert engine.stats()["applied_updates"] == 3, engine.stats()
        torch.testing.assert_close(engine.master_state_dict()["weight"].double(), reference.weight.detach(),
                                   rtol=1e-5, atol=1e-6)


# ---- micro-batches within a step (gradient accumulation) ----

@pytest.mark.parametrize("mode,workers,batch", [("hybrid", 3, 37), ("sync", 2, 23)])
def test_microbatches_equal_one_big_batch(rng, mode, workers, batch, worker_device):
    """microbatches=4: each worker's part of the batch runs as 4 uneven micro-batches (every forward sees one of
    them), whose weighted gradients accumulate before one transfer: the same weights and losses as torch.optim.AdamW
    on the whole batch."""
    model = make_model()
    reference = TorchReference(model, **OPT)
    seen = []

    def recording_loss(replica, b):
        seen.append(b[0].shape[0])
        return loss_fn(replica, b)

    with Engine(model, recording_loss, devices=[worker_device] * workers, mode=mode, optimizer=AdamW(**OPT),
                microbatches=4, **TINY_BUCKETS) as engine:
        for b in make_batches(rng, 8, batch):
            seen.clear()
            metrics = engine.step(b)
            ref_loss = loss_fn(reference.model, (b[0].double(), b[1])).item()
            reference.step([b])
            assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5)
            parts = [batch] if mode == "sync" else [len(t) for t in torch.tensor_split(b[0], workers)]
            expected = [len(t) for n in parts for t in torch.tensor_split(torch.empty(n), 4)]
            assert sorted(seen) == sorted(expected)
        assert_matches(engine, reference)


def test_microbatches_bad_values_and_a_shard_too_small(rng):
    for mode, value, message in [("hybrid", 0, "microbatches must be an int >= 1"),
                                 ("sync", True, "microbatches must be an int >= 1"),
                                 ("async", 2, "async workers sum mini-batches before a push with accumulate")]:
        with pytest.raises(ValueError, match=message):
            Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode, microbatches=value)
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT), microbatches=4) as engine:
        with pytest.raises(ValueError, match=r"worker 1's shard of 3 samples cannot be split into microbatches=4; "
                                             r"use at least 4 samples there \(a batch of at least 8 samples gives "
                                             r"each of the 2 workers a shard of 4 or more\)"):
            engine.step(make_batches(rng, 1, 7)[0])
        assert engine.version == 0 and engine.stats()["steps"] == 0
        assert engine.step(make_batches(rng, 1, 8)[0])["applied"] and engine.version == 1


# ---- parameters without weight decay ----

def norm_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.LayerNorm(24), torch.nn.Tanh(),
                               torch.nn.Linear(24, 3))


NO_DECAY = ("bias", "1.")  # every bias, and the LayerNorm's weight


@pytest.mark.parametrize("mode,workers", [("hybrid", 2), ("sync", 2), ("async", 1), ("pipeline", 2)])
@pytest.mark.parametrize("flags", [dict(maximize=True), dict(amsgrad=True), dict(adamw=False, maximize=True)],
                         ids=["maximize", "amsgrad", "adam-maximize"])
def test_optimizer_flags_reach_the_update_as_torchs(rng, mode, workers, flags):
    """AdamW(maximize=, amsgrad=, adamw=) against torch in float64 (the fused kernel's flags are tested in
    test_ops; this checks the engine hands them to it: a maximize left at False trained downhill unnoticed). A loss
    to maximize: the negative cross-entropy."""
    def negative(model, batch):
        return -loss_fn(model, batch)

    flags = dict(flags)  # the parameter's dict is shared by every mode's case
    adamw = flags.pop("adamw", True)
    model = make_model()
    reference = copy.deepcopy(model).double()
    kind = torch.optim.AdamW if adamw else torch.optim.Adam  # Adam: L2 weight decay added to the gradient
    ref_opt = kind(reference.parameters(), foreach=False, **OPT, **flags)
    extra = dict(microbatches=2) if mode == "pipeline" else {}
    with Engine(model, negative, devices=["cpu"] * workers, mode=mode, optimizer=AdamW(**OPT, **flags, adamw=adamw),
                **extra) as engine:
        for x, y in make_batches(rng, 5, 12):
            engine.step((x, y)) if mode != "async" else engine.fit([(x, y)])
            ref_opt.zero_grad()
            negative(reference, (x.double(), y)).backward()
            ref_opt.step()
        master = engine.master_state_dict()
    for name, p in reference.named_parameters():
        scale = p.detach().abs().max().item()
        torch.testing.assert_close(master[name].double(), p.detach(), rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("mode,workers,options", [
    ("hybrid", 2, TINY_BUCKETS), ("hybrid", 2, {}), ("sync", 2, {}), ("pipeline", 2, dict(microbatches=2))],
    ids=["hybrid-4-buckets", "hybrid-1-bucket", "sync", "pipeline"])
def test_no_decay_equals_torch_param_groups(rng, mode, workers, options, worker_device):
    """AdamW(no_decay=...) equals torch.optim.AdamW with the usual two param groups (decayed parameters with
    weight_decay, the others with 0), weights and Adam state; optimizer_state_dict has those two groups, and a fresh
    engine that loads the state trains on identically."""
    opt = dict(OPT, weight_decay=0.2)  # large enough that decaying every parameter would be far off
    model = norm_model()
    reference = TorchReference(model, **opt)
    names = [n for n, _ in reference.model.named_parameters()]
    decayed = [n for n in names if not any(s in n for s in NO_DECAY)]
    kept = [n for n in names if any(s in n for s in NO_DECAY)]
    params = dict(reference.model.named_parameters())
    reference.opt = torch.optim.AdamW([{"params": [params[n] for n in decayed]},
                                       {"params": [params[n] for n in kept], "weight_decay": 0.0}],
                                      foreach=False, **opt)
    batches = make_batches(rng, 8, 24)
    kwargs = dict(devices=[worker_device] * workers, mode=mode, optimizer=AdamW(**opt, no_decay=NO_DECAY), **options)
    with Engine(model, loss_fn, **kwargs) as engine:
        for b in batches[:6]:
            engine.step(b)
            reference.step([b])
        assert_matches(engine, reference)
        state = engine.optimizer_state_dict()
        want = reference.opt.state_dict()
        assert [g["params"] for g in state["param_groups"]] == [g["params"] for g in want["param_groups"]] == \
            [[0, 1], [2, 3, 4, 5]]
        assert [g["weight_decay"] for g in state["param_groups"]] == [0.2, 0.0]
        for i, entry in want["state"].items():
            torch.testing.assert_close(state["state"][i]["exp_avg"].double(), entry["exp_avg"], rtol=1e-4,
                                       atol=1e-4 * entry["exp_avg"].abs().max().item())
        saved = engine.state_dict()
        for b in batches[6:]:
            engine.step(b)
        expected = engine.master_state_dict()
    with Engine(norm_model(seed=1), loss_fn, **kwargs) as resumed:
        resumed.load_state_dict(saved)
        for b in batches[6:]:
            resumed.step(b)
        for name, value in resumed.master_state_dict().items():
            assert torch.equal(value, expected[name]), name


def test_no_decay_bad_values_and_a_one_group_state(rng):
    """Bad no_decay values are TypeErrors; a state of one param group without the optimizer's config (which says
    how its groups were made; with it, it loads: test_a_state_loads_each_parameters_moments_when_no_decay_changed)
    does not load into an engine with two, and the refused load changes nothing."""
    for bad in ("bias", (1,), ("",), None):
        with pytest.raises(TypeError, match="no_decay must be a tuple of non-empty strings"):
            AdamW(no_decay=bad)
    batch = make_batches(rng, 1, 8)[0]
    with Engine(norm_model(), loss_fn, devices=["cpu"], optimizer=AdamW(**OPT)) as plain:
        plain.step(batch)
        one_group = plain.state_dict()
    assert len(one_group["optimizer"]["param_groups"]) == 1
    with Engine(norm_model(), loss_fn, devices=["cpu"], optimizer=AdamW(**OPT, no_decay=NO_DECAY)) as engine:
        engine.step(batch)
        before = engine.state_dict()
        with pytest.raises(ValueError, match=r"two groups \(AdamW\(no_decay=...\)"):
            engine.load_state_dict({k: v for k, v in one_group.items() if k != "optimizer_config"})
        swapped = copy.deepcopy(before)  # a torch dict whose second group decays: its groups in the other order
        swapped["optimizer"]["param_groups"][1]["weight_decay"] = 0.01
        with pytest.raises(ValueError, match=r"param_groups\[1\] has weight_decay 0.01; expected 0"):
            engine.load_state_dict(swapped)
        after = engine.state_dict()
        assert all(torch.equal(v, after["master"][k]) for k, v in before["master"].items())
        assert engine.version == 1


# ---- learning-rate schedule ----

SCHEDULE = pyengine.WarmupCosine(warmup_steps=3, total_steps=8, min_factor=0.1)  # 10 steps: past its end too


@pytest.mark.parametrize("mode,workers,options", [
    ("hybrid", 3, TINY_BUCKETS), ("sync", 2, {}), ("async", 1, {}), ("pipeline", 2, dict(microbatches=3))],
    ids=["hybrid", "sync", "async", "pipeline"])
def test_lr_schedule_equals_torch_lambdalr(rng, mode, workers, options, worker_device):
    """lr_schedule follows torch.optim.lr_scheduler.LambdaLR stepped after every optimizer step: the same weights,
    the step's lr reported in its metrics, and an optimizer_state_dict whose group holds the last update's lr and
    initial_lr (a lambda and pyengine.WarmupCosine alike)."""
    model = make_model()
    batches = make_batches(rng, 10, 24)
    for schedule in (SCHEDULE, lambda step: 0.5 ** step):
        reference = TorchReference(model, **OPT)
        scheduler = torch.optim.lr_scheduler.LambdaLR(reference.opt, schedule)
        with Engine(model, loss_fn, devices=[worker_device] * workers, mode=mode, optimizer=AdamW(**OPT),
                    lr_schedule=schedule, **options) as engine:
            for b in batches:
                lr = reference.opt.param_groups[0]["lr"]
                metrics = engine.fit([b])[0] if mode == "async" else engine.step(b)
                assert metrics["lr"] == pytest.approx(lr, rel=1e-12)
                reference.step([b])
                scheduler.step()
            assert_matches(engine, reference)
            group, torch_group = engine.optimizer_state_dict()["param_groups"][0], \
                reference.opt.state_dict()["param_groups"][0]
            assert group["lr"] == pytest.approx(lr, rel=1e-12)  # torch's holds the next update's lr
            assert group["initial_lr"] == torch_group["initial_lr"] == OPT["lr"]
    assert SCHEDULE(0) == pytest.approx(1 / 3) and SCHEDULE(3) == 1.0 and SCHEDULE(9) == SCHEDULE(8) == 0.1


def test_lr_schedule_counts_applied_updates_and_reaches_a_state_dict_reload(rng):
    """A skipped step (non-finite gradient) does not advance the schedule: it is asked for updates 0, 1, 2, ... in
    order, once each. An engine that loads the state continues the schedule from the loaded step."""
    batches = make_batches(rng, 5, 12)
    poisoned = (batches[2][0].clone(), batches[2][1])
    poisoned[0][0, 0] = float("nan")
    asked = []

    def schedule(step):
        asked.append(step)
        return 1.0 / (1 + step)

    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT), lr_schedule=schedule,
                **TINY_BUCKETS) as engine:
        lrs = [engine.step(b)["lr"] for b in batches[:2] + [poisoned] + batches[2:4]]
        assert asked == [0, 1, 2, 3], "once per update, in order, none for the skipped step"
        state = engine.state_dict()
    assert lrs[2] is None and lrs[:2] + lrs[3:] == pytest.approx([OPT["lr"] / k for k in (1, 2, 3, 4)], rel=1e-15)
    with Engine(make_model(seed=1), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT), lr_schedule=schedule,
                **TINY_BUCKETS) as resumed:
        resumed.load_state_dict(state)
        assert resumed.step(batches[4])["lr"] == pytest.approx(OPT["lr"] / 5, rel=1e-15)


def test_an_lr_changed_after_a_skipped_step_is_the_next_updates(rng, monkeypatch):
    """The schedule's answer is kept per update: the update a skipped step asked for runs with the next batch.
    Its lr is optimizer.lr times that answer as of the update, so an lr changed between the two counts (the kept
    value is keyed by the optimizer's lr too; observed at the kernel's arguments)."""
    batches = make_batches(rng, 2, 12)
    poisoned = (batches[0][0].clone(), batches[0][1])
    poisoned[0][0, 0] = float("nan")
    seen = []
    original = AdamW.kernel_kwargs
    monkeypatch.setattr(AdamW, "kernel_kwargs", lambda self, lr=None: seen.append(lr) or original(self, lr))
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT),
                lr_schedule=lambda step: 0.5 ** step) as engine:
        assert engine.step(batches[0])["lr"] == pytest.approx(OPT["lr"])
        assert engine.step(poisoned)["applied"] is False  # update 2 asked for, skipped
        engine.optimizer.lr = OPT["lr"] * 10
        assert engine.step(batches[1])["lr"] == pytest.approx(OPT["lr"] * 10 * 0.5, rel=1e-15)
    assert seen[-1] == pytest.approx(OPT["lr"] * 10 * 0.5, rel=1e-15)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf"), "0.1", None, True, 10 ** 400, 1e308])
@pytest.mark.parametrize("mode", ["hybrid", "sync", "pipeline", "async"])
def test_lr_schedule_bad_value_raises_before_anything_changes(rng, bad, mode):
    """A schedule value that is not a finite number >= 0 is a ValueError naming the step and the value, in every
    mode (async made it the cause of a WorkerError naming whichever worker pushed); the weights, Adam state, step
    and every counter are those of the last update, and the engine trains on with a good schedule."""
    batches = make_batches(rng, 3, 12)
    schedule = lambda step: bad if step == 1 else 1.0  # noqa: E731
    options = dict(stages=2, microbatches=2) if mode == "pipeline" else {}
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT), lr_schedule=schedule,
                **TINY_BUCKETS, **options) as engine:
        def step(b):
            return engine.fit([b])[0] if mode == "async" else engine.step(b)

        step(batches[0])
        before, stats = engine.state_dict(), engine.stats()
        # 10**400: an OverflowError; 1e308: finite, but times the lr past float32's range (the update counted, then
        # the kernel refused the lr)
        what = "beyond float32's range" if bad == 1e308 else "finite number >= 0"
        with pytest.raises(ValueError, match=rf"lr_schedule\(1\) returned .*{what}"):
            step(batches[1])
        assert_state_is(engine, before, stats, version=1)
        engine.lr_schedule = lambda step: 1.0
        assert step(batches[2])["applied"] and engine.version == 2


def test_lr_schedule_and_warmup_cosine_arguments_are_checked():
    with pytest.raises(TypeError, match="lr_schedule must be callable"):
        Engine(make_model(), loss_fn, devices=["cpu"], lr_schedule=0.5)
    for kwargs, message in [(dict(warmup_steps=-1), "warmup_steps must be an integer >= 0"),
                            (dict(warmup_steps=1.5), "warmup_steps must be an integer >= 0"),
                            (dict(warmup_steps=5, total_steps=4), "total_steps must be an integer >= 5"),
                            (dict(total_steps=0), "total_steps must be an integer >= 1"),
                            (dict(min_factor=1.5), r"min_factor must be a number in \[0, 1\]")]:
        with pytest.raises(ValueError, match=message):
            pyengine.WarmupCosine(**kwargs)
    assert [pyengine.WarmupCosine(warmup_steps=2)(s) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert pyengine.WarmupCosine(total_steps=4)(2) == pytest.approx(0.5)
    # a warmup over every step: min_factor from step == total_steps on, as the docstring says (was 1.0 there)
    assert [pyengine.WarmupCosine(warmup_steps=3, total_steps=3, min_factor=0.1)(s) for s in range(5)] == \
        pytest.approx([1 / 3, 2 / 3, 1.0, 0.1, 0.1])
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="step .* must be an integer >= 0"):
            pyengine.WarmupCosine(total_steps=3)(bad)
    # the engine never asks a schedule for a negative step (a shard server checks a push with no Adam step as 0)
    asked = []
    with Engine(make_model(), loss_fn, devices=["cpu"], lr_schedule=lambda k: asked.append(k) or 1.0) as engine:
        engine.lr_at(0)
        engine.lr_at(1)
        for bad in (2.5, True, float("nan"), -3, "1"):  # 2.5 asked the schedule for 1.5; the others for step 0
            with pytest.raises(ValueError, match=r"lr_at: step must be an int >= 0 \(the update's number"):
                engine.lr_at(bad)
    assert asked and min(asked) == 0 and all(isinstance(k, int) for k in asked), asked


def test_nonfinite_gradient_in_the_last_bucket_skips_the_whole_step(rng, worker_device):
    """Backward delivers the first layer's weight last: its infinite gradient arrives after the other buckets, and
    none of them may have been updated (no half-applied step)."""
    batches = make_batches(rng, 3, 12)
    poison = {"on": False}

    def poisoned_loss(model, batch):
        loss = loss_fn(model, batch)
        return loss + float("inf") * model[0].weight.sum() if poison["on"] else loss

    with Engine(make_model(), poisoned_loss, devices=[worker_device] * 2, optimizer=AdamW(**OPT), **TINY_BUCKETS) as engine:
        assert engine.workers[0].streamer.buckets[-1].names == ("0.weight",)
        engine.step(batches[0])
        before = engine.master_state_dict()
        poison["on"] = True
        assert not engine.step(batches[1])["applied"]
        after = engine.master_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        poison["on"] = False
        assert engine.step(batches[2])["applied"] and engine.version == 2


@pytest.mark.parametrize("dropout", [0.0, 0.5], ids=["deterministic-model", "dropout"])
def test_hybrid_is_bit_reproducible(rng, dropout):
    """With dropout the workers draw masks concurrently: each from its own generator (Note [Random numbers of
    concurrent workers]), so the order in which the threads run does not matter. Three runs: the seed is the
    only input (and with dropout a different seed gives other weights: the masks are drawn, and from the seed)."""
    batches = make_batches(rng, 6, 40)
    results = []
    for seed in (7, 7, 7, 8):
        with Engine(make_model(dropout=dropout), loss_fn, devices=["cpu"] * 3, optimizer=AdamW(**OPT),
                    seed=seed) as engine:
            for b in batches:
                engine.step(b)
            results.append(engine.master_state_dict())
    for other in results[1:3]:
        for name in results[0]:
            assert torch.equal(results[0][name], other[name]), name
    assert any(not torch.equal(results[0][name], results[3][name]) for name in results[0]) == bool(dropout)


class CheckpointedDropout(torch.nn.Module):
    """One Dropout called outside any activation checkpoint and inside two (``regions``: checkpoint's keywords, or
    None for no checkpoint)."""

    def __init__(self, regions):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d = (torch.nn.Linear(i, o) for i, o in ((10, 24), (24, 24), (24, 24), (24, 3)))
        self.drop, self.regions = torch.nn.Dropout(0.3), regions

    def forward(self, x):
        def region(fn, h):
            return fn(h) if self.regions is None else torch.utils.checkpoint.checkpoint(fn, h, **self.regions)
        h = self.drop(torch.tanh(self.a(x)))
        h = region(lambda t: self.drop(torch.tanh(self.b(t))), h)
        return self.d(region(lambda t: self.drop(torch.tanh(self.c(t))), h))


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpoints_change_nothing_with_concurrent_workers(rng, worker_device, reentrant):
    """Three workers, two micro-batches each, a Dropout called outside and inside two checkpointed regions: the
    weights equal, bit for bit, those of the same run without checkpoints (each recomputation replayed another
    call's masks before: Note [Random numbers of concurrent workers])."""
    batches = make_batches(rng, 4, 36)
    results = []
    for regions in (None, dict(use_reentrant=reentrant)):
        with Engine(CheckpointedDropout(regions), loss_fn, devices=[worker_device] * 3, optimizer=AdamW(**OPT),
                    seed=4, microbatches=2) as engine:
            for b in batches:
                engine.step((b[0].requires_grad_(reentrant), b[1]))
            results.append(engine.master_state_dict())
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


def test_an_engine_built_from_another_engines_replica_trains_its_own_replicas(rng):
    """The replicas are deep copies of the model; copies of a routed module ran the original's forward (Note [Random
    numbers of concurrent workers]), so an engine built from another's replica computed with that replica's
    weights: its own replicas' attention got no gradient and its master weights never moved."""
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True)
            self.out = torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.out(self.mha(x, x, x, need_weights=False)[0].mean(1))

    torch.manual_seed(0)
    batch = (torch.randn(8, 3, 8, generator=rng), torch.randint(0, 3, (8,), generator=rng))
    with Engine(Attention(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as first:
        first.step(batch)
        replica = first.workers[0].replica
    # no weight decay: a parameter moves only with its gradient
    with Engine(replica, loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**dict(OPT, weight_decay=0.0))) as second:
        before = second.master_state_dict()
        second.step(batch)
        for name, value in second.master_state_dict().items():
            assert not torch.equal(value, before[name]), f"{name} did not move"


@pytest.mark.parametrize("mode", ["hybrid", "sync", "async", "pipeline", "pipeline-balanced-by-time"])
def test_gradient_hooks_on_the_models_parameters_reach_the_replicas(rng, mode):
    """Note [Replicas keep the parameters' hooks]: the replicas are deep copies, and a deep-copied parameter has
    none of the original's hooks: a hook that zeroes a gradient (register_hook) or the accumulated .grad
    (register_post_accumulate_grad_hook) was dropped, and the layers it held still trained. The weights equal
    torch.optim.AdamW's with the same hooks (float64); the held parameters do not move. (balance="time" kept a deep
    copy of the model for its first step's timing, and its stages came from that copy: without the hooks.)"""
    options = dict(balance="time") if mode == "pipeline-balanced-by-time" else {}
    mode = mode.split("-")[0]
    def halve(p):
        p.grad.mul_(0.5)

    def hooked(model):
        model[0].weight.register_hook(torch.zeros_like)
        model[2].bias.register_post_accumulate_grad_hook(halve)
        return model

    opt = dict(OPT, weight_decay=0.0)
    model = hooked(make_model())
    reference = TorchReference(make_model(), **opt)
    hooked(reference.model)
    batches = make_batches(rng, 3, 12)
    with Engine(model, loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**opt), **options,
                **(dict(max_staleness=0) if mode == "async" else {})) as engine:
        for b in batches:
            if mode == "async":
                engine.fit([b])
            else:
                engine.step(b)
            reference.step([b])
        master = engine.master_state_dict()
    assert torch.equal(master["0.weight"], model[0].weight), "a zeroed gradient moved the weight"
    for name, p in reference.model.named_parameters():
        torch.testing.assert_close(master[name].double(), p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_random_modules_routes_a_users_random_layer(rng):
    """A layer drawing with torch.rand in its forward is on the shared generator unless listed in random_modules."""
    class Noise(torch.nn.Module):
        def forward(self, x):
            return x + 0.1 * torch.rand_like(x) if self.training else x

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(10, 24), Noise(), torch.nn.Tanh(), torch.nn.Linear(24, 3))

    batches = make_batches(rng, 6, 40)
    results = []
    for _ in range(3):
        with Engine(model(), loss_fn, devices=["cpu"] * 3, optimizer=AdamW(**OPT), seed=3,
                    random_modules=(Noise,)) as engine:
            for b in batches:
                engine.step(b)
            results.append(engine.master_state_dict())
    for other in results[1:]:
        for name in results[0]:
            assert torch.equal(results[0][name], other[name]), name
    for bad in (Noise, [int], ("Noise",)):
        with pytest.raises(TypeError, match="random_modules must"):
            Engine(model(), loss_fn, devices=["cpu"], random_modules=bad)


def test_sync_equals_sequential_training(rng, worker_device):
    model = make_model()
    reference = TorchReference(model, **OPT)
    with Engine(model, loss_fn, devices=[worker_device] * 3, mode="sync", optimizer=AdamW(**OPT)) as engine:
        for i, b in enumerate(make_batches(rng, 10, 16)):
            metrics = engine.step(b)
            assert metrics["worker"] == i % 3, "sync is round-robin"
            reference.step([b])
        assert_matches(engine, reference)


def test_async_with_one_worker_equals_sync_exactly(rng, worker_device):
    batches = make_batches(rng, 9, 16)
    with Engine(make_model(), loss_fn, devices=[worker_device], mode="sync", optimizer=AdamW(**OPT)) as sync:
        sync.fit(batches)
        expected = sync.master_state_dict()
    with Engine(make_model(), loss_fn, devices=[worker_device], mode="async", optimizer=AdamW(**OPT)) as engine:
        engine.fit(batches)
        got = engine.master_state_dict()
        assert engine.stats()["pushes"] == 9 and engine.stats()["staleness_max"] == 0
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_an_async_push_after_a_skipped_one_draws_new_masks(rng):
    """Note [Random numbers of concurrent workers]: a worker's draws are keyed by the pushes counted when it pulls,
    a skipped push too. Keyed by the version (which a skipped push leaves as it was), a worker that pulls again
    after its skipped push, before any other push lands, drew that push's dropout masks again."""
    engine = None
    masks, calls, second = [], {"worker 0": 0}, threading.Event()

    def loss(model, batch):
        mask = model[2](torch.ones(64)) != 0  # the replica's Dropout, on the worker's generator
        if model is engine.workers[1].replica:
            assert second.wait(30)  # worker 1 pushes after worker 0's second pull (it holds one of the 3 batches)
            return loss_fn(model, batch)
        masks.append(mask)
        calls["worker 0"] += 1
        if calls["worker 0"] == 2:
            second.set()
        value = loss_fn(model, batch)
        return value * float("nan") if calls["worker 0"] == 1 else value  # worker 0's first push is skipped

    engine = Engine(make_model(dropout=0.5), loss, devices=["cpu"] * 2, mode="async", optimizer=AdamW(**OPT),
                    nonfinite="skip")
    with engine:
        engine.fit(make_batches(rng, 3, 8))
        assert engine.stats()["skipped_steps"] == 1
    assert len(masks) >= 2 and not torch.equal(masks[0], masks[1])


def test_async_accumulate_sums_minibatch_gradients(rng, worker_device):
    model = make_model()
    reference = TorchReference(model, **OPT)
    batches = make_batches(rng, 8, 16)
    with Engine(model, loss_fn, devices=[worker_device], mode="async", optimizer=AdamW(**OPT), accumulate=2) as engine:
        engine.fit(batches)
        assert engine.stats()["pushes"] == 4
    for i in range(0, 8, 2):
        reference.step(batches[i:i + 2])
    assert_matches(engine, reference)


def test_async_batch_schedule_grows_the_minibatch(rng):
    batches = make_batches(rng, 7, 8)
    with Engine(make_model(), loss_fn, devices=["cpu"], mode="async", optimizer=AdamW(**OPT),
                batch_schedule=lambda version: 1 if version < 3 else 2) as engine:
        history = engine.fit(batches)
    assert [m["samples"] for m in history] == [8, 8, 8, 16, 16]


def test_async_stress_every_push_applied_exactly_once(rng, worker_device):
    batches = make_batches(rng, 50, 4)
    with Engine(make_model(hidden=8), loss_fn, devices=[worker_device] * 8, mode="async", optimizer=AdamW(**OPT)) as engine:
        engine.fit(batches, epochs=40)
        stats = engine.stats()
        history = engine.history
    assert stats["pushes"] == 2000 == len(history)
    assert stats["applied_updates"] == stats["pushes"] == stats["version"]
    assert sum(stats["staleness_histogram"].values()) == stats["pushes"]
    applied_versions = sorted(m["version_at_apply"] for m in history)
    assert applied_versions == list(range(2000)), "each push gets its own version: none lost, none doubled"
    for m in history:
        assert m["staleness"] == m["version_at_apply"] - m["version_at_pull"] >= 0
    assert {m["worker"] for m in history} == set(range(8))


def test_async_max_staleness_bounds_every_applied_push(rng):
    batches = make_batches(rng, 60, 4)
    with Engine(make_model(hidden=8), loss_fn, devices=["cpu"] * 4, mode="async", optimizer=AdamW(**OPT),
                max_staleness=1) as engine:
        engine.fit(batches)
        stats = engine.stats()
    assert stats["pushes"] == 60
    assert stats["staleness_max"] <= 1


@pytest.mark.parametrize("scheduled", [False, True])
def test_async_inverse_staleness_damps_lr(rng, monkeypatch, scheduled):
    """staleness_lr="inverse": each push's update runs the kernel with lr / (1 + its staleness), and with an
    lr_schedule with the scheduled lr of that update divided so (observed at the kernel's arguments); the push's
    metrics hold that lr (they held the scheduled one)."""
    batches = make_batches(rng, 40, 4)
    schedule = (lambda step: 1.0 / (step + 1)) if scheduled else None

    def overlapping_loss(model, batch):  # a sleep releases the GIL: the 4 workers' computations overlap
        time.sleep(0.005)
        return loss_fn(model, batch)

    engine = Engine(make_model(hidden=8), overlapping_loss, devices=["cpu"] * 4, mode="async",
                    optimizer=AdamW(**OPT), staleness_lr="inverse", lr_schedule=schedule)
    seen = []
    original = AdamW.kernel_kwargs

    def spy(self, lr=None):
        seen.append((engine.version, lr))
        return original(self, lr)

    monkeypatch.setattr(AdamW, "kernel_kwargs", spy)
    with engine:
        history = engine.fit(batches)
    assert len(seen) == len(history) == 40
    for (version, lr), m in zip(seen, history):  # version: the engine's step count with this update
        assert version - 1 - m["version_at_pull"] == m["staleness"] and m["applied"] and m["version"] == version
        scheduled_lr = OPT["lr"] * (schedule(version - 1) if scheduled else 1.0)
        assert lr == pytest.approx(scheduled_lr / (1 + m["staleness"]), rel=1e-12)
        assert m["lr"] == lr
    assert {m["staleness"] for m in history} != {0}, "no push was stale: the damping went untested"
    # the counters tell the pushes' staleness as their metrics do, and a state carries them on
    stats = engine.stats()
    counted = collections.Counter(m["staleness"] for m in history)
    assert stats["staleness_histogram"] == dict(counted) and stats["staleness_max"] == max(counted)
    assert stats["staleness_mean"] == pytest.approx(sum(m["staleness"] for m in history) / len(history), rel=1e-12)
    with Engine(make_model(hidden=8), loss_fn, devices=["cpu"] * 2, mode="async", optimizer=AdamW(**OPT),
                staleness_lr="inverse", lr_schedule=schedule) as other:
        other.load_state_dict(engine.state_dict())
        assert other.stats() == stats


def test_nonfinite_gradient_skip_and_raise(rng, worker_device):
    batches = make_batches(rng, 4, 8)
    poisoned = (batches[2][0].clone(), batches[2][1])
    poisoned[0][0, 0] = float("inf")
    batches[2] = poisoned
    with Engine(make_model(), loss_fn, devices=[worker_device] * 2, optimizer=AdamW(**OPT)) as engine:
        engine.step(batches[0])
        engine.step(batches[1])
        before = engine.master_state_dict()
        metrics = engine.step(batches[2])
        assert not metrics["applied"] and engine.stats()["skipped_steps"] == 1
        after = engine.master_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert all(torch.isfinite(v).all() for v in after.values())
    # "raise": the poisoned steps raise and change nothing; the steps after them train on their own gradients (the
    # raised step's buckets must not be taken for the next step's), as a reference that never saw the poisoned batch.
    reference = TorchReference(make_model(), **OPT)
    with Engine(make_model(), loss_fn, devices=[worker_device] * 2, optimizer=AdamW(**OPT), nonfinite="raise") as engine:
        for batch in (batches[2], batches[0], batches[2], batches[1], batches[2], batches[3]):
            if batch is batches[2]:
                before = engine.master_state_dict()
                with pytest.raises(FloatingPointError, match="non-finite gradient"):
                    engine.step(batch)
                after = engine.master_state_dict()
                assert all(torch.equal(before[k], after[k]) for k in before)
            else:
                assert engine.step(batch)["applied"]
                reference.step([batch])
        assert engine.version == 3
        assert_matches(engine, reference)
        stats = engine.stats()
        assert (stats["steps"], stats["applied_updates"], stats["skipped_steps"], stats["raised_steps"]) == (6, 3, 0, 3)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_counters_add_up_when_a_step_raises(rng, mode):
    """steps (sync) / pushes (async) = applied + skipped + raised, and the staleness histogram counts every push,
    also when nonfinite="raise" stops training."""
    batches = make_batches(rng, 4, 8)
    batches[2][0][0, 0] = float("nan")
    with Engine(make_model(), loss_fn, devices=["cpu"], mode=mode, optimizer=AdamW(**OPT),
                nonfinite="raise") as engine:
        with pytest.raises(FloatingPointError, match="non-finite gradient"):  # async: it was a WorkerError
            engine.fit(batches)
        stats = engine.stats()
        count = stats["steps"] if mode == "sync" else stats["pushes"]
        assert (count, stats["applied_updates"], stats["raised_steps"]) == (3, 2, 1)
        if mode == "async":
            assert sum(stats["staleness_histogram"].values()) == stats["pushes"]
    if mode == "async":  # workers on threads of their own too
        with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode, nonfinite="raise") as engine:
            with pytest.raises(FloatingPointError, match="non-finite gradient"):
                engine.fit(batches)
            assert engine.stats()["raised_steps"] == 1


@pytest.mark.parametrize("mode", ["hybrid", "sync", "async"])
def test_steps_from_no_batches_is_an_error(mode):
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT)) as engine:
        with pytest.raises(ValueError, match="batches is empty"):
            engine.fit([], steps=3)
        # epochs over no batch (a DataLoader with drop_last and fewer samples than a batch) train nothing, as said
        for source, epochs in (([], None), ([], 2), (iter([]), None)):
            with pytest.warns(RuntimeWarning, match=r"fit: batches \((list|list_iterator)\) gave no batch: "
                                                    "nothing was trained") as caught:
                assert engine.fit(source, epochs=epochs) == []
            assert caught[0].filename == __file__  # the caller's line
        assert engine.version == 0


@pytest.mark.parametrize("mode", ["hybrid", "sync", "async"])
def test_fit_takes_no_batch_past_its_steps(rng, mode):
    """fit(steps=n) took batch n + 1 from the iterable before it stopped (hybrid, sync): a generator lost it, a
    live source was waited on for it (a hang), and a pass that ended at step n began a new one (a one-pass source
    raised after the steps had trained, a DataLoader started another epoch)."""
    batches = make_batches(rng, 10, 8)
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT)) as engine:
        source = iter(batches)
        assert len(engine.fit(source, steps=3)) == 3
        assert len(list(source)) == 7  # the batches no step took are the source's still

        class OnePass:
            passes = 0

            def __iter__(self):
                OnePass.passes += 1
                if OnePass.passes > 1:
                    raise RuntimeError("this source can be iterated once")
                return iter(batches[:3])

        assert len(engine.fit(OnePass(), steps=3)) == 3 and OnePass.passes == 1
        assert len(engine.fit(batches[:4], steps=6)) == 6  # over two passes, as before
        assert engine.fit(iter(batches), steps=0) == []
        assert engine.stats()["applied_updates"] == 12


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_empty_batch_is_refused(mode):
    """A 0-sample batch has a NaN mean loss and a zero gradient: applied, it would count a step and decay the
    weights. Refused before any update, as hybrid's split refuses it."""
    empty = (torch.zeros(0, 10), torch.zeros(0, dtype=torch.long))
    with Engine(make_model(), loss_fn, devices=["cpu"], mode=mode, optimizer=AdamW(**OPT)) as engine:
        before = engine.master_state_dict()
        with pytest.raises((ValueError, WorkerError)) as info:
            engine.fit([empty])
        assert "a batch of 0 samples" in str(info.value) + str(info.value.__cause__)
        assert engine.version == 0 and all(torch.equal(before[k], v) for k, v in engine.master_state_dict().items())


@pytest.mark.parametrize("workers", [3, 1])  # 1: the lone CPU worker runs on the calling thread
def test_failing_worker_is_named_and_weights_keep_last_update(rng, workers, worker_device):
    batches = make_batches(rng, 3, 12)
    calls = {"n": 0}
    lock = threading.Lock()

    def flaky(model, batch):
        with lock:
            calls["n"] += 1
            n = calls["n"]
        if n == workers + min(2, workers):  # step 2 (calls workers+1 .. 2*workers), one of the workers
            raise RuntimeError("boom in loss")
        return loss_fn(model, batch)

    model = make_model()
    reference = TorchReference(model, **OPT)
    # Clipping: the host's per-bucket norm is taken while backward runs, so a stale bucket would change the step.
    with Engine(model, flaky, devices=[worker_device] * workers, optimizer=AdamW(**OPT, max_grad_norm=0.05),
                **TINY_BUCKETS) as engine:
        engine.step(batches[0])
        before = engine.master_state_dict()
        with pytest.raises(WorkerError, match=rf"worker \d \({worker_device}\) failed: RuntimeError: boom in loss") \
                as info:
            engine.step(batches[1])
        assert isinstance(info.value.__cause__, RuntimeError) and info.value.worker in range(workers)
        check_the_failed_step_left_nothing(engine, before, reference, batches)


def check_the_failed_step_left_nothing(engine, before, reference, batches):
    """After batches[1]'s step failed: the weights are those of batches[0]'s, and nothing of the failed step leaks
    into the next: training goes on as if batches[1] had never been seen (clipping at 0.05: the host's per-bucket
    norm is taken while backward runs, so a stale bucket would change the step)."""
    after = engine.master_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.step(batches[2])
    for b in (batches[0], batches[2]):
        reference.step([b], clip=0.05)
    assert_matches(engine, reference)


class _KeepsACenter(torch.nn.Module):
    """Centres its input on a running mean of the batches it saw, kept as a frozen parameter written in place
    (``kind="frozen"``: a VQ-VAE's EMA codebook, say) or as a buffer registered as None that the first forward sets
    (``kind="none-buffer"``): state the engine does not follow (Note [Model state the engine does not follow]);
    ``kind="followed"``: a buffer registered with a tensor. Each has a cache too (non-persistent, set when None)."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.l = kind, torch.nn.Linear(10, 10)
        if kind == "frozen":
            self.center = torch.nn.Parameter(torch.zeros(10), requires_grad=False)
        else:  # "followed": a buffer from the start, which the engine follows
            self.register_buffer("center", None if kind == "none-buffer" else torch.zeros(10))
        self.register_buffer("cache", None, persistent=False)  # a cache the first forward makes: each replica's own

    def forward(self, x):
        if self.cache is None:
            self.cache = torch.ones(10)
        with torch.no_grad():
            if self.kind == "frozen":
                self.center.mul_(0.9).add_(x.mean(0), alpha=0.1)
            else:
                self.center = x.mean(0) if self.center is None else 0.9 * self.center + 0.1 * x.mean(0)
        return self.l(x - self.center)


def _centering_model(kind):
    torch.manual_seed(0)
    return torch.nn.Sequential(_KeepsACenter(kind), torch.nn.Linear(10, 3))  # two layers: two pipeline stages


@pytest.mark.parametrize("kind", ["frozen", "none-buffer"])
@pytest.mark.parametrize("mode,workers", [("hybrid", 2), ("hybrid", 1), ("sync", 2), ("async", 2), ("pipeline", 2)])
def test_state_the_engine_does_not_follow_fails_the_step(rng, kind, mode, workers):
    """A frozen parameter written in place by the forward stayed on the replica that wrote it (sync with 2 workers:
    each its own running mean, so the weights trained 6 % away from sequential training) and out of checkpoints (a
    digest of its construction value); a buffer registered as None and set by the forward was nobody's to share,
    save or copy out (11 % away). Either now fails the step, naming it and the remedy; nothing of the step counts.
    A non-persistent buffer set by the forward (a cache) is no error: each replica makes its own, as before."""
    batches = make_batches(rng, 2, 8)
    options = dict(devices=["cpu"] * workers, mode=mode, optimizer=AdamW(**OPT))
    options.update(stages=2) if mode == "pipeline" else None
    with Engine(_centering_model(kind), loss_fn, **options) as engine:
        before, stats = engine.state_dict(), engine.stats()
        with pytest.raises((WorkerError, ValueError)) as info:
            engine.fit(batches) if mode == "async" else engine.step(batches[0])
        error = info.value.__cause__ if isinstance(info.value, WorkerError) else info.value
        assert isinstance(error, ValueError), info.value
        where = "stage 0 (replica 0): " if mode == "pipeline" else "worker 0's replica: " if workers == 1 else ""
        assert str(error).startswith(where or "worker "), str(error)
        if kind == "frozen":
            assert "the step wrote the frozen parameter(s) '0.center' in place" in str(error)
            assert "register that state as a buffer (module.register_buffer)" in str(error)
        else:
            assert "the step set the buffer(s) '0.center', registered as None when the engine was built" in str(error)
            assert "register it with its initial tensor before building the engine" in str(error)
            # put back to None on the replica that set it, as the engine was built: the next step refuses it again
            # only if its forward sets it again (it stayed set, and every later step was refused)
            modules = [stage.module for row in engine.pipeline.stages for stage in row] if mode == "pipeline" else \
                [worker.replica for worker in engine.workers]
            assert all(center.center is None for m in modules for center in m.modules()
                       if isinstance(center, _KeepsACenter)), modules
        assert_state_is(engine, before, stats, 0)
    with Engine(_centering_model("followed"), loss_fn, **options) as engine:
        engine.fit(batches)
        assert engine.version == 2


def test_a_gradient_copy_that_fails_fails_its_worker_and_leaves_nothing_behind():
    """A gradient whose storage a hook frees while its bucket's copy waits behind a large one (CPU): the copy fails,
    and every wait for the bucket raises (Note [A failed copy's error]). The host's wait for the bucket's norm used
    to raise the bare copy error when it waited first, and the worker's WorkerError otherwise; now the step fails
    with the WorkerError naming worker 1, nothing of it is applied, and the next step trains as a first one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1 << 22))  # 16M weights, copied first
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    square = lambda replica, batch: replica(batch).square().mean()  # noqa: E731
    twin = copy.deepcopy(model)
    with Engine(model, square, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as engine:
        free = [True]

        def free_grad(p):  # after the streamer's hook launched the bucket's copy, while the large copy still runs
            if free[0]:
                free[0] = False
                p.grad.untyped_storage().resize_(0)
                time.sleep(0.5)  # the copy fails meanwhile, and the host waits for the bucket first

        engine.workers[1].replica[0].weight.register_post_accumulate_grad_hook(free_grad)
        before, stats = engine.state_dict(), engine.stats()
        with pytest.raises(WorkerError, match=r"worker 1 \(cpu\) failed: RuntimeError: BucketTransfer: the copy of "
                           r"grads bucket \d+ of w1 failed: copy_on_host: the source's storage holds 0 bytes but the "
                           r"copy needs 48: .*its bucket's wait returns\)$") as info:
            engine.step(x)
        assert not free[0] and "Exception raised from" not in str(info.value)  # no C++ backtrace in the message
        assert_state_is(engine, before, stats, 0)
        engine.step(y)
        with Engine(twin, square, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as reference:
            reference.step(y)
            expected = reference.master_state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in engine.master_state_dict().items())


def test_a_replica_whose_weights_copy_failed_fails_its_steps_until_a_state_is_loaded():
    """A copy back into a replica whose parameter's storage was freed meanwhile fails; every wait for it raises
    (Note [A failed copy's error]), so the replica's next steps fail instead of training on its torn weights. Once
    the storage is back, loading a state recovers (its wait for the last copies back took the failed one as
    complete, where it raised the error and refused the load for good), and training goes on from the state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1 << 22))  # 16M weights, copied first
    batches = [torch.randn(8, 4) for _ in range(3)]
    square = lambda replica, batch: replica(batch).square().mean()  # noqa: E731
    twin = copy.deepcopy(model)
    with Engine(model, square, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as engine:
        engine.step(batches[0])
        state = engine.state_dict()
        weight = engine.workers[1].replica[0].weight  # its copy back waits behind the large bucket's
        engine.step(batches[1])
        nbytes = weight.untyped_storage().nbytes()
        weight.untyped_storage().resize_(0)
        for _ in range(2):
            with pytest.raises(WorkerError, match=r"worker 1 \(cpu\) failed: RuntimeError: BucketTransfer: the copy "
                               r"of weights bucket \d+ of w1 failed: copy_on_host: the destination's storage holds 0 "
                               r"bytes"):
                engine.step(batches[2])
        weight.untyped_storage().resize_(nbytes)
        engine.load_state_dict(state)
        engine.step(batches[2])
        with Engine(twin, square, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as reference:
            for b in (batches[0], batches[2]):
                reference.step(b)
            expected = reference.master_state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in engine.master_state_dict().items())


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: the last thing a worker's backward does (it runs after every parameter's)."""

    @staticmethod
    def forward(ctx, x, done):
        ctx.done = done
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.5)
        ctx.done.append(1)
        return grad, None


@pytest.mark.parametrize("workers", [1, 2])
def test_a_host_error_while_workers_compute_waits_for_them_and_leaves_nothing_behind(rng, monkeypatch, workers):
    """The host's per-bucket work raises while the workers' backward passes still run: the error reaches the caller
    as itself only once every worker's task has ended (none outlives its step to write the next one's slots), and
    the next step equals the reference, as if the failed one had never been tried."""
    from pyengine import ops
    batches = make_batches(rng, 3, 12)
    done, calls, norm = [], [], ops.mean_grad_norm

    def failing_norm(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # step 2, its first bucket: the workers are still in backward
            raise RuntimeError("boom in the host's norm")
        return norm(*args, **kwargs)

    def slow(model, batch):
        x, y = batch
        return loss_fn(model, (_SlowBackward.apply(x.clone().requires_grad_(), done), y))

    monkeypatch.setattr(ops, "mean_grad_norm", failing_norm)
    model = make_model()
    reference = TorchReference(model, **OPT)
    with Engine(model, slow, devices=["cpu"] * workers, optimizer=AdamW(**OPT, max_grad_norm=0.05), pin=False,
                **TINY_BUCKETS) as engine:
        engine.step(batches[0])
        before, done[:] = engine.master_state_dict(), []
        with pytest.raises(RuntimeError, match="boom in the host's norm"):
            engine.step(batches[1])
        assert len(done) == workers  # every worker's backward had ended when step() raised
        check_the_failed_step_left_nothing(engine, before, reference, batches)


def test_interrupt_of_a_lone_cpu_worker_leaves_nothing_behind(rng):
    """A KeyboardInterrupt during the backward of the lone CPU worker (run on the calling thread) reaches the caller
    as itself; the weights are those of the last update and the next step equals the reference."""
    batches = make_batches(rng, 3, 12)
    calls = {"n": 0}

    def interrupt_in_step_2(grad):
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return grad

    def interrupted(model, batch):
        calls["n"] += 1
        if calls["n"] == 1:  # a hook on the first parameter: it fires during backward
            next(iter(model.parameters())).register_hook(interrupt_in_step_2)
        return loss_fn(model, batch)

    model = make_model()
    reference = TorchReference(model, **OPT)
    with Engine(model, interrupted, devices=["cpu"], optimizer=AdamW(**OPT), **TINY_BUCKETS) as engine:
        engine.step(batches[0])
        before = engine.master_state_dict()
        with pytest.raises(KeyboardInterrupt):
            engine.step(batches[1])
        after = engine.master_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        engine.step(batches[2])
        for b in (batches[0], batches[2]):
            reference.step([b])
        assert_matches(engine, reference)


def test_close_from_another_thread_during_async_fit_says_so(rng):
    batches = make_batches(rng, 4, 8)
    engine = Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode="async", optimizer=AdamW(**OPT))
    closer = []

    def close_once(engine_, metrics):
        if not closer:  # after the first push, from another thread
            closer.append(threading.Thread(target=engine_.close))
            closer[0].start()

    with pytest.raises(RuntimeError, match=r"closed while fit\(\) was running"):
        engine.fit(batches, steps=10 ** 6, callbacks=[close_once])
    closer[0].join()
    assert engine.stats()["pushes"] >= 1


def test_close_from_another_thread_during_async_fit_returns_after_the_last_push(rng):
    """close() takes the store's mutex: the push being applied completes, none lands after close() returns, and it
    returns once the workers have stopped (they used to go on, and a push computed before could still be applied)."""
    batches = make_batches(rng, 4, 8)
    engine = Engine(make_model(), slow_loss, devices=["cpu"] * 3, mode="async", optimizer=AdamW(**OPT))
    seen = {}

    def close_and_look():
        engine.close()
        seen["version"] = engine.version
        seen["alive"] = [t.name for t in threading.enumerate() if t.name.startswith("pyengine-async")]

    def close_after_three(engine_, metrics):
        if engine_.stats()["pushes"] == 3:
            seen["closer"] = threading.Thread(target=close_and_look)
            seen["closer"].start()

    with pytest.raises(RuntimeError, match=r"closed while fit\(\) was running"):
        engine.fit(batches, steps=10 ** 6, callbacks=[close_after_three])
    seen["closer"].join()
    assert seen["alive"] == [] and engine.version == seen["version"] >= 3
    assert engine.stats()["pushes"] == engine.stats()["applied_updates"] == engine.version


def test_two_threads_closing_during_async_fit_both_return_after_the_workers_stopped(rng):
    """A second close() while the first waits for the async workers returned at once (closed already), with the
    workers still running: every close() returns once the first has stopped everything."""
    batches = make_batches(rng, 4, 8)
    engine = Engine(make_model(), slow_loss, devices=["cpu"] * 3, mode="async", optimizer=AdamW(**OPT))
    alive, closers = {}, []

    def close_and_look(name):
        engine.close()
        alive[name] = [t.name for t in threading.enumerate() if t.name.startswith("pyengine-async")]

    def close_twice(engine_, metrics):
        if engine_.stats()["pushes"] == 2:
            for name in ("first", "second"):
                closers.append(threading.Thread(target=close_and_look, args=(name,)))
                closers[-1].start()
                time.sleep(0.005)  # the second comes while the first waits for the workers

    with pytest.raises(RuntimeError, match=r"closed while fit\(\) was running"):
        engine.fit(batches, steps=10 ** 6, callbacks=[close_twice])
    for closer in closers:
        closer.join()
    assert alive == {"first": [], "second": []}, alive


def test_one_fit_at_a_time(rng):
    """A second fit() while one runs (another thread, or a callback of the running one) is a clear error; it used to
    run two schedules over one store at once."""
    batches = make_batches(rng, 4, 8)
    with Engine(make_model(), slow_loss, devices=["cpu"] * 2, mode="async", optimizer=AdamW(**OPT)) as engine:
        second = []

        def start_another(engine_, metrics):
            if not second:
                try:
                    engine_.fit(batches, steps=1)
                except RuntimeError as exc:
                    second.append(exc)

        engine.fit(batches, steps=6, callbacks=[start_another])
        assert len(second) == 1 and "fit() is already running on this Engine" in str(second[0])
        assert engine.stats()["pushes"] == 6
        engine.fit(batches, steps=2)  # one after the other: fine
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as engine:
        with pytest.raises(RuntimeError, match=r"fit\(\) is already running"):
            engine.fit(batches, callbacks=[lambda engine_, metrics: engine_.fit(batches)])
        assert engine.stats()["steps"] == 1


def slow_loss(model, batch):
    time.sleep(0.003)  # the workers' computations overlap, whatever the machine's load
    return loss_fn(model, batch)


def test_state_dict_from_another_thread_during_async_fit_is_consistent_and_loads(rng):
    """Note [Reading the state while async workers run]: a state taken while pushes land lies between two of them
    (a monitor thread used to see the optimizer's step, the version and the counters disagree, and load_state_dict
    refused some of those states)."""
    batches = make_batches(rng, 6, 8)
    states, done = [], threading.Event()

    def loss_after_a_look(model, batch):  # the first computations wait for a new state: 5 at least, on any load
        seen, deadline = len(states), time.monotonic() + 10
        while len(states) <= seen and len(states) < 5 and time.monotonic() < deadline:
            time.sleep(0.001)
        return slow_loss(model, batch)

    with Engine(make_bn_model(), loss_after_a_look, devices=["cpu"] * 3, mode="async",
                optimizer=AdamW(**OPT)) as engine:
        def monitor():  # a look every millisecond (unpaused, its thousands of looks starved the workers)
            while not done.is_set():
                states.append(engine.state_dict())
                time.sleep(0.001)

        thread = threading.Thread(target=monitor)
        thread.start()
        try:
            engine.fit(batches, steps=40)
        finally:
            done.set()
            thread.join()
    assert len(states) >= 5
    for state in states:
        version = state["version"]
        assert state["counters"].get("applied_updates", 0) == state["counters"].get("pushes", 0) == version
        steps = {int(entry["step"]) for entry in state["optimizer"]["state"].values()}
        assert steps == ({version} if version else {0}) or not state["optimizer"]["state"]
    with Engine(make_bn_model(), loss_fn, devices=["cpu"] * 3, mode="async", optimizer=AdamW(**OPT)) as fresh:
        for state in states[:: max(1, len(states) // 8)]:
            fresh.load_state_dict(state)
            assert fresh.version == state["version"]


def test_async_refreshed_and_discarded_computations_leave_the_buffers_alone(rng):
    """A refresh (max_staleness) computes the same mini-batches again and a stop discards the computations in flight:
    BatchNorm in the buffers' source replica (worker 0) counts exactly the batches of its applied pushes (it counted
    a refreshed batch twice, and a discarded one)."""
    batches = make_batches(rng, 8, 8)
    with Engine(make_bn_model(), slow_loss, devices=["cpu"] * 2, mode="async", optimizer=AdamW(**OPT),
                max_staleness=0) as engine:
        history = engine.fit(batches, steps=30)
        assert engine.stats()["refreshes"] > 0
        counted = engine.buffers_state_dict()["1.num_batches_tracked"]
        assert counted == sum(1 for m in history if m["worker"] == 0)


def test_async_batch_schedule_follows_the_version_pulled(rng):
    """The mini-batches of a push are batch_schedule(version its worker pulled), asked under the mutex (it was asked
    about the version before the pull, which other pushes may have moved on)."""
    batches = make_batches(rng, 8, 4)
    schedule = lambda version: 1 if version % 2 == 0 else 2  # noqa: E731
    with Engine(make_model(), slow_loss, devices=["cpu"] * 3, mode="async", optimizer=AdamW(**OPT),
                batch_schedule=schedule) as engine:
        # a callback runs under the mutex: its sleep holds the other workers' pulls while the version moves on
        history = engine.fit(batches, steps=40, callbacks=[lambda engine_, metrics: time.sleep(0.003)])
    assert len(history) == 40
    assert [m["samples"] for m in history] == [4 * schedule(m["version_at_pull"]) for m in history]


@pytest.mark.parametrize("workers", [1, 2])
def test_async_callback_error_is_raised_as_itself_and_the_push_keeps_its_statistics(rng, workers):
    """A callback that raises after a push was applied ends fit with its own error (as in sync and hybrid; it was a
    WorkerError naming worker 0), and the buffers keep that push's batch: BatchNorm counts every applied push of the
    source replica (the failure path put them back to before that push)."""
    batches = make_batches(rng, 16, 8)
    refused = []

    def refuse(engine_, metrics):  # a push of worker 0 (the source replica), the third push or a later one: with two
        if metrics["worker"] == 0 and engine_.stats()["pushes"] >= 3:  # workers on a loaded machine worker 1 may
            refused.append(engine_.stats()["pushes"])  # make the first three
            raise RuntimeError("the callback says stop")

    with Engine(make_bn_model(), loss_fn, devices=["cpu"] * workers, mode="async", optimizer=AdamW(**OPT)) as engine:
        with pytest.raises(RuntimeError, match="the callback says stop") as info:
            engine.fit(batches, steps=40, callbacks=[refuse])
        assert not isinstance(info.value, WorkerError)
        assert engine.stats()["pushes"] == engine.version == refused[0] >= 3
        counted = engine.buffers_state_dict()["1.num_batches_tracked"]
        assert counted == sum(1 for m in engine.history if m["worker"] == 0) >= 1


def test_async_push_raised_for_a_nonfinite_gradient_keeps_its_statistics(rng):
    """Note [A failed step leaves the buffers alone]: a step that raises for a non-finite gradient keeps its batch's
    statistics; an async push did not (its buffers were put back)."""
    batches = make_batches(rng, 4, 8)
    batches[2][0][0, 0] = float("nan")
    counted = {}
    for mode in ("sync", "async"):
        with Engine(make_bn_model(), loss_fn, devices=["cpu"], mode=mode, optimizer=AdamW(**OPT),
                    nonfinite="raise") as engine:
            with pytest.raises(FloatingPointError, match="non-finite gradient"):
                engine.fit(batches)
            assert engine.version == 2 and engine.stats()["raised_steps"] == 1
            counted[mode] = int(engine.buffers_state_dict()["1.num_batches_tracked"])
    assert counted == {"sync": 3, "async": 3}


def test_load_state_dict_during_an_async_fit_is_refused(rng):
    """Loading while async workers compute made their pushes (pulled at a later version) count a negative staleness,
    and with staleness_lr="inverse" a push was counted as applied but wrote nothing. Refused, the engine as it was;
    a callback of a hybrid fit still loads (its workers are between steps)."""
    batches = make_batches(rng, 6, 8)
    with Engine(make_model(), slow_loss, devices=["cpu"] * 2, mode="async", optimizer=AdamW(**OPT),
                staleness_lr="inverse") as engine:
        first = engine.state_dict()
        refused = []

        def load_at_3(engine_, metrics):
            if engine_.version == 3 and not refused:
                before = engine_.master_state_dict()
                with pytest.raises(RuntimeError, match="load_state_dict during an async fit") as info:
                    engine_.load_state_dict(first)
                refused.append(info.value)
                assert engine_.version == 3
                assert all(torch.equal(v, before[k]) for k, v in engine_.master_state_dict().items())

        engine.fit(batches, steps=8, callbacks=[load_at_3])
        assert refused and min(engine.stats()["staleness_histogram"]) >= 0
        assert engine.version == engine.stats()["applied_updates"] == 8
        engine.load_state_dict(first)  # after fit: loads
        assert engine.version == 0
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as engine:
        first = engine.state_dict()
        engine.fit(batches, steps=3, callbacks=[lambda engine_, metrics: engine_.load_state_dict(first)])
        assert engine.version == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_engine_stop_from_another_thread_applies_no_push_after_it(rng, workers):
    """Engine.stop() from another thread (a watchdog): the computations in flight are discarded (the next one was
    still applied: the flag was looked at only after a push)."""
    batches = make_batches(rng, 40, 8)

    def slower_loss(model, batch):
        time.sleep(0.05)
        return loss_fn(model, batch)

    with Engine(make_model(), slower_loss, devices=["cpu"] * workers, mode="async", optimizer=AdamW(**OPT)) as engine:
        at_stop = {}

        def watchdog():
            while engine.version < 2:
                time.sleep(0.002)
            time.sleep(0.02)  # the workers compute
            with engine.mutex:  # no push is being applied now
                at_stop["version"] = engine.version
                engine.stop()

        thread = threading.Thread(target=watchdog)
        thread.start()
        engine.fit(batches)
        thread.join()
        assert engine.version == at_stop["version"] == engine.stats()["pushes"]


@pytest.mark.parametrize("workers", [1, 2])
def test_async_worker_that_pulls_after_a_stop_takes_no_batch(rng, workers):
    """A worker that pulls once the run is stopped (it waited for the mutex while another's push ended the run; here
    the stop comes from inside the pull, from the batch schedule) ends without taking a mini-batch: none is drawn
    from the iterable after the stop, so a later fit on the same iterator gets it, and none is computed for
    nothing."""
    drawn = []

    def batches():
        for b in make_batches(rng, 12, 8):
            drawn.append(engine.stop_requested)
            yield b

    stop_at = {"version": 2}

    def schedule(version):
        if version >= stop_at["version"]:
            stop_at["version"] = float("inf")  # once
            engine.stop()
        return 1

    with Engine(make_model(), loss_fn, devices=["cpu"] * workers, mode="async", optimizer=AdamW(**OPT),
                batch_schedule=schedule, pin=False) as engine:
        it = batches()
        engine.fit(it, steps=10)
        assert engine.version == 2 and drawn.count(True) == 0, drawn
        taken = len(drawn)
        assert taken <= 1 + workers  # two pushes, and one mini-batch in flight on each other worker
        engine.fit(it, steps=1)  # the next fit starts where this one stopped
        assert engine.version == 3 and taken + 1 <= len(drawn) <= taken + workers


def test_a_close_cut_short_by_ctrl_c_is_done_by_the_next(rng, monkeypatch):
    """A Ctrl-C while close() waits (here: in the pool's shutdown) left the engine marked closed and done: a later
    close() returned at once, with the pool running and the streamers' hooks on the replicas."""
    engine = Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT))
    engine.step(make_batches(rng, 1, 8)[0])
    shutdown, calls = engine._pool.shutdown, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return shutdown(*args, **kwargs)

    monkeypatch.setattr(engine._pool, "shutdown", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.close()
    params = [p for w in engine.workers for p in w.replica.parameters()]
    assert any(p._post_accumulate_grad_hooks for p in params)
    engine.close()
    assert len(calls) == 2 and engine._pool._shutdown
    assert not any(p._post_accumulate_grad_hooks for p in params), "a hook was left on a replica"
    engine.close()  # and then idempotent
    assert len(calls) == 2


def test_close_from_a_new_thread_waits_for_workers_whose_thread_ids_came_free(rng):
    """close() tells a callback of the fit (which must not wait for the workers) by its thread's id: a worker thread
    that had ended left its id behind, a new thread often gets the same one, and close() from it returned while the
    other workers still ran."""
    batches = make_batches(rng, 4, 8)
    release, inside = threading.Event(), threading.Event()

    def worker_0_slow(model, batch):
        if threading.current_thread().name == "pyengine-async-0":
            inside.set()
            release.wait(30)  # meanwhile worker 1 takes the other batches and its thread ends
        else:
            inside.wait(30)  # worker 0 holds a batch first (else worker 1 could take all 4 and fit end)
        return loss_fn(model, batch)

    engine = Engine(make_model(), worker_0_slow, devices=["cpu"] * 2, mode="async", optimizer=AdamW(**OPT))
    outcome = {}

    def fit():
        try:
            engine.fit(batches)
        except RuntimeError as exc:
            outcome["fit"] = exc

    fitter = threading.Thread(target=fit)
    fitter.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        names = [t.name for t in threading.enumerate()]
        if "pyengine-async-0" in names and "pyengine-async-1" not in names and engine.stats()["pushes"] >= 3:
            break
        time.sleep(0.001)
    else:
        release.set()
        pytest.fail(f"worker 1 did not take the other batches and end while worker 0 waited: {names}")

    def close():
        release.set()
        engine.close()
        outcome["alive"] = [t.name for t in threading.enumerate() if t.name.startswith("pyengine-async")]

    closers = [threading.Thread(target=close)]
    closers[0].start()
    closers[0].join()
    fitter.join()
    assert outcome["alive"] == [] and "closed while fit() was running" in str(outcome["fit"])


def test_a_non_exception_from_an_async_worker_thread_names_the_worker(rng):
    """SystemExit raised on a worker's thread is that worker's failure (a WorkerError, as in hybrid); only the calling
    thread's own interrupt is re-raised as itself."""
    def loss(model, batch):
        if threading.current_thread().name == "pyengine-async-1":
            raise SystemExit(3)
        time.sleep(0.002)
        return loss_fn(model, batch)

    with Engine(make_model(), loss, devices=["cpu"] * 2, mode="async", optimizer=AdamW(**OPT)) as engine:
        with pytest.raises(WorkerError, match=r"worker 1 \(cpu\) failed: SystemExit: 3"):
            engine.fit(make_batches(rng, 4, 8))


def test_failing_async_worker_stops_everyone(rng, worker_device):
    batches = make_batches(rng, 400, 4)
    calls = threading.local()

    def fail_on_fifth_call_of_worker_2(model, batch):
        calls.n = getattr(calls, "n", 0) + 1
        if threading.current_thread().name == "pyengine-async-2" and calls.n == 5:
            raise ValueError("bad sample")
        time.sleep(0.002)
        return loss_fn(model, batch)

    start = time.monotonic()
    with Engine(make_model(), fail_on_fifth_call_of_worker_2, devices=[worker_device] * 4, mode="async") as engine:
        with pytest.raises(WorkerError, match=rf"worker 2 \({worker_device}\) failed: ValueError: bad sample") as info:
            engine.fit(batches, epochs=50)
        assert engine.stats()["pushes"] < 400, "the others must stop soon after the failure"
    # it crosses processes whole (a process pool's result): the default pickling rebuilt it from its message alone,
    # which its __init__ refused
    carried = pickle.loads(pickle.dumps(info.value))
    assert type(carried) is WorkerError and str(carried) == str(info.value) and carried.worker == 2
    assert time.monotonic() - start < 60
    assert not [t for t in threading.enumerate() if t.name.startswith("pyengine-async")], "orphan worker thread"


def test_failing_lone_async_worker_on_the_calling_thread(rng):
    """One CPU worker in async runs on the calling thread: its error is a WorkerError, its interrupt arrives as
    itself, and the pushes applied before either are kept (the same weights as sequential AdamW on them)."""
    batches = make_batches(rng, 12, 4)
    calls = {"n": 0, "threads": set()}

    def fail_on_call(n, exc):
        def loss(model, batch):
            calls["n"] += 1
            calls["threads"].add(threading.get_ident())
            if calls["n"] == n:
                raise exc
            return loss_fn(model, batch)
        return loss

    for exc, expected in ((ValueError("bad sample"), WorkerError), (KeyboardInterrupt(), KeyboardInterrupt)):
        calls["n"] = 0
        model = make_model()
        reference = TorchReference(model, **OPT)
        with Engine(model, fail_on_call(4, exc), devices=["cpu"], mode="async", optimizer=AdamW(**OPT)) as engine:
            with pytest.raises(expected):
                engine.fit(batches, epochs=1)
            assert engine.stats()["pushes"] == 3 and calls["threads"] == {threading.get_ident()}
            for b in batches[:3]:
                reference.step([b])
            assert_matches(engine, reference)

@pytest.mark.parametrize("kwargs,message", [
    (dict(devices=["cuda:7"]), r"(asks for CUDA|does not exist)"),
    (dict(devices=["tpu"]), r"is not a device|neither 'cpu' nor"),
    (dict(devices=[]), r"non-empty list"),
    (dict(mode="gossip"), r"mode must be one of"),
    (dict(accumulate=2), r"accumulate is an async option"),
    (dict(nonfinite="ignore"), r"nonfinite must be"),
    (dict(max_staleness=-1, mode="async"), r"max_staleness must be"),
    (dict(max_staleness=True, mode="async"), r"max_staleness must be an integer >= 0 or None; got True"),
    (dict(accumulate=True, mode="async"), r"accumulate must be an integer >= 1; got True"),
    (dict(staleness_lr="sqrt", mode="async"), r"staleness_lr must be"),
    (dict(max_staleness=2), r"max_staleness: async option"),
    (dict(staleness_lr="inverse", mode="sync"), r"staleness_lr: async option"),
    (dict(mode="async", accumulate=4, batch_schedule=lambda version: 1),  # the schedule won without a word
     r"accumulate=4 and batch_schedule both set the mini-batches of a push"),
    (dict(batch_schedule=lambda v: 1, mode="pipeline", stages=2), r"batch_schedule: async option"),
    (dict(bucket_mb="25"), r"Engine: bucket_mb must be a number > 0 \(MiB\); got '25'"),
    (dict(bucket_mb=None), r"Engine: bucket_mb must be a number > 0"),
    (dict(bucket_mb=float("nan")), r"Engine: bucket_mb must be a number > 0"),
    (dict(first_bucket_mb=None), r"Engine: first_bucket_mb must be a number > 0"),
    (dict(first_bucket_mb=0), r"Engine: first_bucket_mb must be a number > 0"),
    (dict(eager_mb="1"), r"Engine: eager_mb must be a number >= 0 or None"),
    (dict(unused="ignore"), r"Engine: unused must be 'zero' or 'error'"),
    (dict(pin="yes"), r"Engine: pin must be True, False or 'auto'"),
    (dict(servers=0), r"servers must be an integer >= 1"),
    (dict(servers=True), r"servers must be an integer >= 1"),
    (dict(servers=2, mode="async"), r"servers=2 shards the store across async server ranks: it needs mode='async' "
                                    r"and a process group"),
])
def test_bad_engine_options(kwargs, message):
    """Each raises a ValueError naming the option before the engine seeds torch's generator (or allocates its
    store): a bucket_mb of another type raised a bare TypeError from the streamer, after both."""
    model = make_model()  # seeds torch's generator itself
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match=message):
        Engine(model, loss_fn, seed=7, **kwargs)
    assert torch.equal(torch.get_rng_state(), before)


def test_numpy_bucket_sizes_are_taken(rng):
    """np.int64 and np.float32 bucket sizes were refused as "bucket_mb must be a number > 0"; they are taken, and
    make the buckets their Python values make."""
    import numpy as np
    batch = make_batches(rng, 1, 8)[0]
    sizes = dict(bucket_mb=1e-6, first_bucket_mb=1e-6, eager_mb=0.0)
    numpy_sizes = dict(bucket_mb=np.float32(1e-6), first_bucket_mb=np.float64(1e-6), eager_mb=np.int64(0))
    buckets = []
    for options in (sizes, numpy_sizes):
        with Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT), pin=False,
                    **options) as engine:
            engine.step(batch)
            buckets.append(engine.workers[0].streamer.buckets)
    assert buckets[0] == buckets[1] and len(buckets[0]) > 1



def _shared_batchnorm_stages():
    norm = torch.nn.BatchNorm1d(4)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), norm, torch.nn.Linear(4, 4), norm)


@pytest.mark.parametrize("make,options", [
    (lambda: make_model().double(), dict(devices=["cpu"] * 2)),  # float64: refused by a worker
    (_shared_batchnorm_stages, dict(devices=["cpu"] * 2, mode="pipeline", stages=2)),  # refused by the stages
], ids=["float64-replica", "batchnorm-shared-by-stages"])
def test_an_engine_refused_after_its_seeding_puts_the_generator_back(make, options):
    """Checks that need the replicas or the stages built run after the engine seeded torch's generator: a refused
    engine left it reseeded (the next torch.rand was seed 7's)."""
    model = make()  # may seed torch's generator itself
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    with pytest.raises(ValueError):
        Engine(model, loss_fn, seed=7, **options)
    assert torch.equal(torch.get_rng_state(), before)


def test_bad_batch_schedule_and_fit_arguments(rng):
    with pytest.raises(TypeError, match="batch_schedule must be callable"):
        Engine(make_model(), loss_fn, mode="async", batch_schedule=2)
    for bad in (0, -3, 2.7, "2", True):
        with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode="async", batch_schedule=lambda v: bad) as engine:
            before = engine.master_state_dict()
            with pytest.raises(ValueError, match=r"^batch_schedule\(0\) must return .* an int >= 1"):  # as itself
                engine.fit(make_batches(rng, 4, 8), steps=4)
            assert engine.version == 0 and engine.stats()["pushes"] == 0
            assert all(torch.equal(before[k], v) for k, v in engine.master_state_dict().items())
    np = pytest.importorskip("numpy")
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode="async", batch_schedule=lambda v: np.int64(2)) as e:
        assert [len(m["batches"]) for m in e.fit(make_batches(rng, 4, 8))] == [2, 2]  # it was refused
    for mode, devices in (("async", ["cpu"]), ("async", ["cpu"] * 2), ("hybrid", ["cpu"] * 2)):
        with Engine(make_model(), loss_fn, devices=devices, mode=mode) as engine:
            before = engine.master_state_dict()
            assert engine.fit(make_batches(rng, 4, 8), steps=0) == []
            assert engine.version == 0 and engine.stats()["pushes"] == engine.stats()["steps"] == 0
            assert all(torch.equal(before[k], v) for k, v in engine.master_state_dict().items())
            for bad in (dict(steps=-1), dict(steps=1.5), dict(epochs=0), dict(epochs="2")):
                with pytest.raises(ValueError, match="fit: (steps|epochs) must be an int"):
                    engine.fit(make_batches(rng, 1, 8), **bad)
            for bad in (None, 42):
                with pytest.raises(TypeError, match=r"fit: batches must be an iterable of batches; got (NoneType|int)"):
                    engine.fit(bad)
            x, y = make_batches(rng, 1, 8)[0]
            with pytest.raises(ValueError, match=r"got one dict with keys \['x', 'y'\] \(a single batch: fit"):
                engine.fit({"x": x, "y": y})  # its keys were taken for batches ("batch is a str")
            for callback in (lambda metrics: None, lambda engine_, metrics, extra: None):  # failed after a step
                with pytest.raises(TypeError, match=r"fit: a callback is called as callback\(engine, metrics\); "):
                    engine.fit(make_batches(rng, 2, 8), callbacks=[callback])
            with pytest.raises(TypeError, match=r"copy_to: model must be an nn.Module .*; got OrderedDict"):
                engine.copy_to(make_model().state_dict())
            with pytest.raises(ValueError, match=r"fit: batches must be an iterable of batches; got one tensor of "
                                                 r"shape \(8, 16\) \(a single batch: fit\(\[batch\]\)"):
                engine.fit(torch.randn(8, 16))  # its rows were taken for batches
            assert engine.version == 0
            taken = []
            engine.fit(make_batches(rng, 1, 8), callbacks=[lambda *args, **kwargs: taken.append(len(args)),
                                                           functools.partial(lambda tag, e, m: taken.append(tag), 7)])
            assert taken == [2, 7] and engine.version == 1  # any signature that takes (engine, metrics)


def test_bad_optimizer_and_seed_types():
    for devices in ("cpu", b"cpu", torch.device("cpu"), [], 2):  # bytes were a list of ints: "devices: 99 asks CUDA"
        with pytest.raises(ValueError, match=r"devices must be a non-empty list like \['cpu', 'cpu'\]"):
            Engine(make_model(), loss_fn, devices=devices)
    for model in (None, [torch.nn.Linear(2, 2)], "model"):  # AttributeError 'parameters' before
        with pytest.raises(TypeError, match=r"Engine: model must be an nn.Module \(or, for mode='pipeline', a list of "
                                            r"layers\); got (NoneType|list|str)"):
            Engine(model, loss_fn, devices=["cpu"])
    for model in (None, "model"):  # a list of layers is a pipeline's model (tests/test_pipeline.py); these are not
        with pytest.raises(TypeError, match="mode='pipeline' needs the model as a sequence of layers"):
            Engine(model, loss_fn, devices=["cpu"] * 2, mode="pipeline", stages=2)
    for kwargs, message in ((dict(lr="1"), "lr must be a number"), (dict(betas=(0.9,)), "betas must be two"),
                            (dict(betas=(0.9, "0.99")), r"betas\[1\] must be a number"),
                            (dict(eps=None), "eps must be a number"), (dict(max_grad_norm="1"), "max_grad_norm"),
                            (dict(amsgrad=1), "amsgrad must be True or False")):
        with pytest.raises((TypeError, ValueError), match=message):
            AdamW(**kwargs)
    for name in ("lr", "eps", "weight_decay"):  # the update computes in float32: refused when made, not at a step
        low = "1.175e-38" if name == "eps" else "0"  # eps > 0: float32's normal numbers
        with pytest.raises(ValueError, match=rf"{name} must be a number in \[{low}, 3.403e\+38\] \(float32's"):
            AdamW(**{name: 1e39})
        AdamW(**{name: 3e38})
    assert AdamW(lr=1, betas=[0.8, 0.9]).betas == (0.8, 0.9)
    assert AdamW(betas=torch.tensor([0.5, 0.75])).betas == (0.5, 0.75)  # a 1-D tensor (or array) of two
    for betas in ({0.9, 0.999}, {0.9: 1, 0.999: 2}, "ab"):  # a set's order swapped them; a dict gave its keys
        with pytest.raises(TypeError, match=r"betas must be a tuple of two numbers in \[0, 1\); got (set|dict|str)"):
            AdamW(betas=betas)
    for step in (0, -1, True, 1.5):  # the kernel's own check took some of these
        with pytest.raises(ValueError, match=r"AdamW.check_update: step must be an int >= 1"):
            AdamW().check_update(step)
    with pytest.raises(TypeError, match="seed must be an int"):
        Engine(make_model(), loss_fn, devices=["cpu"], seed="a")
    for seed in (2 ** 64, -2 ** 63 - 1):  # torch.manual_seed's range, said as the seed's
        with pytest.raises(ValueError, match=r"seed must be an int in \[-2\*\*63, 2\*\*64\)"):
            Engine(make_model(), loss_fn, devices=["cpu"], seed=seed)
    Engine(make_model(), loss_fn, devices=["cpu"], seed=2 ** 64 - 1).close()


@pytest.mark.parametrize("mode,workers", [("hybrid", 1), ("sync", 2), ("async", 1)])
def test_seeds_that_differ_above_bit_32_draw_their_own_masks(mode, workers):
    """A lone worker and sync mode draw their Dropout masks from torch's generator, which the engine seeds: the CPU
    one keeps the low 32 bits of a seed, so seed 5 and 5 + 2**32 trained alike (concurrent workers' generators mix
    every bit). A seed below 2**32 keeps the masks it always drew: torch.manual_seed(seed)'s."""
    batches = make_batches(torch.Generator().manual_seed(7), 3, 16)

    def losses(seed):
        with Engine(make_model(dropout=0.5), loss_fn, devices=["cpu"] * workers, mode=mode, optimizer=AdamW(**OPT),
                    seed=seed, pin=False) as engine:
            return [m["loss"] for m in engine.fit(batches)]

    small = losses(5)
    assert losses(5) == small  # the seed decides the masks
    assert losses(5 + 2 ** 32) != small
    assert losses(-5) != small and losses(2 ** 64 - 5) != losses(2 ** 32 - 5)
    if mode == "hybrid":  # a small seed's masks are torch.manual_seed(5)'s: one forward by hand
        torch.manual_seed(5)
        model = make_model(dropout=0.5)
        torch.manual_seed(5)
        assert loss_fn(model, batches[0]).item() == pytest.approx(small[0], rel=1e-6)


@pytest.mark.parametrize("mode", ["hybrid", "sync", "async"])
@pytest.mark.parametrize("changes,error,what", [
    (dict(lr=1e38), ValueError, r"lr / \(1 - beta1\^step\)"),
    (dict(lr=10.0, weight_decay=3e38), ValueError, r"1 - lr \* weight_decay"),
    (dict(eps=1e39), ValueError, r"AdamW: eps must be a number in \[1.175e-38, 3.403e\+38\] \(float32's normal"),
    # eps = 0: a parameter no worker used (its zero gradient, unused="zero") was NaN after the first step
    (dict(eps=0.0), ValueError, r"AdamW: eps must be a number in \[1.175e-38, .* divides 0 by 0\); got 0.0"),
    (dict(lr=-0.1), ValueError, r"AdamW: lr must be a number in \[0, "),
    (dict(weight_decay=-1.0), ValueError, r"AdamW: weight_decay must be a number in \[0, "),
    (dict(lr=True), TypeError, "AdamW: lr must be a number; got True"),
    (dict(lr="0.5"), TypeError, "AdamW: lr must be a number; got '0.5'"),
    (dict(betas=(1.0, 0.999)), ValueError, r"AdamW: betas must be two numbers in \[0, 1\)"),
    (dict(maximize="False"), TypeError, "AdamW: maximize must be True or False"),
    (dict(amsgrad=True), ValueError, "engine.optimizer.amsgrad was changed to True after the engine was made"),
], ids=["lr", "decay", "eps", "zero-eps", "negative-lr", "negative-decay", "bool-lr", "str-lr", "beta1-1",
        "str-maximize", "amsgrad"])
def test_an_update_the_kernel_refuses_is_not_counted(rng, mode, changes, error, what):
    """Hyperparameters changed between steps so that a float32 scalar of the update leaves float32's range (lr
    1e38: lr / (1 - beta1) is 1e39), or to a value AdamW refuses when made (lr -0.1 was counted, then refused by
    the kernel; lr=True trained at 1.0; amsgrad changed sized no buffer): the step is an error naming it (in
    every mode: async made it the cause of a WorkerError), and nothing counts: the version, the counters, the
    weights and the Adam state (its step too) are the last update's, and with the value put back the next update
    is Adam's step 2, as in a run that never saw it."""
    batches = make_batches(rng, 3, 12)
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT), **TINY_BUCKETS) \
            as engine, Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT),
                              **TINY_BUCKETS) as clean:
        def step(e, b):
            return e.fit([b])[0] if mode == "async" else e.step(b)

        step(engine, batches[0])
        step(clean, batches[0])
        before, stats = engine.state_dict(), engine.stats()
        good = {field: getattr(engine.optimizer, field) for field in changes}
        for field, value in changes.items():
            setattr(engine.optimizer, field, value)
        with pytest.raises(error, match=what):
            step(engine, batches[1])
        for field, value in good.items():
            setattr(engine.optimizer, field, value)
        assert_state_is(engine, before, stats, version=1)
        step(engine, batches[1])
        step(clean, batches[1])
        assert engine.version == clean.version == 2
        for (name, a), b in zip(engine.state_dict()["master"].items(), clean.state_dict()["master"].values()):
            assert torch.equal(a, b), name


MODES_ON_CPU = [("hybrid", 2, {}), ("sync", 1, {}), ("async", 2, {}), ("pipeline", 2, dict(stages=2))]


@pytest.mark.parametrize("mode,workers,options", MODES_ON_CPU, ids=[m[0] for m in MODES_ON_CPU])
def test_a_weight_written_in_place_by_a_step_is_refused_not_lost(rng, mode, workers, options):
    """Note [Weights changed in place by a step]: nn.Embedding(max_norm=...) renormalises the rows it looks up in
    place; torch keeps that, and the engine's copy back dropped it without a word (rows of norm 2.5 where torch's
    stay at 1). The step now fails before its update, naming the parameter; a step that wrote a weight once (a
    loss_fn's stray in-place op) fails alone, and the next trains from the store's weights, as a clean engine."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, max_norm=1.0), torch.nn.Flatten(), torch.nn.Linear(12, 3))
    batch = (torch.randint(0, 10, (8, 3)), torch.randint(0, 3, (8,)))
    kwargs = dict(devices=["cpu"] * workers, mode=mode, optimizer=AdamW(**OPT), pin=False, **options)
    with Engine(model, loss_fn, **kwargs) as engine:
        with pytest.raises((WorkerError, pyengine.StageError), match=r"parameter\(s\) '0.weight' in place"):
            engine.fit([batch])
        assert engine.version == 0 and engine.stats()["pushes" if mode == "async" else "steps"] == 0

    writes = []

    def stray(model, batch):  # writes a weight in place on its first call only
        if not writes:
            writes.append(1)
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
        return loss_fn(model, batch)

    batches = make_batches(rng, 2, 8)
    with Engine(make_model(), stray, **kwargs) as engine, Engine(make_model(), loss_fn, **kwargs) as clean:
        # (the pipeline calls loss_fn on its last stage: its first parameter is 2.weight)
        with pytest.raises((WorkerError, pyengine.StageError), match=r"parameter\(s\) '[02].weight' in place"):
            engine.fit(batches[:1])
        engine.fit(batches[1:])
        clean.fit(batches[1:])
        assert engine.version == clean.version == 1
        for (name, a), b in zip(engine.state_dict()["master"].items(), clean.state_dict()["master"].values()):
            assert torch.equal(a, b), name


def test_no_trainable_parameters_is_an_error():
    model = make_model()
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match=r"no trainable parameters \(every parameter has requires_grad=False\)"):
        Engine(model, loss_fn, devices=["cpu"])
    with pytest.raises(ValueError, match="^the model has no parameters$"):  # not "every parameter is frozen"
        Engine(torch.nn.ReLU(), loss_fn, devices=["cpu"])


class _Overlapping(torch.nn.Module):
    """Two parameters over overlapping memory: elements 2 and 3 of ``base`` are in both."""

    def __init__(self, frozen: bool = False, apart: bool = False):
        super().__init__()
        base = torch.randn(8)
        self.a = torch.nn.Parameter(base[:4])
        self.b = torch.nn.Parameter(base[4:7] if apart else base[2:5], requires_grad=not frozen)

    def forward(self, x):
        return x @ self.a[:3] + x @ self.b


@pytest.mark.parametrize("frozen", [False, True])
def test_parameters_that_overlap_in_memory_are_refused(frozen):
    """Parameter(base[:4]) and Parameter(base[2:5]): the engine trained them as two, the replicas no longer shared
    the elements and copy_to wrote both into them (the last write winning: the model other than
    master_state_dict()). Refused when built, naming both, also when one of them is frozen (the trainable one would
    change it); views that do not overlap, and a parameter used twice, train."""
    loss = lambda m, x: m(x).square().mean()
    with pytest.raises(ValueError, match=r"parameters 'a' and 'b' overlap in memory \(views of one tensor\)"):
        Engine(_Overlapping(frozen=frozen), loss, devices=["cpu"], pin=False)
    x = torch.randn(6, 3)
    with Engine(_Overlapping(apart=True), loss, devices=["cpu"], pin=False) as engine:
        engine.step(x)
        assert engine.version == 1


def test_batch_smaller_than_workers_and_non_scalar_loss(rng):
    with Engine(make_model(), loss_fn, devices=["cpu"] * 4) as engine:
        with pytest.raises(ValueError, match="a batch of 3 samples cannot feed 4 workers"):
            engine.step(make_batches(rng, 1, 3)[0])
    per_sample = lambda model, batch: torch.nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none")
    with Engine(make_model(), per_sample, devices=["cpu"] * 2) as engine:
        with pytest.raises(WorkerError, match="loss_fn must return a scalar"):
            engine.step(make_batches(rng, 1, 8)[0])


@pytest.mark.parametrize("mode,workers", [("hybrid", 2), ("sync", 1), ("async", 2)])
def test_a_loss_without_a_gradient_is_named_as_loss_fns(rng, mode, workers):
    """An int loss, a detached one and a comparison got torch's "element 0 of tensors does not require grad and does
    not have a grad_fn", naming neither loss_fn nor the cause; each is a ValueError naming both, and the engine
    trains on."""
    batch = make_batches(rng, 1, 8)[0]
    make = {"int64": lambda loss: torch.tensor(3), "detached": lambda loss: loss.detach(),
            "bool": lambda loss: loss > 0}
    for kind, bad in make.items():
        with Engine(make_model(), lambda m, b: bad(loss_fn(m, b)), devices=["cpu"] * workers, mode=mode,
                    optimizer=AdamW(**OPT), pin=False) as engine:
            with pytest.raises((WorkerError, ValueError)) as raised:
                engine.step(batch) if mode != "async" else engine.fit([batch])
            error = raised.value.__cause__ if isinstance(raised.value, WorkerError) else raised.value
            assert isinstance(error, ValueError) and str(error).startswith("loss_fn returned a loss that does not "
                                                                           "require grad"), (kind, error)
            assert ("not floating point" if kind != "detached" else "detached") in str(error), (kind, error)
            assert engine.version == 0


@pytest.mark.parametrize("mode", ["hybrid", "sync"])
def test_a_batch_that_cannot_be_split_names_the_tensor(rng, mode):
    x, y = make_batches(rng, 1, 8)[0]
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode) as engine:
        with pytest.raises(ValueError, match=r"batch\['w'\] is a 0-dim tensor"):
            engine.step({"x": x, "y": y, "w": torch.tensor(1.0)})
        with pytest.raises(ValueError, match=r"dim 0; batch\[0\] has 8, batch\[1\] has 7"):
            engine.step((x, y[:7]))
        assert engine.version == 0


@pytest.mark.parametrize("mode,options", [("hybrid", {}), ("hybrid", dict(microbatches=2)), ("sync", {}),
                                          ("sync", dict(microbatches=2)), ("async", {}), ("pipeline", {})])
def test_a_batch_that_requires_grad_trains_as_a_detached_one_and_a_sparse_one_is_refused(rng, mode, options):
    """Note [A batch that requires grad]: a batch tensor that required grad got each shard's gradient (hybrid with 2
    workers: 2x torch's; an fp16 loss scale never divided out), and one with a history failed the second shard's
    backward ("backward through the graph a second time"). Every mode now trains on such a batch exactly as on its
    detached values (bit for bit), leaving the caller's tensors without a gradient, and loss_fn still gets an input
    that requires grad (a reentrant checkpoint needs one). A sparse tensor failed hybrid in torch.tensor_split (sync
    and async took it): every mode refuses it, naming it, before any work."""
    batches = make_batches(rng, 2, 8)
    seen = []

    def loss(model, batch):
        seen.append(batch[0].requires_grad)
        return loss_fn(model, batch)

    def train(batches):  # async: one worker, whose pushes are in order (two race)
        with Engine(make_model(), loss, devices=["cpu"] * (1 if mode == "async" else 2), mode=mode,
                    optimizer=AdamW(**OPT), pin=False, **options) as engine:
            if mode == "async":
                engine.fit(batches)
            else:
                for b in batches:
                    engine.step(b)
            return engine.master_state_dict(), engine

    expected, _ = train(batches)
    leaf = batches[0][0].clone().requires_grad_()
    made = torch.nn.Parameter(batches[1][0].clone())
    history = made * 1.0  # a tensor with a graph behind it
    seen.clear()
    got, engine = train([(leaf, batches[0][1]), (history, batches[1][1])])
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert leaf.grad is None and made.grad is None
    if mode != "pipeline":  # the pipeline's loss_fn gets the last stage's activations, not the batch
        assert seen and all(seen)
    (x, y), = make_batches(rng, 1, 8)
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT), pin=False,
                **options) as engine:
        with pytest.raises(ValueError, match=r"batch\[1\] is a torch.sparse_coo tensor: a batch is split along dim "
                                             r"0 into views"):
            engine.step((x, y.to_sparse())) if mode != "async" else engine.fit([(x, y.to_sparse())])
        assert engine.version == 0
        engine.step((x, y)) if mode != "async" else engine.fit([(x, y)])
        assert engine.version == 1


def test_split_batch_shards_and_checks_its_parts():
    from pyengine.workers import split_batch
    x = torch.arange(7)
    assert [s.tolist() for s in split_batch({"x": x}, 3)[0].values()] == [[0, 1, 2]]
    assert [len(s) for s in split_batch(x, 3)] == [3, 2, 2]
    for bad in (0, -1, True, 2.0):  # 0 and -1 gave no shards at all, True one
        with pytest.raises(ValueError, match=r"split_batch: parts must be an integer >= 1; got "):
            split_batch(x, bad)


@pytest.mark.parametrize("mode,workers", [("hybrid", 1), ("hybrid", 2), ("sync", 2), ("async", 2)])
def test_a_batch_of_values_that_are_not_tensors_is_refused(rng, mode, workers):
    """A list of labels, a numpy array or a number in a batch reached every worker whole (not split with the
    tensors): a loss reading it saw every sample's values with two workers and its shard's with one. A ValueError
    in every mode (async wrapped it in a WorkerError, as if a worker had failed)."""
    np = pytest.importorskip("numpy")
    x, y = make_batches(rng, 1, 8)[0]

    def loss(model, batch):
        return loss_fn(model, (batch["x"], batch["y"]) if isinstance(batch, dict) else batch)

    with Engine(make_model(), loss, devices=["cpu"] * workers, mode=mode) as engine:
        for batch, where, kind in (((x, y.tolist()), r"batch\[1\]\[0\]", "int"),
                                   ((x, y.numpy()), r"batch\[1\]", "numpy.ndarray"),
                                   ({"x": x, "y": y, "t": 0.5}, r"batch\['t'\]", "float")):
            with pytest.raises(ValueError, match=rf"^{where} is a {kind}, not a tensor: every value of a batch is a "
                                                 r"tensor split along dim 0"):
                engine.fit([batch]) if mode == "async" else engine.step(batch)
        assert engine.version == 0
        assert engine.fit([{"x": x, "y": y, "unused": None}])[0]["version"] == 1  # None: nothing to split


@pytest.mark.parametrize("mode,workers", [("hybrid", 1), ("hybrid", 2), ("sync", 2), ("pipeline", 1),
                                          ("pipeline", 2)])
def test_the_steps_after_a_failed_one_draw_as_if_it_had_never_been_tried(rng, mode, workers):
    """Note [A failed step leaves the generators alone]: workers drawing from torch's own generator (a lone worker,
    sync, a pipeline on one device) left it advanced by the failed step's forward: the steps after it drew other
    dropout masks than a run that never tried it (concurrent workers' own generators were right already)."""
    batches = make_batches(rng, 3, 12)
    armed = {"on": False}

    def failing_once(model, batch):
        loss = loss_fn(model, batch)  # the forward, and its dropout draws, ran
        if armed["on"]:
            raise RuntimeError("injected")
        return loss

    def run(fail):
        options = dict(stages=workers, microbatches=2) if mode == "pipeline" else {}
        with Engine(make_model(dropout=0.3), failing_once, devices=["cpu"] * workers, mode=mode, seed=3,
                    optimizer=AdamW(**OPT), **options) as engine:
            engine.step(batches[0])
            if fail:
                armed["on"] = True
                with pytest.raises(WorkerError, match="injected"):
                    engine.step(batches[1])
                armed["on"] = False
            losses = [engine.step(b)["loss"] for b in batches[1:]]
            return losses, engine.master_state_dict()

    (clean_losses, clean), (losses, weights) = run(False), run(True)
    assert losses == clean_losses
    assert all(torch.equal(weights[k], clean[k]) for k in clean)


@pytest.mark.parametrize("interruption", ["failed", "stopped", "state-read"])
def test_a_lone_async_workers_unapplied_push_leaves_the_generators_alone(rng, interruption):
    """Note [A failed step leaves the generators alone] for async: a lone worker draws from torch's generators, and
    its push that failed (a worker error), was discarded (engine.stop() while it computed) or during which the state
    was read, left them advanced (or the read state held them advanced): the pushes after it drew other dropout
    masks than a run that never tried it. As sync does, the run now draws as if it never had, and a state read
    during a push resumes bit for bit."""
    batches = make_batches(rng, 5, 12)
    armed, mid = {"on": False}, {}

    def interrupted_once(model, batch):
        loss = loss_fn(model, batch)  # the forward, and its dropout draws, ran
        if armed["on"]:
            armed["on"] = False
            if interruption == "failed":
                raise RuntimeError("injected")
            if interruption == "stopped":
                mid["engine"].stop()
            else:
                mid["state"] = mid["engine"].state_dict()
        return loss

    def engine():
        return Engine(make_model(dropout=0.3), interrupted_once, devices=["cpu"], mode="async", seed=3,
                      optimizer=AdamW(**OPT))

    with engine() as clean:
        clean.fit(batches)
        want = clean.master_state_dict()
    with engine() as interrupted:
        mid["engine"] = interrupted
        interrupted.fit(batches[:2])
        armed["on"] = True
        if interruption == "failed":
            with pytest.raises(WorkerError, match="injected"):
                interrupted.fit(batches[2:])
        else:
            interrupted.fit(batches[2:])
        if interruption == "state-read":
            assert mid["state"]["version"] == 2
            with engine() as resumed:
                resumed.load_state_dict(mid["state"])
                resumed.fit(batches[2:])
                got = resumed.master_state_dict()
        else:
            assert interrupted.version == 2
            interrupted.fit(batches[2:])
            got = interrupted.master_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("no_decay", [(), ("bias",)], ids=["one-call", "decay-runs"])
def test_update_range_from_a_shard_sized_gradient_equals_the_full_slot(rng, no_decay):
    """A multi-node async server receives only its shard of a push (it held a whole store's gradient per client):
    update_range(first=begin) over a shard-sized gradient gives the bits of the update from the full slot, on both
    of its paths (one call; one call per weight decay)."""
    def updated(shard: bool):
        with Engine(make_model(), loss_fn, devices=["cpu"], optimizer=AdamW(**OPT, no_decay=no_decay),
                    pin=False) as engine:
            numel = engine.store.numel
            begin, end = numel // 3, numel - 5
            grad = torch.randn(numel, generator=torch.Generator().manual_seed(7))
            engine.admit_update(False, [])
            engine.update_range(begin, end, [grad[begin:end].clone() if shard else grad], None,
                                torch.tensor(1.0), first=begin if shard else 0)
            return engine.store.param.clone(), engine.store.exp_avg_sq.clone(), begin, end

    (full, full_v, begin, end), (part, part_v, _, _) = updated(False), updated(True)
    assert torch.equal(full, part) and torch.equal(full_v, part_v)
    assert full_v[begin:end].all(), "the range is updated"
    assert not full_v[:begin].any() and not full_v[end:].any(), "only the range is updated"


def test_no_push_is_applied_after_the_one_whose_callback_raised(rng):
    """Note [The push that ends a run]: the run stopped only after the failing push released the mutex, and the
    other worker, waiting on it, applied one more push (and the callbacks ran again): 1 run in 3 here. Several runs,
    so that the old order fails almost surely."""
    batches = make_batches(rng, 20, 8)
    for _ in range(5):
        seen = []

        def refuse_third(engine, metrics):
            seen.append(engine.stats()["pushes"])
            if seen[-1] == 3:
                time.sleep(0.05)  # the other worker finishes its computation and waits on the mutex
                raise RuntimeError("the callback says stop")

        with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode="async", optimizer=AdamW(**OPT)) as engine:
            with pytest.raises(RuntimeError, match="the callback says stop"):
                engine.fit(batches, callbacks=[refuse_third])
            assert (engine.stats()["pushes"], engine.version, seen) == (3, 3, [1, 2, 3])


@pytest.mark.parametrize("error", [OSError, SystemExit])
@pytest.mark.parametrize("mode,workers", [("hybrid", 2), ("sync", 1), ("async", 1), ("async", 2)])
def test_an_error_of_the_batches_iterable_is_raised_as_itself(rng, mode, workers, error):
    """A data loader's error ends fit as itself in every mode (async wrapped it in a WorkerError naming the worker
    that happened to ask for the next batch: an ``except OSError`` missed it; with 2 workers a SystemExit, not an
    Exception, was still wrapped); the batches before it trained."""
    batches = make_batches(rng, 6, 8)

    def loader():
        for i, b in enumerate(batches):
            if i == 3:
                raise error("corrupt shard file")
            yield b

    with Engine(make_model(), loss_fn, devices=["cpu"] * workers, mode=mode, optimizer=AdamW(**OPT)) as engine:
        with pytest.raises(error, match="corrupt shard file"):
            engine.fit(loader())
        # async with 2 workers: the other's computation in flight when the loader failed may be discarded
        assert engine.version == 3 if (mode, workers) != ("async", 2) else engine.version in (2, 3)


@pytest.mark.parametrize("mode,workers", [("hybrid", 2), ("sync", 1), ("async", 1), ("async", 2)])
def test_an_iterable_whose_next_epoch_cannot_start_is_raised_as_itself(rng, mode, workers):
    """The error of a second ``iter(batches)`` (a dataset gone between epochs) ends fit as itself in every mode:
    async raised it inside its end-of-epoch handler, where it escaped the wrapping that carries the iterable's
    errors out of the worker, as a WorkerError naming a worker. The first epoch trained."""
    batches = make_batches(rng, 3, 8)

    class Vanishing:
        def __init__(self):
            self.epochs = 0

        def __iter__(self):
            self.epochs += 1
            if self.epochs > 1:
                raise OSError("the dataset went away")
            return iter(batches)

    with Engine(make_model(), loss_fn, devices=["cpu"] * workers, mode=mode, optimizer=AdamW(**OPT)) as engine:
        with pytest.raises(OSError, match="the dataset went away"):
            engine.fit(Vanishing(), epochs=2)
        # async with 2 workers: the other's computation in flight when the iterable failed may be discarded
        assert engine.version == 3 if (mode, workers) != ("async", 2) else engine.version in (2, 3)


@pytest.mark.parametrize("workers", [1, 2])
def test_an_async_engine_whose_callback_raised_is_freed_by_reference_counting(rng, workers):
    """The raised callback error's traceback held the frame that held it (fit's own frame): a cycle through the
    engine, freed only by the garbage collector (Note [A task's exception and its callers' frames])."""
    def refuse(engine, metrics):
        raise RuntimeError("the callback says stop")

    assert_freed_after(lambda: Engine(make_model(), loss_fn, devices=["cpu"] * workers, mode="async", pin=False),
                       lambda engine: engine.fit(make_batches(rng, 4, 8), callbacks=[refuse]), RuntimeError,
                       "the callback says stop")


def assert_freed_after(build, fail, error, match):
    """The engine ``build()`` makes, after ``fail(engine)`` raised ``error`` and close(), is freed with its store by
    reference counting alone (the garbage collector off)."""
    gc.disable()
    try:
        engine = build()
        with pytest.raises(error, match=match):
            fail(engine)
        engine.close()
        refs = weakref.ref(engine), weakref.ref(engine.store)
        del engine
        assert [r() is None for r in refs] == [True, True]
    finally:
        gc.enable()


def test_an_async_push_wall_counts_its_waits_for_the_store(rng):
    """A push's wall was the sum of its parts: the wait for the store's mutex (here: the other worker's callbacks,
    30 ms each) was left out, and samples/s was many times the real rate."""
    def slow_callback(engine, metrics):
        time.sleep(0.03)

    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode="async", optimizer=AdamW(**OPT)) as engine:
        metrics = engine.fit(make_batches(rng, 12, 8), callbacks=[slow_callback])
    walls = [m["wall_s"] for m in metrics]
    assert statistics.median(walls) >= 0.02, walls  # most pushes waited for a callback of the other worker


def test_the_metrics_step_is_the_step_count_of_stats(rng):
    """step was the position in history: a step raised for a non-finite gradient is counted and not recorded, and
    load_state_dict restores the counts, not the history."""
    batches = make_batches(rng, 4, 8)
    poisoned = (batches[1][0].clone(), batches[1][1])
    poisoned[0][0, 0] = float("nan")
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT), nonfinite="raise") as engine:
        assert engine.step(batches[0])["step"] == 1
        with pytest.raises(FloatingPointError):
            engine.step(poisoned)
        assert engine.step(batches[2])["step"] == engine.stats()["steps"] == 3
        state = engine.state_dict()
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as resumed:
        resumed.load_state_dict(state)
        assert resumed.step(batches[3])["step"] == 4


Pair = collections.namedtuple("Pair", ["x", "y"])


@pytest.mark.parametrize("mode,workers", [("hybrid", 2), ("hybrid", 1), ("sync", 2)])
def test_namedtuple_and_defaultdict_batches_train_as_a_tuple_and_a_dict(rng, mode, workers):
    """Batches as datasets and collate functions yield them: a namedtuple (rebuilt from its fields, as
    default_collate does) trains as the plain tuple, a defaultdict as the plain dict, bit for bit (both raised a
    TypeError when the batch was split or moved)."""
    batches = make_batches(rng, 3, 8)
    by_field = lambda model, b: torch.nn.functional.cross_entropy(model(b.x), b.y)
    by_key = lambda model, b: torch.nn.functional.cross_entropy(model(b["x"]), b["y"])
    runs = [(loss_fn, lambda x, y: (x, y)), (by_field, Pair),
            (by_key, lambda x, y: {"x": x, "y": y}), (by_key, lambda x, y: collections.defaultdict(list, x=x, y=y))]
    weights = []
    for fn, make in runs:
        with Engine(make_model(), fn, devices=["cpu"] * workers, mode=mode) as engine:
            losses = [engine.step(make(x, y))["loss"] for x, y in batches]
            weights.append((losses, engine.store.param.clone()))
    for losses, param in weights[1:]:
        assert losses == weights[0][0] and torch.equal(param, weights[0][1])


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["deterministic-model", "dropout"])
@pytest.mark.parametrize("mode,workers", [("hybrid", 2), ("hybrid", 1), ("sync", 2)])
def test_state_dict_resume_is_bit_identical(rng, worker_device, dropout, mode, workers):
    """With dropout the state carries the generators the workers draw from: concurrent workers' own (seeded per step
    from the state's seed), and for a lone worker or sync mode torch's own, on the CPU and on each CUDA device
    (``cuda_rng``). The resumed run draws the masks the straight one drew (the engine that loads is built with
    another seed, which reseeds torch's generators, so nothing but the state can make them equal)."""
    batches = make_batches(rng, 10, 24)
    model = make_model(dropout=dropout)
    devices = [worker_device] * workers
    with Engine(model, loss_fn, devices=devices, mode=mode, optimizer=AdamW(**OPT, amsgrad=True)) as engine:
        for b in batches:
            engine.step(b)
        straight = engine.master_state_dict()
    with Engine(model, loss_fn, devices=devices, mode=mode, optimizer=AdamW(**OPT, amsgrad=True)) as engine:
        for b in batches[:4]:
            engine.step(b)
        saved = copy.deepcopy(engine.state_dict())
    assert list(saved["cuda_rng"]) == ([0] if worker_device.startswith("cuda") else [])
    with Engine(make_model(seed=1, dropout=dropout), loss_fn, devices=devices, mode=mode,
                optimizer=AdamW(**OPT, amsgrad=True), seed=99) as engine:
        engine.load_state_dict(saved)
        for b in batches[4:]:
            engine.step(b)
        resumed = engine.master_state_dict()
        assert engine.stats()["steps"] == 10
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def test_load_state_dict_checks_the_optimizer_it_was_saved_with(rng):
    """amsgrad must match (its Adam state has one more buffer); other settings may change on resume, with a
    warning that names them (torch.optim would silently take the saved ones)."""
    with Engine(make_model(), loss_fn, devices=["cpu"], optimizer=AdamW(**OPT, amsgrad=True)) as engine:
        engine.step(make_batches(rng, 1, 8)[0])
        saved = engine.state_dict()
    with Engine(make_model(), loss_fn, devices=["cpu"], optimizer=AdamW(**OPT)) as engine:
        with pytest.raises(ValueError, match=r"saved with amsgrad=True and this engine has amsgrad=False"):
            engine.load_state_dict(saved)
        assert engine.version == 0
    with Engine(make_model(), loss_fn, devices=["cpu"], optimizer=AdamW(**{**OPT, "lr": 0.5}, amsgrad=True)) as engine:
        with pytest.warns(UserWarning, match=r"saved with \{'lr': 0\.01\}; this engine's optimizer \(\{'lr': 0\.5\}\)"):
            engine.load_state_dict(saved)
        assert engine.version == 1
    with Engine(make_model(), loss_fn, devices=["cpu"], optimizer=AdamW(**OPT, amsgrad=True)) as engine:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same optimizer: nothing to say
            engine.load_state_dict(saved)


def test_load_state_dict_warns_that_the_optimizer_groups_hyper_parameters_are_not_read(rng):
    """Lowering a saved group's lr before resuming (a torch.optim habit), or loading torch.optim's own state, changes
    nothing: the engine's optimizer drives the update. Said with a warning that names the values, never silently;
    a state as saved (two groups, an lr schedule whose group lr is a scheduled value) loads without a word."""
    batches = make_batches(rng, 2, 8)
    settings = dict(optimizer=AdamW(**OPT, no_decay=("bias",)), lr_schedule=pyengine.WarmupCosine(2, 10))
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, **settings) as engine:
        engine.step(batches[0])
        saved = engine.state_dict()
    assert saved["optimizer"]["param_groups"][0]["lr"] != OPT["lr"]  # scheduled: not a difference
    edited = copy.deepcopy(saved)
    edited["optimizer"]["param_groups"][0].update(initial_lr=0.0, betas=(0.5, 0.5))
    edited["optimizer"]["param_groups"][1]["eps"] = 1e-8
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, **settings) as engine:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            engine.load_state_dict(saved)
            no_base = copy.deepcopy(saved)  # groups without initial_lr: their lr is still a scheduled value
            for group in no_base["optimizer"]["param_groups"]:
                del group["initial_lr"]
            engine.load_state_dict(no_base)
        with pytest.warns(UserWarning, match=r"param_groups hold \{\"param_groups\[0\]\['initial_lr'\]\": 0\.0, "
                                             r"\"param_groups\[0\]\['betas'\]\": \(0\.5, 0\.5\), "
                                             r"\"param_groups\[1\]\['eps'\]\": 1e-08\}, which are not read"):
            engine.load_state_dict(edited)
        assert engine.step(batches[1])["lr"] > 0  # the engine's own settings
    model = make_model()  # torch.optim's state: no optimizer_config, compared with the engine's settings
    torch_opt = torch.optim.AdamW(model.parameters(), **{**OPT, "lr": 0.5})
    loss_fn(model, batches[0]).backward()
    torch_opt.step()
    with Engine(make_model(), loss_fn, devices=["cpu"], optimizer=AdamW(**OPT)) as engine:
        engine.step(batches[0])
        state = dict(engine.state_dict(), optimizer=torch_opt.state_dict())
        del state["optimizer_config"]
        with pytest.warns(UserWarning, match=r"\{\"param_groups\[0\]\['lr'\]\": 0\.5\}, which are not read"):
            engine.load_state_dict(state)
        state["optimizer"]["param_groups"][0]["lr"] = OPT["lr"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch.optim.AdamW's state with the same settings
            engine.load_state_dict(state)


def test_an_engine_launched_by_torchrun_without_a_process_group_warns(rng, monkeypatch):
    """WORLD_SIZE > 1 without torch.distributed initialized: process_group="auto" trains each rank alone on its own
    batches, which was silent."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(RuntimeWarning, match=r"WORLD_SIZE=2 \(launched by torchrun\?\) but torch.distributed is not "
                                            r"initialized, so process_group='auto' trains in this process alone"):
        Engine(make_model(), loss_fn, devices=["cpu"], pin=False).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for: no word
        Engine(make_model(), loss_fn, devices=["cpu"], pin=False, process_group=None).close()


def test_dropout_resume_on_other_workers_and_process_free_state(rng):
    """The workers' generators are seeded per step from (seed, worker, step) (Note [Random numbers of concurrent
    workers]): the state holds no generator, and a run resumed with another worker count loads without a word."""
    with Engine(make_model(dropout=0.3), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as engine:
        engine.step(make_batches(rng, 1, 8)[0])
        saved = engine.state_dict()
    assert "worker_rng" not in saved
    with Engine(make_model(dropout=0.3), loss_fn, devices=["cpu"] * 3, optimizer=AdamW(**OPT)) as engine:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            engine.load_state_dict(saved)
        assert engine.version == 1 and engine.step(make_batches(rng, 1, 9)[0])["applied"]


def test_load_state_dict_rejects_foreign_state():
    with Engine(make_model(), loss_fn, devices=["cpu"]) as engine:
        with pytest.raises(ValueError, match="not a pyengine engine state"):
            engine.load_state_dict({"weights": 1})
        other = Engine(make_model(hidden=5), loss_fn, devices=["cpu"])
        with pytest.raises(ValueError, match="expected float32"):
            engine.load_state_dict(other.state_dict())
        other.close()


@pytest.mark.parametrize("mode", ["hybrid", "pipeline"])
def test_a_state_refuses_a_model_with_other_frozen_parameters(rng, mode):
    """Note [A state names the frozen parameters it was trained with]: a model whose first layer is frozen trains,
    its state loads into an engine of the same model (the next step equal, bit for bit), and an engine whose frozen
    layer differs (built from another seed) refuses it, naming the layer, and keeps its own state."""
    def model(seed):
        m = make_model(seed=seed)
        m[0].requires_grad_(False)
        return m

    options = dict(devices=["cpu"] * 2, optimizer=AdamW(**OPT), mode=mode)
    if mode == "pipeline":
        options.update(stages=2, microbatches=2)
    batches = make_batches(rng, 3, 16)
    with Engine(model(0), loss_fn, **options) as saved, Engine(model(0), loss_fn, **options) as same, \
            Engine(model(1), loss_fn, **options) as other:
        for b in batches[:2]:
            saved.step(b)
        state = saved.state_dict()
        assert set(state["frozen"]) == {"0.weight", "0.bias"}
        same.load_state_dict(state)
        saved.step(batches[2])
        same.step(batches[2])
        for name, value in saved.master_state_dict().items():
            assert torch.equal(same.master_state_dict()[name], value), name
        before = other.master_state_dict()
        with pytest.raises(ValueError, match=r"other frozen parameters .*\['0.bias', '0.weight'\]"):
            other.load_state_dict(state)
        assert other.version == 0
        for name, value in before.items():
            assert torch.equal(other.master_state_dict()[name], value), name
        del state["frozen"]  # a state written before the digests were saved: not checked
        other.load_state_dict(state)
        assert other.version == 2


def _corruptions():
    """(what, how to spoil a valid state, the error it must raise): every part load_state_dict reads."""
    def spoil(path, value):
        def apply(sd):
            *parents, last = path
            target = sd
            for key in parents:
                target = target[key]
            if value is KeyError:
                del target[last]
            else:
                target[last] = value(target[last]) if callable(value) else value
        return apply

    return [
        ("master lacks a weight", spoil(("master", "0.bias"), KeyError), "master weights"),
        ("master has an extra weight", spoil(("master", "extra"), torch.zeros(1)), "master weights"),
        ("master weight in float64", spoil(("master", "2.weight"), lambda t: t.double()), "expected float32"),
        ("Adam state of the last param misshaped", spoil(("optimizer", "state", 3, "exp_avg"), torch.zeros(5)),
         r"state\[3\]\['exp_avg'\]"),
        ("Adam state lacks exp_avg_sq", spoil(("optimizer", "state", 2, "exp_avg_sq"), KeyError), "lacks"),
        ("Adam state not a tensor", spoil(("optimizer", "state", 1, "exp_avg"), 0.5), "floating tensor"),
        ("Adam state empty at version > 0", spoil(("optimizer", "state"), {}), "does not match"),
        ("version ahead of the Adam step", spoil(("version",), 7), "does not match"),
        ("version not an int", spoil(("version",), "three"), "version must be an int"),
        ("rng of the wrong kind", spoil(("rng",), torch.zeros(3)), "rng"),
        ("rng of the right size, not a generator state", spoil(("rng",), torch.zeros_like), "not a generator state"),
        ("cuda_rng not a dict", spoil(("cuda_rng",), [0]), "cuda_rng must be"),
        ("cuda_rng state not a byte tensor", spoil(("cuda_rng",), {0: torch.zeros(16)}), "cuda_rng must be"),
        ("cuda_rng keyed by a name", spoil(("cuda_rng",), {"cuda:0": torch.zeros(16, dtype=torch.uint8)}),
         "cuda_rng must be"),
        ("master weight on the meta device", spoil(("master", "0.bias"), lambda t: t.to("meta")), "meta device"),
        ("Adam state on the meta device", spoil(("optimizer", "state", 3, "exp_avg"), lambda t: t.to("meta")),
         "on meta"),
        ("master weight sparse", spoil(("master", "2.weight"), lambda t: t.to_sparse()), r"torch.sparse_coo"),
        ("Adam state sparse", spoil(("optimizer", "state", 3, "exp_avg"), lambda t: t.to_sparse()),
         r"torch.sparse_coo"),
        ("names not a list", spoil(("names",), 5), "do not match this model's"),
        ("a master key not a string", spoil(("master", 7), torch.zeros(1)), "master weights"),
        ("no counters", spoil(("counters",), KeyError), "lacks"),
        ("staleness keys not ints", spoil(("staleness",), {"x": 1}), "staleness"),
        ("staleness key infinite", spoil(("staleness",), {float("inf"): 1}), "staleness"),
        ("staleness count not an int", spoil(("staleness",), {"3": 2.9}),
         r"keys and counts must be ints >= 0; got \{'3': 2.9\}"),
        ("staleness key a fraction", spoil(("staleness",), {2.9: 3}), r"got \{2.9: 3\}"),  # was taken as 2
        ("staleness key negative", spoil(("staleness",), {-1: 3}), r"got \{-1: 3\}"),
        ("staleness key a bool", spoil(("staleness",), {True: 3}), r"got \{True: 3\}"),
        ("a counter negative", spoil(("counters", "steps"), -5), r"values ints >= 0; got \{.*'steps': -5"),
        ("a counter a bool", spoil(("counters", "steps"), True), r"values ints >= 0; got \{.*'steps': True"),
        ("Adam step infinite", spoil(("optimizer", "state", 2, "step"), torch.tensor(float("inf"))), "step"),
        ("ranks not a list of counters", spoil(("ranks",), [{"counters": {}}]), "the state's ranks"),
        ("pipeline_sizes not a list of ints", spoil(("pipeline_sizes",), [3.5]), "pipeline_sizes"),
        ("frozen parameters of another model", spoil(("frozen",), {"0.weight": "0" * 64}), "other frozen parameters"),
        ("frozen not a dict of digests", spoil(("frozen",), ["0.weight"]), "the state's frozen must be"),
        # a tensor where a number belongs raised RuntimeError "Boolean value of Tensor ... is ambiguous"
        ("optimizer_config lr a tensor", spoil(("optimizer_config", "lr"), torch.tensor([1e-3, 1e-3])),
         r"optimizer_config\['lr'\] must be a number .* got Tensor"),
        ("param_groups params a tensor", spoil(("optimizer", "param_groups", 0, "params"),
                                               lambda p: [torch.tensor([0, 1])] + list(p)[1:]),
         r"param_groups\[0\] holds params"),
        # torch.optim refuses each of these; they loaded without a word
        *[(f"param_groups[0] {what}", spoil(("optimizer", "param_groups", 0), value),
           r"param_groups\[0\] must be a dict with the indices of its params")
          for what, value in (("a number", 5), ("an empty dict", {}), ("a string", "garbage"))],
        ("param_groups params None", spoil(("optimizer", "param_groups", 0, "params"), None),
         r"param_groups\[0\] holds params None"),
        # Note [A state's values are checked]: a diverged or damaged state trained on with every loss NaN
        ("master weight NaN", spoil(("master", "2.bias"), lambda t: _with_last(t, float("nan"))),
         r"master weight '2.bias' holds 1 non-finite value\(s\) .* of 3: a diverged or damaged state"),
        ("exp_avg infinite", spoil(("optimizer", "state", 0, "exp_avg"), lambda t: _with_last(t, -float("inf"))),
         r"optimizer state\[0\]\['exp_avg'\] \(param '0.weight'\) holds 1 non-finite"),
        ("exp_avg_sq beyond float32", spoil(("optimizer", "state", 3, "exp_avg_sq"),
                                            lambda t: _with_last(t.double(), 1e39)), "beyond float32's range"),
        ("exp_avg_sq negative", spoil(("optimizer", "state", 1, "exp_avg_sq"), lambda t: _with_last(t, -1e-12)),
         r"state\[1\]\['exp_avg_sq'\] \(param '0.bias'\) holds 1 negative value\(s\) of 24"),
    ]


def test_an_amsgrad_state_with_a_negative_maximum_is_refused(rng):
    """max_exp_avg_sq is checked as exp_avg_sq is (a negative one would make the update's denominator NaN)."""
    batches = make_batches(rng, 3, 8)
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT, amsgrad=True)) as engine:
        engine.fit(batches)
        state = engine.state_dict()
        state["optimizer"]["state"][1]["max_exp_avg_sq"] = _with_last(state["optimizer"]["state"][1]["max_exp_avg_sq"],
                                                                      -1e-12)
        before = engine.master_state_dict()
        with pytest.raises(ValueError, match=r"state\[1\]\['max_exp_avg_sq'\] \(param '0.bias'\) holds 1 negative"):
            engine.load_state_dict(state)
        for name, value in engine.master_state_dict().items():
            assert torch.equal(value, before[name]), name


def _with_last(t: torch.Tensor, value) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[-1] = value
    return t


@pytest.mark.parametrize("what,corrupt,error", _corruptions(), ids=[c[0] for c in _corruptions()])
def test_invalid_state_changes_nothing(rng, what, corrupt, error):
    """load_state_dict validates everything before it writes: a state spoiled anywhere (first or last parameter,
    weights, Adam state, version, RNG, counters) raises and leaves weights, Adam state, version, RNG and counters
    as they were."""
    batches = make_batches(rng, 4, 8)
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as source:
        source.fit(batches[:3])
        state = source.state_dict()
    corrupt(state)
    with Engine(make_model(seed=1), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as engine:
        engine.step(batches[3])
        before = copy.deepcopy(engine.state_dict())
        rng_before = torch.get_rng_state()
        with pytest.raises(ValueError, match=error):
            engine.load_state_dict(state)
        after = engine.state_dict()
        assert after["version"] == before["version"] == 1 and after["counters"] == before["counters"]
        assert torch.equal(torch.get_rng_state(), rng_before)
        for name in before["master"]:
            assert torch.equal(after["master"][name], before["master"][name]), name
        for index, entry in before["optimizer"]["state"].items():
            for key, value in entry.items():
                assert torch.equal(after["optimizer"]["state"][index][key], value), (index, key)


def test_a_loss_scale_below_min_scale_warns_before_the_load_writes_anything(rng):
    """A state whose loss scale is below this engine's min_scale loads at min_scale with a warning. The warning came
    after the weights, Adam state and version were written and before the replicas pulled them: as an error
    (``python -W error``, pytest's filterwarnings = error) it left the store loaded and the replicas on the old
    weights, and the next step trained the old replicas' gradients into the new master. Now it comes first, with
    the load's other warnings, and names the caller's line."""
    batches = make_batches(rng, 3, 8)
    scaler = pyengine.LossScaler(init_scale=2.0 ** 21, min_scale=2.0 ** 20)
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT), loss_scale=scaler) as engine:
        engine.step(batches[0])
        state = engine.state_dict()
        state["loss_scaler"] = {"scale": 65536.0, "growth_tracker": 3}  # saved with a lower min_scale
        engine.step(batches[1])
        before, stats = copy.deepcopy(engine.state_dict()), engine.stats()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(RuntimeWarning, match=r"load_state_dict: the state's loss scale 65536.0 is below this "
                               r"scaler's min_scale 1048576.0 .* starts at 1048576.0"):
                engine.load_state_dict(state)
        assert_state_is(engine, before, stats, 2)
        assert before["loss_scaler"] == engine.state_dict()["loss_scaler"] != state["loss_scaler"]
        engine.workers[1].wait_copies_back()  # the copies into the replica run on its copy thread
        replica = dict(engine.workers[1].replica.named_parameters())
        assert all(torch.equal(replica[k], v) for k, v in engine.master_state_dict().items())
        with pytest.warns(RuntimeWarning, match="loss scale 65536.0 is below") as caught:
            engine.load_state_dict(state)
        assert [w.filename for w in caught] == [__file__]  # the caller's line, once
        assert engine.version == 1 and engine.state_dict()["loss_scaler"] == {"scale": 2.0 ** 20, "growth_tracker": 0}
        engine.workers[1].wait_copies_back()  # the copies into the replica run on its copy thread
        replica = dict(engine.workers[1].replica.named_parameters())
        assert all(torch.equal(replica[k], v) for k, v in engine.master_state_dict().items())


@pytest.mark.parametrize("saved,loaded", [(("0.bias",), ("2.bias",)), (("bias",), ()), ((), ("weight",))],
                         ids=["same-sizes", "two-groups-to-one", "one-group-to-two"])
def test_a_state_loads_each_parameters_moments_when_no_decay_changed(rng, saved, loaded):
    """The state's torch indices follow the groups of the optimizer that saved it: with another no_decay they were
    read in the loading engine's order, and two parameters of one shape swapped their moments (only a warning)."""
    def moments_by_name(engine):
        state = engine.optimizer_state_dict()["state"]
        order = [n for names, _ in engine.optimizer.param_groups(engine.param_names) for n in names]
        return {n: (state[i]["exp_avg"], state[i]["exp_avg_sq"]) for i, n in enumerate(order)}

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))  # equal shapes
    batch = (torch.randn(8, 4, generator=rng), torch.randint(0, 4, (8,), generator=rng))
    with Engine(copy.deepcopy(model), loss_fn, devices=["cpu"], optimizer=AdamW(**OPT, no_decay=saved)) as source:
        source.step(batch)
        state, expected = source.state_dict(), moments_by_name(source)
    with Engine(copy.deepcopy(model), loss_fn, devices=["cpu"], optimizer=AdamW(**OPT, no_decay=loaded)) as engine:
        with pytest.warns(UserWarning, match="no_decay"):
            engine.load_state_dict(state)
        got = moments_by_name(engine)
    for name, (m, v) in expected.items():
        assert torch.equal(got[name][0], m) and torch.equal(got[name][1], v), name


def test_a_state_without_the_models_buffers_is_refused(rng):
    """A BatchNorm model's state with ``"buffers": {}`` would leave the statistics as they are: refused (a state
    written before buffers were saved has no "buffers" key at all, and loads)."""
    with Engine(make_bn_model(), loss_fn, devices=["cpu"] * 2) as engine:
        engine.step(make_batches(rng, 1, 8)[0])
        state = engine.state_dict()
        with pytest.raises(ValueError, match=r"the state's buffers \[\] do not match"):
            engine.load_state_dict(dict(state, buffers={}))
        del state["buffers"]
        engine.load_state_dict(state)


def test_a_state_written_before_cuda_rng_was_saved_loads(rng):
    """States (and checkpoints) from before the CUDA generators were saved have no "cuda_rng": they load."""
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as engine:
        engine.step(make_batches(rng, 1, 8)[0])
        state = engine.state_dict()
        del state["cuda_rng"]
        engine.load_state_dict(state)
        assert engine.version == 1


def test_a_state_built_from_tensors_that_require_grad_loads_as_values(rng):
    """A state whose weights and Adam state require grad (say, built from a model's parameters) loads their values:
    the host store is not tied to autograd."""
    batches = make_batches(rng, 3, 8)
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as source:
        source.fit(batches[:2])
        state = source.state_dict()
    state["master"] = {k: torch.nn.Parameter(v) for k, v in state["master"].items()}
    for entry in state["optimizer"]["state"].values():
        entry["exp_avg"].requires_grad_(True)
    with Engine(make_model(seed=1), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as engine:
        engine.load_state_dict(state)
        assert not engine.store.param.requires_grad and engine.store.param.grad_fn is None
        assert not engine.store.exp_avg.requires_grad and engine.store.exp_avg.grad_fn is None
        for name, value in engine.master_state_dict().items():
            assert torch.equal(value, state["master"][name].detach()), name
        engine.step(batches[2])


def test_fit_says_what_a_one_shot_iterator_cannot_give_and_checks_callbacks(rng):
    batches = make_batches(rng, 3, 8)
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as engine:
        with pytest.warns(RuntimeWarning, match="ran out after 3 of the 5 steps asked .*one-shot iterator"):
            assert len(engine.fit(iter(batches), steps=5)) == 3
        with pytest.warns(RuntimeWarning, match="epochs=2 over a one-shot iterator"):
            assert len(engine.fit((b for b in batches), epochs=2)) == 3
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(engine.fit(batches, steps=5)) == 5  # a list is iterated again: no warning
            assert len(engine.fit(batches, epochs=2)) == 6
        version = engine.version
        for bad, message in ((print, "got one builtin_function_or_method"), (3, "iterable of callables"),
                             ([print, 3], "every callback must be callable")):
            with pytest.raises(ValueError, match=message):
                engine.fit(batches, callbacks=bad)
        assert engine.version == version  # refused before any step


def test_a_channels_last_model_is_refused_before_the_store_is_made():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3)).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=r"parameter '0.weight' is not contiguous .*contiguous_format"):
        Engine(model, loss_fn, devices=["cpu"] * 2)


def test_a_transposed_parameter_is_refused_with_a_fix_that_works():
    """The advice was model.to(memory_format=torch.contiguous_format), which converts 4-D and 5-D tensors only: a
    transposed Linear weight stayed as it was, and the same error came back."""
    model = make_model()
    model[0].weight = torch.nn.Parameter(torch.randn(10, 24).t())
    with pytest.raises(ValueError, match=r"parameter '0.weight' is not contiguous \(shape \(24, 10\), strides "
                                         r"\(1, 24\); .*`for p in model.parameters\(\): p.data = "
                                         r"p.data.contiguous\(\)`"):
        Engine(model, loss_fn, devices=["cpu"] * 2)
    for p in model.parameters():  # the fix the message gives
        p.data = p.data.contiguous()
    with Engine(model, loss_fn, devices=["cpu"] * 2) as engine:
        assert torch.equal(engine.master_state_dict()["0.weight"], model[0].weight.detach())


def test_lazy_and_complex_parameters_are_refused_naming_them():
    """A lazy module's parameter got torch's 'Attempted to use an uninitialized parameter' (naming neither it nor
    Engine); a complex one was told to use model.float(), which leaves it complex."""
    lazy = torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.LazyLinear(3))
    message = r"parameter '1.weight' is uninitialized \(a lazy module.*run one forward of the model on a sample batch"
    with pytest.raises(ValueError, match="Engine: " + message):
        Engine(lazy, loss_fn, devices=["cpu"] * 2)
    with pytest.raises(ValueError, match="HostStore: " + message):
        pyengine.HostStore(lazy, pin=False)
    lazy(torch.zeros(1, 10))  # the fix
    with Engine(lazy, loss_fn, devices=["cpu"] * 2) as engine:
        assert "1.weight" in engine.master_state_dict()
    model = make_model()
    model[2].bias = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"parameter '2.bias' is torch.complex64: a trainable parameter must be real "
                                         r".*torch.view_as_complex"):
        Engine(model, loss_fn, devices=["cpu"] * 2)


@pytest.mark.parametrize("make", [torch.jit.script, lambda m: torch.jit.trace(m, torch.zeros(2, 10))],
                         ids=["script", "trace"])
def test_a_torchscript_model_is_refused_naming_the_fix(make):
    """torch said 'post accumulate grad hooks cannot be registered on non-leaf tensors' (the replicas' parameters,
    copies of a ScriptModule's, are no leaves), naming neither the engine nor the fix."""
    with pytest.raises(TypeError, match=r"Engine: the model \((RecursiveScriptModule|TopLevelTracedModule)\) is a "
                                        r"TorchScript module: .*give the plain nn.Module"):
        Engine(make(make_model()), loss_fn, devices=["cpu"] * 2)
    nested = make_model()
    nested[2] = make(torch.nn.Linear(24, 3)) if make is torch.jit.script else torch.jit.trace(
        torch.nn.Linear(24, 3), torch.zeros(2, 24))
    with pytest.raises(TypeError, match=r"Engine: '2' \(.*\) is a TorchScript module"):
        Engine(nested, loss_fn, devices=["cpu"] * 2)
    with pytest.raises(TypeError, match=r"Engine: layer 2 \(.*\) is a TorchScript module"):
        Engine(list(nested), loss_fn, devices=["cpu"] * 2, mode="pipeline", stages=2)


class GrowsInForward(torch.nn.Module):
    """A hand-made lazy layer: its bias is created by the first forward (after the engine copied the model)."""

    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, x):
        if not hasattr(self, "extra"):
            self.extra = torch.nn.Parameter(torch.zeros(3))
        return self.net(x) + self.extra


@pytest.mark.parametrize("mode", ["hybrid", "sync", "async"])
def test_a_parameter_created_in_the_forward_is_refused_not_left_untrained(rng, mode):
    """It got a .grad each step and was never trained nor saved (torch trains it), without a word. The first
    step's backward now refuses it, naming it; nothing is updated."""
    with Engine(GrowsInForward(), loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT)) as engine:
        before = engine.master_state_dict()
        with pytest.raises(WorkerError, match=r"the replica has trainable parameter\(s\) \['extra'\] that the store "
                                              r"does not hold: made after the streamer was built"):
            engine.fit(make_batches(rng, 2, 8), steps=1) if mode == "async" else engine.step(make_batches(rng, 1, 8)[0])
        assert engine.version == 0
        for name, value in engine.master_state_dict().items():
            assert torch.equal(value, before[name]), name


@pytest.mark.parametrize("mode,workers", [("hybrid", 2), ("sync", 2), ("hybrid", 1), ("pipeline", 2)])
def test_ctrl_c_inside_a_step_completes_it_then_raises(rng, mode, workers, python_sigint):
    """Note [Ctrl-C inside a step]: SIGINT arriving in the middle of the update (hybrid: between two buckets) is held
    until the step is complete; then KeyboardInterrupt. The weights are those of the whole step (as an engine that was
    not interrupted), and the next step trains normally. A second SIGINT in a step gets out at once and leaves the
    engine refusing further work until it is closed."""
    import signal
    options = dict(stages=2, microbatches=2) if mode == "pipeline" else {}
    batches = make_batches(rng, 2, 8)
    kwargs = dict(devices=["cpu"] * workers, mode=mode, optimizer=AdamW(**OPT), pin=False, **TINY_BUCKETS, **options)
    with Engine(make_model(), loss_fn, **kwargs) as plain:
        for b in batches:
            plain.step(b)
        expected = plain.master_state_dict()

    def interrupting(times):
        calls = [0]

        def update_range(*args, **kw):
            Engine.update_range(engine, *args, **kw)
            calls[0] += 1
            if calls[0] == 1:  # after the first range's update: hybrid, before the other buckets' updates
                for _ in range(times):
                    signal.raise_signal(signal.SIGINT)
        return update_range

    with Engine(make_model(), loss_fn, **kwargs) as engine:
        engine.update_range = interrupting(1)
        with pytest.raises(KeyboardInterrupt, match="it completed first"):
            engine.step(batches[0])
        assert engine.version == 1
        del engine.update_range
        engine.step(batches[1])
        for name, value in engine.master_state_dict().items():
            assert torch.equal(value, expected[name]), name
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        engine.update_range = interrupting(2)
        with pytest.raises(KeyboardInterrupt, match="second Ctrl-C"):
            engine.step(batches[0])
        with pytest.raises(RuntimeError, match="abandoned by a second Ctrl-C"):
            engine.step(batches[0])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("workers", [2, 1])  # 1: the lone CPU worker runs its loop on the calling thread
def test_ctrl_c_during_async_fit_stops_every_worker(rng, workers, python_sigint):
    """Ctrl-C while async workers run: fit raises KeyboardInterrupt once every worker has stopped after its current
    push (none left running, every push applied whole), and the engine trains on afterwards."""
    import signal
    batches = make_batches(rng, 4, 8)

    def interrupt_at_5(engine, metrics):
        if engine.stats()["pushes"] == 5:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            # callbacks run under the store's mutex: no push lands until the main thread, which may wait for the
            # GIL on a loaded machine, got to the signal and stopped the run (a fixed 1 s sleep here could end
            # first; before it, 3 more pushes were seen under load). A lone worker runs on the main thread, which
            # takes the signal once this callback has returned.
            if threading.current_thread() is threading.main_thread():
                return
            deadline = time.monotonic() + 30
            while not engine._async_run.stop.is_set() and time.monotonic() < deadline:
                time.sleep(0.001)

    with Engine(make_model(), loss_fn, devices=["cpu"] * workers, mode="async", optimizer=AdamW(**OPT),
                pin=False) as engine:
        with pytest.raises(KeyboardInterrupt):
            engine.fit(batches, steps=10_000, callbacks=[interrupt_at_5])
        time.sleep(0.2)
        assert not [t.name for t in threading.enumerate() if t.name.startswith("pyengine-async")]
        stats = engine.stats()
        assert 5 <= stats["pushes"] <= 5 + workers and engine.version == stats["applied_updates"]
        assert len(engine.fit(batches, steps=3)) == 3
        assert engine.stats()["pushes"] == stats["pushes"] + 3


@pytest.mark.parametrize("mode", ["hybrid", "sync", "async"])
def test_a_callback_is_outside_the_deferral_of_ctrl_c(rng, mode, python_sigint):
    """A lone CPU worker's callbacks run on the calling thread after the step (async: the push) is whole, outside the
    deferral of Note [Ctrl-C inside a step]: Ctrl-C in a slow callback (an evaluation) raises at once and the engine
    trains on, and a SIGINT handler the callback installs stays. Async held the Ctrl-C until the callback ended, a
    second one gave the engine up with every push complete, and its handler was replaced by Python's default."""
    import signal
    batches = make_batches(rng, 4, 8)

    def own_handler(signum, frame):
        pass

    def interrupted(engine, metrics):
        if engine.version == 2:
            signal.raise_signal(signal.SIGINT)  # raised in here at once: the second never comes
            signal.raise_signal(signal.SIGINT)

    def installs(engine, metrics):
        if engine.version == 4:  # the first of two steps: the second runs under the handler
            signal.signal(signal.SIGINT, own_handler)

    with Engine(make_model(), loss_fn, devices=["cpu"], mode=mode, optimizer=AdamW(**OPT), pin=False) as engine:
        with pytest.raises(KeyboardInterrupt) as raised:
            engine.fit(batches, callbacks=[interrupted])
        assert "abandoned" not in str(raised.value) and engine.version == 2
        assert len(engine.fit(batches[:1])) == 1 and engine.version == 3
        try:
            engine.fit(batches[:2], callbacks=[installs])
            assert signal.getsignal(signal.SIGINT) is own_handler
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.mark.parametrize("setting", ["optimizer", "batch_schedule"])
def test_a_bad_setting_in_async_is_raised_as_itself(rng, setting):
    """An optimizer field made invalid between pushes, or a batch_schedule's bad value, is the caller's error:
    ValueError as sync and hybrid raise it, not a WorkerError naming whichever worker met it first."""
    options = dict(batch_schedule=lambda version: 1 if version < 2 else 0) if setting == "batch_schedule" else {}

    def bad_lr(engine, metrics):
        if setting == "optimizer" and engine.version == 2:
            engine.optimizer.lr = -1.0

    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode="async", optimizer=AdamW(**OPT), pin=False,
                **options) as engine:
        with pytest.raises(ValueError, match=r"lr must be|batch_schedule\(2\) must return"):
            engine.fit(make_batches(rng, 6, 8), callbacks=[bad_lr])
        assert engine.version == 2 == engine.stats()["applied_updates"]


@pytest.mark.parametrize("setting", ["batch_schedule", "lr_schedule"])
def test_a_setting_that_raises_a_base_exception_in_async_is_raised_as_itself(rng, setting):
    """batch_schedule raising KeyboardInterrupt, or lr_schedule SystemExit, ended a 2-worker async fit as a
    WorkerError naming a worker (only Exceptions were carried out as themselves; one worker, sync and hybrid raised
    them as themselves). The engine trains on after it."""
    error = KeyboardInterrupt if setting == "batch_schedule" else SystemExit
    raised_at = []

    def schedule(version):
        # >= 2: batch_schedule is asked at each pull, and both workers may push between two pulls (version 2 skipped)
        if version >= 2:
            raised_at.append(version)
            raise error("the schedule says stop")
        return 1 if setting == "batch_schedule" else 1e-3

    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode="async", optimizer=AdamW(**OPT), pin=False,
                **{setting: schedule}) as engine:
        with pytest.raises(error, match="the schedule says stop"):
            engine.fit(make_batches(rng, 6, 8))
        assert len(raised_at) == 1 and engine.version == raised_at[0] == engine.stats()["applied_updates"], raised_at
        assert raised_at[0] == 2 or setting == "batch_schedule"  # lr_schedule is asked at every update


@pytest.mark.parametrize("workers", [1, 2])
def test_an_async_push_checks_its_update_once(rng, monkeypatch, workers):
    """A push asks Engine.check_update once, under the mutex, before it counts (a refreshed one too): it was asked
    again when the update was admitted, with no user code in between (~5-20 us a push)."""
    calls = []
    check = Engine.check_update
    monkeypatch.setattr(Engine, "check_update", lambda self, step: calls.append(step) or check(self, step))
    with Engine(make_model(), loss_fn, devices=["cpu"] * workers, mode="async", optimizer=AdamW(**OPT), pin=False,
                max_staleness=0) as engine:
        engine.fit(make_batches(rng, 7, 8))
        stats = engine.stats()
    assert stats["pushes"] == 7 and len(calls) == stats["pushes"] + stats["refreshes"], (stats, calls)


def test_second_ctrl_c_while_async_workers_finish_gives_the_engine_up(rng, python_sigint):
    """A second Ctrl-C while fit waits for the workers to finish their pushes (after the first): fit raises with
    workers still running, so the engine refuses more work as after a second Ctrl-C inside a step (it accepted a new
    fit beside the old run's threads), and close() waits for them."""
    import os
    import signal

    release = threading.Event()  # the workers' computations end only once fit has handled both signals
    computing = threading.Event()  # a worker is inside its loss: fit then waits for it when the first signal comes

    def held_loss(model, batch):
        computing.set()
        release.wait(60)
        return loss_fn(model, batch)

    engine = Engine(make_model(), held_loss, devices=["cpu"] * 2, mode="async", optimizer=AdamW(**OPT), pin=False)

    def interrupt_twice():
        # the first once the workers compute, the second once fit handles the first (two signals the main thread
        # has not run between would count as one); the workers are held until fit gave the engine up (with a
        # computation of a fixed length, a loaded machine let them finish before the second signal came). A worker
        # thread that merely exists may not compute yet: a first signal then ended fit before any computation, and
        # the second one came outside fit (it ended the whole test session)
        deadline = time.monotonic() + 60
        try:
            computing.wait(60)
            os.kill(os.getpid(), signal.SIGINT)
            while time.monotonic() < deadline and not (engine._async_run is not None
                                                       and engine._async_run.stop.is_set()):
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGINT)
            while time.monotonic() < deadline and not engine._abandoned:
                time.sleep(0.001)
        finally:
            release.set()

    controller = threading.Thread(target=interrupt_twice)
    controller.start()
    with pytest.raises(KeyboardInterrupt):
        engine.fit(make_batches(rng, 10, 8))
    controller.join()
    with pytest.raises(RuntimeError, match="abandoned by a second Ctrl-C"):
        engine.fit(make_batches(rng, 2, 8))
    engine.close()
    # close() returned once every worker had set its done event, its last act; the threads then end
    for thread in [t for t in threading.enumerate() if t.name.startswith("pyengine-async")]:
        thread.join(10)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("pyengine-async")]
    assert engine.stats()["pushes"] == 0  # the computations in flight at the first Ctrl-C were not pushed


_EXIT_AFTER_SECOND_CTRL_C = """
import os, signal, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal: a runner in the background ignores it
import torch
import pyengine
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
release, computing = threading.Event(), threading.Event()
def held_loss(m, batch):
    computing.set()
    release.wait(60)
    return torch.nn.functional.cross_entropy(m(batch[0]), batch[1])
engine = pyengine.Engine(model, held_loss, devices=["cpu"] * 2, mode="async", pin=False)
def interrupt_twice():  # as in test_second_ctrl_c_while_async_workers_finish_gives_the_engine_up
    deadline = time.monotonic() + 60
    computing.wait(60)
    os.kill(os.getpid(), signal.SIGINT)
    while time.monotonic() < deadline and not (engine._async_run is not None and engine._async_run.stop.is_set()):
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGINT)
    while time.monotonic() < deadline and not engine._abandoned:
        time.sleep(0.001)
    release.set()  # the workers compute their last push while the interpreter exits
threading.Thread(target=interrupt_twice, daemon=True).start()
engine.fit([(torch.randn(256, 256), torch.randint(0, 10, (256,)))] * 1000)
"""


def test_a_script_ended_by_a_second_ctrl_c_during_async_fit_exits_cleanly(tmp_path):
    """Note [Async threads are not daemons]: a script whose async fit is ended by a second Ctrl-C (the workers still
    finishing their push) and that lets the KeyboardInterrupt end it aborted at exit in 5 of 6 runs ("terminate
    called without an active exception", SIGABRT): its daemon workers were killed inside torch. It ends by its
    SIGINT, as hybrid and sync do."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "second_ctrl_c.py"
    script.write_text(_EXIT_AFTER_SECOND_CTRL_C)
    for _ in range(3):
        run = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
        # an uncaught KeyboardInterrupt ends Python by SIGINT (a shell's 130); the abort was SIGABRT
        assert run.returncode == -signal.SIGINT and "terminate called" not in run.stderr, \
            (run.returncode, run.stderr[-2000:])
        assert run.stderr.rstrip().endswith("KeyboardInterrupt"), run.stderr[-2000:]


_ASYNC_FIT_ON_A_DAEMON_THREAD = """
import threading, time, torch, pyengine
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
engine = pyengine.Engine(model, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), devices=["cpu"] * 2,
                         mode="async", pin=False)
def record(engine, metrics):
    if metrics["step"] == 1:
        print(sorted((t.name, t.daemon) for t in threading.enumerate() if t.name.startswith("pyengine-async")),
              flush=True)
batch = (torch.randn(64, 64), torch.randint(0, 10, (64,)))
threading.Thread(target=engine.fit, args=([batch] * 300,), kwargs=dict(callbacks=[record]), daemon=True).start()
time.sleep(0.5)  # the script ends while fit runs
"""


def test_async_fit_on_a_daemon_thread_makes_workers_that_are_no_daemons():
    """Note [Async threads are not daemons]: a thread takes its creator's daemon flag, so an async fit called on a
    daemon thread made daemon workers, and a script that ended meanwhile aborted ("terminate called without an
    active exception", SIGABRT: the interpreter killed them inside torch). They are no daemons now: the exit waits
    for their pushes and the script exits 0."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-W", "ignore", "-c", _ASYNC_FIT_ON_A_DAEMON_THREAD], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0 and "terminate called" not in run.stderr, (run.returncode, run.stderr[-2000:])
    assert run.stdout.splitlines() == ["[('pyengine-async-0', False), ('pyengine-async-1', False)]"], run.stdout


def _new_thread_count() -> int:
    """The intra-op thread count a thread started now begins with."""
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


@pytest.mark.parametrize("mode", ["hybrid", "pipeline"])
def test_close_gives_later_threads_the_callers_thread_count(rng, mode):
    """Note [Worker threads' count]: CPU workers set their share of the cores, which later threads would inherit;
    after close() a new thread starts with the count the engine's caller had."""
    options = dict(stages=2, microbatches=2) if mode == "pipeline" else {}
    torch.set_num_threads(8)
    with Engine(make_model(), loss_fn, devices=["cpu"] * 4, mode=mode, pin=False, **options) as engine:
        engine.fit(make_batches(rng, 2, 8))
        assert _new_thread_count() == 2  # the premise: the effect exists (each of 4 CPU workers set 8 // 4)
    assert _new_thread_count() == 8


def test_an_engine_dropped_without_close_gives_later_threads_the_callers_thread_count(rng):
    torch.set_num_threads(8)
    engine = Engine(make_model(), loss_fn, devices=["cpu"] * 4, pin=False)
    engine.fit(make_batches(rng, 2, 8))
    assert _new_thread_count() == 2  # the premise: the effect exists
    del engine
    gc.collect()
    assert _new_thread_count() == 8


@pytest.mark.parametrize("mode", ["hybrid", "async", "pipeline"])
def test_cpu_workers_divide_the_callers_intra_op_threads(rng, mode):
    """Note on set_worker_threads: the workers share the threads of the thread that built the engine (what
    OMP_NUM_THREADS, torch.set_num_threads and the process's CPU affinity leave it), not os.cpu_count(): a process
    pinned to a few of a machine's CPUs, or one of several processes of a node, oversubscribed its cores."""
    options = dict(stages=2, microbatches=2) if mode == "pipeline" else {}
    seen = set()

    def counting_loss(model, batch):
        seen.add(torch.get_num_threads())
        return loss_fn(model, batch)

    for threads in (3 * (os.cpu_count() or 1), 1):  # more than the machine's CPUs; fewer than its workers
        torch.set_num_threads(threads)
        seen.clear()
        with Engine(make_model(), counting_loss, devices=["cpu"] * 2, mode=mode, pin=False, **options) as engine:
            engine.fit(make_batches(rng, 2, 8))
        assert seen == {max(1, threads // 2)}, threads


@pytest.mark.parametrize("workers,serial", [(2, True), (1, False)])
def test_hybrid_host_ops_beside_cpu_workers_run_on_the_host_thread_alone(rng, monkeypatch, workers, serial):
    """Note [Host threads beside CPU workers]: the per-bucket norm and a small update run on the host thread alone
    while CPU workers hold the cores on their own threads; a lone CPU worker runs on the host thread itself, so its
    norm and update keep every thread. Seen from inside the ops' calls."""
    from pyengine import _C, ops
    seen = []

    def is_serial():
        previous = _C._set_serial_on_this_thread(True)
        _C._set_serial_on_this_thread(previous)
        return previous

    norm, update = ops.mean_grad_norm, Engine.update_range
    monkeypatch.setattr(ops, "mean_grad_norm", lambda *a, **k: (seen.append(("norm", is_serial())), norm(*a, **k))[1])
    monkeypatch.setattr(Engine, "update_range",
                        lambda *a, **k: (seen.append(("update", is_serial())), update(*a, **k))[1])
    with Engine(make_model(), loss_fn, devices=["cpu"] * workers, pin=False, **TINY_BUCKETS) as engine:
        engine.fit(make_batches(rng, 2, 8))
    assert {kind for kind, _ in seen} == {"norm", "update"} and len(seen) == 2 * 2 * 4  # 2 steps x 4 buckets
    assert all(s is serial for _, s in seen), seen
    assert is_serial() is False  # left as found


@pytest.mark.parametrize("mode", ["hybrid", "sync", "async", "pipeline"])
def test_a_dropped_engine_is_freed_by_reference_counting(rng, mode):
    """No reference cycle runs through an engine (Note [No reference cycle through the engine]): once closed and
    dropped, it and its host store are freed at once, not whenever the garbage collector runs."""
    options = dict(stages=2, microbatches=2) if mode == "pipeline" else {}
    gc.disable()
    try:
        with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode, pin=False, **options) as engine:
            engine.fit(make_batches(rng, 2, 8))
        refs = weakref.ref(engine), weakref.ref(engine.store)
        del engine
        assert [r() is None for r in refs] == [True, True]
    finally:
        gc.enable()


@pytest.mark.parametrize("mode,workers", [("hybrid", 1), ("hybrid", 2), ("sync", 1), ("sync", 2), ("async", 1),
                                          ("async", 2), ("pipeline", 2)])
def test_an_engine_whose_step_failed_is_freed_by_reference_counting(rng, mode, workers):
    """A worker's failure leaves no cycle either: a lone CPU worker runs on the calling thread (Note [One CPU worker
    runs on the calling thread]), and its exception's traceback held the frame that held its future, which held the
    exception: engine and store lived until the garbage collector ran."""
    def failing(model, batch):
        raise RuntimeError("injected")

    options = dict(stages=2, microbatches=2) if mode == "pipeline" else {}
    assert_freed_after(lambda: Engine(make_model(), failing, devices=["cpu"] * workers, mode=mode, pin=False,
                                      **options),
                       lambda engine: engine.fit(make_batches(rng, 1, 8)), WorkerError, "injected")


def test_optimizer_state_dict_matches_torch(rng, worker_device):
    model = make_model()
    reference = TorchReference(model, **OPT)
    with Engine(model, loss_fn, devices=[worker_device] * 2, optimizer=AdamW(**OPT)) as engine:
        for b in make_batches(rng, 5, 20):
            engine.step(b)
            reference.step([b])
        ours = engine.optimizer_state_dict()
    theirs = reference.opt.state_dict()
    assert set(ours["state"]) == set(theirs["state"])
    for index, entry in theirs["state"].items():
        assert set(entry) == set(ours["state"][index])
        assert float(ours["state"][index]["step"]) == float(entry["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            scale = entry[key].abs().max().item()
            torch.testing.assert_close(ours["state"][index][key].double(), entry[key], rtol=1e-4, atol=1e-5 * scale)
    group, ref_group = ours["param_groups"][0], theirs["param_groups"][0]
    for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "params"):
        assert group[key] == ref_group[key], key
    # and back: a torch.optim.AdamW loads it and holds the same state
    fresh = torch.optim.AdamW(copy.deepcopy(model).parameters(), **OPT)
    fresh.load_state_dict(ours)
    for index, entry in fresh.state_dict()["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[key], ours["state"][index][key]), (index, key)


def test_bf16_autocast_trains_with_fp32_master(rng, worker_device):
    batches = make_batches(rng, 30, 32)
    with Engine(make_model(), loss_fn, devices=[worker_device] * 2, optimizer=AdamW(lr=3e-2), autocast=torch.bfloat16) as e:
        assert e.store.grad_slot(0).dtype == torch.bfloat16 and e.store.param.dtype == torch.float32
        history = e.fit(batches[:1] * 30)
    assert history[-1]["loss"] < 0.5 * history[0]["loss"], "overfitting one batch must reduce its loss"


def test_metrics_trace_and_unused_parameters(rng, tmp_path):
    class WithUnused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(10, 3)
            self.unused = torch.nn.Linear(10, 3)

        def forward(self, x):
            return self.used(x)

    model = WithUnused()
    with Engine(model, loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**{**OPT, "weight_decay": 0.0})) as engine:
        history = engine.fit(make_batches(rng, 3, 8))
        engine.trace(tmp_path / "trace.json")
        for bad in (10 ** 6, None, True):  # an int was a file descriptor: trace(True) wrote to stdout and closed it
            with pytest.raises(TypeError, match=r"trace: path must be a file name \(str or path-like\); got "):
                engine.trace(bad)
        unused = engine.master_state_dict()["unused.weight"]
    assert torch.equal(unused, model.unused.weight.detach()), "zero gradient and no decay: unchanged"
    for key in ("loss", "samples_per_s", "compute_s", "transfer_wait_s", "update_s", "copy_back_s",
                "overlap_efficiency"):
        assert key in history[-1]
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    rows = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"host", "worker0", "worker1"} <= rows
    assert any(e.get("name") == "update" for e in events)


def test_a_trace_whose_write_fails_leaves_the_previous_one(rng, tmp_path, monkeypatch):
    """The trace was written in place: a write that failed half way (a full disk) left a truncated file where a
    good trace was (a resume rewrites it). It is replaced atomically, and nothing is left beside it."""
    path = tmp_path / "trace.json"
    with Engine(make_model(), loss_fn, devices=["cpu"], optimizer=AdamW(**OPT), pin=False) as engine:
        engine.fit(make_batches(rng, 2, 8))
        engine.trace(bytes(path))  # a bytes path too, as open() takes it
        good = path.read_bytes()
        engine.fit(make_batches(rng, 2, 8))

        def full_disk(obj, f):
            f.write(json.dumps(obj)[:100])
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(json, "dump", full_disk)
        with pytest.raises(OSError, match="No space left"):
            engine.trace(path)
    assert path.read_bytes() == good and json.loads(good)["traceEvents"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]


def test_a_trace_to_a_path_it_cannot_write_names_that_path(rng, tmp_path, monkeypatch):
    """engine.trace("") said "PosixPath('.') has an empty name"; a missing folder, a folder as the path and a
    refused write named the temporary file beside the path (".t.tmp.json"), not the path given."""
    with Engine(make_model(), loss_fn, devices=["cpu"], optimizer=AdamW(**OPT), pin=False) as engine:
        engine.fit(make_batches(rng, 1, 8))
        with pytest.raises(ValueError, match="the file name is empty"):
            engine.trace("")
        missing = tmp_path / "no" / "t.json"
        with pytest.raises(FileNotFoundError, match=f"its folder '{tmp_path / 'no'}' does not exist: '{missing}'"):
            engine.trace(missing)
        with pytest.raises(IsADirectoryError, match=f"is a folder, not a file: '{tmp_path}'"):
            engine.trace(tmp_path)
        real_open = open

        def refused(file, *args, **kwargs):  # a folder this user may not write (root may write anywhere)
            if str(file).endswith(".t.tmp.json"):
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)
        monkeypatch.setattr("builtins.open", refused)
        with pytest.raises(PermissionError, match=rf"Permission denied \(writing it through \.t\.tmp\.json\): "
                                                  f"'{tmp_path / 't.json'}'"):
            engine.trace(tmp_path / "t.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", ["hybrid", "sync", "async"])
def test_copy_back_is_measured(rng, mode):
    """copy_back_s: the seconds a worker waited for the updated weights before computing (hybrid, sync: the copy
    back not hidden behind the update; async: the snapshot's copy under the mutex). Measured, so never exactly 0
    on a CPU worker, and part of the step's wall time."""
    with Engine(make_model(hidden=4096), loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT)) as engine:
        history = engine.fit(make_batches(rng, 4, 8))
    for metrics in history:
        assert 0.0 < metrics["copy_back_s"] < metrics["wall_s"], metrics


def test_default_devices_and_public_api():
    with Engine(make_model(), loss_fn) as engine:
        expected = torch.cuda.device_count() if torch.cuda.is_available() else 2
        assert engine.num_workers == expected
    assert pyengine.Engine is Engine and pyengine.AdamW is AdamW


def make_bn_model(seed=0, d_in=10, hidden=24, d_out=3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, d_out))


def loss_failing_while(failing: dict):
    """loss_fn that raises RuntimeError("after the forward") after its forward, while ``failing["on"]``."""
    def loss(model, batch):
        value = loss_fn(model, batch)
        if failing["on"]:
            raise RuntimeError("after the forward")
        return value
    return loss


@pytest.mark.parametrize("mode,workers", [("hybrid", 2), ("hybrid", 1), ("sync", 1), ("async", 1)])
def test_a_failed_step_leaves_the_buffers_alone(rng, mode, workers, worker_device):
    """Note [A failed step leaves the buffers alone]: every worker's forward of step 2 runs (BatchNorm counts its
    batch), then its loss raises. The engine's buffers and weights are those of step 1, and the run goes on exactly
    as one that never saw step 2's batch: bit-identical weights and buffers. Async (the source replica's failed
    push) is compared with sync, which one async worker equals."""
    batches = make_batches(rng, 3, 12)
    failing = {"on": False}
    loss_then_fail = loss_failing_while(failing)

    kw = dict(devices=[worker_device] * workers, optimizer=AdamW(**OPT))
    with Engine(make_bn_model(), loss_then_fail, mode=mode, **kw) as engine, \
            Engine(make_bn_model(), loss_fn, mode="sync" if mode == "async" else mode, **kw) as clean:
        engine.fit(batches[:1])
        clean.fit(batches[:1])
        before = engine.state_dict()
        failing["on"] = True
        with pytest.raises(WorkerError, match="after the forward"):
            engine.fit(batches[1:2])
        failing["on"] = False
        for name, value in engine.buffers_state_dict().items():
            assert torch.equal(value, before["buffers"][name]), name
        engine.fit(batches[2:])
        clean.fit(batches[2:])
        for name, value in clean.master_state_dict().items():
            assert torch.equal(engine.master_state_dict()[name], value), name
        for name, value in clean.buffers_state_dict().items():
            assert torch.equal(engine.buffers_state_dict()[name], value), name


def test_close_from_a_signal_handler_on_the_fit_thread_waits_for_the_async_workers(rng):
    """close() from a signal handler (a SIGTERM handler's shutdown, say) runs on the thread that called fit, which
    only waits for its 2 worker threads: it was taken for a close() from inside the run (a callback), waited for
    nothing, closed the streamers under the computing workers and returned while they ran. It returns once they
    stopped, as from any other thread, and fit raises that the engine was closed."""
    import signal

    def slow_loss(model, batch):
        time.sleep(0.02)
        return loss_fn(model, batch)

    pushed, seen = threading.Event(), {}
    with Engine(make_model(), slow_loss, devices=["cpu"] * 2, mode="async", optimizer=AdamW(**OPT)) as engine:
        def on_signal(signum, frame):
            engine.close()
            seen["alive"] = [t.name for t in threading.enumerate() if t.name.startswith("pyengine-async-")]

        previous = signal.signal(signal.SIGUSR1, on_signal)
        sender = threading.Thread(target=lambda: pushed.wait(30) and os.kill(os.getpid(), signal.SIGUSR1))
        sender.start()
        try:
            with pytest.raises(RuntimeError, match="closed while fit"):
                engine.fit(make_batches(rng, 200, 8), callbacks=[lambda e, m: pushed.set()])
        finally:
            sender.join()
            signal.signal(signal.SIGUSR1, previous)
    assert seen == {"alive": []}, seen


def test_an_async_batch_schedule_is_not_asked_at_a_refresh(rng):
    """batch_schedule is asked about the version a worker pulls to take new mini-batches; every pull asked it,
    a refresh's too (which computes the same mini-batches again and ignored the answer): with max_staleness=0 and
    3 workers, 17 calls for 6 pushes and 8 refreshes. Now a push's pull asks it, and each worker's last pull, which
    finds the batches run out."""
    asked = []

    def schedule(version):
        asked.append(version)
        return 1

    def slow_loss(model, batch):
        time.sleep(0.005)
        return loss_fn(model, batch)

    with Engine(make_model(), slow_loss, devices=["cpu"] * 3, mode="async", optimizer=AdamW(**OPT), max_staleness=0,
                batch_schedule=schedule) as engine:
        engine.fit(make_batches(rng, 12, 8))
        stats = engine.stats()
    assert stats["pushes"] == 12 and stats["refreshes"] > 3, stats  # the premise: more refreshes than workers
    assert len(asked) <= stats["pushes"] + 3, (len(asked), stats)


class Logging(torch.nn.Module):
    """make_model's layers and a persistent buffer the forward resizes in place: a log of the batch sizes seen."""

    def __init__(self, seed=0):
        super().__init__()
        self.net = make_model(seed)
        self.register_buffer("log", torch.zeros(2))

    def forward(self, x):
        n = self.log.numel()
        with torch.no_grad():
            self.log.resize_(n + 1)
            self.log[n] = x.shape[0]
        return self.net(x)


def test_kept_buffer_copies_are_rewritten_in_place_and_made_anew_when_a_buffer_changes(rng):
    """Note [Buffer copies kept from step to step]: a take copies every buffer; the next take rewrites the same copy
    tensors (no clone) while the buffers are the same tensors of the same shapes; a buffer assigned a new tensor,
    one resized in place, and a None slot that now holds a tensor (a cache) each make fresh copies; put_back_saved
    puts every value back (and a reassigned module its old tensor)."""
    from pyengine.workers import KeptBufferCopies, put_back_saved

    model = torch.nn.Sequential(torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 5))
    model[1].register_buffer("cache", None, persistent=False)
    kept = KeptBufferCopies.of_modules([model])
    assert [(m is model[0] or m is model[1], k) for m, k in kept.slots] == [
        (True, "running_mean"), (True, "running_var"), (True, "num_batches_tracked"), (True, "cache")]

    def values():
        return {k: b.clone() for m, k in kept.slots if (b := m._buffers.get(k)) is not None}

    first = kept.take()
    assert [k for _, k, _, _ in first] == ["running_mean", "running_var", "num_batches_tracked"]
    before = values()
    model.train()(torch.randn(8, 5, generator=rng))  # the statistics move
    assert not torch.equal(model[0].running_mean, before["running_mean"])
    put_back_saved(first)
    assert all(torch.equal(v, values()[k]) for k, v in before.items())
    model(torch.randn(8, 5, generator=rng))
    second = kept.take()  # the same buffers: the copies rewritten, not made anew
    assert all(a[3] is b[3] for a, b in zip(first, second))
    assert all(torch.equal(c, b) for _, _, b, c in second)
    for change in ("assign", "resize", "cache"):
        held = kept.take()
        if change == "assign":
            old = model[0].running_mean
            model[0].running_mean = torch.full((5,), 7.0)
        elif change == "resize":
            model[0].running_var.resize_(6)
        else:
            model[1].cache = torch.ones(3)
        now = kept.take()
        assert all(a[3] is not b[3] for a, b in zip(held, now)), change
        assert all(torch.equal(c, b) for _, _, b, c in now), change
        assert len(now) == (4 if change == "cache" else 3)
        if change == "assign":
            model[0].running_mean = torch.zeros(5)  # a step that assigns again, then fails
            put_back_saved(now)
            assert model[0].running_mean is not old and torch.equal(model[0].running_mean, torch.full((5,), 7.0))
        if change == "resize":
            model[0].running_var.resize_(5)  # back to BatchNorm's shape for the forward of the next round
    cache = model[1].cache
    saved = kept.take()
    model[1].cache = torch.zeros(2)  # a step's forward makes another cache, then the step fails
    put_back_saved(saved)
    assert model[1].cache is cache and torch.equal(cache, torch.ones(3))


@pytest.mark.parametrize("mode,workers", [("hybrid", 2), ("hybrid", 1), ("sync", 1), ("async", 1)])
def test_a_failed_step_puts_back_a_buffer_resized_in_place(rng, mode, workers):
    """Note [A failed step leaves the buffers alone] with a buffer the forward resizes in place: putting it back
    raised ("the size of tensor a (3) must match the size of tensor b (2)") in place of the worker's error, and
    async's next pull failed on its copy. The failed step's WorkerError is raised, the buffer is as before it (its
    shape too), and the run goes on as one that never saw the failed batch."""
    batches = make_batches(rng, 3, 12)
    failing = {"on": False}
    loss_then_fail = loss_failing_while(failing)
    kw = dict(devices=["cpu"] * workers, optimizer=AdamW(**OPT))
    with Engine(Logging(), loss_then_fail, mode=mode, **kw) as engine, \
            Engine(Logging(), loss_fn, mode="sync" if mode == "async" else mode, **kw) as clean:
        engine.fit(batches[:1])
        clean.fit(batches[:1])
        before = engine.buffers_state_dict()["log"].clone()
        failing["on"] = True
        with pytest.raises(WorkerError, match="after the forward"):
            engine.fit(batches[1:2])
        failing["on"] = False
        assert torch.equal(engine.buffers_state_dict()["log"], before)
        engine.fit(batches[2:])
        clean.fit(batches[2:])
        assert torch.equal(engine.buffers_state_dict()["log"], clean.buffers_state_dict()["log"])
        seen = 12 // workers if mode == "hybrid" else 12  # worker 0's shard: the source's log
        assert engine.buffers_state_dict()["log"].tolist() == [0, 0, seen, seen]
        for name, value in clean.master_state_dict().items():
            assert torch.equal(engine.master_state_dict()[name], value), name


@pytest.mark.parametrize("whose", ["worker", "another-worker-first", "schedule"])
def test_an_async_worker_whose_buffers_cannot_be_put_back_still_fails_fit(rng, monkeypatch, whose):
    """An async worker's error was recorded only after its replica's buffers were put back: when that raised too
    (a sticky CUDA error in its stream's synchronize), the error died on the worker's thread and fit returned as if
    it had trained, with "gave no batch: nothing was trained". fit raises the worker's error (its loss's, or an
    lr_schedule's, raised as itself), which says the putting back failed too. When another worker failed first,
    fit raises that one's error, and the note goes on it, naming the buffers' source worker (it was put on the
    source's own error, which fit does not raise: lost, and this test failed when the other worker came first)."""
    roles = {}

    def loss(model, batch):  # with 2 workers: one of them fails first, the other once it has (by time)
        value = loss_fn(model, batch)
        source = model is roles["source"]
        if source == (whose == "another-worker-first"):
            time.sleep(0.5)
        raise RuntimeError(f"after the forward ({'source' if source else 'other'})")

    def schedule(step):
        if step >= 1:
            raise ValueError("the schedule says no")
        return 1.0

    # the schedule's error: on a lone worker, the buffers' source (whose buffers are put back)
    with Engine(make_bn_model(), loss if whose != "schedule" else loss_fn,
                devices=["cpu"] * (1 if whose == "schedule" else 2), mode="async", optimizer=AdamW(**OPT),
                lr_schedule=schedule if whose == "schedule" else None) as engine:
        roles["source"] = engine.workers[engine.buffer_source].replica

        def broken(saved):
            if saved is not None:
                raise RuntimeError("the device's stream failed")
        monkeypatch.setattr(engine, "_restore_source_buffers", broken)
        with pytest.raises(WorkerError if whose != "schedule" else ValueError,
                           match={"worker": r"after the forward \(source\)",
                                  "another-worker-first": r"after the forward \(other\)",
                                  "schedule": "the schedule says no"}[whose]) as caught:
            engine.fit(make_batches(rng, 6, 12))
        notes = [n for e in (caught.value, caught.value.__cause__) for n in getattr(e, "__notes__", [])]
        want = "putting back the buffers of its replica failed too: RuntimeError: the device's stream failed"
        if whose == "another-worker-first":
            want = (f"worker {engine.buffer_source}'s push failed too (RuntimeError: after the forward (source)), "
                    f"and " + want)
        assert len(notes) == 1 and notes[0].startswith(want), notes


def test_an_async_pull_that_fails_stops_the_run_before_releasing_the_mutex(rng, monkeypatch):
    """Note [The push that ends a run]: an error in an async worker's pull (its copy of the buffers, here) stopped
    the run only after the pull released the mutex, and workers waiting for it applied more pushes after the
    failure (5-9 of 4 workers' when the release and the stop were 30 ms apart; a profile hook widens that gap
    here). No push is applied after it."""
    def slow_loss(model, batch):
        time.sleep(0.01)
        return loss_fn(model, batch)

    with Engine(make_bn_model(), slow_loss, devices=["cpu"] * 4, mode="async", optimizer=AdamW(**OPT)) as engine:
        original, at_failure, calls = engine._snapshot_source_buffers, {}, {"n": 0}

        def snapshot(tasks):
            calls["n"] += 1
            if calls["n"] == 3:
                at_failure["version"] = engine.version
                raise RuntimeError("the snapshot failed")
            return original(tasks)
        monkeypatch.setattr(engine, "_snapshot_source_buffers", snapshot)

        def widen(frame, event, arg):  # the failing pull, leaving: the mutex is released by now
            if event == "return" and frame.f_code.co_name == "pull" and "at_failure" not in frame.f_locals \
                    and at_failure and threading.current_thread().name == "pyengine-async-0":
                time.sleep(0.05)
        threading.setprofile(widen)
        try:
            with pytest.raises(WorkerError, match="the snapshot failed"):
                engine.fit(make_batches(rng, 40, 12))
        finally:
            threading.setprofile(None)
        assert engine.version == at_failure["version"], (engine.version, at_failure)


@pytest.mark.parametrize("mode", ["hybrid", "sync"])
@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_a_step_stopped_on_the_calling_thread_leaves_the_buffers_alone(rng, mode, stop):
    """A lone CPU worker runs on the calling thread (Note [One CPU worker runs on the calling thread]). A
    KeyboardInterrupt (a program's own SIGINT handler) or SystemExit raised by its loss after the forward propagates
    as itself, and the buffers are those of the last complete step: they stayed one batch ahead."""
    batches = make_batches(rng, 3, 12)
    failing = {"on": False}

    def loss_then_stop(model, batch):
        loss = loss_fn(model, batch)
        if failing["on"]:
            raise stop()
        return loss

    kw = dict(devices=["cpu"], mode=mode, optimizer=AdamW(**OPT))
    with Engine(make_bn_model(), loss_then_stop, **kw) as engine, Engine(make_bn_model(), loss_fn, **kw) as clean:
        engine.fit(batches[:1])
        clean.fit(batches[:1])
        failing["on"] = True
        with pytest.raises(stop):
            engine.step(batches[1])
        failing["on"] = False
        engine.fit(batches[2:])
        clean.fit(batches[2:])
        for name, value in clean.buffers_state_dict().items():
            assert torch.equal(engine.buffers_state_dict()[name], value), name
        for name, value in clean.master_state_dict().items():
            assert torch.equal(engine.master_state_dict()[name], value), name


def assert_buffers_match(buffers, reference_model, rtol=1e-5):
    expected = dict(reference_model.named_buffers())
    assert sorted(buffers) == sorted(expected)
    for name, value in buffers.items():
        value = value.detach().cpu()  # replicas' buffers live on their (CUDA) devices
        if value.dtype == torch.int64:
            assert torch.equal(value, expected[name]), name
        else:
            torch.testing.assert_close(value.double(), expected[name].detach(), rtol=rtol, atol=rtol, msg=name)


def test_sync_buffers_follow_the_batches_like_sequential_training(rng, worker_device):
    model = make_bn_model()
    reference = TorchReference(model, **OPT)
    with Engine(model, loss_fn, devices=[worker_device] * 3, mode="sync", optimizer=AdamW(**OPT)) as engine:
        for b in make_batches(rng, 7, 16):
            engine.step(b)
            reference.step([b])
        assert_matches(engine, reference)
        assert_buffers_match(engine.buffers_state_dict(), reference.model)
        assert engine.buffers_state_dict()["1.num_batches_tracked"].item() == 7
        copied = make_bn_model(seed=5)
        engine.copy_to(copied)
        assert_buffers_match(dict(copied.named_buffers()), reference.model)


class CountingModel(torch.nn.Module):
    """make_model's layers and a non-persistent buffer the forward changes: a step counter that scales the output
    (a warm-up factor, say), kept out of the state_dict."""

    def __init__(self, seed=0):
        super().__init__()
        self.net = make_model(seed)
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.calls += 1
        return self.net(x) * (1 + self.calls / 4)


@pytest.mark.parametrize("mode,workers", [("hybrid", 2), ("sync", 3), ("async", 1)])
def test_a_non_persistent_buffer_trains_as_in_torch(rng, mode, workers):
    """Note [Buffers that are not saved]: a buffer registered with persistent=False was not shared: sync's workers
    each counted their own steps (the weights off torch's by 2e-2), hybrid's replicas drifted from worker 0's, and
    copy_to left the model's at its initial value. It follows the source as the persistent ones do; checkpoints
    hold the persistent ones only, as torch's state_dict does."""
    model, batches = CountingModel(), make_batches(rng, 5, 12)
    reference = TorchReference(model, **OPT)
    with Engine(model, loss_fn, devices=["cpu"] * workers, mode=mode, optimizer=AdamW(**OPT)) as engine:
        for b in batches:
            engine.step(b) if mode != "async" else engine.fit([b])
            reference.step([b])
        assert_matches(engine, reference)
        assert reference.model.calls.item() == 5
        copied = CountingModel(seed=5)
        engine.copy_to(copied)
        assert copied.calls.item() == 5
        if mode == "hybrid":  # every step starts from worker 0's: each replica counted every step
            assert [w.replica.calls.item() for w in engine.workers] == [5, 5]
        saved = engine.state_dict()
        assert "calls" not in saved["buffers"] and "calls" not in engine.buffers_state_dict()
    with Engine(CountingModel(seed=3), loss_fn, devices=["cpu"] * workers, mode=mode, optimizer=AdamW(**OPT)) as other:
        other.load_state_dict(saved)  # the counter is the model's own, as torch's load_state_dict leaves it
        copied = CountingModel(seed=5)
        other.copy_to(copied)
        assert copied.calls.item() == 0
        for name, value in engine.master_state_dict().items():
            assert torch.equal(copied.state_dict()[name], value), name


class Cached(torch.nn.Module):
    """make_model's layers with two buffers (non-persistent, or ``persistent``) of the kinds that cannot take values
    in place: a cache the forward replaces at the batch's size (rotary tables, say) and an expanded constant mask."""

    def __init__(self, seed=0, persistent=False):
        super().__init__()
        self.net = make_model(seed)
        self.register_buffer("cache", torch.zeros(1), persistent=persistent)
        self.register_buffer("mask", torch.ones(1, 3).expand(4, 3), persistent=persistent)

    def forward(self, x):
        if self.cache.numel() < x.shape[0]:
            self.cache = torch.arange(float(x.shape[0]))
        return self.net(x) * self.mask[0] + 0 * self.cache[:1]


@pytest.mark.parametrize("persistent", [False, True], ids=["non-persistent", "persistent"])
@pytest.mark.parametrize("mode,workers", [("hybrid", 2), ("sync", 2), ("sync", 1)])
def test_caches_and_expanded_masks_follow_by_replacement(rng, mode, workers, persistent):
    """A buffer the forward replaced at a new size could not be copied into the other replicas' (sync failed every
    step after the first: "the size of tensor a (2) must match"), nor an expanded one written (hybrid and sync:
    "more than one element of the written-to tensor refers to a single memory location"). Such a buffer now
    takes a copy of the source's; a failed step leaves the expanded one alone; copy_to replaces the model's.
    Persistent ones too (they failed every step of hybrid, and copy_to and load_state_dict into an expanded one);
    a model whose persistent cache has another size is refused by copy_to, as by torch's load_state_dict."""
    failing = {"on": False}
    loss = loss_failing_while(failing)

    model = Cached(persistent=persistent)
    reference = TorchReference(model, **OPT)
    batches = [make_batches(rng, 1, size)[0] for size in (8, 12, 16, 6)]
    with Engine(model, loss, devices=["cpu"] * workers, mode=mode, optimizer=AdamW(**OPT)) as engine:
        for i, b in enumerate(batches):
            if i == 2:
                failing["on"] = True
                with pytest.raises((WorkerError, RuntimeError), match="after the forward"):
                    engine.step(b)
                failing["on"] = False
            engine.step(b)
            reference.step([b])
        assert_matches(engine, reference)
        size = engine.buffers_state_dict()["cache"].numel() if persistent else 1
        assert size in ((8, 16) if persistent else (1,))
        copied = Cached(seed=5, persistent=persistent)
        if persistent:
            with pytest.raises(ValueError, match=r"reshapes the engine's buffers or frozen parameters: 'cache'"):
                engine.copy_to(copied)
            copied.cache = torch.zeros(size)  # a model of the engine's shapes takes them
        engine.copy_to(copied)
        assert copied.cache.numel() in (8, 16) and torch.equal(copied.mask, torch.ones(4, 3))
        for name, value in engine.master_state_dict().items():
            assert torch.equal(copied.state_dict()[name], value), name
        saved = engine.state_dict()
        other_model = Cached(seed=3, persistent=persistent)
        other_model.cache = torch.zeros(size)
        with Engine(other_model, loss, devices=["cpu"] * workers, mode=mode, optimizer=AdamW(**OPT)) as other:
            other.load_state_dict(saved)  # into replicas whose mask is expanded
            if persistent:
                for name, value in saved["buffers"].items():
                    assert torch.equal(other.buffers_state_dict()[name], value), name
            engine.step(batches[0])
            other.step(batches[0])
            for name, value in engine.master_state_dict().items():
                assert torch.equal(other.master_state_dict()[name], value), name


@pytest.mark.parametrize("mode,workers", [("hybrid", 2), ("sync", 1)])
def test_a_failed_step_puts_back_a_non_persistent_buffer(rng, mode, workers):
    """A failed step (every worker's forward ran, then a loss raised) counted its batch in a non-persistent buffer
    of the source replica, and the run went on from there (Note [A failed step leaves the buffers alone] covered the
    persistent ones only): it now goes on bit-identically to a run that never saw the failed batch."""
    batches = make_batches(rng, 3, 12)
    failing = {"on": False}
    loss_then_fail = loss_failing_while(failing)

    kw = dict(devices=["cpu"] * workers, mode=mode, optimizer=AdamW(**OPT))
    with Engine(CountingModel(), loss_then_fail, **kw) as engine, Engine(CountingModel(), loss_fn, **kw) as clean:
        engine.step(batches[0])
        clean.step(batches[0])
        failing["on"] = True
        with pytest.raises((WorkerError, RuntimeError), match="after the forward"):
            engine.step(batches[1])
        failing["on"] = False
        engine.step(batches[2])
        clean.step(batches[2])
        for name, value in clean.master_state_dict().items():
            assert torch.equal(engine.master_state_dict()[name], value), name
        counted = [CountingModel(), CountingModel()]
        engine.copy_to(counted[0])
        clean.copy_to(counted[1])
        assert counted[0].calls.item() == counted[1].calls.item() == 2


def test_copy_to_a_model_without_the_engines_buffers_writes_nothing(rng):
    """copy_to wrote the weights, then raised a bare KeyError on the first buffer the model lacks."""
    with Engine(make_bn_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as engine:
        engine.step(make_batches(rng, 1, 8)[0])
        target = make_bn_model(seed=5)
        target[1] = torch.nn.BatchNorm1d(24, track_running_stats=False)  # the same parameters, no statistics
        before = {k: v.clone() for k, v in target.state_dict().items()}
        with pytest.raises(ValueError, match=r"copy_to: the model lacks or reshapes the engine's buffers or frozen "
                                             r"parameters: '1.running_mean' \(the engine's \(24,\); model: none\)"):
            engine.copy_to(target)
        assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("mode", ["hybrid", "pipeline"])
def test_copy_to_writes_the_frozen_parameters_the_engine_trained_with(rng, mode):
    """copy_to into a model built from another seed: its frozen layer is the engine's (it kept its own, so the
    exported model was not the one trained), and a model whose frozen layer has another shape is refused before
    anything is written. A model whose frozen layer was made trainable since takes it too (it was refused)."""
    def model(seed):
        net = make_model(seed=seed)
        net[0].requires_grad_(False)
        return net

    with Engine(model(0), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT), mode=mode) as engine:
        batch = make_batches(rng, 1, 8)[0]
        engine.step(batch)
        trained = model(0)
        engine.copy_to(trained)
        target = model(5)
        engine.copy_to(target)
        for name, value in trained.state_dict().items():
            assert torch.equal(target.state_dict()[name], value), name
        assert torch.equal(target[0].weight, model(0)[0].weight)
        other = model(5)
        other[0] = torch.nn.Linear(10, 24, bias=False).requires_grad_(False)
        before = {k: v.clone() for k, v in other.state_dict().items()}
        with pytest.raises(ValueError, match=r"lacks or reshapes the engine's buffers or frozen parameters: '0.bias' "
                                             r"\(the engine's \(24,\); model: none\)"):
            engine.copy_to(other)
        assert all(torch.equal(v, other.state_dict()[k]) for k, v in before.items())
        unfrozen = model(5).requires_grad_(True)  # its frozen layer made trainable since (progressive unfreezing):
        engine.copy_to(unfrozen)  # refused as "trainable parameters the store does not hold"
        for name, value in trained.state_dict().items():
            assert torch.equal(unfrozen.state_dict()[name], value), name
        assert all(p.requires_grad for p in unfrozen.parameters())
        extra = torch.nn.Sequential(*model(5), torch.nn.Linear(3, 3))  # a trainable layer the engine never had
        with pytest.raises(ValueError, match=r"trainable parameters the store does not hold: \['3.weight', "
                                             r"'3.bias'\]"):
            engine.copy_to(extra)


def test_copy_to_keeps_the_model_s_dtypes(rng):
    """copy_to into a float64 copy of the model: its BatchNorm statistics were replaced by float32 copies (the
    parameters converted), so its forward failed ("expected scalar type Double but found Float"). Each takes the
    engine's values in its own dtype."""
    with Engine(make_bn_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as engine:
        engine.step(make_batches(rng, 1, 8)[0])
        doubled = make_bn_model(seed=5).double()
        engine.copy_to(doubled)
        assert all(v.dtype == torch.float64 for v in doubled.state_dict().values() if v.is_floating_point())
        for name, value in engine.buffers_state_dict().items():
            assert torch.equal(doubled.state_dict()[name], value.to(doubled.state_dict()[name].dtype)), name
        doubled.eval()(make_batches(rng, 1, 4)[0][0].double())


def test_hybrid_buffers_come_from_worker_0_and_resume(rng, worker_device):
    """As DDP's broadcast_buffers: every step starts from worker 0's running statistics, which it updates on its own
    shard. Reference: a float64 copy that sees shard 0 with the master weights of the step."""
    model = make_bn_model()
    stats = copy.deepcopy(model).double()
    batches = make_batches(rng, 6, 20)
    with Engine(model, loss_fn, devices=[worker_device] * 2, optimizer=AdamW(**OPT)) as engine:
        for b in batches:
            with torch.no_grad():
                for name, p in stats.named_parameters():
                    p.copy_(engine.master_state_dict()[name])
                worker1 = copy.deepcopy(stats)  # worker 1 starts from worker 0's statistics, sees shard 1
                worker1(b[0][10:].double())
                stats(b[0][:10].double())
            engine.step(b)
            assert_buffers_match(dict(engine.workers[1].replica.named_buffers()), worker1)
        assert_buffers_match(engine.buffers_state_dict(), stats)
        saved = copy.deepcopy(engine.state_dict())
    with Engine(make_bn_model(seed=3), loss_fn, devices=[worker_device] * 2, optimizer=AdamW(**OPT)) as engine:
        engine.load_state_dict(saved)
        for worker in engine.workers:
            assert_buffers_match({k: v for k, v in worker.replica.named_buffers()}, stats)
        bad = copy.deepcopy(saved)
        bad["buffers"]["1.running_mean"] = torch.zeros(5)
        with pytest.raises(ValueError, match="buffer '1.running_mean'"):
            engine.load_state_dict(bad)


@pytest.mark.parametrize("mode", ["hybrid", "async"])
def test_a_callback_can_stop_fit(rng, mode):
    def stop_at_third(engine, metrics):
        if len(engine.history) == 3:
            engine.stop()

    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT)) as engine:
        history = engine.fit(make_batches(rng, 20, 8), callbacks=[stop_at_third])
        assert len(history) == 3 == engine.stats()["pushes" if mode == "async" else "steps"]
        assert len(engine.fit(make_batches(rng, 4, 8))) == 4, "the next fit starts afresh"


def test_async_fit_steps_counts_this_calls_pushes(rng):
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode="async", optimizer=AdamW(**OPT)) as engine:
        assert len(engine.fit(make_batches(rng, 40, 8), steps=5)) == 5
        assert len(engine.fit(make_batches(rng, 40, 8), steps=4)) == 4
        assert engine.stats()["pushes"] == 9 == engine.stats()["applied_updates"]


def test_pipeline_buffers_match_single_device_and_resume(rng, worker_device):
    """Two stages, one micro-batch: the BatchNorm layer sees the whole batch, as in single-device training."""
    model = make_bn_model()
    reference = TorchReference(model, **OPT)
    batches = make_batches(rng, 5, 16)
    with Engine(model, loss_fn, devices=[worker_device] * 2, mode="pipeline", stages=2, optimizer=AdamW(**OPT)) as engine:
        for b in batches:
            engine.step(b)
            reference.step([b])
        assert_matches(engine, reference)
        assert_buffers_match(engine.buffers_state_dict(), reference.model)
        saved = copy.deepcopy(engine.state_dict())
    with Engine(make_bn_model(seed=4), loss_fn, devices=[worker_device] * 2, mode="pipeline", stages=2,
                optimizer=AdamW(**OPT)) as engine:
        engine.load_state_dict(saved)  # before the first step: the stages are built from the loaded layers
        assert_buffers_match(engine.buffers_state_dict(), reference.model)


class _TwiceUsed(torch.nn.Module):
    """A layer applied twice in one forward (a weight used twice: what autocast's cast cache is for)."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = torch.nn.Linear(7, 17), torch.nn.Linear(17, 17), torch.nn.Linear(17, 7)

    def forward(self, x):
        z = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return self.out(torch.tanh(self.mid(z)))


@pytest.mark.parametrize("mode", ["hybrid", "pipeline"])
def test_autocast_with_a_weight_used_twice_is_reproducible(mode):
    """torch's autocast cast cache is one map for the process, emptied whenever any thread leaves its outermost
    autocast region: concurrent workers (or stages) emptied it under each other's forward, so a weight used twice
    was cast once or twice depending on timing, and its two uses' gradients were summed in bfloat16 or in float32:
    the same seed and data gave different weights from run to run (8 results in 12 runs). The engine's autocast
    regions do without the cache (Note [Autocast without its cast cache] in pyengine.workers)."""
    def run():
        torch.manual_seed(0)
        model = _TwiceUsed() if mode == "hybrid" else torch.nn.Sequential(
            torch.nn.Linear(7, 7), torch.nn.Tanh(), _TwiceUsed(), torch.nn.Linear(7, 7))
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(24, 7, generator=g), torch.randint(0, 7, (24,), generator=g)) for _ in range(4)]
        options = dict(devices=["cpu"] * 3, microbatches=2) if mode == "hybrid" else \
            dict(devices=["cpu"] * 2, mode="pipeline", microbatches=4)
        with Engine(model, loss_fn, autocast=torch.bfloat16, optimizer=AdamW(lr=1e-2), **options) as engine:
            for batch in batches:
                engine.step(batch)
            return engine.master_state_dict()

    first = run()
    for _ in range(7):
        again = run()
        assert all(torch.equal(first[k], again[k]) for k in first), \
            max((first[k] - again[k]).abs().max().item() for k in first)


@pytest.mark.parametrize("mode", ["hybrid", "sync", "async", "pipeline"])
def test_keep_history_bounds_the_history_and_fit_counts_every_step(rng, mode):
    seen = []
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT),
                keep_history=3) as engine:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # fit counts its steps, not the history's length: no "ran out" warning
            returned = engine.fit(make_batches(rng, 10, 8), steps=10, callbacks=[lambda e, m: seen.append(m)])
        assert len(seen) == 10, "callbacks see every step"
        assert engine.history == seen[-3:] and returned == seen[-3:]
        assert [m["step"] for m in returned] == [8, 9, 10]
        returned = engine.fit(make_batches(rng, 2, 8))
        assert [m["step"] for m in returned] == [11, 12] and returned == engine.history[-2:]
        assert len(engine.history) == 3
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT),
                keep_history=0) as engine:
        assert engine.fit(make_batches(rng, 4, 8), steps=4) == [] == engine.history
        assert engine.stats()["pushes" if mode == "async" else "steps"] == 4


@pytest.mark.parametrize("mode", ["hybrid", "async"])
def test_a_callback_may_clear_the_history(rng, mode):
    """fit counted its steps by the history's length: a callback emptying it made fit warn that the batches ran out
    and return nothing. fit returns its steps' metrics whatever the history holds."""
    def clear(engine, metrics):
        if metrics["step"] == 4:
            engine.history.clear()

    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT)) as engine:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            returned = engine.fit(make_batches(rng, 6, 8), steps=6, callbacks=[clear])
        assert [m["step"] for m in engine.history] == [5, 6]
    assert [m["step"] for m in returned] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("mode", ["hybrid", "sync", "pipeline"])
def test_fit_returns_its_own_steps_while_another_thread_steps(rng, mode):
    """fit returned every step recorded while it ran, other threads' step() calls included (35-40 for its 20)."""
    mine, others = make_batches(rng, 20, 8), make_batches(rng, 20, 4)  # told apart by their sizes
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT)) as engine:
        other = threading.Thread(target=lambda: [engine.step(b) for b in others])
        other.start()
        returned = engine.fit(mine, steps=20)
        other.join(120)
        assert engine.stats()["steps"] == 40
    assert [m["samples"] for m in returned] == [8] * 20


@pytest.mark.parametrize("bad", [-1, 1.5, True, "all"])
def test_keep_history_must_be_a_count(bad):
    with pytest.raises(ValueError, match="keep_history must be an integer >= 0 or None"):
        Engine(make_model(), loss_fn, devices=["cpu"], keep_history=bad)


@pytest.mark.parametrize("mode", ["hybrid", "sync", "pipeline"])
def test_steps_from_several_threads_run_one_after_another(rng, mode):
    """Steps run one at a time and their updates under the engine's mutex (Note [A step's update under the mutex]):
    two threads stepping at once ran two steps on the same streamers at once (a WorkerError, then "free(): corrupted
    unsorted chunks" and the process gone); a state read from a third thread lies between two steps. Every step uses
    the same batch, so any order gives the weights of 40 steps in a row."""
    batch = make_batches(rng, 1, 16)[0]
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT)) as reference:
        for _ in range(40):
            reference.step(batch)
        expected = reference.master_state_dict()
    errors, versions = [], []
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT)) as engine:
        def steps():
            try:
                for _ in range(20):
                    engine.step(batch)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        def reads():
            try:
                while any(t.is_alive() for t in threads[:2]):
                    state = engine.state_dict()
                    # steps are counted before the update; none yet before the first step
                    versions.append((state["version"], state["counters"].get("steps", 0)))
            except Exception as exc:  # noqa: BLE001 - reported below (a reader that died checked nothing)
                errors.append(exc)

        threads = [threading.Thread(target=steps), threading.Thread(target=steps), threading.Thread(target=reads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert engine.stats()["steps"] == 40 == engine.version
        assert versions and all(v == s for v, s in versions), f"a state read during a step mixed two steps: {versions}"
        for name, value in engine.master_state_dict().items():
            assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize("action", ["close", "exit"])
@pytest.mark.parametrize("mode", ["hybrid", "sync", "async", "pipeline"])
def test_an_engine_in_a_forked_process_refuses_to_train_and_exits_cleanly(mode, action):
    """Note [An engine in a forked process]: in a child forked after the engine had trained, a step or fit waited for
    the parent's worker threads for good, and close() or the exit crashed (joining the copy thread of another
    process) or hung. The child is refused with a clear error, reads the state, closes or exits cleanly; the parent
    trains on."""
    import subprocess
    import sys

    job = os.path.join(os.path.dirname(__file__), "fork_job.py")
    run = subprocess.run([sys.executable, job, mode, action], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    updates = 2 if mode == "async" else 1  # what one train() call applies
    assert run.stdout.splitlines() == [
        "child: engine refused, True", "child: transfer refused, True", f"child: state version {updates}",
        "parent: child exit 0", f"parent: updates {2 * updates}"], (run.returncode, run.stdout, run.stderr[-2000:])
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("mode", ["hybrid", "sync", "pipeline"])
def test_a_loss_fn_on_a_worker_thread_may_read_the_state(rng, mode):
    """Note [A step's update under the mutex]: with the whole step under the engine's mutex, a loss_fn (run on a
    worker or stage thread) that read engine.stats() waited for the step, which waited for it: a deadlock."""
    seen = []

    def annealed(model, batch):
        seen.append(engine.stats()["steps"])
        return loss_fn(model, batch)

    options = dict(stages=2, microbatches=2) if mode == "pipeline" else {}
    engine = Engine(make_model(), annealed, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT), **options)
    try:
        done = threading.Event()
        runner = threading.Thread(target=lambda: (engine.fit(make_batches(rng, 3, 8)), done.set()), daemon=True)
        runner.start()
        assert done.wait(60), "the step waited for its own loss_fn"
    finally:
        if done.is_set():
            engine.close()
    assert engine.stats()["steps"] == 3 and set(seen) == {0, 1, 2}


@pytest.mark.parametrize("mode", ["hybrid", "sync", "pipeline"])
def test_a_fork_while_another_thread_steps_gives_the_child_a_readable_state(mode):
    """Note [An engine in a forked process]: the child got the engine's mutex as held by the stepping thread, which
    it does not have: its state_dict() hung. The fork now waits for the update in progress; the child's locks are
    its own."""
    import subprocess
    import sys

    job = os.path.join(os.path.dirname(__file__), "fork_job.py")
    run = subprocess.run([sys.executable, job, mode, "stepping"], capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.stdout.splitlines() == ["parent: child exit 0"] * 3, (run.returncode, run.stdout, run.stderr[-2000:])
    assert run.returncode == 0, run.stderr[-2000:]


def step_with_a_call_inside(engine, batch, devices, inside, go, call) -> None:
    """One step on ``batch``; with several workers on another thread, ``call()`` made from here once a worker has
    set ``inside`` (and waits for ``go``). With one CPU worker the step's own code makes the call."""
    if devices == 1:
        engine.step(batch)
        return
    stepping = threading.Thread(target=engine.step, args=(batch,))
    stepping.start()
    assert inside.wait(30)
    call()
    go.set()
    stepping.join(30)
    assert not stepping.is_alive()


@pytest.mark.parametrize("mode", ["hybrid", "sync"])
@pytest.mark.parametrize("devices", [2, 1], ids=["threads", "inline"])
def test_load_state_dict_is_refused_while_a_step_runs(rng, mode, devices):
    """A load while a step's workers compute (from another thread, or from the step's own loss_fn, which runs on
    the calling thread with one CPU worker) would have the step apply a gradient of the old weights onto the loaded
    ones: it is a RuntimeError that says to load between steps, and the step ends as if no load had been tried.
    Between steps (a fit callback) the load works."""
    batches = make_batches(rng, 3, 12)
    inside, go, errors = threading.Event(), threading.Event(), []
    hold = {"on": False}

    def holding_loss(model, batch):
        if hold["on"]:
            if devices == 1:
                try:
                    engine.load_state_dict(saved)
                except RuntimeError as e:
                    errors.append(e)
            else:
                inside.set()
                go.wait(30)
        return loss_fn(model, batch)

    with Engine(make_model(), holding_loss, devices=["cpu"] * devices, mode=mode, optimizer=AdamW(**OPT)) as engine, \
            Engine(make_model(), loss_fn, devices=["cpu"] * devices, mode=mode, optimizer=AdamW(**OPT)) as clean:
        for e in (engine, clean):
            e.step(batches[0])
        saved = engine.state_dict()
        hold["on"] = True

        def load():
            try:
                engine.load_state_dict(saved)
            except RuntimeError as e:
                errors.append(e)

        step_with_a_call_inside(engine, batches[1], devices, inside, go, load)
        assert errors and all("load_state_dict while a step is running" in str(e) for e in errors), errors
        hold["on"] = False
        clean.step(batches[1])
        assert engine.version == clean.version == 2
        for (name, a), b in zip(engine.master_state_dict().items(), clean.master_state_dict().values()):
            assert torch.equal(a, b), name
        engine.fit([batches[2]], callbacks=[lambda e, metrics: e.load_state_dict(saved)])  # between steps: loads
        assert engine.version == 1
        for name, value in saved["master"].items():
            assert torch.equal(engine.master_state_dict()[name], value), name


@pytest.mark.parametrize("call", ["close", "step", "fit"])
@pytest.mark.parametrize("mode,devices", [("hybrid", 2), ("hybrid", 1), ("sync", 2), ("pipeline", 2)],
                         ids=["hybrid-threads", "hybrid-inline", "sync", "pipeline"])
def test_close_from_inside_a_step_is_refused_and_the_step_completes(rng, mode, devices, call):
    """close(), step() or fit() from a step's own loss_fn (on a worker or stage thread: waiting for the step to end
    would wait for itself, a deadlock; on the calling thread with one CPU worker: the step would go on on stopped
    workers, or a second step would nest in it, both counted) is a RuntimeError that says to call it after step()
    returns; the step completes as if nothing had been tried, and the engine goes on until closed from outside."""
    batches = make_batches(rng, 3, 12)
    errors, hold = [], {"on": False}
    options = dict(stages=2, microbatches=2) if mode == "pipeline" else {}
    inner = {"close": lambda: engine.close(), "step": lambda: engine.step(batches[0]),
             "fit": lambda: engine.fit([batches[0]])}[call]

    def closing_loss(model, batch):
        if hold["on"]:
            try:
                inner()
            except RuntimeError as e:
                errors.append(e)
        return loss_fn(model, batch)

    engine = Engine(make_model(), closing_loss, devices=["cpu"] * devices, mode=mode, optimizer=AdamW(**OPT),
                    pin=False, **options)
    clean = Engine(make_model(), loss_fn, devices=["cpu"] * devices, mode=mode, optimizer=AdamW(**OPT), pin=False,
                   **options)
    try:
        for e in (engine, clean):
            e.step(batches[0])
        hold["on"] = True
        stepping = threading.Thread(target=engine.step, args=(batches[1],), daemon=True)
        stepping.start()
        stepping.join(60)
        assert not stepping.is_alive(), f"{call}() from inside the step deadlocked"
        assert errors and all(f"{call}() from inside a step" in str(e) for e in errors), errors
        hold["on"] = False
        clean.step(batches[1])
        engine.step(batches[2])
        clean.step(batches[2])
        assert engine.version == clean.version == 3
        for (name, a), b in zip(engine.master_state_dict().items(), clean.master_state_dict().values()):
            assert torch.equal(a, b), name
    finally:
        clean.close()
        if not hold["on"]:
            engine.close()


class _Noise(torch.nn.Module):
    """Adds noise drawn from torch's generator (a random module: with G > 1 its forward swaps the worker's own
    generator into torch's). ``pause``, when set, is called inside that forward."""

    pause = None

    def forward(self, x):
        if _Noise.pause is not None:
            _Noise.pause()
        return x + 0.01 * torch.randn_like(x)


@pytest.mark.parametrize("devices", [2, 1], ids=["threads", "inline"])
def test_a_state_read_while_a_step_computes_is_the_last_steps(rng, devices):
    """state_dict() while a step's workers compute (from another thread while a worker waits inside its random
    module's forward, after BatchNorm; with one CPU worker, from that forward itself) is the state of the last
    complete step: its weights and counters (the mutex), and also the source replica's BatchNorm statistics, which
    the step's forward already moved, and torch's generator, which a lone worker's draws advance and a worker's
    random module has swapped its own generator into. Both used to come from the running step. After the step,
    the state is the step's."""
    batches = make_batches(rng, 2, 12)
    inside, go, mid = threading.Event(), threading.Event(), {}

    def pause():
        if devices == 1:
            torch.randn(3)  # the lone worker's draws move torch's generator
            mid["state"] = engine.state_dict()
        elif not inside.is_set():
            inside.set()
            go.wait(30)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.BatchNorm1d(24), _Noise(), torch.nn.Linear(24, 3))
    with Engine(model, loss_fn, devices=["cpu"] * devices, optimizer=AdamW(**OPT), random_modules=(_Noise,)) \
            as engine:
        engine.step(batches[0])
        before = engine.state_dict()
        _Noise.pause = pause
        try:
            step_with_a_call_inside(engine, batches[1], devices, inside, go,
                                    lambda: mid.update(state=engine.state_dict()))
        finally:
            _Noise.pause = None
        after = engine.state_dict()
    state = mid["state"]
    assert state["version"] == 1 and after["version"] == 2
    for key in ("master", "buffers"):
        for name, value in before[key].items():
            assert torch.equal(state[key][name], value), (key, name)
    assert torch.equal(state["rng"], before["rng"])
    assert not torch.equal(after["buffers"]["1.running_mean"], before["buffers"]["1.running_mean"])
    if devices == 1:  # the lone worker draws from torch's generator: the step moved it
        assert not torch.equal(after["rng"], before["rng"])


def test_a_state_of_another_mode_goes_on_counting(rng):
    """Note [A state of another mode]: a hybrid state loaded into an async engine left its pushes at 0 (a resumed
    async run counted pushes from 0 again, below applied + skipped + raised, and drew the first steps' random
    numbers again), and the other way round; with no word that the modes differed."""
    batches = make_batches(rng, 5, 8)
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, optimizer=AdamW(**OPT)) as hybrid:
        hybrid.fit(batches[:3])
        state = hybrid.state_dict()
    with Engine(make_model(seed=3), loss_fn, devices=["cpu"], mode="async", optimizer=AdamW(**OPT)) as engine:
        with pytest.warns(UserWarning, match=r"saved by a mode='hybrid' engine; this one is mode='async': .* and its "
                                             r"steps \(3\) go on as this engine's pushes"):
            engine.load_state_dict(state)
        assert engine.version == 3
        assert all(torch.equal(v, state["master"][k]) for k, v in engine.master_state_dict().items())
        history = engine.fit(batches[3:])
        stats = engine.stats()
        assert [m["step"] for m in history] == [4, 5]
        assert stats["pushes"] == 5 == stats["applied_updates"] + stats["skipped_steps"] + stats["raised_steps"]
        state = engine.state_dict()
    for mode, devices in (("hybrid", ["cpu"] * 2), ("sync", ["cpu"] * 2)):
        with Engine(make_model(), loss_fn, devices=devices, mode=mode, optimizer=AdamW(**OPT)) as engine:
            with pytest.warns(UserWarning, match=rf"saved by a mode='async' engine; this one is mode='{mode}': .* its "
                                                 r"pushes \(5\) go on as this engine's steps"):
                engine.load_state_dict(state)
            assert engine.fit(batches[:1])[0]["step"] == 6
            assert engine.stats()["steps"] == 6 == engine.stats()["applied_updates"]
            mine = engine.state_dict()
    with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode="hybrid", optimizer=AdamW(**OPT)) as engine:
        with pytest.warns(UserWarning, match=r"saved by a mode='sync' engine; this one is mode='hybrid': its "
                                             r"weights, optimizer state and version are taken$"):
            engine.load_state_dict(mine)  # the same counter: only the word
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            engine.load_state_dict(engine.state_dict())  # its own mode: no word
        before = engine.state_dict()
        for bad in ("all", None, 3):
            with pytest.raises(ValueError, match=r"the state's mode must be one of \('hybrid', 'sync', 'async', "):
                engine.load_state_dict({**before, "mode": bad})
        assert engine.stats()["steps"] == 6 and engine.version == 6


@pytest.mark.parametrize("mode,workers", [("hybrid", 1), ("hybrid", 2), ("sync", 2)])
def test_a_step_failing_inside_its_update_refuses_the_next_until_a_state_is_loaded(rng, mode, workers):
    """Note [A step that fails inside its update]: hybrid copies each bucket back as soon as it is updated; a copy
    back that raised left the later buckets un-updated and a replica with old weights, and the next step trained on
    them silently (it differed from an uninterrupted run's). Now the next step (and fit) is refused, naming the
    error; once a state saved before is loaded, training goes on and equals the uninterrupted run bit for bit."""
    batches = make_batches(rng, 3, 16)
    options = dict(devices=["cpu"] * workers, mode=mode, optimizer=AdamW(**OPT), pin=False, **TINY_BUCKETS)
    with Engine(make_model(), loss_fn, **options) as clean:
        for b in batches:
            clean.step(b)
        want = clean.master_state_dict()
    with Engine(make_model(), loss_fn, **options) as engine:
        assert len(engine.workers[0].streamer.buckets) >= 3
        engine.step(batches[0])
        saved = engine.state_dict()
        # the second bucket's copy back (hybrid), or the update itself (sync: one call; its copy back is the next
        # step's pull)
        owner, name, fail_at = ((engine.workers[-1].streamer, "copy_back", 2) if mode == "hybrid" else
                                (engine, "update_range", 1))
        real, calls = getattr(owner, name), []

        def failing(*args, **kwargs):
            calls.append(None)
            if len(calls) == fail_at:
                raise RuntimeError("the copy failed")
            return real(*args, **kwargs)

        setattr(owner, name, failing)
        with pytest.raises(RuntimeError, match="the copy failed"):
            engine.step(batches[1])
        setattr(owner, name, real)
        refused = r"step 2 failed inside its update \(RuntimeError: the copy failed\): .*load a state to go on"
        with pytest.raises(RuntimeError, match=refused):
            engine.step(batches[1])
        with pytest.raises(RuntimeError, match=refused):
            engine.fit([batches[1]])
        assert engine.stats()["steps"] == 2 and engine.state_dict()["version"] == 2  # readable, as it is
        engine.load_state_dict(saved)
        for b in batches[1:]:
            engine.step(b)
        got = engine.master_state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
