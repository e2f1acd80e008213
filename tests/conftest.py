"""Shared fixtures: the devices every op test runs on (CUDA twins skip without a GPU)."""
import random

import pytest
import torch

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def rng():
    """A CPU generator with a fresh seed each run; the seed is printed (pytest shows it when a test fails)."""
    seed = random.SystemRandom().randrange(2**31)
    print(f"rng seed: {seed}")
    return torch.Generator().manual_seed(seed)
