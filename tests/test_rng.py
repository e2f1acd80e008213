"""pyengine.rng: a concurrent worker's random modules draw from its own generator, seeded per step (Note [Random
numbers of concurrent workers]); the default generator is left exactly as it was."""
import copy
import gc
import io
import os
import threading
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from pyengine import rng as rng_module
from pyengine.rng import WorkerRNG, worker_seed


def routed_model(rng):
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.5), torch.nn.RReLU(),
                                torch.nn.AlphaDropout(0.0), torch.nn.Linear(32, 4))
    assert rng.install(model) == 3  # the dropouts and RReLU; Linear draws nothing
    assert rng.install(model) == 0, "a module is routed once"
    return model


def test_routed_draws_leave_the_default_generator_alone_and_follow_the_step():
    x = torch.randn(16, 8)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        rng = WorkerRNG(torch.device("cpu"), seed=5, worker=1)
        model = routed_model(rng)
        torch.set_rng_state(before)
        rng.begin_step(7)
        outs.append([model(x) for _ in range(3)])
        assert torch.equal(torch.get_rng_state(), before), "the default generator must not move"
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert not torch.equal(outs[0][0], outs[0][1]), "each call draws new masks"
    rng.begin_step(7)
    assert torch.equal(model(x), outs[0][0]), "a step's draws are a function of (seed, worker, step)"
    rng.begin_step(8)
    assert not torch.equal(model(x), outs[0][0])


def test_workers_draw_the_same_masks_whatever_the_thread_timing():
    """Two workers in threads, each with its own generator: the masks of worker g depend on (seed, g, step) only."""
    x = torch.randn(64, 8)

    def run(order):
        torch.manual_seed(0)
        models = [routed_model(WorkerRNG(torch.device("cpu"), 3, g)) for g in range(2)]
        results = [None, None]

        def work(g):
            results[g] = [models[g](x) for _ in range(20)]
        threads = [threading.Thread(target=work, args=(g,)) for g in order]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results
    first, second = run([0, 1]), run([1, 0])
    for g in range(2):
        for a, b in zip(first[g], second[g]):
            assert torch.equal(a, b)
    assert not torch.equal(first[0][0], first[1][0]), "workers draw different masks"


@pytest.mark.parametrize("reentrant,preserve", [(False, True), (True, True), (False, False)])
def test_a_checkpoint_recomputes_the_masks_its_forward_drew(reentrant, preserve):
    """torch.utils.checkpoint recomputes the region's forward in backward: the routed dropout replays the state its
    forward started from, so the gradients equal those of the same step without the checkpoint. With
    preserve_rng_state=False torch sets no state before the recomputation, so no mark applies: a layer called once
    per micro-batch replays its forwards' states in order."""
    x = torch.randn(16, 8)
    grads = []
    for use_checkpoint in (False, True):
        torch.manual_seed(0)
        rng = WorkerRNG(torch.device("cpu"), 2, 0)
        model = routed_model(rng)
        rng.begin_step(3)
        for _ in range(2):  # two micro-batches: forward, backward, forward, backward
            inputs = x.clone().requires_grad_(reentrant)
            out = checkpoint(model, inputs, use_reentrant=reentrant, preserve_rng_state=preserve) if use_checkpoint \
                else model(inputs)
            out.pow(2).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


class SharedDropout(torch.nn.Module):
    """One Dropout called outside any checkpointed region and inside two (each region with its own Linear, so that
    a parameter's gradient sums in the same order with and without checkpoints)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (torch.nn.Linear(i, o) for i, o in ((8, 32), (32, 32), (32, 32), (32, 4)))
        self.drop = torch.nn.Dropout(0.5)
        self.regions = None  # None: no checkpoint; else checkpoint(..., **self.regions)

    def forward(self, x):
        def region(fn, h):
            return fn(h) if self.regions is None else checkpoint(fn, h, **self.regions)
        h = self.drop(self.a(x))
        h = region(lambda t: self.drop(torch.relu(self.b(t))), h)
        h = region(lambda t: self.drop(torch.tanh(self.c(t))) * 2, h)
        return self.d(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_layer_called_outside_and_in_two_regions_recomputes_each_calls_masks(reentrant):
    """Backward recomputes the second region first, the first next, and never the call outside: the recomputations
    replayed the oldest recorded states in turn, the outside call's masks in the second region (wrong gradients for
    every parameter before the last Linear). Two workers in threads, two micro-batches each: every worker's
    gradients equal those of the same steps without the checkpoints, bit for bit."""
    x = torch.randn(16, 8)

    def grads(regions):
        torch.manual_seed(0)
        template = SharedDropout()
        models = []
        for g in range(2):
            model = copy.deepcopy(template)
            model.regions, model.rng = regions, WorkerRNG(torch.device("cpu"), 2, g)
            assert model.rng.install(model) == 1
            model.rng.begin_step(3)
            models.append(model)

        def work(model):
            for _ in range(2):
                model(x.clone().requires_grad_(reentrant)).pow(2).sum().backward()
        threads = [threading.Thread(target=work, args=(m,)) for m in models]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [[p.grad for p in m.parameters()] for m in models]

    plain, checkpointed = grads(None), grads(dict(use_reentrant=reentrant))
    for g in range(2):
        for a, b in zip(plain[g], checkpointed[g]):
            assert torch.equal(a, b)
    assert not torch.equal(plain[0][0], plain[1][0]), "the two workers draw different masks"


def test_a_nested_checkpoint_recomputes_its_masks_on_every_backward():
    """A reentrant checkpoint nested in another runs its forward inside the outer recomputation; its state is marked
    there, settled with the replay's state. It replayed the oldest recorded state and used it up: a second backward
    (retain_graph) raised "ran inside backward with no forward of this step to replay"."""
    x = torch.randn(4, 8)
    grads = []
    for nested in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4))
        rng = WorkerRNG(torch.device("cpu"), 0, 0)
        rng.install(model)
        rng.begin_step(0)
        inputs = x.clone().requires_grad_(True)
        out = checkpoint(lambda u: checkpoint(model, u, use_reentrant=True), inputs, use_reentrant=True) \
            if nested else model(inputs)
        loss = out.pow(2).sum()
        loss.backward(retain_graph=True)
        first = model[0].weight.grad.clone()
        loss.backward()
        assert torch.equal(model[0].weight.grad, 2 * first)
        grads.append(first)
    assert torch.equal(grads[0], grads[1])


def test_a_copy_of_a_routed_module_is_not_routed():
    """copy.deepcopy copied the routed forward with its weak reference as it was: the copy ran the original module
    (its gradients went there) on a copy of the original's generator, so an eval-mode copy still dropped and an
    engine built from another engine's replica trained the original's weights; pickling raised ("cannot pickle
    'weakref.ReferenceType'"). A copy now runs its own forward on torch's generator, as an unrouted module does,
    and installing a generator routes it (a module routed by another generator is routed to the new one)."""
    rng = WorkerRNG(torch.device("cpu"), 0, 0)
    model = routed_model(rng)
    x = torch.randn(16, 8)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied[0].weight.mul_(2)  # the copy's own weights: its output must follow them
        expected = copied[4](torch.nn.functional.rrelu(copied[0](x), training=False))  # eval: dropouts draw nothing
        assert torch.equal(copied.eval()(x), expected) and torch.equal(copied(x), expected)
    copied.train()
    for _ in range(2):  # in training mode it draws from torch's default generator, like an unrouted module
        torch.manual_seed(5)
        first = copied(x)
        torch.manual_seed(5)
        assert torch.equal(copied(x), first)
    loss = copied(x).sum()
    loss.backward()
    assert copied[0].weight.grad is not None and model[0].weight.grad is None, "the gradient reached the original"
    buffer = io.BytesIO()
    torch.save(copied, buffer)
    torch.save(model, io.BytesIO())
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert torch.equal(loaded.eval()(x), copied.eval()(x))
    other = WorkerRNG(torch.device("cpu"), 0, 1)
    assert other.install(copied) == 3 and other.install(copied) == 0
    assert other.install(model) == 3, "routed by another generator: routed to this one"
    assert all(m.forward.rng is other and m.forward.module() is m for m in model if "forward" in m.__dict__)


def test_routing_makes_no_reference_cycle():
    """A routed module's forward holds it weakly: a dropped replica is freed at once, not by the collector."""
    gc.disable()
    try:
        model = routed_model(WorkerRNG(torch.device("cpu"), 0, 0))
        ref = weakref.ref(model[1])
        del model
        assert ref() is None
    finally:
        gc.enable()


def test_eval_mode_and_p_zero_draw_nothing():
    rng = WorkerRNG(torch.device("cpu"), 0, 0)
    model = routed_model(rng).eval()
    state = rng.generator.get_state()
    model(torch.randn(4, 8))
    assert torch.equal(rng.generator.get_state(), state)
    seeds = {worker_seed(s, w, t) for s in range(3) for w in range(3) for t in range(3)}
    assert len(seeds) == 27 and all(0 <= v < 2**63 for v in seeds)


@pytest.mark.parametrize("classes", [torch.nn.Linear, (torch.nn.Linear, "Dropout"), [int], "Dropout"])
def test_install_checks_its_classes_before_routing_anything(classes):
    """A bad entry of classes raised from isinstance after the first modules were routed already."""
    rng = WorkerRNG(torch.device("cpu"), 0, 0)
    model = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(3, 3))
    with pytest.raises(TypeError, match="WorkerRNG.install: classes must be a tuple of nn.Module subclasses"):
        rng.install(model, classes)
    assert "forward" not in model[0].__dict__, "a module was routed before the refusal"
    assert rng.install(model, (torch.nn.Linear,)) == 2


def test_worker_seed_checks_its_arguments_and_takes_numpy_integers():
    """np.int64(5) raised an OverflowError from the mix, 5.0 a TypeError about >>, True was 1, and 2**64 gave the
    seed of 0 (torch.manual_seed refuses it)."""
    np = pytest.importorskip("numpy")
    assert worker_seed(np.int64(5), np.int64(1), np.uint8(2)) == worker_seed(5, 1, 2)
    assert worker_seed(-2**63, 0, 0) != worker_seed(2**64 - 1, 0, 0)
    for args, message in (((2**64, 0, 0), r"seed must be an int in \[-9223372036854775808, 18446744073709551616\)"),
                          ((5.0, 0, 0), "seed must be an int"), ((True, 0, 0), "seed must be an int"),
                          (("5", 0, 0), "seed must be an int"), ((0, -1, 0), "worker must be an int >= 0"),
                          ((0, 0, -2), "step must be an int >= 0"), ((0, 0, 1.5), "step must be an int >= 0")):
        with pytest.raises(ValueError, match=f"worker_seed: {message}"):
            worker_seed(*args)


def test_setting_the_generators_waits_for_a_routed_forward_to_end():
    """Note [Checkpoints beside concurrent workers]: torch.set_rng_state on another thread (as a worker's activation
    checkpoint calls it around each recomputation) used to land inside a routed forward that had its worker's state
    swapped in, and the rest of that forward drew the other state's numbers (5 % of recomputed dropout masks differed
    from their forwards' with 2 x 2 pipeline stages). Now it waits until the forward has swapped its state back."""
    inside, go, set_done = threading.Event(), threading.Event(), threading.Event()

    class Drawing(torch.nn.Module):
        def forward(self, x):
            first = torch.rand(4)
            inside.set()
            go.wait(10)
            return x + torch.cat([first, torch.rand(4)])

    with torch.random.fork_rng():
        rng = WorkerRNG(torch.device("cpu"), seed=3, worker=1)
        module = Drawing()
        assert rng.install(module, classes=(Drawing,)) == 1
        expected = torch.rand(8, generator=torch.Generator().manual_seed(worker_seed(3, 1, 0)))
        other = torch.Generator().manual_seed(99).get_state()
        out = []
        forward = threading.Thread(target=lambda: out.append(module(torch.zeros(8))))
        forward.start()
        assert inside.wait(10)

        def set_state():  # from inside a backward, where a checkpoint recomputes
            x = torch.zeros(1, requires_grad=True)
            y = x * 2
            y.register_hook(lambda grad: torch.set_rng_state(other))
            y.sum().backward()
            set_done.set()

        setter = threading.Thread(target=set_state)
        setter.start()
        assert not set_done.wait(0.5), "torch.set_rng_state ran inside the routed forward"
        # outside a backward nothing waits: torch.compile reads the states while it compiles, and a routed forward
        # whose code waited for the compiler deadlocked with it
        read = []
        reader = threading.Thread(target=lambda: read.append(torch.get_rng_state()))
        reader.start()
        reader.join(5)
        assert read, "torch.get_rng_state outside a backward waited for the routed forward"
        # a forked child has a swap lock of its own (the parent's is held by the routed forward's thread)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if rng_module._SWAP.acquire(timeout=5) else 1)
        assert os.waitpid(pid, 0)[1] == 0, "the child found the swap lock held"
        go.set()
        forward.join(10)
        setter.join(10)
        assert set_done.is_set() and torch.equal(out[0], expected)
        assert torch.equal(torch.get_rng_state(), other)  # then it set the state, as asked
