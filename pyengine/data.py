"""Embedded data for ``python -m pyengine train``: nothing is downloaded at run time.

- ``digits``: scikit-learn's handwritten digits (1797 8x8 images, 10 classes; the data ships inside the
  scikit-learn package), pixels scaled to [0, 1], a stratified held-out split fixed by ``split_seed``.
- ``tokens``: a synthetic throughput workload for a small transformer: random token sequences drawn from a fixed
  random bigram chain (each token has a preferred successor with probability ``p_follow``), next-token targets.
  Learnable (so the loss curve means something; accuracy is bounded by about ``p_follow``) and any size.

Batches are a pure function of (seed, step): :meth:`Dataset.batch` gives the batch of global step ``step``, so a
resumed run sees exactly the batches an uninterrupted one would.
"""
from __future__ import annotations

import collections.abc
import math
import numbers
from dataclasses import dataclass, field

import torch

from .rng import cpu_generator_seed

__all__ = ["Dataset", "DATASETS", "load"]

DATASETS = ("digits", "tokens")


@dataclass
class Dataset:
    name: str
    task: str  # "classify": x (N, D) float, y (N,) int | "lm": x (N, T) int, y (N, T) int
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    info: dict = field(default_factory=dict)

    @property
    def train_size(self) -> int:
        return self.x_train.shape[0]

    def steps_per_epoch(self, batch_size: int) -> int:
        """Full batches per pass over the training split (the last partial batch is dropped; 0 when
        ``batch_size`` exceeds the split)."""
        _check_int(batch_size, "batch_size", 1)
        return self.train_size // batch_size

    def _check_batch(self, batch_size: int) -> int:
        per_epoch = self.steps_per_epoch(batch_size)
        if per_epoch < 1:
            raise ValueError(f"batch_size must be at most the {self.name} training split's {self.train_size} samples "
                             f"(the last partial batch is dropped); got {batch_size}")
        return per_epoch

    def batch(self, step: int, batch_size: int, seed: int):
        """The batch of global step ``step`` (0-based): epoch ``step // steps_per_epoch`` of a per-epoch shuffle.
        ``step >= 0``; ``1 <= batch_size <= train_size``."""
        _check_int(step, "step", 0)
        per_epoch = self._check_batch(batch_size)
        _check_int(seed, "seed", 0, SEED_BELOW)
        epoch, index = divmod(step, per_epoch)
        generator = torch.Generator().manual_seed(cpu_generator_seed(seed, _mix(seed, epoch)))
        order = torch.randperm(self.train_size, generator=generator)
        rows = order[index * batch_size:(index + 1) * batch_size]
        return self.x_train[rows], self.y_train[rows]

    def stream(self, start: int, batch_size: int, seed: int, skip=frozenset(), indices: list | None = None):
        """Batches of steps ``start, start + 1, ...`` without end (the caller stops), leaving out the steps in
        ``skip``; the step of each batch yielded is appended to ``indices`` when given. The arguments are checked
        here, not at the first batch (``start >= 0``, ``batch_size`` as in :meth:`batch`)."""
        _check_int(start, "start", 0)
        self._check_batch(batch_size)
        _check_int(seed, "seed", 0, SEED_BELOW)
        if not isinstance(skip, collections.abc.Container) or isinstance(skip, (str, bytes)):
            raise TypeError(f"stream: skip must be a set of steps; got {type(skip).__name__} {skip!r}")
        if indices is not None and not isinstance(indices, list):
            raise TypeError(f"stream: indices must be a list (the steps yielded are appended) or None; got "
                            f"{type(indices).__name__} {indices!r}")
        return self._stream(start, batch_size, seed, skip, indices)

    def _stream(self, start: int, batch_size: int, seed: int, skip, indices: list | None):
        step = start
        while True:
            if step not in skip:
                if indices is not None:
                    indices.append(step)
                yield self.batch(step, batch_size, seed)
            step += 1


def _check_int(value, what: str, least: int, below: int | None = None) -> int:
    wanted = f"an integer >= {least}" if below is None else f"an integer in [{least}, {below})"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be {wanted}; got {type(value).__name__} {value!r}")
    if value < least or (below is not None and value >= below):
        raise ValueError(f"{what} must be {wanted}; got {value}")
    return value


SEED_BELOW = 2**64  # what torch.manual_seed takes (the CLI's --seed range)
SPLIT_SEED_BELOW = 2**32  # what scikit-learn's random_state takes


def _mix(seed: int, epoch: int) -> int:
    """The generator seed of one epoch's shuffle before :func:`pyengine.rng.cpu_generator_seed`: distinct for every
    seed in [0, 2**64) at one epoch (1_000_003 is odd, so a bijection modulo 2**64; modulo 2**63 - 1, seeds s and
    s + 2**63 - 1 shuffled alike). The generator keeps 32 bits of it, so no 2**64 seeds can all shuffle apart; seeds
    below 2**32 keep their orders, larger ones get theirs from all their bits."""
    return (seed * 1_000_003 + epoch * 7919 + 12345) % SEED_BELOW


TOKENS_OPTIONS = ("train", "test", "seq_len", "vocab", "p_follow")


def load(name: str, *, split_seed: int = 0, test_fraction: float | None = None, **kwargs) -> Dataset:
    """The dataset ``name``. ``split_seed`` fixes the data (digits: its held-out split; tokens: the chain and the
    sequences); the training seed does not enter (it orders the batches: :meth:`Dataset.batch`). digits:
    ``test_fraction`` (default 0.2); tokens: the options of :func:`synthetic_tokens` (``train=``, ``test=``, ...).
    An argument the dataset does not use is refused (TypeError)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")
    if "seed" in kwargs:
        raise TypeError(f"load: no seed argument (the training seed orders the batches, Dataset.batch(step, "
                        f"batch_size, seed); the data is fixed by split_seed); got seed={kwargs['seed']!r}")
    if name == "digits":
        if kwargs:
            raise TypeError(f"load('digits'): unexpected argument(s) {', '.join(sorted(kwargs))}; digits takes "
                            f"split_seed and test_fraction")
        return load_digits(split_seed=split_seed, test_fraction=0.2 if test_fraction is None else test_fraction)
    if test_fraction is not None:
        raise TypeError(f"load('tokens'): test_fraction does not apply (the split is train= and test= sequences); "
                        f"got test_fraction={test_fraction!r}")
    unknown = sorted(set(kwargs) - set(TOKENS_OPTIONS))
    if unknown:
        raise TypeError(f"load('tokens'): unexpected argument(s) {', '.join(unknown)}; tokens takes split_seed and "
                        f"{', '.join(TOKENS_OPTIONS)}")
    return synthetic_tokens(seed=split_seed, **kwargs)


def load_digits(split_seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """scikit-learn's digits, split by class (stratified): ``test_fraction`` of them held out (a number in (0, 1)
    that leaves at least one sample of each class on each side), the split fixed by ``split_seed`` (an integer in
    [0, 2**32))."""
    _check_int(split_seed, "load_digits: split_seed", 0, SPLIT_SEED_BELOW)
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, numbers.Real):
        raise TypeError(f"load_digits: test_fraction must be a fraction in (0, 1) (not a count); got "
                        f"{type(test_fraction).__name__} {test_fraction!r}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"load_digits: test_fraction must be a fraction in (0, 1); got {test_fraction}")
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    digits = sk_load_digits()
    samples, classes = len(digits.target), len(set(digits.target.tolist()))
    held_out = math.ceil(samples * test_fraction)  # scikit-learn's rounding of a fractional test_size
    if not classes <= held_out <= samples - classes:
        raise ValueError(f"load_digits: test_fraction {test_fraction} holds out {held_out} of {samples} samples; a "
                         f"split by class needs at least {classes} (one per class) on each side")
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(torch.arange(len(y)).numpy(), test_size=test_fraction,
                                           random_state=split_seed, stratify=y.numpy())
    idx_train, idx_test = torch.as_tensor(idx_train), torch.as_tensor(idx_test)
    return Dataset("digits", "classify", x[idx_train].contiguous(), y[idx_train].contiguous(),
                   x[idx_test].contiguous(), y[idx_test].contiguous(),
                   info=dict(source="sklearn.datasets.load_digits", features=64, classes=10,
                             train=len(idx_train), test=len(idx_test)))


def synthetic_tokens(seed: int = 0, *, train: int = 4096, test: int = 512, seq_len: int = 64, vocab: int = 256,
                     p_follow: float = 0.8) -> Dataset:
    """Sequences from a random bigram chain: next = succ[token] with probability ``p_follow``, else uniform.
    ``train``, ``test``, ``seq_len`` and ``vocab`` are integers >= 1, ``0 <= p_follow <= 1``; ``seed`` is an
    integer in [0, 2**32)."""
    _check_int(seed, "synthetic_tokens: seed", 0, SPLIT_SEED_BELOW)
    for what, value in (("train", train), ("test", test), ("seq_len", seq_len), ("vocab", vocab)):
        _check_int(value, f"synthetic_tokens: {what}", 1)
    if isinstance(p_follow, bool) or not isinstance(p_follow, numbers.Real):
        raise TypeError(f"synthetic_tokens: p_follow must be a probability in [0, 1]; got {type(p_follow).__name__} "
                        f"{p_follow!r}")
    if not 0 <= p_follow <= 1:
        raise ValueError(f"synthetic_tokens: p_follow must be a probability in [0, 1]; got {p_follow}")
    g = torch.Generator().manual_seed(10_007 + seed)
    successor = torch.randperm(vocab, generator=g)
    n = train + test
    seqs = torch.empty(n, seq_len + 1, dtype=torch.int64)
    seqs[:, 0] = torch.randint(vocab, (n,), generator=g)
    for t in range(1, seq_len + 1):
        follow = torch.rand(n, generator=g) < p_follow
        seqs[:, t] = torch.where(follow, successor[seqs[:, t - 1]], torch.randint(vocab, (n,), generator=g))
    x, y = seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
    return Dataset("tokens", "lm", x[:train], y[:train], x[train:], y[train:],
                   info=dict(source="synthetic bigram chain", vocab=vocab, seq_len=seq_len, p_follow=p_follow,
                             train=train, test=test))
