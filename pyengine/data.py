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

from dataclasses import dataclass, field

import torch

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
        """Full batches per pass over the training split (the last partial batch is dropped)."""
        return self.train_size // batch_size

    def batch(self, step: int, batch_size: int, seed: int):
        """The batch of global step ``step`` (0-based): epoch ``step // steps_per_epoch`` of a per-epoch shuffle."""
        per_epoch = self.steps_per_epoch(batch_size)
        epoch, index = divmod(step, per_epoch)
        generator = torch.Generator().manual_seed(_mix(seed, epoch))
        order = torch.randperm(self.train_size, generator=generator)
        rows = order[index * batch_size:(index + 1) * batch_size]
        return self.x_train[rows], self.y_train[rows]

    def stream(self, start: int, batch_size: int, seed: int, skip=frozenset(), indices: list | None = None):
        """Batches of steps ``start, start + 1, ...`` without end (the caller stops), leaving out the steps in
        ``skip``; the step of each batch yielded is appended to ``indices`` when given."""
        step = start
        while True:
            if step not in skip:
                if indices is not None:
                    indices.append(step)
                yield self.batch(step, batch_size, seed)
            step += 1


def _mix(seed: int, epoch: int) -> int:
    return (seed * 1_000_003 + epoch * 7919 + 12345) % (2**63 - 1)


def load(name: str, *, seed: int = 0, split_seed: int = 0, test_fraction: float = 0.2, **kwargs) -> Dataset:
    if name == "digits":
        return load_digits(split_seed=split_seed, test_fraction=test_fraction)
    if name == "tokens":
        return synthetic_tokens(seed=split_seed, **kwargs)
    raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")


def load_digits(split_seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    digits = sk_load_digits()
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
    """Sequences from a random bigram chain: next = succ[token] with probability ``p_follow``, else uniform."""
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
