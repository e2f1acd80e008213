"""Shared fixtures (the devices every op test runs on: CUDA twins skip without a GPU; a fresh rng) and the
classification workload of the engine and pipeline tests."""
import os
import random

import pytest
import torch

# Every process a test starts (mp.spawn workers, torchrun-like jobs, CLI runs) inherits this: a crash in native code
# (SIGSEGV, SIGABRT: "terminate called ...") then prints each Python thread's stack, so a rare one can be placed.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# The CUDA twins compare runs bit for bit with several workers' streams busy on one GPU: cuBLAS promises the same bits
# with more than one active stream only with a fixed workspace (read when its first handle is made, after this).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def pytest_configure(config):
    # A test's helper thread that dies of an exception fails its test: pytest only warns by default, and a test
    # whose reader thread died at its first read once passed having checked nothing.
    config.addinivalue_line("filterwarnings", "error::pytest.PytestUnhandledThreadExceptionWarning")


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(params=["cpu", pytest.param("cuda:0", marks=CUDA, id="cuda")])
def worker_device(request):
    """The device of an engine test's workers: CPU workers, and the CUDA twin (several workers on one GPU, each with
    its own streams), which skips without a GPU."""
    return request.param


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler for the test, as in a terminal: a runner started in the background inherits SIGINT
    ignored (the tests that raise SIGINT then skipped, or got no interrupt at all). Skips when the runner has a
    handler of its own."""
    import signal

    previous = signal.getsignal(signal.SIGINT)
    if previous not in (signal.default_int_handler, signal.SIG_IGN, signal.SIG_DFL):
        pytest.skip("the test runner handles SIGINT itself")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def _restore_intra_op_threads():
    """torch.set_num_threads() on any thread (engine workers, pipeline stages) also sets the count that every thread
    started later begins with; restored after each test, so that no test depends on the ones before it. (A test
    comparing a backward on the main thread with backwards on new threads failed after the pipeline tests: its new
    threads ran with 1 intra-op thread, the main thread with 2, and the two GEMM splits round differently.)"""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def fresh_seed() -> int:
    """A fresh seed each run, printed (pytest shows it when a test fails); ``PYENGINE_TEST_SEED=<seed>`` replays it."""
    replay = os.environ.get("PYENGINE_TEST_SEED")
    seed = int(replay) if replay else random.SystemRandom().randrange(2**31)
    print(f"rng seed: {seed}")
    return seed


@pytest.fixture
def rng():
    """A CPU generator with a fresh seed (:func:`fresh_seed`)."""
    return torch.Generator().manual_seed(fresh_seed())


def loss_fn(model, batch):
    """Mean cross-entropy of ``model`` on ``(x, y)``: the engine's ``loss_fn(model, batch)``."""
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def make_batches(rng, count, size, d_in=10, classes=3):
    """``count`` random ``(x, y)`` batches of ``size`` samples."""
    return [(torch.randn(size, d_in, generator=rng), torch.randint(0, classes, (size,), generator=rng))
            for _ in range(count)]
