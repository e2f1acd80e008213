"""Loss scaling under float16 autocast (Note [Loss scaling], pyengine/scaler.py), against torch.amp.GradScaler with
torch.optim.AdamW: the scale's trajectory step for step, the weights, skipped steps, resume, and bad options."""
import copy
import math

import pytest
import torch

from pyengine import AdamW, Engine, LossScaler
from pyengine.scaler import make_scaler

from conftest import fresh_seed, loss_fn, make_batches

F16 = torch.float16
# eps = 1e-3: as tests/test_engine.py's OPT, so elements whose gradient is near zero do not amplify rounding
OPT = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.01)


def make_model(seed=0, d_in=10, hidden=24, d_out=3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, d_out))


class GradScalerReference:
    """One fp32 model under float16 autocast, trained by torch.amp.GradScaler + torch.optim.AdamW: the reference.

    A step takes groups of micro-batches: each group's gradient is computed alone, as a hybrid worker (or a pipeline
    replica) computes its own, with each micro-batch's loss weighted by its share of the group, times the scale;
    the optimizer gets the groups' mean weighted by their sizes. Each group's gradient is rounded to float16, as it
    travels in the engine's float16 slots (a sum of micro-batch gradients may overflow there). So overflow happens
    where it happens in the engine."""

    def __init__(self, model, scaler: dict, clip=None, device="cpu", **opt):
        self.device = torch.device(device)
        self.model = copy.deepcopy(model).to(self.device)
        self.params = list(self.model.parameters())
        self.start = [p.detach().clone() for p in self.params]
        self.opt = torch.optim.AdamW(self.params, foreach=False, **opt)
        self.scaler = torch.amp.GradScaler(self.device.type, **scaler)
        self.clip = clip

    def step(self, groups, divide_after: bool = False) -> tuple[float, bool]:
        """``groups``: lists of ``(x, y)`` micro-batches. ``divide_after``: the micro-batch losses are not weighted;
        their summed gradient is divided by their number (torch.distributed.pipelining's ``scale_grads``, for equal
        micro-batches). Returns (the scale the step computed with, whether it was applied)."""
        total = sum(len(y) for group in groups for _, y in group)
        mean = [torch.zeros_like(p) for p in self.params]
        for group in groups:
            self.opt.zero_grad()
            size = sum(len(y) for _, y in group)
            for x, y in group:
                with torch.autocast(self.device.type, dtype=F16):
                    loss = loss_fn(self.model, (x.to(self.device), y.to(self.device)))
                unweighted = len(group) == 1 or divide_after
                self.scaler.scale(loss if unweighted else loss * (len(y) / size)).backward()
            if divide_after:
                for p in self.params:
                    p.grad.div_(len(group))
            for m, p in zip(mean, self.params):  # the group's gradient travels in float16, as the engine's slots
                m.add_(p.grad.to(F16).float(), alpha=size / total)
        for m, p in zip(mean, self.params):
            p.grad = m
        scale = self.scaler.get_scale()
        if self.clip is not None:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        before = [p.detach().clone() for p in self.params]
        self.scaler.step(self.opt)
        self.scaler.update()
        return scale, any(not torch.equal(b, p) for b, p in zip(before, self.params))


def poisoned(batches, index):
    """The batches with one input of batch ``index`` beyond float16's range: that step's gradient is not finite."""
    out = [(x.clone(), y) for x, y in batches]
    out[index][0][0, 0] = 1e6
    return out


def assert_close_to(engine, reference, bound):
    """Every weight within ``bound`` of the largest change the reference made to any weight."""
    master = engine.master_state_dict()
    moved = max((p.detach() - p0).abs().max().item() for p, p0 in zip(reference.params, reference.start))
    for name, p in reference.model.named_parameters():
        err = (master[name] - p.detach().cpu()).abs().max().item()
        assert err <= bound * moved, f"{name}: {err:.3g} vs largest update {moved:.3g}"


# ---- the scale's rule against torch.amp.GradScaler ----

@pytest.mark.parametrize("kwargs", [
    dict(init_scale=2.0 ** 10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
    dict(init_scale=1000.0, growth_factor=1.5, backoff_factor=0.3, growth_interval=2)],
                         ids=["powers-of-2", "float32-rounding"])
def test_update_rule_equals_grad_scaler(rng, kwargs):
    """LossScaler.overflow/applied against GradScaler.update over a random sequence of finite / non-finite steps,
    bit for bit also with factors whose products round (torch keeps the scale in float32)."""
    # GradScaler has no floor: ours must never reach its own in 60 steps (1000 x 0.3^60 = 4e-29; 2^10 x 0.5^60 =
    # 9e-16). 2^-30 was reached by 23 net backoffs (seed 250366956: the scales parted at step 57).
    ours = LossScaler(**kwargs, min_scale=1e-37)
    torch_scaler = torch.amp.GradScaler("cpu", **kwargs)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    bad = (torch.rand(60, generator=rng) < 0.3).tolist()
    for step, inf in enumerate(bad):
        used = ours.scale
        assert used == torch_scaler.get_scale(), step
        torch_scaler.scale(torch.ones(()))  # as a training loop scales its loss (GradScaler starts lazily)
        p.grad = torch.tensor([math.inf if inf else 1.0])
        torch_scaler.step(opt)
        torch_scaler.update()
        if inf:
            assert ours.overflow(used)
        else:
            ours.applied(used)
    assert ours.scale == torch_scaler.get_scale() and sum(bad) not in (0, len(bad))
    assert len({ours.scale} | {torch_scaler.get_scale()}) == 1


def test_min_scale_static_scale_and_stale_overflows():
    s = LossScaler(init_scale=4.0, min_scale=1.0, growth_interval=1)
    assert s.overflow(4.0) and s.scale == 2.0
    assert s.overflow(4.0) and s.scale == 2.0, "an overflow at a scale already backed off from: no second backoff"
    assert s.overflow(2.0) and s.scale == 1.0
    assert not s.overflow(1.0) and s.scale == 1.0, "at min_scale the engine's nonfinite policy decides"
    s.applied(2.0)
    assert s.scale == 1.0 and s.growth_tracker == 0, "a step at another scale does not count towards growth"
    s.applied(1.0)
    assert s.scale == 2.0
    # async: a push pulled at 4 overflows after another push's growth to 8: the backoff is from 4, not from 8 (it
    # landed on 4 again, and the next push pulled at 4 that overflowed backed off a second time)
    grown = LossScaler(init_scale=4.0, min_scale=1.0, growth_interval=1)
    grown.applied(4.0)
    assert grown.scale == 8.0
    assert grown.overflow(4.0) and grown.scale == 2.0
    assert grown.overflow(4.0) and grown.scale == 2.0, "the same overflowing scale: one backoff"
    grown.applied(2.0)
    assert grown.scale == 4.0 and not grown.overflow(1.0) and grown.scale == 1.0, "overflowed at min_scale"
    static = LossScaler(init_scale=8.0, dynamic=False)
    assert not static.overflow(8.0) and static.scale == 8.0
    static.applied(8.0)
    assert static.scale == 8.0 and static.growth_tracker == 0
    static.load_state_dict({"scale": 2.0, "growth_tracker": 0})
    assert static.scale == 8.0, "a static scale is configuration, not state"
    # a static scale below the default min_scale (1.0) was refused, though Engine(loss_scale=0.5) builds it; a
    # dynamic one still is
    small = LossScaler(init_scale=0.5, dynamic=False)
    assert small.scale == 0.5 and not small.overflow(0.5) and small.scale == 0.5
    with pytest.raises(ValueError, match=r"min_scale \(1.0\) must be <= init_scale \(0.5\)"):
        LossScaler(init_scale=0.5)


def test_growth_stays_in_float32_and_a_loaded_tracker_past_the_interval_grows():
    top = LossScaler(init_scale=2.0 ** 127, growth_interval=1)
    top.applied(top.scale)
    assert top.scale == 2.0 ** 127 and top.growth_tracker == 0, "a growth past float32's range is not taken"
    s = LossScaler(init_scale=8.0, growth_interval=2)
    s.load_state_dict({"scale": 8.0, "growth_tracker": 5})  # saved with a longer interval
    s.applied(8.0)
    assert s.scale == 16.0 and s.growth_tracker == 0
    s.load_state_dict(None)  # a state saved without loss scaling
    assert s.scale == 8.0 and s.growth_tracker == 0


def test_a_loaded_scale_below_min_scale_starts_at_min_scale():
    """A state saved with a lower min_scale: its scale was taken below this scaler's floor, and the first overflow
    "backed off" to min_scale, 512x up, leaving the step to the engine's nonfinite policy."""
    s = LossScaler(init_scale=4096.0, min_scale=1024.0)
    with pytest.warns(RuntimeWarning, match=r"loss scale 2.0 is below this scaler's min_scale 1024.0 .* starts at "
                                            r"1024.0"):
        s.load_state_dict({"scale": 2.0, "growth_tracker": 7})
    assert s.scale == 1024.0 and s.growth_tracker == 0
    s.load_state_dict({"scale": 2048.0, "growth_tracker": 3})  # at or above the floor: as saved, without a word
    assert s.scale == 2048.0 and s.growth_tracker == 3
    assert s.overflow(2048.0) and s.scale == 1024.0


# ---- the engine against the reference ----

def split(batch, parts):
    x, y = batch
    return list(zip(torch.tensor_split(x, parts), torch.tensor_split(y, parts)))


@pytest.mark.parametrize("mode,workers,clip,options", [
    ("sync", 1, None, {}), ("hybrid", 2, None, {}), ("hybrid", 3, 0.5, {}), ("async", 1, None, {}),
    ("hybrid", 2, None, dict(microbatches=2)), ("pipeline", 2, 0.5, dict(stages=2, microbatches=3)),
], ids=["sync", "hybrid-G2", "hybrid-G3-uneven-clip", "async", "hybrid-microbatches", "pipeline-clip"])
def test_engine_equals_grad_scaler_reference(rng, mode, workers, clip, options, worker_device):
    """Float16 autocast with dynamic loss scaling: the scale starts too high (the first steps overflow and back off,
    as GradScaler's), grows every 3 applied steps, and one batch is poisoned (a step skipped, the scale halved).
    Every step's scale and whether it was applied equal the reference's; the weights follow it closely."""
    scaler = dict(init_scale=2.0 ** 24, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    batches = poisoned(make_batches(rng, 16, 12 * workers + (workers > 2)), 9)
    model = make_model()
    reference = GradScalerReference(model, scaler, clip=clip, device=worker_device, **OPT)
    replicas = 1 if mode == "pipeline" else workers
    micro = options.get("microbatches", 1)
    expected = [reference.step([split(shard, micro) for shard in split(b, replicas)]) for b in batches]
    with Engine(model, loss_fn, devices=[worker_device] * workers, mode=mode, autocast=F16,
                optimizer=AdamW(**OPT, max_grad_norm=clip), loss_scale=LossScaler(**scaler), **options) as engine:
        history = engine.fit(batches) if mode == "async" else [engine.step(b) for b in batches]
        got = [(m["loss_scale"], m["applied"]) for m in history]
        assert got == expected
        skipped = sum(not applied for _, applied in expected)
        assert 3 <= skipped < len(batches) and engine.stats()["skipped_steps"] == skipped
        assert engine.stats()["loss_scale"] == reference.scaler.get_scale()
        scales = [s for s, _ in expected]
        assert any(b < a for a, b in zip(scales, scales[1:])) and any(b > a for a, b in zip(scales, scales[1:])), \
            f"the run exercises backoff and growth: {scales}"
        assert_close_to(engine, reference, 1e-3)  # worst seen over 12 seeds: 1.1e-4 (hybrid, G = 3, clipping)


@pytest.mark.parametrize("mode,options", [("sync", {}), ("hybrid", {}), ("hybrid", dict(microbatches=2)),
                                          ("pipeline", dict(stages=2, microbatches=2)), ("async", {})])
def test_tiny_gradients_arrive_only_with_scaling(rng, mode, options, worker_device):
    """A loss of 2^-20 times cross-entropy: under float16 autocast its gradients (~1e-9) flush to zero unscaled. With
    the default (dynamic) scaling the first update's gradient, read back from the Adam state (exp_avg = (1 - beta1)
    g), equals the float64 gradient of the whole batch; without scaling it does not."""
    tiny = 2.0 ** -20
    workers = 2 if mode in ("hybrid", "pipeline") else 1
    batch = make_batches(rng, 1, 16)[0]
    model = make_model()
    reference = copy.deepcopy(model).double()
    (tiny * loss_fn(reference, (batch[0].double(), batch[1]))).backward()

    def scaled_loss(m, b):
        return tiny * loss_fn(m, b)

    errors = {}
    for scaling in ("auto", None):
        with Engine(model, scaled_loss, devices=[worker_device] * workers, mode=mode, autocast=F16,
                    optimizer=AdamW(**OPT), loss_scale=scaling, **options) as engine:
            if mode == "async":
                engine.fit([batch])
            else:
                engine.step(batch)
            assert engine.stats()["applied_updates"] == 1
            exp_avg = engine.optimizer_state_dict()["state"]
            errors[scaling] = max(
                ((exp_avg[i]["exp_avg"].double() / (1 - OPT["betas"][0]) - p.grad).norm() / p.grad.norm()).item()
                for i, p in enumerate(reference.parameters()))
    assert errors["auto"] < 0.02, errors
    assert errors[None] > 0.5, errors


def test_resume_restores_the_scale_bit_identically(rng):
    """The scale and its growth count are part of state_dict(): a run resumed half-way equals the run straight
    through, weights and scale, with the scale changing after the resume."""
    scaler = dict(init_scale=2.0 ** 15, growth_interval=2)
    batches = make_batches(rng, 10, 16)
    kwargs = dict(devices=["cpu"] * 2, autocast=F16, pin=False, optimizer=AdamW(**OPT))
    with Engine(make_model(), loss_fn, loss_scale=LossScaler(**scaler), **kwargs) as engine:
        straight = [engine.step(b)["loss_scale"] for b in batches]
        final = engine.master_state_dict()
    with Engine(make_model(), loss_fn, loss_scale=LossScaler(**scaler), **kwargs) as engine:
        # saved after the first step from the 3rd on whose growth count is under way (an overflow, which this
        # fresh data may cause, resets it), so a resume that dropped the count would differ
        first = []
        for b in batches[:-2]:
            first.append(engine.step(b)["loss_scale"])
            saved = copy.deepcopy(engine.state_dict())
            if len(first) >= 3 and saved["loss_scaler"]["growth_tracker"] > 0:
                break
    assert saved["version"] > 0 and saved["loss_scaler"]["growth_tracker"] > 0, saved["loss_scaler"]
    with Engine(make_model(seed=1), loss_fn, loss_scale=LossScaler(**scaler), **kwargs) as engine:
        engine.load_state_dict(saved)
        rest = [engine.step(b)["loss_scale"] for b in batches[len(first):]]
        resumed = engine.master_state_dict()
    assert first + rest == straight and len(set(rest)) > 1
    for name in final:
        assert torch.equal(final[name], resumed[name]), name


@pytest.mark.parametrize("bad,error", [({"scale": -1.0, "growth_tracker": 0}, "normal float32 > 0"),
                                       ({"scale": math.nan, "growth_tracker": 0}, "normal float32 > 0"),
                                       ({"scale": 2.0, "growth_tracker": "x"}, "growth_tracker"),
                                       ({"scale": 2.0}, "loss scaler must be")])
def test_a_bad_scaler_state_changes_nothing(rng, bad, error):
    batches = make_batches(rng, 3, 8)
    kwargs = dict(devices=["cpu"] * 2, autocast=F16, pin=False, optimizer=AdamW(**OPT))
    with Engine(make_model(), loss_fn, **kwargs) as engine:
        engine.fit(batches[:2])
        state = engine.state_dict()
    state["loss_scaler"] = bad
    with Engine(make_model(seed=1), loss_fn, loss_scale=LossScaler(init_scale=8.0), **kwargs) as engine:
        engine.step(batches[2])
        before = engine.state_dict()
        with pytest.raises(ValueError, match=error):
            engine.load_state_dict(state)
        after = engine.state_dict()
        assert after["version"] == before["version"] and after["loss_scaler"] == before["loss_scaler"]
        for name in before["master"]:
            assert torch.equal(after["master"][name], before["master"][name]), name


def test_static_scale_and_min_scale_hand_overflows_to_nonfinite(rng):
    """A static scale never changes; an overflow at it (or at min_scale) goes to the nonfinite policy: "raise"
    raises with the weights of the last update, "skip" skips."""
    batches = poisoned(make_batches(rng, 3, 8), 1)
    for loss_scale in (64.0, LossScaler(init_scale=64.0, min_scale=64.0)):
        with Engine(make_model(), loss_fn, devices=["cpu"], autocast=F16, pin=False, optimizer=AdamW(**OPT),
                    nonfinite="raise", loss_scale=loss_scale) as engine:
            assert engine.step(batches[0])["loss_scale"] == 64.0
            before = engine.master_state_dict()
            with pytest.raises(FloatingPointError, match="non-finite gradient"):
                engine.step(batches[1])
            assert all(torch.equal(v, engine.master_state_dict()[k]) for k, v in before.items())
            assert engine.step(batches[2])["applied"] and engine.stats()["loss_scale"] == 64.0
    with Engine(make_model(), loss_fn, devices=["cpu"], autocast=F16, pin=False, optimizer=AdamW(**OPT),
                nonfinite="raise", loss_scale=LossScaler(init_scale=1024.0)) as engine:
        # dynamic: the overflow is the scale's, skipped without raising
        metrics = [engine.step(b) for b in batches]
        assert [m["applied"] for m in metrics] == [True, False, True]
        assert metrics[2]["loss_scale"] == metrics[1]["loss_scale"] / 2


def test_async_workers_that_overflow_together_back_off_once_each_scale(rng):
    """Several async workers start at a scale that overflows: every push at a scale already backed off from is
    skipped without another backoff, training then proceeds, and every push is applied or skipped exactly once."""
    batches = make_batches(rng, 60, 8)
    with Engine(make_model(), loss_fn, devices=["cpu"] * 3, mode="async", autocast=F16, pin=False,
                optimizer=AdamW(**OPT), loss_scale=LossScaler(init_scale=2.0 ** 24)) as engine:
        history = engine.fit(batches)
        stats = engine.stats()
    assert stats["pushes"] == 60 and stats["applied_updates"] + stats["skipped_steps"] == 60
    assert stats["applied_updates"] >= 25  # seen 40-48 over 15 seeds (7-8 backoffs)
    scales = [m["loss_scale"] for m in history if not m["applied"]]
    backoffs = len(set(scales))
    # each distinct overflowing scale halved it once: the final scale is 2^24 / 2^backoffs
    assert stats["loss_scale"] == 2.0 ** (24 - backoffs) and backoffs >= 5
    assert all(torch.isfinite(v).all() for v in engine.master_state_dict().values())


@pytest.mark.parametrize("kwargs,error", [
    (dict(loss_scale="sometimes"), "loss_scale must be"), (dict(loss_scale=0.0), "static loss_scale"),
    (dict(loss_scale=math.inf), "loss_scale"), (dict(loss_scale=True), "loss_scale must be"),
    (dict(loss_scale=1e-50), "normal float32"), (dict(loss_scale=1e39), "normal float32"),
    (dict(loss_scale=10 ** 400), "normal float32"),  # an int past float's range: was an OverflowError
])
def test_bad_loss_scale_options(kwargs, error):
    """A ValueError, and torch's generator as it was (the engine seeded it before this check)."""
    model = make_model()
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match=error):
        Engine(model, loss_fn, devices=["cpu"], autocast=F16, seed=7, **kwargs)
    assert torch.equal(torch.get_rng_state(), before)


def test_engines_given_one_loss_scaler_each_keep_their_own_scale(rng):
    """The LossScaler given is configuration: each engine scales with its own copy (one object was shared: an
    overflow in one engine halved the other's scale, and an engine built later started from it)."""
    given = LossScaler(init_scale=2.0 ** 24, growth_interval=3)
    x, y = make_batches(rng, 1, 8)[0]
    x[0, 0] = 1e6  # overflows float16
    with Engine(make_model(), loss_fn, devices=["cpu"], mode="sync", autocast=F16, loss_scale=given) as a, \
            Engine(make_model(), loss_fn, devices=["cpu"], mode="sync", autocast=F16, loss_scale=given) as b:
        a.step((x, y))
        assert (a.scaler.scale, b.scaler.scale, given.scale) == (2.0 ** 23, 2.0 ** 24, 2.0 ** 24)
        with Engine(make_model(), loss_fn, devices=["cpu"], mode="sync", autocast=F16, loss_scale=given) as c:
            assert c.scaler.scale == 2.0 ** 24


def test_numbers_past_floats_range_are_value_errors():
    """10**400 (an int) raised OverflowError from the checks meant to say ValueError."""
    with pytest.raises(ValueError, match="init_scale must be a normal float32"):
        LossScaler(init_scale=10 ** 400)
    with pytest.raises(ValueError, match="loss scale must be a normal float32"):
        LossScaler().load_state_dict({"scale": 10 ** 400, "growth_tracker": 0})
    with pytest.raises(ValueError, match="lr must be a finite number"):
        AdamW(lr=10 ** 400)


@pytest.mark.parametrize("kwargs,error", [
    (dict(init_scale=-2.0), "init_scale"), (dict(growth_factor=1.0), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"), (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(growth_interval=0), "growth_interval"), (dict(growth_interval=2.5), "growth_interval"),
    (dict(min_scale=4.0, init_scale=2.0), "min_scale"), (dict(dynamic="yes"), "dynamic"),
    (dict(init_scale=1e-40), "normal float32"), (dict(growth_factor=math.nan), "growth_factor"),
])
def test_bad_loss_scaler_arguments(kwargs, error):
    with pytest.raises((ValueError, TypeError), match=error):
        LossScaler(**kwargs)


def test_numpy_numbers_as_a_static_loss_scale_and_growth_interval():
    """np.float32(1024.0) or np.int64(1024) as loss_scale were refused as not "a number > 0" (np.float64 was
    taken), growth_interval=np.int64(100) as not an int."""
    np = pytest.importorskip("numpy")
    for value in (np.float32(1024.0), np.int64(1024), np.float64(1024.0), 1024):
        scaler = make_scaler(value, F16)
        assert (scaler.scale, scaler.dynamic) == (1024.0, False)
    scaler = LossScaler(growth_interval=np.int64(100))
    assert scaler.growth_interval == 100 and type(scaler.growth_interval) is int
    for bad in (np.bool_(True), np.float32(0.0), np.int64(-4)):
        with pytest.raises(ValueError, match="loss_scale"):
            make_scaler(bad, F16)


def test_defaults():
    """"auto": dynamic under float16 only; a number: a static scale."""
    assert isinstance(make_scaler("auto", F16), LossScaler) and make_scaler("auto", F16).dynamic
    assert make_scaler("auto", torch.bfloat16) is None and make_scaler("auto", None) is None
    assert make_scaler(None, F16) is None and not make_scaler(128.0, None).dynamic
    with Engine(make_model(), loss_fn, devices=["cpu"], pin=False) as engine:
        assert engine.scaler is None and "loss_scale" not in engine.step(make_batches(
            torch.Generator().manual_seed(fresh_seed()), 1, 4)[0])
        assert engine.state_dict()["loss_scaler"] is None and engine.stats()["loss_scale"] is None
    with Engine(make_model(), loss_fn, devices=["cpu"], pin=False, autocast=F16) as engine:
        with pytest.raises(RuntimeError, match="needs the scale the gradients were computed with"):
            engine.apply_update([0], None)


@pytest.mark.parametrize("used", [-1.0, 0.0, math.nan, math.inf, None, "x", True])
@pytest.mark.parametrize("method", ["overflow", "applied"])
def test_overflow_and_applied_refuse_a_scale_no_gradient_was_computed_with(method, used):
    """overflow(-1.0) or overflow(0.0) backed the scale off to min_scale, applied(None) counted nothing, both
    without a word; the scaler is unchanged after the refusal."""
    scaler = LossScaler(init_scale=1024.0, growth_interval=1)
    with pytest.raises(ValueError, match=rf"LossScaler.{method}: used must be the scale the gradient was computed "
                                         "with, a finite number > 0"):
        getattr(scaler, method)(used)
    assert (scaler.scale, scaler.growth_tracker) == (1024.0, 0)
    scaler.applied(1024.0)  # a good call still counts
    assert scaler.scale == 2048.0


def test_numpy_numbers_are_numbers():
    """np.float32(1024.0) was "not a normal float32"."""
    np = pytest.importorskip("numpy")
    scaler = LossScaler(init_scale=np.float32(1024.0), growth_factor=np.float64(2.0), min_scale=np.int64(1))
    assert scaler.scale == 1024.0 and type(scaler.scale) is float
    assert scaler.overflow(np.float32(1024.0)) and scaler.scale == 512.0
    scaler.load_state_dict({"scale": np.float32(256.0), "growth_tracker": 0})
    assert scaler.scale == 256.0
