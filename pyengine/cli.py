"""``python -m pyengine train``: the main training job.

With no arguments: scikit-learn's handwritten digits (embedded in the package, nothing downloaded), a small MLP,
the hybrid schedule on every available device (2 CPU workers when there is no GPU), evaluation on a held-out split.
A run directory (``--out``, default ``runs/<timestamp>-<mode>``) gets ``summary.json``, ``metrics.jsonl`` (one line
per step), ``checkpoints/`` (atomic, the last ``--keep``) and ``loss.png``; ``--mode all`` trains every schedule on
the same data and seed into ``<out>/<mode>/`` and draws ``<out>/compare.png``; it writes its configuration to
``<out>/config.json`` before the first mode trains, so ``--resume <out>`` continues an interrupted one as a whole (the
interrupted mode from its checkpoint, then the modes not yet run, then compare.png and ``<out>/summary.json``).
``--mode pipeline`` splits the model's layers (:func:`pyengine.models.as_layers`) into ``--stages`` stages fed by
``--microbatches`` micro-batches.

Exit codes: 0 done, 2 bad input (argparse errors and impossible combinations, reported before any work; an unusable
checkpoint), 1 a failure while training, 130 interrupted (Ctrl-C: a checkpoint is saved and the message says how to
resume; before training starts there is nothing to save, and the message says so).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import shlex
import signal
import shutil
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

from .files import replace_file

__all__ = ["main", "build_parser", "UsageError"]

PROG = "pyengine train"
MODES = ("hybrid", "sync", "async", "pipeline")  # --mode all runs each of them
PIPELINE_DEFAULTS = dict(microbatches=4, schedule="1f1b", balance="params")  # stages: one per device

# Per-dataset defaults (a flag given on the command line always wins).
DATA_DEFAULTS = {
    "digits": dict(model="mlp", batch_size=64, lr=2e-3, epochs=100, hidden=512),
    "tokens": dict(model="transformer", batch_size=32, lr=1e-3, epochs=2, hidden=128),
}
# Flags a resumed run may change; every other flag must match the checkpoint's run (or be left out).
RESUME_OVERRIDABLE = {"steps", "epochs", "quiet", "trace", "keep", "checkpoint_every", "log_every"}
# Output settings of one invocation, not of the run: not saved, so a resume never inherits them.
NOT_SAVED = ("quiet",)
# Modes whose resume may move to other --devices/--workers: their training state is the host store's (weights, Adam
# state, step) plus whatever per-worker state Engine.load_state_dict checks. A pipeline lays its stages over the
# devices (and --mode all runs one), so it resumes on its own.
DEVICES_MOVABLE = ("hybrid", "sync", "async")
ALL_CONFIG = "config.json"  # a --mode all run's configuration, written before its first mode trains


class UsageError(Exception):
    """An impossible combination of options or an unusable input: one line, exit code 2."""


class Interrupted(Exception):
    """Raised from a step callback when Ctrl-C asked the run to stop after the current step."""


class TrainingFailed(Exception):
    """A failure while training (the cause is ``__cause__``) after ``step`` complete steps; ``checkpoint``: the
    newest checkpoint (None when there is none), of that very step when ``complete``; ``not_saved``: why the step
    could not be saved, if it could not. Note [A failed run keeps its last step]."""

    def __init__(self, step: int, checkpoint: Path | None, complete: bool, not_saved: str | None = None,
                 pending: Path | None = None):
        super().__init__(f"training failed after step {step}")
        self.step, self.checkpoint, self.complete, self.not_saved = step, checkpoint, complete, not_saved
        self.pending = pending  # under torchrun: the checkpoint rank 0 was writing when the run failed

    def lines(self, out: Path, whole_run: bool) -> list[str]:
        """What follows the failure's own line: why the step was not saved, and how to resume (``whole_run``: a
        --mode all run, which resumes as a whole even when the failed mode has no checkpoint)."""
        lines = [] if self.not_saved is None else [f"step {self.step} could not be saved: {self.not_saved}"]
        resume = f"resume with {_resume_command(out)}"
        if self.checkpoint is not None:
            saved = f"step {self.step}, the last complete one, is saved" if self.complete else \
                "the last checkpoint is"
            pending = "" if self.pending is None else \
                f" (or {self.pending}, which rank 0 was writing when the run failed, if that write completed)"
            lines.append(f"{saved} in {self.checkpoint}{pending}: {resume}")
        elif self.pending is not None:
            lines.append(f"rank 0 was writing {self.pending} when the run failed; if that write completed: {resume}")
        elif whole_run:
            lines.append(f"{resume} (the modes trained so far are kept)")
        return lines


def _resume_command(out: Path) -> str:
    """The command that continues the run in ``out``: under torchrun, the same launch (a run resumed in another
    number of processes is not bit-identical: its reductions group the gradients otherwise)."""
    where = shlex.quote(str(out))  # a folder with spaces or parentheses: the line pastes into a shell as is
    if _launched()[1] > 1:
        return f"torchrun <the same launch options> -m pyengine train --resume {where}"
    return f"python -m pyengine train --resume {where}"


# ---- arguments ------------------------------------------------------------------------------------------------

def _path(text: str) -> str:
    """An argparse type for a file or folder: an empty one (``--out "$OUT"`` with OUT unset) is refused, not taken
    for the default."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path; got {text!r}")
    return text


def _number(convert, ok, expected: str):
    """An argparse type: ``convert`` the text, then require ``ok(value)``; errors say ``expected``."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}; got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}; got {text!r}")
        return value
    return parse


_positive_int = _number(int, lambda v: v >= 1, "a positive integer")
# bounded where a huge value failed inside the set-up with a traceback (a list of 10**11 devices; a model whose
# storage size overflowed int64 on the meta device): a transformer of d_model 2**20 is ~13 TB, refused in one line
_hidden = _number(int, lambda v: 1 <= v <= 2 ** 20, "an integer in [1, 2**20]")
_workers = _number(int, lambda v: 1 <= v <= 4096, "an integer in [1, 4096] (workers of this process)")
_seed = _number(int, lambda v: 0 <= v < 2 ** 64, "an integer in [0, 2**64) (what torch.manual_seed takes)")


def _balance(text: str):
    """``--balance``: ``params``, ``time`` or layers per stage as ``2,3`` (values checked with the model's layers)."""
    if text in ("params", "time"):
        return text
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected params, time or layers per stage as comma-separated integers "
                                         f"(e.g. 2,3); got {text!r}") from None
_nonnegative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
_positive_float = _number(float, lambda v: math.isfinite(v) and v > 0, "a positive number")
_nonnegative_float = _number(float, lambda v: math.isfinite(v) and v >= 0, "a number >= 0")
# Hyperparameters the update takes in float32: 1e-50 would be 0 there (no training at all), 1e300 infinite.
_FP32_NORMAL = (2.0 ** -126, 3.4e38)
_positive_fp32 = _number(float, lambda v: _FP32_NORMAL[0] <= v < _FP32_NORMAL[1],
                         "a positive number in float32's normal range [1.2e-38, 3.4e38)")
_nonnegative_fp32 = _number(float, lambda v: v == 0 or _FP32_NORMAL[0] <= v < _FP32_NORMAL[1],
                            "0 or a positive number in float32's normal range [1.2e-38, 3.4e38)")


def _loss_scale(text: str):
    """``--loss-scale``: auto, dynamic, none, or a static scale (a positive number)."""
    if text in ("auto", "dynamic", "none"):
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 2.0 ** -126 <= value < 3.4e38):  # a normal float32 (pyengine.LossScaler)
        raise argparse.ArgumentTypeError(f"expected auto, dynamic, none or a positive number (a normal float32); got "
                                         f"{text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pyengine", description="pyengine: train one model on many "
                                     "workers (master weights and AdamW state in host memory).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser(
        "train", prog=PROG, help="train a model (default: digits, MLP, hybrid on every device)",
        description="Trains a small model on embedded data with the pyengine engine and writes a run directory "
                    "(summary.json, metrics.jsonl, checkpoints/, loss.png). Defaults in brackets.")
    # Every default is None here and filled in by _resolve (so a resumed run can tell what was given).
    S = None
    g = p.add_argument_group("what to train")
    g.add_argument("--mode", choices=MODES + ("all",), default=S,
                   help="schedule: hybrid (all workers, mean gradient), sync (one worker at a time), async "
                        "(push when done), pipeline (the layers split into stages, one per worker, fed by "
                        "micro-batches), all (each of the four on the same data and seed, plus compare.png) "
                        "[hybrid]")
    g.add_argument("--data", choices=("digits", "tokens"), default=S,
                   help="digits: sklearn handwritten digits (real, embedded); tokens: synthetic token sequences "
                        "for a transformer throughput workload [digits]")
    g.add_argument("--model", choices=("mlp", "transformer"), default=S,
                   help="mlp for digits, transformer for tokens [chosen by --data]")
    g.add_argument("--hidden", type=_hidden, default=S, help="MLP width / transformer d_model [512 / 128]")
    g.add_argument("--seed", type=_seed, default=S,
                   help="model init, data order and engine seed, 0 <= seed < 2**64 [0]")
    g = p.add_argument_group("workers")
    g.add_argument("--devices", default=S,
                   help="comma-separated worker devices, e.g. cpu, cuda:0,cuda:1, cuda (every GPU); one entry is "
                        "repeated --workers times (cpu alone: 2 workers) [every GPU, else cpu]")
    g.add_argument("--workers", type=_workers, default=S,
                   help="number of workers (replicas) [one per GPU, else 2 CPU workers]")
    g = p.add_argument_group("schedule")
    length = g.add_mutually_exclusive_group()
    length.add_argument("--steps", type=_positive_int, default=S,
                        help="optimizer updates (async: pushes) to train for [from --epochs]")
    length.add_argument("--epochs", type=_positive_int, default=S,
                        help="passes over the training split [100 digits / 2 tokens]")
    g.add_argument("--batch-size", type=_positive_int, default=S,
                   help="samples per update (hybrid: split across the workers; sync: one worker; async: each "
                        "worker's mini-batch; pipeline: split across the replicas, then into micro-batches) "
                        "[64 digits / 32 tokens]")
    g.add_argument("--lr", type=_positive_fp32, default=S, help="AdamW learning rate [2e-3 digits / 1e-3 tokens]")
    g.add_argument("--lr-schedule", choices=("constant", "cosine"), default=S,
                   help="learning rate over the updates: constant, or a cosine decay that would reach 0 one "
                        "update after the last of --steps (or of --epochs' updates) [constant]")
    g.add_argument("--warmup-steps", type=_nonnegative_int, default=S,
                   help="linear warmup of the learning rate over the first updates [0]")
    g.add_argument("--weight-decay", type=_nonnegative_fp32, default=S, help="AdamW weight decay [0.01]")
    g.add_argument("--max-grad-norm", type=_positive_fp32, default=S, help="clip the mean gradient [off]")
    g.add_argument("--autocast", choices=("none", "bf16", "fp16"), default=S,
                   help="replicas compute under autocast, gradients travel in that dtype [none]")
    g.add_argument("--loss-scale", type=_loss_scale, default=S,
                   help="auto (dynamic under fp16, else none), dynamic, none, or a static scale: the loss is "
                        "multiplied by it before backward, the update divides it out [auto]")
    g.add_argument("--accumulate", type=_positive_int, default=S,
                   help="async: mini-batches a worker sums before one push [1]")
    g.add_argument("--max-staleness", type=_nonnegative_int, default=S,
                   help="async (and its run in --mode all): a push more than this many versions old recomputes on "
                        "fresh weights [unbounded]")
    g.add_argument("--staleness-lr", choices=("none", "inverse"), default=S,
                   help="async (and its run in --mode all): scale lr by 1/(1+staleness) [none]")
    g = p.add_argument_group("pipeline (--mode pipeline, and its run in --mode all)")
    g.add_argument("--stages", type=_positive_int, default=S,
                   help="pipeline stages S; the workers must be S x R (stage s, replica r on worker s*R+r) "
                        "[one stage per worker]")
    g.add_argument("--microbatches", type=_positive_int, default=S,
                   help=f"micro-batches per replica and step [{PIPELINE_DEFAULTS['microbatches']}]; with --mode "
                        "hybrid or sync: gradient accumulation, each worker's part of the batch in this many "
                        "micro-batches [1]")
    g.add_argument("--schedule", choices=("1f1b", "gpipe"), default=S,
                   help="1f1b (one forward, one backward: at most S micro-batches stored per stage) or gpipe "
                        "(all forwards, then all backwards) [1f1b]")
    g.add_argument("--balance", type=_balance, default=S, metavar="{params,time,N1,N2,...}",
                   help="cut the layers into stages by parameter count, by forward+backward time measured on "
                        "the first micro-batch, or by explicit layers per stage (e.g. 2,3: one count per stage, "
                        "summing to the model's layers) [params]")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=_path, default=S, help="run directory [runs/<timestamp>-<mode>]")
    g.add_argument("--resume", metavar="DIR", type=_path, default=S,
                   help="continue the run in DIR (a run directory or one checkpoint file) from its latest "
                        "checkpoint; --steps/--epochs set a new end")
    g.add_argument("--keep", type=_positive_int, default=S, help="checkpoints to keep [3]")
    g.add_argument("--checkpoint-every", type=_positive_int, default=S,
                   help="steps between checkpoints [one epoch]; one is always written at the end")
    g.add_argument("--trace", metavar="PATH", type=_path, default=S,
                   help="write a Chrome trace (chrome://tracing, Perfetto) of every worker's phases; with "
                        "--mode all, one per mode (PATH with -<mode> before the extension)")
    g.add_argument("--quiet", action="store_true", default=S,
                   help="no progress output (a resumed run is quiet only when given it again)")
    g.add_argument("--log-every", type=_positive_int, default=S,
                   help="steps between progress lines when stdout is not a terminal [about 20 lines a run]")
    _add_plan_parser(commands)
    return parser


def _add_plan_parser(commands) -> None:
    """``python -m pyengine plan``: the communication planner (:mod:`pyengine.comm`)."""
    from . import comm

    def unit(parse, expected):
        return _number(parse, lambda v: True, expected)

    p = commands.add_parser(
        "plan", prog="pyengine plan", help="model the gradient exchange time of each allreduce algorithm",
        description="Alpha-beta model (latency + bytes / bandwidth) of one step's gradient exchange across nodes: "
                    "parameter server (one, sharded), tree, butterfly and ring allreduce; prints time per step, "
                    "scaling efficiency and the fastest. Defaults in brackets.")
    p.add_argument("--nodes", type=_positive_int, required=True, help="number of nodes (data-parallel ranks)")
    p.add_argument("--params", type=unit(comm.parse_count, "a parameter count like 1.3e9 or 350M"), required=True,
                   help="model parameters, e.g. 1.3e9, 1.3B, 350M")
    p.add_argument("--grad-dtype", type=unit(comm.parse_dtype, "bf16, fp16 or fp32"), default=4,
                   help="gradient dtype on the wire: bf16, fp16, fp32 [fp32]")
    p.add_argument("--bandwidth", type=unit(comm.parse_bandwidth, "a bandwidth like 25Gbit or 3GB/s"),
                   required=True, help="per-node link bandwidth, e.g. 25Gbit, 100Gbps, 3GB/s")
    p.add_argument("--latency", type=unit(comm.parse_latency, "a latency like 5us or 0.2ms"), default=5e-6,
                   help="per-message latency, e.g. 5us, 0.2ms [5us]")
    p.add_argument("--compute-ms", type=_positive_float, required=True,
                   help="forward+backward time of one step on one node, in ms")
    p.add_argument("--servers", type=_positive_int, default=None,
                   help="server shards of the sharded parameter server [one per node]")
    p.add_argument("--overlap", type=_number(float, lambda v: 0.0 <= v <= 1.0, "a fraction in [0, 1]"), default=0.0,
                   help="fraction of the exchange hidden behind backward, at most the compute time [0]")
    p.add_argument("--plot", metavar="PATH", type=_path, default=None,
                   help="also draw efficiency against node count (1, 2, 4, ... up to --nodes) to this file (.png, "
                        ".svg, .pdf, ...: the type by the suffix)")


def _plan(args) -> int:
    from . import comm

    made = []
    if args.plot:  # a type plot_efficiency writes; its folder is made (as --out's is) and checked before any output
        try:
            comm.check_plot_path(args.plot)
        except ValueError:
            raise UsageError(f"--plot {args.plot}: expected a file name ending in .png (or "
                             f"{', '.join(comm.plot_kinds())})") from None
        made = _check_writable(Path(args.plot).resolve().parent, "the --plot folder")
    network = comm.Network(args.latency, args.bandwidth)
    compute_s = args.compute_ms / 1e3
    try:
        rows = comm.plan(args.nodes, args.params, args.grad_dtype, network, compute_s, servers=args.servers,
                         overlap=args.overlap)
    except ValueError as exc:  # numbers each in range whose product is not
        _remove_empty(made)
        raise UsageError(str(exc)) from None
    dtype = {2: "16-bit", 4: "fp32"}[args.grad_dtype]
    print(f"pyengine plan: {args.nodes} nodes, {args.params:.3g} params, {dtype} gradients "
          f"({comm.format_bytes(args.params * args.grad_dtype)} per node), {args.bandwidth * 8 / 1e9:.3g} Gbit/s "
          f"links, {args.latency * 1e6:.3g} us latency, {args.compute_ms:.3g} ms "
          f"compute, overlap {args.overlap:.0%}")
    print(comm.format_plan(rows, args.servers))
    if args.plot:
        counts = sorted({2 ** i for i in range(args.nodes.bit_length())} | {args.nodes})
        try:
            comm.plot_efficiency(args.plot, counts, args.params, args.grad_dtype, network, compute_s,
                                 servers=args.servers, overlap=args.overlap,
                                 title=f"{args.params:.3g} params, {dtype} gradients, "
                                 f"{args.bandwidth * 8 / 1e9:.3g} Gbit/s, {args.latency * 1e6:.3g} us, "
                                 f"{args.compute_ms:.3g} ms compute, overlap {args.overlap:.0%}")
        except (OSError, ValueError) as exc:  # a folder of that name, say
            _remove_empty(made)
            raise UsageError(f"cannot write the --plot file {args.plot}: {getattr(exc, 'strerror', None) or exc}") \
                from None
        print(f"plot: {args.plot}")
    return 0


# ---- configuration --------------------------------------------------------------------------------------------

def _resolve(given: dict) -> dict:
    """Fills the defaults; ``given`` holds the flags from the command line (not None)."""
    cfg = dict(given)
    data = cfg.get("data") or "digits"
    defaults = dict(mode="hybrid", data=data, seed=0, weight_decay=0.01, autocast="none", accumulate=1,
                    staleness_lr="none", keep=3, quiet=False, lr_schedule="constant", warmup_steps=0,
                    loss_scale="auto", **DATA_DEFAULTS[data])
    for key, value in defaults.items():
        if cfg.get(key) is None:
            cfg[key] = value
    if "steps" in given:
        cfg["epochs"] = None
    if cfg["mode"] in ("pipeline", "all"):  # elsewhere a pipeline flag stays set only when given (an error)
        for key, value in PIPELINE_DEFAULTS.items():
            cfg.setdefault(key, value)
    for key in ("steps", "hidden", "devices", "workers", "max_staleness", "max_grad_norm", "out", "trace",
                "checkpoint_every", "log_every", "stages", *PIPELINE_DEFAULTS):
        cfg.setdefault(key, None)
    cfg.pop("resume", None)
    cfg.pop("command", None)
    return cfg


def _given(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if v is not None and k not in ("command",)}


def resolve_devices(devices: str | None, workers: int | None) -> list[str]:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices is None:
        if gpus:
            n = workers or gpus
            return [f"cuda:{i % gpus}" for i in range(n)]
        return ["cpu"] * (workers or 2)
    entries = [d.strip() for d in devices.split(",") if d.strip()]
    if not entries:
        raise UsageError(f"--devices {devices!r} names no device (use e.g. cpu or cuda:0,cuda:1)")
    if entries == ["cuda"]:
        if not gpus:
            raise UsageError("--devices cuda: no CUDA device is usable here (use --devices cpu)")
        entries = [f"cuda:{i}" for i in range(gpus)]
        if workers:
            return [entries[i % gpus] for i in range(workers)]
        return entries
    if entries == ["cpu"] and not workers:
        entries = ["cpu"] * 2  # the engine's CPU default
    elif len(entries) == 1 and workers:
        entries = entries * workers
    elif workers and workers != len(entries):
        raise UsageError(f"--workers {workers} does not match the {len(entries)} devices of --devices {devices}")
    from .workers import parse_devices

    try:
        parse_devices(entries)
    except ValueError as exc:
        raise UsageError(f"--{exc}") from None
    return entries


def check_config(cfg: dict, train_size: int | None = None) -> None:
    """Impossible combinations; raises :class:`UsageError` with one line."""
    mode = cfg["mode"]
    async_only = mode == "async"
    if cfg["accumulate"] > 1 and not async_only:
        raise UsageError(f"--accumulate is an async option (a worker sums mini-batches before one push); "
                         f"--mode {mode} updates once per batch: drop --accumulate or use --mode async")
    # in --mode all, the async run's (as --microbatches is the pipeline run's)
    if cfg["max_staleness"] is not None and mode not in ("async", "all"):
        raise UsageError(f"--max-staleness is an async option; --mode {mode} has no stale gradients")
    if cfg["staleness_lr"] != "none" and mode not in ("async", "all"):
        raise UsageError(f"--staleness-lr is an async option; --mode {mode} has no stale gradients")
    expected = {"digits": "mlp", "tokens": "transformer"}[cfg["data"]]
    if cfg["model"] != expected:
        raise UsageError(f"--model {cfg['model']} does not fit --data {cfg['data']} (use --model {expected})")
    from .models import TRANSFORMER_HEADS as heads
    if cfg["model"] == "transformer" and cfg["hidden"] % heads:
        raise UsageError(f"--hidden {cfg['hidden']}: the transformer's d_model must be a multiple of its {heads} "
                         f"attention heads (e.g. --hidden {max(heads, cfg['hidden'] // heads * heads)})")
    from .optim import AdamW
    try:  # the update's own float32 check, at step 1 (lr / (1 - beta1^step) is largest; schedules scale lr by <= 1)
        AdamW(lr=cfg["lr"], weight_decay=cfg["weight_decay"]).check_update(1)
    except ValueError as error:
        raise UsageError(f"--lr {cfg['lr']} with --weight-decay {cfg['weight_decay']}: {error}") from None
    workers = len(cfg["devices"])
    if train_size is not None:
        if workers > train_size:
            raise UsageError(f"{workers} workers but only {train_size} training samples: every worker needs at "
                             "least one sample")
        if cfg["batch_size"] > train_size:
            raise UsageError(f"--batch-size {cfg['batch_size']} is larger than the {train_size} training samples "
                             f"of --data {cfg['data']}")
        per_epoch = train_size // cfg["batch_size"]
        if (mode in ("async", "all") and cfg["steps"] is None and cfg["epochs"] is not None
                and cfg["accumulate"] > cfg["epochs"] * per_epoch):  # one push of them all: many more epochs
            raise UsageError(f"--accumulate {cfg['accumulate']} batches a push is more than the "
                             f"{cfg['epochs'] * per_epoch} batches of --epochs {cfg['epochs']} (--batch-size "
                             f"{cfg['batch_size']}): not one push fits")
        steps = {m: target_steps(cfg, m, per_epoch) for m in (MODES if mode == "all" else (mode,))}
        # cosine only: with a constant lr a run that ends while warming up is valid (a first part, resumed later
        # with more --steps)
        if cfg["lr_schedule"] == "cosine" and cfg["warmup_steps"] > min(steps.values()):
            raise UsageError(f"--warmup-steps {cfg['warmup_steps']} is longer than the run's "
                             f"{min(steps.values())} updates: the cosine decay would have no steps left")
    if mode in ("hybrid", "all") and cfg["batch_size"] < workers:
        raise UsageError(f"hybrid splits each batch across the workers: --batch-size {cfg['batch_size']} cannot "
                         f"feed {workers} workers (use --batch-size >= {workers} or fewer --workers)")
    _check_pipeline_config(cfg, pipeline_workers(cfg))


def target_steps(cfg: dict, mode: str, per_epoch: int) -> int:
    """The updates (async: pushes) a run of ``mode`` trains for: ``--steps``, else ``--epochs`` of ``per_epoch``
    batches (async: each push takes ``--accumulate`` of them)."""
    per_update = cfg["accumulate"] if mode == "async" else 1
    return cfg["steps"] if cfg["steps"] is not None else max(1, cfg["epochs"] * per_epoch // per_update)


def lr_schedule(cfg: dict, target: int):
    """``--lr-schedule`` and ``--warmup-steps`` as the engine's ``lr_schedule`` (None: a constant lr). A resumed run
    with another ``--steps`` re-aims the cosine at its new last update."""
    from .optim import WarmupCosine

    if cfg["lr_schedule"] == "constant" and not cfg["warmup_steps"]:
        return None
    return WarmupCosine(warmup_steps=cfg["warmup_steps"],
                        total_steps=target if cfg["lr_schedule"] == "cosine" else None)


def pipeline_workers(cfg: dict) -> int:
    """The workers a pipeline's stages x replicas are laid over: the processes under torchrun (each runs one stage on
    its one device: Note [Training under torchrun]), else the devices."""
    world = _launched()[1]
    return world if world > 1 else len(cfg["devices"])


def _foreign_options(mode: str, given: list[str]) -> str | None:
    """Why ``--mode mode`` takes none of the pipeline options ``given`` (keys of cfg), or None when it takes them:
    a new run's refusal and a resume's say the same."""
    if mode in ("pipeline", "all"):
        return None
    if mode in ("hybrid", "sync"):  # gradient accumulation within a step
        given = [key for key in given if key != "microbatches"]
    elif given == ["microbatches"]:
        return ("--microbatches: an option of the hybrid, sync and pipeline steps; async workers sum mini-batches "
                "before a push with --accumulate")
    if not given:
        return None
    flags = ", ".join("--" + key for key in given)
    return f"{flags}: pipeline option{'s' if len(given) > 1 else ''}; --mode {mode} has no stages (use --mode pipeline)"


def _check_pipeline_config(cfg: dict, workers: int) -> None:
    given = [key for key in ("stages", *PIPELINE_DEFAULTS) if cfg.get(key) is not None]
    if cfg["mode"] in ("hybrid", "sync") and "microbatches" in given:  # gradient accumulation within a step
        given.remove("microbatches")
        # hybrid: the batch is split over the processes, then over each one's devices (``workers`` counts the
        # processes under torchrun: a pipeline's)
        parts = len(cfg["devices"]) * _launched()[1] if cfg["mode"] == "hybrid" else 1
        if cfg["batch_size"] // parts < cfg["microbatches"]:
            raise UsageError(f"--microbatches {cfg['microbatches']}: --batch-size {cfg['batch_size']} leaves a "
                             f"worker fewer samples than micro-batches (use --batch-size >= "
                             f"{parts * cfg['microbatches']})")
    foreign = _foreign_options(cfg["mode"], given)
    if foreign is not None:
        raise UsageError(foreign)
    if cfg["mode"] not in ("pipeline", "all"):
        return
    stages = cfg["stages"] or workers
    if workers % stages:
        if _launched()[1] > 1:  # each process is one stage's worker (--workers 1): the process count is the fix
            raise UsageError(f"--stages {stages} does not divide the {workers} processes: a pipeline under torchrun "
                             f"runs stages x replicas processes, one stage each (launch "
                             f"{stages * max(1, workers // stages)} processes, or use --stages that divides "
                             f"{workers})")
        raise UsageError(f"--stages {stages} does not divide the {workers} workers: a pipeline needs stages x "
                         f"replicas workers (use --workers {stages * max(1, workers // stages)} or --stages that "
                         f"divides {workers})")
    replicas = workers // stages
    if cfg["batch_size"] // replicas < cfg["microbatches"]:
        raise UsageError(f"--batch-size {cfg['batch_size']} over {replicas} pipeline replica(s) cannot feed "
                         f"--microbatches {cfg['microbatches']} (use --batch-size >= "
                         f"{cfg['microbatches'] * replicas})")
    across = _launched()[1] > 1  # stages in separate processes (Note [Training under torchrun])
    if across and cfg["balance"] == "time":
        raise UsageError("--balance time: stages in separate processes are split before the first step, when no "
                         "layer has been timed; use --balance params or a list of layers per stage")
    if across and any(n % cfg["microbatches"] for n in _split_sizes(cfg["batch_size"], replicas)):
        # across processes, torch.distributed.pipelining needs equal micro-batches
        unit = replicas * cfg["microbatches"]
        raise UsageError(f"--batch-size {cfg['batch_size']} over {replicas} replica(s) does not split into "
                         f"--microbatches {cfg['microbatches']} equal micro-batches per replica, which stages in "
                         f"separate processes need (use a multiple of {unit})")
    if across and cfg["schedule"] == "1f1b" and cfg["microbatches"] < stages:
        raise UsageError(f"--schedule 1f1b with stages in separate processes needs --microbatches >= the {stages} "
                         f"stages; got {cfg['microbatches']} (or use --schedule gpipe)")


def _split_sizes(n: int, parts: int) -> list[int]:
    """The sizes ``torch.tensor_split`` cuts ``n`` samples into (the first ``n % parts`` one longer)."""
    base, extra = divmod(n, parts)
    return [base + (k < extra) for k in range(parts)]


def check_pipeline_layers(cfg: dict, model_layers) -> None:
    """The model must have at least one layer per stage (``model_layers``: :func:`pyengine.models.as_layers`'s
    ``(name, layer)`` pairs), and across processes a trainable parameter in each stage."""
    layers = len(model_layers)
    stages = cfg["stages"] or pipeline_workers(cfg)
    if cfg["mode"] in ("pipeline", "all") and stages > layers:
        raise UsageError(f"--stages {stages} is more than the {layers} layers of --model {cfg['model']} (each stage "
                         f"needs at least one; use --stages <= {layers})")
    sizes = cfg["balance"]
    if cfg["mode"] in ("pipeline", "all") and isinstance(sizes, list):
        given = ",".join(map(str, sizes))
        if len(sizes) != stages or min(sizes) < 1 or sum(sizes) != layers:
            raise UsageError(f"--balance {given}: expected {stages} layer counts (one per stage), each >= 1, summing "
                             f"to the {layers} layers of --model {cfg['model']}")
    if cfg["mode"] == "pipeline" and _launched()[1] > 1 and stages <= layers and sizes != "time":  # time: refused
        # across processes a stage without trainable parameters is refused (pipeline_distributed): said before any
        # work, as one line (it was "training failed" on every rank after the set-up)
        from .engine import distributed_pipeline
        from .pipeline import _param_costs

        sizes = distributed_pipeline()._stage_sizes(model_layers, stages, sizes)  # the split the processes will make
        costs = _param_costs([layer for _, layer in model_layers])
        bounds = [sum(sizes[:s]) for s in range(stages + 1)]
        empty = [s for s in range(stages) if not sum(costs[bounds[s]:bounds[s + 1]])]
        if empty:
            with_params = sum(c > 0 for c in costs)
            raise UsageError(f"--stages {stages} across processes: stage {empty[0]} of {sizes} layers gets no "
                             f"trainable parameter, and each stage across processes needs one (--model "
                             f"{cfg['model']} has {with_params} layers with parameters of its {layers}; use "
                             f"--stages <= {with_params}"
                             f"{' or another --balance' if isinstance(cfg['balance'], list) else ''})")


def _check_writable(directory: Path, what: str) -> list[Path]:
    """Creates ``directory`` and checks that a file can be written there. Returns the folders it created, deepest
    first, for :func:`_remove_empty` should a later check fail; a failed check leaves none behind."""
    created = []
    for folder in (directory, *directory.parents):
        if folder.exists():
            if not folder.is_dir():
                raise UsageError(f"cannot write to {what} {directory}: {folder} is a file, not a folder")
            break
        created.append(folder)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        _remove_empty(created)
        raise UsageError(f"cannot write to {what} {directory}: {exc.strerror or exc}") from None
    return created


def _remove_empty(folders: list[Path]) -> None:
    """Removes ``folders`` (deepest first) that are still empty: what :func:`_check_writable` created."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _default_out(mode: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path("runs") / f"{stamp}-{mode}"
    n = 1
    while out.exists():
        n += 1
        out = Path("runs") / f"{stamp}-{mode}-{n}"
    return out


def _agreed_out(out: Path, rank: int) -> Path:
    """Rank 0's run directory on every rank (a default one is named after the time, which may differ by rank)."""
    import torch.distributed as dist

    from . import distributed

    return Path(distributed.broadcast_object(str(out) if rank == 0 else None, dist.group.WORLD))


_RUN_PLOTS = ("loss.png", "compare.png")  # what a run writes in its folder beside the files _holds_run looks for


def _holds_run(directory: Path, depth: int = 1) -> bool:
    """Whether ``directory`` holds a pyengine train run: its result files or checkpoints, a --mode all run's
    config.json, or a mode's folder that holds one. A config.json of anything else, or a folder that only shares a
    mode's name, is not a run (it was taken for one, and --resume, as the refusal advised, then failed too)."""
    if not directory.is_dir():
        return False
    if any((directory / name).exists() for name in ("summary.json", "metrics.jsonl", "checkpoints")):
        return True
    if _is_all_config(directory / ALL_CONFIG):
        return True
    return depth > 0 and any(_holds_run(directory / mode, depth - 1) for mode in MODES)


def _is_runs_checkpoints(directory: Path) -> bool:
    """Whether ``directory`` is a run's checkpoints/ folder (holding a checkpoint, or beside the run's metrics or
    summary): a new run there mixed its files with the run's checkpoints, and ``--resume <run>/checkpoints``, a
    form that names the run, then resumed the new run instead (its checkpoints/ inside)."""
    from . import checkpoint as ckpt

    if directory.name != "checkpoints":
        return False
    if directory.is_dir() and ckpt.latest(directory) is not None:
        return True
    return any((directory.parent / name).is_file() for name in ("summary.json", "metrics.jsonl"))


def _is_all_config(file: Path) -> bool:
    """``file`` is a --mode all run's config.json (kind pyengine.train, mode all)."""
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("kind") == "pyengine.train" and config.get("mode") == "all"


def _saved_nothing(directory: Path) -> bool:
    """A run directory with no checkpoint to resume: one stopped (killed) before its first save."""
    from . import checkpoint as ckpt

    if _is_all_config(directory / ALL_CONFIG) or any(_holds_run(directory / m, 0) for m in MODES):
        return False  # a --mode all run: resumable as a whole
    return ckpt.latest(directory / "checkpoints") is None  # none there, or no checkpoints/ at all


def _saved_trace(trace, root: Path) -> dict:
    """The settings a checkpoint (or a --mode all run's config.json) keeps of the trace a run writes.

    Note [Where a resumed run writes its trace]
    A resume writes its trace where the run did: ``trace`` is kept absolute (a resume from another working
    directory writes it there too), with ``trace_anchor``, the run directory it was written in. A resume in that
    same directory writes the same file. A run directory that was moved, or a checkpoint copied into a new one (to
    continue a set-aside branch, say), is not that run: a trace inside the old directory moves with it (the same
    place relative to the run), and one outside it is not written (it would write over the other run's), unless
    --trace names one; a line says so. Checkpoints without ``trace_anchor`` resume as before it."""
    if trace is None:
        return dict(trace=None)
    return dict(trace=os.path.abspath(trace), trace_anchor=os.path.abspath(root))


def _resumed_trace(base: dict, out: Path, given: dict) -> str | None:
    """The trace a resume of the run in ``out`` writes, from its saved settings ``base`` (which lose
    ``trace_anchor``): Note [Where a resumed run writes its trace]."""
    trace, anchor = base.get("trace"), base.pop("trace_anchor", None)
    if trace is None or anchor is None or "trace" in given:
        return trace
    here = os.path.abspath(out)
    if anchor == here:
        return trace
    if Path(trace).is_relative_to(anchor):  # inside the run's old directory: it moved with the run
        return os.path.join(here, os.path.relpath(trace, anchor))
    if _launched()[0] == 0:
        print(f"pyengine train: note: the checkpoint's run, in {anchor}, wrote its trace to {trace}, outside it; "
              "this resume is in another directory and writes no trace (give --trace to write one)",
              file=sys.stderr, flush=True)
    return None


def _trace_path(trace: str | None, mode: str, all_modes: bool) -> Path | None:
    if trace is None:
        return None
    path = Path(trace)
    return path.with_name(f"{path.stem}-{mode}{path.suffix}") if all_modes else path


# ---- progress ---------------------------------------------------------------------------------------------------

class Progress:
    """tqdm bar on a terminal, plain lines otherwise, nothing with --quiet. Thread-safe (async callbacks)."""

    def __init__(self, mode: str, total: int, initial: int, quiet: bool, log_every: int | None):
        self.mode, self.total, self.quiet = mode, total, quiet
        self.tty = sys.stdout.isatty()
        self.log_every = log_every or max(1, (total - initial) // 20)
        self.window = collections.deque(maxlen=50)  # (elapsed, samples) for a windowed samples/s
        self.samples = 0
        self.lock = threading.Lock()
        self.bar = None
        if not quiet and self.tty:
            from tqdm import tqdm

            try:
                sized = os.get_terminal_size(sys.stdout.fileno()).columns > 0
            except OSError:
                sized = False
            self.bar = tqdm(total=total, initial=initial, desc=mode, unit="step", dynamic_ncols=sized,
                            ncols=None if sized else 120, nrows=None if sized else 40, file=sys.stdout,
                            mininterval=0.2)

    def rate(self, rec: dict | None = None) -> float:
        """samples/s over the window; with one step in it (the first after a start or a resume), that step's own
        (``rec``'s samples / wall: 0 was shown)."""
        if len(self.window) < 2:
            return float((rec or {}).get("samples_per_s") or 0.0)
        (t0, s0), (t1, s1) = self.window[0], self.window[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0

    def update(self, rec: dict) -> None:
        if self.quiet:
            return
        with self.lock:
            self.samples += rec["samples"]
            self.window.append((rec["elapsed_s"], self.samples))
            fields = {"loss": _loss_text(rec["loss"]), "samples/s": f"{self.rate(rec):,.0f}"}
            if "staleness" in rec:
                fields["staleness"] = rec["staleness"]
            if "bubble_fraction" in rec:
                fields["bubble"] = f"{rec['bubble_fraction']:.2f}"
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix(fields, refresh=False)
            elif rec["step"] % self.log_every == 0 or rec["step"] == self.total:
                extra = "".join(f"  {k} {v}" for k, v in fields.items() if k in ("staleness", "bubble"))
                print(f"[{self.mode}] step {rec['step']}/{self.total}  loss {_loss_text(rec['loss'])}  "
                      f"samples/s {fields['samples/s']}{extra}  ({rec['elapsed_s']:.1f} s)", flush=True)

    def write(self, message: str, force: bool = False) -> None:
        if self.quiet and not force:
            return
        if self.bar is not None:
            self.bar.write(message, file=sys.stdout)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


# ---- one run ----------------------------------------------------------------------------------------------------

class _StopFlag:
    """First Ctrl-C: stop after the current step and checkpoint. Second: abort at once (KeyboardInterrupt)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\ninterrupted: stopping after this step and saving a checkpoint (Ctrl-C again to abort)",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


def _loss_text(loss) -> str:
    """A loss for the progress line: a non-finite loss is stored as None (JSON has no NaN)."""
    return "nan" if loss is None else f"{loss:.4f}"


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _write_json(path: Path, obj) -> None:
    _write_lines(path, [json.dumps(_json_safe(obj), indent=2) + "\n"])


def _write_lines(path: Path, lines: list[str]) -> None:
    """Replaces ``path`` atomically (:func:`pyengine.files.replace_file`): a crash leaves the old file or the new
    one."""
    def write(tmp: Path) -> None:
        with open(tmp, "w") as f:
            f.writelines(lines)

    replace_file(path, write)


def _saved_config(cfg: dict) -> dict:
    """The run's settings as a checkpoint or config.json keeps them (:data:`NOT_SAVED` left out), JSON-safe."""
    return _json_safe({k: v for k, v in cfg.items() if k not in NOT_SAVED})


def _drop_all_results(out: Path) -> None:
    """One mode of a --mode all run (``out``, its folder) resumed alone, its state loaded: the run's summary.json
    and compare.png no longer describe that mode, so they are removed, with a word on stderr."""
    stale = [name for name in ("summary.json", "compare.png") if (out.parent / name).exists()]
    for name in stale:
        (out.parent / name).unlink()
    if stale:
        print(f"pyengine train: note: {out.parent} is a --mode all run whose {' and '.join(stale)} described "
              f"{out.name} before this resume: removed (a resume of the whole run, --resume {out.parent} with the "
              "--steps its modes reached, writes them again)", file=sys.stderr, flush=True)


def _set_aside_later(out: Path, step: int, trace: Path | None = None) -> Path | None:
    """Resuming from a checkpoint older than the run's newest forks the run: the checkpoints after ``step``, the
    metrics lines after it and the summary, plot and trace of its end belong to the abandoned continuation. They
    are moved, not deleted, into ``out/superseded-<time>/``, so that a later ``--resume out`` continues this run
    (not the abandoned one) and nothing is lost (the trace its summary names, when it lies in ``out`` or is the file
    ``trace`` this resume writes, which wrote over it; the moved summary then names its new place). Returns that
    folder, or None when no checkpoint comes after ``step``: resuming from the newest one (after a crash, say) forks
    nothing, and the metrics lines of steps after it are redone, bit for bit."""
    from . import checkpoint as ckpt

    later = [p for p in ckpt.list_checkpoints(out / "checkpoints") if ckpt.step_of(p) > step]
    if not later:  # the newest checkpoint: no fork; steps logged after it (a crash) are simply run again
        return None
    metrics_path = out / "metrics.jsonl"
    dropped = _split_metrics(metrics_path, upto=step)[2]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = out / f"superseded-{stamp}"
    n = 1
    while aside.exists():
        n += 1
        aside = out / f"superseded-{stamp}-{n}"
    aside.mkdir()
    with open(aside / "metrics.jsonl", "wb") as f:
        f.writelines(dropped)
    for path in later:
        path.rename(aside / path.name)
    for name in ("summary.json", *_RUN_PLOTS):  # the abandoned continuation's result, if it ended
        if (out / name).exists():
            (out / name).rename(aside / name)
    _set_aside_trace(aside, out, trace)
    return aside


def _set_aside_trace(aside: Path, out: Path, trace: Path | None) -> None:
    """The trace that the summary set aside in ``aside`` names, moved there too when it lies in ``out`` or is the
    file ``trace`` (this run's, which would write over it); the summary then names its new place."""
    try:
        summary = json.loads((aside / "summary.json").read_text())
        written = Path(os.path.abspath(summary["trace"]))
    except (OSError, ValueError, KeyError, TypeError):  # no summary (the continuation never ended), no trace
        return
    here = Path(os.path.abspath(out))
    if not written.is_file() or not (here in written.parents or (trace is not None
                                                                 and written == Path(os.path.abspath(trace)))):
        return
    moved = aside / written.name
    try:
        shutil.move(written, moved)  # another file system than the run's (--trace on /dev/shm): copied, then removed
    except OSError as exc:
        print(f"pyengine train: warning: the set-aside continuation's trace {written} could not be moved to "
              f"{aside} ({type(exc).__name__}: {exc}); this run writes its own trace over it", file=sys.stderr,
              flush=True)
        return
    summary["trace"] = str(moved)
    _write_json(aside / "summary.json", summary)


def _read_metrics(path: Path, upto: int | None = None) -> list[dict]:
    """The records of ``path`` (metrics.jsonl) up to step ``upto`` (:func:`_split_metrics`)."""
    return _split_metrics(path, upto)[0]


def _split_metrics(path: Path, upto: int | None = None) -> tuple[list[dict], list[int], list[bytes]]:
    """``path`` (metrics.jsonl) read up to the first record past step ``upto``: (the records before it, the line
    numbers (1-based) among them that are no record, the lines from it on). A line that is no record (cut by a
    crash, not UTF-8, not a JSON object with an int ``step``: a resume stopped there with a traceback, an
    AttributeError or a TypeError, as "training failed"; then it stopped reading there, and a resume wrote the file
    back without the records after it, which the steps it redid did not give back) is left out, and the records
    after it are read on."""
    records, unreadable, rest = [], [], []
    if path.exists():
        lines = path.read_bytes().splitlines(keepends=True)
        for number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode().strip()
                rec = json.loads(line) if line else None
            except (UnicodeDecodeError, json.JSONDecodeError):
                rec = False
            if rec is None:
                continue
            step = rec.get("step") if isinstance(rec, dict) else None
            if isinstance(step, bool) or not isinstance(step, int):
                unreadable.append(number)
                continue
            if upto is not None and step > upto:
                rest = lines[number - 1:]
                break
            records.append(rec)
    return records, unreadable, rest


def _launched() -> tuple[int, int]:
    """(rank, world size) of a torchrun launch (RANK, WORLD_SIZE), else (0, 1)."""
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise UsageError(f"RANK={os.environ.get('RANK')!r} and WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} must "
                         "be integers (set by torchrun)") from None
    if not 0 <= rank < world:  # RANK=1 left in the environment: a lone process took itself for rank 1 and wrote
        raise UsageError(f"RANK={rank} is not a rank of WORLD_SIZE={world}"  # nothing, printed nothing
                         f"{' (unset)' if 'WORLD_SIZE' not in os.environ else ''}: unset RANK for one process, or "
                         "launch with torchrun, which sets both")
    return rank, world


def _rank_shard(batch, rank: int, world: int):
    """Rank ``rank``'s contiguous part of a global batch ``(x, y)`` (the sizes of ``torch.tensor_split``): the ranks'
    engines exchange their sample counts, so the step equals one step on the whole batch (Note [Training under
    torchrun])."""
    import torch

    return tuple(torch.tensor_split(t, world)[rank] for t in batch)


def _unfit(cfg: dict, mode: str, resume: dict, exc: Exception) -> str:
    """Why Engine.load_state_dict refused the checkpoint, naming the devices when the resume moved the run."""
    saved = _saved_devices(resume.get("config", {}), _launched()[0]) or list(cfg["devices"])
    if saved == list(cfg["devices"]):
        return f"checkpoint does not fit this run: {exc}"
    return (f"--devices/--workers: the {mode} run's checkpoint (trained on {','.join(saved)}) cannot continue on "
            f"{','.join(cfg['devices'])}: {exc}; resume on its devices (leave out --devices/--workers)")


def train_one(cfg: dict, mode: str, out: Path, stop: _StopFlag, dataset, resume: dict | None = None) -> dict:
    """Trains one schedule into ``out``; returns its summary (``interrupted`` set when Ctrl-C stopped it).

    Note [Training under torchrun]
    Launched by torchrun with WORLD_SIZE > 1, every rank runs this with the same configuration: ``_train`` has
    joined the default process group (gloo), so the Engine is a multi-node engine over it. Each step every rank
    draws the same global batch of ``--batch-size`` samples. Hybrid: each rank trains on its own contiguous part of
    it (:func:`_rank_shard`); the engines weight the ranks' gradients by their sample counts, so the run equals a
    single-process run on the same batches. Pipeline: the processes are the pipeline's workers, one device each
    (stages x replicas = WORLD_SIZE, rank s * R + r runs stage s of replica r), and every rank is given the whole
    batch (:mod:`pyengine.pipeline_distributed`); the run equals the in-process pipeline with as many workers. Rank 0
    alone writes the run directory (metrics, checkpoints, summary, plots) and prints. Every rank holds the same
    master weights after ``state_dict()`` (for a pipeline a collective, which every rank calls before rank 0 saves),
    so rank 0's checkpoint resumes all of them.
    """
    import torch

    from . import checkpoint as ckpt
    from . import models, plots
    from .engine import Engine
    from .optim import AdamW

    started = time.perf_counter()
    rank, world = _launched()
    primary = rank == 0  # Note [Training under torchrun]
    if primary:
        out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out / "checkpoints"
    devices = cfg["devices"]
    batch_size, seed = cfg["batch_size"], cfg["seed"]
    per_epoch = dataset.steps_per_epoch(batch_size)
    per_update = cfg["accumulate"] if mode == "async" else 1
    target = target_steps(cfg, mode, per_epoch)
    every = cfg["checkpoint_every"] or max(1, per_epoch // per_update)

    model = models.build(cfg["model"], dataset, seed, cfg["hidden"])
    autocast = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg["autocast"]]
    optimizer = AdamW(lr=cfg["lr"], weight_decay=cfg["weight_decay"], max_grad_norm=cfg["max_grad_norm"])
    pin = False if all(d == "cpu" for d in devices) else "auto"
    pipeline = mode == "pipeline"
    options = dict(stages=cfg.get("stages") or pipeline_workers(cfg), microbatches=cfg["microbatches"],
                   schedule=cfg["schedule"], balance=cfg["balance"]) if pipeline else {}
    # hybrid and sync: --microbatches of their own run (in --mode all the flag is the pipeline run's)
    own_microbatches = None if mode not in ("hybrid", "sync") else (
        cfg["microbatches"] or 1) if cfg["mode"] != "all" else 1
    if own_microbatches is not None:
        options["microbatches"] = own_microbatches
    engine = Engine(models.as_layers(model) if pipeline else model, models.loss_fn, devices=devices, mode=mode,
                    optimizer=optimizer, seed=seed, autocast=autocast, lr_schedule=lr_schedule(cfg, target),
                    loss_scale=None if cfg["loss_scale"] == "none" else cfg["loss_scale"],
                    accumulate=cfg["accumulate"] if mode == "async" else 1,
                    max_staleness=cfg["max_staleness"] if mode == "async" else None,
                    staleness_lr=cfg["staleness_lr"] if mode == "async" else "none", pin=pin,
                    keep_history=0,  # every step's metrics go to metrics.jsonl (on_step): none held in memory
                    **options)
    metrics_path = out / "metrics.jsonl"
    try:
        if resume is not None and primary:  # files it reads and replaces: a folder in the place of one failed late
            odd = [p for p in (metrics_path, out / "summary.json", *(out / n for n in _RUN_PLOTS))
                   if p.exists() and not p.is_file()]
            if odd:
                raise UsageError(f"cannot resume {out}: {odd[0]} is not a file (a folder in its place?); move it "
                                 "away and resume again")
        start_step, batches_done, elapsed_offset, applied_beyond = 0, 0, 0.0, set()
        if resume is not None:
            try:
                engine.load_state_dict(resume["engine"])
            except (ValueError, KeyError, TypeError) as exc:
                raise UsageError(_unfit(cfg, mode, resume, exc)) from None
            start_step, batches_done = int(resume["step"]), int(resume["batches_done"])
            applied_beyond = set(resume.get("batches_beyond", ()))  # absent before async runs recorded them
            elapsed_offset = float(resume["elapsed_s"])
        if resume is not None and primary:
            aside = _set_aside_later(out, start_step, _trace_path(cfg["trace"], mode, cfg["mode"] == "all"))
            if aside is not None:
                print(f"[{mode}] resuming at step {start_step}, before the run's newest checkpoint: the later "
                      f"checkpoints and metrics were moved to {aside}", file=sys.stderr, flush=True)
        kept, unreadable, _ = _split_metrics(metrics_path, upto=start_step) if resume is not None else ([], [], [])
        if unreadable and primary:
            print(f"[{mode}] {metrics_path}: line{'s' if len(unreadable) > 1 else ''} "
                  f"{', '.join(map(str, unreadable[:10]))}{' ...' if len(unreadable) > 10 else ''} before step "
                  f"{start_step} {'are' if len(unreadable) > 1 else 'is'} no record (cut or damaged): left out, the "
                  "records around them kept", file=sys.stderr, flush=True)
        if resume is not None and primary:  # the end of the run it continues: written again at this one's end
            for name in ("summary.json", *_RUN_PLOTS):
                (out / name).unlink(missing_ok=True)
            if cfg["mode"] != "all" and out.name in MODES and _is_all_config(out.parent / ALL_CONFIG):
                _drop_all_results(out)
        # the samples trained before this run: the checkpoint counts them (its run directory's metrics.jsonl may be
        # another's, or lack lines: a checkpoint copied into a new directory has none); older checkpoints did not
        samples_before = (resume.get("samples_done", sum(r.get("samples", 0) for r in kept)) if resume is not None
                          else 0)
        try:
            if primary:  # a resumed run redoes the steps after its checkpoint; a crash keeps the old file whole
                _write_lines(metrics_path, [json.dumps(r) + "\n" for r in kept])
            metrics_file = open(metrics_path, "a") if primary else open(os.devnull, "w")
        except OSError as exc:  # a full disk, a folder in its place: the run's files named, and how to go on
            resumed = ckpt.path_for(ckpt_dir, start_step)
            raise TrainingFailed(start_step, resumed if resume is not None and resumed.exists() else None,
                                 True) from OSError(f"{metrics_path} could not be written before the first step "
                                                    f"(nothing was trained): {exc}")
        records = list(kept)
        progress = Progress(mode, target, start_step, cfg["quiet"] or not primary, cfg["log_every"])
        if resume is not None:
            progress.write(f"[{mode}] resuming {out} at step {start_step} of {target}")
        # Note [Which batches an async checkpoint holds]
        # Async workers take the batches in order, but their pushes land in any order: after n pushes the weights
        # may hold batches 1..n and not batch 0, still in flight. So a checkpoint records the first batch not yet
        # applied ("batches_done") and the batches after it that were ("batches_beyond"); a resume streams from the
        # former and leaves the latter out. Every batch is applied once (resuming at a count applied batch 1 twice
        # and never batch 0). Hybrid, sync and pipeline take batch ``step`` at each step: beyond stays empty.
        state = dict(step=start_step, batches=batches_done, applied_beyond=set(applied_beyond), taken=[],
                     samples=samples_before, last_ckpt=None, t0=time.perf_counter(),
                     agreed_ckpt=ckpt.path_for(ckpt_dir, start_step) if resume is not None else None)

        def elapsed() -> float:
            return elapsed_offset + time.perf_counter() - state["t0"]

        # a --mode all sub-run saves the trace path it writes (t-<mode>.json): Note [Where a resumed run writes
        # its trace]
        own_trace = _saved_trace(_trace_path(cfg["trace"], mode, cfg["mode"] == "all"), out)

        def save_checkpoint(prune: bool = True) -> Path:
            """Saves this step (rank 0; the others only note rank 0's path) and, with ``prune``, keeps the newest
            ``--keep``. Under torchrun the periodic saves prune only after the stop agreement that follows them
            passed (on_step): a rank whose agreement fails names the checkpoint it last agreed on, which must then
            still be there."""
            engine_state = engine.state_dict() if primary or pipeline else None  # a collective in a pipeline
            if not primary:  # rank 0 holds the same state (Note [Training under torchrun])
                state["last_ckpt"] = ckpt.path_for(ckpt_dir, state["step"])  # rank 0's, once the next agreement passed
                return state["last_ckpt"]
            # a --mode all sub-run saves its own options only: the async ones are its async run's
            own_async = {} if mode == "async" else {"max_staleness": None, "staleness_lr": "none"}
            config = _saved_config(dict(cfg, mode=mode, out=str(out), **own_trace, **own_async,
                                        **({} if pipeline else {"microbatches": own_microbatches})))
            payload = dict(kind="pyengine.train", step=state["step"], batches_done=state["batches"],
                           batches_beyond=sorted(state["applied_beyond"]), elapsed_s=elapsed(),
                           samples_done=state["samples"], mode=mode, config=config, engine=engine_state)
            began = time.perf_counter()
            state["last_ckpt"] = ckpt.save(ckpt_dir, state["step"], payload, keep=cfg["keep"] if prune else None)
            state["save_s"] = time.perf_counter() - began
            return state["last_ckpt"]

        def failed_run_checkpoint() -> tuple[Path | None, bool, str | None, Path | None]:
            """Note [A failed run keeps its last step]
            A step whose worker raises (its forward, loss or backward; a failed transfer) is never half applied: the
            engine's host store still holds the last complete update (its buffers too: Note [A failed step leaves
            the buffers alone]), and ``state`` counts exactly the steps (async: the pushes) done. That state is
            saved as a checkpoint like any other, so the steps since the last periodic checkpoint are not lost and
            ``--resume`` continues from it (bit-identical when the failure does not recur: tested). Under torchrun
            nothing is saved (``state_dict`` may be a collective and another rank may be the one that died): the last
            periodic checkpoint is named instead.
            Saved only when the engine's own count agrees with ``state`` (a failure after an update was applied but
            before ``on_step`` counted it would otherwise save that update under the step before)."""
            this_step = ckpt.path_for(ckpt_dir, state["step"])
            if primary and this_step.exists():  # saved already: a periodic checkpoint, or the one resumed from (a
                return this_step, True, None, None  # resume sets later ones aside, so what is there is this run's)
            not_saved = None
            if world == 1 and state["step"] > start_step:
                counted = engine.stats()["pushes" if mode == "async" else "steps"]
                if counted != state["step"]:
                    not_saved = f"the engine counts {counted} steps there (the last periodic checkpoint stands)"
                else:
                    try:
                        return save_checkpoint(), True, None, None
                    except Exception as exc:  # noqa: BLE001 - reported after the training error, which stays first
                        not_saved = f"{type(exc).__name__}: {exc}"
                    except KeyboardInterrupt:
                        not_saved = "interrupted"
            # another rank: the last checkpoint that rank 0 had written when the ranks last agreed (stop_agreed
            # follows each save, so a rank past it knows rank 0's save returned; rank 0 prunes only after it), and
            # the one rank 0 was writing when the agreement that follows it failed
            if primary:
                return ckpt.latest(ckpt_dir), False, not_saved, None
            pending = state["last_ckpt"] if state["last_ckpt"] != state["agreed_ckpt"] else None
            return state["agreed_ckpt"], False, not_saved, pending

        def on_step(_engine, metrics: dict) -> None:
            """After every update (async: under the store's mutex, so the state is consistent)."""
            state["step"] += 1
            rec = {"mode": mode, **metrics, "step": state["step"], "elapsed_s": elapsed()}
            if mode == "async":  # Note [Which batches an async checkpoint holds]
                rec["batches"] = [state["taken"][i] for i in metrics["batches"]]  # fit's ordinals -> the data's steps
                state["applied_beyond"].update(rec["batches"])
                while state["batches"] in state["applied_beyond"]:
                    state["applied_beyond"].remove(state["batches"])
                    state["batches"] += 1
            else:
                state["batches"] += 1
            state["samples"] += rec["samples"]
            rec.pop("time", None)
            rec = _json_safe(rec)
            records.append(rec)
            metrics_file.write(json.dumps(rec) + "\n")
            metrics_file.flush()
            progress.update(rec)
            saving = state["step"] % every == 0 and state["step"] < target
            if saving:
                save_checkpoint(prune=world == 1)
            stopping = stop_agreed(saving)
            if saving and primary and world > 1:  # every rank now knows this save returned (save_checkpoint)
                ckpt.prune(ckpt_dir, cfg["keep"])
            if state["last_ckpt"] is not None:
                state["agreed_ckpt"] = state["last_ckpt"]
            if stopping:
                raise Interrupted

        def stop_agreed(saved: bool) -> bool:
            """Whether to stop after this step. Note [Stopping together under torchrun]: a SIGINT may reach some ranks
            and not others, or reach them between their checks (sent by a scheduler to the processes, not through
            torchrun's agent). Ranks that decided apart would run different collectives next (one the final
            checkpoint's, another the next step's) and hang until the group's timeout, with no final checkpoint.
            So the ranks agree after every step: one MAX all-reduce of their flags. Async runs decide per push on
            the rank that applies it (their protocol stops every rank), so they keep the local flag."""
            if world == 1 or mode == "async":
                return stop.requested
            import torch.distributed as dist

            from .distributed import _collective

            flag = state.setdefault("stop_flag", torch.zeros(1))  # one tensor for every agreement
            flag.fill_(1.0 if stop.requested else 0.0)
            late = None
            if saved and not primary:  # this rank cannot tell a slow write from a dead rank 0
                late = (f"rank 0 wrote the checkpoint of step {state['step']} before it: a write longer than the "
                        f"group's timeout ({DIST_TIMEOUT_ENV}, default 60 s) ends the run here; else a peer rank "
                        "died, raised or timed out")
            elif saved and state["save_s"] >= _dist_timeout():
                late = (f"this rank's write of the checkpoint of step {state['step']} took {state['save_s']:.1f} s, "
                        f"longer than the group's timeout ({DIST_TIMEOUT_ENV}={_dist_timeout():g} s): the other ranks "
                        "stopped waiting (set it above the time a checkpoint takes to write)")
            with _collective(f"the agreement after step {state['step']} whether to stop", rank,
                             lambda: engine.recorded_failure() or late):  # a peer's recorded error comes first
                # its work kept: Note [Gloo's works are released by the thread that waits] (the last agreement
                # is the run's last collective, just before the exit)
                engine.collective_works.run(dist.all_reduce, flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                stop.requested = True  # the summary then says "interrupted" on every rank
            return flag.item() > 0

        interrupted = False
        train_start = time.perf_counter()
        try:
            if mode == "async":
                if state["step"] < target:  # on_step's Interrupted leaves fit as itself (a callback's error)
                    stream = dataset.stream(batches_done, batch_size, seed, skip=frozenset(applied_beyond),
                                            indices=state["taken"])
                    engine.fit(stream, steps=target - state["step"], callbacks=[on_step])
            else:
                for step in range(start_step, target):
                    batch = dataset.batch(step, batch_size, seed)
                    shard = world > 1 and not pipeline  # a pipeline's ranks all take the whole batch
                    on_step(engine, engine.step(_rank_shard(batch, rank, world) if shard else batch))
        except Interrupted:
            interrupted = True
        except Exception as exc:
            if isinstance(exc, UsageError):
                raise
            engine.record_failure(exc)  # under torchrun: the peers' errors name this rank (its data, say)
            progress.close()
            metrics_file.close()
            raise TrainingFailed(state["step"], *failed_run_checkpoint()) from exc
        train_s = time.perf_counter() - train_start
        progress.close()
        metrics_file.close()
        # Under torchrun the ranks stop on their agreement (Interrupted above): a SIGINT that reached one rank after
        # the last one is left to the next mode's first agreement (or to none), or that rank alone would call its
        # run interrupted and leave while the others go on
        if stop.requested and (world == 1 or mode == "async"):
            interrupted = True
        try:
            path = save_checkpoint()
        except Exception as exc:  # the run's last step (or a Ctrl-C's) unsaved: name the newest checkpoint there is
            engine.record_failure(exc)
            raise TrainingFailed(state["step"], *failed_run_checkpoint()) from exc
        trace = _trace_path(cfg["trace"], mode, cfg["mode"] == "all") if primary else None
        if cfg["trace"] is not None and not primary:
            print(f"note: --trace is written by rank 0 only; rank {_launched()[0]} writes none", file=sys.stderr)
        if trace is not None and len(records) == len(kept) and os.path.exists(trace):
            pass  # a resume of a run already done trained nothing: no span to write, the run's trace stays
        elif trace is not None:
            try:
                engine.trace(trace)
            except OSError as exc:  # a diagnostic: the run and its checkpoint stand (and the old trace, if any)
                print(f"pyengine train: warning: the trace could not be written to {trace} ({type(exc).__name__}: "
                      f"{exc}); the run is saved in {path}", file=sys.stderr)
                trace = None

        final_model = models.build(cfg["model"], dataset, seed, cfg["hidden"])
        engine.copy_to(models.as_layers(final_model) if pipeline else final_model)
        evaluation = models.evaluate(final_model, dataset.x_test, dataset.y_test)
        stats = engine.stats()
    finally:
        engine.close()

    # the phases' means are this invocation's; a resume of a run already done (no step) gives the run's, over all
    # its records (not None over the numbers the run had)
    measured = records[len(kept):] or records
    samples = state["samples"]
    train_total = records[-1]["elapsed_s"] if records else 0.0
    tail = [r["loss"] for r in records[-10:] if r["loss"] is not None]
    # a run whose last step's loss is not finite (None in the records) ended diverged: its final loss is not the
    # last finite one before (that made a diverged mode the best of --mode all)
    diverged = bool(records) and records[-1]["loss"] is None

    def mean(key):
        values = [r[key] for r in measured if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    summary = dict(
        mode=mode, devices=list(devices), workers=len(devices), processes=world,
        **({"rank_devices": cfg["rank_devices"]} if world > 1 else {}), steps=state["step"],
        target_steps=target,
        samples=samples, samples_per_s=samples / train_total if train_total > 0 else 0.0,
        final_loss=sum(tail) / len(tail) if tail and not diverged else None,
        final_loss_window=0 if diverged else len(tail), diverged=diverged,
        test_accuracy=evaluation["test_accuracy"], test_loss=evaluation["test_loss"],
        wall_s=time.perf_counter() - started, train_s=train_total, this_run_train_s=train_s,
        data=cfg["data"], model=cfg["model"], params=sum(p.numel() for p in model.parameters()),
        batch_size=batch_size, lr=cfg["lr"], lr_schedule=cfg["lr_schedule"], warmup_steps=cfg["warmup_steps"],
        seed=seed, epochs=cfg["epochs"], autocast=cfg["autocast"], loss_scale=cfg["loss_scale"],
        dataset=dataset.info, checkpoint=os.path.abspath(path),
        resumed_from_step=start_step if resume is not None else None,
        interrupted=interrupted, trace=os.path.abspath(trace) if trace is not None else None,
        phases_mean_s={k: mean(k) for k in ("wall_s", "compute_s", "transfer_wait_s", "update_s", "copy_back_s")},
        overlap_efficiency_mean=mean("overlap_efficiency"), engine_stats=stats)
    if own_microbatches is not None:
        summary["microbatches"] = own_microbatches
    if pipeline:
        summary.update(options, stage_sizes=records[-1]["stage_sizes"] if records else None,
                       bubble_fraction_mean=mean("bubble_fraction"),
                       bubble_ideal=records[-1]["bubble_ideal"] if records else None)
    if not primary:
        return summary
    _write_json(out / "summary.json", summary)
    if records:
        plots.plot_loss(records, out / "loss.png", f"pyengine {mode}: {cfg['model']} on {cfg['data']}, "
                        f"{_plural(len(devices), 'worker')} ({', '.join(sorted(set(devices)))})")
    return summary


def _read_checkpoint(file: Path) -> dict:
    """The payload of a ``pyengine train`` checkpoint file (:class:`CheckpointError` when it is not one)."""
    from . import checkpoint as ckpt

    payload = ckpt.load(file)
    missing = {"kind", "step", "batches_done", "elapsed_s", "mode", "config", "engine"} - set(payload)
    if payload.get("kind") != "pyengine.train" or missing:
        raise ckpt.CheckpointError(f"{file} is a pyengine checkpoint but not of a `pyengine train` run "
                                   f"(missing {sorted(missing)})")

    def refuse(what: str, value) -> None:
        raise ckpt.CheckpointError(f"{file} is not a usable `pyengine train` checkpoint: {what}; got {value!r}")

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    step, done = payload["step"], payload["batches_done"]
    if not count(step):
        refuse("its step must be an int >= 0", step)
    try:
        named = ckpt.step_of(file)
    except ValueError:  # another name: a copy, say
        named = step
    if named != step:
        refuse(f"its name says step {named}, its contents another", step)
    if not count(done):
        refuse("its batches_done must be an int >= 0", done)
    beyond = payload.get("batches_beyond", [])
    if (not isinstance(beyond, list) or not all(count(b) and b > done for b in beyond)
            or len(set(beyond)) != len(beyond)):
        refuse(f"its batches_beyond must be distinct ints > its batches_done ({done})", beyond)
    if not (isinstance(payload["elapsed_s"], (int, float)) and math.isfinite(payload["elapsed_s"])
            and payload["elapsed_s"] >= 0):
        refuse("its elapsed_s must be a number of seconds >= 0", payload["elapsed_s"])
    if "samples_done" in payload and not count(payload["samples_done"]):  # absent before checkpoints counted them
        refuse("its samples_done must be an int >= 0", payload["samples_done"])
    config = payload["config"]
    if not isinstance(config, dict):
        refuse("its config must be a dict", type(config).__name__)
    lacking = sorted(_required_config() - set(config))
    if lacking:
        refuse(f"its config lacks {lacking}", sorted(config))
    if payload["mode"] not in MODES or config["mode"] != payload["mode"]:
        refuse(f"its mode and its config's must be one of {MODES}, the same", (payload["mode"], config["mode"]))
    error = _saved_setting_error(_saved_run_config(config))
    if error is not None:
        raise ckpt.CheckpointError(f"{file} is not a usable `pyengine train` checkpoint: {error}")
    return payload


def _load_resume(target: str) -> tuple[dict, Path]:
    from . import checkpoint as ckpt

    path = Path(target)
    if not path.exists():
        raise UsageError(f"--resume {target}: no such file or directory")
    if path.is_dir():
        if (path / "summary.json").exists() and not (path / "checkpoints").exists() and any(
                (path / m).is_dir() for m in MODES):
            raise UsageError(f"--resume {target} is a --mode all directory without its {ALL_CONFIG} (written "
                             f"before --mode all runs could resume as a whole); resume one mode's directory, "
                             f"e.g. {path / 'hybrid'}")
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        file = ckpt.latest(folder)
        if file is None:
            why = (f": the run there saved none (it ended before its first checkpoint), so there is nothing to "
                   f"continue; start a new run (remove {path}, or choose another --out)" if _holds_run(path)
                   else f": the folder is empty (a run stopped before it wrote anything?): start a new run with "
                   f"--out {path}" if not any(path.iterdir())
                   else ": --resume takes the directory of a pyengine train run or one of its checkpoint files")
            raise UsageError(f"--resume {target}: no checkpoint (step-*.pyeckpt) in {folder}{why}")
    else:
        file = path
    file = Path(os.path.abspath(file))  # its folders name the run (a bare file name has none)
    payload = _read_checkpoint(file)
    if file.parent.name.startswith("superseded-"):
        raise ckpt.CheckpointError(f"{file} belongs to a continuation that a resume set aside (in "
                                   f"{file.parent.name}/); resume from the run's checkpoints/ instead, or copy it "
                                   "into a new run directory's checkpoints/ to continue that branch")
    run_dir = file.parent.parent if file.parent.name == "checkpoints" else file.parent
    return payload, run_dir


def _saved_setting_error(config: dict) -> str | None:
    """What in a saved run configuration no ``train`` command line could have given (a checkpoint or config.json
    edited, or written by something else): None, or one line naming the setting, what it must be and its value.
    Each setting is read back through its own flag's parser (its type's checks and its choices): a value that
    does not come back as itself is refused. Settings that every run has may not be None."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    always = {k for k, v in _resolve({}).items() if v is not None} - {"epochs"}  # epochs: None when --steps given
    for action in commands.choices["train"]._actions:
        key = action.dest
        if key not in config or key in ("help", "resume", "out", "trace", "devices") or (
                action.type is None and action.choices is None):
            continue
        value = config[key]
        if value is None:
            if key in always:
                return f"its {key} must be set; got None"
            continue
        if action.choices is not None:
            if value not in action.choices or not isinstance(value, str):
                return f"its {key} must be one of {', '.join(action.choices)}; got {value!r}"
            continue
        text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        try:
            back = action.type(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            return f"its {key} is not a value of --{key.replace('_', '-')} ({exc}); got {value!r}"
        if type(back) is not type(value) or back != value:
            return f"its {key} is not a value of --{key.replace('_', '-')}; got {value!r}"
    if config.get("steps") is None and config.get("epochs") is None:
        return "its steps or its epochs must be set; got None for both"
    for key in ("trace", "trace_anchor"):  # paths, as --trace takes them (trace_anchor: the run directory it was in)
        if config.get(key) is not None and not (isinstance(config[key], str) and config[key]):
            return f"its {key} must be a path or null; got {config[key]!r}"

    def names(devices) -> bool:
        return isinstance(devices, list) and bool(devices) and all(isinstance(d, str) for d in devices)

    devices = config.get("devices")
    if not names(devices):
        return f"its devices must be a non-empty list of device names; got {devices!r}"
    by_rank = config.get("rank_devices")  # Note [Each rank's devices in the checkpoint]
    if by_rank is not None and not (isinstance(by_rank, list) and len(by_rank) > 1 and all(map(names, by_rank))
                                    and by_rank[0] == devices):
        return (f"its rank_devices must be a list of every rank's devices (a non-empty list of device names each, "
                f"rank 0's its devices); got {by_rank!r}")
    return None


def _all_config(path: Path) -> dict | None:
    """The configuration of the --mode all run in ``path`` (its config.json), or None when ``path`` is not one (a
    config.json that is no run's beside a one-mode run's checkpoints/ is that folder's own file)."""
    file = path / ALL_CONFIG
    if not (path.is_dir() and file.is_file()):
        return None
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        if (path / "checkpoints").is_dir():
            return None
        raise UsageError(f"--resume {path}: cannot read {file}: {exc}") from None
    if not isinstance(config, dict) or config.get("kind") != "pyengine.train" or config.get("mode") != "all":
        if (path / "checkpoints").is_dir():  # one mode's run in a folder that held a config.json of its own
            return None
        raise UsageError(f"--resume {path}: {file} is not the configuration of a --mode all run (expected kind "
                         "pyengine.train and mode all)")
    missing = set(_resolve({"mode": "all"})) - set(NOT_SAVED) - set(config)
    if missing:
        raise UsageError(f"--resume {path}: {file} lacks the settings {sorted(missing)}")
    config.pop("kind")
    error = _saved_setting_error(config)
    if error is not None:
        raise UsageError(f"--resume {path}: {file} is not a usable configuration: {error}")
    return config


def _all_checkpoints(out: Path) -> dict:
    """The newest checkpoint payload of each mode of the --mode all run in ``out`` that has one."""
    from . import checkpoint as ckpt

    found = {}
    for mode in MODES:
        file = ckpt.latest(out / mode / "checkpoints")
        if file is not None:
            found[mode] = _read_checkpoint(file)
    return found


def _required_config() -> set:
    """The settings a checkpoint's config holds: every flag of ``train`` but those not saved and those that
    :func:`_saved_run_config` gives a default (flags added after the first checkpoints were written)."""
    flags = set(vars(build_parser().parse_args(["train"])))
    return flags - {"command", "resume", *NOT_SAVED, "lr_schedule", "warmup_steps", "loss_scale", "stages",
                    *PIPELINE_DEFAULTS}


def _saved_run_config(config: dict) -> dict:
    """A checkpoint's run configuration, with the settings of flags added since it was written."""
    base = dict(config)
    legacy = "lr_schedule" not in config  # saved before hybrid/sync had --microbatches
    base.setdefault("lr_schedule", "constant")  # saved before these flags existed: the constant lr it had
    base.setdefault("warmup_steps", 0)
    base.setdefault("loss_scale", "none")  # saved before --loss-scale: it trained unscaled
    if base.get("mode") != "pipeline":  # a --mode all sub-run saved the pipeline defaults too: not given flags
        for key in ("stages", *PIPELINE_DEFAULTS):
            if key != "microbatches" or legacy:  # a hybrid/sync run saved the micro-batches it used
                base[key] = None
    return base


def _resumed(given: dict) -> tuple[dict, Path, dict]:
    """``--resume``: the run's configuration with the flags given now, its directory, and the checkpoint payload of
    each mode to continue ({mode: payload}; a --mode all run's modes without a checkpoint start afresh)."""
    from . import checkpoint as ckpt

    if "out" in given:
        raise UsageError("--resume continues in the run's own directory; leave out --out")
    base = _all_config(Path(given["resume"]))
    try:
        if base is not None:
            out = Path(given["resume"])
            resumes = _all_checkpoints(out)
        else:
            payload, out = _load_resume(given["resume"])
            base = _saved_run_config(payload["config"])
            resumes = {base["mode"]: payload}
    except ckpt.CheckpointError as exc:
        raise UsageError(f"cannot resume: {exc}") from None
    base = dict(base)
    base["trace"] = _resumed_trace(base, out, given)
    cfg = _apply_resume_flags(base, given)
    cfg["out"] = str(out)
    return cfg, out, resumes


def _apply_resume_flags(base: dict, given: dict) -> dict:
    cfg = dict(base)
    for key in NOT_SAVED:  # an old checkpoint saved --quiet: a resume is quiet only when asked
        cfg[key] = False
    cfg["devices"] = _resume_devices(cfg, given)
    cfg["workers"] = len(cfg["devices"])
    for key, value in given.items():
        if key in ("resume", "devices", "workers"):
            continue
        if key in RESUME_OVERRIDABLE:
            cfg[key] = value
            if key == "steps":
                cfg["epochs"] = None
            if key == "epochs":
                cfg["steps"] = None
        elif key in ("stages", *PIPELINE_DEFAULTS) and _foreign_options(cfg["mode"], [key]) is not None:
            raise UsageError(_foreign_options(cfg["mode"], [key]))  # as a new run refuses it (--stages was skipped
            # when it equalled the workers; the others said "differs from the resumed run's None")
        elif key == "stages" and cfg.get(key) is None and value == pipeline_workers(cfg):
            continue  # saved as None: a stage per worker, the number given
        elif cfg.get(key) != value:
            saved = (f"None (a stage per worker: {pipeline_workers(cfg)})" if key == "stages" and cfg.get(key) is None
                     else repr(cfg[key]))
            raise UsageError(f"--{key.replace('_', '-')} {value} differs from the resumed run's "
                             f"{saved}; a resumed run keeps its settings (only "
                             f"{', '.join('--' + k.replace('_', '-') for k in sorted(RESUME_OVERRIDABLE))} "
                             f"may change, and --devices/--workers for --mode {'/'.join(DEVICES_MOVABLE)})")
    return cfg


def _resume_devices(cfg: dict, given: dict) -> list[str]:
    """The devices a resumed run trains on: the checkpoint's, or (hybrid, sync, async) those of --devices/--workers
    (--workers alone: the checkpoint's devices, cycled). Checked to exist here, before any work."""
    from .workers import parse_devices

    saved, mode = _saved_devices(cfg, _launched()[0]), cfg["mode"]
    cfg.pop("rank_devices", None)  # this run's own: gathered again under torchrun (_train), none in one process
    devices = saved
    if "devices" in given:
        devices = resolve_devices(given["devices"], given.get("workers"))
    elif "workers" in given:
        distinct = list(dict.fromkeys(saved))
        devices = [distinct[i % len(distinct)] for i in range(given["workers"])]
    if devices != saved and mode not in DEVICES_MOVABLE:
        stages = "its pipeline stages are" if mode == "pipeline" else "the stages of its pipeline run are"
        raise UsageError(f"--devices/--workers: a resumed --mode {mode} run keeps the devices it trained on "
                         f"({','.join(saved)}: {stages} laid over them); got {','.join(devices)} "
                         f"(only {', '.join(DEVICES_MOVABLE)} runs may change devices on resume)")
    try:
        parse_devices(devices)
    except ValueError as exc:
        how = ("continue it on others with --devices/--workers" if mode in DEVICES_MOVABLE else
               f"a {mode} run resumes on the devices it trained on")
        raise UsageError(f"the resumed run's {exc} (it trained on {','.join(saved)}; {how})") from None
    return devices


def _saved_devices(config: dict, rank: int) -> list[str] | None:
    """The devices rank ``rank`` trained on in the run ``config`` saved: its own entry of the checkpoint's
    ``rank_devices`` (Note [Each rank's devices in the checkpoint]), else the saved ``devices`` (rank 0's; a
    checkpoint written before every rank's were saved, or a resume with more processes than the saved run had)."""
    by_rank = config.get("rank_devices")
    if isinstance(by_rank, list) and rank < len(by_rank):
        return list(by_rank[rank])
    devices = config.get("devices")
    return list(devices) if devices else None


def _check_resume_steps(cfg: dict, resumes: dict, per_epoch: int) -> None:
    """A resume trains forward: a run that ends before its checkpoint's step would do nothing but rewrite it."""
    for mode, payload in resumes.items():
        target, step = target_steps(cfg, mode, per_epoch), int(payload["step"])
        if step > target:
            length = f"--steps {cfg['steps']}" if cfg["steps"] is not None else \
                f"--epochs {cfg['epochs']} ({target} updates)"
            which = f" ({mode})" if cfg["mode"] == "all" else ""
            raise UsageError(f"{length} ends before the checkpoint's step {step}{which}: a resume continues "
                             f"forward (give --steps >= {step}, or resume an older checkpoint file to branch "
                             "from it)")


def _finished_before(cfg: dict, mode: str, run_dir: Path, payload: dict | None, per_epoch: int) -> dict | None:
    """The summary of a --mode all run's mode that a resume need not train again (its checkpoint is at the run's
    last step and its summary.json says it finished there), else None."""
    if payload is None or int(payload["step"]) != target_steps(cfg, mode, per_epoch):
        return None
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    done = isinstance(summary, dict) and summary.get("interrupted") is False and \
        summary.get("steps") == payload["step"]
    return summary if done else None


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}{'es' if noun.endswith('s') else 's'}"


def _summarise(summary: dict) -> str:
    acc, loss = summary["test_accuracy"], summary["final_loss"]
    workers = _plural(summary["workers"], "worker")
    where = workers if summary.get("processes", 1) == 1 else f"{_plural(summary['processes'], 'process')} x {workers}"
    skipped = (summary.get("engine_stats") or {}).get("skipped_steps") or 0  # a run of skipped steps read as trained
    steps = _plural(summary["steps"], "step") + (f" ({skipped} skipped: non-finite gradients)" if skipped else "")
    return (f"[{summary['mode']}] {steps} on {where}: "
            f"{summary['samples_per_s']:,.0f} samples/s, final loss "
            f"{'nan (diverged)' if summary.get('diverged') else 'n/a' if loss is None else format(loss, '.4g')}, "
            f"test accuracy {acc:.2%} ({summary['wall_s']:.1f} s)")


def _all_summary(cfg: dict, summaries: dict) -> dict:
    """The top summary.json of --mode all: the keys of every run's summary over the modes (dicts keyed by mode where
    they differ), the best mode by each measure, and each mode's own summary under ``runs``."""
    def by_mode(key):
        return {m: s.get(key) for m, s in summaries.items()}

    rates, losses, accuracy = by_mode("samples_per_s"), by_mode("final_loss"), by_mode("test_accuracy")
    finite = {m: v for m, v in losses.items() if v is not None}
    return dict(
        mode="all", devices=cfg["devices"], workers=len(cfg["devices"]),
        steps=max(s["steps"] for s in summaries.values()),  # the same for every mode (no --accumulate in all)
        samples_per_s=rates, final_loss=losses, test_accuracy=accuracy,
        wall_s=sum(s["wall_s"] for s in summaries.values()),  # the modes' wall_s, summed
        best=dict(samples_per_s=max(rates, key=rates.get), test_accuracy=max(accuracy, key=accuracy.get),
                  final_loss=min(finite, key=finite.get) if finite else None),
        data=cfg["data"], model=cfg["model"], seed=cfg["seed"], interrupted=False, runs=summaries)


# ---- entry point ------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    prog = PROG
    try:
        parser = build_parser()
        args = parser.parse_args(argv)  # argparse errors exit 2 with usage
        if args.command == "plan":
            prog = "pyengine plan"
            return _plan(args)
        return _train(_given(args))
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # before _StopFlag's handler is installed (or after it is gone): nothing to save
        # Note [Ctrl-C while the data's libraries import]
        # The digits come from scikit-learn, whose first import (scipy, numpy's submodules) takes a second or two. A
        # KeyboardInterrupt raised inside it can leave a module half imported, and what surfaces is another error
        # (a RecursionError in numpy's __getattr__, seen): so the data is loaded with the first Ctrl-C deferred
        # (workers.deferred_interrupt), which then arrives here as a KeyboardInterrupt. A second one gets out at once.
        message = "interrupted before training started; nothing to save" if prog == PROG else "interrupted"
        print(f"{prog}: {message}", file=sys.stderr, flush=True)
        return 130
    finally:
        if "torch.distributed" in sys.modules:  # joined under torchrun (Note [Training under torchrun])
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()


DIST_TIMEOUT_ENV = "PYENGINE_DIST_TIMEOUT_S"


def _dist_timeout() -> float:
    """The process group's timeout under torchrun: how long a collective waits for a silent peer, and so also how
    long the other ranks wait while rank 0 writes a checkpoint (the stop agreement follows each write).
    ``PYENGINE_DIST_TIMEOUT_S`` (seconds) sets it; default 60."""
    text = os.environ.get(DIST_TIMEOUT_ENV, "60")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value <= _DIST_TIMEOUT_MAX_S):
        raise UsageError(f"{DIST_TIMEOUT_ENV}={text!r}: expected a number of seconds > 0 and at most "
                         f"{_DIST_TIMEOUT_MAX_S} (a week)")
    return value


_DIST_TIMEOUT_MAX_S = 7 * 24 * 3600  # distributed.MAX_TIMEOUT_S (read before torch is imported)


def _train(given: dict) -> int:
    rank, world = _launched()
    if world > 1:  # Note [Training under torchrun]: joined first, so that every check's failure reaches every rank
        import torch.distributed as dist

        from . import distributed

        if not dist.is_initialized():
            try:
                distributed.init_process_group("gloo", timeout_s=_dist_timeout())
            except ValueError as exc:  # the environment lacks torchrun's variables
                raise UsageError(f"WORLD_SIZE={world}: {exc}") from None
            except (RuntimeError, OSError) as exc:  # no rendezvous (DistStoreError, a refused or timed-out connect)
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise UsageError(f"WORLD_SIZE={world}: could not join the process group at "
                                 f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} within "
                                 f"{DIST_TIMEOUT_ENV}'s {_dist_timeout():g} s: {type(exc).__name__}: {first}") from None
    cfg, out, resumes, dataset = _on_every_rank(world, lambda: _checked(given, world), _compared)
    if world > 1:
        cfg["rank_devices"] = _every_rank_devices(cfg["devices"])
    if world > 1 and out is None:  # a new run's folder is rank 0's (a default one is named after the time)
        out = _agreed_out(Path(cfg["out"]) if cfg["out"] else _default_out(cfg["mode"]), rank)
    out = _on_every_rank(world, lambda: _prepare_out(cfg, out, rank, resumed="resume" in given))
    if cfg["mode"] == "all" and rank == 0:  # before any mode trains: --resume <out> continues it as a whole
        _write_json(out / ALL_CONFIG, dict(kind="pyengine.train",
                                           **_saved_config(dict(cfg, **_saved_trace(cfg["trace"], out)))))
    warnings.filterwarnings("ignore", message=r".*pin='auto'.*")
    return _train_modes(cfg, out, dataset, resumes, rank)


def _on_every_rank(world: int, check, compared=None):
    """``check()``'s result. Under torchrun (``world`` > 1) every rank learns whether every other rank's check
    passed: a rank whose check raises tells the others, which then raise one UsageError naming it, so no rank is
    left waiting in its next collective until the group's timeout. ``compared(result)``: what every rank's result
    must hold alike (Note [Every rank's engine alike], for the whole command line)."""
    if world == 1:
        return check()
    import torch.distributed as dist

    from . import distributed

    try:
        result = check()
    except Exception as exc:
        distributed.report_failed_config(dist.group.WORLD, exc)
        raise
    try:
        distributed.check_same_config(dist.group.WORLD, compared(result) if compared is not None else {},
                                      "command lines differ (only --devices, --workers, --quiet, --log-every, "
                                      "--trace, --out and a hybrid run's --microbatches may)",
                                      failed="failed its checks of the command line")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return result


# Settings that may differ between the processes of one run under torchrun: each process's own devices and output
# (and a hybrid run's micro-batches: _compared).
_PER_RANK = ("devices", "workers", "quiet", "log_every", "trace", "out", "rank_devices")


def _every_rank_devices(devices: list[str]) -> list[list[str]]:
    """Note [Each rank's devices in the checkpoint]
    Under torchrun each rank trains on its own ``--devices``/``--workers``, and rank 0 alone writes the checkpoints.
    So that a resume gives every rank back its own devices (not rank 0's: a pipeline stage would be refused or land
    on rank 0's GPU, a hybrid rank would lose its other workers), every rank's devices are gathered once, after the
    command lines were checked, and saved in the run's config as ``rank_devices`` (rank r's at index r; ``devices``
    stays rank 0's). A resume takes its own entry (:func:`_saved_devices`), which ``--devices``/``--workers`` given
    again still override as in one process; a resume in one process takes rank 0's and saves none."""
    import torch.distributed as dist

    from . import distributed

    return distributed.all_gather_object(list(devices), dist.group.WORLD)


def _compared(checked) -> dict:
    """What every rank's run must hold alike under torchrun: the resolved settings (a flag given at its default
    equals the flag left out), and the state a resumed run continues from."""
    cfg, _, resumes, dataset = checked
    # a hybrid run's micro-batches are a memory setting of the local workers: the same step (the Engine's check too)
    per_rank = _PER_RANK + (("microbatches",) if cfg["mode"] == "hybrid" else ())
    compared = {k: v for k, v in cfg.items() if k not in per_rank}
    per_epoch = dataset.steps_per_epoch(cfg["batch_size"])  # under torchrun: hybrid or pipeline, a batch an update
    compared["checkpoint_every"] = cfg["checkpoint_every"] or per_epoch
    compared["steps"] = target_steps(cfg, cfg["mode"], per_epoch)  # --steps or --epochs: the updates they give
    compared.pop("epochs")
    if cfg["mode"] == "pipeline":
        compared["stages"] = cfg["stages"] or pipeline_workers(cfg)
    compared["resumed at (step, batches, seconds)"] = {
        m: (p["step"], p["batches_done"], p["elapsed_s"]) for m, p in resumes.items()}
    return compared


def _checked(given: dict, world: int) -> tuple:
    """This rank's settings, checked: ``(cfg, out, resumes, dataset)``; ``out`` None for a new run."""
    if "resume" in given:
        cfg, out, resumes = _resumed(given)
    else:
        cfg, out, resumes = _resolve(given), None, {}
        cfg["devices"] = resolve_devices(cfg["devices"], cfg["workers"])
        cfg["workers"] = len(cfg["devices"])
    if world > 1:  # Note [Training under torchrun]; before check_config, whose pipeline checks count processes
        if cfg["mode"] not in ("hybrid", "pipeline"):
            raise UsageError(f"under torchrun (WORLD_SIZE={world}) the command line trains --mode hybrid or pipeline "
                             f"across the processes; got --mode {cfg['mode']} (async across processes: the Python "
                             "API, Engine(..., process_group=...))")
        if cfg["mode"] == "pipeline" and len(cfg["devices"]) != 1:
            raise UsageError(f"--mode pipeline under torchrun: each process runs one stage on one device; got "
                             f"{len(cfg['devices'])} devices ({','.join(cfg['devices'])}): pass --workers 1")
    check_config(cfg)
    if world > 1 and cfg["mode"] == "hybrid" and cfg["batch_size"] < world * len(cfg["devices"]):
        raise UsageError(f"--batch-size {cfg['batch_size']} gives fewer than one sample to each of the {world} "
                         f"processes x {len(cfg['devices'])} workers")
    from . import data as data_mod
    from .workers import deferred_interrupt

    # the data is fixed (split_seed); --seed orders the batches. A Ctrl-C waits for the load: Note [Ctrl-C while
    # the data's libraries import]
    with deferred_interrupt("loading the data"):
        dataset = data_mod.load(cfg["data"])
    check_config(cfg, dataset.train_size)
    if cfg["mode"] in ("pipeline", "all"):
        from . import models

        import torch

        with torch.device("meta"):  # the layers counted, no memory taken: a --hidden too large to allocate fails
            layers = models.as_layers(models.build(cfg["model"], dataset, cfg["seed"], cfg["hidden"]))
        # later, as in hybrid mode, as one line (it was a traceback here)
        check_pipeline_layers(cfg, list(layers.named_children()))
    if dataset.steps_per_epoch(cfg["batch_size"]) < 1:
        raise UsageError(f"--batch-size {cfg['batch_size']} leaves no full batch in {dataset.train_size} samples")
    _check_resume_steps(cfg, resumes, dataset.steps_per_epoch(cfg["batch_size"]))
    return cfg, out, resumes, dataset


def _prepare_out(cfg: dict, out: Path | None, rank: int, resumed: bool = False) -> Path:
    """Checks --trace, then creates --out (``out`` None: a new run's from ``cfg``; ``resumed``: ``out`` is the
    resumed run's) and checks both are writable; a failed check leaves neither behind."""
    made = []
    if cfg["trace"] is not None and Path(cfg["trace"]).is_dir():
        raise UsageError(f"--trace {cfg['trace']} is a directory; give a file name (e.g. trace.json)")
    if not resumed:  # before the trace's folder is made: one inside --out would make it look like a run's
        out = out or (Path(cfg["out"]) if cfg["out"] else _default_out(cfg["mode"]))
        if rank == 0 and _holds_run(out):
            if _saved_nothing(out):
                raise UsageError(f"--out {out} holds a run that saved no checkpoint (it ended before its first): "
                                 "nothing to resume; remove it or choose another --out")
            raise UsageError(f"--out {out} already holds a run; continue it with --resume {out} or choose "
                             "another --out")
        if rank == 0 and _is_runs_checkpoints(out):  # a run inside it: `--resume <run>/checkpoints` resumed that one
            raise UsageError(f"--out {out} is the checkpoints folder of the run in {out.parent}; choose another "
                             "--out")
        if rank == 0:
            written = _RUN_PLOTS + ((ALL_CONFIG, *MODES) if cfg["mode"] == "all" else ())
            taken = [name for name in written if (out / name).exists()]
            if taken:  # not a run's folder, but one this run would write over (or into)
                raise UsageError(f"--out {out} holds {' and '.join(taken)}, which this run would write over; "
                                 "choose another --out (or move them)")
    if cfg["trace"] is not None:
        _check_trace_is_no_run_file(Path(cfg["trace"]), out, cfg["mode"])
        made = _check_writable(Path(cfg["trace"]).parent, "the --trace folder")
    try:
        if resumed:
            _check_writable(out, "the resumed run directory")
            return out
        _check_writable(out, "--out")
    except UsageError:
        _remove_empty(made)
        raise
    cfg["out"] = str(out)
    return out


def _check_trace_is_no_run_file(trace: Path, out: Path, mode: str) -> None:
    """A --trace that names one of the files the run in ``out`` writes (its metrics, summary, plots, a checkpoint;
    --mode all: each mode's too) was written over them, or they over it, and the run ended with exit code 0 (a
    final checkpoint overwritten by the trace: the next --resume refused it as no checkpoint). Refused."""
    from .checkpoint import _NAME

    def ckpt_named(path: Path) -> bool:  # a checkpoint's name in a checkpoints/ folder (other files are let be)
        return _NAME.fullmatch(path.name) is not None

    out = Path(os.path.abspath(out))
    every = mode == "all"
    traces = [Path(os.path.abspath(_trace_path(str(trace), m, every))) for m in (MODES if every else (mode,))]
    runs = [out] + ([out / m for m in MODES] if every else [])
    folders = set(runs) | {run / "checkpoints" for run in runs}  # made by the run (a trace there: no file at all)
    if any(t in folders for t in traces):
        raise UsageError(f"--trace {trace} names a folder the run in {out} makes (the run's own, or its "
                         "checkpoints/); give a file name (e.g. trace.json)")
    files = {run / name for run in runs for name in ("summary.json", "metrics.jsonl", ALL_CONFIG, *_RUN_PLOTS)}
    if any(t in files or (t.parent in {run / "checkpoints" for run in runs} and ckpt_named(t)) for t in traces):
        raise UsageError(f"--trace {trace} names a file the run in {out} writes (its metrics, summary, plots or "
                         "checkpoints); give another file name (e.g. trace.json)")
    for t in traces:  # another run's files: the trace replaced them (its newest checkpoint: that run lost its resume)
        other = t.parent.parent if t.parent.name == "checkpoints" else t.parent
        if (t.name in ("summary.json", "metrics.jsonl", *_RUN_PLOTS) and _holds_run(t.parent, 0)) or \
                (t.name == ALL_CONFIG and _is_all_config(t)) or \
                (ckpt_named(t) and _is_runs_checkpoints(t.parent)) or _is_checkpoint_file(t):
            raise UsageError(f"--trace {trace} names a file of the run in {other} (its metrics, summary, plots, "
                             "config or a checkpoint), which the trace would replace; give another file name (e.g. "
                             "trace.json)")


def _is_checkpoint_file(path: Path) -> bool:
    """Whether ``path`` is a file that starts as a pyengine checkpoint does (wherever it was copied)."""
    from .checkpoint import MAGIC

    try:
        if not path.is_file():  # not opened: a named pipe would block the open
            return False
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def _train_modes(cfg: dict, out: Path, dataset, resumes: dict, rank: int) -> int:
    """Trains the run's mode (each of them for --mode all, skipping those a resumed run finished before)."""
    from . import checkpoint as ckpt

    every = cfg["mode"] == "all"
    modes = MODES if every else (cfg["mode"],)
    per_epoch = dataset.steps_per_epoch(cfg["batch_size"])
    quiet = cfg["quiet"] or rank != 0
    if not quiet:
        what = f"{cfg['model']} on {cfg['data']} ({dataset.train_size} train / {dataset.x_test.shape[0]} test)"
        print(f"pyengine train: {', '.join(modes)} | {what} | workers: {', '.join(cfg['devices'])} | out: {out}",
              flush=True)
    summaries, runs = {}, {}
    if every and rank == 0:  # the run goes on: its old result files would describe a run that is no longer there
        for stale in ("summary.json", "compare.png"):
            (out / stale).unlink(missing_ok=True)
    with _StopFlag() as stop:
        try:
            for index, mode in enumerate(modes):
                run_dir = out / mode if every else out
                summary = _finished_before(cfg, mode, run_dir, resumes.get(mode), per_epoch) if every else None
                if summary is None:
                    try:
                        summary = train_one(cfg, mode, run_dir, stop, dataset, resumes.get(mode))
                    except ckpt.CheckpointError as exc:
                        raise UsageError(str(exc)) from None
                elif not quiet:
                    print(f"[{mode}] finished before this resume", flush=True)
                summaries[mode] = summary
                runs[mode] = (_read_metrics(run_dir / "metrics.jsonl"), summary)
                if summary["interrupted"]:
                    if rank == 0:  # the checkpoint is rank 0's to write (Note [Training under torchrun])
                        print(_stopped(summary, out, modes[index + 1:] if every else None), file=sys.stderr,
                              flush=True)
                    return _leave_together(130, rank)
                if not quiet:
                    print(_summarise(summary) + f" -> {run_dir}", flush=True)
        except KeyboardInterrupt:
            last = ckpt.latest(out / "checkpoints") if not every else None
            hint = (f"; resume with {_resume_command(out)} (the modes without a checkpoint start over)" if every
                    else f"; the last checkpoint is {last}: resume with {_resume_command(out)}" if last else "")
            print(f"aborted{hint}", file=sys.stderr, flush=True)
            return 130
        except Exception as exc:  # noqa: BLE001 - a failure while training: one line, the cause chained
            if isinstance(exc, UsageError):
                raise
            failed = exc if isinstance(exc, TrainingFailed) else None
            cause = failed.__cause__ if failed is not None else exc
            print(f"{PROG}: training failed: {type(cause).__name__}: {cause}", file=sys.stderr, flush=True)
            for line in failed.lines(out, every) if failed is not None else []:
                print(f"{PROG}: {line}", file=sys.stderr, flush=True)
            if os.environ.get("PYENGINE_TRACEBACK"):
                raise cause
            return 1
    if every:
        try:
            _finish_all(cfg, out, runs, summaries, quiet)
        except KeyboardInterrupt:
            print(f"aborted while writing compare.png and summary.json; every mode is trained and saved: finish "
                  f"with {_resume_command(out)}", file=sys.stderr, flush=True)
            return 130
    return _leave_together(0, rank)


def _leave_together(code: int, rank: int) -> int:
    """``code``, once every rank got here (under torchrun; else at once), or 1 when that wait failed (said in one line).

    Note [The ranks leave together]
    Rank 0 alone writes the run's last checkpoint, its summary and plots; the other ranks are done before it. torchrun
    takes a rank's exit with a code other than 0 (130 after a Ctrl-C) as a failed worker and stops the others with
    SIGTERM: rank 0, still writing, lost its final checkpoint and summary (seen with a 3 s write). So every rank
    waits here for the others, rank 0 once it has written everything, before leaving. A failed run (exit 1) does not
    wait: its group may be broken, and its last checkpoint is the periodic one."""
    if _launched()[1] == 1:
        return code
    import torch.distributed as dist

    from .distributed import DistributedError, _collective

    late = (f"rank 0 was writing the run's last checkpoint, summary and plots: a write longer than the group's timeout "
            f"({DIST_TIMEOUT_ENV}, default 60 s) ends the wait; else a peer rank died")
    try:
        with _collective("the end of the run (waiting for rank 0's last files)", rank, lambda: late):
            dist.barrier()
    except DistributedError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr, flush=True)
        return 1
    return code


def _stopped(summary: dict, out: Path, rest: tuple | None) -> str:
    """The Ctrl-C message: where the checkpoint is and the command that continues the run; for --mode all (``rest``:
    the modes after the stopped one) the whole run, in its top directory."""
    then = ""
    if rest is not None:
        steps = [f"continues {summary['mode']}", *([f"then trains {', '.join(rest)}"] if rest else []),
                 "then writes compare.png and summary.json"]
        then = f" ({', '.join(steps)})"
    return (f"stopped at step {summary['steps']}; checkpoint saved: {summary['checkpoint']}\n"
            f"resume with: {_resume_command(out)}{then}")


def _finish_all(cfg: dict, out: Path, runs: dict, summaries: dict, quiet: bool) -> None:
    from . import plots

    plots.plot_compare(runs, out / "compare.png",
                       f"pyengine: {cfg['model']} on {cfg['data']}, {_plural(len(cfg['devices']), 'worker')}, "
                       f"same data and seed")
    _write_json(out / "summary.json", _all_summary(cfg, summaries))
    if not quiet:
        print(f"comparison: {out / 'compare.png'}", flush=True)
