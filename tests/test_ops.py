"""The fused mean-gradient AdamW ops against torch.optim in float64, on fresh random data.

Reference for every update: torch.optim.AdamW / Adam (foreach=False) on a float64 copy of the parameter, fed the
float64 mean of the same (already rounded) gradients the kernel sees.
"""
import inspect
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import pyengine
from pyengine import ops

from conftest import CUDA

SIZES = [1, 7, 17, 4097, 1_000_003]
WORKERS = [1, 2, 3, 8]
# weight_decay a power of two: with Adam's L2 decay the first step's gradient g + wd * p is then exact in float32 for
# p on the grid of random_grads (see run_both)
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0625)


def assert_fp32_close(actual, expected, what, floor=1e-30):
    """Element-wise, fp32-level agreement with a float64 reference: ~1e-6 relative to the tensor's scale.

    ``floor`` bounds the scale from below by the size of the terms the result is summed from: exp_avg = beta1 * m +
    (1 - beta1) * g can cancel to almost nothing, and its fp32 rounding error is then relative to those terms, not to
    the result (with a single element, a scale taken from the result alone fails ~1 % of fresh random draws).
    """
    expected = expected.detach().double().cpu()
    scale = max(expected.abs().max().item(), floor)
    torch.testing.assert_close(actual.detach().double().cpu(), expected, rtol=2e-6, atol=2e-6 * scale, msg=what)


def random_grads(rng, n, workers, dtypes=(torch.float32,)):
    """Fresh normal gradients on a 2^-12 grid (|g| < 16, exact in bf16/fp16 after rounding).

    Why the grid: Adam's step lr * m / (sqrt(v) + eps) is ill-conditioned where the mean gradient is within ~eps of
    zero, and a float32 sum of G normals has an absolute error ~1e-7 that a float64 reference does not share. On
    the grid, sums of up to 8 gradients are exact in float32, so the comparison measures the kernel's arithmetic,
    not the cancellation in an unlucky element out of millions.
    """
    return [on_grid(torch.randn(n, generator=rng)).to(dtypes[g % len(dtypes)]) for g in range(workers)]


def on_grid(x):
    """``x`` rounded to the 2^-12 grid of :func:`random_grads` (|x| < 16)."""
    return (x * 4096).round().clamp(-65000, 65000) / 4096


class Reference:
    """torch.optim in float64 on the mean gradient: the independent reference."""

    def __init__(self, p0, *, adamw=True, amsgrad=False, maximize=False, lr, beta1, beta2, eps, weight_decay):
        self.p = torch.nn.Parameter(p0.detach().double().clone())
        cls = torch.optim.AdamW if adamw else torch.optim.Adam
        self.opt = cls([self.p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                       maximize=maximize, foreach=False)

    def step(self, grads, weights=None, grad_scale=1.0, max_grad_norm=None):
        g64 = [g.detach().double().cpu() for g in grads]
        if weights is None:
            mean = sum(g64) / len(g64)
        else:
            mean = sum(w * g for w, g in zip(weights, g64))
        self.p.grad = mean / grad_scale
        norm = None
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_([self.p], max_grad_norm)
        self.opt.step()
        return norm

    def state(self, key):
        return self.opt.state[self.p][key]


class Ours:
    """The fused op on fp32 buffers on `device`, stepping like torch.optim (step counted after increment)."""

    def __init__(self, p0, device, amsgrad=False):
        self.p = p0.detach().float().to(device).clone()
        self.m = torch.zeros_like(self.p)
        self.v = torch.zeros_like(self.p)
        self.vmax = torch.zeros_like(self.p) if amsgrad else None
        self.t = 0

    def step(self, grads, **kwargs):
        self.t += 1
        device = self.p.device
        return flat_update(self.p, self.m, self.v, [g.to(device) for g in grads], step=self.t,
                           amsgrad=self.vmax is not None, max_exp_avg_sq=self.vmax, **kwargs)


def flat_update(param, exp_avg, exp_avg_sq, grads, max_grad_norm=None, **kwargs):
    """The flat op; with ``max_grad_norm``, its clipping form (returns the norm)."""
    if max_grad_norm is None:
        return ops.mean_grad_adamw_(param, exp_avg, exp_avg_sq, grads, **kwargs)
    return ops.mean_grad_adamw_clipped_(param, exp_avg, exp_avg_sq, grads, max_grad_norm=max_grad_norm, **kwargs)


def run_both(rng, device, n, workers, steps=5, dtypes=(torch.float32,), ref_kwargs=None, our_kwargs=None,
             hyper=HYPER):
    ref_kwargs, our_kwargs = dict(ref_kwargs or {}), dict(our_kwargs or {})
    options = {k: our_kwargs.pop(k) for k in ("adamw", "amsgrad", "maximize") if k in our_kwargs}
    # On the grid: with Adam's L2 decay (adamw=False) the first step's gradient is g + wd * p, and a float32 p times
    # wd = 0.05 could cancel g to within eps (seen once in CI: element 1820 of a seed moved 1.2e-3 apart, Adam's first
    # step being g / (|g| + eps)); with p on the grid and wd a power of two that sum is exact in float32.
    p0 = on_grid(torch.randn(n, generator=rng))
    ref = Reference(p0, **options, **hyper)
    ours = Ours(p0, device, amsgrad=options.get("amsgrad", False))
    opt_kwargs = {k: v for k, v in options.items() if k != "amsgrad"}
    for _ in range(steps):
        grads = random_grads(rng, n, workers, dtypes)
        ref.step(grads, **ref_kwargs)
        ours.step(grads, **hyper, **opt_kwargs, **our_kwargs)
    return ref, ours


def check_state(ref, ours):
    """Each buffer to fp32 level; the floors are the sizes of the terms each is summed from (|g| ~ 1 here): lr for
    the weights' steps, (1 - beta1) |g| for exp_avg, (1 - beta2) g^2 for exp_avg_sq."""
    group = ref.opt.param_groups[0]
    beta1, beta2 = group["betas"]
    assert_fp32_close(ours.p, ref.p, "param", floor=group["lr"])
    assert_fp32_close(ours.m, ref.state("exp_avg"), "exp_avg", floor=1 - beta1)
    assert_fp32_close(ours.v, ref.state("exp_avg_sq"), "exp_avg_sq", floor=1 - beta2)
    if ours.vmax is not None:
        assert_fp32_close(ours.vmax, ref.state("max_exp_avg_sq"), "max_exp_avg_sq")


@pytest.mark.skipif(sys.platform != "linux" or not shutil.which("readelf"), reason="needs Linux and readelf")
def test_extension_uses_the_shared_libstdcxx():
    """_C must load the process's libstdc++.so, not carry a static copy: a second libstdc++ in the process has
    uninitialised locale facets, and the first error message that formats a number crashes (seen with a toolchain
    that links it statically; setup.py builds with the compiler on PATH for this)."""
    dynamic = subprocess.run(["readelf", "-d", pyengine._C.__file__], capture_output=True, text=True, check=True)
    assert "libstdc++.so" in dynamic.stdout, "pyengine._C does not link libstdc++.so dynamically"
    symbols = subprocess.run(["readelf", "--dyn-syms", "-W", pyengine._C.__file__], capture_output=True, text=True,
                             check=True).stdout
    defined = [line for line in symbols.splitlines() if "_ZNSo9_M_insertIlEERSoT_" in line and " UND " not in line]
    assert not defined, "pyengine._C defines std::ostream itself (a static libstdc++)"


# ---------------------------------------------------------------------------------------------------------------
# Agreement with torch.optim


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("workers", WORKERS)
def test_matches_torch_adamw(rng, device, n, workers):
    ref, ours = run_both(rng, device, n, workers)
    check_state(ref, ours)


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,), (torch.float16,), (torch.float32, torch.bfloat16, torch.float16)],
                         ids=["bf16", "fp16", "mixed"])
@pytest.mark.parametrize("n", [17, 4097, 100_003])
def test_low_precision_grads(rng, device, dtypes, n):
    ref, ours = run_both(rng, device, n, 3, dtypes=dtypes)
    check_state(ref, ours)


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
@pytest.mark.parametrize("maximize", [False, True], ids=["", "maximize"])
def test_optimizer_variants(rng, device, adamw, amsgrad, maximize):
    opts = dict(adamw=adamw, amsgrad=amsgrad, maximize=maximize)
    ref, ours = run_both(rng, device, 4097, 2, steps=6, our_kwargs=opts)
    check_state(ref, ours)


def test_weighted_mean(rng, device):
    raw = torch.rand(3, generator=rng) + 0.1
    weights = (raw / raw.sum()).double().tolist()
    ref, ours = run_both(rng, device, 1003, 3, ref_kwargs=dict(weights=weights), our_kwargs=dict(weights=weights))
    check_state(ref, ours)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_a_gradient_whose_square_overflows_float32_keeps_a_finite_second_moment(device, amsgrad):
    """|g| > 1.8e19 squares past float32's range; torch.optim computes (1 - beta2) * g * g, finite up to ~5.8e20 at
    beta2 = 0.999. The op's second moment is finite too (it was inf, after which the element's update was 0 for
    good and a saved state was refused as damaged), and the weights and moments follow torch's in float64."""
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    p0 = torch.tensor([0.5, -0.25, 1.0, 2.0])
    ref, ours = Reference(p0, amsgrad=amsgrad, **hyper), Ours(p0, device, amsgrad=amsgrad)
    for g in ([3e19, -1.0, 0.5, -4e20], [1.0, 2.0, -1.0, 1.0], [-1.0, 0.5, 2.0, -3.0]):
        grads = [torch.tensor(g), torch.tensor(g)]  # two workers: their mean is g
        ref.step(grads)
        ours.step(grads, **hyper)
        assert torch.isfinite(ours.v).all(), ours.v
        torch.testing.assert_close(ours.v.cpu().double(), ref.state("exp_avg_sq"), rtol=1e-6, atol=0)
        torch.testing.assert_close(ours.m.cpu().double(), ref.state("exp_avg"), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours.p.cpu().double(), ref.p.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("max_grad_norm", [None, 0.5], ids=["no_clip", "clip"])
def test_grad_scale_unscales(rng, device, max_grad_norm):
    """grad_scale divides the gradients; with clipping, the norm compared to max_grad_norm is the unscaled one."""
    n, scale = 1009, 1024.0
    p0 = torch.randn(n, generator=rng)
    ref, ours = Reference(p0, **HYPER), Ours(p0, device)
    grad_scale = torch.tensor([scale], device=device)
    for _ in range(5):
        grads = random_grads(rng, n, 2)
        ref.step(grads, max_grad_norm=max_grad_norm)
        ours.step([g * scale for g in grads], grad_scale=grad_scale, max_grad_norm=max_grad_norm, **HYPER)
    check_state(ref, ours)


def test_found_inf_skips_and_zero_does_not(rng, device):
    n = 2053
    p0 = torch.randn(n, generator=rng)
    ours, plain = Ours(p0, device), Ours(p0, device)
    grads = random_grads(rng, n, 2)
    before = [t.clone() for t in (ours.p, ours.m, ours.v)]
    ours.step(grads, found_inf=torch.ones(1, device=device), **HYPER)
    for now, then in zip((ours.p, ours.m, ours.v), before):
        assert torch.equal(now, then), "found_inf != 0 must leave every buffer untouched"
    ours.t = 0
    ours.step(grads, found_inf=torch.zeros(1, device=device), **HYPER)
    plain.step(grads, **HYPER)
    assert torch.equal(ours.p, plain.p) and torch.equal(ours.m, plain.m) and torch.equal(ours.v, plain.v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_param_out_is_the_rounded_update(rng, device, dtype):
    n = 4099
    ours = Ours(torch.randn(n, generator=rng), device)
    out = torch.full((n,), float("nan"), dtype=dtype, device=device)
    for _ in range(3):
        ours.step(random_grads(rng, n, 2), param_out=out, **HYPER)
        assert torch.equal(out, ours.p.to(dtype)), "param_out must equal the updated fp32 weights cast by torch"


def test_clipping_by_mean_gradient_norm(rng, device):
    n = 10_007
    p0 = torch.randn(n, generator=rng)
    ref, ours = Reference(p0, **HYPER), Ours(p0, device)
    for _ in range(5):
        grads = random_grads(rng, n, 3)
        true_norm = (sum(g.double() for g in grads) / 3).norm().item()
        max_norm = 0.25 * true_norm  # always clips
        ref_norm = ref.step(grads, max_grad_norm=max_norm)
        our_norm = ours.step(grads, max_grad_norm=max_norm, **HYPER)
        assert our_norm.item() == pytest.approx(ref_norm.item(), rel=1e-5)
    check_state(ref, ours)


def test_clipping_skips_step_on_nonfinite_gradient(rng, device):
    ours = Ours(torch.randn(100, generator=rng), device)
    grads = random_grads(rng, 100, 2)
    grads[1][37] = float("inf")
    before = ours.p.clone()
    norm = ours.step(grads, max_grad_norm=1.0, **HYPER)
    assert not torch.isfinite(norm)
    assert torch.equal(ours.p, before) and torch.equal(ours.m, torch.zeros_like(ours.m))
    assert torch.equal(ours.v, torch.zeros_like(ours.v))


@pytest.mark.parametrize("grad_norm", [-2.0, float("nan"), float("-inf")])
def test_a_clip_norm_below_zero_or_nan_skips_the_step(rng, device, grad_norm):
    """The op takes the norm as a tensor (it may come from another device pass): a norm that is not a finite number
    >= 0 skips the step, as a non-finite one does; a negative one would otherwise reverse the update's sign."""
    call = valid_call(device)
    before = {k: call[k].clone() for k in ("param", "exp_avg", "exp_avg_sq")}
    torch.ops.pyengine.mean_grad_adamw_.default(
        call["param"], call["exp_avg"], call["exp_avg_sq"], call["grads"], lr=1e-3, beta1=0.9, beta2=0.999,
        eps=1e-8, weight_decay=0.0, step=1, adamw=True, maximize=False, amsgrad=False, max_exp_avg_sq=None,
        grad_scale=None, found_inf=None, weights=None, param_out=None,
        grad_norm=torch.tensor(grad_norm, device=device), max_grad_norm=1.0)
    for k, v in before.items():
        assert torch.equal(call[k], v), f"{k} changed under grad_norm={grad_norm}"


def test_a_bound_below_float_range_still_clips(device):
    """max_grad_norm is a double; one below float's smallest subnormal must clip to ~0, not round to 0 (which means
    no clipping to the kernels)."""
    n = 8
    ours = Ours(torch.zeros(n), device)
    ours.step([torch.ones(n)], max_grad_norm=1e-46, **HYPER)
    assert ours.m.abs().max().item() < 1e-40, "the gradient must have been clipped to ~0"
    unclipped = Ours(torch.zeros(n), device)
    unclipped.step([torch.ones(n)], **HYPER)
    assert unclipped.m.abs().min().item() > 1e-3


def test_flat_signature_is_the_documented_one():
    """Other code calls the flat form by this exact signature (names, order, kinds, defaults)."""
    empty = inspect.Parameter.empty
    expected = [("param", empty), ("exp_avg", empty), ("exp_avg_sq", empty), ("grads", empty), ("lr", empty),
                ("beta1", 0.9), ("beta2", 0.999), ("eps", 1e-8), ("weight_decay", 0.0), ("step", empty),
                ("adamw", True), ("maximize", False), ("amsgrad", False), ("max_exp_avg_sq", None),
                ("grad_scale", None), ("found_inf", None), ("weights", None), ("param_out", None)]
    params = inspect.signature(ops.mean_grad_adamw_).parameters.values()
    assert [(p.name, p.default) for p in params] == expected
    kinds = [p.kind for p in params]
    assert kinds == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 4 + [inspect.Parameter.KEYWORD_ONLY] * 14


# ---------------------------------------------------------------------------------------------------------------
# Norm


@pytest.mark.parametrize("n", [1, 17, 1_000_003])
@pytest.mark.parametrize("workers", [1, 3, 8])
def test_mean_grad_norm(rng, device, n, workers):
    grads = [g.to(device) for g in random_grads(rng, n, workers, (torch.float32, torch.bfloat16))]
    expected = (sum(g.double().cpu() for g in grads) / workers).norm().item()
    norm, nonfinite = ops.mean_grad_norm(grads)
    assert norm.dtype == torch.float32 and norm.device.type == device.type
    assert norm.item() == pytest.approx(expected, rel=1e-5)
    assert nonfinite.item() == 0.0


def test_mean_grad_norm_weighted(rng, device):
    grads = [g.to(device) for g in random_grads(rng, 5000, 2)]
    expected = (0.25 * grads[0].double() + 0.75 * grads[1].double()).norm().item()
    assert ops.mean_grad_norm(grads, weights=[0.25, 0.75]).norm.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_mean_grad_norm_reports_nonfinite(rng, device, bad):
    grads = [g.to(device) for g in random_grads(rng, 4097, 2)]
    grads[1][4096] = bad
    norm, nonfinite = ops.mean_grad_norm(grads)
    assert nonfinite.item() == 1.0 and not torch.isfinite(norm)


@pytest.mark.parametrize("case", ["one element past 1.8e19", "many elements whose squares sum past float32",
                                  "elements near float32's top"])
def test_a_finite_gradient_whose_squares_overflow_float32_has_a_finite_norm(rng, device, case):
    """Note [A finite gradient's squares beyond float32]: the squares were summed in float32 only, so a finite
    gradient of norm > 1.8e19 had an infinite norm flagged non-finite, and the engine skipped (or raised for) a step
    torch.optim takes. The norm is now float64's where float32 overflowed, every flag as the elements say; a norm
    beyond float32's own range is not finite (the update's scalars are float32)."""
    g = torch.randn(4103, generator=rng)
    if case == "one element past 1.8e19":
        g[4100] = 3e20
    elif case == "many elements whose squares sum past float32":
        g *= 1e18  # each square < 3.4e38; their sum is ~4e39
    else:
        g[:100] = 3e38  # the norm of their mean: 7.5e38
    grads = [g.to(device), (-0.5 * g).to(device)]  # their mean: g / 4 (finite in float32)
    expected = (g.double() / 4).norm().item()
    norm, nonfinite = ops.mean_grad_norm(grads)
    if expected < torch.finfo(torch.float32).max:
        assert nonfinite.item() == 0.0 and norm.item() == pytest.approx(expected, rel=1e-5)
        [multi] = [ops.mean_grad_norm_multi([[grads[0][:100], grads[0][100:]], [grads[1][:100], grads[1][100:]]])]
        assert multi.nonfinite.item() == 0.0 and multi.norm.item() == pytest.approx(expected, rel=1e-5)
    else:
        assert nonfinite.item() == 1.0 and norm.item() == float("inf")
    grads[1][7] = float("nan")  # a non-finite element is flagged on either path
    assert ops.mean_grad_norm(grads).nonfinite.item() == 1.0


def float32_mean_or_wide(grads):
    """The mean gradient as Note [A finite mean whose float32 sum overflows] defines it, computed with torch: the
    float32 sum (list order) times float32(1/G) where that sum is finite, else the float64 sum times the same
    multiplier, rounded to float32 once."""
    mult = torch.tensor(1 / len(grads), dtype=torch.float32)
    narrow, wide = grads[0].float().clone(), grads[0].double().clone()
    for g in grads[1:]:
        narrow += g.float()
        wide += g.double()
    return torch.where(torch.isfinite(narrow), narrow * mult, (wide * mult.double()).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("workers", [2, 3, 5, 9])
def test_a_finite_mean_whose_float32_sum_overflows_is_summed_again_in_float64(rng, device, dtype, workers):
    """The G gradients are summed in float32 and divided by G after: finite gradients whose sum passes float32's
    range gave an inf mean, and the update wrote NaN weights where torch.optim, on the mean, takes a finite step.
    Such elements are summed again in float64: the update equals, bit for bit, the one-gradient update on the mean
    computed by torch (float32 where its sum is finite, float64 rounded once where not), and the weights stay
    finite. Elements in the first tile, across tile edges, in a long tile (G = 5 and 9 fp32 take two summation
    passes), in the last partial tile; sums that overflow and cancel (mean 0); a NaN and an inf gradient element
    still give NaN/inf as before."""
    n = 40_003
    grads = [on_grid(torch.randn(n, generator=rng)).to(dtype) for _ in range(workers)]
    big = torch.tensor(3e38).to(dtype).item()
    for k, g in enumerate(grads):
        g[[3, 1023, 1024, 17_000, n - 1]] = big  # mean: big
        g[2000] = big if k % 2 == 0 else -big  # partial sums overflow (G >= 3); an odd G's mean is big / G
        g[2001] = -big if k < workers - 1 else big  # -big - big = -inf, then + big
    grads[0][7] = float("nan")
    grads[1][9] = float("inf")
    p0 = on_grid(torch.randn(n, generator=rng))
    mean = float32_mean_or_wide(grads)
    assert not torch.isfinite(sum(g.float() for g in grads)[[3, 1024, n - 1]]).any(), "the sums must overflow"
    assert torch.isfinite(mean[[3, 1024, 17_000, n - 1, 2000, 2001]]).all()
    forms = [(False, True), (True, False), (True, True)] if device.type == "cpu" else [(False, None), (True, None)]
    for amsgrad, prefetch in forms:  # the CPU's plain and prefetching loops (Note [Prefetching the streams])
        fused, one = Ours(p0, device, amsgrad=amsgrad), Ours(p0, device, amsgrad=amsgrad)
        outs = [torch.empty(n, dtype=torch.bfloat16, device=device) for _ in range(2)]
        previous = ops._C._set_cpu_prefetch(prefetch) if prefetch is not None else None
        try:
            for step in range(2):
                fused.step(grads, param_out=outs[0], **HYPER)
                one.step([mean], param_out=outs[1], **HYPER)
        finally:
            if prefetch is not None:
                ops._C._set_cpu_prefetch(previous)
        for name, a, b in [("param", fused.p, one.p), ("exp_avg", fused.m, one.m), ("exp_avg_sq", fused.v, one.v),
                           ("param_out", *outs)] + ([("max_exp_avg_sq", fused.vmax, one.vmax)] if amsgrad else []):
            assert torch.equal(a.isnan(), b.isnan()), f"{name}: NaN elements differ"
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), f"{name} differs from the update on the mean"
        finite = torch.ones(n, dtype=torch.bool)
        finite[[7, 9]] = False
        assert torch.isfinite(fused.p.cpu()[finite]).all() and torch.isnan(fused.p.cpu()[[7, 9]]).all()


def test_clipping_a_finite_mean_whose_float32_sum_overflows_takes_torchs_step(rng, device):
    """The clip norm of a mean whose float32 sum overflows is finite (it was flagged non-finite, so the step was
    skipped); the clipped step is torch.optim's (float64, clip_grad_norm_ on the mean), and finite."""
    n, workers = 5003, 3
    grads = random_grads(rng, n, workers)
    for g in grads:
        g[11] = 2e38  # float32 sum inf, mean 2e38
        g[4000] = 3e38
    grads[2][4000] = -3e38  # float32 sum 3e38 + 3e38 = inf, then inf; mean 1e38. The norm, ~2.2e38, fits float32
    hyper = dict(HYPER, weight_decay=0.0)
    ref = Reference(on_grid(torch.randn(n, generator=rng)), **hyper)
    ours = Ours(ref.p.detach(), device)
    for _ in range(2):
        expected_norm = ref.step(grads, max_grad_norm=1e10).item()
        norm = ours.step(grads, max_grad_norm=1e10, **hyper)
        assert norm.item() == pytest.approx(expected_norm, rel=1e-6)
        assert torch.isfinite(ours.p).all() and torch.isfinite(ours.v).all()
    check_state(ref, ours)
    assert ops.mean_grad_norm([g.to(device) for g in grads]).nonfinite.item() == 0.0


def test_the_norm_ops_refuse_gradients_of_another_shape(device):
    """The norm pairs elements by position, as the update does: a transposed gradient made contiguous paired the
    wrong elements without a word (2.050 for 1.643), where the update refuses it."""
    a = torch.arange(6.0).reshape(2, 3).to(device)
    with pytest.raises(ValueError, match=r"grads\[1\]\[0\] must have the shape of worker 0's gradient \[2, 3\]"):
        ops.mean_grad_norm_multi([[a, a], [a.t().contiguous(), a]])
    with pytest.raises(ValueError, match=r"grads\[1\] must have the shape of worker 0's gradient \[2, 3\]"):
        ops.mean_grad_norm([a, a.reshape(-1)])


# ---------------------------------------------------------------------------------------------------------------
# Multi-tensor form

SHAPES = [(7,), (33, 5), (1,), (4097,), (3, 3, 3), (0,)]


def multi_buffers(rng, device, shapes=SHAPES):
    params = [torch.randn(s, generator=rng).to(device) for s in shapes]
    return params, [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]


def test_multi_equals_flat_per_tensor(rng, device):
    workers = 3
    params, ms, vs = multi_buffers(rng, device)
    flat_p = [p.clone().reshape(-1) for p in params]
    flat_m = [torch.zeros_like(p) for p in flat_p]
    flat_v = [torch.zeros_like(p) for p in flat_p]
    outs = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    for step in range(1, 4):
        grads = [[torch.randn(s, generator=rng).to(device) for s in SHAPES] for _ in range(workers)]
        ops.mean_grad_adamw_multi_(params, ms, vs, grads, step=step, param_outs=outs, **HYPER)
        for i in range(len(params)):
            ops.mean_grad_adamw_(flat_p[i], flat_m[i], flat_v[i], [g[i].reshape(-1) for g in grads], step=step,
                                 **HYPER)
    for i in range(len(params)):
        assert torch.equal(params[i].reshape(-1), flat_p[i]) and torch.equal(ms[i].reshape(-1), flat_m[i])
        assert torch.equal(vs[i].reshape(-1), flat_v[i]) and torch.equal(outs[i], params[i].to(torch.bfloat16))


def test_multi_global_norm_clipping(rng, device):
    shapes = [(100,), (20, 30), (5,)]
    params, ms, vs = multi_buffers(rng, device, shapes)
    ref = [torch.nn.Parameter(p.detach().double().cpu().clone()) for p in params]
    opt = torch.optim.AdamW(ref, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], foreach=False)
    for step in range(1, 5):
        grads = [[torch.randn(s, generator=rng) for s in shapes] for _ in range(2)]
        for i, r in enumerate(ref):
            r.grad = (grads[0][i].double() + grads[1][i].double()) / 2
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        opt.step()
        norm = ops.mean_grad_adamw_multi_(params, ms, vs, [[g.to(device) for g in w] for w in grads], step=step,
                                          max_grad_norm=1.0, **HYPER)
        assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-5)
    for p, r in zip(params, ref):
        assert_fp32_close(p, r, "param")


def test_multi_norm_matches_concatenation(rng, device):
    params, _, _ = multi_buffers(rng, device)
    grads = [[torch.randn(p.shape, generator=rng).to(device) for p in params] for _ in range(2)]
    flat = [torch.cat([g.reshape(-1) for g in w]) for w in grads]
    assert ops.mean_grad_norm_multi(grads).norm.item() == pytest.approx(ops.mean_grad_norm(flat).norm.item(),
                                                                        rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, and nothing written


def valid_call(device, n=64, workers=2):
    p = torch.randn(n, device=device)
    return dict(param=p, exp_avg=torch.rand(n, device=device), exp_avg_sq=torch.rand(n, device=device),
                grads=[torch.randn(n, device=device) for _ in range(workers)], lr=1e-3, step=1)


def _amsgrad_with(buffer):
    """A mutation: amsgrad on, its buffer made from the call by ``buffer``."""
    def mutate(a):
        a["amsgrad"] = True
        a["max_exp_avg_sq"] = buffer(a)
    return mutate


def _set(key, value):
    return lambda a: a.__setitem__(key, value(a) if callable(value) else value)


BAD_CALLS = {
    "length": (_set("exp_avg", lambda a: torch.zeros(63, device=a["param"].device)), r"exp_avg must have 64 elements"),
    "grad length": (_set("grads", lambda a: [a["grads"][0], a["grads"][1][:-1]]), r"grads\[1\] must have 64"),
    "no workers": (_set("grads", []), r"G >= 1"),
    "float64 param": (_set("param", lambda a: a["param"].double()), r"param must be float32"),
    "int grad": (_set("grads", lambda a: [a["grads"][0], a["grads"][1].int()]), r"grads\[1\] must be float32, bf"),
    "fp16 exp_avg": (_set("exp_avg", lambda a: a["exp_avg"].half()), r"exp_avg must be float32"),
    "non-contiguous": (_set("exp_avg_sq", lambda a: torch.rand(128, device=a["param"].device)[::2]),
                       r"exp_avg_sq must be contiguous"),
    "2-D param": (_set("param", lambda a: a["param"].view(8, 8)), r"param must be 1-D"),
    "overlap": (_set("exp_avg", lambda a: a["param"]), r"overlap"),
    "grad overlaps output": (_set("grads", lambda a: [a["grads"][0], a["exp_avg_sq"]]), r"overlaps exp_avg_sq"),
    "param_out overlaps": (_set("param_out", lambda a: a["exp_avg"]), r"overlap"),
    "amsgrad without buffer": (_set("amsgrad", True), r"amsgrad=True needs max_exp_avg_sq"),
    "a string switch": (_set("maximize", "False"), r"maximize must be True or False; got 'False'"),
    "an int switch": (_set("adamw", 0), r"adamw must be True or False; got 0"),
    "negative lr": (_set("lr", -1e-3), r"lr must be a finite number >= 0"),
    "nan lr": (_set("lr", float("nan")), r"lr must be"),
    "negative eps": (_set("eps", -1.0), r"eps must be"),
    # an element whose gradients are all 0 divided 0 by 0: NaN in the weights (below float32's normals: flushed to 0)
    "zero eps": (_set("eps", 0.0), r"eps must be a finite number >= 1.17549e-38 \(float32's smallest normal"),
    "subnormal eps": (_set("eps", 1e-40), r"eps must be a finite number >= 1.17549e-38"),
    "beta1 = 1": (_set("beta1", 1.0), r"beta1 must be in \[0, 1\)"),
    "beta2 < 0": (_set("beta2", -0.1), r"beta2 must be in \[0, 1\)"),
    "negative weight_decay": (_set("weight_decay", -0.1), r"weight_decay must be"),
    "step 0": (_set("step", 0), r"step must be >= 1"),
    "weights length": (_set("weights", [1.0]), r"weights must have one entry per worker \(2\)"),
    "weights sum": (_set("weights", [0.5, 0.6]), r"weights must sum to 1"),
    "negative weight": (_set("weights", [1.5, -0.5]), r"weights\[1\] must be"),
    "grad_scale shape": (_set("grad_scale", lambda a: torch.ones(2, device=a["param"].device)),
                         r"grad_scale must have exactly 1 element"),
    "found_inf dtype": (_set("found_inf", lambda a: torch.zeros(1, dtype=torch.float64, device=a["param"].device)),
                        r"found_inf must be float32"),
    "param_out length": (_set("param_out", lambda a: torch.empty(3, dtype=torch.bfloat16,
                                                                 device=a["param"].device)),
                         r"param_out must have 64 elements"),
    "max_grad_norm": (_set("max_grad_norm", -1.0), r"max_grad_norm must be > 0"),
    "grads not a list": (_set("grads", lambda a: a["grads"][0]), r"grads must be a list of tensors"),
    "grad not a tensor": (_set("grads", lambda a: [a["grads"][0], None]), r"grads\[1\] must be a tensor; got NoneType"),
    "non-contiguous grad": (_set("grads", lambda a: [a["grads"][0], torch.rand(128, device=a["param"].device)[::2]]),
                            r"grads\[1\] must be contiguous \(it is read as a flat array\)"),
    "grad on meta": (_set("grads", lambda a: [a["grads"][0], torch.rand(64, device="meta")]),
                     r"every tensor must be on one device; got param on .*, grads\[1\] on meta"),
    "found_inf on meta": (_set("found_inf", torch.zeros(1, device="meta")), r"found_inf on meta"),
    "step not an int": (_set("step", 1.5), r"step must be an int"),
    "step too large": (_set("step", 2**70), r"step must be >= 1 and < 2\*\*63"),
    "lr not a number": (_set("lr", "abc"), r"lr must be a number; got 'abc'"),
    "weight not a number": (_set("weights", [0.5, "0.5"]), r"weights\[1\] must be a number"),
    "nan weight": (_set("weights", [float("nan"), 1.0]), r"weights\[0\] must be a finite number"),
    "inf weight": (_set("weights", [float("inf"), 0.0]), r"weights\[0\] must be a finite number"),
    "nan eps": (_set("eps", float("nan")), r"eps must be a finite number"),
    "nan beta1": (_set("beta1", float("nan")), r"beta1 must be in \[0, 1\)"),
    "nan beta2": (_set("beta2", float("nan")), r"beta2 must be in \[0, 1\)"),
    "exp_avg is exp_avg_sq": (_set("exp_avg_sq", lambda a: a["exp_avg"]), r"exp_avg(_sq)? and exp_avg(_sq)? overlap"),
    "param_out overlaps param": (_set("param_out", lambda a: a["param"]), r"overlap"),
    "param_out overlaps a grad": (_set("param_out", lambda a: a["grads"][1]), r"grads\[1\] overlaps param_out"),
    "non-contiguous param": (_set("param", lambda a: torch.rand(128, device=a["param"].device)[::2]),
                             r"param must be contiguous"),
    "2-D exp_avg": (_set("exp_avg", lambda a: a["exp_avg"].view(8, 8)), r"exp_avg must be 1-D \(flat form\)"),
    "2-D grad": (_set("grads", lambda a: [a["grads"][0], a["grads"][1].view(8, 8)]), r"grads\[1\] must be 1-D"),
    "2-D param_out": (_set("param_out", lambda a: torch.empty(8, 8, device=a["param"].device)),
                      r"param_out must be 1-D"),
    "found_inf numel": (_set("found_inf", lambda a: torch.zeros(2, device=a["param"].device)),
                        r"found_inf must have exactly 1 element"),
    "grad_scale dtype": (_set("grad_scale", lambda a: torch.ones(1, dtype=torch.float16, device=a["param"].device)),
                         r"grad_scale must be float32"),
    "max_exp_avg_sq dtype": (_amsgrad_with(lambda a: torch.zeros(64, dtype=torch.float64, device=a["param"].device)),
                             r"max_exp_avg_sq must be float32"),
    "max_exp_avg_sq is exp_avg_sq": (_amsgrad_with(lambda a: a["exp_avg_sq"]), r"overlap"),
    "max_grad_norm None": (_set("max_grad_norm", None), r"max_grad_norm must be a number > 0"),
    # the kernels compute in float32: a double beyond its range was narrowed (undefined; -inf in the weights)
    "lr beyond float32": (_set("lr", 1e300), r"lr = 1e\+300 is beyond float32's range"),
    "eps beyond float32": (_set("eps", 1e39), r"eps = 1e\+39 is beyond float32's range"),
    "lr x weight_decay beyond float32": (lambda a: a.update(lr=1e30, weight_decay=1e30),
                                         r"1 - lr \* weight_decay = .* is beyond float32's range"),
    "lr / bias correction beyond float32": (lambda a: a.update(lr=1e38, beta1=0.9),
                                            r"lr / \(1 - beta1\^step\) = .* is beyond float32's range"),
}


def test_a_clipping_bound_beyond_float32_does_not_clip(device):
    """max_grad_norm past float's range (finite) was narrowed to float (undefined behaviour); it is a bound no norm
    reaches: the same bits as no clipping."""
    clipped = valid_call(device)
    plain = {k: v.clone() for k, v in clipped.items() if isinstance(v, torch.Tensor)}
    grads = [g.clone() for g in clipped["grads"]]
    ops.mean_grad_adamw_(plain["param"], plain["exp_avg"], plain["exp_avg_sq"], grads, lr=1e-3, step=1)
    ops.mean_grad_adamw_clipped_(clipped["param"], clipped["exp_avg"], clipped["exp_avg_sq"], clipped["grads"],
                                 lr=1e-3, step=1, max_grad_norm=1e300)
    for key in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(clipped[key], plain[key]), key


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_is_a_clear_error_and_writes_nothing(device, case):
    mutate, message = BAD_CALLS[case]
    call = valid_call(device)
    call.setdefault("param_out", torch.zeros(64, dtype=torch.bfloat16, device=device))
    mutate(call)
    outputs = [call[k] for k in ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "param_out")
               if isinstance(call.get(k), torch.Tensor) and call[k].dtype != torch.float64]
    before = [t.clone() for t in outputs]
    update = ops.mean_grad_adamw_clipped_ if "max_grad_norm" in call else ops.mean_grad_adamw_
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        update(call.pop("param"), call.pop("exp_avg"), call.pop("exp_avg_sq"), call.pop("grads"), **call)
    for now, then in zip(outputs, before):  # bit for bit; a buffer made by torch.empty may hold NaNs
        torch.testing.assert_close(now, then, rtol=0, atol=0, equal_nan=True, msg="a rejected call must not write")


def _misaligned(n, dtype=torch.float32):
    """n elements whose data starts one byte past an element boundary (torch.frombuffer at an odd offset)."""
    size = torch.empty((), dtype=dtype).element_size()
    t = torch.frombuffer(bytearray(n * size + 1), dtype=dtype, offset=1, count=n)
    assert t.data_ptr() % size != 0  # the premise
    return t


@pytest.mark.parametrize("key,message", [("grads", r"grads\[1\]'s data must start on a multiple of its element size"),
                                         ("param", r"param's data must start on a multiple of its element size"),
                                         ("found_inf", r"found_inf's data must start on a multiple of 4 bytes"),
                                         ("norm", r"mean_grad_norm: grads\[1\]'s data must start")])
def test_misaligned_tensors_are_refused(key, message):
    """A tensor whose data is not on its element size's boundary was accepted: undefined behaviour on the CPU (typed
    pointers), a misaligned-address fault on CUDA, which ends the process's CUDA context."""
    call = valid_call("cpu")
    odd = _misaligned(1 if key == "found_inf" else 64)
    odd.copy_(torch.zeros(1) if key == "found_inf" else call["grads"][1])
    before = call["param"].clone()
    with pytest.raises(ValueError, match=message):
        if key == "norm":
            ops.mean_grad_norm([call["grads"][0], odd])
        elif key == "grads":
            ops.mean_grad_adamw_(call["param"], call["exp_avg"], call["exp_avg_sq"], [call["grads"][0], odd],
                                 lr=1e-3, step=1)
        elif key == "param":
            before = odd.clone()
            ops.mean_grad_adamw_(odd, call["exp_avg"], call["exp_avg_sq"], call["grads"], lr=1e-3, step=1)
        else:
            ops.mean_grad_adamw_(call["param"], call["exp_avg"], call["exp_avg_sq"], call["grads"], lr=1e-3, step=1,
                                 found_inf=odd)
    assert torch.equal(odd if key == "param" else call["param"], before)


def test_a_zero_tensor_is_refused_by_name():
    """torch.sgn's gradient is a ZeroTensor (no memory): the dispatcher made it an expanded zero, refused as
    "non-contiguous"."""
    call = valid_call("cpu")
    zero = torch._efficientzerotensor(64)
    with pytest.raises(ValueError, match=r"grads\[1\] is a ZeroTensor .*pass torch.zeros"):
        ops.mean_grad_adamw_(call["param"], call["exp_avg"], call["exp_avg_sq"], [call["grads"][0], zero], lr=1e-3,
                             step=1)
    with pytest.raises(ValueError, match=r"grads\[0\] is a ZeroTensor"):
        ops.mean_grad_norm([zero])


@pytest.mark.parametrize("where", ["param_out", "param", "grads", "multi"])
def test_a_negative_view_is_refused_before_anything_is_written(where):
    """Note [Negative views and the update ops]: a tensor with the negative bit (here .conj().imag of a complex
    tensor, made with public ops only) went to torch's fallback for such tensors, which failed an internal assert
    and left freed tensors behind: reading the parameter afterwards crashed the process."""
    call = valid_call("cpu")
    negative = torch.zeros(64, dtype=torch.complex64).conj().imag
    assert negative.is_neg()
    before = {k: v.clone() for k, v in call.items() if isinstance(v, torch.Tensor)}
    p, m, v, grads = call["param"], call["exp_avg"], call["exp_avg_sq"], call["grads"]
    calls = {
        "param_out": (r"param_out", lambda: ops.mean_grad_adamw_(p, m, v, grads, lr=1e-3, step=1, param_out=negative)),
        "param": (r"param", lambda: ops.mean_grad_adamw_(negative, m, v, grads, lr=1e-3, step=1)),
        "grads": (r"grads\[1\]", lambda: ops.mean_grad_adamw_(p, m, v, [grads[0], negative], lr=1e-3, step=1)),
        "multi": (r"param_outs\[0\]", lambda: ops.mean_grad_adamw_multi_([p], [m], [v], [[g] for g in grads], lr=1e-3,
                                                                          step=1, param_outs=[negative]))}
    name, run = calls[where]
    with pytest.raises(ValueError, match=f"{name} is a negative view .*resolve_neg"):
        run()
    for key, value in before.items():
        assert torch.equal(call[key], value), key
    assert torch.equal(negative, torch.zeros(64))


@pytest.mark.timeout(120)
def test_a_negative_view_of_an_inference_tensor_is_refused():
    """Inference tensors skip the kernel that refuses negative views (Note [Negative views and the update ops]):
    one made under torch.inference_mode reached torch's fallback, which failed an internal assert and then aborted
    the process (SIGABRT, uncatchable) when the tensors were freed. The wrappers refuse it by name, every tensor
    argument of the flat, clipped and multi updates and of the norms, and nothing is written. In a child
    process, so that a regression aborts the child, not the test run."""
    script = textwrap.dedent("""
        import torch
        from pyengine import ops
        with torch.inference_mode():
            def fresh():
                return dict(p=torch.ones(8), m=torch.zeros(8), v=torch.zeros(8), g=torch.ones(8), s=torch.zeros(8),
                            o=torch.zeros(8), one=torch.ones(1), zero=torch.zeros(1))
            def flat(t, **kw):
                ops.mean_grad_adamw_(t["p"], t["m"], t["v"], [t["g"]], lr=0.1, step=1, **kw)
            cases = {
                "param": lambda t: ops.mean_grad_adamw_(torch._neg_view(t["p"]), t["m"], t["v"], [t["g"]], lr=0.1,
                                                        step=1),
                "exp_avg": lambda t: ops.mean_grad_adamw_(t["p"], torch._neg_view(t["m"]), t["v"], [t["g"]], lr=0.1,
                                                          step=1),
                "exp_avg_sq": lambda t: ops.mean_grad_adamw_(t["p"], t["m"], torch._neg_view(t["v"]), [t["g"]],
                                                             lr=0.1, step=1),
                "grads[0]": lambda t: ops.mean_grad_adamw_(t["p"], t["m"], t["v"], [torch._neg_view(t["g"])], lr=0.1,
                                                           step=1),
                "max_exp_avg_sq": lambda t: flat(t, amsgrad=True, max_exp_avg_sq=torch._neg_view(t["s"])),
                "param_out": lambda t: flat(t, param_out=torch._neg_view(t["o"])),
                "grad_scale": lambda t: flat(t, grad_scale=torch._neg_view(t["one"])),
                "found_inf": lambda t: flat(t, found_inf=torch._neg_view(t["zero"])),
                "clipped exp_avg": lambda t: ops.mean_grad_adamw_clipped_(t["p"], torch._neg_view(t["m"]), t["v"],
                                                                          [t["g"]], lr=0.1, step=1, max_grad_norm=1.0),
                "exp_avgs[0]": lambda t: ops.mean_grad_adamw_multi_([t["p"]], [torch._neg_view(t["m"])], [t["v"]],
                                                                    [[t["g"]]], lr=0.1, step=1),
                "exp_avg_sqs[0]": lambda t: ops.mean_grad_adamw_multi_([t["p"]], [t["m"]], [torch._neg_view(t["v"])],
                                                                       [[t["g"]]], lr=0.1, step=1),
                "norm grads[0]": lambda t: ops.mean_grad_norm([torch._neg_view(t["g"])]),
                "norm_multi grads[0][0]": lambda t: ops.mean_grad_norm_multi([[torch._neg_view(t["g"])]]),
            }
            for case, call in cases.items():
                t = fresh()
                before = {k: v.clone() for k, v in t.items()}
                try:
                    call(t)
                    print(case, "| returned")
                except ValueError as exc:
                    print(case, "|", exc)
                changed = [k for k in t if not torch.equal(t[k], before[k])]
                print(case, "| changed", changed)
                del t
        print("exited cleanly")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "exited cleanly", out.stdout
    said = dict(line.split(" | ", 1) for line in lines[:-1] if not line.split(" | ", 1)[1].startswith("changed"))
    for case, text in said.items():
        name = case.split(" ")[-1]
        assert text == f"{name} is a negative view (torch._neg_view, .conj().imag); resolve it first " \
                       "(.resolve_neg())", (case, text)
    assert len(said) == 13, out.stdout
    assert all(line.endswith("| changed []") for line in lines[:-1] if "| changed" in line), out.stdout


def test_empty_lists_are_clear_errors():
    g = torch.ones(4)
    with pytest.raises(ValueError, match=r"grads must hold G >= 1 gradients"):
        ops.mean_grad_norm([])
    with pytest.raises(ValueError, match=r"grads must hold G >= 1 lists"):
        ops.mean_grad_norm_multi([])
    with pytest.raises(ValueError, match=r"grads\[0\] must hold at least one gradient"):
        ops.mean_grad_norm_multi([[]])
    with pytest.raises(ValueError, match=r"params must hold at least one tensor"):
        ops.mean_grad_adamw_multi_([], [], [], [[]], lr=1e-3, step=1)
    with pytest.raises(ValueError, match=r"grads must hold G >= 1 lists"):
        ops.mean_grad_adamw_multi_([g], [g.clone()], [g.clone()], [], lr=1e-3, step=1)


@pytest.mark.parametrize("scale", [0.0, -2.0, float("nan"), float("inf"), 1e-40])
@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_broken_grad_scale_skips_the_step(rng, device, scale, max_grad_norm):
    """A loss scale that is not a positive finite number never reaches the weights: the step is skipped, as with
    found_inf, decided where the scale lives (on the device for CUDA: no host sync). So is a subnormal one whose
    inverse overflows float32 (1e-40: torch's GradScaler unscales by that inf and skips too; it wrote NaN)."""
    n = 1031
    ours = Ours(torch.randn(n, generator=rng), device)
    before = [t.clone() for t in (ours.p, ours.m, ours.v)]
    ours.step(random_grads(rng, n, 2), grad_scale=torch.tensor([scale], device=device), max_grad_norm=max_grad_norm,
              **HYPER)
    for now, then in zip((ours.p, ours.m, ours.v), before):
        assert torch.equal(now, then), f"grad_scale={scale} must leave every buffer untouched"


@CUDA
def test_device_mismatch_is_an_error():
    call = valid_call("cpu")
    call["grads"] = [call["grads"][0], call["grads"][1].cuda()]
    with pytest.raises(ValueError, match=r"grads\[1\] must be on cpu"):
        ops.mean_grad_adamw_(call.pop("param"), call.pop("exp_avg"), call.pop("exp_avg_sq"), call.pop("grads"),
                             **call)
    # the norm of many tensors: the second tensor's gradients on another device than the first's (the kernel would
    # read them as device memory)
    with pytest.raises(ValueError, match=r"grads\[0\]\[1\] must be on cuda"):
        ops.mean_grad_norm_multi([[torch.ones(3, device="cuda"), torch.ones(4)]])


def test_multi_bad_structure_is_an_error(device):
    params, ms, vs = multi_buffers(torch.Generator().manual_seed(0), device, [(3,), (4,)])
    with pytest.raises(ValueError, match=r"grads\[1\] must hold one gradient per param \(2\)"):
        ops.mean_grad_adamw_multi_(params, ms, vs, [[torch.zeros(3), torch.zeros(4)], [torch.zeros(3)]], lr=1e-3,
                                   step=1)
    with pytest.raises(ValueError, match=r"params, exp_avgs and exp_avg_sqs must have the same length"):
        ops.mean_grad_adamw_multi_(params, ms[:1], vs, [[p.clone() for p in params]], lr=1e-3, step=1)
    # Elements pair by position: a gradient or state of another shape (a transposed one made contiguous) is refused,
    # nothing written
    square = [torch.zeros(2, 3, device=device)], [torch.zeros(2, 3, device=device)], [torch.zeros(2, 3, device=device)]
    for name, call in (("grads\\[0\\]", lambda: ops.mean_grad_adamw_multi_(
            *square, [[torch.ones(3, 2, device=device)]], lr=1e-3, step=1)),
                       ("exp_avg", lambda: ops.mean_grad_adamw_multi_(
            square[0], [torch.zeros(6, device=device)], square[2], [[torch.ones(2, 3, device=device)]], lr=1e-3,
            step=1))):
        with pytest.raises(ValueError, match=name + r" must have param's shape \[2, 3\]"):
            call()
        assert all(torch.count_nonzero(t[0]) == 0 for t in square)
    # A tensor where a list belongs: the message says what the list holds (params are no per-worker list)
    for at, want in ((0, r"params must be a list of tensors; got Tensor"),
                     (1, r"exp_avgs must be a list of tensors, one per param; got Tensor"),
                     (3, r"grads\[0\] must be a list of tensors, one per param; got Tensor")):
        args = [params, ms, vs, [[p.clone() for p in params]]]
        args[at] = params[0] if at < 3 else [params[0]]
        with pytest.raises(TypeError, match="^" + want + "$"):
            ops.mean_grad_adamw_multi_(*args, lr=1e-3, step=1)


# ---------------------------------------------------------------------------------------------------------------
# Determinism, ISA variants, torch.library integration


def update_inputs(seed=None, n=100_003):
    """Inputs of one_update. Generated once and passed around: torch.randn itself differs between CPU ISAs."""
    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.empty((), dtype=torch.int64)
                                                                          .random_().item()))
    p0 = torch.randn(n, generator=gen)
    steps = [random_grads(gen, n, 3, (torch.float32, torch.bfloat16, torch.float16)) for _ in range(4)]
    for k in (0, 1):  # the last step's float32 sum passes float32's range at two elements, their mean does not
        steps[-1][k][[5, n - 2]] = 3e38
    return p0, steps


def one_update(device, inputs):
    """Three weighted steps, then an unweighted one whose float32 sum overflows at two elements (Note [A finite mean
    whose float32 sum overflows]): the weights, moments, bf16 copy, and the norms of the last two steps."""
    p0, steps = inputs
    state = Ours(p0, device, amsgrad=True)
    out = torch.empty(p0.numel(), dtype=torch.bfloat16, device=device)
    for k, grads in enumerate(steps):
        state.step(grads, param_out=out, weights=[0.2, 0.3, 0.5] if k < len(steps) - 1 else None, **HYPER)
    norm = ops.mean_grad_norm([g.to(device) for g in steps[-2]]).norm
    wide_norm = ops.mean_grad_norm([g.to(device) for g in steps[-1]]).norm
    return [state.p, state.m, state.v, state.vmax, out, norm, wide_norm]


def test_bit_reproducible_and_thread_count_independent(device):
    threads = torch.get_num_threads()
    try:
        inputs = update_inputs()
        torch.set_num_threads(1)
        first = one_update(device, inputs)
        torch.set_num_threads(max(2, threads))
        second = one_update(device, inputs)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(first, second):
        assert torch.equal(a, b)



def test_serial_on_this_thread_gives_the_same_bits_and_is_per_thread():
    """``_C._set_serial_on_this_thread`` (the engine's host thread beside CPU workers) runs the CPU ops without an
    OpenMP region: the same bits as the parallel run (fixed chunks), it returns the previous setting, and another
    thread keeps its own (default) setting."""
    from pyengine import _C

    inputs = update_inputs(n=1_000_003)  # many chunks, so the parallel run does split the work
    parallel = one_update("cpu", inputs)
    assert _C._set_serial_on_this_thread(True) is False
    try:
        serial = one_update("cpu", inputs)
        seen = []
        thread = threading.Thread(target=lambda: seen.append(_C._set_serial_on_this_thread(False)))
        thread.start()
        thread.join()
        assert seen == [False]  # the other thread's setting was the default, not this thread's
    finally:
        assert _C._set_serial_on_this_thread(False) is True
    for a, b in zip(parallel, serial):
        assert torch.equal(a, b)

F32, B16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize("dtypes", [(F32,) * 4, (F32,) * 5, (F32,) * 8, (F32,) * 9,
                                    (F32, F32, B16, F32, F32, F32, F32, F16, F32, F32),
                                    (B16,) * 5, (B16,) * 8, (B16,) * 9,
                                    (B16, B16, F32, F32, F32, B16, B16, B16, B16, B16, F16, B16, B16),
                                    (F16,) * 5, (F16,) * 9, (F16, F16, F16, B16, F16, F16, F32, F16, F16, F16, F16)],
                         ids=["fp32x4", "fp32x5", "fp32x8", "fp32x9", "mixed10", "bf16x5", "bf16x8", "bf16x9",
                              "mixed13", "fp16x5", "fp16x9", "mixed11"])
def test_gradients_summed_in_list_order(rng, device, dtypes):
    """The documented summation order, bit for bit: acc = w_0 g_0, then acc = acc + w_k g_k for k = 1..G-1 in fp32.

    With beta1 = 0, m = 0 and explicit weights, exp_avg after one step is exactly that sum (0 * m + 1 * g, times
    grad_mult 1). Full-precision random gradients make any other association order differ in some element; the test
    checks that a pairwise order would indeed be caught before it compares.
    """
    n, G = 100_003, len(dtypes)
    weights = (torch.rand(G, generator=rng, dtype=torch.float64) + 0.5)
    weights = (weights / weights.sum()).tolist()
    grads = [torch.randn(n, generator=rng).to(dt) for dt in dtypes]
    terms = [torch.tensor(w, dtype=torch.float32) * g.float() for w, g in zip(weights, grads)]
    expected = terms[0].clone()
    for x in terms[1:]:
        expected += x
    pairwise = terms[0] + terms[1]
    for k in range(2, G - 1, 2):
        pairwise += terms[k] + terms[k + 1]
    if G % 2:
        pairwise += terms[-1]
    assert not torch.equal(pairwise, expected), "the data must tell summation orders apart"

    p, m, v = torch.randn(n, device=device), torch.zeros(n, device=device), torch.zeros(n, device=device)
    ops.mean_grad_adamw_(p, m, v, [g.to(device) for g in grads], lr=1e-3, beta1=0.0, step=1, weights=weights)
    assert torch.equal(m.cpu(), expected)


ISA_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[2])
    import pyengine
    from test_ops import one_update
    inputs = torch.load(sys.argv[3])
    out = one_update(torch.device("cpu"), inputs)
    torch.save({"isa": pyengine._C.cpu_isa(), "prefetch": pyengine._C.cpu_prefetch(), "out": out}, sys.argv[1])
""")


def test_cpu_isa_variants_are_bit_identical(tmp_path):
    """Every ISA's loops, plain and prefetching (PYENGINE_CPU_PREFETCH), give the baseline plain loops' bits."""
    results = {}
    inputs = tmp_path / "inputs.pt"
    torch.save(update_inputs(), inputs)
    for isa in ["default", "avx2", "avx512"]:
        for prefetch in ["0", "1"]:
            path = tmp_path / f"{isa}{prefetch}.pt"
            env = dict(os.environ, ATEN_CPU_CAPABILITY=isa, PYENGINE_CPU_PREFETCH=prefetch)
            subprocess.run([sys.executable, "-c", ISA_SCRIPT, str(path), os.path.dirname(__file__), str(inputs)],
                           env=env, check=True, timeout=300)
            results[isa, prefetch] = torch.load(path)
            assert results[isa, prefetch]["prefetch"] is (prefetch == "1")
    assert results["default", "0"]["isa"] == "default", "ATEN_CPU_CAPABILITY=default must select the baseline loops"
    host = torch.backends.cpu.get_cpu_capability()
    if host in ("AVX2", "AVX512"):  # every variant the host can run must be the one that ran
        assert results["avx2", "0"]["isa"] == "avx2", results["avx2", "0"]["isa"]
    if host == "AVX512":
        assert results["avx512", "0"]["isa"] == "avx512", results["avx512", "0"]["isa"]
    for key, r in results.items():
        for a, b in zip(r["out"], results["default", "0"]["out"]):
            assert torch.equal(a, b), f"{key} differs from the baseline plain loops"


@pytest.mark.parametrize("grads", ["fp32", "mixed", "fp16"])
@pytest.mark.parametrize("workers", [1, 3, 4, 5, 8, 9, 13])
def test_cpu_prefetching_loops_give_the_plain_bits(rng, workers, grads):
    """The software-prefetching loops (on for Intel CPUs) against the plain ones in one process: the update, the
    clipped update and the norm pass. Gradients of every summation shape (G = 1 read in place; one group of up to 4
    or 8 fp32 gradients; several groups on long tiles: the two forms group differently; "mixed": every third one
    bf16, so lone fp32 gradients sit between them; "fp16": runs of fp16 gradients, widened a block at a time, with
    bf16 ones between them), an odd length that ends tiles and blocks mid-way, AdamW and Adam
    with amsgrad, a bf16 param_out. Full-precision gradients and uneven weights: another order of the additions
    would change some bits."""
    n = 100_003
    p0 = torch.randn(n, generator=rng)
    cycle = {"fp32": [F32], "mixed": [F32, B16, F32], "fp16": [F16, F16, B16, F16]}[grads]
    dtypes = [cycle[k % len(cycle)] for k in range(workers)]
    steps = [[torch.randn(n, generator=rng).to(dt) for dt in dtypes] for _ in range(3)]
    weights = torch.rand(workers, generator=rng, dtype=torch.float64) + 0.5
    weights = (weights / weights.sum()).tolist() if workers > 1 else None
    for adamw, amsgrad, clip in [(True, False, None), (False, True, None), (True, False, 1.0)]:
        results = []
        for prefetch in (False, True):
            previous = ops._C._set_cpu_prefetch(prefetch)
            try:
                assert ops._C.cpu_prefetch() is prefetch
                state = Ours(p0, "cpu", amsgrad=amsgrad)
                out = torch.empty(n, dtype=torch.bfloat16)
                norms = []
                for grads_ in steps:
                    norm = state.step(grads_, param_out=out, weights=weights, adamw=adamw, max_grad_norm=clip,
                                      **HYPER)
                    norms.append(norm if clip is not None else ops.mean_grad_norm(grads_, weights).norm)
            finally:
                ops._C._set_cpu_prefetch(previous)
            results.append([state.p, state.m, state.v, out, torch.stack(norms)] + ([state.vmax] if amsgrad else []))
        for name, a, b in zip(["param", "exp_avg", "exp_avg_sq", "param_out", "norm", "max_exp_avg_sq"], *results):
            assert torch.equal(a, b), f"G={workers} {grads} adamw={adamw} clip={clip}: prefetching {name} differs"


PREFETCH_SCRIPT = textwrap.dedent("""
    import sys, torch
    from pyengine import _C, ops
    try:
        on = _C.cpu_prefetch()
    except RuntimeError as e:
        on = str(e)
    p = torch.zeros(3)
    try:
        ops.mean_grad_adamw_(p, torch.zeros(3), torch.zeros(3), [torch.ones(3)], lr=0.1, step=1)
        called = "updated" if p.ne(0).all() else "not updated"
    except RuntimeError as e:
        called = str(e)
    print(repr((on, called)))
""")


@pytest.mark.parametrize("setting", [None, "0", "1", "yes"])
def test_cpu_prefetch_setting(setting):
    """PYENGINE_CPU_PREFETCH: unset = on for Intel CPUs only; 0/1 force it; anything else is an error naming the
    variable, from every op call (no update runs with a setting that was not meant)."""
    env = {k: v for k, v in os.environ.items() if k != "PYENGINE_CPU_PREFETCH"}
    if setting is not None:
        env["PYENGINE_CPU_PREFETCH"] = setting
    run = subprocess.run([sys.executable, "-c", PREFETCH_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    on, called = eval(run.stdout.strip().splitlines()[-1])
    if setting == "yes":
        for message in (on, called):
            assert "PYENGINE_CPU_PREFETCH must be 0" in message and "got 'yes'" in message, message
        return
    assert called == "updated"
    if setting is None:
        with open("/proc/cpuinfo") as f:
            intel = any(line.split(":")[-1].strip() == "GenuineIntel" for line in f if line.startswith("vendor_id"))
        assert on is intel
    else:
        assert on is (setting == "1")


def opcheck_args(device):
    call = valid_call(device, n=37, workers=3)
    call["grads"][1] = call["grads"][1].bfloat16()
    return call


def test_opcheck_update(device):
    c = opcheck_args(device)
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1, adamw=True, maximize=False,
                  amsgrad=False, max_exp_avg_sq=None, grad_scale=None, found_inf=None, weights=None,
                  param_out=torch.empty(37, dtype=torch.bfloat16, device=device), grad_norm=None, max_grad_norm=0.0)
    torch.library.opcheck(torch.ops.pyengine.mean_grad_adamw_.default,
                          (c["param"], c["exp_avg"], c["exp_avg_sq"], c["grads"]), kwargs)


def test_opcheck_multi_and_norm(device):
    params, ms, vs = multi_buffers(torch.Generator().manual_seed(0), device, [(5,), (2, 3)])
    grads = [torch.randn(p.shape, device=device) for _ in range(2) for p in params]
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=2, adamw=False, maximize=True,
                  amsgrad=False, max_exp_avg_sqs=[], grad_scale=None, found_inf=None, weights=[0.5, 0.5],
                  param_outs=[], grad_norm=None, max_grad_norm=0.0)
    torch.library.opcheck(torch.ops.pyengine.mean_grad_adamw_multi_.default, (params, ms, vs, grads), kwargs)
    torch.library.opcheck(torch.ops.pyengine.mean_grad_norm.default, ([grads[0], grads[2]], None))
    torch.library.opcheck(torch.ops.pyengine.mean_grad_norm_multi.default, (grads, 2, None))


def test_torch_compile_calls_the_ops(rng, device):
    n = 1001
    eager, compiled = Ours(torch.randn(n, generator=rng), device), None
    compiled = Ours(eager.p.cpu(), device)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(p, m, v, g0, g1, t):
        norm = ops.mean_grad_norm([g0, g1]).norm
        ops.mean_grad_adamw_(p, m, v, [g0, g1], step=t, **HYPER)
        return norm

    for t in range(1, 4):
        grads = [g.to(device) for g in random_grads(rng, n, 2)]
        eager.step(grads, **HYPER)
        norm = step(compiled.p, compiled.m, compiled.v, grads[0], grads[1], t)
        assert norm.item() == pytest.approx(ops.mean_grad_norm(grads).norm.item(), rel=1e-6)
    assert torch.equal(eager.p, compiled.p) and torch.equal(eager.v, compiled.v)


def test_build_reports_cuda_and_isa():
    assert isinstance(pyengine.with_cuda, bool)
    assert pyengine.with_cuda == (torch.version.cuda is not None and pyengine.with_cuda)
    if torch.cuda.is_available():  # a GPU machine must not get a CPU-only build (nvcc missing, say)
        assert pyengine.with_cuda
    assert pyengine._C.cpu_isa() in {"avx512", "avx2", "default"}


def configure_cmake(build_dir, *flags, **env):
    """tests/cpp/run_ctest.sh with CONFIGURE_ONLY=1 (cmake's configure and generate steps, seconds): the output and
    the CMakeCache of ``build_dir``. The interpreter is named by a relative path, as `make ctest` names .venv's."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHON=os.path.relpath(sys.executable, root), BUILD_DIR=str(build_dir), CONFIGURE_ONLY="1",
               **env)
    done = subprocess.run([os.path.join(root, "tests", "cpp", "run_ctest.sh"), *flags], env=env, capture_output=True,
                          text=True, timeout=240, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Build files have been written" in done.stdout
    return done.stdout, (build_dir / "CMakeCache.txt").read_text()


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.version.cuda is None or not shutil.which("cmake")
                    or not os.path.isfile(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")),
                    reason="needs torch with CUDA, cmake and nvcc")
def test_cmake_configures_with_cuda(tmp_path):
    """The CMake build with PYENGINE_WITH_CUDA=ON (the GPU suite's ctest stage) configures and generates here too,
    and takes the CUDA headers of torch's wheels from beside torch. Generation failed on CMake 3.25 once (no CUDA20
    flag for nvcc), and the wheels' include folder was looked up under another Python's site-packages."""
    _, cache = configure_cmake(tmp_path / "build", "-DPYENGINE_WITH_CUDA=ON")
    assert "PYENGINE_WITH_CUDA:BOOL=ON" in cache
    wheel_headers = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia", "cu13", "include")
    toolkit_has_it = os.path.isfile(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include",
                                                 "cusparse.h"))
    if os.path.isfile(os.path.join(wheel_headers, "cusparse.h")) and not toolkit_has_it:
        flags = "".join(p.read_text() for p in (tmp_path / "build").rglob("flags.make"))
        assert os.path.realpath(wheel_headers) in flags, "the wheels' CUDA headers are not on the include path"


@pytest.mark.timeout(300)
@pytest.mark.skipif(not shutil.which("cmake") or not shutil.which("c++"), reason="needs cmake and c++")
def test_ctest_script_refuses_a_compiler_that_links_libstdcxx_statically(tmp_path):
    """run_ctest.sh applies setup.py's rule: a CXX that finds no libstdc++.so (it would link a second, static
    libstdc++ into libpyengine) is replaced by a compiler on PATH that links the shared one."""
    fake = tmp_path / "static-cxx"
    fake.write_text('#!/bin/sh\nif [ "$1" = "-print-file-name=libstdc++.so" ]; then echo libstdc++.so; exit 0; fi\n'
                    f'exec {shutil.which("c++")} "$@"\n')
    fake.chmod(0o755)
    out, cache = configure_cmake(tmp_path / "build", CXX=str(fake))
    assert f"{fake} would link libstdc++ statically" in out
    compiler = next(line for line in cache.splitlines() if line.startswith("CMAKE_CXX_COMPILER:"))
    assert str(fake) not in compiler and compiler.split("=", 1)[1].startswith("/")


# ---------------------------------------------------------------------------------------------------------------
# CUDA only


@CUDA
def test_cuda_matches_cpu_bit_for_bit():
    """--fmad=false and the same summation order: the CUDA kernel rounds exactly as the CPU loops."""
    inputs = update_inputs()
    for a, b in zip(one_update(torch.device("cpu"), inputs)[:5], one_update(torch.device("cuda"), inputs)[:5]):
        assert torch.equal(a, b.cpu())


@CUDA
def test_cuda_matches_cpu_with_clipping_and_grad_scale_given_the_same_norm(rng):
    """The multiplier (grad_scale, clip by a given norm) is the same float arithmetic on both devices, so with the
    same norm the updates are bit-equal. The norms themselves are summed in a different order on each device (each
    reproducible on its own): close, not equal."""
    n = 70001
    p0, grads = torch.randn(n, generator=rng), random_grads(rng, n, 3)
    cpu_norm = ops.mean_grad_norm(grads).norm
    cuda_norm = ops.mean_grad_norm([g.cuda() for g in grads]).norm
    torch.testing.assert_close(cuda_norm.cpu(), cpu_norm, rtol=1e-6, atol=0)
    results = []
    for device in ("cpu", "cuda"):
        p, m, v = p0.clone().to(device), torch.zeros(n, device=device), torch.zeros(n, device=device)
        for step in (1, 2):
            torch.ops.pyengine.mean_grad_adamw_.default(
                p, m, v, [g.to(device) for g in grads], **HYPER, step=step, adamw=True, maximize=False,
                amsgrad=False, max_exp_avg_sq=None, grad_scale=torch.tensor([2.0 ** 10 / 3], device=device),
                found_inf=None, weights=None, param_out=None, grad_norm=cpu_norm.to(device) * 2.0 ** 10 / 3,
                max_grad_norm=0.5 * cpu_norm.item())
        results.append((p.cpu(), m.cpu(), v.cpu()))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@CUDA
def test_cuda_unaligned_views_take_the_scalar_path(rng):
    n = 4101
    ref, ours = Reference(torch.randn(n, generator=rng), **HYPER), None
    big = torch.zeros(3 * (n + 1), device="cuda")
    p, m, v = big[1:n + 1], big[n + 2:2 * n + 2], big[2 * n + 3:3 * n + 3]  # offsets not multiples of 4
    p.copy_(ref.p.detach().float())
    for t in range(1, 4):
        grads = random_grads(rng, n, 2)
        ref.step(grads)
        ops.mean_grad_adamw_(p, m, v, [g.cuda() for g in grads], step=t, **HYPER)
    assert_fp32_close(p, ref.p, "param")


@CUDA
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory < 40 * 2**30,
                    reason="needs ~30 GB of device memory")
def test_cuda_64bit_indexing():
    n = 2**31 + 5
    p = torch.zeros(n, device="cuda")
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    g = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    g[-5:] = torch.tensor([1.0, -2.0, 3.0, 0.5, -1.0], dtype=torch.bfloat16)
    ops.mean_grad_adamw_(p, m, v, [g], lr=0.1, step=1)
    # First Adam step moves each weight by -lr * sign(g) (|m/sqrt(v)| = 1 after bias correction).
    expected = torch.tensor([-0.1, 0.1, -0.1, -0.1, 0.1], device="cuda")
    torch.testing.assert_close(p[-5:], expected, rtol=1e-5, atol=1e-6)
    assert p[: n - 5].abs().max().item() == 0.0


def test_multi_form_takes_any_shape_even_for_one_tensor(rng):
    """The 1-D rule is the flat form's: the multi form takes a single 2-D param as it takes several."""
    p0 = torch.randn(3, 4, generator=rng)
    one = [p0.clone()], [torch.zeros(3, 4)], [torch.zeros(3, 4)]
    two = [p0.clone(), torch.zeros(5)], [torch.zeros(3, 4), torch.zeros(5)], [torch.zeros(3, 4), torch.zeros(5)]
    g = torch.randn(3, 4, generator=rng)
    ops.mean_grad_adamw_multi_(*one, [[g]], lr=1e-2, step=1)
    ops.mean_grad_adamw_multi_(*two, [[g, torch.zeros(5)]], lr=1e-2, step=1)
    assert torch.equal(one[0][0], two[0][0]) and not torch.equal(one[0][0], p0)


def test_scalars_inside_an_output_are_refused(device):
    """grad_scale / found_inf / grad_norm read by the kernel while it writes param: refused, nothing written. Each
    scalar holds a value with which the step would otherwise be applied (found_inf 0, a positive scale and norm)."""
    for key, value in (("grad_scale", 2.0), ("found_inf", 0.0), ("grad_norm", 0.5)):
        call = valid_call(device)
        param = call["param"]
        param[0] = value
        before = param.clone()
        scalars = dict(grad_scale=None, found_inf=None, grad_norm=None, max_grad_norm=0.0)
        scalars[key] = param[:1]
        if key == "grad_norm":
            scalars["max_grad_norm"] = 1.0
        with pytest.raises(ValueError, match=rf"{key}.*overlap|overlap.*{key}"):
            torch.ops.pyengine.mean_grad_adamw_.default(
                param, call["exp_avg"], call["exp_avg_sq"], call["grads"], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.0, step=1, adamw=True, maximize=False, amsgrad=False, max_exp_avg_sq=None,
                weights=None, param_out=None, **scalars)
        assert torch.equal(param, before)


def test_transfer_timeout_and_bucket_count_edges():
    with pytest.raises(ValueError, match="num_buckets must be >= 0; got -1"):
        pyengine._C.BucketTransfer(-1, "cpu", "x")
    transfer = pyengine._C.BucketTransfer(1, "cpu", "x")
    # a timeout too long for the clock waits like no timeout (it returned False at once): launched from another
    # thread after 0.3 s, the wait returns True
    timer = threading.Timer(0.3, lambda: transfer.launch(0, 0, [torch.ones(3)], [torch.zeros(3)]))
    start = time.monotonic()
    timer.start()
    assert transfer.wait(0, 0, True, 1e300)
    assert time.monotonic() - start > 0.2  # it waited for the launch
    timer.join()
    transfer.close()


def test_updates_bump_version_counters_and_refuse_tracked_tensors(device):
    """Note [Version counters of the in-place ops]: a weight saved for a backward and then updated by the op makes
    that backward raise, as torch's in-place ops do (it silently used the updated weights); an update of a tensor
    that requires grad in grad mode is refused, nothing written; the multi form alike; a refused call bumps
    nothing."""
    w = torch.nn.Parameter(torch.randn(6, device=device))
    x = torch.randn(6, device=device, requires_grad=True)
    loss = (x * w).sum()  # saves w for x's gradient
    m, v, out = (torch.zeros(6, device=device) for _ in range(3))
    with torch.no_grad():
        ops.mean_grad_adamw_(w, m, v, [torch.ones(6, device=device)], lr=0.1, step=1, param_out=out)
    assert (w._version, m._version, v._version, out._version) == (1, 1, 1, 1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    before = w.detach().clone()
    with pytest.raises(RuntimeError, match="param requires grad and grad mode is on"):
        ops.mean_grad_adamw_(w, m, v, [torch.ones(6, device=device)], lr=0.1, step=2)
    assert torch.equal(w.detach(), before) and (w._version, m._version) == (1, 1)
    params = [torch.zeros(3, device=device), torch.zeros(4, device=device)]
    ms, vs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    ops.mean_grad_adamw_multi_(params, ms, vs, [[torch.ones_like(p) for p in params]], lr=0.1, step=1)
    assert [t._version for t in params + ms + vs] == [1] * 6
    tracked = [torch.nn.Parameter(p.clone()) for p in params]
    with pytest.raises(RuntimeError, match="params requires grad"):
        ops.mean_grad_adamw_multi_(tracked, ms, vs, [[torch.ones_like(p) for p in params]], lr=0.1, step=2)
    assert [t._version for t in tracked + ms] == [0, 0, 1, 1]


def test_numbers_that_are_not_one_number_are_named():
    """An array of several numbers, an int past float's range, a 0-d tensor of weights: errors naming the argument
    (they were bare numpy / Python / torch errors)."""
    import numpy as np
    call = valid_call("cpu")
    args = [call.pop(k) for k in ("param", "exp_avg", "exp_avg_sq", "grads")]
    before = args[0].clone()
    for key, value, message in (("lr", np.array([1e-3, 1e-3]), "lr must be a number"),
                                ("lr", 10 ** 400, r"lr must be a number; got 1000.*\.\.\. \(int too large"),
                                ("weights", torch.tensor(1.0), r"weights must be a list of G numbers; got Tensor of "
                                 r"shape \(\)")):
        with pytest.raises(TypeError, match=message):
            ops.mean_grad_adamw_(*args, **{**call, key: value})
    assert torch.equal(args[0], before)


def test_bools_and_complex_numbers_of_any_kind_are_not_numbers():
    """np.True_ or torch.tensor(True) as lr trained at lr 1.0, as step counted step 1; a complex lr dropped its
    imaginary part (a warning at most); a schedule's np.True_ was a factor of 1; a max_exp_avg_sq given without
    amsgrad was left as it was, any size."""
    import numpy as np
    call = valid_call("cpu")
    args = [call.pop(k) for k in ("param", "exp_avg", "exp_avg_sq", "grads")]
    before = args[0].clone()
    for key, value in (("lr", np.True_), ("lr", torch.tensor(True)), ("lr", np.complex128(1e-3 + 1j)),
                       ("lr", 1e-3 + 0j), ("eps", torch.tensor(1e-8 + 0j)), ("weight_decay", np.True_),
                       ("step", np.True_), ("step", torch.tensor(True))):
        message = "step must be an int" if key == "step" else f"{key} must be a number; got"
        with pytest.raises(TypeError, match=message):
            ops.mean_grad_adamw_(*args, **{**call, key: value})
    assert torch.equal(args[0], before)
    ops.mean_grad_adamw_(*args, **{**call, "lr": np.float32(1e-3), "step": np.int64(2)})  # numpy's real ones are
    assert not torch.equal(args[0], before)
    with pytest.raises(ValueError, match="max_exp_avg_sq given with amsgrad=False: only amsgrad reads and writes it"):
        ops.mean_grad_adamw_(*args, **{**call, "max_exp_avg_sq": torch.zeros(1)})  # the wrong size too: never read
    with pytest.raises(ValueError, match="max_exp_avg_sq given with amsgrad=False"):
        ops.mean_grad_adamw_multi_([args[0]], [args[1]], [args[2]], [[g] for g in args[3]], lr=1e-3, step=3,
                                   max_exp_avg_sqs=[torch.zeros(1)])
    updated = [t.clone() for t in args[:3]]
    raw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=3, adamw=True, maximize=False,
               amsgrad=False, grad_scale=None, found_inf=None, weights=None, grad_norm=None, max_grad_norm=0.0)
    with pytest.raises(ValueError, match="max_exp_avg_sq given with amsgrad=False"):  # the op itself refuses it
        torch.ops.pyengine.mean_grad_adamw_.default(*args, **raw, max_exp_avg_sq=torch.zeros_like(args[0]),
                                                    param_out=None)
    with pytest.raises(ValueError, match="max_exp_avg_sq given with amsgrad=False"):
        torch.ops.pyengine.mean_grad_adamw_multi_.default(
            [args[0]], [args[1]], [args[2]], list(args[3]), **raw, max_exp_avg_sqs=[torch.zeros_like(args[0])],
            param_outs=[])
    assert all(torch.equal(t, u) for t, u in zip(args[:3], updated))  # refused before anything was written
    for key, value, message in (("grad_scale", 2.0, "grad_scale must be a tensor or None; got float 2.0"),
                                ("found_inf", True, "found_inf must be a tensor or None; got bool True"),
                                ("param_out", [args[0]], "param_out must be a tensor or None; got list"),
                                ("param", None, "param must be a tensor; got NoneType")):
        with pytest.raises(TypeError, match=re.escape(message)):
            ops.mean_grad_adamw_(*([value] + args[1:] if key == "param" else args),
                                 **{**call, **({} if key == "param" else {key: value})})
    with pytest.raises(TypeError, match=re.escape("param_outs[0] must be a tensor; got NoneType")):
        ops.mean_grad_adamw_multi_([args[0]], [args[1]], [args[2]], [[g] for g in args[3]], lr=1e-3, step=3,
                                   param_outs=[None])
    for factor in (np.True_, torch.tensor(False), 1 + 0j):
        with pytest.raises(ValueError, match=r"lr_schedule\(3\) returned"):
            pyengine.optim.check_lr_factor(factor, 3)
