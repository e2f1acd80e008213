"""Pipeline mode against references it does not share code with: torch.optim on one copy of the whole model
(float64) for the weights, a unit-time simulation for the schedules, brute force for the balancer, and layers that
sleep for fixed times for the bubble fraction (busy times under control on a noisy 2-core machine)."""
import collections
import contextlib
import copy
import gc
import itertools
import json
import math
import os
import pickle
import sys
import threading
import time
import weakref

import pytest
import torch

from pyengine import AdamW, Engine, LossScaler, StageError, WorkerError
from pyengine import pipeline as pipeline_module, pipeline_distributed
from pyengine.distributed import DistributedError
from pyengine.pipeline import partition, schedule_actions, split_layers

from conftest import loss_fn, make_batches
from test_scaler import GradScalerReference, assert_close_to, poisoned, split

pytestmark = pytest.mark.timeout(60)

# eps = 1e-3 for the reason given in tests/test_engine.py: fp32 engine vs fp64 reference stays bounded per element.
OPT = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.01)
FP16_SCALER = dict(init_scale=2.0 ** 24, growth_interval=3)


def fp16_batches(seed):
    return poisoned(make_batches(torch.Generator().manual_seed(seed + 2), 12, 12), 7)


def make_model(seed=0, d_in=10, hidden=16, d_out=3, blocks=3, dropout=0.0):
    torch.manual_seed(seed)
    drop = [torch.nn.Dropout(dropout)] if dropout else []
    layers = [torch.nn.Linear(d_in, hidden), torch.nn.Tanh(), *drop]
    for _ in range(blocks - 1):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.Tanh(), *drop]
    return torch.nn.Sequential(*layers, torch.nn.Linear(hidden, d_out))


class TorchReference:
    """The whole model on one device in float64, one torch.optim.AdamW step per full batch."""

    def __init__(self, model):
        self.model = copy.deepcopy(model).double()
        self.opt = torch.optim.AdamW(self.model.parameters(), foreach=False, **OPT)

    def step(self, batch, clip=None):
        x, y = batch
        self.opt.zero_grad()
        loss = loss_fn(self.model, (x.double(), y))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.opt.step()
        return loss.item()


def assert_matches(engine, reference, rtol=1e-5):
    master = engine.master_state_dict()
    for name, p in reference.model.named_parameters():
        scale = p.detach().abs().max().item() if p.numel() else 0.0
        torch.testing.assert_close(master[name].double(), p.detach(), rtol=rtol, atol=rtol * scale, msg=name)


def pipeline(model, devices, **options):
    return Engine(model, loss_fn, devices=devices, mode="pipeline", optimizer=AdamW(**OPT), **options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stages_of_a_low_precision_model_get_the_master_weights_rounded(worker_device, dtype):
    """bfloat16/float16 stages pull the float32 master weights rounded as torch rounds them: the store's shadow of
    their dtype, refreshed after a write of the master weights (Note [The shadow follows the master weights])."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(dtype)
    with pipeline(model, [worker_device] * 2, stages=2, microbatches=2) as engine:
        assert engine.store.shadow is not None and engine.store.shadow.dtype == dtype
        engine.store.param.copy_(torch.randn(engine.store.numel))  # new weights: every stage must change
        engine.store.refresh_shadow()
        stages = [stage for row in engine.pipeline.stages for stage in row]
        for stage in stages:
            stage.pull()
        if worker_device != "cpu":
            torch.cuda.synchronize()
        master = engine.store.views(engine.store.param)
        pulled = 0
        for stage in stages:
            for name, p in stage.params:
                assert p.dtype == dtype and torch.equal(p.detach().cpu(), master[name].to(dtype)), name
                pulled += 1
        assert pulled == 4


# ---- equivalence with single-device training ----

@pytest.mark.parametrize("stages,microbatches,batch,schedule", [
    (2, 3, 37, "1f1b"), (3, 4, 29, "gpipe"), (4, 7, 23, "1f1b"), (3, 1, 9, "1f1b"), (1, 5, 17, "gpipe")])
def test_pipeline_equals_single_device(rng, stages, microbatches, batch, schedule, worker_device):
    model = make_model()
    reference = TorchReference(model)
    with pipeline(model, [worker_device] * stages, stages=stages, microbatches=microbatches,
                  schedule=schedule) as engine:
        for b in make_batches(rng, 6, batch):
            metrics = engine.step(b)
            ref_loss = reference.step(b)
            assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5), "loss: micro-batch losses weighted by size"
        assert_matches(engine, reference)
        assert engine.stats()["applied_updates"] == 6
        assert len(metrics["stage_sizes"]) == stages and sum(metrics["stage_sizes"]) == len(model)


class _TracksItsDevice(torch.nn.Module):
    """A layer with the empty parameter that tells a module its device, registered before its weights."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.device_tracker = torch.nn.Parameter(torch.empty(0))
        self.linear = torch.nn.Linear(d_in, d_out)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def test_empty_parameters_at_the_start_of_stages(rng):
    """The host store puts an empty parameter at the offset where the previous stage's range begins: each stage but
    the last was refused as not one contiguous range ("also holds ['1.device_tracker']")."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_TracksItsDevice(10, 16), _TracksItsDevice(16, 16), _TracksItsDevice(16, 3))
    reference = TorchReference(model)
    with pipeline(model, ["cpu"] * 3, stages=3, microbatches=2) as engine:
        for b in make_batches(rng, 3, 12):
            engine.step(b)
            reference.step(b)
        assert_matches(engine, reference)


class _ChangesASavedTensor(torch.nn.Module):
    def forward(self, x):
        y = torch.exp(x * 0.1)
        return y.add_(1.0)  # exp saved y for its backward: autograd refuses the gradient


@pytest.mark.parametrize("stages,devices", [(1, 1), (2, 2)])
def test_a_tensor_changed_in_place_after_it_was_saved_is_refused_as_by_autograd(rng, stages, devices):
    """The stages' forwards run under saved-tensor hooks (the activation bytes), and under those autograd no longer
    checks a saved tensor's version: the pipeline trained on a wrong gradient where one device and hybrid raise.
    Refused with autograd's error, the weights untouched."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(10, 16), _ChangesASavedTensor(), torch.nn.Linear(16, 3)]
    batch = make_batches(rng, 1, 8)[0]
    with pipeline(torch.nn.Sequential(*layers), ["cpu"] * devices, stages=stages, microbatches=2,
                  balance=[2, 1] if stages == 2 else "params") as engine:
        before = engine.master_state_dict()
        with pytest.raises(StageError, match=r"modified by an inplace operation: \[torch.FloatTensor \[(8|4), 16\]\] "
                                             r"is at version 1; expected version 0"):
            engine.step(batch)
        assert all(torch.equal(value, before[name]) for name, value in engine.master_state_dict().items())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # what torch itself says
        torch.nn.Sequential(*layers)(batch[0]).sum().backward()


def test_stages_across_processes_each_get_a_trainable_parameter_when_they_can():
    """balance="params" across processes put a GELU alone in a stage ([1, 1, 3] for 3 stages of Linear, GELU, Linear,
    GELU, Linear), which a stage across processes cannot be: the split now gives each stage a parameter where enough
    layers have one; in one process the split is as before."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 10))
    layers = list(model._modules.items())
    costs = pipeline_module._param_costs(model)
    assert partition(costs, 3) == [1, 1, 3]  # the premise (in one process: unchanged)
    sizes = pipeline_distributed._stage_sizes(layers, 3, "params")
    bounds = [0, sizes[0], sizes[0] + sizes[1], 5]
    assert all(sum(costs[bounds[s]:bounds[s + 1]]) > 0 for s in range(3)), sizes
    assert max(sum(costs[bounds[s]:bounds[s + 1]]) for s in range(3)) == max(costs)  # still the least largest stage
    assert partition(costs, 4, each_positive=True) == partition(costs, 4)  # 3 layers with parameters: as before


def test_1f1b_and_gpipe_give_identical_weights(rng, worker_device):
    batches = make_batches(rng, 5, 31)
    results = []
    for schedule in ("1f1b", "gpipe"):
        with pipeline(make_model(), [worker_device] * 3, stages=3, microbatches=5, schedule=schedule) as engine:
            for b in batches:
                engine.step(b)
            results.append(engine.master_state_dict())
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


def test_dropout_in_stages_is_reproducible_and_schedule_independent(rng):
    """Stage threads draw their masks at once, each (stage, replica) from its own generator (Note [Random numbers
    of concurrent workers]): the same seed gives the same weights, 1F1B and GPipe too (a stage runs its forwards in
    micro-batch order in both), and resuming from state_dict() continues the same masks."""
    batches = make_batches(rng, 6, 32)
    runs = {}
    for key, schedule, seed in (("a", "1f1b", 7), ("b", "1f1b", 7), ("gpipe", "gpipe", 7), ("seed", "1f1b", 8)):
        with pipeline(make_model(dropout=0.4), ["cpu"] * 4, stages=2, microbatches=4, schedule=schedule,
                      seed=seed) as engine:
            engine.fit(batches)
            runs[key] = engine.master_state_dict()
    with pipeline(make_model(dropout=0.4), ["cpu"] * 4, stages=2, microbatches=4, seed=7) as first:
        first.fit(batches[:3])
        state = first.state_dict()
    with pipeline(make_model(dropout=0.4), ["cpu"] * 4, stages=2, microbatches=4, seed=99) as second:
        second.load_state_dict(state)
        second.fit(batches[3:])
        runs["resumed"] = second.master_state_dict()
    for key in ("b", "gpipe", "resumed"):
        for name in runs["a"]:
            assert torch.equal(runs["a"][name], runs[key][name]), (key, name)
    assert any(not torch.equal(runs["a"][name], runs["seed"][name]) for name in runs["a"])


def test_pipeline_times_hybrid_equals_single_device(rng, worker_device):
    model = make_model()
    reference = TorchReference(model)
    # stage s, replica r on devices[s * 2 + r]; 41 samples: shards of 21 and 20 (weighted), micro-batches of 7 or so
    with pipeline(model, [worker_device] * 4, stages=2, microbatches=3) as engine:
        assert engine.store.workers == 2, "one gradient slot per data-parallel replica"
        for b in make_batches(rng, 6, 41):
            metrics = engine.step(b)
            reference.step(b)
        assert metrics["replicas"] == 2 and metrics["samples"] == 41
        assert_matches(engine, reference)


def test_list_of_layers_and_resume(rng, worker_device):
    batches = make_batches(rng, 6, 20)
    layers = list(make_model())
    with pipeline(layers, [worker_device] * 2, microbatches=2) as engine:
        engine.fit(batches)
        expected = engine.master_state_dict()
    with pipeline(list(make_model()), [worker_device] * 2, microbatches=2) as first:
        first.fit(batches[:3])
        state = first.state_dict()
    with pipeline(list(make_model(seed=5)), [worker_device] * 2, microbatches=2) as second:
        second.load_state_dict(state)
        second.fit(batches[3:])
        got = second.master_state_dict()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    with pipeline(torch.nn.ModuleList(make_model()), [worker_device] * 2, microbatches=2) as listed:
        listed.fit(batches)  # an nn.ModuleList is a list of layers too; its layers keep their names ("0", "1", ...)
        got = listed.master_state_dict()
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_balance_as_an_array_or_tensor_of_layer_counts(rng):
    """balance=np.array([3, 4]) met numpy's "truth value of an array is ambiguous" in the option checks."""
    np = pytest.importorskip("numpy")
    for balance in (np.array([3, 4]), torch.tensor([3, 4])):  # make_model() has 7 layers
        with pipeline(make_model(), ["cpu"] * 2, microbatches=2, balance=balance) as engine:
            assert engine.pipeline.sizes == [3, 4]
            engine.step(make_batches(rng, 1, 8)[0])
    for balance in (np.array([[3, 4]]), np.array(7), torch.tensor([[3], [4]])):  # 2-D: numpy's "is ambiguous"
        with pytest.raises(ValueError, match="balance must be"):
            pipeline(make_model(), ["cpu"] * 2, microbatches=2, balance=balance)


def test_numpy_integers_are_counts_like_pythons(rng):
    """Engine(seed=np.int64(3)) was a TypeError; stages, microbatches, balance's counts, keep_history and fit's
    steps as numpy integers were ValueErrors. They train as the same Python ints do."""
    np = pytest.importorskip("numpy")
    batches = make_batches(rng, 2, 8)
    runs = []
    for to in (int, np.int64):
        with Engine(make_model(), loss_fn, devices=["cpu"] * 2, mode="pipeline", optimizer=AdamW(**OPT),
                    seed=to(3), stages=to(2), microbatches=to(2), balance=[to(3), to(4)],
                    keep_history=to(5)) as engine:
            assert engine.fit(batches, steps=to(2))[-1]["step"] == 2 and type(engine.keep_history) is int
            runs.append(engine.master_state_dict())
    assert all(torch.equal(a, b) for a, b in zip(runs[0].values(), runs[1].values()))


def test_a_time_balanced_pipeline_resumes_with_the_saved_split(rng):
    """balance="time" chooses the split from timings, which vary: a state loaded before the first step gave no
    split, so the resumed engine timed its own, and a different split draws other dropout masks (5 of 8 resumes
    differed in a fuzzer). The state holds the split and such an engine takes it (Note [A resumed pipeline keeps
    its split]); one already split otherwise warns; a bad saved split is a ValueError."""
    batches = make_batches(rng, 4, 12)
    model = make_model(dropout=0.3)  # 10 layers; [2, 8] is not what timing them would give
    with pipeline(copy.deepcopy(model), ["cpu"] * 2, microbatches=2, balance=[2, 8]) as straight:
        straight.fit(batches)
        expected = straight.master_state_dict()
    with pipeline(copy.deepcopy(model), ["cpu"] * 2, microbatches=2, balance=[2, 8]) as first:
        first.fit(batches[:2])
        state = first.state_dict()
    assert state["pipeline_sizes"] == [2, 8]
    with pipeline(make_model(seed=3, dropout=0.3), ["cpu"] * 2, microbatches=2, balance="time") as resumed:
        resumed.load_state_dict(state)
        assert resumed.pipeline.sizes == [2, 8]
        resumed.fit(batches[2:])
        got = resumed.master_state_dict()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    with pipeline(make_model(dropout=0.3), ["cpu"] * 2, microbatches=2, balance=[4, 6]) as other:
        with pytest.warns(UserWarning, match=r"trained with \[2, 8\] layers per stage; this pipeline splits "
                                             r"\[4, 6\]") as said:
            other.load_state_dict(state)
        assert said[0].filename == __file__, said[0].filename  # the caller's line (it named engine.py's)
        assert other.pipeline.sizes == [4, 6]
        with pytest.raises(ValueError, match="pipeline_sizes must be None or a list of positive ints"):
            other.load_state_dict({**state, "pipeline_sizes": [2, "8"]})


def test_the_first_steps_copy_back_leaves_out_the_layer_timing_of_balance_time(rng, monkeypatch):
    """balance="time" times the layers in the first step: that was counted as the step's copy back."""
    timing = pipeline_module.measure_layer_times

    def slow(*args, **kwargs):
        time.sleep(2.0)
        return timing(*args, **kwargs)

    monkeypatch.setattr(pipeline_module, "measure_layer_times", slow)
    with pipeline(make_model(), ["cpu"] * 2, microbatches=2, balance="time") as engine:
        first = engine.step(make_batches(rng, 1, 8)[0])
    assert first["wall_s"] >= 2.0 and first["copy_back_s"] < 1.0, first  # the copies take ~1 ms, the timing 2 s


@pytest.mark.parametrize("kind", ["buffer", "parameter"])
@pytest.mark.parametrize("container", [torch.nn.Sequential, torch.nn.ModuleList])
def test_a_container_holding_a_tensor_outside_its_layers_is_refused(kind, container):
    """No stage holds a buffer or parameter registered on the Sequential itself: the model trained, then
    state_dict() raised KeyError (hybrid takes such a model; the pipeline now refuses it, naming the tensor)."""
    model = container(make_model())
    register = model.register_buffer if kind == "buffer" else model.register_parameter
    register("extra", torch.ones(3) if kind == "buffer" else torch.nn.Parameter(torch.ones(3)))
    with pytest.raises(ValueError, match=rf"the {container.__name__} holds \['extra'\] itself, outside its layers"):
        pipeline(model, ["cpu"] * 2, microbatches=2)


class _Residual(torch.nn.Sequential):
    def forward(self, x):
        return x + super().forward(x)


@pytest.mark.parametrize("kind", ["forward", "hook", "pre-hook", "backward-hook", "backward-pre-hook"])
def test_a_sequential_whose_forward_is_not_the_chain_is_refused(kind):
    """The stages chain a Sequential's layers: a subclass's own forward (a residual) or a hook on the container
    would not run, and the pipeline trained another model than the one given (its losses differed from a single
    device's). Refused, saying what would be lost."""
    layers = [torch.nn.Linear(10, 10), torch.nn.Tanh(), torch.nn.Linear(10, 10)]
    model = _Residual(*layers) if kind == "forward" else torch.nn.Sequential(*layers)
    if kind == "hook":
        model.register_forward_hook(lambda module, args, out: out * 2)
    elif kind == "pre-hook":
        model.register_forward_pre_hook(lambda module, args: None)
    elif kind == "backward-hook":  # accepted, and never run
        model.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    elif kind == "backward-pre-hook":
        model.register_full_backward_pre_hook(lambda module, grad_out: None)
    what = "own forward()" if kind == "forward" else "hooks"
    with pytest.raises(ValueError, match=rf"chain the layers of the {type(model).__name__}, so its {what}"):
        pipeline(model, ["cpu"] * 2, microbatches=2)
    pipeline(torch.nn.Sequential(*layers), ["cpu"] * 2, microbatches=2).close()  # the layers themselves: taken


def test_a_state_read_while_the_stages_compute_is_the_last_steps(rng):
    """buffers_state_dict() / state_dict() from a loss_fn (on the last stage, while the stages compute) used to
    return BatchNorm statistics that this step's forwards had already moved, beside the last step's weights: now
    the statistics of the last complete step, as in hybrid mode (Note [Reading the state during a step])."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3))
    reads = []

    def reading_loss(module, batch):
        out = loss_fn(module, batch)
        if engine.version == 1:
            reads.append(engine.state_dict())
        return out

    with Engine(model, reading_loss, devices=["cpu"] * 2, mode="pipeline", stages=2, microbatches=2,
                optimizer=AdamW(**OPT)) as engine:
        batches = make_batches(rng, 2, 8)
        engine.step(batches[0])
        before = engine.state_dict()
        engine.step(batches[1])
        after = engine.state_dict()
    assert reads and all(r["version"] == 1 for r in reads)
    for read in reads:
        for name, value in before["buffers"].items():
            assert torch.equal(read["buffers"][name], value), name
    assert not torch.equal(after["buffers"]["1.running_mean"], before["buffers"]["1.running_mean"])


def test_trace_has_one_row_per_stage(rng, tmp_path):
    with pipeline(make_model(), ["cpu"] * 3, stages=3, microbatches=2) as engine:
        engine.step(make_batches(rng, 1, 8)[0])
        engine.trace(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = {(e["cat"], e["name"]) for e in events if e["ph"] == "X"}
    for s in range(3):
        assert {(f"stage{s}.r0", f"{k}{m}") for k in "FB" for m in range(2)} <= spans
    assert ("host", "update") in spans


# ---- autocast ----

def test_autocast_bf16_matches_single_device_autocast(rng):
    """Each stage's forward runs under CPU autocast (the activations reaching the loss are bf16), gradients travel in
    bf16 and land in the fp32 master weights; the weights follow one device running the same autocast.

    Tolerance: bf16 keeps 8 significant bits (rounding error 2^-9 ~ 0.2 %). The two runs round different things:
    micro-batches make every weight gradient a sum of per-micro-batch bf16 matmul outputs instead of one, and the
    gradient slot rounds to bf16 once more. eps=1 keeps AdamW's step nearly linear in the gradient (|g| << eps), so
    those errors reach the weights in proportion; with a small eps, Adam's normalisation amplifies them wherever a
    gradient element is near zero (eps=1e-3: up to 4.5 % of a tensor's update in 20 draws). Measured with eps=1 over
    30 fresh draws: 0.5-1.7 % of each tensor's largest update, hence 4 % of the model's largest update (the scale of
    the step: see _check_autocast_matches); the loss within 1 % (bf16 logits).
    """
    _check_autocast_matches(rng, torch.bfloat16, tolerance=0.04, loss_rel=1e-2)


def test_autocast_fp16_matches_single_device_autocast(rng):
    """As the bf16 test, in float16: the activations reaching the loss are fp16, gradients travel and land in fp16
    slots, the fp32 master weights follow one device running the same autocast.

    Tolerance: fp16 keeps 11 significant bits (rounding error 2^-12 ~ 0.02 %, 8x finer than bf16); the values here
    (|activations| < 10, gradients > 1e-5) stay far inside its range, so nothing overflows or flushes to zero and no
    loss scaling is needed. The same differences as in bf16 (per-micro-batch matmuls, one more rounding into the slot)
    remain, with eps=1 for the same reason. Measured over 30 fresh draws: 0.04-0.19 % of each tensor's largest update,
    hence 0.5 %; the loss within 0.2 %.
    """
    _check_autocast_matches(rng, torch.float16, tolerance=0.005, loss_rel=2e-3)


def _check_autocast_matches(rng, dtype, tolerance, loss_rel):
    opt = dict(OPT, eps=1.0)
    model, batches = make_model(), make_batches(rng, 5, 29)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), **opt)
    dtypes, worst = set(), []

    def recording_loss(last_stage, batch):
        x, y = batch
        logits = last_stage(x)
        dtypes.update({x.dtype, logits.dtype})
        return torch.nn.functional.cross_entropy(logits, y)

    with Engine(model, recording_loss, devices=["cpu"] * 3, mode="pipeline", stages=3, microbatches=4,
                optimizer=AdamW(**opt), autocast=dtype) as engine:
        assert engine.store.grad_dtype == dtype and engine.store.param.dtype == torch.float32
        for b in batches:
            metrics = engine.step(b)
            ref_opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                ref_loss = loss_fn(reference, b)
            ref_loss.backward()
            ref_opt.step()
            assert metrics["applied"] and metrics["loss"] == pytest.approx(ref_loss.item(), rel=loss_rel)
        master = engine.master_state_dict()
    assert dtypes == {dtype}, "the stages' forwards ran under autocast"
    initial = dict(model.named_parameters())
    # The scale of the errors is the model's step, not each tensor's own: a tensor whose gradient nearly cancels over
    # the batch (the last layer's bias can) takes a small update with the same rounding errors in it (seed 584883410:
    # 6.bias's largest update was a tenth of the usual, its error 5 % of that, 1.3 % of the model's largest update).
    updates = {name: ((master[name] - initial[name].detach()), (p - initial[name]).detach())
               for name, p in reference.named_parameters()}
    scale = max(ref_update.abs().max().item() for _, ref_update in updates.values())
    for name, (update, ref_update) in updates.items():
        assert master[name].dtype == torch.float32 and ref_update.abs().max() > 0
        worst.append(((update - ref_update).abs().max() / scale).item())
        torch.testing.assert_close(update, ref_update, rtol=0, atol=tolerance * scale, msg=name)
    print(f"largest error per tensor / the model's largest update: {max(worst):.4f}")


# ---- parameters tied across stages ----

def lm_loss(model, batch):
    tokens, targets = batch
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tied_lm(vocab=11, d=7, seed=0):
    """Input embedding in the first stage, its weight reused by the output layer in the last."""
    torch.manual_seed(seed)
    embedding, head = torch.nn.Embedding(vocab, d), torch.nn.Linear(d, vocab, bias=False)
    head.weight = embedding.weight
    return torch.nn.Sequential(embedding, torch.nn.Tanh(), torch.nn.Linear(d, d), torch.nn.Tanh(), head)


def tied_module(seed=0):
    """One Linear used twice: in stage 0 and stage 1."""
    torch.manual_seed(seed)
    shared = torch.nn.Linear(5, 5)
    return torch.nn.Sequential(shared, torch.nn.Tanh(), torch.nn.Linear(5, 5), torch.nn.Tanh(), shared)


def tied_thrice(seed=0):
    """One Linear used three times, in each of three stages (balance [2, 2, 1])."""
    torch.manual_seed(seed)
    shared = torch.nn.Linear(5, 5)
    return torch.nn.Sequential(shared, torch.nn.Tanh(), shared, torch.nn.Tanh(), shared)


@pytest.mark.parametrize("case,stages,replicas,balance", [
    ("embedding", 3, 1, [1, 3, 1]), ("embedding", 2, 2, [2, 3]), ("module", 2, 1, [3, 2]),
    ("module", 3, 1, [2, 2, 1])])
def test_tied_parameters_across_stages_equal_single_device(rng, case, stages, replicas, balance, worker_device):
    """A parameter held by several stages gets the sum of their gradients (three stages: every one's)."""
    model = tied_lm() if case == "embedding" else tied_module() if stages == 2 else tied_thrice()
    tied = ["0.weight"] if case == "embedding" else ["0.weight", "0.bias"]
    holders = [0, 1, 2] if case == "module" and stages == 3 else [0, stages - 1]
    if case == "embedding":
        batches = [(torch.randint(0, 11, (19, 3), generator=rng), torch.randint(0, 11, (19, 3), generator=rng))
                   for _ in range(5)]
        loss = lm_loss
    else:
        batches = [(torch.randn(19, 5, generator=rng), torch.randint(0, 5, (19,), generator=rng)) for _ in range(5)]
        loss = loss_fn
    reference = copy.deepcopy(model).double()
    ref_opt = torch.optim.AdamW(reference.parameters(), foreach=False, **OPT)
    with Engine(model, loss, devices=[worker_device] * (stages * replicas), mode="pipeline", stages=stages,
                microbatches=3, optimizer=AdamW(**OPT), balance=balance) as engine:
        assert engine.pipeline.tied == {name: holders for name in tied}
        for x, y in batches:
            before = engine.master_state_dict()
            metrics = engine.step((x, y))
            for stage in [s for h in holders for s in engine.pipeline.stages[h]]:
                for name in tied:
                    held = dict(stage.params)[name]
                    assert torch.equal(held.detach().cpu(), before[name]), "every stage computed with the last update"
            ref_opt.zero_grad()
            ref_loss = loss(reference, (x.double() if x.is_floating_point() else x, y))
            ref_loss.backward()
            ref_opt.step()
            assert metrics["loss"] == pytest.approx(ref_loss.item(), rel=1e-5)
        master = engine.master_state_dict()
    assert sorted(master) == sorted(name for name, _ in reference.named_parameters())
    for name, p in reference.named_parameters():
        scale = p.detach().abs().max().item() if p.numel() else 0.0
        torch.testing.assert_close(master[name].double(), p.detach(), rtol=1e-5, atol=1e-5 * scale, msg=name)


# ---- schedules ----

def simulate(schedule, stages, microbatches):
    """Unit-time execution of the action lists: an action runs once its input exists (F(m) after F(m) upstream,
    B(m) after B(m) downstream). Returns (makespan, peak stored micro-batches per stage); raises on deadlock."""
    lists = [schedule_actions(schedule, s, stages, microbatches) for s in range(stages)]
    done, position, stored, peak, clock = set(), [0] * stages, [0] * stages, [0] * stages, 0
    while any(position[s] < len(lists[s]) for s in range(stages)):
        ready = []
        for s in range(stages):
            if position[s] < len(lists[s]):
                kind, m = lists[s][position[s]]
                need = (("F", m, s - 1) if s > 0 else None) if kind == "F" else (
                    ("B", m, s + 1) if s < stages - 1 else ("F", m, s))
                if need is None or need in done:
                    ready.append((s, kind, m))
        assert ready, f"deadlock at time {clock}"
        for s, kind, m in ready:
            done.add((kind, m, s))
            position[s] += 1
            stored[s] += 1 if kind == "F" else -1
            peak[s] = max(peak[s], stored[s])
        clock += 1
    return clock, peak


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages,microbatches", [(1, 1), (2, 1), (2, 4), (4, 3), (4, 16), (5, 7)])
def test_schedule_actions(schedule, stages, microbatches):
    for s in range(stages):
        actions = schedule_actions(schedule, s, stages, microbatches)
        assert sorted(actions) == sorted([(k, m) for k in "FB" for m in range(microbatches)])
        assert [m for k, m in actions if k == "B"] == list(range(microbatches)), "backwards in micro-batch order"
    makespan, peak = simulate(schedule, stages, microbatches)
    assert makespan == 2 * (microbatches + stages - 1), "no bubble beyond fill and drain"
    expected = [min(stages - s, microbatches) if schedule == "1f1b" else microbatches for s in range(stages)]
    assert peak == expected


class Sleep(torch.autograd.Function):
    """Identity whose forward and backward sleep: fixed busy time that needs no CPU."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepLayer(torch.nn.Module):
    def __init__(self, width=8, forward_s=0.004, backward_s=0.008):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x):
        return Sleep.apply(self.linear(x), self.forward_s, self.backward_s)


def sleep_model(stages, **kwargs):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[SleepLayer(**kwargs) for _ in range(stages)])


def mse(model, batch):
    x, y = batch
    return (model(x) - y).square().mean()


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages,microbatches", [(4, 8), (2, 1)])
def test_bubble_fraction_near_ideal(schedule, stages, microbatches):
    batch = (torch.randn(16, 8), torch.randn(16, 8))
    forward_s, backward_s = 0.016, 0.032  # long against a thread's wake-up (ms on a loaded 2-core VM)
    per_microbatch = forward_s + backward_s
    with Engine(sleep_model(stages, forward_s=forward_s, backward_s=backward_s), mse, devices=["cpu"] * stages,
                mode="pipeline", stages=stages, microbatches=microbatches, schedule=schedule) as engine:
        history = [engine.step(batch) for _ in range(3)]
    ideal = (stages - 1) / (microbatches + stages - 1)
    measured = sorted(m["bubble_fraction"] for m in history)[1]
    assert history[0]["bubble_ideal"] == pytest.approx(ideal)
    # Python overhead, thread wake-ups and sleep overshoot only add idle time, a little of it (more on a loaded VM);
    # the bound stays well below (S - 1) / S, the bubble of stages that ran one at a time (0.75 for S = 4, M = 8)
    assert ideal - 0.03 <= measured <= ideal + 0.25, (measured, ideal)
    for stage in range(stages):
        busy = [m["stage_busy_s"][stage] for m in history]
        assert min(busy) >= per_microbatch * microbatches, busy  # a stage's sleeps all counted, in every step
        # sleeps overshoot on a loaded VM: the upper bound holds for the stage's best step of the three
        assert min(busy) <= per_microbatch * microbatches * 2 + 0.02, busy


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_1f1b_bounds_stored_activations(schedule):
    stages, microbatches = 4, 8
    batch = (torch.randn(32, 8), torch.randn(32, 8))
    with Engine(sleep_model(stages, forward_s=0.0, backward_s=0.0), mse, devices=["cpu"] * stages, mode="pipeline",
                stages=stages, microbatches=microbatches, schedule=schedule) as engine:
        metrics = engine.step(batch)
    if schedule == "1f1b":
        assert metrics["activation_peak"] == [min(stages - s, microbatches) for s in range(stages)]
        assert metrics["activation_peak"][0] <= stages
    else:
        assert metrics["activation_peak"] == [microbatches] * stages
    # stage 1 is Linear + Sleep: autograd saves the Linear's input (4 samples x 8 fp32) per micro-batch; the weight
    # it also saves is a parameter and is not counted
    assert metrics["activation_peak_bytes"][1] == metrics["activation_peak"][1] * 4 * 8 * 4


class LiveActivations:
    """Per label, how many forwards still have tensors saved by autograd (the micro-batches a stage holds for their
    backward, counted from the tensors themselves, not from the pipeline's bookkeeping), and the most at once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.live, self.peak = collections.Counter(), collections.Counter()

    def enter(self, label):
        with self.lock:
            self.live[label] += 1
            self.peak[label] = max(self.peak[label], self.live[label])

    def leave(self, label):
        with self.lock:
            self.live[label] -= 1


LIVE = LiveActivations()  # module level: a layer holding it could not be deep-copied (its lock)


class _Forward:
    """One forward of a KeepsActivations layer: alive while autograd holds any tensor that forward saved."""

    def __init__(self, label):
        self.label = label
        LIVE.enter(label)

    def __del__(self):
        LIVE.leave(self.label)


class KeepsActivations(torch.nn.Module):
    """Linear + Tanh whose forward packs every tensor autograd saves together with one _Forward (saved_tensors_hooks,
    the innermost pair, so the pipeline's own counting hooks do not see them): the _Forward dies when autograd drops
    the last of them, which a backward does (retain_graph=False) and a graph kept alive by mistake does not."""

    def __init__(self, label, width=8):
        super().__init__()
        self.linear, self.label = torch.nn.Linear(width, width), label

    def forward(self, x):
        forward = _Forward(self.label)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (forward, t), lambda held: held[1]):
            return torch.tanh(self.linear(x))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_1f1b_bounds_live_saved_activations(schedule):
    """The micro-batches whose saved tensors are alive at once, counted from autograd's saved tensors (not from the
    pipeline's own counter): at most S - s at stage s with 1F1B, all M with GPipe, and none left after the step."""
    stages, microbatches = 4, 8
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[KeepsActivations(s) for s in range(stages)])
    LIVE.live.clear()
    LIVE.peak.clear()
    with Engine(model, mse, devices=["cpu"] * stages, mode="pipeline", stages=stages, microbatches=microbatches,
                schedule=schedule, balance=[1] * stages) as engine:
        metrics = engine.step((torch.randn(32, 8), torch.randn(32, 8)))
        gc.collect()
        assert all(LIVE.live[s] == 0 for s in range(stages)), ("saved activations outlived the step", LIVE.live)
    peaks = [LIVE.peak[s] for s in range(stages)]
    assert peaks == ([min(stages - s, microbatches) for s in range(stages)] if schedule == "1f1b"
                     else [microbatches] * stages)
    assert metrics["activation_peak"] == peaks, "the reported peaks are the live ones"


# ---- balance ----

def test_partition_is_optimal_against_brute_force(rng):
    for _ in range(30):
        layers = int(torch.randint(1, 8, (1,), generator=rng))
        stages = int(torch.randint(1, layers + 1, (1,), generator=rng))
        costs = torch.randint(0, 20, (layers,), generator=rng).tolist()
        sizes = partition(costs, stages)
        assert len(sizes) == stages and sum(sizes) == layers and min(sizes) >= 1

        def worst(cuts):
            bounds = [0, *cuts, layers]
            return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))

        best = min(worst(c) for c in itertools.combinations(range(1, layers), stages - 1))
        bounds = list(itertools.accumulate(sizes))[:-1]
        assert worst(bounds) == best, (costs, stages, sizes)


def test_balance_params_list_and_time():
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)], SleepLayer(forward_s=0.02))

    batch = (torch.randn(8, 8), torch.randn(8, 8))
    expected = {"params": [2, 3], "time": [4, 1], (1, 4): [1, 4]}
    for balance, sizes in expected.items():
        balance = list(balance) if isinstance(balance, tuple) else balance
        with Engine(model(), mse, devices=["cpu"] * 2, mode="pipeline", microbatches=2, balance=balance) as engine:
            assert engine.step(batch)["stage_sizes"] == sizes, balance


@pytest.mark.parametrize("balance", [[2, 2], [0, 5], [5], "flops", [2.5, 2.5], [True, 4], True])
def test_bad_balance(balance):
    with pytest.raises(ValueError, match="balance"):
        pipeline(make_model(blocks=2), ["cpu"] * 2, balance=balance)


# ---- failures and bad inputs ----

class RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in the middle stage's backward")


class Failing(torch.nn.Module):
    """Identity; ``armed = "forward"`` raises in its forward, ``armed = "backward"`` in its backward."""

    def __init__(self):
        super().__init__()
        self.armed = None

    def forward(self, x):
        if self.armed == "forward":
            raise RuntimeError("boom in the middle stage")
        return RaiseInBackward.apply(x) if self.armed == "backward" else x


def threads_inside_the_pipeline(engine) -> list[str]:
    """The names of ``engine``'s stage threads whose stack is in pyengine/pipeline.py: still in a stage's work."""
    names = {t.ident: t.name for t in engine.pipeline._pool._threads}
    inside = []
    for ident, frame in sys._current_frames().items():
        while ident in names and frame is not None:
            if frame.f_code.co_filename.endswith(os.path.join("pyengine", "pipeline.py")):
                inside.append(names[ident])
                break
            frame = frame.f_back
    return inside


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("where", ["forward", "backward", "loss"])
def test_raising_stage_stops_the_pipeline_and_is_named(rng, schedule, where, worker_device):
    """A stage whose forward, backward or loss raises stops every stage: the step raises StageError naming it within
    seconds, with no stage thread left in the step, and its threads end at close (Note [Stopping a failed
    pipeline]). The failed step changes nothing: the master weights, and stage 0's BatchNorm statistics, which its
    forwards moved before the failure, are as before it; the run then goes on exactly as one that never tried it."""
    armed = {"loss": False}

    def loss(model, batch):
        if armed["loss"]:
            raise RuntimeError("boom in the loss")
        return loss_fn(model, batch)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.BatchNorm1d(8), Failing(), torch.nn.Linear(8, 3))

    batches = make_batches(rng, 3, 12)
    options = dict(devices=[worker_device] * 3, mode="pipeline", stages=3, microbatches=4, schedule=schedule,
                   balance=[2, 1, 1], optimizer=AdamW(**OPT))
    with Engine(model(), loss, **options) as clean:
        clean.fit(batches)
        expected = clean.master_state_dict(), clean.buffers_state_dict()
    failing = 2 if where == "loss" else 1
    with Engine(model(), loss, **options) as engine:
        engine.step(batches[0])
        before = engine.master_state_dict(), engine.buffers_state_dict()
        engine.pipeline.stages[1][0].module[0].armed = where
        armed["loss"] = where == "loss"
        start = time.perf_counter()
        with pytest.raises(StageError, match=f"stage {failing}") as info:
            engine.step(batches[1])
        assert time.perf_counter() - start < 5, "the other stages stop instead of waiting forever"
        assert info.value.stage == failing and isinstance(info.value.__cause__, RuntimeError)
        carried = pickle.loads(pickle.dumps(info.value))  # it crosses processes whole (a process pool's result)
        assert type(carried) is StageError and str(carried) == str(info.value)
        assert (carried.stage, carried.replica, carried.worker) == (failing, 0, failing)
        assert threads_inside_the_pipeline(engine) == [], "a stage thread is still in the failed step"
        after = engine.master_state_dict(), engine.buffers_state_dict()
        for was, now, what in zip(before, after, ("the master weights", "the buffers")):
            assert all(torch.equal(was[k], now[k]) for k in was), f"{what} are as before the failed step"
        engine.pipeline.stages[1][0].module[0].armed = None
        armed["loss"] = False
        assert engine.step(batches[1])["applied"], "the next step runs afresh"
        engine.step(batches[2])
        got = engine.master_state_dict(), engine.buffers_state_dict()
        threads = list(engine.pipeline._pool._threads)
    assert threads and not any(t.is_alive() for t in threads), "a stage thread outlived close()"
    for want, have in zip(expected, got):
        for name in want:
            torch.testing.assert_close(have[name], want[name], msg=name)


@pytest.mark.parametrize("options,match", [
    (dict(stages=9), "more than the model's 7 layers"),
    (dict(stages=2, microbatches=0), "microbatches must be an int >= 1"),
    (dict(stages=2, microbatches=2.0), "microbatches must be an int >= 1"),
    (dict(stages=2, microbatches=True), "microbatches must be an int >= 1"),
    (dict(stages=True), "stages must be an int >= 1"),
    (dict(stages=3), "multiple|stages x replicas"),
    (dict(stages=2, schedule="interleaved"), "schedule must be one of"),
])
def test_bad_pipeline_options(options, match):
    with pytest.raises(ValueError, match=match):
        pipeline(make_model(), ["cpu"] * 4, **options)


def test_bad_inputs_at_step(rng):
    with pipeline(make_model(), ["cpu"] * 2, microbatches=4) as engine:
        x, y = make_batches(rng, 1, 3)[0]
        with pytest.raises(ValueError, match="at least microbatches=4"):
            engine.step((x, y))
        with pytest.raises(ValueError, match=r"needs each batch as \(inputs, targets\).*got Tensor$"):
            engine.step(x)
        with pytest.raises(ValueError, match=r"needs each batch as \(inputs, targets\).*got a tuple of 3$"):
            engine.step((x, y, y))  # a pair and an extra: the length named
        with pytest.raises(ValueError, match=r"got a list of 1$"):
            engine.step([x])
        with pytest.raises(ValueError, match=r"got dict$"):
            engine.step({"x": x, "y": y})
        assert engine.step(make_batches(rng, 1, 8)[0])["loss"] > 0  # usable after


def test_bad_models_and_modes():
    with pytest.raises(TypeError, match="sequence of layers"):
        Engine(torch.nn.Linear(3, 3), loss_fn, devices=["cpu"], mode="pipeline")
    with pytest.raises(ValueError, match="pipeline options"):
        Engine(make_model(), loss_fn, devices=["cpu"], mode="hybrid", stages=2, schedule="gpipe")
    norm = torch.nn.BatchNorm1d(4)
    with pytest.raises(ValueError, match=r"buffer '0.running_mean' is shared between stages \[0, 1\]"):
        Engine(torch.nn.Sequential(norm, torch.nn.Linear(4, 4), norm), loss_fn, devices=["cpu"] * 2,
               mode="pipeline", balance=[2, 1])


class Gated(torch.nn.Module):
    """A Linear and a gain used only while GATE is on: a parameter that some steps' backward does not reach."""
    GATE = {"on": True}

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.gain = torch.nn.Parameter(torch.ones(16))

    def forward(self, x):
        x = self.linear(x)
        return x * self.gain if Gated.GATE["on"] else x


def test_a_stage_parameter_unused_in_a_step_gets_a_zero_gradient(rng):
    """unused='zero' (the default): a stage parameter the step's backward does not reach streams zeros, as in the
    other modes; its slot must not keep the last step's gradient (which would be applied again). Reference:
    torch's AdamW in float64 with a zero .grad for a parameter that got none."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), Gated(), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3))
    reference = TorchReference(model)
    try:
        with pipeline(model, ["cpu"] * 2, stages=2, microbatches=2) as engine:
            for step, batch in enumerate(make_batches(rng, 4, 12)):
                Gated.GATE["on"] = step == 0
                engine.step(batch)
                x, y = batch
                reference.opt.zero_grad(set_to_none=True)
                loss_fn(reference.model, (x.double(), y)).backward()
                for p in reference.model.parameters():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                reference.opt.step()
            assert_matches(engine, reference)
    finally:
        Gated.GATE["on"] = True


def test_split_layers_keeps_tied_parameters_in_every_stage_holding_them():
    """A parameter tied across stages is in each of them (both kinds of pipeline update it: Note [Parameters tied
    across stages]); a shared buffer is still an error (test_bad_models_and_modes)."""
    shared = torch.nn.Linear(4, 4)
    layers = list(torch.nn.Sequential(torch.nn.Linear(4, 4), shared, torch.nn.Tanh(), shared)._modules.items())
    modules = split_layers(layers, [2, 1, 1])
    assert [m[-1] for m in modules] == [shared, layers[2][1], shared]


# ---- stages in separate processes (torch.distributed.pipelining) ----

def _rank_msg(rank, name):
    """assert_close's msg: the rank and the tensor, then torch's own report of the mismatch."""
    return lambda report: f"rank {rank} {name}: {report}"


def _join_gloo_group(rank, world, init_file):
    """A spawned rank joins the test's gloo group (30 s timeout, one intra-op thread); returns torch.distributed."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{init_file}",
                            timeout=datetime.timedelta(seconds=30))
    torch.set_num_threads(1)
    return dist


# ---- Engine(mode="pipeline") over a process group: rank s runs stage s ----

ENGINE_RUNS = (("1f1b", 0.05, 3), ("gpipe", None, 4))  # schedule, max_grad_norm, microbatches


BN_OPTIONS = dict(mode="pipeline", microbatches=3, balance=[3, 3], optimizer=AdamW(**OPT), pin=False)


def bn_model(seed=0):
    """Stage 0 (of balance [3, 3]) holds a BatchNorm: buffers that only its rank updates. No bias before it: that
    bias's exact gradient is zero (the BatchNorm subtracts the batch mean), so its fp32 gradient is rounding noise
    that Adam's normalisation amplifies, differently for each summation order (the replicas test failed on it:
    seed 536769876, 6e-6 apart on values of 0.05)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 16, bias=False), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def varying_batches(seed):
    """Batches whose size changes from step to step (all multiples of 4 micro-batches; 12 and 8 come back)."""
    rng = torch.Generator().manual_seed(seed + 1)
    return [make_batches(rng, 1, n)[0] for n in (12, 8, 12, 4, 16, 8)]


def _engine_worker(rank, world, init_file, seed, out_dir):
    dist = _join_gloo_group(rank, world, init_file)
    gc.disable()  # so that only reference counting can free the engines (checked at the end)
    group = weakref.ref(dist.group.WORLD)
    try:
        batches = make_batches(torch.Generator().manual_seed(seed), 4, 12)
        for schedule, clip, microbatches in ENGINE_RUNS:
            with Engine(make_model(blocks=2), loss_fn, devices=["cpu"], mode="pipeline", microbatches=microbatches,
                        schedule=schedule, optimizer=AdamW(**OPT, max_grad_norm=clip), pin=False) as engine:
                metrics = engine.fit(batches)
                uneven = mismatch = few = rows = None
                try:
                    engine.step(make_batches(torch.Generator().manual_seed(seed), 1, 13)[0])
                except ValueError as error:
                    uneven = str(error)
                try:  # targets of another size than the inputs: refused on every rank, not paired row by row
                    x, y = make_batches(torch.Generator().manual_seed(seed), 1, 12)[0]
                    engine.step((x, y[:4]))
                except ValueError as error:
                    rows = str(error)
                try:  # Note [The same batch on every rank]: another batch on each rank
                    engine.step(make_batches(torch.Generator().manual_seed(seed + 1 + rank), 1, 12)[0])
                except ValueError as error:
                    mismatch = str(error)
                try:  # torch's Schedule1F1B needs M >= S: refused at construction, on every rank
                    Engine(make_model(blocks=2), loss_fn, devices=["cpu"], mode="pipeline", microbatches=1,
                           schedule="1f1b", pin=False)
                except ValueError as error:
                    few = str(error)
                own = sorted(name for name, _ in engine.pipeline.params)
                torch.save({"own": own, "master": engine.master_state_dict(), "state": engine.state_dict(),
                            "losses": [m["loss"] for m in metrics], "stats": engine.stats(),
                            "sizes": engine.pipeline.sizes, "uneven": uneven, "mismatch": mismatch, "few": few,
                            "rows": rows},
                           f"{out_dir}/engine-{schedule}-{rank}.pt")
        # resume: two steps, state_dict (a collective), a fresh engine of another init loads it and takes the rest
        options = dict(devices=["cpu"], mode="pipeline", microbatches=3, optimizer=AdamW(**OPT, amsgrad=True),
                       pin=False)
        with Engine(make_model(blocks=2), loss_fn, **options) as whole:
            whole.fit(batches)
            expected = whole.master_state_dict()
        with Engine(make_model(blocks=2), loss_fn, **options) as first:
            first.fit(batches[:2])
            state = first.state_dict()
        with Engine(make_model(blocks=2, seed=9), loss_fn, **options) as second:
            different_states = None
            if rank == 0:  # Note [Every rank at the same version]: rank 0 alone loads it; the step is refused
                second.load_state_dict(state)
            try:
                second.step(batches[2])
            except DistributedError as error:
                different_states = str(error)
            second.load_state_dict(state)
            different_lr = None
            if rank == 0:  # an lr changed on rank 0 only: refused on every rank too
                second.optimizer.lr *= 2
            try:
                second.step(batches[2])
            except DistributedError as error:
                different_lr = str(error)
            second.optimizer.lr = OPT["lr"]
            second.fit(batches[2:])
            got = second.master_state_dict()
        # bf16 autocast: every stage's forward and the loss under CPU autocast, fp32 master weights
        bf16_options = dict(options, optimizer=AdamW(**dict(OPT, eps=1.0)))  # eps=1: see _check_autocast_matches
        with Engine(make_model(blocks=2), loss_fn, autocast=torch.bfloat16, **bf16_options) as bf16:
            bf16_losses = [m["loss"] for m in bf16.fit(batches)]
            bf16_master = bf16.master_state_dict()
        # float16 autocast with dynamic loss scaling (Note [Loss scaling]): the scale starts too high, grows every 3
        # applied steps, and one batch is poisoned
        with Engine(make_model(blocks=2), loss_fn, devices=["cpu"], mode="pipeline", microbatches=3, pin=False,
                    optimizer=AdamW(**OPT), autocast=torch.float16, loss_scale=LossScaler(**FP16_SCALER)) as fp16:
            fp16_trajectory = [(m["loss_scale"], m["applied"]) for m in fp16.fit(fp16_batches(seed))]
            fp16_master = fp16.master_state_dict()
        # batches of changing sizes (Note [One schedule per batch shape]), two schedules kept: shapes are evicted
        # and built again
        pipeline_distributed.SCHEDULES_KEPT = 2
        with Engine(make_model(blocks=2), loss_fn, devices=["cpu"], mode="pipeline", microbatches=4,
                    optimizer=AdamW(**OPT), pin=False) as varying:
            varying_losses = [m["loss"] for m in varying.fit(varying_batches(seed))]
            varying_master, kept = varying.master_state_dict(), len(varying.pipeline._schedules)
        # BatchNorm in stage 0 (Note [Buffers of stages across processes]): its statistics reach rank 1's state, and
        # a fresh engine loads them
        with Engine(bn_model(), loss_fn, devices=["cpu"], **BN_OPTIONS) as bn:
            bn_losses = [m["loss"] for m in bn.fit(batches)]
            bn_state = bn.state_dict()
        with Engine(bn_model(seed=9), loss_fn, devices=["cpu"], **BN_OPTIONS) as bn_again:
            bn_again.load_state_dict(bn_state)
            bn_reloaded = bn_again.buffers_state_dict()
        # Note [Bubble across processes]: layers that sleep 8 ms forward, 16 ms backward (test_bubble_fraction_...);
        # the first step also builds the schedule (shape exchange): steps 2-4 are measured
        bubbles, generator = {}, torch.Generator().manual_seed(seed)
        sleepy_batch = (torch.randn(16, 8, generator=generator), torch.randn(16, 8, generator=generator))
        for schedule in ("gpipe", "1f1b"):
            with Engine(sleep_model(2, forward_s=0.008, backward_s=0.016), mse, devices=["cpu"], mode="pipeline",
                        microbatches=4, schedule=schedule, pin=False) as sleepy:
                bubbles[schedule] = [sleepy.step(sleepy_batch) for _ in range(4)][1:]
        # M = 1: the stages never compute at once, so the bubble is at least (S - 1) / S = 1/2
        with Engine(sleep_model(2, forward_s=0.008, backward_s=0.016), mse, devices=["cpu"], mode="pipeline",
                    microbatches=1, schedule="gpipe", pin=False) as single:
            bubble_m1 = [single.step(sleepy_batch) for _ in range(4)][1:]
        torch.save({"resumed": got, "expected": expected, "different_states": different_states,
                    "different_lr": different_lr, "bf16_losses": bf16_losses, "bf16_master": bf16_master,
                    "fp16_trajectory": fp16_trajectory, "fp16_master": fp16_master,
                    "varying_losses": varying_losses, "varying_master": varying_master, "kept": kept,
                    "bn_losses": bn_losses, "bn_state": bn_state, "bn_reloaded": bn_reloaded,
                    "bubbles": {k: [(m["bubble_fraction"], m["bubble_ideal"], m["busy_s"]) for m in v]
                                for k, v in bubbles.items()},
                    "stage_busy": {k: [m["stage_busy_s"] for m in v] for k, v in bubbles.items()},
                    "activations": {k: [(m["activation_peak"], m["activation_peak_bytes"]) for m in v]
                                    for k, v in bubbles.items()},
                    "walls": {k: [m["schedule_s"] for m in v] for k, v in bubbles.items()},
                    "bubble_m1": [(m["bubble_fraction"], m["bubble_ideal"], m["schedule_s"]) for m in bubble_m1]},
                   f"{out_dir}/engine-extra-{rank}.pt")
        del engine, whole, first, second, bf16, fp16, varying, bn, bn_again, sleepy, single
    finally:
        dist.destroy_process_group()
    # Note [No reference cycle through the engine]: once its engines are dropped, destroy_process_group() really
    # destroys the group (its gloo threads end here, not during interpreter shutdown)
    with open(f"{out_dir}/engine-teardown-{rank}.txt", "w") as f:
        f.write("group alive" if group() is not None else "group freed")
    gc.enable()


def test_shape_inference_leaves_the_stage_buffers_alone(monkeypatch):
    """Note [Shape inference leaves the buffers alone]: torch 2.11's PipelineStage._shape_inference runs the stage's
    module on zeros, under no_grad, in training mode, at the first step; a BatchNorm then took a batch of zeros into
    its running statistics. Stood in for here (the installed torch may back the buffers up itself): the inference
    runs, and the buffers come out as they went in."""
    calls = []

    def torch_2_11_shape_inference(self, args, kwargs=None):
        calls.append(len(args))
        with torch.no_grad():
            return self.submod(*[torch.zeros_like(a) for a in args])

    monkeypatch.setattr(pipeline_distributed.PipelineStage, "_shape_inference", torch_2_11_shape_inference,
                        raising=False)
    module = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6)).train()
    module(torch.randn(8, 4))  # statistics away from their initial values
    before = {k: v.clone() for k, v in module.state_dict().items()}
    stage = pipeline_distributed._MeteredStage.__new__(pipeline_distributed._MeteredStage)  # no process group needed
    stage.submod = module
    out = stage._shape_inference((torch.randn(5, 4),))
    assert calls == [1] and out.shape == (5, 6)
    for name, value in module.state_dict().items():
        assert torch.equal(value, before[name]), name
    torch_2_11_shape_inference(stage, (torch.randn(5, 4),))  # without the override the statistics do move
    assert not torch.equal(module[1].running_var, before["1.running_var"])
    assert module[1].num_batches_tracked == before["1.num_batches_tracked"] + 1
    with pytest.raises(RuntimeError, match="inference failed"), pipeline_distributed.buffers_restored(module):
        module(torch.randn(8, 4))
        raise RuntimeError("inference failed")
    assert module[1].num_batches_tracked == before["1.num_batches_tracked"] + 1  # restored after a failure too


@pytest.mark.timeout(120)
def test_engine_over_process_group_equals_single_device(rng, tmp_path):
    """Engine(mode="pipeline") on 2 gloo ranks (the default group): one stage each, every rank's master weights,
    Adam state (state_dict gathers the other stage) and losses equal float64 torch AdamW on one device; a batch that
    does not split into M equal micro-batches is a clear error on every rank."""
    import torch.multiprocessing as mp

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    mp.spawn(_engine_worker, args=(2, str(tmp_path / "init"), seed, str(tmp_path)), nprocs=2)
    batches = make_batches(torch.Generator().manual_seed(seed), 4, 12)
    for schedule, clip, _ in ENGINE_RUNS:
        reference = TorchReference(make_model(blocks=2))
        ref_losses = [reference.step(b, clip) for b in batches]
        ref_state = reference.opt.state_dict()["state"]
        own = [torch.load(tmp_path / f"engine-{schedule}-{r}.pt", weights_only=False)["own"] for r in range(2)]
        assert not set(own[0]) & set(own[1]), "each rank runs its own stage's parameters only"
        assert sorted(own[0] + own[1]) == sorted(n for n, _ in reference.model.named_parameters())
        for rank in range(2):
            got = torch.load(tmp_path / f"engine-{schedule}-{rank}.pt", weights_only=False)
            assert got["sizes"] == [1, 4]  # balance="params": the 10x16 input layer, then the rest
            assert got["stats"]["applied_updates"] == got["stats"]["version"] == len(batches)
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-5)
            names = [n for n, _ in reference.model.named_parameters()]
            for i, (name, p) in enumerate(reference.model.named_parameters()):
                scale = p.detach().abs().max().item() if p.numel() else 0.0
                for master in (got["master"], got["state"]["master"]):
                    torch.testing.assert_close(master[name].double(), p.detach(), rtol=1e-5, atol=1e-5 * scale,
                                               msg=name)
                for key in ("exp_avg", "exp_avg_sq"):
                    want = ref_state[i][key]
                    have = got["state"]["optimizer"]["state"][names.index(name)][key]
                    torch.testing.assert_close(have.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item(),
                                               msg=f"{name} {key}")
            assert "a batch of 13 samples" in got["uneven"] and "microbatches=" in got["uneven"]
            assert got["mismatch"] is not None and "were given different batches" in got["mismatch"]
            assert got["rows"] is not None and "batch[0] has 12, batch[1] has 4" in got["rows"], got["rows"]
            assert "schedule='1f1b' across processes needs microbatches >= stages" in got["few"]
    extras = [torch.load(tmp_path / f"engine-extra-{rank}.pt", weights_only=False) for rank in range(2)]
    # Note [Bubble across processes]: one wall for every rank, from a common start to the last rank's end
    assert extras[0]["walls"] == extras[1]["walls"]
    assert [w for _, _, w in extras[0]["bubble_m1"]] == [w for _, _, w in extras[1]["bubble_m1"]]
    print("bubbles across processes:", {k: [round(b, 3) for b, _, _ in v] for k, v in extras[0]["bubbles"].items()},
          "M=1:", [round(b, 3) for b, _, _ in extras[0]["bubble_m1"]])
    for rank in range(2):
        assert (tmp_path / f"engine-teardown-{rank}.txt").read_text() == "group freed", \
            "a dropped pipeline engine kept the process group alive (a reference cycle)"
        extra = extras[rank]
        # M = 1: F0, F1, B1, B0 one after the other, and rank 0 computes first and last, so the common wall holds
        # every busy second of both ranks one after the other: the bubble is at least (S - 1) / S = 1/2 in every
        # step; 0.01 for rounding (seen over 5 runs: 0.511-0.539; each rank's own wall read 0.416-0.424)
        for fraction, ideal, _ in extra["bubble_m1"]:
            assert ideal == pytest.approx(1 / 2)
            assert fraction >= 1 / 2 - 0.01, (rank, extra["bubble_m1"])
        # above: overhead only, which a loaded VM adds to some steps: bounded in the median step
        fractions = sorted(fraction for fraction, _, _ in extra["bubble_m1"])
        assert fractions[len(fractions) // 2] <= 1 / 2 + 0.3, (rank, extra["bubble_m1"])
        reference = TorchReference(make_model(blocks=2))
        assert extra["varying_losses"] == pytest.approx([reference.step(b) for b in varying_batches(seed)], rel=1e-5)
        for name, p in reference.model.named_parameters():
            torch.testing.assert_close(extra["varying_master"][name].double(), p.detach(), rtol=1e-5,
                                       atol=1e-5 * p.detach().abs().max().item(), msg=f"varying batches: {name}")
        assert extra["kept"] == 2
        # float16 with loss scaling: GradScaler's decisions step for step (3 micro-batches, each loss times the
        # scale, their gradient divided by 3 after backward: pipelining's scale_grads), the weights following
        # GradScaler + torch.optim.AdamW
        scaled = GradScalerReference(make_model(blocks=2), FP16_SCALER, **OPT)
        expected = [scaled.step([split(b, 3)], divide_after=True) for b in fp16_batches(seed)]
        assert extra["fp16_trajectory"] == expected and any(not applied for _, applied in expected)

        class Result:  # assert_close_to's view of the rank's engine
            master_state_dict = staticmethod(lambda: extra["fp16_master"])

        assert_close_to(Result, scaled, 1e-3)
        # the BatchNorm run equals the in-process pipeline (same stages, same micro-batches): losses, weights,
        # running statistics (rank 1 has rank 0's), and a fresh engine that loaded the state holds the same buffers
        with Engine(bn_model(), loss_fn, devices=["cpu"] * 2, stages=2, **BN_OPTIONS) as local:
            bn_local_losses = [m["loss"] for m in local.fit(batches)]
            bn_local = local.state_dict()
        assert extra["bn_losses"] == pytest.approx(bn_local_losses, rel=1e-5)
        assert sorted(extra["bn_state"]["buffers"]) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
        for name, want in bn_local["buffers"].items():
            torch.testing.assert_close(extra["bn_state"]["buffers"][name], want, rtol=1e-5, atol=1e-6, msg=name)
            assert torch.equal(extra["bn_reloaded"][name], extra["bn_state"]["buffers"][name]), name
        assert not torch.equal(bn_local["buffers"]["1.running_mean"], bn_model()[1].running_mean)  # they moved
        for name, want in bn_local["master"].items():
            torch.testing.assert_close(extra["bn_state"]["master"][name], want, rtol=1e-5, atol=1e-6, msg=name)
        for name, want in extra["expected"].items():
            assert torch.equal(extra["resumed"][name], want), f"rank {rank}: resumed {name} differs"
        # rank 0 alone loaded the state: refused on every rank (the ranks trained on, a mix of two states)
        assert extra["different_states"] == (
            f"rank {rank}: the ranks' engines hold different states (this rank's version: {2 - 2 * rank}): every "
            "rank must load the same state (load_state_dict or checkpoint.load_engine on every rank); this step was "
            "refused on every rank"), extra["different_states"]
        lr = OPT['lr'] * (2 - rank)
        assert extra["different_lr"] == (
            f"rank {rank}: the ranks' engine.optimizer settings or learning rates differ (this rank's: "
            f"{AdamW(**dict(OPT, lr=lr), amsgrad=True)!r}, lr {lr!r} for update 3): a change between steps must be "
            "made on every rank, and lr_schedule must give every rank the same; this step was refused on every rank"
        ), extra["different_lr"]
        for schedule, steps in extra["bubbles"].items():  # Note [Bubble across processes]; ideal 1/5 for S=2, M=4
            measured = sorted(b for b, _, _ in steps)[1]
            assert all(ideal == pytest.approx(1 / 5) for _, ideal, _ in steps)
            # as in process (test_bubble_fraction_near_ideal), with room above for the exchanges between processes
            # (seen over 5 runs: medians 0.225-0.272, single steps 0.218-0.288; each rank's own wall, the earlier
            # definition, read 0.18-0.20, below the ideal)
            assert 1 / 5 - 0.03 <= measured <= 1 / 5 + 0.2, (schedule, measured)  # one stage at a time: 1/2
            busy = sorted(s for _, _, s in steps)[1]
            assert 0.024 * 4 <= busy <= 0.024 * 4 * 2 + 0.02, (schedule, busy)  # 4 forwards+backwards, late sleeps
            # every rank's metrics hold every stage's busy seconds, as in process (rank 0's metrics lines missed
            # stage 1's): the same list on both ranks, this rank's entry its own busy_s
            assert all(len(each) == 2 and each[rank] == own for each, (_, _, own) in
                       zip(extra["stage_busy"][schedule], steps)), (schedule, extra["stage_busy"][schedule])
            assert extra["stage_busy"][schedule] == extras[1 - rank]["stage_busy"][schedule]
            # Note [Activations across processes]: GPipe holds all 4 micro-batches, 1F1B min(S - s, M) at stage s
            peak = 4 if schedule == "gpipe" else 2 - rank
            assert all(count == peak and nbytes > 0 for count, nbytes in extra["activations"][schedule]), \
                (schedule, rank, extra["activations"][schedule])
        # bf16: as the in-process pipeline with the same autocast (2 stages, 3 micro-batches) to bf16 tolerance: the
        # library scales each micro-batch's gradient by 1/M before it is rounded into the bf16 slot, the in-process
        # pipeline after. Bound: 4 % of the model's largest update (the 4 % of _check_autocast_matches). Not of each
        # tensor's own: a last-layer bias gradient is a sum of terms that nearly cancel, so its update can be far
        # smaller than the rounding of its terms (seed 2001945550: 4.bias error 2.9e-5 against its own update 2e-4)
        initial = dict(make_model(blocks=2).named_parameters())
        with Engine(make_model(blocks=2), loss_fn, devices=["cpu"] * 2, mode="pipeline", stages=2, microbatches=3,
                    optimizer=AdamW(**dict(OPT, eps=1.0)), autocast=torch.bfloat16) as local:
            local_losses = [m["loss"] for m in local.fit(batches)]
            local_master = local.master_state_dict()
        assert extra["bf16_losses"] == pytest.approx(local_losses, rel=2e-2)
        largest = max((want - initial[name].detach()).abs().max().item() for name, want in local_master.items())
        assert largest > 0
        errors = {name: (extra["bf16_master"][name] - want).abs().max().item() for name, want in local_master.items()}
        print(f"bf16 across processes: largest error / largest update {max(errors.values()) / largest:.4f}")
        for name, error in errors.items():
            assert error <= 0.04 * largest, (name, error, largest)


def _failing_worker(rank, world, init_file, how, out_dir):
    """Rank ``FAILING[how]`` fails at step 3 (``how``: its loss raises, its layers' forward or backward raises, or it
    exits between steps 2 and 3); every rank writes what it raised and when (time.time()) to ``out_dir``, and what
    state_dict() (a collective) then raised and how long it took."""
    dist = _join_gloo_group(rank, world, init_file)
    failing, result, step = FAILING[how], "nothing raised", [0]
    saved, saved_s = "not tried", None

    def fail(kind):
        if how == kind and rank == failing and step[0] == 3:
            raise RuntimeError(f"rank {rank} fails on purpose")

    def loss(model, batch):
        fail("loss")
        return loss_fn(model, batch)

    def fail_in_backward(module, inputs, output):
        if output.requires_grad:
            output.register_hook(lambda grad: fail("backward"))

    model = make_model(blocks=2)
    model[0].register_forward_hook(lambda *_: fail("forward"))
    model[0].register_forward_hook(fail_in_backward)
    batches = make_batches(torch.Generator().manual_seed(0), 5, 12)
    try:
        with Engine(model, loss, devices=["cpu"], mode="pipeline", microbatches=3, optimizer=AdamW(**OPT),
                    pin=False) as engine:
            try:
                for i, batch in enumerate(batches):
                    step[0] = i + 1
                    if how == "exit" and rank == failing and step[0] == 3:
                        with open(f"{out_dir}/failed-at", "w") as f:
                            f.write(str(time.time()))
                        os._exit(17)
                    engine.step(batch)
            except Exception as error:  # noqa: BLE001 - what every rank raised is the test's subject
                result = f"{type(error).__name__}: {error}"
                began = time.time()
                try:  # a checkpoint after the failure (a collective): refused at once, not the group's timeout
                    engine.state_dict()
                    saved = "returned"
                except Exception as error:  # noqa: BLE001
                    saved = f"{type(error).__name__}: {error}"
                saved_s = time.time() - began
    except Exception as error:  # noqa: BLE001
        result = f"{type(error).__name__}: {error}"
    with open(f"{out_dir}/rank{rank}", "w") as f:
        json.dump({"error": result, "at": time.time(), "saved": saved, "saved_s": saved_s}, f)
    os._exit(0)  # the group is broken; its teardown is not the subject here


# (a parameter without a gradient under unused="error" was a failure here too; now every rank refuses that step:
# test_state_the_engine_does_not_follow_is_refused_on_every_rank)
FAILING = {"loss": 1, "forward": 0, "backward": 0, "exit": 1}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["loss", "forward", "backward", "exit"])
def test_a_failing_stage_process_is_named_by_the_others(tmp_path, how):
    """Engine(mode="pipeline") over 2 gloo ranks: a stage whose loss, forward or backward raises at step 3 raises
    StageError naming its stage and the original error (the backward's, not torch's "Failed to run stage backward"
    around it, nor a DistributedError blaming the healthy peer), and the other rank DistributedError naming that rank
    and its error; a rank that exits between steps is named as never reaching step 3 (Note [Naming the stage that
    failed]); both within seconds, well under the group's 30 s timeout. Then state_dict() (a collective) raises
    "an earlier step failed" at once on every rank left, instead of waiting for the group's timeout."""
    import torch.multiprocessing as mp

    context = mp.start_processes(_failing_worker, args=(2, str(tmp_path / "init"), how, str(tmp_path)), nprocs=2,
                                 join=False, start_method="spawn")
    for process in context.processes:
        process.join(timeout=90)
        assert process.exitcode is not None, "a rank still runs after 90 s"
    failed, other = FAILING[how], 1 - FAILING[how]
    survivor = json.loads((tmp_path / f"rank{other}").read_text())
    if how == "exit":
        assert context.processes[failed].exitcode == 17
        failed_at = float((tmp_path / "failed-at").read_text())
        assert survivor["error"].startswith(f"DistributedError: rank {other}: step 3 of the pipeline failed"), survivor
        assert f"rank {failed} never reached step 3 (rank {other} did;" in survivor["error"], survivor
    else:
        own = json.loads((tmp_path / f"rank{failed}").read_text())
        error = f"RuntimeError: rank {failed} fails on purpose"
        assert own["error"] == f"StageError: pipeline stage {failed} (replica 0, cpu) failed: {error}", own
        failed_at = own["at"]
        assert survivor["error"].startswith(f"DistributedError: rank {other}: step 3 of the pipeline failed"), survivor
        assert survivor["error"].endswith(f"; rank {failed} failed: StageError: pipeline stage {failed} (replica 0, "
                                          f"cpu) failed: {error}"), survivor
    assert survivor["at"] - failed_at < 15, "noticed within PRESENCE_WAIT_S (5 s) and some, not the group's timeout"
    for rank in ([other] if how == "exit" else [other, failed]):
        got = json.loads((tmp_path / f"rank{rank}").read_text())
        assert got["saved"] == f"DistributedError: rank {rank}: an earlier step failed; the group is no longer " \
                               "usable", got
        assert got["saved_s"] < 1, got


class _Caching(torch.nn.Module):
    """A layer that makes a cache at its first forward (a buffer registered as None, non-persistent) and counts its
    calls."""

    def __init__(self):
        super().__init__()
        self.l, self.calls = torch.nn.Linear(10, 10), 0
        self.register_buffer("cache", None, persistent=False)

    def forward(self, x):
        self.calls += 1
        if self.cache is None:
            self.cache = torch.ones(10)
        return self.l(x * self.cache)


class _DataDependent(torch.nn.Module):
    """A layer whose forward reads a value of its input (``.item()``): it cannot run on fake tensors."""

    def forward(self, x):
        return x * (2.0 if x.abs().max().item() >= 0 else 1.0)


def _metadata_worker(rank, world, init_file, out_dir):
    dist = _join_gloo_group(rank, world, init_file)
    try:
        batches = make_batches(torch.Generator().manual_seed(0), 4, 12)
        # both stages hold dropouts (balance [3, 4]): the masks of every step come from the rank's generator only
        options = dict(devices=["cpu"], mode="pipeline", microbatches=3, schedule="gpipe", balance=[3, 4],
                       optimizer=AdamW(**OPT), pin=False, seed=5)
        calls = []

        def counting(model, batch):
            calls.append(tuple(batch[0].shape))
            return loss_fn(model, batch)

        with Engine(make_model(blocks=2, dropout=0.5), counting, **options) as whole:
            metrics = whole.fit(batches)
            expected = whole.master_state_dict()
        with Engine(make_model(blocks=2, dropout=0.5), loss_fn, **options) as first:
            first.fit(batches[:2])
            state = first.state_dict()
        with Engine(make_model(blocks=2, dropout=0.5, seed=9), loss_fn, **options) as second:
            second.load_state_dict(state)
            second.fit(batches[2:])
            got = second.master_state_dict()
        # a model the fake forward cannot run: torch infers the metadata at the first step, with a warning
        data_dependent = make_model(blocks=2)
        data_dependent.insert(2, _DataDependent())
        with pytest.warns(RuntimeWarning, match="could not be computed on fake tensors"):
            with Engine(data_dependent, loss_fn, devices=["cpu"], mode="pipeline", microbatches=3, balance=[3, 3],
                        optimizer=AdamW(**OPT), pin=False) as fallback:
                fallback_losses = [m["loss"] for m in fallback.fit(batches)]
        torch.save({"expected": expected, "got": got, "calls": calls, "fallback_losses": fallback_losses,
                    "peaks": [(m["activation_peak"], m["activation_peak_bytes"]) for m in metrics]},
                   f"{out_dir}/metadata-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_stages_across_processes_run_no_hidden_forward(tmp_path):
    """Note [Static stage metadata]: each PipelineStage gets its input and output metadata, so torch runs no forward,
    backward or loss of its own at the first step of a batch shape (torch 2.14's metadata inference did: it drew
    dropout masks from the rank's generator right after it was seeded, called loss_fn on uninitialised activations,
    and counted in step 1's metrics). On 2 gloo ranks, dropout in both stages: resuming from state_dict() after 2
    of 4 steps is bit-identical to the uninterrupted run; loss_fn runs once per real micro-batch (M per step, on the
    last rank only); step 1's activation peak (count and bytes) is every later step's. A model the fake forward
    cannot run still trains (torch infers the metadata), with a warning."""
    import torch.multiprocessing as mp

    mp.spawn(_metadata_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"metadata-{rank}.pt", weights_only=False)
        for name, want in got["expected"].items():
            assert torch.equal(got["got"][name], want), f"rank {rank}: resumed {name} differs"
        assert got["calls"] == ([(4, 16)] * 3 * 4 if rank == 1 else []), (rank, got["calls"])
        assert all(peak == got["peaks"][0] for peak in got["peaks"][1:]), (rank, got["peaks"])
        assert len(got["fallback_losses"]) == 4 and all(math.isfinite(loss) for loss in got["fallback_losses"])


def test_stage_metadata_comes_from_fake_tensors():
    """Note [Static stage metadata]: stage_inputs gives each stage's input as meta tensors with the shape, strides,
    dtype (under autocast too) and requires_grad the real forward gives, and leaves everything as it was: the random
    state (a dropout), the BatchNorm statistics, the weights."""
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.5),
                                torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)).train()
    model[0].requires_grad_(False)  # stage 0's output needs no gradient
    sizes = [1, 2, 1, 1, 1]
    x, cpu = torch.randn(4, 10), torch.device("cpu")
    for context in (lambda d: contextlib.nullcontext(), lambda d: torch.autocast(d.type, dtype=torch.bfloat16)):
        real, want = x, [x]
        for module in split_layers(list(copy.deepcopy(model)._modules.items()), sizes)[:-1]:
            with context(cpu):
                real = module(real)
            want.append(real)
        before, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()
        got = pipeline_distributed.stage_inputs(split_layers(list(model._modules.items()), sizes), x, cpu, context)
        assert [(t.shape, t.stride(), t.dtype, t.requires_grad, t.device.type) for t in got] == \
            [(t.shape, t.stride(), t.dtype, t.requires_grad, "meta") for t in want]
        assert torch.equal(torch.get_rng_state(), rng)
        for name, value in model.state_dict().items():
            assert torch.equal(value, before[name]), name
    assert [t.requires_grad for t in got] == [False, False, True, True, True]
    # the layers are the user's model's: what a forward assigns to its module is undone (a cache made at the first
    # forward stayed in the user's model as a FakeTensor, and a call counter counted the fake forward)
    cached = torch.nn.Sequential(_Caching(), torch.nn.Linear(10, 10), _Caching(), torch.nn.Linear(10, 3))
    shapes = pipeline_distributed.stage_inputs(split_layers(list(cached._modules.items()), [2, 2]), x, cpu,
                                               lambda d: contextlib.nullcontext())
    assert [tuple(t.shape) for t in shapes] == [(4, 10), (4, 10)]
    assert (cached[0].cache, cached[0].calls, list(cached[0]._buffers)) == (None, 0, ["cache"])
    cached(x)  # the user's model runs as it would have: the forward makes its cache
    assert type(cached[0].cache) is torch.Tensor and cached[0].calls == 1
    assert got[1].dtype == torch.bfloat16  # a Linear's output under autocast
    # a forward that reads a value (meta tensors have none): the caller falls back to torch's inference
    with pytest.raises(torch._subclasses.fake_tensor.DataDependentOutputException):
        pipeline_distributed.stage_inputs([torch.nn.Sequential(_DataDependent()), torch.nn.Sequential()],
                                          torch.randn(4, 10), cpu, lambda d: contextlib.nullcontext())


def _batch_kinds_worker(rank, world, init_file, out_dir):
    dist = _join_gloo_group(rank, world, init_file)
    try:
        inputs = [x for x, _ in make_batches(torch.Generator().manual_seed(3), 4, 12)]
        with Engine(make_model(), _energy, devices=["cpu"], mode="pipeline", microbatches=3, optimizer=AdamW(**OPT),
                    pin=False) as engine:
            losses = [engine.step((x, None))["loss"] for x in inputs[:2]]
            refused = []
            for bad in (({"x": inputs[2]}, None), ((inputs[2],), None), (inputs[2], {"y": inputs[2]}),
                        (inputs[2], None, None)):
                try:
                    engine.step(bad)
                except ValueError as error:
                    refused.append(str(error))
            losses += [engine.step((x, None))["loss"] for x in inputs[2:]]  # the group is still usable
            torch.save({"losses": losses, "refused": refused, "master": engine.master_state_dict()},
                       f"{out_dir}/kinds-{rank}.pt")
    finally:
        dist.destroy_process_group()


class _Transposed(torch.nn.Module):
    """A stage output that is not contiguous: (N, 4, 3) -> a transposed (N, 3, 4) view."""

    def forward(self, x):
        return x.view(x.shape[0], 4, 3).transpose(1, 2)


class _Pair(torch.nn.Module):
    def forward(self, x):
        return x, x


def _transposed_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 12), _Transposed(), torch.nn.Flatten(), torch.nn.Linear(12, 3))


class _Long(torch.nn.Module):
    """Integer activations (indices for the next stage's Embedding): no gradient can go back through them."""

    def forward(self, x):
        return (x.abs() * 10).long().clamp(max=15)


def _in_place_model():
    """balance="params" puts the in-place ReLU first in the last stage ([1, 4]: Note [A stage's input is its own])."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(inplace=True), torch.nn.Linear(16, 16),
                               torch.nn.ReLU(inplace=True), torch.nn.Linear(16, 3))


def _stage_kinds_worker(rank, world, init_file, out_dir):
    dist = _join_gloo_group(rank, world, init_file)
    try:
        batches = make_batches(torch.Generator().manual_seed(5), 4, 12)
        poisoned = (batches[1][0].clone(), batches[1][1])
        poisoned[0][0, 0] = float("nan")
        out = {}
        with Engine(_transposed_model(), loss_fn, devices=["cpu"], mode="pipeline", microbatches=2, pin=False,
                    optimizer=AdamW(**OPT), nonfinite="raise", balance=[2, 2]) as engine:
            out["losses"] = [engine.step(batches[0])["loss"]]
            try:
                engine.step(poisoned)
            except FloatingPointError as error:
                out["raised"] = str(error)
            out["losses"] += [engine.step(b)["loss"] for b in batches[2:]]  # the group is still usable
            out["master"] = engine.master_state_dict()
        for what, layers, balance in (
                ("tuple", [torch.nn.Linear(10, 12), _Pair(), torch.nn.Linear(12, 3)], [2, 1]),
                ("long", [torch.nn.Linear(10, 4), _Long(), torch.nn.Embedding(16, 3), torch.nn.Flatten(),
                          torch.nn.Linear(12, 3)], [2, 3])):
            try:
                with Engine(torch.nn.Sequential(*layers), loss_fn, devices=["cpu"], mode="pipeline", microbatches=2,
                            pin=False, balance=balance) as engine:
                    engine.step(batches[0])
            except Exception as error:  # noqa: BLE001 - reported to the test
                out[what] = f"{type(error).__name__}: {error}"
        with Engine(_in_place_model(), loss_fn, devices=["cpu"], mode="pipeline", microbatches=3, pin=False,
                    optimizer=AdamW(**OPT)) as engine:
            out["in_place"] = [engine.step(b)["stage_sizes"] for b in batches]
            out["in_place_master"] = engine.master_state_dict()
        torch.save(out, f"{out_dir}/stage-kinds-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_stage_outputs_and_a_raised_nonfinite_step_across_processes(tmp_path):
    """Across processes: a stage whose output is not contiguous trains as in process (gloo refused it on both
    ranks, each naming the other); nonfinite="raise" raises FloatingPointError on every rank and the engine goes on
    (it was taken for a failed rank: every later step refused); a stage returning a tuple is one ValueError naming
    it on every rank (a TypeError from inside torch's schedule, blaming the other rank), as is one returning integer
    activations (they trained stage 0 on zero gradients); a stage whose first layer is in place (ReLU(inplace=True))
    trains as in process (it failed: "a view of a leaf Variable ... is being used in an in-place operation")."""
    import torch.multiprocessing as mp

    mp.spawn(_stage_kinds_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    batches = make_batches(torch.Generator().manual_seed(5), 4, 12)
    poisoned = (batches[1][0].clone(), batches[1][1])
    poisoned[0][0, 0] = float("nan")
    with Engine(_transposed_model(), loss_fn, devices=["cpu"] * 2, mode="pipeline", stages=2, microbatches=2,
                optimizer=AdamW(**OPT), nonfinite="raise", balance=[2, 2], pin=False) as local:
        losses = [local.step(batches[0])["loss"]]
        with pytest.raises(FloatingPointError):
            local.step(poisoned)
        losses += [local.step(b)["loss"] for b in batches[2:]]
        master = local.master_state_dict()
    with Engine(_in_place_model(), loss_fn, devices=["cpu"] * 2, mode="pipeline", stages=2, microbatches=3,
                optimizer=AdamW(**OPT), pin=False) as local:
        local.fit(batches)
        in_place = local.master_state_dict()
    for rank in range(2):
        got = torch.load(tmp_path / f"stage-kinds-{rank}.pt", weights_only=False)
        assert "non-finite" in got["raised"], got
        assert got["losses"] == pytest.approx(losses, rel=1e-6)
        for name, value in master.items():
            torch.testing.assert_close(got["master"][name], value, rtol=1e-6, atol=1e-7)
        assert got["tuple"].startswith("ValueError: mode='pipeline' across processes: stage 0's output is a tuple"), got
        assert got["long"].startswith("ValueError: mode='pipeline' across processes: stage 0's output is a "
                                      "torch.int64 tensor; a stage before the last must return one floating-point"), got
        assert got["in_place"] == [[1, 4]] * len(batches)
        for name, value in in_place.items():
            torch.testing.assert_close(got["in_place_master"][name], value, rtol=1e-6, atol=1e-7)


def _energy(model, batch):
    """A loss that needs no targets: (inputs, None) batches."""
    x, targets = batch
    assert targets is None
    return model(x).pow(2).mean()


@pytest.mark.timeout(120)
def test_batches_without_targets_across_processes(tmp_path):
    """Note [Batches without targets across processes]: (inputs, None) batches train on 2 gloo ranks as in the
    in-process pipeline (the loss gets None); inputs or targets the pipeline cannot carry (a dict, a tuple) are the
    same ValueError on every rank, and the engine still steps afterwards (they broke it for good: AttributeError in
    the batch check)."""
    import torch.multiprocessing as mp

    mp.spawn(_batch_kinds_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    inputs = [x for x, _ in make_batches(torch.Generator().manual_seed(3), 4, 12)]
    with Engine(make_model(), _energy, devices=["cpu"] * 2, mode="pipeline", stages=2, microbatches=3,
                optimizer=AdamW(**OPT), pin=False) as local:
        local_losses = [local.step((x, None))["loss"] for x in inputs]
        local_master = local.master_state_dict()
    got = [torch.load(tmp_path / f"kinds-{rank}.pt", weights_only=False) for rank in range(2)]
    assert got[0]["refused"] == got[1]["refused"] and len(got[0]["refused"]) == 4
    assert "needs the inputs of each (inputs, targets) batch as one tensor; got dict" in got[0]["refused"][0]
    assert "needs the inputs of each (inputs, targets) batch as one tensor; got tuple" in got[0]["refused"][1]
    assert "needs the targets of each (inputs, targets) batch as one tensor or None; got dict" in got[0]["refused"][2]
    assert "needs each batch as (inputs, targets)" in got[0]["refused"][3]
    assert got[0]["refused"][3].endswith("got a tuple of 3")
    for rank in range(2):
        assert got[rank]["losses"] == pytest.approx(local_losses, rel=1e-5)
        for name, want in local_master.items():
            torch.testing.assert_close(got[rank]["master"][name], want, rtol=1e-5, atol=1e-6, msg=name)



class _WritesWhenArmed(torch.nn.Module):
    """A layer whose forward, when ``armed`` names its index, writes state the engine does not follow once, before
    it uses it (so autograd sees no saved tensor changed): a trainable weight in place ("weight"), a frozen
    parameter ("frozen"), a persistent buffer registered as None ("none-buffer"); or leaves its parameter ``extra``
    out of the forward ("unused": no gradient, refused under unused="error"). ``armed`` is per process, so each
    rank (and the in-process reference) arms only its own copy of the layer."""
    armed = None  # (kind, index)

    def __init__(self, index):
        super().__init__()
        self.index, self.l = index, torch.nn.Linear(10, 10)
        self.frozen = torch.nn.Parameter(torch.zeros(10), requires_grad=False)
        self.extra = torch.nn.Parameter(torch.zeros(10))
        self.register_buffer("late", None)

    def forward(self, x):
        armed = _WritesWhenArmed.armed
        kind = None
        if armed is not None and armed[1] == self.index:
            kind = armed[0]
            if kind != "unused":  # once; "unused" holds for every micro-batch of the step (disarmed after it)
                _WritesWhenArmed.armed = None
            with torch.no_grad():
                if kind == "weight":
                    self.l.weight.clamp_(-10.0, 10.0)
                elif kind == "frozen":
                    self.frozen.add_(0.5)
                elif kind == "none-buffer":
                    self.late = x.mean(0)
        out = self.l(x + self.frozen)
        return out if kind == "unused" else out + self.extra


def _writing_model():
    """Stage 0 (of balance [2, 2]): a writing layer and a BatchNorm (buffers its rank alone updates, put back
    after a refused step); stage 1: a writing layer and the head."""
    torch.manual_seed(0)
    return torch.nn.Sequential(_WritesWhenArmed(0), torch.nn.BatchNorm1d(10), _WritesWhenArmed(1),
                               torch.nn.Linear(10, 3))


WRITES = [("weight", 0), ("weight", 1), ("frozen", 1), ("none-buffer", 0), ("unused", 1), ("unused", 0)]
WRITING_OPTIONS = dict(mode="pipeline", microbatches=2, balance=[2, 2], optimizer=AdamW(**OPT), pin=False,
                       unused="error")


def _writes(engine, batches, kind, stage):
    """Step 1, then step 2 with the layer of ``stage`` armed to write ``kind`` (refused), then the rest: the
    refusal's text (None: nothing raised), the version after it, the losses, the master weights and buffers."""
    _WritesWhenArmed.armed = None
    out = {"losses": [engine.step(batches[0])["loss"]], "refused": None}
    _WritesWhenArmed.armed = (kind, stage)  # across processes, only the rank running that stage has the layer run
    try:
        engine.step(batches[1])
    except (ValueError, RuntimeError) as error:
        out["refused"] = f"{type(error).__name__}: {error}"
    _WritesWhenArmed.armed = None
    out["version"] = engine.version
    out["losses"] += [engine.step(b)["loss"] for b in batches[2:]]
    out["master"], out["buffers"] = engine.master_state_dict(), engine.buffers_state_dict()
    return out


def _writing_worker(rank, world, init_file, out_dir):
    dist = _join_gloo_group(rank, world, init_file)
    try:
        batches = make_batches(torch.Generator().manual_seed(7), 4, 12)
        out = []
        for kind, stage in WRITES:
            with Engine(_writing_model(), loss_fn, devices=["cpu"], **WRITING_OPTIONS) as engine:
                out.append(_writes(engine, batches, kind, stage))
        torch.save(out, f"{out_dir}/writes-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_state_the_engine_does_not_follow_is_refused_on_every_rank(tmp_path):
    """Note [A step refused on every rank]: across processes a stage's forward that wrote a trainable weight in
    place, a frozen parameter, or set a persistent buffer registered as None trained on without a word (the
    in-process pipeline refuses each: Note [Weights changed in place by a step], Note [Model state the engine does
    not follow]). Now the step is refused on both ranks: the refusing rank raises the in-process pipeline's
    StageError word for word (naming the parameter), the other a DistributedError naming it; nothing of it counts
    (version, the BatchNorm's statistics of the refused batch), and the engine steps on to the in-process
    pipeline's weights and buffers, bit for bit. A trainable parameter without a gradient under unused="error" (its
    rank raised alone, the peer blocked in the step's all-reduce: the group broken) is refused the same way."""
    import torch.multiprocessing as mp

    mp.spawn(_writing_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    batches = make_batches(torch.Generator().manual_seed(7), 4, 12)
    got = [torch.load(tmp_path / f"writes-{rank}.pt", weights_only=False) for rank in range(2)]
    for i, (kind, stage) in enumerate(WRITES):
        with Engine(_writing_model(), loss_fn, devices=["cpu"] * 2, stages=2, **WRITING_OPTIONS) as local:
            want = _writes(local, batches, kind, stage)
        assert want["refused"] is not None and want["version"] == 1, want["refused"]
        name = f"{2 * stage}." + {"weight": "l.weight", "frozen": "frozen", "none-buffer": "late",
                                  "unused": "extra"}[kind]
        what = {"weight": f"ValueError: stage {stage} (replica 0): the step wrote the trainable parameter(s) '{name}' "
                          "in place",
                "frozen": f"ValueError: stage {stage} (replica 0): the step wrote the frozen parameter(s) '{name}' "
                          "in place",
                "none-buffer": f"ValueError: stage {stage} (replica 0): the step set the buffer(s) '{name}', "
                               "registered as None when the engine was built",
                "unused": f"RuntimeError: 1 parameter(s) of this stage received no gradient: ['{name}']; pass "
                          "unused='zero' or freeze them"}[kind]
        why = ("had trainable parameter(s) that received no gradient, with unused='error'" if kind == "unused" else
               "wrote state the engine does not follow")
        assert want["refused"].startswith(f"StageError: pipeline stage {stage} (replica 0, cpu) failed: {what}"), \
            want["refused"]
        for rank in range(2):
            case = got[rank][i]
            if rank == stage:  # the in-process pipeline's error, word for word
                assert case["refused"] == want["refused"], case["refused"]
            else:
                assert case["refused"] == (f"DistributedError: rank {rank}: the step was refused on every rank: the "
                                           f"stage of rank {stage} {why} (its own error names it and the remedy); "
                                           "nothing of the step was applied, the group stays usable"), \
                    case["refused"]
            assert case["version"] == 1 and case["losses"] == want["losses"], (case["version"], case["losses"])
            for name, value in want["master"].items():
                assert torch.equal(case["master"][name], value), (kind, rank, name)
            for name, value in want["buffers"].items():
                assert torch.equal(case["buffers"][name], value), (kind, rank, name)


def _empty_stage_worker(rank, world, init_file, out_dir):
    dist = _join_gloo_group(rank, world, init_file)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3), torch.nn.Tanh())
    try:  # balance [3, 1]: stage 1 is a Tanh
        Engine(model, loss_fn, devices=["cpu"], mode="pipeline", microbatches=2, balance=[3, 1], pin=False)
        result = "constructed"
    except Exception as error:  # noqa: BLE001 - what every rank raised is the test's subject
        result = f"{type(error).__name__}: {error}"
    with open(f"{out_dir}/rank{rank}", "w") as f:
        f.write(result)
    # the empty stage's rank stays (as a process that catches the error would) until rank 0 has its answer, 60 s
    # at most: rank 0 must not need it to exit
    deadline = time.time() + 60
    while rank == 1 and not os.path.exists(f"{out_dir}/rank0") and time.time() < deadline:
        time.sleep(0.05)
    if rank == 1:  # rank 0's answer came while this rank still stayed, or only once it gave up
        with open(f"{out_dir}/rank1-left", "w") as f:
            f.write("saw rank 0's answer" if os.path.exists(f"{out_dir}/rank0") else "deadline")
    os._exit(0)


@pytest.mark.timeout(120)
def test_a_stage_without_parameters_is_the_same_error_on_every_rank(tmp_path):
    """A stage with no trainable parameters is a ValueError on every rank (every rank checks every stage before any
    collective), not on that stage's rank only while the others wait in the construction's broadcast."""
    import torch.multiprocessing as mp

    context = mp.start_processes(_empty_stage_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                                 join=False, start_method="spawn")
    for process in context.processes:
        process.join(timeout=90)
        assert process.exitcode == 0, "a rank still runs after 90 s"
    for rank in range(2):
        assert (tmp_path / f"rank{rank}").read_text() == ("ValueError: stage 1 has no trainable parameters (stage "
                                                          "sizes [3, 1]); choose another balance"), rank
    assert (tmp_path / "rank1-left").read_text() == "saw rank 0's answer", "rank 0 waited for rank 1"


class _TanhSeen(torch.nn.Module):
    """Tanh that adds each batch's mean input into column 0 of a non-contiguous buffer (a transposed one): a stage's
    buffer whose bytes the gather must bring in place."""

    def __init__(self, width):
        super().__init__()
        self.register_buffer("seen", torch.zeros(2, width).t())

    def forward(self, x):
        with torch.no_grad():
            self.seen[:, 0].add_(x.detach().mean(0))
        return torch.tanh(x)


def frozen_bn_model(seed):
    """Stage 1 (of balance [2, 4]) holds a frozen Linear, a BatchNorm with statistics away from their init, an
    int16 buffer (a dtype gloo does not broadcast: Note [Tensors travel as bytes]) and a non-contiguous buffer that
    every forward changes: state that is not in the host store."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.BatchNorm1d(16), _TanhSeen(16), torch.nn.Linear(16, 3))
    assert not model[4].seen.is_contiguous()
    model[2].requires_grad_(False)
    with torch.no_grad():
        model[3].running_mean.normal_()
        model[3].running_var.uniform_(0.5, 2.0)
    model[2].register_buffer("levels", torch.randint(-300, 300, (5,), dtype=torch.int16))
    return model


FROZEN_OPTIONS = dict(mode="pipeline", microbatches=2, schedule="gpipe", balance=[2, 4], optimizer=AdamW(**OPT),
                      pin=False)


def _rank0_init_worker(rank, world, init_file, out_dir):
    dist = _join_gloo_group(rank, world, init_file)
    try:
        with Engine(frozen_bn_model(seed=rank), loss_fn, devices=["cpu"], **FROZEN_OPTIONS) as engine:
            # no second copy of the frozen weights and buffers stays behind after the broadcast (its work is kept:
            # Note [Gloo's works are released by the thread that waits]); the store's own weights are the others
            arena = engine.store.param.untyped_storage().data_ptr()
            tensors = [t for work in engine.collective_works.works for t in work.result()]
            assert len(tensors) >= 2, len(tensors)  # the store's weights and one flat buffer per dtype at least
            kept = sum(t.untyped_storage().nbytes() for t in tensors if t.untyped_storage().data_ptr() != arena)
            losses = [engine.step(b)["loss"] for b in make_batches(torch.Generator().manual_seed(1), 3, 8)]
            exported = frozen_bn_model(seed=rank)
            engine.copy_to(exported)  # a collective: rank 1's stage holds the frozen layer, rank 0 checks its copy
            refused = None
            try:
                engine.copy_to(frozen_bn_model(seed=7))
            except ValueError as error:
                refused = str(error)
            torch.save({"losses": losses, "state": engine.state_dict(), "kept": kept, "refused": refused,
                        "exported": {n: p for n, p in exported.named_parameters() if not p.requires_grad}},
                       f"{out_dir}/init-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_every_rank_starts_from_rank0s_frozen_parameters_and_buffers(tmp_path):
    """Note [Every rank starts from rank 0's model]: each rank builds the model from its own seed; the construction
    broadcasts rank 0's frozen parameters and buffers (BatchNorm statistics) with its weights, so the 2 gloo ranks
    train as the in-process pipeline of rank 0's model: losses, weights and buffers."""
    import torch.multiprocessing as mp

    mp.spawn(_rank0_init_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    with Engine(frozen_bn_model(seed=0), loss_fn, devices=["cpu"] * 2, stages=2, **FROZEN_OPTIONS) as local:
        local_losses = [local.step(b)["loss"] for b in make_batches(torch.Generator().manual_seed(1), 3, 8)]
        want = local.state_dict()
    frozen = {n: p for n, p in frozen_bn_model(seed=0).named_parameters() if not p.requires_grad}
    for rank in range(2):
        got = torch.load(tmp_path / f"init-{rank}.pt", weights_only=False)
        assert got["kept"] == 0, rank
        # copy_to: rank 1 (the frozen layer's stage) writes rank 0's frozen layer (it exported its own); rank 0
        # holds no copy of it, and refuses a model whose frozen layer is not the one trained with
        assert got["exported"].keys() == frozen.keys() == {"2.weight", "2.bias"}
        assert all(torch.equal(got["exported"][n], frozen[n]) for n in frozen), rank
        assert got["refused"] == (None if rank else "copy_to: the model's frozen parameters ['2.weight', '2.bias'] "
                                  "differ from those the engine trained with (rank 0's), which this rank's pipeline "
                                  "stage does not hold: call copy_to on a model built as rank 0's (its frozen "
                                  "parameters), or on the rank of their stage"), got["refused"]
        assert got["losses"] == pytest.approx(local_losses, rel=1e-5), rank
        for part in ("master", "buffers"):
            for name, value in want[part].items():
                torch.testing.assert_close(got["state"][part][name], value, rtol=1e-5, atol=1e-6,
                                           msg=f"rank {rank} {part} {name}")


# microbatches, max_grad_norm, batch sizes, schedule (1F1B needs M >= S)
REPLICA_RUNS = ((3, 0.05, (12, 18, 12), "1f1b"), (1, None, (13, 7), "gpipe"))


def _replicas_worker(rank, world, init_file, seed, out_dir):
    """Engine(mode="pipeline", stages=2) on 4 ranks: 2 replicas of 2 stages (Note [Replicas of stages across
    processes]); uneven replica shards in the second run (13 = 7 + 6, 7 = 4 + 3)."""
    dist = _join_gloo_group(rank, world, init_file)
    try:
        out = {}
        for microbatches, clip, sizes, schedule in REPLICA_RUNS:
            rng = torch.Generator().manual_seed(seed + microbatches)
            with Engine(make_model(blocks=2), loss_fn, devices=["cpu"], mode="pipeline", stages=2,
                        microbatches=microbatches, schedule=schedule, optimizer=AdamW(**OPT, max_grad_norm=clip),
                        pin=False) as engine:
                metrics = [engine.step(make_batches(rng, 1, n)[0]) for n in sizes]
                out[microbatches] = {"losses": [m["loss"] for m in metrics], "state": engine.state_dict(),
                                     "where": (metrics[0]["stage"], metrics[0]["replica"], metrics[0]["replicas"])}
            del engine
        rng = torch.Generator().manual_seed(seed)  # BatchNorm: replica 0's statistics, as in process
        with Engine(bn_model(), loss_fn, devices=["cpu"], stages=2, **BN_OPTIONS) as bn:
            out["bn_losses"] = [bn.step(make_batches(rng, 1, n)[0])["loss"] for n in (12, 18, 12)]
            out["bn_live"] = {k: v.clone() for k, v in bn.pipeline.module.named_buffers()}  # before a gather
            out["bn_state"] = bn.state_dict()
        del bn
        out["tied"] = _tied_runs(rank, seed)  # Note [Parameters tied across processes], with replicas
        torch.save(out, f"{out_dir}/replicas-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_engine_with_replicas_over_processes_equals_single_device(rng, tmp_path):
    """2 stages x 2 replicas on 4 gloo ranks: every rank's weights, Adam state and losses equal float64 torch AdamW
    on the whole batch, with clipping, M = 3 and, with uneven replica shards, M = 1; so do models with parameters tied
    across the stages; BatchNorm statistics equal the in-process pipeline x hybrid's."""
    import torch.multiprocessing as mp

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    mp.spawn(_replicas_worker, args=(4, str(tmp_path / "init"), seed, str(tmp_path)), nprocs=4)
    got = [torch.load(tmp_path / f"replicas-{r}.pt", weights_only=False) for r in range(4)]
    for microbatches, clip, sizes, _ in REPLICA_RUNS:
        batches_rng = torch.Generator().manual_seed(seed + microbatches)
        reference = TorchReference(make_model(blocks=2))
        ref_losses = [reference.step(make_batches(batches_rng, 1, n)[0], clip) for n in sizes]
        ref_state = reference.opt.state_dict()["state"]
        names = [n for n, _ in reference.model.named_parameters()]
        for rank in range(4):
            run = got[rank][microbatches]
            assert run["where"] == (rank // 2, rank % 2, 2)  # group rank s * R + r: stage s, replica r
            assert run["losses"] == pytest.approx(ref_losses, rel=1e-5)
            for i, (name, p) in enumerate(reference.model.named_parameters()):
                torch.testing.assert_close(run["state"]["master"][name].double(), p.detach(), rtol=1e-5,
                                           atol=1e-5 * p.detach().abs().max().item(), msg=_rank_msg(rank, name))
                want = ref_state[i]["exp_avg_sq"]
                have = run["state"]["optimizer"]["state"][names.index(name)]["exp_avg_sq"]
                torch.testing.assert_close(have.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    rng_bn = torch.Generator().manual_seed(seed)
    with Engine(bn_model(), loss_fn, devices=["cpu"] * 4, stages=2, **BN_OPTIONS) as local:
        losses = [local.step(make_batches(rng_bn, 1, n)[0])["loss"] for n in (12, 18, 12)]
        live = [dict(local.pipeline.stages[0][r].module.named_buffers()) for r in range(2)]
        want = local.state_dict()
    # Weights: within 0.2 % of the model's largest update. The in-process pipeline x hybrid sums the replicas in
    # another order than gloo's allreduce, and 0.weight (the bias-free Linear before the BatchNorm, over micro-batches
    # of 2 samples) has a gradient whose terms nearly cancel: its rounding is large against the gradient, and Adam
    # (eps=1e-3) carries it into the update. Measured over 6 seeds: 0.weight 8e-6 to 3.3e-4 of the largest update,
    # every other tensor <= 4e-6 (a fixed atol of 1e-6 failed on seed 407745488, one relative to each weight's
    # largest entry on seeds 1973844847 and 1934509885).
    initial = dict(bn_model().named_parameters())
    largest = max((v - initial[n].detach()).abs().max().item() for n, v in want["master"].items())
    assert largest > 0
    for rank in range(4):
        assert got[rank]["bn_losses"] == pytest.approx(losses, rel=1e-5)
        for name, value in want["master"].items():
            error = (got[rank]["bn_state"]["master"][name] - value).abs().max().item()
            assert error <= 2e-3 * largest, (_rank_msg(rank, name), error, largest)
        for name, value in want["buffers"].items():
            torch.testing.assert_close(got[rank]["bn_state"]["buffers"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=_rank_msg(rank, name))
    _check_tied_runs([got[rank]["tied"] for rank in range(4)], seed)
    for rank in (0, 1):  # stage 0's replicas: each started every step from replica 0's statistics (broadcast_buffers)
        for name, value in got[rank]["bn_live"].items():
            torch.testing.assert_close(value, live[rank][name], rtol=1e-5, atol=1e-6, msg=_rank_msg(rank, name))


# ---- parameters tied across processes (Note [Parameters tied across processes]) ----

# case, balance (2 stages), microbatches, max_grad_norm, batch sizes (each replica's shard splits into M equal parts)
TIED_RUNS = (("embedding", [2, 3], 3, 0.05, (12, 18, 6)), ("module", [3, 2], 2, None, (8, 12, 4)))
TIED_NAMES = {"embedding": ["0.weight"], "module": ["0.weight", "0.bias"]}


def tied_case(case, seed=0):
    """(model, loss, batches(seed, sizes)) of a TIED_RUNS case."""
    def batches(data_seed, sizes):
        rng = torch.Generator().manual_seed(data_seed)
        if case == "embedding":
            return [(torch.randint(0, 11, (n, 3), generator=rng), torch.randint(0, 11, (n, 3), generator=rng))
                    for n in sizes]
        return [(torch.randn(n, 5, generator=rng), torch.randint(0, 5, (n,), generator=rng)) for n in sizes]
    if case == "embedding":
        return tied_lm(seed=seed), lm_loss, batches
    return tied_module(seed=seed), loss_fn, batches


def _tied_runs(rank, seed):
    """Every TIED_RUNS case on 2 stages (2 ranks, or 2 x 2 with replicas), each rank from a model of its own init:
    the construction broadcasts rank 0's."""
    out = {}
    for case, balance, microbatches, clip, sizes in TIED_RUNS:
        model, loss, batches = tied_case(case, seed=rank)
        with Engine(model, loss, devices=["cpu"], mode="pipeline", stages=2, microbatches=microbatches,
                    balance=balance, optimizer=AdamW(**OPT, max_grad_norm=clip), pin=False) as engine:
            losses = [engine.step(batch)["loss"] for batch in batches(seed, sizes)]
            out[case] = {"losses": losses, "state": engine.state_dict(), "tied": engine.pipeline.tied}
        del engine
    return out


def _check_tied_runs(got, seed):
    """``got[rank]`` (from _tied_runs) against float64 torch AdamW on one copy of rank 0's model, whole batches."""
    for case, _, _, clip, sizes in TIED_RUNS:
        model, loss, batches = tied_case(case, seed=0)
        reference = copy.deepcopy(model).double()
        opt = torch.optim.AdamW(reference.parameters(), foreach=False, **OPT)
        ref_losses = []
        for x, y in batches(seed, sizes):
            opt.zero_grad()
            ref_loss = loss(reference, (x.double() if x.is_floating_point() else x, y))
            ref_loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            opt.step()
            ref_losses.append(ref_loss.item())
        names = [n for n, _ in reference.named_parameters()]
        for rank, runs in enumerate(got):
            run = runs[case]
            assert run["tied"] == {name: [0, 1] for name in TIED_NAMES[case]}
            assert run["losses"] == pytest.approx(ref_losses, rel=1e-5)
            assert sorted(run["state"]["master"]) == sorted(names)
            for i, (name, p) in enumerate(reference.named_parameters()):
                torch.testing.assert_close(run["state"]["master"][name].double(), p.detach(), rtol=1e-5,
                                           atol=1e-5 * p.detach().abs().max().item(), msg=_rank_msg(rank, name))
                want = opt.state_dict()["state"][i]["exp_avg_sq"]
                have = run["state"]["optimizer"]["state"][i]["exp_avg_sq"]
                torch.testing.assert_close(have.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item(),
                                           msg=_rank_msg(rank, f"{name} exp_avg_sq"))


TIED_BF16 = dict(mode="pipeline", stages=2, microbatches=3, balance=[2, 3], autocast=torch.bfloat16,
                 optimizer=AdamW(**dict(OPT, eps=1.0)), pin=False)  # eps=1: see _check_autocast_matches


def _tied_worker(rank, world, init_file, seed, out_dir):
    dist = _join_gloo_group(rank, world, init_file)
    try:
        out = _tied_runs(rank, seed)
        model, loss, batches = tied_case("embedding", seed=rank)
        with Engine(model, loss, devices=["cpu"], **TIED_BF16) as engine:  # bf16 gradient slots
            out["bf16"] = {"losses": [engine.step(b)["loss"] for b in batches(seed, (12, 18, 6))],
                           "master": engine.master_state_dict()}
        del engine
        torch.save(out, f"{out_dir}/tied-{rank}.pt")
    finally:
        dist.destroy_process_group()


def _dropout_replicas_worker(rank, world, init_file, out_dir):
    dist = _join_gloo_group(rank, world, init_file)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 3))
        masks = []
        with Engine(model, loss_fn, devices=["cpu"], mode="pipeline", stages=1, pin=False, seed=3) as engine:
            engine.pipeline.module[1].register_forward_hook(lambda m, i, o: masks.append(o == 0))
            engine.step((torch.ones(8, 8), torch.zeros(8, dtype=torch.long)))
        torch.save(masks[-1], f"{out_dir}/mask-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_replicas_of_a_stage_across_processes_draw_their_own_masks(tmp_path):
    """Two ranks, one stage of two data-parallel replicas, the same input: each rank's stage draws from its own
    generator (Note [Random numbers of concurrent workers]), not the same masks from the same seed."""
    import torch.multiprocessing as mp

    mp.spawn(_dropout_replicas_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    masks = [torch.load(tmp_path / f"mask-{r}.pt") for r in range(2)]
    assert masks[0].shape == masks[1].shape and not torch.equal(masks[0], masks[1])


@pytest.mark.timeout(120)
def test_tied_parameters_across_processes_equal_single_device(rng, tmp_path):
    """An embedding tied to the output layer, and one Linear used in both stages, on 2 gloo ranks (one stage each,
    each rank built from its own init): losses, weights and Adam state equal float64 torch AdamW on rank 0's model,
    with global-norm clipping in the first case; under bf16 autocast the embedding case equals the in-process
    pipeline's to bf16 tolerance."""
    import torch.multiprocessing as mp

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    mp.spawn(_tied_worker, args=(2, str(tmp_path / "init"), seed, str(tmp_path)), nprocs=2)
    got = [torch.load(tmp_path / f"tied-{r}.pt", weights_only=False) for r in range(2)]
    _check_tied_runs(got, seed)
    # bf16 autocast: as the in-process pipeline under the same autocast, to bf16 tolerance (the library scales each
    # micro-batch's gradient by 1/M before the bf16 rounding, the in-process pipeline after): 4 % of the model's
    # largest update, as across processes above (measured in 2 runs: at most 0.4 % of each tensor's own update; a
    # bound per tensor is at the mercy of a tensor whose update happens to be small, as 6.bias's was there)
    model, loss, batches = tied_case("embedding")
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    with Engine(model, loss, devices=["cpu"] * 2, **TIED_BF16) as local:
        local_losses = [local.step(b)["loss"] for b in batches(seed, (12, 18, 6))]
        local_master = local.master_state_dict()
    largest = max((want - initial[name]).abs().max().item() for name, want in local_master.items())
    assert largest > 0
    for rank in range(2):
        assert got[rank]["bf16"]["losses"] == pytest.approx(local_losses, rel=2e-2)
        for name, want in local_master.items():
            error = (got[rank]["bf16"]["master"][name] - want).abs().max().item()
            assert error <= 0.04 * largest, (f"rank {rank} {name}", error, largest)


def test_engine_over_process_group_bad_options(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'init'}")
    try:
        group = dist.group.WORLD
        for options, match in ((dict(stages=2), r"stages must be None \(one stage per rank\) or a divisor of 1"),
                               (dict(devices=["cpu"] * 2), "one stage on one device"),
                               (dict(balance="time"), "balance='time' is not supported across processes"),
                               (dict(schedule="zb"), "schedule must be one of"),
                               (dict(microbatches=0), "microbatches must be an int"),
                               (dict(microbatches=True), "microbatches must be an int"),
                               (dict(stages=True), r"stages must be None \(one stage per rank\)")):
            options = dict(dict(devices=["cpu"]), **options)
            with pytest.raises(ValueError, match=match):
                Engine(make_model(), loss_fn, mode="pipeline", process_group=group, pin=False, **options)
    finally:
        dist.destroy_process_group()


def test_batch_checksum_does_not_depend_on_the_thread_count():
    """Note [The same batch on every rank]: ranks may run different intra-op thread counts; the fingerprint of the
    same batch must still be the same bits (a float64 sum's last bits are not), and a changed batch must differ."""
    from pyengine.pipeline_distributed import batch_checksum
    x = torch.randn(3 * 64 * 64 * 64, dtype=torch.float32)
    threads = torch.get_num_threads()
    try:
        seen = []
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            seen.append((batch_checksum(x), x.double().sum().item()))
    finally:
        torch.set_num_threads(threads)
    assert len({c for c, _ in seen}) == 1
    print("float64 sums by thread count:", [s.hex() for _, s in seen])  # the premise, where the cores allow it
    y = x.clone()
    y[12345] = torch.nextafter(y[12345], torch.tensor(float("inf")))
    assert batch_checksum(y) != batch_checksum(x)
    assert batch_checksum(x.view(64, -1)[:, ::2]) == batch_checksum(x.view(64, -1)[:, ::2].contiguous())
    for t in (torch.arange(7), torch.ones(3, dtype=torch.bool), x[:9].bfloat16(), torch.zeros(0)):
        assert batch_checksum(t) == batch_checksum(t.clone())
    # The same bytes as another shape (another micro-batch split) or dtype are another batch.
    assert batch_checksum(x[:24].view(4, 6)) != batch_checksum(x[:24].view(6, 4))
    assert batch_checksum(torch.zeros(4, dtype=torch.int32)) != batch_checksum(torch.zeros(4))
    assert batch_checksum(torch.zeros(0, 3)) != batch_checksum(torch.zeros(0, 5))


def test_in_place_first_layer_of_a_stage(rng):
    """Note [A stage's input is its own]: balance="params" puts parameter-free layers at the start of the next
    stage; an in-place one (ReLU(inplace=True)) there must work and train as on one device."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(inplace=True), torch.nn.Linear(16, 16),
                                torch.nn.ReLU(inplace=True), torch.nn.Linear(16, 3))
    reference = TorchReference(model)
    with pipeline(model, ["cpu"] * 2, stages=2, microbatches=3) as engine:
        for b in make_batches(rng, 4, 12):
            metrics = engine.step(b)
            reference.step(b)
        assert metrics["stage_sizes"] == [1, 4]  # the premise: stage 1 starts with the in-place ReLU
        assert_matches(engine, reference)


@pytest.mark.parametrize("mode,workers,options", [("hybrid", 2, {}), ("pipeline", 2, dict(stages=2, microbatches=2)),
                                                  ("pipeline", 4, dict(stages=2, microbatches=1))],
                         ids=["hybrid-2-workers", "pipeline-2-microbatches", "pipeline-2-replicas"])
def test_an_in_place_first_layer_of_the_model(rng, mode, workers, options):
    """Note [A shard's own version counter]: the workers' shards (the micro-batches) are views of one batch, which
    share its version counter: one shard's in-place ReLU made another's backward fail ("modified by an inplace
    operation"). Each trains as on one device."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ReLU(inplace=True), torch.nn.Linear(10, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3))
    reference = TorchReference(model)
    with Engine(model, loss_fn, devices=["cpu"] * workers, mode=mode, optimizer=AdamW(**OPT), **options) as engine:
        for b in make_batches(rng, 3, 12):
            engine.step((b[0].clone(), b[1]))
            reference.step(b)
        assert_matches(engine, reference)


@pytest.mark.parametrize("balance", ["params", "time"])
def test_a_sparse_embedding_is_refused_when_the_engine_is_built(balance):
    """The store holds dense gradients: hybrid refused nn.Embedding(sparse=True) when built, the pipeline took it and
    failed every step after the whole forward and backward, inside torch ("copy_() between dense and sparse")."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 6, sparse=True), torch.nn.Linear(6, 3))
    with pytest.raises(ValueError, match=r"pipeline: \['0.weight'\] make sparse gradients \(sparse=True\)"):
        pipeline(model, ["cpu"] * 2, stages=2, balance=balance)
    model[0].weight.requires_grad_(False)  # a frozen one makes no gradient
    pipeline(model, ["cpu"] * 2, stages=2, balance=balance).close()


def test_activation_bytes_count_the_micro_batch_not_the_whole_batch():
    """Stage 0 saves its micro-batch of the input (a view of the whole batch): counted by its own bytes."""
    stages, microbatches, batch = 2, 4, 32
    with Engine(sleep_model(stages, forward_s=0.0, backward_s=0.0), mse, devices=["cpu"] * stages, mode="pipeline",
                stages=stages, microbatches=microbatches, schedule="gpipe") as engine:
        metrics = engine.step((torch.randn(batch, 8), torch.randn(batch, 8)))
    per_microbatch = batch // microbatches * 8 * 4
    assert metrics["activation_peak_bytes"][0] == microbatches * per_microbatch


def test_balance_by_time_keeps_the_random_state_and_names_non_tensor_outputs():
    from pyengine.pipeline import measure_layer_times

    layers = [torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 8)]
    x = torch.randn(4, 8)
    state = torch.get_rng_state()
    times = measure_layer_times(layers, x)
    assert len(times) == 3 and torch.equal(torch.get_rng_state(), state)

    class Pair(torch.nn.Module):
        def forward(self, x):
            return x, x

    with pytest.raises(TypeError, match=r"layer 1 returned tuple"):
        measure_layer_times([torch.nn.Linear(8, 8), Pair(), torch.nn.Linear(8, 8)], torch.randn(4, 8))
    with pytest.raises(TypeError, match=r"layer 0 returned tuple"):
        measure_layer_times([Pair(), torch.nn.Linear(8, 8)], torch.randn(4, 8))
    assert len(measure_layer_times([torch.nn.Linear(8, 8), Pair()], torch.randn(4, 8))) == 2  # the last: anything
    with pytest.raises(TypeError, match=r"must be a tensor or a tuple / list / dict holding tensors; got str"):
        measure_layer_times([torch.nn.Linear(8, 8)], "tokens")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11's")
def test_a_layer_that_raises_while_balance_by_time_times_it_is_named(rng):
    """A layer that raises while balance="time" times it (the first step) raises its own error, of its own type,
    with a note naming the layer and what it was fed (it came out bare: nothing said it came from the timing); the
    engine builds its stages at the next good step and trains as the same split given explicitly."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                   torch.nn.Linear(16, 3))

    batches = make_batches(rng, 3, 8)
    with pipeline(model(), ["cpu"] * 2, microbatches=2, balance="time") as timed:
        with pytest.raises(ValueError, match="Expected more than 1 value per channel") as raised:
            timed.step((batches[0][0][:2], batches[0][1][:2]))  # micro-batches of one sample: BatchNorm refuses
        assert raised.value.__notes__ == [
            "(raised by layer 1, BatchNorm1d, while balance='time' timed its forward and backward on cpu, fed (1, 16) "
            "from the first micro-batch)"]
        got = [timed.step(b)["loss"] for b in batches]
        sizes, master = timed.pipeline.sizes, timed.master_state_dict()
    with pipeline(model(), ["cpu"] * 2, microbatches=2, balance=list(sizes)) as given:
        assert [given.step(b)["loss"] for b in batches] == got
        for name, want in given.master_state_dict().items():
            assert torch.equal(master[name], want), name


def test_balance_by_time_takes_tuple_inputs_and_times_on_the_stage_device(worker_device):
    """The first layer may take a tuple of tensors (the batch's inputs as they come): balance="time" times it on that
    (it was an AttributeError at the first step). Every layer is timed on stage 0's device, not on the device of the
    model and the batch (Note [Timing the layers on stage 0's device]): the CUDA twin sees only CUDA inputs."""
    seen = []

    class Product(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, pair):
            a, b = pair
            seen.append(a.device.type)
            return self.linear(a * b)

    torch.manual_seed(0)
    model = torch.nn.Sequential(Product(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), SleepLayer(forward_s=0.02))
    batch = ((torch.randn(8, 8), torch.randn(8, 8)), torch.randn(8, 8))
    with Engine(model, mse, devices=[worker_device] * 2, mode="pipeline", microbatches=2, balance="time") as engine:
        assert engine.step(batch)["stage_sizes"] == [3, 1]  # by parameters: [2, 2]
        assert engine.step(batch)["applied"]
    assert seen and set(seen) == {torch.device(worker_device).type}


def test_a_failed_build_is_retried_not_half_kept():
    """A partition that cannot be built (a buffer shared across stages) fails the first step and every later one
    with the same error; the pipeline is not left half built. The BatchNorm is the first layer and the last, so every
    split into 2 stages shares it, whatever the measured times (Linear, BN, Linear, BN split as [1, 3] when the first
    Linear happened to time slowest on a busy machine)."""
    bn = torch.nn.BatchNorm1d(4)
    model = torch.nn.Sequential(bn, torch.nn.Linear(4, 4), bn)
    with Engine(model, mse, devices=["cpu"] * 2, mode="pipeline", stages=2, microbatches=2,
                balance="time") as engine:
        for _ in range(2):
            with pytest.raises(ValueError, match="shared between stages"):
                engine.step((torch.randn(8, 4), torch.randn(8, 4)))
            assert engine.pipeline.sizes is None and engine.pipeline.stages == []


class _Watched(torch.nn.Module):
    """Linear + tanh (which saves its own output for backward), keeping weak references (class-wide: the engine's
    stages are copies) to its outputs and to an off-the-loss sigmoid (a logged statistic); ``fail_after`` calls of
    the second one, its forward raises."""

    refs: list = []
    calls = 0
    fail_after = None

    def __init__(self, d=16, counted=False):
        super().__init__()
        self.linear, self.counted = torch.nn.Linear(d, d), counted

    def forward(self, x):
        h = self.linear(x)
        gate = torch.sigmoid(h)
        self.stat = gate.mean().item()  # computed and dropped: off the loss's path
        y = torch.tanh(h)
        _Watched.refs += [weakref.ref(gate), weakref.ref(y)]
        if self.counted:
            _Watched.calls += 1
            if _Watched.fail_after is not None and _Watched.calls > _Watched.fail_after:
                raise RuntimeError("watched layer fails")
        return y


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_no_activation_outlives_its_step_failed_or_not(schedule, monkeypatch):
    """The stages' saved-tensor hook (counting activation bytes) kept each saved op output as itself, which holds its
    own grad_fn: a cycle that only backward breaks, and gc cannot see. The activations of a failed step's stored
    micro-batches, and of an op off the loss's path in every step, were never freed."""
    monkeypatch.setattr(_Watched, "refs", [])
    monkeypatch.setattr(_Watched, "calls", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), _Watched(), _Watched(counted=True), torch.nn.Linear(16, 3))
    batches = make_batches(torch.Generator().manual_seed(1), 4, 32)
    with Engine(model, loss_fn, devices=["cpu"] * 2, mode="pipeline", stages=2, microbatches=4, schedule=schedule,
                optimizer=AdamW(**OPT), balance=[2, 2]) as engine:
        engine.step(batches[0])
        monkeypatch.setattr(_Watched, "fail_after", _Watched.calls + 2)  # the next step's third micro-batch
        with pytest.raises(StageError, match="watched layer fails"):
            engine.step(batches[1])
        monkeypatch.setattr(_Watched, "fail_after", None)
        engine.step(batches[2])
        gc.collect()
        alive = sum(r() is not None for r in _Watched.refs)
    assert len(_Watched.refs) >= 40 and alive == 0, f"{alive} of {len(_Watched.refs)} activations outlived their step"


def test_a_stage_that_saves_a_sparse_tensor_runs():
    """The activation count keyed every saved tensor by its storage, which a sparse tensor has not: the stage failed
    with NotImplementedError where hybrid trained."""
    torch.manual_seed(0)
    adjacency = torch.eye(16).to_sparse()

    class Propagate(torch.nn.Module):
        def forward(self, x):
            return torch.sparse.mm(adjacency.to(x.dtype), x.t()).t()  # saves the sparse matrix for backward

    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), Propagate(), torch.nn.Linear(16, 3))
    reference = TorchReference(model)
    batches = make_batches(torch.Generator().manual_seed(2), 5, 16)
    with Engine(model, loss_fn, devices=["cpu"] * 2, mode="pipeline", stages=2, microbatches=2,
                optimizer=AdamW(**OPT), balance=[2, 2]) as engine:
        for b in batches:
            engine.step(b)
            reference.step(b)
        master = engine.master_state_dict()
    for name, p in reference.model.named_parameters():
        torch.testing.assert_close(master[name].double(), p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_batches_without_targets_train_as_on_one_device():
    """(inputs, None) for a loss that needs no targets: the last stage took None for "not the last stage" and then
    failed on the micro-batch's sample count."""
    def energy(model, batch):
        return model(batch[0]).pow(2).mean()

    model = make_model()
    reference = copy.deepcopy(model).double()
    opt = torch.optim.AdamW(reference.parameters(), foreach=False, **OPT)
    batches = [(x, None) for x, _ in make_batches(torch.Generator().manual_seed(3), 5, 12)]
    with Engine(model, energy, devices=["cpu"] * 2, mode="pipeline", stages=2, microbatches=3,
                optimizer=AdamW(**OPT)) as engine:
        for x, _ in batches:
            engine.step((x, None))
            opt.zero_grad()
            energy(reference, (x.double(), None)).backward()
            opt.step()
        master = engine.master_state_dict()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(master[name].double(), p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_a_step_that_fails_between_two_stage_submits_leaves_no_stage_waiting(monkeypatch):
    """An exception on the step's thread after some stages were started (the pool shut by close() from another
    thread, a second Ctrl-C) left those stages waiting on their channels for ever, and close() hung on them."""
    model = make_model()
    engine = Engine(model, loss_fn, devices=["cpu"] * 2, mode="pipeline", stages=2, microbatches=4,
                    optimizer=AdamW(**OPT))
    batch = make_batches(torch.Generator().manual_seed(4), 1, 16)[0]
    engine.step(batch)  # built (balance="params" builds at once; a first step in any case)
    submit, calls = engine.pipeline._pool.submit, []

    def second_fails(fn):
        calls.append(fn)
        if len(calls) == 2:
            raise RuntimeError("cannot schedule new futures after shutdown")
        return submit(fn)

    monkeypatch.setattr(engine.pipeline._pool, "submit", second_fails)
    with pytest.raises(RuntimeError, match="cannot schedule new futures"):
        engine.step(batch)
    closer = threading.Thread(target=engine.close, daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "close() hung on a stage waiting for its neighbour"


class _Ema(torch.nn.Module):
    """A layer that updates its buffer by assignment (a new tensor each forward), not in place."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("ema", torch.zeros(d))

    def forward(self, x):
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)
        return x


class _Fails(torch.nn.Module):
    armed = False

    def forward(self, x):
        if _Fails.armed:
            raise RuntimeError("failed on purpose")
        return x


def _step_failing(engine, batch) -> None:
    """A step whose _Fails layer raises: its StageError (pipeline) or WorkerError (hybrid); disarmed after."""
    _Fails.armed = True
    try:
        with pytest.raises((StageError, WorkerError), match="failed on purpose"):
            engine.step(batch)
    finally:
        _Fails.armed = False


class _Log(torch.nn.Module):
    """A layer whose buffer the forward resizes in place (a log of what it saw)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("log", torch.zeros(0), persistent=False)

    def forward(self, x):
        n = self.log.numel()
        self.log.resize_(n + 1)
        self.log[n] = x.detach().mean()
        return x


class _Mask(torch.nn.Module):
    """A layer whose forward assigns its buffer an expanded view (a mask cache)."""

    def __init__(self, d):
        super().__init__()
        self.d = d
        self.register_buffer("mask", torch.ones(1, d), persistent=False)

    def forward(self, x):
        self.mask = torch.ones(1, self.d).expand(x.shape[0], self.d)
        return x * self.mask


@pytest.mark.parametrize("mode", ["hybrid", "pipeline"])
@pytest.mark.parametrize("odd", ["log", "mask", "mask-alone"])
def test_a_failed_step_puts_back_buffers_resized_in_place_or_expanded(rng, mode, odd):
    """Note [A failed step leaves the buffers alone] with a buffer the forward resizes in place (a log) or assigns
    as an expanded view (a mask): putting the buffers back raised ("the size of tensor a (4) must match", "more
    than one element of the written-to tensor refers to a single memory location"; hybrid with the mask: "Tensor
    list must have at least one tensor") in place of the step's StageError / WorkerError, and the pipeline left
    the buffers after that one (the BatchNorm's statistics) as the failed step had them. Now the step's error is
    raised, the statistics are as before it, and the run goes on bit-identically to one that never saw it
    ("mask-alone": the mask is the model's only buffer)."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(10, 16), _Log() if odd == "log" else _Mask(16),
                                   torch.nn.Identity() if odd == "mask-alone" else torch.nn.BatchNorm1d(16),
                                   _Fails(), torch.nn.Linear(16, 3))
    options = dict(stages=2, microbatches=2, balance=[2, 3]) if mode == "pipeline" else {}
    batches = make_batches(rng, 3, 8)
    kw = dict(devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT), **options)
    _Fails.armed = False
    with Engine(model(), loss_fn, **kw) as engine, Engine(model(), loss_fn, **kw) as clean:
        engine.step(batches[0])
        clean.step(batches[0])
        before = engine.buffers_state_dict()
        _step_failing(engine, batches[1])
        for name, value in engine.buffers_state_dict().items():
            assert torch.equal(value, before[name]), name
        engine.step(batches[2])
        clean.step(batches[2])
        for got, want in ((engine.master_state_dict(), clean.master_state_dict()),
                          (engine.buffers_state_dict(), clean.buffers_state_dict())):
            for name, value in want.items():
                assert torch.equal(got[name], value), name


@pytest.mark.parametrize("mode", ["hybrid", "pipeline"])
def test_a_failed_step_puts_back_a_buffer_updated_by_assignment(rng, mode):
    """Note [A failed step leaves the buffers alone] for a layer that assigns its buffer a new tensor (an EMA): the
    copies were put back into the old tensor objects, which the module no longer held, so the failed step's value
    stayed. Now the module gets its old tensor back, with its old value, and the next step goes on from it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), _Ema(10), _Fails(), torch.nn.Linear(10, 3))
    options = dict(stages=2, microbatches=2, balance=[2, 2]) if mode == "pipeline" else {}
    batches = make_batches(rng, 2, 8)
    _Fails.armed = False
    with Engine(model, loss_fn, devices=["cpu"] * 2, mode=mode, optimizer=AdamW(**OPT), **options) as engine:
        engine.step(batches[0])
        before = engine.state_dict()
        _step_failing(engine, batches[1])
        after = engine.state_dict()
        assert torch.equal(after["buffers"]["1.ema"], before["buffers"]["1.ema"])
        engine.step(batches[1])
        assert not torch.equal(engine.state_dict()["buffers"]["1.ema"], before["buffers"]["1.ema"])


def _reassigned_buffer_worker(rank, world, init_file, out_dir):
    dist = _join_gloo_group(rank, world, init_file)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(10, 10), _Ema(10), torch.nn.Linear(10, 3))
        batches = make_batches(torch.Generator().manual_seed(0), 3, 8)
        with Engine(model, loss_fn, devices=["cpu"], mode="pipeline", microbatches=2, schedule="gpipe",
                    balance=[2, 1], optimizer=AdamW(**OPT), pin=False) as engine:
            for batch in batches[:2]:
                engine.step(batch)
            saved = engine.state_dict()  # a collective
            live = engine.pipeline.module[1].ema.clone() if rank == 0 else None
            engine.step(batches[2])
            engine.load_state_dict(saved)
            loaded = engine.pipeline.module[1].ema.clone() if rank == 0 else None
            torch.save({"saved": saved["buffers"]["1.ema"], "live": live, "loaded": loaded},
                       f"{out_dir}/reassigned-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_buffer_updated_by_assignment_is_saved_and_loaded_across_processes(tmp_path):
    """Note [Buffers of stages across processes]: the stage's own buffers are looked up in their modules at every
    use. A layer that assigns its buffer a new tensor each forward (an EMA) had state_dict() save its value at
    construction (zeros) on every rank, and load_state_dict write into a tensor the layer no longer held. On 2 gloo
    ranks (the EMA in rank 0's stage): every rank saves the live value, and a load puts it into the live buffer."""
    import torch.multiprocessing as mp

    mp.spawn(_reassigned_buffer_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    got = [torch.load(tmp_path / f"reassigned-{rank}.pt", weights_only=False) for rank in range(2)]
    live = got[0]["live"]
    assert live.abs().sum() > 0, "the EMA moved"
    for rank in range(2):
        assert torch.equal(got[rank]["saved"], live), f"rank {rank} saved another value than the layer's"
    assert torch.equal(got[0]["loaded"], live), "the load did not reach the layer's buffer"


@pytest.mark.parametrize("stages", [1, 2])
def test_a_loss_that_does_not_require_grad_is_an_error(rng, stages):
    """A detached loss (or one computed under no_grad) skipped its backward: the step was applied with no gradient
    (weight decay alone), where hybrid raises."""
    def detached(model, batch):
        return loss_fn(model, batch).detach()

    with Engine(make_model(), detached, devices=["cpu"] * stages, mode="pipeline", stages=stages,
                optimizer=AdamW(lr=1e-2)) as engine:
        before = engine.master_state_dict()
        with pytest.raises(StageError, match="returned a loss that does not require grad .*no gradient to train on"):
            engine.step(make_batches(rng, 1, 8)[0])
        assert engine.version == 0 and engine.stats()["applied_updates"] == 0
        assert all(torch.equal(before[k], v) for k, v in engine.master_state_dict().items())


@pytest.mark.parametrize("mode", ["hybrid", "sync", "async", "pipeline"])
def test_a_float64_model_is_refused_in_every_mode(mode):
    """A pipeline trained a float64 model at float32's precision (its master weights and copy_to were float32);
    the other modes refused it from a worker's streamer, after the seeding."""
    options = dict(stages=2) if mode == "pipeline" else {}
    with pytest.raises(ValueError, match=r"parameter '.*' is torch.float64: a trainable parameter must be float32, "
                                         r"bfloat16 or float16 .* give the engine model.float\(\)"):
        Engine(make_model().double(), loss_fn, devices=["cpu"] * 2, mode=mode, **options)


def test_balance_time_trains_the_model_as_given_not_as_changed_before_the_first_step(rng):
    """With balance="time" the stages are built at the first step: they were built from the caller's model as it
    was then (a change made after the engine was made was trained on), and a state loaded before that step was
    written into the caller's model."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3))
    options = dict(devices=["cpu"] * 2, mode="pipeline", stages=2, balance="time", optimizer=AdamW(**OPT))
    batches = make_batches(rng, 3, 8)
    with Engine(model, loss_fn, **options) as engine, Engine(copy.deepcopy(model), loss_fn, **options) as reference:
        given = copy.deepcopy(model.state_dict())
        with Engine(copy.deepcopy(model), loss_fn, devices=["cpu"], optimizer=AdamW(**OPT)) as hybrid:
            hybrid.step(batches[0])
            state = hybrid.state_dict()  # moved statistics, and no split: the pipelines stay unbuilt
        with pytest.warns(UserWarning, match="saved by a mode='hybrid' engine"):
            engine.load_state_dict(state)
            reference.load_state_dict(state)
        assert all(torch.equal(given[k], v) for k, v in model.state_dict().items())  # the load left it alone
        with torch.no_grad():
            model[1].running_mean += 5.0
            model[0].weight += 1.0
        for batch in batches[1:]:
            engine.step(batch)
            reference.step(batch)
        ours, theirs = engine.state_dict(), reference.state_dict()
        for part in ("master", "buffers"):
            for name, value in theirs[part].items():
                torch.testing.assert_close(ours[part][name], value, rtol=1e-4, atol=1e-5, msg=f"{part} {name}")


def test_stages_left_to_default_says_so_when_there_are_too_many():
    """devices=["cpu"] * 8 with 7 layers and no stages said "stages=8 is more than the model's 7 layers", a value
    never given."""
    with pytest.raises(ValueError, match=r"stages defaults to one per device, 8, more than the model's 7 layers"):
        Engine(make_model(), loss_fn, devices=["cpu"] * 8, mode="pipeline")
    with pytest.raises(ValueError, match=r"stages=8 is more than the model's 7 layers"):
        Engine(make_model(), loss_fn, devices=["cpu"] * 8, mode="pipeline", stages=8)


@pytest.mark.parametrize("stages", [1, 2])
def test_loss_fn_gets_the_batch_type_back(rng, stages):
    """A loss_fn written for a namedtuple batch (b.inputs, b.targets), which hybrid gives back as it was given,
    met a plain tuple on the last stage ("'tuple' object has no attribute 'targets'")."""
    Batch = collections.namedtuple("Batch", ["inputs", "targets"])
    seen = []

    def named_loss(model, b):
        seen.append(type(b))
        return torch.nn.functional.cross_entropy(model(b.inputs), b.targets) if isinstance(b, Batch) else \
            loss_fn(model, b)

    batches = make_batches(rng, 2, 8)
    results = {}
    for kind in (Batch, list, tuple):
        with Engine(make_model(), named_loss, devices=["cpu"] * stages, mode="pipeline", stages=stages,
                    microbatches=2, optimizer=AdamW(**OPT)) as engine:
            seen.clear()
            engine.fit([kind(b) if kind is not Batch else Batch(*b) for b in batches])
            assert set(seen) == {kind}
            results[kind] = engine.master_state_dict()
    for name, value in results[tuple].items():
        assert torch.equal(results[Batch][name], value) and torch.equal(results[list][name], value), name
