"""Plots of ``python -m pyengine train`` (matplotlib's object API: figures of their own, drawn without a display;
pyplot's backend and open figures are left alone).

- ``loss.png``: training loss against step and against wall time (raw, and a moving average).
- ``compare.png`` (``--mode all``): every schedule's loss against step and against wall time, and samples/s bars.
"""
from __future__ import annotations

import math

from matplotlib.figure import Figure

from .files import replace_file

__all__ = ["plot_loss", "plot_compare", "compare_figure", "mode_colors"]

# One colour per mode, the same in compare.png's lines and bars.
COLORS = {"hybrid": "tab:blue", "sync": "tab:orange", "async": "tab:green", "pipeline": "tab:red"}
OTHER_COLORS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")  # modes COLORS does not name
STYLES = {"sync": "--"}  # hybrid and sync take the same steps on the same batches: their loss curves coincide


def _smooth(values, window: int):
    """Running mean over ``window`` values; non-finite losses (NaN) are left out of it. Linear in the values: a
    running sum, the window summed anew once per ``window`` values (it was summed anew at every value: 160,000
    steps took 20 s a pass)."""
    values = list(values)
    out, total, count = [], 0.0, 0
    for i, v in enumerate(values):
        if math.isfinite(v):
            total, count = total + v, count + 1
        left = values[i - window] if i >= window else math.nan
        if math.isfinite(left):
            total, count = total - left, count - 1
        # the window summed anew: once a window (the running sum's rounding does not build up), where a loss that
        # left it dwarfed the rest (its rounding would have cancelled them), and where the sum overflowed
        if i % window == 0 or not math.isfinite(total) or math.isfinite(left) and abs(left) > 2**20 * abs(total):
            total = sum(x for x in values[max(0, i - window + 1):i + 1] if math.isfinite(x))
        out.append(total / count if count else math.nan)
    return out


def _save(fig, path) -> None:
    """Writes the figure atomically (:func:`pyengine.files.replace_file`), as the run's other files: a kill during
    the write (a resume redraws the plot) left a truncated PNG in place of the good one."""
    replace_file(path, lambda tmp: fig.savefig(tmp, dpi=110))


def _series(records):
    steps = [r["step"] for r in records]
    elapsed = [r["elapsed_s"] for r in records]
    loss = [math.nan if r["loss"] is None else r["loss"] for r in records]  # JSON writes a non-finite loss as null
    return steps, elapsed, loss


def plot_loss(records: list[dict], path, title: str) -> None:
    steps, elapsed, loss = _series(records)
    window = max(1, len(loss) // 50)
    fig = Figure(figsize=(11, 4), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, xs, label in ((axes[0], steps, "step"), (axes[1], elapsed, "wall time (s)")):
        ax.plot(xs, loss, color="0.75", linewidth=0.8, label="loss")
        if window > 1:
            ax.plot(xs, _smooth(loss, window), color="tab:blue", linewidth=1.6, label=f"moving mean ({window})")
        ax.set_xlabel(label)
        ax.set_ylabel("training loss")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    _save(fig, path)


def mode_colors(modes) -> dict[str, str]:
    """Each of ``modes``' colour: :data:`COLORS`, then distinct others for modes it does not name."""
    spare = iter(c for c in OTHER_COLORS if c not in COLORS.values())
    return {mode: COLORS[mode] if mode in COLORS else next(spare, "tab:gray") for mode in modes}


def plot_compare(runs: dict[str, tuple[list[dict], dict]], path, title: str) -> None:
    """``runs``: mode -> (metrics records, summary)."""
    _save(compare_figure(runs, title), path)


def compare_figure(runs: dict[str, tuple[list[dict], dict]], title: str):
    """compare.png's figure: loss against step and against wall time per mode, and samples/s bars."""
    fig = Figure(figsize=(16, 4.5), layout="constrained")
    axes = fig.subplots(1, 3)
    colors = mode_colors(runs)
    for mode, (records, _) in runs.items():
        steps, elapsed, loss = _series(records)
        window = max(1, len(loss) // 50)
        color = colors[mode]
        axes[0].plot(steps, _smooth(loss, window), label=mode, color=color, linestyle=STYLES.get(mode, "-"))
        axes[1].plot(elapsed, _smooth(loss, window), label=mode, color=color)
    for ax, label in ((axes[0], "step (optimizer update)"), (axes[1], "wall time (s)")):
        ax.set_xlabel(label)
        ax.set_ylabel("training loss (moving mean)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    modes = list(runs)
    rates = [runs[m][1]["samples_per_s"] for m in modes]
    bars = axes[2].bar(modes, rates, color=[colors[m] for m in modes])
    for bar, mode in zip(bars, modes):
        acc = runs[mode][1].get("test_accuracy")
        text = f"{bar.get_height():,.0f}" + (f"\nacc {acc:.1%}" if acc is not None else "")
        axes[2].annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                         fontsize=9)
    axes[2].set_ylabel("training samples/s")
    axes[2].set_ylim(0, max(rates) * 1.25 if rates and max(rates) > 0 else 1)
    axes[2].grid(True, axis="y", alpha=0.3)
    fig.suptitle(title)
    return fig
