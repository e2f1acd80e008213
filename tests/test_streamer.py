"""GradientStreamer and pipelined_update on CPU workers (copy thread), with CUDA twins that skip without a GPU.

Every comparison is bit for bit: slots against param.grad, the pipelined update against one update over the whole
store after all gradients arrived, replicas against the store after the copy back."""
import contextlib
import copy
import gc
import json
import re
import threading
import time
import warnings
import weakref

import numpy as np
import pytest
import torch

import pyengine

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA device"))]
TINY = 1e-5  # MiB: every parameter closes its bucket


class Net(torch.nn.Module):
    """Odd sizes, a tied (shared) weight, a frozen layer, and a branch used only when asked."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.emb = torch.nn.Embedding(17, 7)
        self.frozen = torch.nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.body = torch.nn.Linear(7, 4097)
        self.scale = torch.nn.Parameter(torch.randn(1))
        self.out = torch.nn.Linear(4097, 7)
        self.head = torch.nn.Linear(7, 17, bias=False)
        self.head.weight = self.emb.weight
        self.extra = torch.nn.Linear(7, 7)
        self.to(dtype)

    def forward(self, idx, use_extra=True):
        h = self.frozen(self.emb(idx))
        h = self.out(torch.tanh(self.body(h)) * self.scale)
        if use_extra:
            h = h + self.extra(h)
        return self.head(h).float().pow(2).mean()


@pytest.fixture(autouse=True, params=[None, 0], ids=["bucketed", "eager"])
def eager_mb(request, monkeypatch):
    """Every test of this file runs twice: whole-bucket copies only, and every gradient copied early (Note [Early
    copies of large gradients]), whatever eager_mb a test does not set itself (test_engine.py covers the engine's
    option)."""
    init = pyengine.GradientStreamer.__init__

    def with_eager_mb(self, *args, **kwargs):
        kwargs.setdefault("eager_mb", request.param)
        init(self, *args, **kwargs)

    monkeypatch.setattr(pyengine.GradientStreamer, "__init__", with_eager_mb)
    return request.param


def batch(device="cpu", n=9):
    return torch.randint(0, 17, (n,), device=device)


def slot_views(store, worker):
    return store.views(store.grad_slot(worker))


def assert_slots_equal_grads(store, model, worker, dtype=None):
    named = dict(model.named_parameters())
    for name, view in slot_views(store, worker).items():
        grad = named[name].grad
        expect = torch.zeros_like(view) if grad is None else grad.detach().cpu().to(view.dtype)
        assert torch.equal(view, expect), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bucket_mb,first_bucket_mb", [(TINY, TINY), (0.01, 0.001), (25, 1)])
def test_slot_equals_param_grad(device, grad_dtype, bucket_mb, first_bucket_mb):
    model = Net().to(device)
    store = pyengine.HostStore(model, workers=2, grad_dtype=grad_dtype, pin=False)
    with pyengine.GradientStreamer(model, store, worker=1, bucket_mb=bucket_mb,
                                   first_bucket_mb=first_bucket_mb) as streamer:
        for _ in range(2):  # twice: the second step's copies replace the first's
            model.zero_grad()
            model(batch(device)).backward()
            streamer.wait_all()
            assert_slots_equal_grads(store, model, 1)
            streamer.copy_back()
            assert torch.count_nonzero(store.grad_slot(0)) == 0


@pytest.mark.parametrize("replica_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_replicas(replica_dtype, grad_dtype):
    """A bf16/fp16 replica's gradients are converted to the slot's dtype as torch's cast does, bit for bit."""
    model = Net(dtype=replica_dtype)
    store = pyengine.HostStore(model, grad_dtype=grad_dtype, pin=False)
    with pyengine.GradientStreamer(model, store, bucket_mb=0.01, first_bucket_mb=0.001) as streamer:
        model(batch()).backward()
        streamer.wait_all()
        assert_slots_equal_grads(store, model, 0)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("eager_mb", [0.01, None])
@pytest.mark.parametrize("pin", [True, False])
def test_cuda_conversions_run_beside_the_copies_and_keep_the_bits(eager_mb, pin, tmp_path):
    """Float32 and bfloat16 gradients into bfloat16 slots, in one bucket: the float32 ones are converted on a stream
    of their own, never on the stream of the copies (Note [Gradients converted on a stream of their own]), and every
    slot equals its gradient as torch converts it, step after step (early copies of the large gradient or not)."""
    from torch.profiler import ProfilerActivity, profile

    wide = torch.nn.Linear(64, 4097).cuda()  # float32 gradients: converted
    narrow = torch.nn.Linear(64, 33).cuda().bfloat16()  # bfloat16 gradients: copied as they are
    model = torch.nn.ModuleDict({"wide": wide, "narrow": narrow})
    store = pyengine.HostStore(model, grad_dtype=torch.bfloat16, pin=pin)

    def backward():
        x = torch.randn(8, 64, device="cuda")
        model.zero_grad()
        (wide(x).square().mean() + narrow(x.bfloat16()).float().square().mean()).backward()

    with pyengine.GradientStreamer(model, store, bucket_mb=25, first_bucket_mb=25, eager_mb=eager_mb) as streamer:
        assert len(streamer.buckets) == 1
        for _ in range(3):
            backward()
            streamer.wait_all()
            assert_slots_equal_grads(store, model, 0)
            streamer.copy_back()
        streamer.wait_weights()
        torch.cuda.synchronize()  # the copy back's work ends before the profile: only this step's copies in it
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            backward()
            streamer.wait_all()
            torch.cuda.synchronize()
        assert_slots_equal_grads(store, model, 0)
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    copy_streams = {e["args"]["stream"] for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"]}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert copy_streams and kernels
    assert [e["name"] for e in kernels if e["args"]["stream"] in copy_streams] == []


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("replica_dtype", [torch.bfloat16, torch.float16])
def test_cuda_low_precision_replicas_get_the_master_weights_rounded(replica_dtype):
    """The float32 master weights copied back into a bfloat16/float16 replica on the GPU hold them rounded as torch
    rounds them on the host, bit for bit."""
    model = Net(dtype=replica_dtype).cuda()
    store = pyengine.HostStore(model, pin=True)
    store.param.copy_(torch.randn(store.numel))  # new weights: the replica must change
    with pyengine.GradientStreamer(model, store, bucket_mb=0.01, first_bucket_mb=0.001) as streamer:
        streamer.copy_back()
        streamer.wait_weights()
        for name, param in model.named_parameters():
            if param.requires_grad:
                assert torch.equal(param.detach().cpu(), store.views(store.param)[name].to(replica_dtype)), name


def test_zero_size_parameter():
    """A parameter of no elements (a layer sized by a config to 0) takes no room and gets no copy, and breaks
    nothing around it."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 0), torch.nn.Flatten(), torch.nn.Linear(0, 3))
    model.append(torch.nn.Linear(3, 2))
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store, bucket_mb=TINY, first_bucket_mb=TINY) as streamer:
        for _ in range(2):
            model.zero_grad()
            with streamer.backward_pass():
                model(torch.randn(4, 5)).pow(2).mean().backward()
            streamer.wait_all()
            assert_slots_equal_grads(store, model, 0)
            streamer.copy_back()


@pytest.mark.timeout(60)
def test_first_buckets_are_copied_while_backward_still_runs():
    model = torch.nn.Sequential(torch.nn.Linear(7, 4097), torch.nn.Tanh(), torch.nn.Linear(4097, 7))
    store = pyengine.HostStore(model, pin=False)
    seen = {}
    with pyengine.GradientStreamer(model, store, bucket_mb=TINY, first_bucket_mb=TINY) as streamer:
        def during_backward(grad):
            # Layer 2's gradients are accumulated; layer 0's are not computed yet: backward is mid-way.
            seen["layer0_grad"] = model[0].weight.grad
            for k, bucket in enumerate(streamer.buckets[:2]):
                streamer.wait(k)
                seen[bucket.names] = torch.equal(slot_views(store, 0)[bucket.names[0]],
                                                 dict(model.named_parameters())[bucket.names[0]].grad)

        h = model[0](torch.randn(3, 7))
        h.register_hook(during_backward)
        model[2](model[1](h)).sum().backward()
        streamer.wait_all()
    assert seen.pop("layer0_grad") is None
    assert seen == {("2.bias",): True, ("2.weight",): True}
    assert_slots_equal_grads(store, model, 0)


@pytest.mark.timeout(120)
def test_the_copy_thread_copies_while_backward_runs_on():
    """On CPU workers a bucket's copy runs on the copy thread: the hook that launches it returns at once and backward
    goes on while the copy is in progress (a launch that copied, or waited for its copy, before returning would
    leave backward waiting: no overlap). A 64 MiB gradient has a bucket of its own; the slot starts as NaN, and right
    after its launch (a hook of the same parameter, registered after the streamer's, runs next on the backward
    thread) the bucket's slot range is not yet all written. A copy can finish before the look when the backward
    thread is descheduled for the whole copy (2 cores, and the copy's own threads): up to 8 tries, one is enough.
    The look is a hook on that parameter: a look further on in backward (the gradient of layer 0's output) found
    the copy done in every try of one run in two on a 2-core machine."""
    model = torch.nn.Sequential(torch.nn.Linear(7, 2048), torch.nn.Tanh(), torch.nn.Linear(2048, 8192))
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store, bucket_mb=TINY, first_bucket_mb=TINY) as streamer:
        big = next(b for b in streamer.buckets if b.names == ("2.weight",))
        lo, hi = big.begin, big.end
        slot = store.grad_slot(0)
        tries, seen = [], {}

        def look(param):  # runs right after the streamer's hook, which launched the bucket's copy
            seen["launched"] = streamer.hook_calls
            seen["unwritten"] = bool(torch.isnan(slot[hi - 4096:hi]).any() or torch.isnan(slot[lo:lo + 4096]).any())

        handle = model[2].weight.register_post_accumulate_grad_hook(look)
        for _ in range(8):
            slot.fill_(float("nan"))
            model.zero_grad(set_to_none=True)
            seen.clear()
            calls = streamer.hook_calls
            model[2](model[1](model[0](torch.randn(3, 7)))).sum().backward()
            streamer.wait_all()
            assert seen["launched"] > calls, "the look ran before the streamer's hook"
            assert torch.equal(slot[lo:hi].view(8192, 2048), model[2].weight.grad)  # then the copy completes
            streamer.reset()
            tries.append(seen["unwritten"])
            if seen["unwritten"]:
                break
        handle.remove()
    assert any(tries), f"every look found the bucket copied already: {tries}"


def test_pipelined_update_names_each_bucket_in_an_nvtx_range(monkeypatch):
    """The update's NVTX ranges (what an Nsight Systems timeline shows): one ``pyengine/update b{k}`` per bucket, in
    order, each closed. The copies' and waits' ranges are C++ (nvtx3) and compiled only with CUDA: the GPU suite's
    nvtx stage looks for them."""
    from pyengine import _C

    events = []
    monkeypatch.setattr(_C, "_nvtx_push", lambda name: events.append(("push", name)))
    monkeypatch.setattr(_C, "_nvtx_pop", lambda: events.append(("pop",)))
    model = Net()
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store, bucket_mb=TINY, first_bucket_mb=TINY) as streamer:
        model(batch()).backward()
        pyengine.pipelined_update([streamer], store, 1, lr=1e-3)
        streamer.wait_weights()
        count = len(streamer.buckets)
    assert count >= 3
    assert events == [e for k in range(count) for e in (("push", f"pyengine/update b{k}"), ("pop",))], events


@pytest.mark.timeout(120)
def test_pipelined_update_updates_a_bucket_while_later_ones_are_in_flight():
    """pipelined_update updates bucket k once every worker delivered it, not after the whole backward: backward is
    held (a node between the layers waits on an event) after the last layer's buckets were launched; the update,
    started on another thread, must change those buckets' weights while the first layer's gradients do not exist
    yet. Then backward is released and the step completes."""
    model = torch.nn.Sequential(torch.nn.Linear(7, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    store = pyengine.HostStore(model, pin=False)
    release, errors = threading.Event(), []
    with pyengine.GradientStreamer(model, store, bucket_mb=TINY, first_bucket_mb=TINY) as streamer:
        last, first = store.views(store.param)["2.weight"], store.views(store.param)["0.weight"]
        before, first_before = last.clone(), first.clone()

        def hold(grad):  # between layer 2's gradients (launched) and layer 0's (not computed yet)
            if not release.wait(30):
                errors.append("backward was not released")
            return grad

        def backward():
            try:
                h = model[0](torch.randn(3, 7))
                h.register_hook(hold)
                model[2](model[1](h)).sum().backward()
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        def update():
            try:
                pyengine.pipelined_update([streamer], store, 1, lr=0.1)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=backward), threading.Thread(target=update)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and torch.equal(last, before):
            time.sleep(0.005)
        changed_while_held = not torch.equal(last, before)
        layer0_missing = model[0].weight.grad is None
        release.set()
        for t in threads:
            t.join(60)
        streamer.wait_weights()
    assert not errors, errors
    assert changed_while_held and layer0_missing
    assert not torch.equal(first, first_before)  # the step completed: the first layer updated too


@pytest.mark.timeout(60)
@pytest.mark.parametrize("eager", [0.1, None])
def test_a_large_gradient_is_copied_before_its_bucket_is_complete(eager):
    """One bucket holds both layers. Layer 1's weight (256 KiB of gradient) is ready first; with eager_mb below its
    size its copy starts from its own hook, so it is in the slot before layer 0's gradients exist; without, it waits
    for the bucket's last gradient. The test's hooks on layer 0 run before the streamer's (registered first), so
    the bucket's own launch cannot have happened when they look."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
    store = pyengine.HostStore(model, pin=False)
    slot = slot_views(store, 0)["2.weight"]
    seen = []

    def look(param):
        deadline = time.monotonic() + (10 if eager else 0.3)
        while time.monotonic() < deadline and not torch.equal(slot, model[2].weight.grad):
            time.sleep(0.001)
        seen.append(torch.equal(slot, model[2].weight.grad))

    for p in model[0].parameters():
        p.register_post_accumulate_grad_hook(look)
    with pyengine.GradientStreamer(model, store, eager_mb=eager) as streamer:
        assert len(streamer.buckets) == 1 and streamer._eager == [False, eager is not None, False, False]  # 2.b, 2.w, 0.b, 0.w
        model(torch.randn(3, 5)).pow(2).sum().backward()
        streamer.wait_all()
        assert seen == [eager is not None] * 2
        assert_slots_equal_grads(store, model, 0)
        assert streamer.wait(0, timeout=0) is True  # one delivery of the bucket, not one per part
        streamer.reset()
        assert streamer.wait(0, timeout=0.05) is False


@pytest.mark.timeout(60)
def test_reset_waits_for_early_copies_of_a_failed_step():
    """A backward that fails after a large gradient's early copy started: reset() returns only once that copy is
    done (the host may use the slot after it), though its bucket never got its completing launch."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 4096), torch.nn.Linear(4096, 4096))  # 64 MiB weight, copied early
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store, bucket_mb=100, first_bucket_mb=100, eager_mb=1) as streamer:
        assert len(streamer.buckets) == 1 and streamer._eager == [False, True, False, False]
        def boom(grad):
            raise RuntimeError("boom in backward")
        model[0].weight.register_hook(boom)
        slot = slot_views(store, 0)["1.weight"]
        for _ in range(3):
            slot.fill_(float("nan"))
            model.zero_grad()
            with pytest.raises(RuntimeError, match="boom in backward"):
                with streamer.backward_pass():
                    model(torch.randn(2, 5)).sum().backward()
            assert torch.equal(slot, model[1].weight.grad)  # the part finished before reset() returned
            assert streamer.wait(0, timeout=0.05) is False


@pytest.mark.timeout(60)
def test_a_waiter_never_takes_a_failed_steps_early_parts_for_its_bucket():
    """A thread waiting for the bucket (as the engine's main thread and the reducer of a process group do) while the
    worker's backward fails after an early part of that bucket: reset() drains the part without delivering the
    bucket, so the waiter runs out of time instead of returning on the failed step's half-filled slot."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 1024), torch.nn.Linear(1024, 1024))  # 4 MiB weight: eager
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store, bucket_mb=100, first_bucket_mb=100, eager_mb=1) as streamer:
        got = {}
        waiter = threading.Thread(target=lambda: got.setdefault("wait", streamer.wait(0, timeout=1.0)))
        waiter.start()

        def boom(grad):
            raise ValueError("worker failed")
        model[0].weight.register_hook(boom)  # after 1.weight's part, before the bucket's last gradient
        with pytest.raises(ValueError, match="worker failed"):
            with streamer.backward_pass():
                model(torch.randn(2, 5)).sum().backward()
        waiter.join()
        assert got["wait"] is False


def test_a_failure_after_close_keeps_its_own_error():
    """The streamer closed while its step runs (an engine closing from another thread), then the backward fails
    after an early part: the user's error comes out of backward_pass, not one from reset() on a closed transfer."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 1024), torch.nn.Linear(1024, 1024))
    store = pyengine.HostStore(model, pin=False)
    streamer = pyengine.GradientStreamer(model, store, bucket_mb=100, first_bucket_mb=100, eager_mb=1)

    def close_then_fail(grad):
        streamer.close()
        raise ValueError("the real error")
    model[0].weight.register_hook(close_then_fail)
    with pytest.raises(ValueError, match="the real error"):
        with streamer.backward_pass():
            model(torch.randn(2, 5)).sum().backward()
    streamer.reset()  # again, as the engines' error paths do


@pytest.mark.timeout(60)
def test_wait_with_timeout_and_reset_after_a_failed_step():
    model = Net()
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store, bucket_mb=TINY, first_bucket_mb=TINY) as streamer:
        last = len(streamer.buckets) - 1
        start = time.perf_counter()
        assert streamer.wait(0, timeout=0.05) is False  # no backward has run: the bucket never comes
        assert 0.04 < time.perf_counter() - start < 5
        start = time.perf_counter()  # longer than one bounded wait: several, and still the whole timeout
        assert streamer.wait(0, timeout=0.35) is False
        assert 0.34 < time.perf_counter() - start < 5
        with pytest.raises(ValueError, match="timeout must be >= 0"):
            streamer.wait(0, timeout=-1)
        model(batch("cpu")).backward()
        assert streamer.wait(last, timeout=5) is True
        # The step fails before its update: reset() drops the delivered buckets, so the next wait waits for the
        # next backward instead of returning at once on the failed step's gradients.
        streamer.reset()
        assert streamer.wait(last, timeout=0.05) is False
        model.zero_grad()
        model(batch("cpu")).backward()
        assert streamer.wait(last, timeout=5) is True
        assert_slots_equal_grads(store, model, 0)


@pytest.mark.timeout(60)
def test_a_backward_that_raises_leaves_no_half_step():
    """A backward that fails half way (here a tensor hook raises after the first buckets were launched): the next
    step starts afresh, its waits return its own gradients, not the failed step's."""
    model = Net()
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store, bucket_mb=TINY, first_bucket_mb=TINY) as streamer:
        def boom(grad):
            raise RuntimeError("boom in backward")
        handle = model.body.weight.register_hook(boom)  # fires after out's, head's and extra's buckets
        with pytest.raises(RuntimeError, match="boom in backward"):
            with streamer.backward_pass():
                model(batch()).backward()
        handle.remove()
        assert streamer.wait(0, timeout=0.05) is False, "a failed step's bucket must not count for the next one"
        model.zero_grad()
        store.grad_slot(0).fill_(float("nan"))  # whatever the failed step left
        with streamer.backward_pass():
            model(batch()).backward()
        streamer.wait_all()
        assert_slots_equal_grads(store, model, 0)


class UsedAcrossCheckpoint(torch.nn.Module):
    """``p`` is used inside a reentrant checkpoint and again outside it: its hook fires in two graph tasks."""

    def __init__(self):
        super().__init__()
        self.q, self.p = torch.nn.Linear(5, 5), torch.nn.Linear(5, 5)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        h = checkpoint(self.p, torch.tanh(self.q(x)), use_reentrant=True)
        return self.p(h).pow(2).mean()


@pytest.mark.timeout(60)
def test_a_gradient_arriving_twice_in_one_pass_is_an_error():
    """Note [Hook fires once]: the first fire would copy half the gradient; an error, never a wrong slot."""
    model = UsedAcrossCheckpoint()
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store) as streamer:
        with pytest.raises(RuntimeError, match=r"'p\.(weight|bias)' received its gradient twice.*use_reentrant=False"):
            with streamer.backward_pass():
                model(torch.randn(3, 5)).backward()


def test_a_parameter_replaced_after_construction_is_an_error():
    """Its gradient has no hook (the slot would get zeros with unused='zero') and its weights no copy back."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store) as streamer:
        model[1].weight = torch.nn.Parameter(torch.randn(2, 4))
        with pytest.raises(RuntimeError, match=r"\['1\.weight'\] were replaced or removed after the streamer was built"):
            with streamer.backward_pass():
                model(torch.randn(3, 4)).pow(2).mean().backward()


def test_replicas_the_store_cannot_take_are_refused_at_construction():
    double = torch.nn.Linear(3, 3).double()
    with pytest.raises(ValueError, match=r"'(weight|bias)' must be float32, bfloat16 or float16.*got torch\.float64"):
        pyengine.GradientStreamer(double, pyengine.HostStore(double, pin=False))
    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"\['0.weight'\] make sparse gradients.*sparse=False"):
        pyengine.GradientStreamer(sparse, pyengine.HostStore(sparse, pin=False))
    alone = torch.nn.Embedding(10, 4, sparse=True)  # the root module: its parameter by its own name, not ''
    with pytest.raises(ValueError, match=r"\['weight'\] make sparse gradients"):
        pyengine.GradientStreamer(alone, pyengine.HostStore(alone, pin=False))
    # a TorchScript module takes no forward pre-hook, and its copies have no leaf parameters
    scripted = torch.jit.script(torch.nn.Linear(5, 3))
    for replica in (scripted, copy.deepcopy(scripted)):
        with pytest.raises(TypeError, match=r"GradientStreamer: the model \(.*\) is a TorchScript module: .*give the plain "
                                            r"nn.Module"):
            pyengine.GradientStreamer(replica, pyengine.HostStore(scripted, pin=False))
    # a frozen sparse embedding makes no gradient: accepted (it was refused), and the rest streams
    sparse[0].requires_grad_(False)
    store = pyengine.HostStore(sparse, pin=False)
    with pyengine.GradientStreamer(sparse, store) as streamer:
        with streamer.backward_pass():
            sparse(torch.tensor([1, 2, 7])).pow(2).mean().backward()
        streamer.wait_all()
        for name, view in store.views(store.grad_slot(0)).items():
            assert torch.equal(view, dict(sparse.named_parameters())[name].grad), name


def test_replica_parameters_the_store_does_not_hold_are_refused():
    """A weight tied in the store's model and untied in the replica, or a layer frozen there and trainable here, got
    .grad every step and was never trained (no hook, slot or copy back), silently."""
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    base = Tied()
    replica = copy.deepcopy(base)
    replica.head.weight = torch.nn.Parameter(replica.emb.weight.detach().clone())
    with pytest.raises(ValueError, match=r"trainable parameters \['head\.weight'\] are not in the store"):
        pyengine.GradientStreamer(replica, pyengine.HostStore(base, pin=False))
    frozen = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    replica = copy.deepcopy(frozen)
    frozen[0].requires_grad_(False)
    with pytest.raises(ValueError, match=r"\['0\.weight', '0\.bias'\] are not in the store"):
        pyengine.GradientStreamer(replica, pyengine.HostStore(frozen, pin=False))


def test_close_from_two_threads_at_once_returns_in_both():
    """close() is idempotent: two threads closing at once while copies are queued both joined the copy thread (one of
    them blocked for good)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    store = pyengine.HostStore(model, pin=False)
    for _ in range(60):
        streamer = pyengine.GradientStreamer(model, store, bucket_mb=TINY, first_bucket_mb=TINY)
        model.zero_grad()
        model(torch.randn(4, 64)).sum().backward()  # bucket copies queued on the copy thread
        barrier = threading.Barrier(2)

        def close():
            barrier.wait()
            streamer.close()

        threads = [threading.Thread(target=close, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert not any(t.is_alive() for t in threads), "a close() never returned"


def test_shared_and_frozen_parameters():
    model = Net()
    store = pyengine.HostStore(model, pin=False)
    assert "head.weight" not in store.names and "emb.weight" in store.names  # tied: once, under its first name
    assert not any(name.startswith("frozen.") for name in store.names)
    with pyengine.GradientStreamer(model, store) as streamer:
        model(batch()).backward()
        streamer.wait_all()
        assert streamer.hook_calls == len(store.names)  # the tied weight's hook fires once, after both uses
        assert_slots_equal_grads(store, model, 0)
        assert model.frozen.weight.grad is None


def test_buckets_cover_every_parameter_once_and_are_contiguous():
    model = Net()
    store = pyengine.HostStore(model, pin=False)
    for bucket_mb, first in [(TINY, TINY), (0.01, 0.001), (0.05, 0.05), (25, 1)]:
        streamer = pyengine.GradientStreamer(model, store, bucket_mb=bucket_mb, first_bucket_mb=first)
        names = [name for b in streamer.buckets for name in b.names]
        assert sorted(names) == sorted(store.names) and len(names) == len(set(names))
        assert names == store.names  # backward (reverse registration) order
        assert streamer.buckets[0].begin == 0 and streamer.buckets[-1].end == store.numel
        for k, b in enumerate(streamer.buckets):
            assert b.index == k
            first_entry, last_entry = store.entry(b.names[0]), store.entry(b.names[-1])
            assert b.begin == first_entry.offset and b.end >= last_entry.offset + last_entry.numel
            if k + 1 < len(streamer.buckets):
                assert b.end == streamer.buckets[k + 1].begin
            cap = (first if k == 0 else bucket_mb) * 2**20
            without_last = sum(store.entry(n).numel * 4 for n in b.names[:-1])
            assert without_last < cap  # a bucket closes as soon as it reaches its cap
        streamer.close()
    assert len(pyengine.GradientStreamer(model, store, bucket_mb=TINY, first_bucket_mb=TINY).buckets) == \
        len(store.names)


def hook_count(model):
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_hooks_fire_once_per_parameter_and_close_removes_them(device):
    model = Net().to(device)
    store = pyengine.HostStore(model, pin=False)
    assert hook_count(model) == 0
    streamer = pyengine.GradientStreamer(model, store, bucket_mb=0.01, first_bucket_mb=0.001)
    assert hook_count(model) == len(store.names) and len(model._forward_pre_hooks) == 1
    for step in range(1, 4):
        model.zero_grad()
        model(batch(device)).backward()
        streamer.wait_all()
        streamer.copy_back()
        assert streamer.hook_calls == step * len(store.names)
    streamer.close()
    streamer.close()
    assert hook_count(model) == 0 and len(model._forward_pre_hooks) == 0
    model(batch(device)).backward()  # no hook left to fire
    assert streamer.hook_calls == 3 * len(store.names)


def test_dropping_the_streamer_removes_its_hooks():
    model = Net()
    store = pyengine.HostStore(model, pin=False)
    streamer = pyengine.GradientStreamer(model, store)
    model(batch()).backward()
    streamer.wait_all()
    del streamer
    gc.collect()
    assert hook_count(model) == 0 and len(model._forward_pre_hooks) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_unused_parameter_gives_zero(device):
    """CUDA: the unused parameter's slot range is zero-filled on the host (no device gradient to copy)."""
    model = Net().to(device)
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store, bucket_mb=0.01, first_bucket_mb=0.001) as streamer:
        store.grad_slot(0).fill_(7.0)  # stale contents must be overwritten
        model(batch(device), use_extra=False).backward()
        streamer.wait_all()
        assert model.extra.weight.grad is None
        assert_slots_equal_grads(store, model, 0)
        assert torch.count_nonzero(slot_views(store, 0)["extra.weight"]) == 0


class SignWeights(torch.nn.Module):
    """A layer used through torch.sgn of its weight: torch gives that weight a ZeroTensor gradient (no memory behind
    it, a null data pointer)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.sign, self.out = torch.nn.Linear(5, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.out(x @ torch.sgn(self.sign.weight).t() + self.sign.bias).pow(2).mean()


@pytest.mark.parametrize("device", DEVICES)
def test_a_zero_tensor_gradient_streams_zeros(device):
    """The copy thread read a ZeroTensor gradient's null pointer and the process died (SIGSEGV); it is a zero-fill.
    In an engine too: the step equals torch.optim.AdamW's (in float64) on the whole batch."""
    model = SignWeights().to(device)
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store, bucket_mb=TINY, first_bucket_mb=TINY) as streamer:
        store.grad_slot(0).fill_(7.0)  # stale contents must be overwritten
        loss = model(torch.randn(4, 5, device=device))
        with streamer.backward_pass(loss):
            loss.backward()
        streamer.wait_all()
        assert model.sign.weight.grad._is_zerotensor()  # the premise
        assert_slots_equal_grads(store, model, 0)
        assert torch.count_nonzero(slot_views(store, 0)["sign.weight"]) == 0
    x = torch.randn(8, 5)
    reference = copy.deepcopy(SignWeights()).double()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.1, foreach=False)
    reference(x.double()).backward()
    optimizer.step()
    with pyengine.Engine(SignWeights(), lambda m, batch: m(batch), devices=["cpu"] * 2, pin=False,
                         optimizer=pyengine.AdamW(lr=0.1, weight_decay=0.1)) as engine:
        engine.step(x)
        for name, value in engine.master_state_dict().items():
            torch.testing.assert_close(value.double(), dict(reference.named_parameters())[name].detach(), rtol=1e-6,
                                       atol=1e-6, msg=name)


def test_a_grad_no_hook_saw_is_named():
    """A .grad assigned by hand (gradient surgery in a loss_fn) to a parameter backward does not reach: its slot got
    zeros, silently. Now a warning names it (once per streamer); a parameter with no .grad at all is the usual unused
    one and says nothing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x = torch.randn(5, 4)
    with pyengine.GradientStreamer(model, pyengine.HostStore(model, pin=False)) as streamer:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # unused, no .grad: nothing said
            with streamer.backward_pass():
                model[2](torch.tanh(model[0](x)).detach()).pow(2).mean().backward()
            streamer.wait_all()
        model.zero_grad(set_to_none=True)
        model[0].weight.grad = torch.ones_like(model[0].weight)  # by hand; the loss does not reach layer 0
        with pytest.warns(RuntimeWarning, match=r"\['0.weight'\] hold a .grad that autograd did not accumulate in "
                                                 r"this window .* their slots hold zeros"):
            with streamer.backward_pass():
                model[2](torch.tanh(model[0](x)).detach()).pow(2).mean().backward()
        streamer.wait_all()


@pytest.mark.parametrize("device", DEVICES)
def test_unused_parameter_error_names_it_and_does_not_hang(device):
    model = Net().to(device)
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store, unused="error") as streamer:
        with pytest.raises(RuntimeError, match=r"no gradient.*extra\.weight.*unused='zero'"):
            model(batch(device), use_extra=False).backward()
        streamer.wait_all()  # every bucket was still delivered
        streamer.copy_back()
        model.zero_grad()
        model(batch(device)).backward()  # a step where all are used is fine
        streamer.wait_all()
        assert_slots_equal_grads(store, model, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_deferred_unused_error_is_kept_and_the_step_delivered(device):
    """defer_unused_error (what a hybrid across processes asks, to refuse the step on every rank: Note [A step
    refused on every rank]): the backward does not raise, every bucket is delivered (the slots equal the
    gradients, zeros for the unused layer), and take_unused_error gives the error once; reset forgets a kept
    error; a window that uses every parameter keeps none; without deferral the backward raises again."""
    model = Net().to(device)
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store, unused="error") as streamer:
        streamer.defer_unused_error()
        with streamer.backward_pass():
            model(batch(device), use_extra=False).backward()
        streamer.wait_all()
        assert_slots_equal_grads(store, model, 0)
        assert model.extra.weight.grad is None
        exc = streamer.take_unused_error()
        assert isinstance(exc, RuntimeError) and re.search(r"no gradient.*extra\.weight.*unused='zero'", str(exc))
        assert streamer.take_unused_error() is None
        streamer.reset()
        model.zero_grad(set_to_none=True)
        with streamer.backward_pass():
            model(batch(device), use_extra=False).backward()
        streamer.reset()  # a step dropped: its kept error with it
        assert streamer.take_unused_error() is None
        model.zero_grad(set_to_none=True)
        with streamer.backward_pass():
            model(batch(device)).backward()
        streamer.wait_all()
        assert streamer.take_unused_error() is None
        assert_slots_equal_grads(store, model, 0)
        streamer.reset()
        streamer.defer_unused_error(False)
        model.zero_grad(set_to_none=True)
        with pytest.raises(RuntimeError, match=r"no gradient.*extra\.weight"):
            with streamer.backward_pass():
                model(batch(device), use_extra=False).backward()


class UnusedFirst(torch.nn.Module):
    """Three layers in a chain and a head registered last (so in the first bucket) that a step may leave out."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(6, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 3)
        self.head = torch.nn.Linear(3, 3)

    def forward(self, x, use_head=False):
        h = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return (self.head(h) if use_head else h).pow(2).mean()


@pytest.mark.timeout(60)
def test_an_unused_parameter_does_not_hold_the_buckets_back():
    """Note [Unused parameters and overlap]: once a step had an unused parameter, the next ones know it from the
    loss's graph before backward, so bucket 0 (holding it) and the next go out while backward still runs; the slots
    stay exact (zeros for it), and a step that uses it again streams its gradient."""
    model = UnusedFirst()
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store, bucket_mb=TINY, first_bucket_mb=TINY) as streamer:
        launched = []
        probe = model.a.weight.register_hook(
            lambda g: launched.append([streamer.wait(k, timeout=0) for k in range(3)]))  # near the end of backward
        for step, use_head in enumerate((False, False, True, False)):
            model.zero_grad(set_to_none=True)
            loss = model(torch.randn(5, 6), use_head)
            with streamer.backward_pass(loss):
                loss.backward()
            streamer.wait_all()
            assert_slots_equal_grads(store, model, 0)
            streamer.copy_back()
        probe.remove()
    # buckets 0, 1 = head.bias, head.weight (unused in steps 0, 1, 3), 2 = c.bias: out before a's gradient from step 1
    assert launched[0] == [False, False, False], "the first step cannot know: the end of backward launches"
    assert launched[1] == [True, True, True] and launched[3] == [True, True, True], launched
    assert launched[2] == [True, True, True], "the head used again: its own gradient, in order"


def test_a_gradient_the_graph_walk_missed_is_an_error():
    """A custom autograd Function that uses a parameter without taking it as an input hides it from the walk: its
    gradient then arrives for a bucket counted ready without it, an error rather than a wrong slot."""
    class Hidden(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, layer):
            ctx.layer = layer
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            with torch.enable_grad():
                ctx.layer(torch.ones(1, 3)).sum().backward()  # the parameter's gradient, from a graph of its own
            return g, None

    model = UnusedFirst()
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store) as streamer:
        loss = model(torch.randn(5, 6))
        with streamer.backward_pass(loss):  # the head unused: from now on the walk prunes
            loss.backward()
        streamer.copy_back()
        loss = Hidden.apply(model(torch.randn(5, 6)), model.head)
        with pytest.raises(RuntimeError, match=r"'head\.(weight|bias)' got a gradient though the loss's autograd graph"):
            with streamer.backward_pass(loss):
                loss.backward()


class Checkpointed(torch.nn.Module):
    """``a`` then ``b``; ``b`` (or both, ``whole=True``) under a reentrant activation checkpoint."""

    def __init__(self, whole=False):
        super().__init__()
        self.a, self.b, self.whole = torch.nn.Linear(5, 6), torch.nn.Linear(6, 3), whole

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        if self.whole:
            x = x.requires_grad_()  # a reentrant checkpoint needs an input that requires grad
            return checkpoint(lambda t: self.b(torch.tanh(self.a(t))), x, use_reentrant=True).pow(2).mean()
        return checkpoint(self.b, torch.tanh(self.a(x)), use_reentrant=True).pow(2).mean()


@pytest.mark.parametrize("whole", [False, True], ids=["last-block", "whole-model"])
def test_reentrant_checkpoint_streams_every_gradient(whole):
    """Note [Reentrant backward]: the first hooks fire inside the checkpoint's inner backward, whose end is not the
    end of the pass. Every slot equals its .grad, each bucket is launched once, one pass is counted."""
    torch.manual_seed(0)
    model = Checkpointed(whole)
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store, bucket_mb=TINY, first_bucket_mb=TINY) as streamer:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with streamer.backward_pass():  # needed for whole=True: no hook fires after the inner backward
                model(torch.randn(4, 5)).backward()
            streamer.wait_all()
            assert_slots_equal_grads(store, model, 0)
            assert not (store.grad_slot(0) == 0).all()
            streamer.copy_back()
        assert streamer._backward_count == 2 and streamer.hook_calls == 8


def test_backward_reaching_no_parameter_ends_the_pass():
    """A loss that does not depend on the model fires no hook: backward_pass() counts a pass with no gradient
    (zeros, or the unused='error' message) instead of leaving every wait to hang."""
    model = Net()
    store = pyengine.HostStore(model, pin=False)
    store.grad_slot(0).fill_(7.0)
    with pyengine.GradientStreamer(model, store) as streamer:
        with pytest.warns(RuntimeWarning, match=r"GradientStreamer\(worker=0\): this step's backward reached none of "
                                                r"the replica's 8 trainable parameters"):
            with streamer.backward_pass():
                torch.zeros((), requires_grad=True).backward()
        assert streamer.wait(0, timeout=5.0)
        streamer.wait_all()
        assert all((view == 0).all() for view in slot_views(store, 0).values())
    with pyengine.GradientStreamer(model, store, unused="error") as streamer:
        with pytest.raises(RuntimeError, match=r"received no gradient"):
            with streamer.backward_pass():
                torch.zeros((), requires_grad=True).backward()
        # a failed pass, as when some parameters got no gradient: reset, so no wait returns on its buckets (the
        # next step's waits returned at once on this one's zeros)
        assert not streamer.wait(0, timeout=0)
        model.zero_grad()
        with streamer.backward_pass():
            model(batch()).backward()
        streamer.wait_all()
        assert_slots_equal_grads(store, model, 0)


@pytest.mark.parametrize("unused,error", [("zero", None), ("error", "received no gradient")])
@pytest.mark.parametrize("mode", ["hybrid", "sync", "async"])
def test_engine_loss_reaching_no_parameter(rng, unused, error, mode):
    """Through the engine (workers wrap every backward): the step completes, or fails naming the cause; no hang. With
    zeros, each worker warns at its first such step: a loss_fn that computes with the model of its closure, not the
    replica it is given, trained nothing (weight decay alone moved the weights) and said nothing."""
    model = Net()

    def closure_model(replica, batch):
        return model(batch).sum()  # the mistake: the closure's model, not the replica

    with pyengine.Engine(model, closure_model, devices=["cpu"] * 2, mode=mode, unused=unused, pin=False) as engine:
        def step():
            return engine.fit([batch(n=8)])[0] if mode == "async" else engine.step(batch(n=8))

        if error is None:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                assert step()["applied"] and step()["applied"]
            said = sorted(str(w.message) for w in said if "reached none" in str(w.message))
            # once per worker (each took a batch in hybrid and sync; async: whichever workers took the two pushes)
            assert len(set(said)) == len(said) and len(said) in ((1, 2) if mode == "async" else (2,)), said
            assert all("original model held in a closure" in m for m in said), said
        else:
            with pytest.raises(pyengine.WorkerError, match=error):
                step()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("style", ["accumulate", "no_sync"])
def test_gradient_accumulation(style, device):
    model = Net().to(device)
    store = pyengine.HostStore(model, pin=False)
    streamer = pyengine.GradientStreamer(model, store, bucket_mb=0.01, first_bucket_mb=0.001)
    if style == "accumulate":
        streamer.accumulate(3)
    for step in range(2):
        model.zero_grad()
        store.grad_slot(0).fill_(5.0)
        # extra is used only in the first micro-batch: its accumulated grad is still streamed on the last pass.
        uses = [True, False, False]
        for i, use_extra in enumerate(uses):
            if style == "no_sync" and i < len(uses) - 1:
                with streamer.no_sync():
                    model(batch(device), use_extra=use_extra).backward()
            else:
                model(batch(device), use_extra=use_extra).backward()
            if i < len(uses) - 1:
                assert torch.all(store.grad_slot(0) == 5.0)  # nothing copied before the window ends
        streamer.wait_all()
        assert_slots_equal_grads(store, model, 0)
        assert model.extra.weight.grad is not None
        streamer.copy_back()
    assert streamer.hook_calls == 2 * (3 * len(store.names) - 2 * 2)  # extra.{weight,bias} silent twice per step
    streamer.close()


def test_numpy_numbers_and_a_huge_timeout_are_taken():
    """bucket_mb / first_bucket_mb / eager_mb of numpy's types were refused as "must be a number > 0" (np.int64(25)
    is one; worker and bucket indices took numpy's ints); a timeout past float's range (an int) raised
    OverflowError: it waits as long as it takes, as None does."""
    model = Net()
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store, bucket_mb=np.float32(TINY), first_bucket_mb=np.float64(TINY),
                                   eager_mb=np.int64(0)) as streamer:
        assert len(streamer.buckets) == len(store.names)
        model(batch()).backward()
        assert streamer.wait(0, timeout=10**400) is True
        streamer.wait_all()
        assert_slots_equal_grads(store, model, 0)


def test_a_lazily_negated_gradient_is_streamed_as_its_values():
    """A custom Function whose backward returns torch._neg_view(g) (torch accepts it; .grad is then a negated
    view) made the streamer's hook raise an internal "BucketTransfer: pair 0 is a negative view" mid-backward. The
    slot holds the gradient's values, bit for bit."""
    class NegatedGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w):
            return w.clone()

        @staticmethod
        def backward(ctx, g):
            return torch._neg_view(g.clone())

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(37))
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store) as streamer:
        with streamer.backward_pass():
            NegatedGrad.apply(model.w).mul(torch.arange(37.0)).sum().backward()
        assert model.w.grad.is_neg()
        streamer.wait_all()
        assert torch.equal(store.views(store.grad_slot(0))["w"], model.w.grad.resolve_neg())


def test_no_sync_nests():
    """The inner of two no_sync() contexts turned syncing back on at its exit: a backward still inside the outer one
    copied its partial gradients into the slot and delivered its buckets (a pipelined_update would have applied
    them). Passes stay uncopied until the outermost context exits, as DDP's no_sync; the next pass completes the
    window with every pass's gradients."""
    model = Net()
    store = pyengine.HostStore(model, pin=False)
    streamer = pyengine.GradientStreamer(model, store, bucket_mb=TINY, first_bucket_mb=TINY)
    store.grad_slot(0).fill_(5.0)
    with streamer.no_sync():
        with streamer.no_sync():
            model(batch()).backward()
        model(batch()).backward()
        assert not streamer.wait(0, timeout=0.2)
        assert torch.all(store.grad_slot(0) == 5.0)
    model(batch()).backward()
    streamer.wait_all()
    assert_slots_equal_grads(store, model, 0)
    streamer.close()


def test_the_accumulation_window_restarts_where_its_api_says():
    """Where the count of a window's passes starts again: accumulate(n) (the engine calls it every step with the
    step's mini-batches: a k that changes from 1 to 2 must not copy after the first pass of two), reset() (a
    failed step's passes do not count towards the next window), and the exit of no_sync() (the next pass outside
    completes the window, whatever n)."""
    model = Net()
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store, bucket_mb=TINY, first_bucket_mb=TINY) as streamer:
        def window(passes, check_between=True):
            model.zero_grad()
            store.grad_slot(0).fill_(5.0)
            for i in range(passes):
                model(batch()).backward()
                if check_between and i < passes - 1:
                    assert torch.all(store.grad_slot(0) == 5.0), f"copied after pass {i + 1} of {passes}"
            streamer.wait_all()
            assert_slots_equal_grads(store, model, 0)
            streamer.copy_back()
            streamer.wait_weights()

        streamer.accumulate(1)
        window(1)
        streamer.accumulate(2)
        window(2)
        model.zero_grad()
        model(batch()).backward()  # the first pass of a window that fails
        streamer.reset()
        window(2)
        streamer.accumulate(3)
        model.zero_grad()
        store.grad_slot(0).fill_(5.0)
        with streamer.no_sync():
            model(batch()).backward()
            model(batch()).backward()
        assert torch.all(store.grad_slot(0) == 5.0)
        model(batch()).backward()  # the first pass outside completes the window
        streamer.wait_all()
        assert_slots_equal_grads(store, model, 0)


def run_steps(models, store, streamers, steps, data, pipelined, threaded, hyper):
    """Steps of G workers; returns nothing, leaves the result in store and replicas."""
    for step in range(1, steps + 1):
        def work(g):
            models[g].zero_grad()
            models[g](data[step][g]).backward()

        if threaded:
            threads = [threading.Thread(target=work, args=(g,)) for g in range(len(models))]
            for t in threads:
                t.start()
        else:
            for g in range(len(models)):
                work(g)
        if pipelined:
            pyengine.pipelined_update(streamers, store, step, **hyper)
        else:
            for s in streamers:
                s.wait_all()
            clip = {} if hyper.get("max_grad_norm") is None else dict(max_grad_norm=hyper["max_grad_norm"])
            update = pyengine.ops.mean_grad_adamw_clipped_ if clip else pyengine.ops.mean_grad_adamw_
            update(store.param, store.exp_avg, store.exp_avg_sq, [store.grad_slot(s.worker) for s in streamers],
                   step=step, lr=hyper["lr"], beta1=hyper["betas"][0], beta2=hyper["betas"][1],
                   weight_decay=hyper["weight_decay"], amsgrad=hyper.get("amsgrad", False),
                   max_exp_avg_sq=store.max_exp_avg_sq, param_out=store.shadow, weights=hyper.get("weights"), **clip)
            for s in streamers:
                s.copy_back()
        if threaded:
            for t in threads:
                t.join()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shadow_dtype,amsgrad,weights,clip", [
    (None, False, None, None), (torch.bfloat16, True, [0.3, 0.7], None), (torch.float16, False, None, 0.05)])
def test_pipelined_update_equals_one_shot(device, shadow_dtype, amsgrad, weights, clip):
    base = Net()
    data = {step: [batch(device, n=5 + g) for g in range(2)] for step in range(1, 4)}
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, amsgrad=amsgrad, weights=weights, max_grad_norm=clip)
    results = []
    for pipelined, threaded in [(False, False), (True, False), (True, True)]:
        models = [copy.deepcopy(base).to(device) for _ in range(2)]
        store = pyengine.HostStore(models[0], workers=2, pin=False, shadow_dtype=shadow_dtype, amsgrad=amsgrad)
        streamers = [pyengine.GradientStreamer(m, store, worker=g, bucket_mb=0.01, first_bucket_mb=0.001)
                     for g, m in enumerate(models)]
        run_steps(models, store, streamers, 3, data, pipelined, threaded, hyper)
        for s in streamers:
            s.wait_weights()
            s.close()
        results.append((store, models))
    (ref_store, ref_models) = results[0]
    for store, models in results[1:]:
        for name in ["param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "shadow"]:
            a, b = getattr(ref_store, name), getattr(store, name)
            assert (a is None and b is None) or torch.equal(a, b), name
        for m in models:  # replicas hold the shipped weights (shadow when present), bit for bit
            source = store.views(store.shadow if shadow_dtype is not None else store.param)
            for name, p in m.named_parameters():
                if name in source:
                    assert torch.equal(p.detach().cpu(), source[name].to(p.dtype)), name
    assert not torch.equal(ref_store.param, pyengine.HostStore(base, pin=False).param)  # it did train


def test_a_closed_streamer_refuses_to_run():
    """After close(), pipelined_update updated bucket 0 of the store, then failed inside the closed transfer (an
    internal message, the store changed); the streamer's own methods failed inside it too. Each is refused by
    name, with nothing written."""
    model = Net()
    store = pyengine.HostStore(model, workers=1, pin=False)
    streamer = pyengine.GradientStreamer(model, store, worker=0, bucket_mb=TINY, first_bucket_mb=TINY)
    with streamer.backward_pass():
        model(batch()).pow(2).mean().backward()
    streamer.wait_all()
    streamer.close()
    before = store.param.clone()
    with pytest.raises(RuntimeError, match=r"pipelined_update: GradientStreamer\(worker=0.*is closed"):
        pyengine.pipelined_update([streamer], store, 1, lr=1e-3)
    assert torch.equal(store.param, before)
    for call in (lambda: streamer.backward_pass().__enter__(), lambda: streamer.wait(0), streamer.wait_all,
                 streamer.copy_back, lambda: streamer.accumulate(2), lambda: streamer.no_sync().__enter__()):
        with pytest.raises(RuntimeError, match=r"GradientStreamer\.\w+: this streamer is closed"):
            call()
    streamer.reset()  # nothing in flight: these return at once (an engine closed mid-step still resets)
    streamer.wait_weights()
    streamer.wait_weights(0)
    with pytest.raises(IndexError, match="wait_weights: bucket must be an int"):
        streamer.wait_weights(99)
    assert streamer.changed_in_place() == []
    streamer.close()  # still idempotent


@pytest.mark.timeout(60)  # a value refused only by the op made the call wait for gradients that never come
def test_pipelined_update_argument_errors():
    model = Net()
    store = pyengine.HostStore(model, workers=2, pin=False)
    a = pyengine.GradientStreamer(model, store, worker=0)
    with pytest.raises(ValueError, match="at least one"):
        pyengine.pipelined_update([], store, 1, lr=1e-3)
    with pytest.raises(ValueError, match="each worker must appear once"):
        pyengine.pipelined_update([a, a], store, 1, lr=1e-3)
    with pytest.raises(ValueError, match="amsgrad"):
        pyengine.pipelined_update([a], store, 1, lr=1e-3, amsgrad=True)
    with pytest.raises(ValueError, match=r"betas must be two numbers"):
        pyengine.pipelined_update([a], store, 1, lr=1e-3, betas=(0.9, 0.99, 0.1))
    with pytest.raises(TypeError, match="streamers must be GradientStreamers; got Net"):  # an AttributeError
        pyengine.pipelined_update([model], store, 1, lr=1e-3)
    with pytest.raises(TypeError, match=r"streamers must be a list of .*; got GradientStreamer \(one streamer: "
                                        r"pass \[streamer\]\)"):  # "'GradientStreamer' object is not iterable"
        pyengine.pipelined_update(a, store, 1, lr=1e-3)
    with pytest.raises(TypeError, match="store must be a HostStore; got Net"):
        pyengine.pipelined_update([a], model, 1, lr=1e-3)
    with pytest.raises(TypeError, match="copy_back must be True or False; got 'no'"):  # "no" copied back
        pyengine.pipelined_update([a], store, 1, lr=1e-3, copy_back="no")
    with pytest.raises(ValueError, match="accumulate: n must be an int >= 1; got True"):  # taken as 1
        a.accumulate(True)
    # The ops' checks, before any wait (nothing was delivered here: a wait would block): a step that is not an int,
    # a switch that is not a bool ("False" would have counted as True), a weight or bound that is no number, an lr
    # whose float32 step size overflows.
    for kwargs, error, message in ((dict(step=2.7), TypeError, "step must be an int"),
                                   (dict(step=True), TypeError, "step must be an int"),
                                   (dict(step=0), ValueError, "step must be >= 1"),
                                   (dict(maximize="False"), TypeError, "maximize must be True or False"),
                                   (dict(adamw=1), TypeError, "adamw must be True or False"),
                                   (dict(weights=["a"]), TypeError, r"weights\[0\] must be a number"),
                                   (dict(max_grad_norm=-1.0), ValueError, "max_grad_norm must be > 0"),
                                   (dict(lr=1e38), ValueError, r"lr / \(1 - beta1\^step\) = .* float32's range"),
                                   # values the op refuses (these waited for the gradients, then raised)
                                   (dict(lr=-1.0), ValueError, "lr must be a finite number >= 0"),
                                   (dict(betas=(1.0, 0.999)), ValueError, "beta1"),
                                   (dict(eps=0.0), ValueError, "eps"),
                                   (dict(weights=[0.5, 0.5]), ValueError, "weights"),
                                   (dict(grad_scale=torch.ones(1, dtype=torch.float64)), TypeError, "grad_scale"),
                                   (dict(found_inf=0.0), TypeError, "found_inf must be a tensor or None")):
        with pytest.raises(error, match=f"pipelined_update: {message}"):
            pyengine.pipelined_update([a], store, **{"step": 1, "lr": 1e-3, **kwargs})
    for buckets in ([0, len(a.buckets)], [-1], [0.5]):  # checked before any copy starts: nothing launched
        with pytest.raises(ValueError, match=r"copy_back: buckets must be indices in \[0, 1\)"):
            a.copy_back(buckets=buckets)
    assert not a._transfer.wait(1, 0, True, 0.0), "a refused copy_back launched bucket 0's weights"
    a.copy_back(buckets=[0])  # a valid call still works after the refusals
    a.wait_weights(0)
    a.copy_back(buckets=[np.int64(0)])  # numpy's ints, as wait() takes them (refused as "not indices")
    a.wait_weights(np.int64(0))
    c = pyengine.GradientStreamer(copy.deepcopy(model), store, worker=1, bucket_mb=TINY, first_bucket_mb=TINY)
    with pytest.raises(ValueError, match="same buckets"):
        pyengine.pipelined_update([a, c], store, 1, lr=1e-3)
    with pytest.raises(ValueError, match="unused"):
        pyengine.GradientStreamer(model, store, unused="ignore")
    for bad in (-1, True, "1", float("nan")):
        with pytest.raises(ValueError, match="eager_mb must be a number >= 0 or None"):
            pyengine.GradientStreamer(model, store, eager_mb=bad)
    with pytest.raises(ValueError, match="trainable parameter 'extra.bias'"):
        pyengine.GradientStreamer(torch.nn.Linear(3, 3), store)
    model.zero_grad()
    model(batch()).pow(2).mean().backward()
    a.wait_all()
    for source, what in ((store.param.double(), "torch.float64"), (torch.zeros(2 * store.numel)[::2],
                                                                   "not contiguous")):
        with pytest.raises(ValueError, match=f"source must be a contiguous float32.*{what}"):
            a.copy_back(source=source)
        assert a._transfer.wait(0, 0, True, 0.0), "a refused copy_back released the bucket's gradients"
    for s in (a, c):
        s.close()
    sharded = pyengine.HostStore(model, pin=False, state_ranges=[(0, 8)])
    with pyengine.GradientStreamer(model, sharded) as d:
        with pytest.raises(ValueError, match="state_ranges"):
            pyengine.pipelined_update([d], sharded, 1, lr=1e-3)


def test_transfer_checks_its_arguments():
    transfer = pyengine._C.BucketTransfer(2, "cpu", "test")
    with pytest.raises(ValueError, match="elements"):
        transfer.launch(0, 0, [torch.zeros(3)], [torch.zeros(4)])
    with pytest.raises(IndexError, match=r"bucket must be in \[0, 2\)"):
        transfer.launch(0, 2, [torch.zeros(3)], [torch.zeros(3)])
    with pytest.raises(ValueError, match="contiguous"):
        transfer.launch(0, 0, [torch.zeros(3)], [torch.zeros(6)[::2]])
    dst = torch.full((5,), 9.0)
    src = torch.randn(5, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        transfer.launch(0, 1, [src], [dst])
    for pair in (([torch._neg_view(torch.ones(5))], [dst]), ([torch.ones(5)], [torch._neg_view(torch.zeros(5))]),
                 ([None], [torch._neg_view(torch.zeros(5))])):  # a byte copy would drop the lazy negation
        with pytest.raises(ValueError, match="negative view"):
            transfer.launch(0, 1, *pair)
    assert torch.equal(dst, torch.full((5,), 9.0))
    shared = torch.arange(1000.0)  # overlapping source and destination: memcpy's result is undefined
    for pair in (([torch._efficientzerotensor(5)], [dst]), ([None], [torch._efficientzerotensor(5)])):
        with pytest.raises(ValueError, match="pair 0 holds a ZeroTensor"):  # no memory: a null pointer was read
            transfer.launch(0, 1, *pair)
    with pytest.raises(ValueError, match=r"srcs\[0\] and dsts\[0\] overlap in memory"):
        transfer.launch(0, 1, [shared[:900]], [shared[100:]])
    assert torch.equal(shared, torch.arange(1000.0))
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds .* got NaN"):
        transfer.wait(0, 1, True, float("nan"))  # it returned at once, as a timeout
    transfer.launch(0, 1, [None], [dst])
    transfer.wait(0, 1, True)
    assert torch.count_nonzero(dst) == 0
    empty = torch.zeros(0)  # zero elements: no memcpy/memset of a null pointer (found by UBSan)
    transfer.launch(0, 0, [torch.zeros(0)], [empty])
    transfer.launch(0, 0, [None], [empty])
    assert transfer.wait(0, 0, True, 10.0)
    transfer.close()
    with pytest.raises(RuntimeError, match="closed"):
        transfer.launch(0, 0, [None], [dst])



_FREED_AFTER_LAUNCH = """
import sys, torch
from pyengine import _C
busy_src, busy_dst = torch.ones(1 << 26), torch.zeros(1 << 26)  # 256 MiB: the copy thread is busy meanwhile
transfer = _C.BucketTransfer(2, "cpu", "t")
for side, nbytes in (("source", 0), ("source", 16), ("destination", 0), ("destination", 16)):
    src, dst = torch.ones(1 << 16), torch.zeros(1 << 16)
    transfer.launch(0, 1, [busy_src], [busy_dst])
    transfer.launch(0, 0, [src], [dst])
    (src if side == "source" else dst).untyped_storage().resize_(nbytes)  # freed or shrunk before its copy ran
    try:
        transfer.wait(0, 0, True, 60.0)
        print(side, nbytes, "copied")
    except RuntimeError as error:
        print(side, nbytes, str(error).split("failed: ")[-1].splitlines()[0])
    assert transfer.wait(0, 1, True, 60.0)
src, dst = torch.randn(1 << 16), torch.zeros(1 << 16)  # the transfer goes on
transfer.launch(0, 0, [src], [dst])
assert transfer.wait(0, 0, True, 60.0) and torch.equal(src, dst)
transfer.close()
print("done")
"""


def test_a_tensor_freed_after_its_copy_was_launched_is_an_error_not_a_crash():
    """The CPU copy thread holds a launched copy's tensors, not their bytes: a storage freed (``resize_(0)``, as code
    that frees gradients to save memory does) or shrunk before the copy ran was read or written through a null or
    short pointer, and the process died (SIGSEGV). Now the bucket's wait raises naming it, and the transfer goes on.
    In a process of its own: on the old code this test's process crashes."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _FREED_AFTER_LAUNCH], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    lines = run.stdout.splitlines()
    assert lines[-1] == "done" and len(lines) == 5, lines
    for line, (side, nbytes) in zip(lines, (("source", 0), ("source", 16), ("destination", 0), ("destination", 16))):
        assert line == (f"{side} {nbytes} copy_on_host: the {side}'s storage holds {nbytes} bytes but the copy needs "
                        f"262144: it was freed or resized after the copy was launched (keep a tensor's storage until "
                        f"its bucket's wait returns)"), line


_GRAD_FREED_IN_BACKWARD = """
import torch, pyengine
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1 << 22))  # the last: 16M weights, copied first
store = pyengine.HostStore(model, pin=False)
streamer = pyengine.GradientStreamer(model, store, bucket_mb=1, first_bucket_mb=1, eager_mb=None)
assert len(streamer.buckets) == 3, streamer.buckets
first = model[0].weight
free = [True]
def free_grad(p):  # runs after the streamer's hook launched the bucket's copy, while the big copy still runs
    if free[0]:
        p.grad.untyped_storage().resize_(0)
first.register_post_accumulate_grad_hook(free_grad)
x = torch.randn(2, 4)
try:
    with streamer.backward_pass(loss := model(x).square().mean()):
        loss.backward()
    print("no error")
except RuntimeError as error:
    print(str(error).split("failed: ")[-1].splitlines()[0])
print(streamer.wait(0, timeout=0.2))  # False: the failed step's buckets are gone (True: returned on its data)
free[0] = False
model.zero_grad(set_to_none=True)
with streamer.backward_pass(loss := model(x).square().mean()):
    loss.backward()
streamer.wait_all()
slot = store.views(store.grad_slot(0))
print(all(torch.equal(slot[name], p.grad) for name, p in model.named_parameters()))
streamer.close()
"""


def test_a_gradient_freed_while_its_copy_waits_fails_the_backward_pass_and_not_the_next():
    """A gradient whose storage a later hook of the caller frees (``resize_(0)``) while its bucket's copy waits behind
    a large one: backward_pass raises the copy's error (the process crashed on the copy thread), and its step is
    dropped as for a backward that raised (reset: the other buckets' copies waited for), so the next pass fills the
    slot with its own gradients. In a process of its own: on the old code this test's process crashes."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _GRAD_FREED_IN_BACKWARD], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    assert run.stdout.splitlines() == [
        "copy_on_host: the source's storage holds 0 bytes but the copy needs 48: it was freed or resized after the "
        "copy was launched (keep a tensor's storage until its bucket's wait returns)", "False", "True"], run.stdout


def _launch_a_failing_copy(transfer, bucket, completes_bucket=True):
    """Launches a copy into ``bucket`` whose source's storage is freed (its size still says 2**16 elements, which
    the launch's checks read): the copy thread's check fails it, every time (freeing it after the launch, behind a
    large copy, raced with the copy thread on a loaded machine), and its bucket's waits raise."""
    src = torch.ones(1 << 16)
    src.untyped_storage().resize_(0)
    transfer.launch(0, bucket, [src], [torch.zeros(1 << 16)], completes_bucket)


def test_every_wait_on_a_failed_copy_raises_until_its_bucket_is_released():
    """Note [A failed copy's error]: the error of a failed copy went to the first wait only, and every other waiter
    of the launch returned as if the slot held the bucket. Two threads wait (a worker at the end of its backward pass,
    the host before the bucket's update): both raise; a later wait raises too, until release() drops the step. An
    early part's failure raises at its bucket's completing launch, and not at the launch after it."""
    transfer = pyengine._C.BucketTransfer(2, "cpu", "test")
    outcomes = []

    def waiter():
        try:
            outcomes.append(transfer.wait(0, 0, True, 60.0))
        except RuntimeError as error:
            outcomes.append(str(error).split("failed: ")[-1].split(":")[0])

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.05)  # both wait for the launch
    _launch_a_failing_copy(transfer, 0)
    for t in threads:
        t.join(60)
    assert outcomes == ["copy_on_host"] * 2, outcomes
    for until_launched in (True, False):  # the same thread again
        with pytest.raises(RuntimeError, match="copy of grads bucket 0 of test failed: copy_on_host: the source"):
            transfer.wait(0, 0, until_launched, 1.0)
    transfer.release(0, 0)
    assert transfer.wait(0, 0, True, 0.1) is False  # the step is dropped, its error with it
    assert transfer.wait(0, 0, False) is True
    src, dst = torch.randn(1 << 16), torch.zeros(1 << 16)
    transfer.launch(0, 0, [src], [dst])
    assert transfer.wait(0, 0, True, 60.0) and torch.equal(src, dst)
    transfer.release(0, 0)

    _launch_a_failing_copy(transfer, 0, completes_bucket=False)  # an early part fails
    transfer.launch(0, 0, [src], [dst])  # its bucket's completing launch copies fine
    for _ in range(2):
        with pytest.raises(RuntimeError, match="copy of grads bucket 0 of test failed"):
            transfer.wait(0, 0, True, 60.0)
    transfer.release(0, 0)
    transfer.launch(0, 0, [None], [dst])  # the next launch: the old error is not raised
    assert transfer.wait(0, 0, True, 60.0) and torch.count_nonzero(dst) == 0

    _launch_a_failing_copy(transfer, 0, completes_bucket=False)  # a part whose bucket never completes
    transfer.drain()
    transfer.release(0, 0)  # reset() of the failed step
    transfer.launch(0, 0, [src], [dst])  # the next step's launch: not failed by the dropped step's part
    assert transfer.wait(0, 0, True, 60.0) and torch.equal(src, dst)
    transfer.close()


_CTRL_C_DURING_WAIT = """
import os, signal, sys, threading, time, torch, pyengine
signal.signal(signal.SIGINT, signal.default_int_handler)  # a runner started in the background ignores SIGINT
model = torch.nn.Linear(4, 3)
eager_mb = None if sys.argv[1] == "None" else float(sys.argv[1])  # the eager_mb fixture's, not seen in this process
streamer = pyengine.GradientStreamer(model, pyengine.HostStore(model, pin=False), eager_mb=eager_mb)
for name, wait in (("wait", lambda: streamer.wait(0)), ("wait_all", streamer.wait_all),
                   ("wait with an hour's timeout", lambda: streamer.wait(0, timeout=3600))):
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # no backward comes: it waits for good
    start = time.perf_counter()
    try:
        wait()
        print(name, "returned")
    except KeyboardInterrupt:
        print(name, "interrupted", time.perf_counter() - start < 5.0)
streamer.close()
"""


def test_ctrl_c_interrupts_a_wait_for_a_backward_that_never_comes(eager_mb):
    """wait() without a timeout and wait_all() waited in C++, where Ctrl-C does not reach the thread: a wait before
    the backward (on the main thread) could be ended only by killing the process. They now wait in bounded steps;
    so does a wait with a long timeout (it held Ctrl-C off for that long). In a process of its own: on the old code
    it waits for good (this test's timeout)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _CTRL_C_DURING_WAIT, str(eager_mb)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    assert run.stdout.splitlines() == ["wait interrupted True", "wait_all interrupted True",
                                       "wait with an hour's timeout interrupted True"], run.stdout


def test_copy_thread_never_drops_the_last_reference_to_a_python_tensor():
    """A finished copy's tensors are released on the thread that launches the next copy (or closes), never on the
    C++ copy thread: that thread would take the GIL, and at interpreter exit CPython ends such a thread with a forced
    unwind (std::terminate). The source's Python object is dropped right after launch, so the job holds its last
    reference; its finalizer records the thread that freed it."""
    transfer = pyengine._C.BucketTransfer(2, "cpu", "test")
    freed_on = []
    for bucket in range(2):
        src = torch.randn(1 << 16)
        weakref.finalize(src, lambda: freed_on.append(threading.get_ident()))
        transfer.launch(0, bucket, [src], [torch.empty(1 << 16)])
        del src
        assert transfer.wait(0, bucket, True, 10.0)
    time.sleep(0.05)  # the copy thread has retired both jobs
    transfer.launch(0, 0, [None], [torch.empty(4)])  # frees the retired jobs here
    transfer.close()
    assert freed_on == [threading.get_ident()] * 2

def test_drain_lets_go_of_the_finished_copies_tensors():
    """After drain() (a reset step), the transfer holds none of the finished copies' tensors: they were kept until the
    next launch, a whole step's gradients for a worker that stays idle."""
    transfer = pyengine._C.BucketTransfer(1, "cpu", "test")
    freed = []
    src = torch.randn(1 << 16)
    weakref.finalize(src, lambda: freed.append(threading.get_ident()))
    transfer.launch(0, 0, [src], [torch.empty(1 << 16)])
    del src
    transfer.drain()
    assert freed == [threading.get_ident()]
    transfer.close()


def test_copy_back_marks_the_replica_weights_modified():
    """The CPU copy thread writes the weights as bytes: a graph that had saved one of them went on to use the new
    values in its backward, silently; now it raises as after an in-place copy_ (which the CUDA path does)."""
    model = torch.nn.Linear(4, 3)
    store = pyengine.HostStore(model, pin=False)
    with pyengine.GradientStreamer(model, store) as streamer:
        x = torch.randn(2, 4, requires_grad=True)
        out = model(x).sum()  # saves the weight for x's gradient
        store.param.add_(1.0)
        streamer.copy_back()
        streamer.wait_weights()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward()


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("device", DEVICES)
def test_thousand_steps_without_memory_growth(device):
    """Host memory (RSS) and, on CUDA, the device's allocated memory do not grow over 800 steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.Tanh(), torch.nn.Linear(65, 3)).to(device)
    store = pyengine.HostStore(model, workers=1, pin="auto" if device != "cpu" else False,
                               shadow_dtype=torch.bfloat16)
    x, y = torch.randn(8, 33, device=device), torch.randn(8, 3, device=device)
    cuda = device != "cpu"
    with pyengine.GradientStreamer(model, store, bucket_mb=0.005, first_bucket_mb=0.001) as streamer:
        assert len(streamer.buckets) >= 2
        first_loss = None
        for step in range(1, 1001):
            model.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            pyengine.pipelined_update([streamer], store, step, lr=1e-3)
            if step == 1:
                first_loss = loss.item()
            if step == 200:
                gc.collect()
                before = rss_bytes()
                device_before = torch.cuda.memory_allocated(device) if cuda else 0
        streamer.wait_weights()
        gc.collect()
        assert rss_bytes() - before < 4 * 2**20
        if cuda:
            torch.cuda.synchronize(device)
            assert torch.cuda.memory_allocated(device) - device_before < 2**20
        assert torch.nn.functional.mse_loss(model(x), y).item() < first_loss / 10  # the replica got the updates
        for name, view in store.views(store.shadow).items():
            assert torch.equal(dict(model.named_parameters())[name].detach().cpu(), view.float()), name


def test_copy_back_refuses_a_replica_whose_layout_changed_before_copying_anything():
    """A replica moved to channels_last after its streamer was built has no flat view of its conv weight: copy_back
    (and pipelined_update) say which parameter and why, before any bucket is released or copied (it used to copy
    the buckets before that weight's and then fail on a view error), and work again once the layout is back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 3 * 8 * 8), torch.nn.Unflatten(1, (3, 8, 8)),
                                torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(144, 2))
    store = pyengine.HostStore(model, workers=1, pin=False)
    streamer = pyengine.GradientStreamer(model, store, bucket_mb=TINY, first_bucket_mb=TINY)
    assert len(streamer.buckets) > 2
    with streamer.backward_pass():
        model(torch.randn(2, 8)).sum().backward()
    streamer.wait_all()
    model.to(memory_format=torch.channels_last)
    assert not model[2].weight.is_contiguous()
    store.param.add_(1.0)  # new weights: a copied bucket would show in the replica
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for call in (streamer.copy_back, lambda: pyengine.pipelined_update([streamer], store, 1, lr=1e-3)):
        with pytest.raises(ValueError, match=r"the replica's parameter '2\.weight' is no longer a contiguous"):
            call()
        for k in range(len(streamer.buckets)):
            assert not streamer._transfer.wait(1, k, True, 0.0), f"bucket {k}'s weights were launched"
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), before[name]), name
    model.to(memory_format=torch.contiguous_format)
    streamer.copy_back()
    streamer.wait_weights()
    views = store.views(store.param)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), views[name]), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("eager_mb", [None, 0.0])
def test_grad_changed_in_place_after_the_pass_does_not_reach_the_slot(eager_mb, device):
    """The copies read param.grad itself: a caller that scales .grad in place right after backward_pass (as
    clip_grad_norm_ or a GradScaler's unscale_ do) before waiting for the slot used to leave the slot a torn mix of
    the two values (rows of both, seen on 8M elements). The pass now ends after its copies (CUDA: the compute
    stream, where the in-place change runs, waits on their events): the slot holds the gradient backward produced,
    bit for bit, in every trial."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 4096, bias=False).to(device)  # 32 MB of gradient: a copy long enough to race
    store = pyengine.HostStore(model, workers=1, pin="auto" if device != "cpu" else False)
    streamer = pyengine.GradientStreamer(model, store, eager_mb=eager_mb)
    x = torch.randn(8, 2048, device=device)
    twin = copy.deepcopy(model)
    twin(x).sum().backward()
    produced = twin.weight.grad.cpu()  # what backward produces (the same kernels on the same input)
    for trial in range(3):
        model.zero_grad(set_to_none=True)
        with streamer.backward_pass():
            model(x).sum().backward()
        model.weight.grad.mul_(0.5)
        streamer.wait_all()
        slot = store.views(store.grad_slot(0))["weight"]
        assert torch.equal(slot, produced), \
            f"trial {trial}: {(slot == produced * 0.5).all(1).float().mean():.3f} of the rows took the change"
        streamer.copy_back()
        streamer.wait_weights()


class _FailsInBackward(torch.autograd.Function):
    """Raises in backward once ``ready()`` is true (polled, 30 s at most): the test's sign that the buckets of the
    layer after it were delivered and updated."""
    ready = staticmethod(lambda: True)

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        deadline = time.monotonic() + 30
        while not _FailsInBackward.ready() and time.monotonic() < deadline:
            time.sleep(0.001)
        raise ValueError("backward failed on purpose")


def test_pipelined_update_raises_when_a_workers_step_fails(monkeypatch):
    """A worker whose backward fails half way resets its streamer: a pipelined_update waiting on that step's later
    buckets used to wait for good, then woke on the retried step's gradients and updated those buckets with them
    (one update from two steps' gradients), and the retry's own update waited for good. Now it raises, naming the
    buckets already updated, and the retried step's update runs on the retry's gradients alone."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    store = pyengine.HostStore(model, workers=1, pin=False)
    streamer = pyengine.GradientStreamer(model, store, bucket_mb=1e-4, first_bucket_mb=1e-5)
    assert len(streamer.buckets) >= 3
    first = streamer.buckets[0]  # of layer 1: its gradients come before the failure

    def first_updated():
        return bool(store.exp_avg[first.begin:first.end].any())

    monkeypatch.setattr(_FailsInBackward, "ready", staticmethod(first_updated))
    outcome = {}

    def host(step):
        try:
            pyengine.pipelined_update([streamer], store, step=step, lr=1e-2)
            outcome[step] = "done"
        except RuntimeError as e:
            outcome[step] = e

    def backward(fail):
        model.zero_grad(set_to_none=True)
        with streamer.backward_pass():
            h = model[0](x)
            model[1](_FailsInBackward.apply(h) if fail else h).sum().backward()

    x = torch.randn(4, 8)
    updater = threading.Thread(target=host, args=(1,), daemon=True)
    updater.start()
    with pytest.raises(ValueError, match="on purpose"):
        backward(fail=True)
    updater.join(10)
    assert not updater.is_alive(), "pipelined_update still waits on the failed step"
    assert isinstance(outcome[1], RuntimeError), outcome
    assert re.search(r"worker 0's step failed .* buckets 0\.\.\d+ were updated", str(outcome[1])), outcome[1]
    left = [t.clone() for t in (store.param, store.exp_avg, store.exp_avg_sq)]  # what the failed step left
    updater = threading.Thread(target=host, args=(2,), daemon=True)
    updater.start()
    backward(fail=False)  # the retry
    updater.join(10)
    assert not updater.is_alive() and outcome[2] == "done", outcome
    # the retry's update, every bucket: from the state the failure left, on the retry's gradients alone
    pyengine.ops.mean_grad_adamw_(*left, [store.grad_slot(0).clone()], lr=1e-2, step=2)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), left, (store.param, store.exp_avg, store.exp_avg_sq)):
        assert torch.equal(a, b), name


@pytest.mark.timeout(60, method="thread")
def test_pipelined_update_since_sees_a_failure_before_the_call():
    """A worker on its own thread whose backward failed (and was reset) before the host reached pipelined_update:
    the reset was counted from the call, so the update waited for good for that worker's buckets. With ``since``
    (the streamers' resets read before the workers started) it raises at once and updates nothing; bad values of
    ``since`` are refused by name."""
    model = Net()
    store = pyengine.HostStore(model, workers=2, pin=False)
    replicas = [copy.deepcopy(model) for _ in range(2)]
    streamers = [pyengine.GradientStreamer(r, store, worker=g) for g, r in enumerate(replicas)]
    for bad, error in ((5, TypeError), ([0], ValueError), ([0, 1], ValueError), ([0, -1], ValueError),
                       ([0, True], ValueError)):
        with pytest.raises(error, match="pipelined_update: since must"):
            pyengine.pipelined_update(streamers, store, step=1, lr=1e-3, since=bad)
    since = [s.resets for s in streamers]
    before = store.param.clone()

    def work(g):
        loss = replicas[g](batch()).pow(2).mean()
        with contextlib.suppress(RuntimeError), streamers[g].backward_pass(loss):
            if g == 1:
                raise RuntimeError("worker 1 failed on purpose")
            loss.backward()

    threads = [threading.Thread(target=work, args=(g,)) for g in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [s.resets for s in streamers] == [since[0], since[1] + 1]  # backward_pass reset the failed one
    with pytest.raises(RuntimeError, match=r"worker 1's step failed .* no bucket was updated"):
        pyengine.pipelined_update(streamers, store, step=1, lr=1e-3, since=since)
    assert torch.equal(store.param, before)
    for s in streamers:
        s.close()


def test_two_streamers_cannot_write_one_slot_and_a_closed_or_dropped_one_gives_it_back():
    """worker=0 given twice once made two streamers copy into one slot: the update read a mix of two replicas'
    gradients, with no error."""
    model, other = Net(), Net()
    store = pyengine.HostStore(model, workers=2, pin=False)
    first = pyengine.GradientStreamer(model, store, worker=0)
    with pytest.raises(RuntimeError, match=r"worker 0's gradient slot is already written by GradientStreamer\("
                                           r"worker=0.*close\(\) that one first"):
        pyengine.GradientStreamer(other, store, worker=0)
    assert not any(p._post_accumulate_grad_hooks for p in other.parameters()), "the refused one left hooks"
    model(batch()).pow(2).mean().backward()
    first.wait_all()
    assert_slots_equal_grads(store, model, 0)  # the first one still streams
    with pyengine.GradientStreamer(other, store, worker=1):  # another worker's slot is free
        pass
    first.close()
    second = pyengine.GradientStreamer(other, store, worker=0)
    other.zero_grad()
    other(batch()).pow(2).mean().backward()
    second.wait_all()
    assert_slots_equal_grads(store, other, 0)
    del second
    gc.collect()
    pyengine.GradientStreamer(model, store, worker=0).close()  # a collected streamer gave its slot back


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(store=None), TypeError, "GradientStreamer: store must be a HostStore; got NoneType"),
    (dict(worker=True), IndexError, r"worker must be an int in \[0, 2\); got bool True"),
    (dict(worker=1.0), IndexError, r"worker must be an int in \[0, 2\); got float 1.0"),
    (dict(worker=2), IndexError, r"worker must be an int in \[0, 2\); got int 2"),
])
def test_streamer_refuses_a_store_or_worker_it_cannot_use(kwargs, error, message):
    model = Net()
    store = pyengine.HostStore(model, workers=2, pin=False)
    with pytest.raises(error, match=message):
        pyengine.GradientStreamer(model, **{"store": store, **kwargs})
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


def test_a_numpy_integer_names_a_worker():
    np = pytest.importorskip("numpy")
    model = Net()
    store = pyengine.HostStore(model, workers=2, pin=False)
    assert store.grad_slot(np.int64(1)).data_ptr() == store.grad_slot(1).data_ptr()
    with pyengine.GradientStreamer(model, store, worker=np.int64(1)) as streamer:
        assert streamer.worker == 1 and type(streamer.worker) is int
        model(batch()).pow(2).mean().backward()
        streamer.wait_all()
        assert_slots_equal_grads(store, model, 1)


@pytest.mark.parametrize("call,error,message", [
    (lambda s: s.wait("0"), IndexError, r"GradientStreamer.wait: bucket must be an int in \[0, \d+\); got str '0'"),
    (lambda s: s.wait(0.5), IndexError, r"GradientStreamer.wait: bucket must be an int .*; got float 0.5"),
    (lambda s: s.wait(True), IndexError, r"GradientStreamer.wait: bucket must be an int .*; got bool True"),
    (lambda s: s.wait(-1), IndexError, r"GradientStreamer.wait: bucket must be an int .*; got int -1"),
    (lambda s: s.wait(0, timeout=True), TypeError, "GradientStreamer.wait: timeout must be a number of seconds >= 0 "
                                                   "or None; got bool True"),
    (lambda s: s.wait(0, timeout="1"), TypeError, "timeout must be a number of seconds >= 0 or None; got str '1'"),
    (lambda s: s.wait(0, timeout=float("nan")), ValueError, "timeout must be >= 0 seconds or None; got nan"),
    (lambda s: s.wait_weights("0"), IndexError, r"GradientStreamer.wait_weights: bucket must be an int .*; got str"),
    (lambda s: s.wait_weights(10**6), IndexError, r"wait_weights: bucket must be an int .*; got int 1000000"),
    (lambda s: s.copy_back(source=5), TypeError, r"copy_back: source must be a flat store buffer \(a tensor\) or None; "
                                                 r"got int"),
    (lambda s: s.copy_back(source=np.zeros(3)), TypeError, r"copy_back: source must be .* got ndarray"),
    (lambda s: s.copy_back(buckets=0), TypeError, r"copy_back: buckets must be a sequence of bucket indices or None; "
                                                  r"got int 0"),
])
@pytest.mark.timeout(60, method="thread")  # bucket True once waited for bucket 1, which this test never delivers
def test_waits_name_a_bad_bucket_or_timeout_in_their_own_words(call, error, message):
    """A bucket that is no int met pybind11's "incompatible function arguments" listing the C++ signature; True
    waited for bucket 1, and timeout=True for a second. copy_back's source and buckets of another type were
    Python's AttributeError ('int' object has no attribute 'dim') and "'int' object is not iterable"."""
    model = Net()
    with pyengine.GradientStreamer(model, pyengine.HostStore(model, pin=False), bucket_mb=TINY,
                                   first_bucket_mb=TINY) as streamer:
        with pytest.raises(error, match=message):
            call(streamer)
        model(batch()).backward()
        assert streamer.wait(0, timeout=5) is True  # a good call after the refusal works
