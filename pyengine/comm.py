"""Communication planner: the per-step gradient exchange time of data-parallel training, as an alpha-beta model.

A message of n bytes between two nodes costs ``alpha + n / B`` (alpha: latency, B: link bandwidth in bytes/s). Every
node has one full-duplex link; messages to different peers in the same round run concurrently (their latencies
overlap) but share the sender's and the receiver's link bandwidth. An algorithm is then two numbers, both linear in
the model's parameters:

    time = steps * alpha + link_bytes / B

``steps`` is the number of sequential message rounds on the critical path and ``link_bytes`` the bytes that cross
the busiest link, one direction at a time, along that path (a full-duplex round that sends and receives n bytes
costs n / B). For P nodes and N bytes of gradient per node (the closed forms of :func:`exchange_cost`):

=================  ===============================  =======================  =================================
algorithm          steps                            link_bytes               bytes sent by the busiest worker
=================  ===============================  =======================  =================================
ps (1 server)      2 (push, pull)                   2 P N (the server's)     N (its push)
ps (S shards)      2                                2 max(N, P N / S)        N (N / S to each shard)
tree (binomial)    2 ceil(log2 P) (reduce, bcast)   2 ceil(log2 P) N         ceil(log2 P) N (the root)
butterfly          log2 P (+2 if P is no power of   (steps) N                log2 P N (+N if P is no power of
                   two: fold in, fold out)                                   two: the fold-out; log2 P rounded
                                                                             down)
ring               2 (P - 1)                        2 (P - 1) / P N          2 (P - 1) / P N
=================  ===============================  =======================  =================================

So the ring's traffic per node does not grow with P (its latency term does), a single parameter server is a
bandwidth bottleneck (P N through one link), tree and butterfly pay log2 P full-size rounds. The model ignores
compute inside the reduction, congestion beyond one link per node, and overlap of communication with backward
(``overlap`` in :func:`plan` is the fraction hidden behind compute, 0 by default).

Calibration: :func:`fit_network` fits alpha and B by least squares on relative error from measured
``(algorithm, P, N, seconds)`` samples (bench/bench_comm.py measures gloo collectives between local processes with
:func:`time_collective`); :func:`model_errors` gives the model's relative error on measurements.
"""
from __future__ import annotations

import collections.abc
import math
import numbers
import os
import re
from dataclasses import dataclass

__all__ = ["ALGORITHMS", "Cost", "Network", "PlanRow", "exchange_cost", "plan", "format_plan", "best",
           "efficiency_curve", "parse_bandwidth", "parse_latency", "parse_count", "parse_dtype", "fit_network",
           "model_errors", "time_collective", "plot_efficiency", "plot_kinds", "check_plot_path"]

ALGORITHMS = ("ps", "ps-sharded", "tree", "butterfly", "ring")
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


@dataclass(frozen=True)
class Network:
    """Link model: ``alpha`` seconds per message, ``bandwidth`` bytes/s per link."""

    alpha: float
    bandwidth: float

    def __post_init__(self):
        _check_real(self.alpha, "Network: alpha (latency, s)")
        _check_real(self.bandwidth, "Network: bandwidth (bytes/s)")
        if not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"Network: alpha (latency, s) must be a finite number >= 0; got {self.alpha}")
        if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"Network: bandwidth (bytes/s) must be a finite number > 0; got {self.bandwidth}")


@dataclass(frozen=True)
class Cost:
    """One algorithm's exchange: ``steps`` rounds, ``link_bytes`` over the busiest link, ``node_bytes`` sent by the
    busiest worker, and ``time_s`` on a given network."""

    algorithm: str
    nodes: int
    steps: int
    link_bytes: float
    node_bytes: float
    time_s: float


def _check_real(value, what: str) -> None:
    """A TypeError naming ``what`` unless ``value`` is a real number (a bool is not one); a ValueError for an integer
    beyond a float's range (10**400: an OverflowError in the arithmetic)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number; got {type(value).__name__} {value!r}")
    try:
        float(value)
    except OverflowError:
        raise ValueError(f"{what} must be a finite number; got an integer of {len(str(value))} digits") from None


def _check_network(network) -> None:
    if not isinstance(network, Network):
        raise TypeError(f"network must be a comm.Network(alpha, bandwidth); got {type(network).__name__} "
                        f"{network!r}")


def _is_count(value) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_servers(servers) -> int | None:
    if servers is not None and (not _is_count(servers) or servers < 1):
        raise ValueError(f"servers must be None (one shard per node) or an integer >= 1; got {servers!r}")
    return None if servers is None else int(servers)


def _check_nodes(nodes, where: str = "") -> int:
    if not _is_count(nodes) or nodes < 1:
        raise ValueError(f"{where}nodes must be an integer >= 1; got {nodes!r}")
    return int(nodes)


def _log2_ceil(p: int) -> int:
    return (p - 1).bit_length()


def exchange_cost(algorithm: str, nodes: int, nbytes: float, network: Network, servers: int | None = None) -> Cost:
    """The gradient exchange of ``nbytes`` per node among ``nodes`` nodes with ``algorithm`` (see the module table).

    ``servers``: the number of server shards of ``"ps-sharded"`` (default: ``nodes``; checked whatever the
    algorithm). One node exchanges nothing.
    """
    p = _check_nodes(nodes)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}; got {algorithm!r}")
    _check_real(nbytes, "nbytes")
    _check_network(network)
    servers = _check_servers(servers)
    if not (math.isfinite(nbytes) and nbytes >= 0):
        raise ValueError(f"nbytes must be a finite number >= 0; got {nbytes}")
    n = float(nbytes)
    if p == 1:
        steps, link, node = 0, 0.0, 0.0
    elif algorithm == "ps":
        # every worker pushes N to the one server and pulls N back: P N cross the server's link each way
        steps, link, node = 2, 2 * p * n, n
    elif algorithm == "ps-sharded":
        s = p if servers is None else servers
        # a worker sends N/S to each shard (N through its own link); a shard's link carries P N / S
        steps, link, node = 2, 2 * max(n, p * n / s), n
    elif algorithm == "tree":
        # binomial tree: reduce up ceil(log2 P) levels, broadcast down as many, each level a full N message; the
        # root receives one per level, then sends one per level
        steps = 2 * _log2_ceil(p)
        link, node = steps * n, steps // 2 * n
    elif algorithm == "butterfly":
        # recursive doubling: log2 P rounds of full-size pairwise exchanges; a P that is no power of two folds the
        # extra nodes into a power of two first and back after (two more rounds). A partner of an extra node sends
        # in every exchange round and in the fold-out (it only receives the fold-in); an extra node sends once
        rounds = p.bit_length() - 1
        folds = 0 if p & (p - 1) == 0 else 2
        steps = rounds + folds
        link, node = steps * n, (rounds + folds // 2) * n
    else:  # ring: reduce-scatter then all-gather, P - 1 rounds each of N / P
        steps = 2 * (p - 1)
        link = node = 2 * (p - 1) / p * n
    return Cost(algorithm, p, steps, link, node, steps * network.alpha + link / network.bandwidth)


@dataclass(frozen=True)
class PlanRow:
    """One algorithm in a plan: its exchange and the resulting step time and scaling efficiency."""

    cost: Cost
    step_s: float
    efficiency: float


def plan(nodes: int, params: float, grad_bytes: int, network: Network, compute_s: float, *,
         servers: int | None = None, overlap: float = 0.0) -> list[PlanRow]:
    """Step time of every algorithm: ``compute_s + exchange - min(overlap * exchange, compute_s)``: ``overlap``, the
    fraction of the exchange that runs behind backward, hides no more than the compute there is (it hid 106 s of a
    parameter server's exchange behind 300 ms of compute at overlap 1, and named it fastest); efficiency =
    compute_s / step time (weak scaling: each node keeps its batch, so 1.0 is perfect linear speed-up)."""
    nodes = _check_nodes(nodes)
    _check_real(params, "params")
    _check_real(compute_s, "compute_s")
    _check_real(overlap, "overlap")
    _check_network(network)
    servers = _check_servers(servers)
    if not (math.isfinite(params) and params > 0):
        raise ValueError(f"params must be a number > 0; got {params}")
    if grad_bytes not in (2, 4):
        raise ValueError(f"grad_bytes must be 2 (bf16/fp16) or 4 (fp32); got {grad_bytes}")
    if not (math.isfinite(compute_s) and compute_s > 0):
        raise ValueError(f"compute_s must be a number > 0; got {compute_s}")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1]; got {overlap}")
    if not math.isfinite(params * grad_bytes):
        raise ValueError(f"params: {params:g} gradients of {grad_bytes} bytes are past a float's range")
    rows = []
    for algorithm in ALGORITHMS:
        cost = exchange_cost(algorithm, nodes, params * grad_bytes, network, servers)
        if not math.isfinite(cost.time_s):  # a step time of nan, named fastest
            raise ValueError(f"{algorithm}'s exchange takes no finite time ({cost.time_s}) at {network.bandwidth:g} "
                             f"bytes/s and {network.alpha:g} s latency: a bandwidth or a size out of range")
        step = compute_s + cost.time_s - min(overlap * cost.time_s, compute_s)
        rows.append(PlanRow(cost, step, compute_s / step))
    return rows


def best(rows: list[PlanRow]) -> PlanRow:
    """The fastest row; of equal step times (an exchange hidden whole) the one with the shortest exchange, then the
    first in :data:`ALGORITHMS` order."""
    return min(rows, key=lambda r: (r.step_s, r.cost.time_s))


def efficiency_curve(node_counts, params, grad_bytes, network, compute_s, **kwargs) -> dict[str, list[float]]:
    """algorithm -> scaling efficiency at each of ``node_counts`` (an iterable of node counts, not empty)."""
    node_counts = _node_counts(node_counts)
    curves = {a: [] for a in ALGORITHMS}
    for p in node_counts:
        for row in plan(p, params, grad_bytes, network, compute_s, **kwargs):
            curves[row.cost.algorithm].append(row.efficiency)
    return curves


def _node_counts(node_counts) -> list[int]:
    """``node_counts`` as a list of ints (numpy's taken), checked: ValueError naming the argument."""
    if isinstance(node_counts, (str, bytes)) or not isinstance(node_counts, collections.abc.Iterable):
        raise TypeError(f"node_counts must be an iterable of node counts; got {type(node_counts).__name__} "
                        f"{node_counts!r:.100}")
    counts = list(node_counts)
    if not counts:
        raise ValueError("node_counts must hold at least one node count; got none")
    return [_check_nodes(p, f"node_counts[{i}]: ") for i, p in enumerate(counts)]


def _label(algorithm: str, nodes: int, servers: int | None) -> str:
    if algorithm == "ps":
        return "ps (1 server)"
    if algorithm == "ps-sharded":
        return f"ps ({servers or nodes} shards)"
    return algorithm


def format_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_plan(rows: list[PlanRow], servers: int | None = None) -> str:
    """The plan as a text table, then the winner."""
    header = f"{'algorithm':<16}{'steps':>7}{'node sends':>12}{'busiest link':>14}{'exchange ms':>13}" \
             f"{'step ms':>11}{'efficiency':>12}"
    lines = [header, "-" * len(header)]
    def ms(seconds: float, width: int) -> str:  # 1e-300 Gbit links gave 300 digits
        value = seconds * 1e3
        return f"{value:>{width}.1f}" if value < 1e9 else f"{value:>{width}.3g}"

    for r in rows:  # a space before every column: values past their width (1e10 nodes) ran into the next one
        c = r.cost
        lines.append(f"{_label(c.algorithm, c.nodes, servers):<16} {c.steps:>6} {format_bytes(c.node_bytes):>11} "
                     f"{format_bytes(c.link_bytes):>13} {ms(c.time_s, 12)} {ms(r.step_s, 10)} "
                     f"{r.efficiency:>10.1%} ")
    win = best(rows)
    lines.append(f"fastest: {_label(win.cost.algorithm, win.cost.nodes, servers)} ({ms(win.step_s, 0)} ms per "
                 f"step, scaling efficiency {win.efficiency:.1%})")
    return "\n".join(lines)


# ---- parsing of human units -------------------------------------------------------------------------------------

_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def _split(text: str, what: str, example: str) -> tuple[float, str]:
    match = re.fullmatch(_NUMBER + r"\s*([A-Za-zµ/]*)", str(text).strip())
    if not match:
        raise ValueError(f"{what}: expected a number with a unit like {example}; got {text!r}")
    return float(match.group(1)), match.group(2)


def parse_bandwidth(text: str) -> float:
    """``"25Gbit"``, ``"25Gbps"``, ``"100Mbit/s"``, ``"3.2GB/s"``, ``"1GiB/s"`` -> bytes per second (> 0)."""
    value, unit = _split(text, "bandwidth", "25Gbit or 3GB/s")
    u = unit[:-2] if unit.endswith("/s") else unit
    if u.endswith("bps") and u is not unit:  # "Gbps/s": a rate per second twice
        u = ""
    u = u[:-3] + "bit" if u.endswith("bps") else u
    prefixes = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
                "Ti": 2**40}
    for suffix, per in (("bit", 1 / 8), ("b", 1 / 8), ("B", 1.0)):
        if u.endswith(suffix) and u[:-len(suffix)] in prefixes:
            result = value * prefixes[u[:-len(suffix)]] * per
            if result > 0 and math.isfinite(result):
                return result
            break
    raise ValueError(f"bandwidth: expected a positive number with a unit like 25Gbit, 100Mbit/s or 3GB/s; got "
                     f"{text!r}")


def parse_latency(text: str) -> float:
    """``"5us"``, ``"5µs"``, ``"0.5ms"``, ``"200ns"``, ``"1e-5s"`` -> seconds (>= 0)."""
    value, unit = _split(text, "latency", "5us or 0.2ms")
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}.get(unit)
    if scale is None or not math.isfinite(value * scale):
        raise ValueError(f"latency: expected a number >= 0 with a unit s, ms, us or ns (like 5us); got {text!r}")
    return value * scale


def parse_count(text: str) -> float:
    """``"1.3e9"``, ``"1.3B"``, ``"350M"``, ``"7k"`` -> a number of parameters (> 0)."""
    value, unit = _split(text, "params", "1.3e9 or 350M")
    scale = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(unit)
    if scale is None or not value * scale >= 1 or not math.isfinite(value * scale):  # 0.5 planned 2 bytes a node
        raise ValueError(f"params: expected a count >= 1 like 1.3e9, 1.3B or 350M; got {text!r}")
    return value * scale


def parse_dtype(text: str) -> int:
    """``"bf16"``, ``"fp16"``, ``"fp32"`` (or the torch names) -> bytes per gradient element."""
    try:
        return DTYPE_BYTES[str(text).lower()]
    except KeyError:
        raise ValueError(f"grad dtype: expected one of bf16, fp16, fp32; got {text!r}") from None


# ---- calibration ------------------------------------------------------------------------------------------------

def _checked_samples(where: str, samples) -> list:
    """``samples`` as a list, each checked: a measurement of a network (nodes >= 2) that took a finite time > 0."""
    if isinstance(samples, (str, bytes)) or not isinstance(samples, collections.abc.Iterable):
        raise TypeError(f"{where}: samples must be an iterable of (algorithm, nodes, nbytes, seconds); got "
                        f"{type(samples).__name__} {samples!r:.100}")
    checked = []
    for i, sample in enumerate(samples):
        if not isinstance(sample, (tuple, list)) or len(sample) != 4:
            raise ValueError(f"{where}: sample {i} must be an (algorithm, nodes, nbytes, seconds) tuple; got "
                             f"{sample!r:.200}")
        algorithm, nodes, nbytes, seconds = sample
        _check_real(seconds, f"{where}: sample {i} {sample!r}: measured seconds")
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"{where}: sample {i} {sample!r}: measured seconds must be a finite number > 0; got "
                             f"{seconds}")
        nodes = _check_nodes(nodes, f"{where}: sample {i} {sample!r}: ")
        if nodes < 2:
            raise ValueError(f"{where}: sample {i} {sample!r}: nodes must be >= 2 (one node exchanges nothing, so its "
                             f"time says nothing about the network); got {nodes}")
        checked.append(sample)
    return checked


def fit_network(samples) -> Network:
    """Fits alpha and the bandwidth to measured exchanges.

    ``samples``: iterable of ``(algorithm, nodes, nbytes, seconds)``. Each predicts ``steps * alpha + link_bytes *
    (1/B)``, linear in (alpha, 1/B); the fit minimises the sum of squared *relative* errors (small and large
    messages count alike) with both parameters kept >= 0. Every sample needs ``nodes >= 2`` and a finite
    ``seconds > 0`` (ValueError naming the sample otherwise).
    """
    rows = []
    for algorithm, nodes, nbytes, seconds in _checked_samples("fit_network", samples):
        c = exchange_cost(algorithm, nodes, nbytes, Network(0.0, 1.0))
        rows.append((c.steps / seconds, c.link_bytes / seconds))  # divide by t: relative error
    if len(rows) < 2:
        raise ValueError("fit_network: needs at least two samples (two unknowns: alpha and bandwidth)")
    # normal equations of min sum (a*x + b*y - 1)^2
    sxx = sum(x * x for x, _ in rows)
    syy = sum(y * y for _, y in rows)
    sxy = sum(x * y for x, y in rows)
    sx, sy = sum(x for x, _ in rows), sum(y for _, y in rows)
    det = sxx * syy - sxy * sxy
    if not det > 1e-9 * sxx * syy:  # rows (nearly) proportional: latency and bandwidth cannot be told apart
        raise ValueError("fit_network: every sample moves the same bytes per latency step (e.g. one message size "
                         "with one algorithm and node count), so latency and bandwidth cannot be separated; "
                         "measure at least two message sizes")
    alpha, inv_bw = (sx * syy - sy * sxy) / det, (sy * sxx - sx * sxy) / det
    if alpha < 0 and syy > 0:  # the optimum has a negative latency: the best fit with alpha = 0
        alpha, inv_bw = 0.0, sy / syy
    if inv_bw <= 0:
        raise ValueError("fit_network: the measured times do not grow with the bytes moved; measure a wider range "
                         "of message sizes")
    return Network(alpha, 1.0 / inv_bw)


def model_errors(samples, network: Network) -> list[float]:
    """Relative error (model - measured) / measured of each ``(algorithm, nodes, nbytes, seconds)`` sample (checked
    as :func:`fit_network` checks them)."""
    samples = _checked_samples("model_errors", samples)
    return [(exchange_cost(a, p, n, network).time_s - t) / t for a, p, n, t in samples]


def time_collective(op: str, nbytes: int, repeats: int = 10, group=None) -> float:
    """Median seconds of one gloo ``all_reduce`` or ``broadcast`` (from the group's first rank) of ``nbytes`` of
    float32 in ``group`` (None: the initialized torch.distributed default group), after a warm-up; a barrier before
    each timed call. Every rank of the group must call it with the same arguments. ``nbytes``: a multiple of 4 (whole
    float32 elements), >= 4; ``repeats``: an integer >= 1."""
    for name, value, least in (("nbytes", nbytes, 4), ("repeats", repeats, 1)):
        if not _is_count(value):
            raise TypeError(f"time_collective: {name} must be an integer >= {least}; got {type(value).__name__} "
                            f"{value!r}")
        if value < least:
            raise ValueError(f"time_collective: {name} must be an integer >= {least}; got {value}")
    nbytes, repeats = int(nbytes), int(repeats)
    if nbytes % 4:  # 7 timed 4 bytes
        raise ValueError(f"time_collective: nbytes must be a multiple of 4 (whole float32 elements); got {nbytes}")
    import time

    import torch
    import torch.distributed as dist

    if op not in ("all_reduce", "broadcast"):
        raise ValueError(f"time_collective: op must be 'all_reduce' or 'broadcast'; got {op!r}")
    from .distributed import run as run_kept  # works kept: Note [Gloo's works are released by the thread that waits]

    tensor = torch.ones(max(1, nbytes // 4))
    run = (lambda: run_kept(dist.all_reduce, tensor, group=group)) if op == "all_reduce" else \
        (lambda: run_kept(dist.broadcast, tensor, src=0 if group is None else dist.get_global_rank(group, 0),
                          group=group))  # src is a global rank: the group's first
    run()
    times = []
    for _ in range(repeats):
        run_kept(dist.barrier, group=group)
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    tensor.set_()  # its memory goes now: the kept works hold the tensor object, not its nbytes
    return sorted(times)[len(times) // 2]


def plot_kinds() -> list[str]:
    """The file types :func:`plot_efficiency` writes (matplotlib's Agg canvas), named by their file suffixes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    # pgf needs a LaTeX installation: it failed after the plan's table was printed
    return sorted(kind for kind in FigureCanvasAgg.get_supported_filetypes() if kind != "pgf")


def check_plot_path(path, what: str = "path") -> None:
    """Raises ValueError unless ``path`` is a file name whose suffix is one of :func:`plot_kinds` (the type written:
    a name without one would be written to another file, name + ".png")."""
    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(name, str) or name.endswith(("/", os.sep)) or \
            os.path.splitext(name)[1].lower().lstrip(".") not in plot_kinds():
        raise ValueError(f"{what} must be a file name ending in .png (or {', '.join(plot_kinds())}); got {path!r}")


def plot_efficiency(path, node_counts, params, grad_bytes, network, compute_s, *, servers=None, overlap=0.0,
                    title=None) -> dict[str, list[float]]:
    """PNG of the scaling efficiency of every algorithm against the node count (log2 axis), with the same model
    options as :func:`plan` (``servers``, ``overlap``), written to ``path`` (a .png, or another of :func:`plot_kinds`,
    by its suffix). Returns the curves drawn (algorithm -> efficiencies). Drawn on a figure of its own (matplotlib's
    object API): pyplot's backend and open figures are left as they were."""
    from matplotlib.figure import Figure

    from .files import replace_file

    check_plot_path(path, "plot_efficiency: path")
    node_counts = _node_counts(node_counts)  # drawn twice (curves, x axis): a generator would be spent after one
    curves = efficiency_curve(node_counts, params, grad_bytes, network, compute_s, servers=servers, overlap=overlap)
    fig = Figure(figsize=(7, 4.5), layout="tight")
    ax = fig.subplots()
    for algorithm, values in curves.items():
        label = "ps (one shard per node)" if algorithm == "ps-sharded" and servers is None else \
            _label(algorithm, 0, servers)
        ax.plot(node_counts, values, marker="o", markersize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes")
    ax.set_ylabel("scaling efficiency (compute / step time)")
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title or "gradient exchange: alpha-beta model")
    replace_file(path, lambda tmp: fig.savefig(tmp, dpi=120))  # atomically, as the run's other files
    return curves
