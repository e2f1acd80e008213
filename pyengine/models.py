"""Small models for ``python -m pyengine train``: an MLP for digits and a small causal transformer for the token
workload. Neither has dropout or buffers: every run is a pure function of the seed and the data (a model with dropout
would be too: concurrent workers draw from generators of their own, Note [Random numbers of concurrent workers])."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .rng import cpu_generator_seed

__all__ = ["MODELS", "MLP", "TinyTransformer", "as_layers", "build", "loss_fn", "evaluate"]

MODELS = ("mlp", "transformer")
TASK_OF_MODEL = {"mlp": "classify", "transformer": "lm"}
TRANSFORMER_HEADS = 4  # attention heads of the token workload's transformer: --hidden (d_model) is a multiple


def _check_sizes(who: str, **sizes) -> None:
    """Each size an int >= 1 (depth and layers: >= 0), or a ValueError naming it: depth=-1 built a depth-0 model,
    d_in=0 a model of no inputs, both without a word."""
    for name, value in sizes.items():
        least = 0 if name in ("depth", "layers") else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{who}: {name} must be an int >= {least}; got {value!r}")


class MLP(nn.Module):
    def __init__(self, d_in: int = 64, hidden: int = 256, d_out: int = 10, depth: int = 2):
        _check_sizes("MLP", d_in=d_in, hidden=hidden, d_out=d_out, depth=depth)
        super().__init__()
        layers, width = [], d_in
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        layers.append(nn.Linear(width, d_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Pre-LN causal transformer LM (token + learned position embeddings, tied-free output head)."""

    def __init__(self, vocab: int = 256, seq_len: int = 64, d: int = 128, layers: int = 2,
                 heads: int = TRANSFORMER_HEADS):
        _check_sizes("TinyTransformer", vocab=vocab, seq_len=seq_len, d=d, layers=layers, heads=heads)
        if d % heads:
            raise ValueError(f"TinyTransformer: d must be a multiple of heads; got d={d}, heads={heads}")
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq_len, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = embed(self.tok, self.pos, tokens)
        mask = causal_mask(tokens.shape[1], tokens.device)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def embed(tok: nn.Embedding, pos: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Token embeddings plus learned position embeddings of the first ``tokens.shape[1]`` positions."""
    return tok(tokens) + pos[:tokens.shape[1]]


def causal_mask(t: int, device) -> torch.Tensor:
    """(t, t) attention mask, True above the diagonal: a position may not attend to later ones."""
    return torch.ones(t, t, dtype=torch.bool, device=device).triu(1)


class _Embedding(nn.Module):
    """The transformer's token + position embeddings as one layer (its parameters, not copies)."""

    def __init__(self, model: TinyTransformer):
        super().__init__()
        self.tok, self.pos = model.tok, model.pos

    def forward(self, tokens):
        return embed(self.tok, self.pos, tokens)


class _CausalBlock(nn.Module):
    """A transformer block as a layer of one input: it builds its causal mask itself."""

    def __init__(self, block: Block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x, causal_mask(x.shape[1], x.device))


def as_layers(model: nn.Module) -> nn.Sequential:
    """``model`` as an ``nn.Sequential`` of its layers, for the pipeline schedule: the MLP's ``net``; the
    transformer as embeddings, one layer per block, final LayerNorm, output head. The layers share the model's
    parameters, so training them trains the model (and ``Engine.copy_to(as_layers(model))`` writes into it)."""
    if isinstance(model, MLP):
        return model.net
    if isinstance(model, TinyTransformer):
        return nn.Sequential(_Embedding(model), *(_CausalBlock(b) for b in model.blocks), model.ln, model.head)
    raise TypeError(f"as_layers: no layer sequence known for {type(model).__name__}; expected MLP or TinyTransformer")


def build(name: str, dataset, seed: int, hidden: int | None = None) -> nn.Module:
    """The model ``name`` sized for ``dataset`` (of the model's task: ``TASK_OF_MODEL``), initialised from ``seed``.
    ``hidden``: the width (None: 256 for the MLP, 128 for the transformer), an integer >= 1 (the transformer's: a
    multiple of its ``TRANSFORMER_HEADS`` attention heads). ``seed``: an int, as torch.manual_seed takes it."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1):
        raise ValueError(f"build: hidden must be None (the model's default width) or an integer >= 1; got {hidden!r}")
    if name == "transformer" and hidden is not None and hidden % TRANSFORMER_HEADS:
        raise ValueError(f"build: the transformer's hidden width must be a multiple of its {TRANSFORMER_HEADS} "
                         f"attention heads; got {hidden}")
    if isinstance(seed, bool) or not isinstance(seed, int):  # torch.manual_seed("0") took the string
        raise TypeError(f"build: seed must be an int; got {type(seed).__name__} {seed!r}")
    task = TASK_OF_MODEL[name]
    if dataset.task != task:
        raise ValueError(f"build: model {name!r} needs a dataset of task {task!r}; got {dataset.name!r} of task "
                         f"{dataset.task!r}")
    torch.manual_seed(cpu_generator_seed(seed))  # seeds that differ above bit 32 initialised alike
    if name == "mlp":
        return MLP(dataset.info["features"], 256 if hidden is None else hidden, dataset.info["classes"])
    return TinyTransformer(dataset.info["vocab"], dataset.info["seq_len"], d=128 if hidden is None else hidden)


def loss_fn(model, batch):
    """Mean cross-entropy; works for (N, C) logits and (N, T, V) token logits."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model, x, y, batch_size: int = 512) -> dict:
    """Held-out mean loss and accuracy (per sample for classification, per token for the LM) of a non-empty set,
    ``batch_size`` (an integer >= 1) samples at a time; the model's training mode is given back as it was."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"evaluate: batch_size must be an integer >= 1; got {batch_size!r}")
    if x.shape[0] != y.shape[0]:  # the extra labels (or inputs) were left out of the score without a word
        raise ValueError(f"evaluate: x and y must hold the same samples; got x of shape {tuple(x.shape)} and y of "
                         f"shape {tuple(y.shape)}")
    if x.shape[0] == 0 or y.numel() == 0:
        raise ValueError(f"evaluate: the evaluation set is empty (x of shape {tuple(x.shape)}, y of shape "
                         f"{tuple(y.shape)}); expected at least one sample")
    was_training = model.training  # given back as it was (it always came back in training mode)
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    try:
        for i in range(0, x.shape[0], batch_size):
            logits = model(x[i:i + batch_size])
            target = y[i:i + batch_size]
            flat = logits.reshape(-1, logits.shape[-1])
            loss_sum += F.cross_entropy(flat, target.reshape(-1), reduction="sum").item()
            correct += (flat.argmax(-1) == target.reshape(-1)).sum().item()
            count += target.numel()
    finally:
        model.train(was_training)
    return {"test_loss": loss_sum / count, "test_accuracy": correct / count}
