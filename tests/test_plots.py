"""pyengine.plots: the moving mean against its definition, and the PNGs written atomically."""
import math
import random

import pytest

from pyengine import plots


def _mean_of_windows(values, window):
    """The definition: the mean of the finite values among the last ``window`` ones, at every value."""
    out = []
    for i in range(len(values)):
        finite = [x for x in values[max(0, i - window + 1):i + 1] if math.isfinite(x)]
        out.append(sum(finite) / len(finite) if finite else math.nan)
    return out


@pytest.mark.parametrize("n,window", [(0, 3), (1, 1), (10, 3), (300, 1), (1000, 20), (2001, 40)])
def test_the_moving_mean_is_the_mean_of_each_window(n, window):
    """It was computed anew at every value (quadratic: 160,000 steps took 20 s a pass); now a running sum, summed
    anew once a window and where a huge loss leaves it (its rounding cancelled the small ones: 0.0 for 1.0)."""
    rng = random.Random(n)
    values = [rng.random() * 10 ** rng.randint(-5, 5) for _ in range(n)]
    for i in range(0, n, 13):
        values[i] = math.nan  # a diverged step's loss is left out
    values[n // 2:n // 2 + 2] = [1e300, 2.0][:max(0, min(2, n - n // 2))]
    for got, want in zip(plots._smooth(values, window), _mean_of_windows(values, window), strict=True):
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-9), (got, want)
    assert plots._smooth([1e308, 1e308, 1.0, math.nan, 2.0], 2) == [1e308, math.inf, 5e307, 1.0, 2.0]


def test_a_plot_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """loss.png was written in place: a kill during the write (a resume redraws it) left a truncated PNG."""
    records = [dict(step=i + 1, elapsed_s=0.1 * i, loss=1.0 / (i + 1)) for i in range(120)]
    path = tmp_path / "loss.png"
    plots.plot_loss(records, path, "first")
    good = path.read_bytes()
    assert good.startswith(b"\x89PNG") and sorted(p.name for p in tmp_path.iterdir()) == ["loss.png"]

    def dies_half_way(self, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(plots.Figure, "savefig", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        plots.plot_loss(records, path, "second")
    assert path.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == ["loss.png"]
