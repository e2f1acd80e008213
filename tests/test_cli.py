"""`python -m pyengine train` end to end, on short runs: the run directory of every mode, resume equality, checkpoint
validation, bad input, Ctrl-C."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import pyengine
import zygote
from pyengine import checkpoint as ckpt
from pyengine.cli import main

REPO = Path(__file__).resolve().parents[1]
SHORT = ["--hidden", "32", "--batch-size", "32", "--devices", "cpu", "--workers", "2"]
SUMMARY_KEYS = {"mode", "devices", "workers", "steps", "samples_per_s", "final_loss", "test_accuracy", "wall_s"}
PNG = b"\x89PNG\r\n\x1a\n"


def train(*argv):
    return main(["train", *argv])


def check_run_dir(run: Path, mode: str, steps: int):
    summary = json.loads((run / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["mode"] == mode and summary["steps"] == steps and summary["workers"] == 2
    assert 0.0 <= summary["test_accuracy"] <= 1.0 and summary["samples_per_s"] > 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, steps + 1))
    assert all({"loss", "samples", "samples_per_s", "wall_s", "elapsed_s"} <= set(r) for r in lines)
    if mode == "async":
        assert all("staleness" in r and "worker" in r for r in lines)
    if mode == "pipeline":
        assert all(0.0 <= r["bubble_fraction"] <= 1.0 and "bubble_ideal" in r for r in lines)
        assert 0.0 <= summary["bubble_fraction_mean"] <= 1.0
    png = (run / "loss.png").read_bytes()
    assert png.startswith(PNG) and len(png) > 1000
    assert ckpt.latest(run / "checkpoints") is not None
    assert summary["checkpoint"] == os.path.abspath(ckpt.latest(run / "checkpoints"))
    return summary


def test_the_summary_names_its_checkpoint_by_an_absolute_path(tmp_path, monkeypatch):
    """A new run's summary.json named its checkpoint as --out gave it (relative), a resumed run's absolutely (its
    trace is always absolute). Both absolute now."""
    monkeypatch.chdir(tmp_path)
    assert train("--steps", "2", "--out", "rel", "--quiet", *SHORT) == 0
    summary = json.loads((tmp_path / "rel" / "summary.json").read_text())
    assert summary["checkpoint"] == str(tmp_path / "rel" / "checkpoints" / "step-00000002.pyeckpt"), summary
    assert train("--resume", "rel", "--steps", "3", "--quiet") == 0
    summary = json.loads((tmp_path / "rel" / "summary.json").read_text())
    assert summary["checkpoint"] == str(tmp_path / "rel" / "checkpoints" / "step-00000003.pyeckpt"), summary


def test_mode_all_writes_every_run_and_compare_png(tmp_path, capsys):
    """... and the async options are its async run's (they were refused: "--mode all has no stale gradients")."""
    out = tmp_path / "all"
    assert train("--mode", "all", "--steps", "12", "--out", str(out), "--trace", str(tmp_path / "t.json"),
                 "--max-staleness", "0", "--staleness-lr", "inverse", *SHORT) == 0
    pushes = [json.loads(line) for line in (out / "async" / "metrics.jsonl").read_text().splitlines()]
    assert len(pushes) == 12 and all(p["staleness"] == 0 for p in pushes), pushes  # older pushes recomputed
    printed = capsys.readouterr().out
    for mode in ("hybrid", "sync", "async", "pipeline"):
        summary = check_run_dir(out / mode, mode, 12)
        assert f"[{mode}] 12 steps" in printed and "test accuracy" in printed
        trace = json.loads((tmp_path / f"t-{mode}.json").read_text())
        names = {e["name"] for e in trace["traceEvents"]}
        compute = {"pipeline": "F0", "async": "push"}.get(mode, "forward_backward+transfer")
        assert compute in names and ("update" in names or mode == "async"), (mode, names)
        assert summary["trace"].endswith(f"t-{mode}.json")
    top = json.loads((out / "summary.json").read_text())
    assert top["mode"] == "all" and set(top["runs"]) == {"hybrid", "sync", "async", "pipeline"}
    assert SUMMARY_KEYS <= set(top) and top["steps"] == 12 and top["workers"] == 2
    for key in ("samples_per_s", "final_loss", "test_accuracy"):  # each mode's, keyed by mode
        assert top[key] == {m: top["runs"][m][key] for m in top["runs"]}, key
    assert top["wall_s"] == pytest.approx(sum(r["wall_s"] for r in top["runs"].values()))
    assert top["best"]["samples_per_s"] == max(top["samples_per_s"], key=top["samples_per_s"].get)
    assert (out / "compare.png").read_bytes().startswith(PNG)
    for mode, own in (("hybrid", (None, "none")), ("async", (0, "inverse"))):  # each sub-run resumes alone: the
        config = ckpt.load(ckpt.latest(out / mode / "checkpoints"))["config"]   # hybrid one was refused
        assert (config["max_staleness"], config["staleness_lr"]) == own, mode
        assert train("--resume", str(out / mode), "--steps", "13", "--quiet") == 0, mode


def test_interrupted_mode_all_resumes_as_a_whole(tmp_path, capsys, monkeypatch):
    """Ctrl-C in the sync run of --mode all (hybrid done): the message gives `--resume <all-folder>`, which continues
    sync from its checkpoint, trains async and pipeline, then writes compare.png and the top summary.json; hybrid,
    finished before, is not trained again. A later --resume with more --steps continues every mode."""
    import pyengine.cli as cli

    out = tmp_path / "all"
    original = cli.train_one

    def ctrl_c_in_sync(cfg, mode, run_dir, stop, *rest):
        stop.requested = stop.requested or mode == "sync"  # as the first Ctrl-C's handler does
        return original(cfg, mode, run_dir, stop, *rest)

    monkeypatch.setattr(cli, "train_one", ctrl_c_in_sync)
    assert train("--mode", "all", "--steps", "4", "--quiet", "--out", str(out), *SHORT) == 130
    err = capsys.readouterr().err
    assert (f"resume with: python -m pyengine train --resume {out} (continues sync, then trains async, pipeline, "
            "then writes compare.png and summary.json)") in err, err
    assert [ckpt.step_of(p) for p in ckpt.list_checkpoints(out / "sync" / "checkpoints")] == [1]
    assert json.loads((out / "config.json").read_text())["mode"] == "all" and not (out / "summary.json").exists()
    assert not (out / "async").exists()
    monkeypatch.setattr(cli, "train_one", original)
    assert train("--out", str(out), "--mode", "all", "--steps", "4", *SHORT) == 2
    assert f"already holds a run; continue it with --resume {out}" in capsys.readouterr().err
    hybrid = (out / "hybrid" / "summary.json").read_bytes()
    assert train("--resume", str(out), "--quiet") == 0
    assert (out / "hybrid" / "summary.json").read_bytes() == hybrid  # finished before: not trained again
    for mode in ("hybrid", "sync", "async", "pipeline"):
        check_run_dir(out / mode, mode, 4)
    assert json.loads((out / "sync" / "summary.json").read_text())["resumed_from_step"] == 1
    top = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(top) and top["steps"] == 4 and set(top["runs"]) == set(top["test_accuracy"])
    assert (out / "compare.png").read_bytes().startswith(PNG)
    assert train("--resume", str(out), "--steps", "5", "--quiet") == 0
    for mode in ("hybrid", "sync", "async", "pipeline"):
        check_run_dir(out / mode, mode, 5)
    assert json.loads((out / "summary.json").read_text())["steps"] == 5
    assert json.loads((out / "config.json").read_text())["steps"] == 5
    monkeypatch.setattr(cli, "train_one", ctrl_c_in_sync)  # extended again and stopped: no stale top-level result
    assert train("--resume", str(out), "--steps", "6", "--quiet") == 130
    assert not (out / "summary.json").exists() and not (out / "compare.png").exists()


def test_compare_png_gives_every_mode_its_own_colour():
    """compare.png: one colour per mode (pipeline had hybrid's), the same in the loss lines and the samples/s bars."""
    from matplotlib.colors import to_hex

    from pyengine import plots
    from pyengine.cli import MODES

    records = [{"step": s, "elapsed_s": 0.1 * s, "loss": 1.0 / s} for s in (1, 2, 3)]
    runs = {m: (records, {"samples_per_s": 100.0 + i, "test_accuracy": 0.5}) for i, m in enumerate(MODES)}
    fig = plots.compare_figure(runs, "t")
    for ax in fig.axes[:2]:
        lines = {line.get_label(): to_hex(line.get_color()) for line in ax.get_lines()}
        assert lines == {m: to_hex(plots.COLORS[m]) for m in MODES}, lines
    bars = [to_hex(bar.get_facecolor()) for bar in fig.axes[2].patches]
    assert bars == [to_hex(plots.COLORS[m]) for m in MODES]
    assert len(set(bars)) == len(MODES)
    assert len(set(plots.mode_colors([*MODES, "other", "more"]).values())) == len(MODES) + 2


def test_default_digits_run_learns(tmp_path):
    """Enough steps of the default model and data to clear 90 % (the full default reaches >= 95 %)."""
    assert train("--steps", "150", "--out", str(tmp_path / "run"), "--quiet", "--devices", "cpu") == 0
    summary = check_run_dir(tmp_path / "run", "hybrid", 150)
    assert summary["test_accuracy"] >= 0.90, summary["test_accuracy"]


def test_tokens_transformer_workload(tmp_path):
    out = tmp_path / "tok"
    assert train("--data", "tokens", "--steps", "3", "--hidden", "32", "--batch-size", "8", "--devices", "cpu",
                 "--out", str(out), "--quiet", "--mode", "async") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "transformer" and summary["steps"] == 3


def master(run: Path) -> dict:
    payload = ckpt.load(ckpt.latest(run / "checkpoints"))
    return payload["engine"]


def assert_same_weights_and_adam_state(a: dict, b: dict):
    """Two engine states (:func:`master`) hold bit-identical master weights and Adam moments."""
    for name in a["master"]:
        assert torch.equal(a["master"][name], b["master"][name]), name
    for index, entry in a["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[key], b["optimizer"]["state"][index][key]), (index, key)


def test_async_resume_runs_the_remaining_pushes(tmp_path):
    run = tmp_path / "run"
    common = ["--mode", "async", "--quiet", "--checkpoint-every", "5", "--out", str(run), *SHORT]
    assert train("--steps", "12", *common) == 0
    ckpt.list_checkpoints(run / "checkpoints")[-1].unlink()  # stopped after step 10's checkpoint
    assert train("--resume", str(run), "--steps", "12", "--quiet") == 0
    state = master(run)
    assert state["version"] == 12 and state["counters"]["pushes"] == 12
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 12


@pytest.mark.parametrize("mode", ["hybrid", "sync", "pipeline"])
def test_resume_is_bit_identical(tmp_path, mode):
    common = ["--mode", mode, "--quiet", "--checkpoint-every", "5", *SHORT]
    assert train("--steps", "20", "--out", str(tmp_path / "full"), *common) == 0
    part = tmp_path / "part"
    assert train("--steps", "20", "--out", str(part), "--keep", "2", *common) == 0
    files = ckpt.list_checkpoints(part / "checkpoints")
    assert [f.name for f in files] == ["step-00000015.pyeckpt", "step-00000020.pyeckpt"]  # --keep 2
    files[-1].unlink()  # as if the run had stopped after step 15's checkpoint
    # the run's clock goes on from the checkpoint's: marked as 1000 s in, the resumed steps are later still
    payload = ckpt.load(files[0])
    payload["elapsed_s"] = 1000.0
    files[0].unlink()
    ckpt.save(part / "checkpoints", 15, payload)
    assert train("--resume", str(part), "--steps", "20", "--quiet") == 0
    a, b = master(tmp_path / "full"), master(part)
    assert a["version"] == b["version"] == 20
    assert_same_weights_and_adam_state(a, b)
    records = [json.loads(line) for line in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))  # steps 16..20 were redone, not duplicated
    assert all(r["elapsed_s"] > 1000.0 for r in records[15:]) and all(r["elapsed_s"] < 1000.0 for r in records[:15])


def _failing_loss(monkeypatch, at_call: int):
    """models.loss_fn raising RuntimeError('boom') from its ``at_call``-th call on (counted over the workers)."""
    import threading

    from pyengine import models
    real, calls, lock = models.loss_fn, [0], threading.Lock()

    def loss_fn(model, batch):
        with lock:
            calls[0] += 1
            fail = calls[0] >= at_call
        if fail:
            raise RuntimeError("boom")
        return real(model, batch)

    monkeypatch.setattr(models, "loss_fn", loss_fn)


@pytest.mark.parametrize("mode", ["hybrid", "pipeline", "async"])
def test_a_failed_run_keeps_its_last_step_and_resumes_from_it(tmp_path, capsys, monkeypatch, mode):
    """Note [A failed run keeps its last step]: a worker's error at step 4 (no periodic checkpoint since the start)
    exits 1 with the error and a second line naming the checkpoint of step 3, saved on the way out; --resume from it
    ends where an uninterrupted run ends (bit-identical; async: every applied push counted once)."""
    common = ["--mode", mode, "--quiet", "--checkpoint-every", "100", *SHORT]
    full, part = tmp_path / "full", tmp_path / "part"
    if mode != "async":
        assert train("--steps", "6", "--out", str(full), *common) == 0
    calls_per_step = 2 if mode == "hybrid" else 1  # hybrid: one call per worker; the pipeline's loss: last stage
    if mode == "pipeline":
        calls_per_step = 4  # --microbatches 4 (the CLI's default), one loss call each
    with monkeypatch.context() as patch:
        _failing_loss(patch, at_call=3 * calls_per_step + 1)
        capsys.readouterr()
        assert train("--steps", "6", "--out", str(part), *common) == 1
    err = capsys.readouterr().err.strip().splitlines()
    steps = len((part / "metrics.jsonl").read_text().splitlines())
    assert steps == 3 if mode != "async" else 1 <= steps <= 3, steps
    saved = ckpt.path_for(part / "checkpoints", steps)
    assert err[-2].startswith("pyengine train: training failed: ") and "RuntimeError: boom" in err[-2], err
    assert err[-1] == (f"pyengine train: step {steps}, the last complete one, is saved in {saved}: resume with "
                       f"python -m pyengine train --resume {part}"), err
    assert ckpt.list_checkpoints(part / "checkpoints") == [saved]
    assert train("--resume", str(part), "--steps", "6", "--quiet") == 0
    b = master(part)
    if mode == "async":
        assert b["version"] == 6 and b["counters"]["pushes"] == 6
        return
    a = master(full)
    assert a["version"] == b["version"] == 6
    assert_same_weights_and_adam_state(a, b)


def test_a_failure_after_an_update_but_before_its_count_saves_nothing_wrong(tmp_path, capsys, monkeypatch):
    """Step 4's update is applied, then its metrics fail: the CLI has counted 3 steps, the engine 4. Saving the
    store as step 3 would put step 4's update under step 3's name; the last periodic checkpoint is named instead."""
    from pyengine import hybrid
    real, calls = hybrid.step_metrics, [0]

    def metrics(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("metrics")
        return real(*args, **kwargs)

    monkeypatch.setattr(hybrid, "step_metrics", metrics)
    out = tmp_path / "run"
    assert train("--steps", "6", "--quiet", "--checkpoint-every", "2", "--out", str(out), *SHORT) == 1
    err = capsys.readouterr().err.strip().splitlines()
    periodic = ckpt.path_for(out / "checkpoints", 2)
    assert err[-2:] == [
        "pyengine train: step 3 could not be saved: the engine counts 4 steps there (the last periodic checkpoint "
        "stands)",
        f"pyengine train: the last checkpoint is in {periodic}: resume with python -m pyengine train --resume {out}"], err
    assert ckpt.list_checkpoints(out / "checkpoints") == [periodic]


def test_a_failed_final_save_names_the_last_checkpoint_and_how_to_resume(tmp_path, capsys, monkeypatch):
    """The run's last checkpoint (the one after its last step, or a Ctrl-C's) cannot be written (a full disk): the
    run exits 1 with the error, why the step is not saved, and the newest checkpoint with the --resume command (it
    printed the error alone); the resume then finishes the run."""
    real = ckpt.save

    def save(directory, step, payload, keep=None):
        if step == 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(directory, step, payload, keep=keep)

    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(ckpt, "save", save)
        assert train("--steps", "6", "--quiet", "--checkpoint-every", "2", "--out", str(out), *SHORT) == 1
    err = capsys.readouterr().err.strip().splitlines()
    periodic = ckpt.path_for(out / "checkpoints", 4)
    assert err[-3].startswith("pyengine train: training failed: ") and "No space left on device" in err[-3], err
    assert err[-2].startswith("pyengine train: step 6 could not be saved: OSError: "), err
    assert err[-1] == (f"pyengine train: the last checkpoint is in {periodic}: resume with python -m pyengine train "
                       f"--resume {out}"), err
    assert train("--resume", str(out), "--steps", "6", "--quiet") == 0
    assert master(out)["version"] == 6


def test_mode_all_failing_before_a_checkpoint_still_says_how_to_resume(tmp_path, capsys, monkeypatch):
    out = tmp_path / "all"
    _failing_loss(monkeypatch, at_call=1)
    assert train("--mode", "all", "--steps", "2", "--quiet", "--out", str(out), *SHORT) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"pyengine train: resume with python -m pyengine train --resume {out} (the modes trained so "
                       "far are kept)"), err


def test_a_run_that_fails_at_its_first_step_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    _failing_loss(monkeypatch, at_call=1)
    out = tmp_path / "run"
    assert train("--steps", "3", "--quiet", "--out", str(out), *SHORT) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pyengine train: training failed: ") and "boom" in err[0], err
    assert ckpt.list_checkpoints(out / "checkpoints") == []


def test_resume_from_an_older_checkpoint_sets_the_later_ones_aside(tmp_path, capsys):
    """Resuming from a checkpoint file older than the run's newest forks the run: the later checkpoints and metrics
    lines, and the summary, plot and trace of the run's end (the trace was written over), move to a superseded-*
    folder (nothing deleted), and the next `--resume DIR` continues the fork."""
    run = tmp_path / "run"
    common = ["--quiet", "--checkpoint-every", "2", *SHORT]
    assert train("--steps", "6", "--out", str(run), "--trace", str(run / "trace.json"), *common) == 0
    first = (run / "metrics.jsonl").read_text().splitlines()
    ended = {name: (run / name).read_bytes() for name in ("loss.png", "trace.json")}
    summary = json.loads((run / "summary.json").read_text())
    assert train("--resume", str(ckpt.path_for(run / "checkpoints", 2)), "--steps", "3", "--quiet") == 0
    assert "moved to" in capsys.readouterr().err
    [aside] = run.glob("superseded-*")
    assert [ckpt.step_of(p) for p in ckpt.list_checkpoints(aside)] == [4, 6]
    for name, content in ended.items():  # the abandoned continuation's plot and trace (were written over)
        assert (aside / name).read_bytes() == content, name
    # its summary, naming the trace where it now is
    assert json.loads((aside / "summary.json").read_text()) == dict(summary, trace=str(aside / "trace.json"))
    assert (run / "trace.json").read_bytes() != ended["trace.json"]  # the fork's own
    assert (aside / "metrics.jsonl").read_text().splitlines() == first[2:]  # steps 3..6 of the first run, kept
    assert [ckpt.step_of(p) for p in ckpt.list_checkpoints(run / "checkpoints")] == [2, 3]
    assert train("--resume", str(run), "--steps", "5", "--quiet") == 0
    assert master(run)["version"] == 5
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    assert len(list(run.glob("superseded-*"))) == 1  # resuming from the newest checkpoint sets nothing aside


def test_a_fork_whose_trace_cannot_be_moved_still_resumes(tmp_path, capsys, monkeypatch):
    """The abandoned continuation's trace on another file system than the run (--trace on /dev/shm): its move
    raised EXDEV half way through setting the continuation aside ("training failed: OSError"). It is moved by
    copy where rename cannot, and when even that fails the resume goes on with a warning."""
    import shutil

    run = tmp_path / "run"
    assert train("--steps", "4", "--out", str(run), "--trace", str(run / "trace.json"), "--quiet",
                 "--checkpoint-every", "2", *SHORT) == 0

    def refused(src, dst):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(shutil, "move", refused)
    capsys.readouterr()
    assert train("--resume", str(ckpt.path_for(run / "checkpoints", 2)), "--steps", "3", "--quiet") == 0
    err = capsys.readouterr().err
    assert f"warning: the set-aside continuation's trace {run / 'trace.json'} could not be moved" in err, err
    [aside] = run.glob("superseded-*")
    assert json.loads((aside / "summary.json").read_text())["trace"] == str(run / "trace.json")
    assert master(run)["version"] == 3


def test_resume_after_a_crash_from_the_newest_checkpoint_forks_nothing(tmp_path, capsys):
    """A run that died after its newest checkpoint (here: steps 3 and 4 logged, checkpoint 4 lost) resumes from it
    with no superseded-* folder and no word of a fork; the steps after it are redone and logged once."""
    run = tmp_path / "run"
    assert train("--steps", "4", "--out", str(run), "--quiet", "--checkpoint-every", "2", *SHORT) == 0
    ckpt.path_for(run / "checkpoints", 4).unlink()  # as if the run had died before writing it
    capsys.readouterr()
    assert train("--resume", str(run), "--quiet") == 0
    assert "moved to" not in capsys.readouterr().err and not list(run.glob("superseded-*"))
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4] and master(run)["version"] == 4


@pytest.mark.parametrize("bad", [b"[1, 2]\n", b'{"step": "x"}\n', b'{"loss": 1.0}\n', b"\xff\xfe\n"])
def test_resume_stops_reading_metrics_at_a_line_that_is_no_record(tmp_path, capsys, bad):
    """A line of metrics.jsonl that parses but is no record (a list, a step that is no int, no step) or is not
    UTF-8 stopped the resume as "training failed" (AttributeError, TypeError, UnicodeDecodeError). It is read as a
    line cut by a crash: the records before it are kept, the steps after it are redone and logged once."""
    run = tmp_path / "run"
    assert train("--steps", "4", "--out", str(run), "--quiet", "--checkpoint-every", "2", *SHORT) == 0
    for n in (3, 4):
        ckpt.path_for(run / "checkpoints", n).unlink(missing_ok=True)  # the run died after checkpoint 2
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (run / "metrics.jsonl").write_bytes(b"".join(lines[:2]) + bad + b"".join(lines[2:]))
    capsys.readouterr()
    assert train("--resume", str(run), "--quiet") == 0, capsys.readouterr().err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4] and master(run)["version"] == 4


def test_resume_keeps_the_records_after_a_damaged_metrics_line(tmp_path, capsys):
    """A damaged line of metrics.jsonl before the checkpoint's step ended the reading there, and the resume wrote
    the file back without every record after it (steps 3 and 4 of a run resumed at step 4 were gone for good: the
    steps it redoes begin after 4). The damaged line alone is left out, with a word on stderr."""
    run = tmp_path / "run"
    assert train("--steps", "4", "--out", str(run), "--quiet", "--checkpoint-every", "2", *SHORT) == 0
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    lines[1] = lines[1][:20] + b"\n"  # step 2's record, cut
    (run / "metrics.jsonl").write_bytes(b"".join(lines))
    capsys.readouterr()
    assert train("--resume", str(run), "--steps", "5", "--quiet") == 0
    err = capsys.readouterr().err
    assert f"{run / 'metrics.jsonl'}: line 2 before step 4 is no record (cut or damaged): left out" in err, err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 3, 4, 5] and master(run)["version"] == 5


def test_a_failed_resume_of_a_finished_run_leaves_no_summary_of_its_earlier_end(tmp_path, capsys, monkeypatch):
    """A finished run resumed for more steps that then failed kept the summary.json and loss.png of its earlier
    end (steps 4 of 4, not interrupted) beside checkpoints and metrics of later steps. A resume removes them when
    it begins training (it writes its own at its end); the next resume finishes the run and writes them."""
    run = tmp_path / "run"
    assert train("--steps", "4", "--out", str(run), "--quiet", "--checkpoint-every", "2", *SHORT) == 0
    assert (run / "summary.json").exists() and (run / "loss.png").exists()
    with monkeypatch.context() as patch:
        _failing_loss(patch, at_call=2)
        assert train("--resume", str(run), "--steps", "8", "--quiet") == 1
    capsys.readouterr()
    assert not (run / "summary.json").exists() and not (run / "loss.png").exists()
    assert train("--resume", str(run), "--steps", "8", "--quiet") == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 8 and (run / "loss.png").exists()


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", "loss.png", "checkpoints/step-00000004.pyeckpt",
                                  "checkpoints/step-00000099.pyeckpt", "copied.pyeckpt"])
def test_a_trace_that_names_another_runs_file_is_refused(finished_run, tmp_path, capsys, name):
    """--trace naming a file of another run (its newest checkpoint, its metrics, summary, plot; a checkpoint named
    in its checkpoints/, which its next --resume would take; a checkpoint copied anywhere) replaced it with the
    trace, exit code 0: that run's --resume then refused "not a pyengine checkpoint". Refused, nothing written;
    a --mode all run's config.json too."""
    import shutil

    victim = tmp_path / "victim"
    shutil.copytree(finished_run, victim)
    shutil.copy(ckpt.latest(victim / "checkpoints"), victim / "copied.pyeckpt")
    before = {p: p.read_bytes() for p in victim.rglob("*") if p.is_file()}
    new = tmp_path / "new"
    assert train("--steps", "1", "--out", str(new), "--quiet", "--trace", str(victim / name), *SHORT) == 2
    err = capsys.readouterr().err
    assert f"names a file of the run in {victim} (its metrics, summary, plots, config or a checkpoint)" in err, err
    assert {p: p.read_bytes() for p in victim.rglob("*") if p.is_file()} == before
    assert not new.exists()


def test_a_trace_that_names_a_mode_all_runs_config_is_refused(tmp_path, capsys):
    every = tmp_path / "all"
    every.mkdir()
    (every / "config.json").write_text(json.dumps({"kind": "pyengine.train", "mode": "all"}))
    assert train("--steps", "1", "--out", str(tmp_path / "new"), "--quiet", "--trace", str(every / "config.json"),
                 *SHORT) == 2
    assert "names a file of the run in" in capsys.readouterr().err
    assert json.loads((every / "config.json").read_text())["mode"] == "all"
    mine = tmp_path / "config.json"  # a config.json of anything else: a trace may replace it
    mine.write_text("{}")
    assert train("--steps", "1", "--out", str(tmp_path / "new2"), "--quiet", "--trace", str(mine), *SHORT) == 0
    assert json.loads(mine.read_text()).get("traceEvents") is not None


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", "loss.png", "checkpoints/step-00000003.pyeckpt"])
def test_a_trace_that_names_a_file_of_the_run_is_refused(tmp_path, capsys, name):
    """--trace naming one of the run's own files (its metrics, summary, plot, a checkpoint) was written over it or
    under it with exit code 0 (a final checkpoint overwritten by the trace: the next --resume refused it as "not a
    pyengine checkpoint"). Refused before anything is made; a resume given such a --trace too, its files intact."""
    run = tmp_path / "run"
    assert train("--steps", "3", "--out", str(run), "--quiet", "--trace", str(run / name), *SHORT) == 2
    err = capsys.readouterr().err
    assert f"names a file the run in {run} writes (its metrics, summary, plots or checkpoints)" in err, err
    assert not run.exists()
    assert train("--steps", "3", "--out", str(run), "--quiet", "--checkpoint-every", "3", *SHORT) == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert train("--resume", str(run), "--steps", "4", "--quiet", "--trace", str(run / name)) == 2
    assert "names a file the run in" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("name", ["", "checkpoints"])
def test_a_trace_that_names_a_folder_the_run_makes_is_refused(tmp_path, capsys, name):
    """--trace naming the run's own folder or its checkpoints/, which a new run has not made yet (the check for a
    folder passed): the run trained, then could not write the trace ("Is a directory") and ended with exit code 0
    and no trace. Refused before anything is made."""
    run = tmp_path / "run"
    assert train("--steps", "1", "--out", str(run), "--quiet", "--trace", str(run / name), *SHORT) == 2
    err = capsys.readouterr().err
    assert f"names a folder the run in {run} makes (the run's own, or its checkpoints/)" in err, err
    assert not run.exists()


def test_a_trace_written_to_a_link_or_a_device_keeps_it(tmp_path):
    """The trace is written to a temporary file renamed over its path: a symbolic link became a plain file, and a
    device a plain file (as root, --trace /dev/null replaced the system's). A link stays a link, its target
    written; a device (a named pipe here: no root needed) is written in place."""
    target, link, pipe = tmp_path / "target.json", tmp_path / "link.json", tmp_path / "pipe"
    target.write_text("old")
    link.symlink_to(target)
    os.mkfifo(pipe)
    received = []
    reader = threading.Thread(target=lambda: received.append(pipe.read_bytes()))
    reader.start()
    for path in (link, pipe):
        assert train("--steps", "1", "--out", str(tmp_path / f"run-{path.name}"), "--quiet", "--trace", str(path),
                     *SHORT) == 0
    reader.join(timeout=30)
    assert link.is_symlink() and json.loads(target.read_text())["traceEvents"]
    assert pipe.is_fifo() and json.loads(received[0])["traceEvents"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "pipe", "run-link.json", "run-pipe",
                                                           "target.json"]


def test_async_resume_applies_every_batch_once_when_pushes_land_out_of_order(tmp_path, monkeypatch):
    """Note [Which batches an async checkpoint holds]: the worker computing batch 0 is slow, so push 1 applies batch
    1 while batch 0 is in flight. The checkpoint after push 1 holds batch 1 only: a resume from it computes batch 0
    and never batch 1 again (resuming at a count of batches applied batch 1 twice and never batch 0)."""
    import threading

    import pyengine.data
    import pyengine.workers

    slow, batch, compute = set(), pyengine.data.Dataset.batch, pyengine.workers.Worker.compute
    second_taken = threading.Event()

    def marked(self, step, *args):
        out = batch(self, step, *args)
        if step == 0:
            slow.add(id(out))
        if step == 2:  # taken once push 1 was applied (the other worker pulls, then takes its next batch)
            second_taken.set()
        return out

    def slowed(self, loss_fn, batches, *args, **kwargs):
        if any(id(b) in slow for b in batches):
            second_taken.wait(30)
        return compute(self, loss_fn, batches, *args, **kwargs)

    monkeypatch.setattr(pyengine.data.Dataset, "batch", marked)
    monkeypatch.setattr(pyengine.workers.Worker, "compute", slowed)
    run = tmp_path / "run"
    assert train("--mode", "async", "--steps", "8", "--checkpoint-every", "1", "--keep", "10", "--out", str(run),
                 "--quiet", *SHORT) == 0
    first = [json.loads(line)["batches"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert first[0] == [1] and [0] in first, first
    saved = ckpt.load(ckpt.path_for(run / "checkpoints", 1))
    assert (saved["batches_done"], saved["batches_beyond"]) == (0, [1])
    slow.clear()
    assert train("--resume", str(ckpt.path_for(run / "checkpoints", 1)), "--steps", "8", "--quiet") == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    applied = [b for line in lines for b in line["batches"]]
    assert [line["step"] for line in lines] == list(range(1, 9))
    assert sorted(applied) == sorted(set(applied)) and 0 in applied and applied[0] == 1, applied


def test_resume_of_a_bare_file_name_inside_checkpoints_forks_the_run(tmp_path, monkeypatch, capsys):
    """``--resume step-N.pyeckpt`` from inside the run's checkpoints/ (no folder in the path) continued as a new
    run nested in checkpoints/ and left the real run unforked; from inside a superseded-* folder it was resumed."""
    run = tmp_path / "run"
    assert train("--steps", "4", "--checkpoint-every", "2", "--out", str(run), "--quiet", *SHORT) == 0
    monkeypatch.chdir(run / "checkpoints")
    assert train("--resume", ckpt.path_for(Path("."), 2).name, "--steps", "3", "--quiet") == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [ckpt.path_for(run, n).name for n in (2, 3)]
    [aside] = run.glob("superseded-*")
    monkeypatch.chdir(aside)
    capsys.readouterr()
    assert train("--resume", ckpt.path_for(Path("."), 4).name, "--steps", "5", "--quiet") == 2
    assert "belongs to a continuation that a resume set aside" in capsys.readouterr().err


def test_a_relative_trace_path_is_written_to_the_same_place_by_a_resume_from_elsewhere(tmp_path, monkeypatch):
    """The run's --trace is inherited by a resume: a relative one was taken from the resuming shell's working
    directory (the trace landed elsewhere)."""
    first, other = tmp_path / "first", tmp_path / "other"
    first.mkdir()
    other.mkdir()
    monkeypatch.chdir(first)
    assert train("--steps", "2", "--out", str(tmp_path / "run"), "--trace", "t.json", "--quiet", *SHORT) == 0
    (first / "t.json").unlink()
    monkeypatch.chdir(other)
    assert train("--resume", str(tmp_path / "run"), "--steps", "3", "--quiet") == 0
    assert (first / "t.json").exists() and not (other / "t.json").exists()


def test_a_resume_of_a_run_already_done_keeps_its_trace_and_its_phase_means(tmp_path):
    """A resume that trains nothing (the run had its steps) replaced the run's trace by an empty one and wrote every
    phase mean of summary.json as null; both stay now. A resume that trains writes its own trace, as before."""
    run, trace = tmp_path / "run", tmp_path / "t.json"
    assert train("--steps", "3", "--out", str(run), "--trace", str(trace), "--quiet", *SHORT) == 0
    written, before = trace.read_bytes(), json.loads((run / "summary.json").read_text())
    assert json.loads(written)["traceEvents"] and before["phases_mean_s"]["update_s"] is not None
    assert train("--resume", str(run), "--quiet") == 0  # at step 3 of 3
    after = json.loads((run / "summary.json").read_text())
    assert trace.read_bytes() == written and after["trace"] == str(trace)
    assert after["phases_mean_s"] == before["phases_mean_s"], after["phases_mean_s"]
    assert after["overlap_efficiency_mean"] == before["overlap_efficiency_mean"] is not None
    assert train("--resume", str(run), "--steps", "4", "--quiet") == 0
    assert trace.read_bytes() != written and json.loads(trace.read_bytes())["traceEvents"]


def test_the_progress_line_of_a_first_step_shows_its_own_rate(capsys):
    """Progress showed samples/s 0 for the first step after a start or a resume (a window of one step); it shows
    that step's own rate, then the window's."""
    from pyengine.cli import Progress

    progress = Progress("hybrid", total=3, initial=0, quiet=False, log_every=1)
    progress.update({"step": 1, "loss": 1.0, "samples": 64, "elapsed_s": 0.5, "samples_per_s": 1280.0})
    progress.update({"step": 2, "loss": 1.0, "samples": 64, "elapsed_s": 1.0, "samples_per_s": 999.0})
    lines = capsys.readouterr().out.splitlines()
    assert "samples/s 1,280" in lines[0] and "samples/s 128 " in lines[1], lines  # 64 samples in 0.5 s


def test_a_trace_that_cannot_be_written_leaves_the_run_complete(tmp_path, capsys, monkeypatch):
    """The trace is written after the run's last checkpoint: its failure (a full disk) ended a run whose training
    was saved as "training failed", with no evaluation and no summary. It is a warning; the run completes."""
    def full_disk(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pyengine.Engine, "trace", full_disk)
    run = tmp_path / "run"
    assert train("--steps", "2", "--out", str(run), "--trace", str(tmp_path / "t.json"), "--quiet", *SHORT) == 0
    err = capsys.readouterr().err
    assert "warning: the trace could not be written to" in err and "No space left on device" in err, err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["trace"] is None and summary["test_accuracy"] is not None
    assert not (tmp_path / "t.json").exists()


def test_a_copied_or_moved_run_writes_its_trace_in_its_own_folder_and_no_other_runs(tmp_path, capsys):
    """Note [Where a resumed run writes its trace]: a checkpoint copied into a new run directory (as the message
    about set-aside checkpoints suggests) wrote the trace into the first run's folder, over its trace.json; a
    moved run re-created its old folder for it. A trace inside the run moves with it; one outside is not written
    by a resume in another directory (a note says so) unless --trace names one; the same run still writes it."""
    first, copy_, outside = tmp_path / "first", tmp_path / "copy", tmp_path / "traces" / "t.json"
    assert train("--steps", "2", "--out", str(first), "--trace", str(first / "trace.json"), "--quiet", *SHORT) == 0
    original = (first / "trace.json").read_bytes()
    (copy_ / "checkpoints").mkdir(parents=True)
    shutil.copy(ckpt.latest(first / "checkpoints"), copy_ / "checkpoints")
    assert train("--resume", str(copy_), "--steps", "3", "--quiet") == 0
    assert (first / "trace.json").read_bytes() == original and (copy_ / "trace.json").exists()
    moved = tmp_path / "moved"
    first.rename(moved)
    assert train("--resume", str(moved), "--steps", "3", "--quiet") == 0
    assert not first.exists() and (moved / "trace.json").read_bytes() != original
    assert json.loads((moved / "summary.json").read_text())["trace"] == str(moved / "trace.json")

    second = tmp_path / "second"
    assert train("--steps", "2", "--out", str(second), "--trace", str(outside), "--quiet", *SHORT) == 0
    written = outside.read_bytes()
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    shutil.copy(ckpt.latest(second / "checkpoints"), other / "checkpoints")
    capsys.readouterr()
    assert train("--resume", str(other), "--steps", "3", "--quiet") == 0
    assert outside.read_bytes() == written and json.loads((other / "summary.json").read_text())["trace"] is None
    assert f"wrote its trace to {outside}, outside it; this resume is in another directory and writes no " \
           "trace (give --trace to write one)" in capsys.readouterr().err
    assert train("--resume", str(second), "--steps", "3", "--quiet") == 0  # the same run: the same file
    assert outside.read_bytes() != written


def test_a_checkpoint_copied_into_a_new_directory_counts_the_samples_trained_before_it(tmp_path):
    """The new directory has no metrics.jsonl: its summary counted the resumed run's samples only, and divided them
    by the whole run's training time (a rate ~15x too low). The checkpoint counts them."""
    first, copy_ = tmp_path / "first", tmp_path / "copy"
    assert train("--steps", "4", "--out", str(first), "--quiet", *SHORT) == 0
    (copy_ / "checkpoints").mkdir(parents=True)
    shutil.copy(ckpt.latest(first / "checkpoints"), copy_ / "checkpoints")
    for run in (copy_, first):
        assert train("--resume", str(run), "--steps", "6", "--quiet") == 0
        summary = json.loads((run / "summary.json").read_text())
        assert summary["samples"] == 6 * 32 and summary["train_s"] > summary["this_run_train_s"], run
        assert summary["samples_per_s"] == pytest.approx(summary["samples"] / summary["train_s"])
    assert len((copy_ / "metrics.jsonl").read_text().splitlines()) == 2  # the premise: 2 of the 6 steps there


def test_a_mode_all_resume_from_elsewhere_writes_its_traces_where_the_run_did(tmp_path, monkeypatch):
    """config.json kept --trace as given: a relative one was taken from the resuming shell's working directory."""
    first, other = tmp_path / "first", tmp_path / "other"
    first.mkdir()
    other.mkdir()
    monkeypatch.chdir(first)
    stop_after_first_mode = ["--steps", "2", "--out", str(tmp_path / "all"), "--trace", "t.json", "--quiet"]
    assert train("--mode", "all", *stop_after_first_mode, *SHORT) == 0
    for file in first.glob("t-*.json"):
        file.unlink()
    (tmp_path / "all" / "async" / "summary.json").unlink()  # async is trained again by the resume
    monkeypatch.chdir(other)
    assert train("--resume", str(tmp_path / "all"), "--steps", "2", "--quiet") == 0
    assert (first / "t-async.json").exists() and not list(other.iterdir())


def test_an_out_folder_with_a_plot_of_the_users_is_refused(tmp_path):
    """--out names a folder that is not a run's but holds a file the run would write: refused, the file kept."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "loss.png").write_bytes(b"my plot")
    code = train("--steps", "1", "--out", str(folder), "--quiet", *SHORT)
    assert code == 2 and (folder / "loss.png").read_bytes() == b"my plot"
    assert sorted(p.name for p in folder.iterdir()) == ["loss.png"]


def _refuses_40_gb() -> bool:
    """Whether this machine refuses a 40 GB allocation at once (the kernel's default overcommit heuristic, with less
    memory than that), so that a test can ask for one without touching it."""
    try:
        policy = Path("/proc/sys/vm/overcommit_memory").read_text().strip()
        return policy == "0" and os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") < 32 * 2**30
    except (OSError, ValueError):
        return False


@pytest.mark.skipif(not _refuses_40_gb(), reason="needs a machine that refuses a 40 GB allocation at once")
def test_a_pipeline_too_large_to_allocate_is_one_line_as_in_hybrid_mode(tmp_path, capsys):
    """--mode pipeline (and all) built the model to count its layers before any error handling: a --hidden too
    large to allocate was a traceback there (hybrid: one line). The layers are counted on the meta device now."""
    code = train("--mode", "pipeline", "--hidden", str(10**5), "--steps", "1", "--out", str(tmp_path / "run"),
                 "--quiet", "--devices", "cpu", "--workers", "2")
    err = capsys.readouterr().err
    assert code == 1 and "training failed: RuntimeError" in err and "can't allocate memory" in err, err
    assert "Traceback" not in err


def test_a_launch_without_a_rendezvous_is_one_line(tmp_path, monkeypatch, capsys):
    """WORLD_SIZE without torchrun's other variables, or with a rendezvous nobody hosts: one line, exit 2 (both were
    tracebacks, the second after the group's timeout)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert train("--steps", "1", "--out", str(tmp_path / "run"), *SHORT) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "WORLD_SIZE=2: init_process_group: the environment lacks ['MASTER_ADDR', " \
        "'MASTER_PORT']" in err, err
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(zygote.free_port()), "PYENGINE_DIST_TIMEOUT_S": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "pyengine", "train", "--steps", "1", "--out", str(tmp_path / "r1"),
                           *SHORT], capture_output=True, text=True, timeout=120, env=env)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert last.startswith("pyengine train: error: WORLD_SIZE=2: could not join the process group at 127.0.0.1:"), last


@pytest.mark.parametrize("rank,world", [("1", None), ("2", "2"), ("-1", "2")])
def test_a_rank_outside_the_world_is_refused(tmp_path, monkeypatch, capsys, rank, world):
    """RANK=1 left in the environment with no WORLD_SIZE: the lone process took itself for rank 1, trained, printed
    nothing, wrote nothing and exited 0."""
    monkeypatch.setenv("RANK", rank)
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    assert train("--steps", "1", "--out", str(tmp_path / "run"), *SHORT) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: RANK={rank} is not a rank of WORLD_SIZE={world or 1}" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", ["--out", "--trace", "--resume"])
def test_an_empty_path_is_refused(flag, capsys):
    """``--out "$OUT"`` with OUT unset: refused, not taken for the default (it wrote runs/<time> in the cwd)."""
    with pytest.raises(SystemExit) as exit_:
        train(flag, "", "--steps", "1", *SHORT)
    assert exit_.value.code == 2 and f"argument {flag}: expected a path; got ''" in capsys.readouterr().err


def test_the_first_checkpoint_makes_its_folder_durable(tmp_path, monkeypatch):
    """A save that creates checkpoints/ also syncs the folder that holds it (the new entry), later saves only the
    checkpoints folder."""
    synced = []
    monkeypatch.setattr(ckpt, "_fsync_dir", lambda directory: synced.append(Path(directory)))
    ckpt.save(tmp_path / "run" / "checkpoints", 1, {"x": 1})
    ckpt.save(tmp_path / "run" / "checkpoints", 2, {"x": 2})
    assert synced == [tmp_path / "run" / "checkpoints", tmp_path / "run", tmp_path / "run" / "checkpoints"]


def test_checkpoints_past_eight_digits_are_listed_in_step_order(tmp_path):
    """Names have 8 digits or more: step 10**8 has 9, and lists (by its number, not its name) after 99999999,
    so latest() and a resume take it and prune() counts it."""
    folder = tmp_path / "checkpoints"
    for step in (99999999, 10 ** 8, 7):
        ckpt.save(folder, step, {"step": step})
    assert [ckpt.step_of(p) for p in ckpt.list_checkpoints(folder)] == [7, 99999999, 10 ** 8]
    assert ckpt.latest(folder).name == "step-100000000.pyeckpt" and ckpt.load(ckpt.latest(folder)) == {"step": 10 ** 8}
    ckpt.prune(folder, 1)
    assert [p.name for p in folder.iterdir()] == ["step-100000000.pyeckpt"]


def test_a_checkpoint_saved_again_replaces_itself_under_keep(tmp_path):
    """Saving the newest step again with keep=1 (a run's final save after its last periodic one) is no older step:
    it replaces the file."""
    folder = tmp_path / "checkpoints"
    ckpt.save(folder, 5, {"x": 1}, keep=1)
    ckpt.save(folder, 5, {"x": 2}, keep=1)
    assert ckpt.load(ckpt.latest(folder)) == {"x": 2} and len(ckpt.list_checkpoints(folder)) == 1
    with pytest.raises(ValueError, match=r"step 4 is older than the newest 1 kept"):
        ckpt.save(folder, 4, {"x": 3}, keep=1)


def test_a_well_formed_file_that_holds_no_dict_is_a_checkpoint_error(tmp_path):
    """The hash matches, the payload decodes, but it is a list: CheckpointError naming it (not an AttributeError
    from the caller that reads it as a state)."""
    import hashlib
    import io
    buffer = io.BytesIO()
    torch.save([1, 2], buffer)
    data = buffer.getvalue()
    path = tmp_path / "step-00000001.pyeckpt"
    path.write_bytes(ckpt.MAGIC + ckpt._HEADER.pack(ckpt.FORMAT_VERSION, len(data), hashlib.sha256(data).digest())
                     + data)
    with pytest.raises(ckpt.CheckpointError, match=r"holds a list, not a pyengine training state"):
        ckpt.load(path)


def _with_attribute(tensor, **attributes):
    for name, value in attributes.items():
        setattr(tensor, name, value)
    return tensor


class _TensorSubclass(torch.Tensor):
    """A tensor subclass: torch.save writes it, torch.load(weights_only=True) refuses to rebuild it."""


@pytest.mark.parametrize("payload,where", [
    ({"schedule": pyengine.WarmupCosine(warmup_steps=2)}, r"payload\['schedule'\] is a WarmupCosine"),
    ({"x": {"deep": [1, object()]}}, r"payload\['x'\]\['deep'\]\[1\] is a object"),
    ([1, 2], r"payload must be a dict; got list"),
    ({"w": [torch.ones(2).as_subclass(_TensorSubclass)]}, r"payload\['w'\]\[0\] is a _TensorSubclass, a tensor "),
    ({"w": torch.empty(3, device="meta")}, r"payload\['w'\] is a meta tensor: it has no values"),
    # torch.save keeps a tensor's Python attributes, and a numpy scalar among them does not load
    ({"w": _with_attribute(torch.ones(2), scale=np.float32(0.5))}, r"payload\['w'\]\.scale is a float32"),
])
def test_save_refuses_a_payload_that_would_not_load_and_keeps_the_last_good_one(tmp_path, payload, where):
    """torch.save pickles anything; load reads with weights_only: such a file never loaded, and keep=1 had pruned
    the good checkpoint before it."""
    folder = tmp_path / "checkpoints"
    ckpt.save(folder, 1, {"x": 1})
    with pytest.raises(ValueError, match=where):
        ckpt.save(folder, 2, payload, keep=1)
    assert [p.name for p in folder.iterdir()] == ["step-00000001.pyeckpt"]


def test_save_keeps_parameters_and_plain_tensors_it_can_read_back(tmp_path):
    weight = torch.nn.Parameter(torch.randn(5))
    ckpt.save(tmp_path, 3, {"w": weight, "t": torch.arange(4), "a": _with_attribute(torch.ones(2), scale=3)})
    back = ckpt.load(ckpt.latest(tmp_path))
    assert torch.equal(back["w"], weight.detach()) and torch.equal(back["t"], torch.arange(4))
    assert back["a"].scale == 3  # an attribute that loads is kept


def test_save_checks_a_shared_or_cyclic_payload_once_per_object(tmp_path, monkeypatch):
    """A container or tensor met again is checked once, as torch.save writes it once: 20 nested dicts each holding
    the next twice took 2**21 checks (1.8 s; a few more levels hung the save), and a list holding itself raised
    RecursionError. Both are saved and read back as they were."""
    shared = {"t": torch.arange(3)}
    for _ in range(20):
        shared = {"a": shared, "b": shared}
    cyclic = [torch.ones(2)]
    cyclic.append(cyclic)
    calls = []
    check = ckpt._check_payload
    monkeypatch.setattr(ckpt, "_check_payload", lambda *args: calls.append(1) or check(*args))
    ckpt.save(tmp_path, 1, {"shared": shared, "cyclic": cyclic})
    assert len(calls) < 200, len(calls)  # 20 dicts x (2 keys + 2 values) + the rest
    back = ckpt.load(ckpt.latest(tmp_path))
    inner = back["shared"]
    for _ in range(20):
        assert inner["a"] is inner["b"]
        inner = inner["a"]
    assert torch.equal(inner["t"], torch.arange(3))
    assert back["cyclic"][1] is back["cyclic"] and torch.equal(back["cyclic"][0], torch.ones(2))
    with pytest.raises(ValueError, match=r"payload\['cyclic'\]\[2\] is a object"):  # refused as before
        cyclic.append(object())
        ckpt.save(tmp_path, 2, {"cyclic": cyclic})


def test_only_exact_checkpoint_names_are_listed(tmp_path):
    """A stray "step-00000009.pyeckpt\\n" (a newline: "$" matched before it) became latest, and prune(1) deleted the
    real checkpoint; non-ASCII digits matched \\d."""
    ckpt.save(tmp_path, 5, {"x": 5})
    for stray in ("step-00000009.pyeckpt\n", "step-0000000\u0669.pyeckpt"):
        (tmp_path / stray).write_bytes(b"not a checkpoint")
    assert ckpt.latest(tmp_path) == ckpt.path_for(tmp_path, 5)
    ckpt.prune(tmp_path, 1)
    assert ckpt.path_for(tmp_path, 5).exists()


def test_save_refuses_a_step_it_would_prune_at_once_and_steps_that_name_no_checkpoint(tmp_path):
    """An older step with keep: written, then deleted by its own prune (the returned path did not exist); a
    negative step made a name that no listing, latest() or prune() sees."""
    folder = tmp_path / "checkpoints"
    ckpt.save(folder, 10, {"x": 10})
    with pytest.raises(ValueError, match=r"step 5 is older than the newest 1 kept .* pruning would delete it"):
        ckpt.save(folder, 5, {"x": 5}, keep=1)
    assert ckpt.save(folder, 5, {"x": 5}, keep=2).exists()  # within the two kept
    for bad in (-1, 2.0, True, "3"):
        with pytest.raises(ValueError, match=r"step must be an int >= 0"):
            ckpt.save(folder, bad, {"x": 0})
    assert [ckpt.step_of(p) for p in ckpt.list_checkpoints(folder)] == [5, 10]
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]


def test_two_writers_into_one_folder_keep_each_others_temporary_files(tmp_path):
    """Each save removed every temporary file it found, another writer's too, just before that one's rename
    (FileNotFoundError): only those older than STALE_TMP_S (a crashed writer's) are removed now."""
    folder = tmp_path / "checkpoints"
    errors = []

    def writer(base):
        try:
            for step in range(base, base + 25):
                ckpt.save(folder, step, {"x": torch.zeros(4096)})
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(base,)) for base in (0, 1000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(ckpt.list_checkpoints(folder)) == 50


def test_load_holds_one_copy_of_the_file(tmp_path):
    """load read the whole file, then sliced the payload out of it: two copies of a large checkpoint at once, on
    top of its tensors. Python allocations measured: the file's bytes once (torch's tensors are not Python's)."""
    import tracemalloc

    path = ckpt.save(tmp_path, 1, {"x": torch.zeros(5 * 2**20 // 4)})  # 5 MiB
    size = path.stat().st_size
    tracemalloc.start()
    try:
        ckpt.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * size, (peak, size)


def test_a_folder_named_like_a_checkpoint_is_not_one(tmp_path):
    """list_checkpoints took a folder named step-*.pyeckpt for the newest checkpoint: prune then failed on it."""
    folder = tmp_path / "checkpoints"
    for step in (1, 2):
        ckpt.save(folder, step, {"x": step})
    ckpt.path_for(folder, 9).mkdir()
    assert [ckpt.step_of(p) for p in ckpt.list_checkpoints(folder)] == [1, 2]
    ckpt.save(folder, 3, {"x": 3}, keep=1)
    assert [ckpt.step_of(p) for p in ckpt.list_checkpoints(folder)] == [3] and ckpt.path_for(folder, 9).is_dir()


def test_checkpoint_files_follow_the_umask(tmp_path):
    """mkstemp made every checkpoint 0600 whatever the umask (the run's other files: 0644 under umask 022)."""
    old = os.umask(0o022)
    try:
        path = ckpt.save(tmp_path, 1, {"x": 1})
    finally:
        os.umask(old)
    assert (path.stat().st_mode & 0o777) == (0o666 & ~ckpt._UMASK)
    assert ckpt.load(path) == {"x": 1}


def test_a_filesystem_without_unix_modes_still_takes_checkpoints(tmp_path, monkeypatch):
    """On a filesystem without Unix permissions (vfat, some network mounts) fchmod fails: the checkpoint is written
    with the filesystem's own modes, and no descriptor is left open (a failed fchmod leaked one per save, and
    failed the save)."""
    def refused(fd, mode):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "fchmod", refused)
    before = len(os.listdir("/proc/self/fd"))
    paths = [ckpt.save(tmp_path, step, {"x": step}) for step in range(1, 6)]
    assert len(os.listdir("/proc/self/fd")) == before
    assert [ckpt.load(p) for p in paths] == [{"x": step} for step in range(1, 6)]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_run_stopped_before_its_first_checkpoint_says_so_on_resume_and_on_out(tmp_path, capsys):
    """A run killed before its first checkpoint leaves only metrics.jsonl: --resume said "no checkpoint" and --out
    said "continue it with --resume", each pointing at the other."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert train("--resume", str(run), "--quiet") == 2
    assert "the run there saved none (it ended before its first checkpoint)" in capsys.readouterr().err
    assert train("--steps", "2", "--out", str(run), "--quiet", *SHORT) == 2
    err = capsys.readouterr().err
    assert "holds a run that saved no checkpoint" in err and "--resume" not in err
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing removed


def test_resume_of_a_folder_without_a_run_says_what_to_do(tmp_path, capsys):
    """A run killed after it made --out and before it wrote anything leaves an empty folder: --resume said "no
    checkpoint" and nothing more."""
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train("--resume", str(empty), "--quiet") == 2
    assert f"the folder is empty (a run stopped before it wrote anything?): start a new run with --out {empty}" in \
        capsys.readouterr().err
    assert train("--steps", "2", "--out", str(empty), "--quiet", *SHORT) == 0  # what it says works
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    assert train("--resume", str(other), "--quiet") == 2
    assert "--resume takes the directory of a pyengine train run or one of its checkpoint files" in \
        capsys.readouterr().err


def test_the_printed_resume_command_pastes_into_a_shell(tmp_path, capsys):
    """The resume command of a failure in a folder with a space and parentheses is quoted for the shell."""
    import shlex

    import pyengine.data

    run = tmp_path / "has space" / "run (1)"
    batch = pyengine.data.Dataset.batch

    def failing(self, step, *args):
        if step == 3:
            raise RuntimeError("injected data failure")
        return batch(self, step, *args)

    pyengine.data.Dataset.batch = failing
    try:
        assert train("--steps", "6", "--out", str(run), "--quiet", *SHORT) == 1
    finally:
        pyengine.data.Dataset.batch = batch
    err = capsys.readouterr().err
    command = err[err.index("resume with ") + len("resume with "):].splitlines()[0]
    assert shlex.split(command) == ["python", "-m", "pyengine", "train", "--resume", str(run)], command


@pytest.mark.parametrize("edit,message", [
    (lambda p: p.update(config=[]), "its config must be a dict; got 'list'"),
    (lambda p: p["config"].pop("devices"), "its config lacks ['devices']"),
    (lambda p: p.update(step="four"), "its step must be an int >= 0; got 'four'"),
    (lambda p: p.update(step=2), "its name says step 4, its contents another; got 2"),
    (lambda p: p.update(batches_done=-5), "its batches_done must be an int >= 0; got -5"),
    (lambda p: p.update(batches_beyond=[1]), "its batches_beyond must be distinct ints > its batches_done"),
    (lambda p: p.update(elapsed_s=float("nan")), "its elapsed_s must be a number of seconds >= 0"),
    (lambda p: p.update(mode="sync"), "its mode and its config's must be one of"),
    # settings no command line could give: each read back through its flag's parser
    (lambda p: p["config"].update(batch_size="32"), "its batch_size is not a value of --batch-size; got '32'"),
    (lambda p: p["config"].update(hidden=0),
     "its hidden is not a value of --hidden (expected an integer in [1, 2**20]"),
    (lambda p: p["config"].update(lr=-1.0), "its lr is not a value of --lr"),
    (lambda p: p["config"].update(accumulate="x"), "its accumulate is not a value of --accumulate"),
    (lambda p: p["config"].update(data="imagenet"), "its data must be one of digits, tokens; got 'imagenet'"),
    (lambda p: p["config"].update(autocast="fp8"), "its autocast must be one of none, bf16, fp16; got 'fp8'"),
    (lambda p: p["config"].update(devices=5), "its devices must be a non-empty list of device names; got 5"),
    (lambda p: p["config"].update(devices=["cpu"], rank_devices=[["cpu"]]), "its rank_devices must be a list of "
     "every rank's devices (a non-empty list of device names each, rank 0's its devices); got [['cpu']]"),
    (lambda p: p["config"].update(devices=["cpu"], rank_devices=[["cpu", "cpu"], ["cpu"]]),
     "its rank_devices must be a list of every rank's devices"),
    (lambda p: p["config"].update(devices=["cpu"], rank_devices=[["cpu"], []]),
     "its rank_devices must be a list of every rank's devices"),
    (lambda p: p["config"].update(seed=None), "its seed must be set; got None"),
    (lambda p: p["config"].update(steps=None, epochs=None), "its steps or its epochs must be set; got None for both"),
    # the trace's path was not checked: an int failed later as a TypeError traceback ("training failed")
    (lambda p: p["config"].update(trace=5), "its trace must be a path or null; got 5"),
    (lambda p: p["config"].update(trace="t.json", trace_anchor=["x"]), "its trace_anchor must be a path or null"),
], ids=["config-list", "no-devices", "step-str", "step-name", "batches-neg", "beyond", "elapsed-nan", "mode",
        "batch-str", "hidden-0", "lr-neg", "accumulate-str", "data", "autocast", "devices-int", "ranks-one",
        "ranks-not-rank-0", "ranks-empty", "seed-none",
        "no-length", "trace-int", "trace-anchor-list"])
def test_a_checkpoint_with_an_unusable_payload_is_a_clear_error(finished_run, tmp_path, capsys, edit, message):
    """A checkpoint whose hash is right but whose contents are not those of a train run (another writer, a hand
    edit) is one line "cannot resume", not a traceback or a resume that says one step and trains from another."""
    run = tmp_path / "copy"
    (run / "checkpoints").mkdir(parents=True)
    source = ckpt.latest(finished_run / "checkpoints")
    payload = ckpt.load(source)
    edit(payload)
    ckpt.save(run / "checkpoints", 4, payload)
    assert train("--resume", str(run), "--steps", "6") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pyengine train: error: cannot resume:") and message in err[0], err


def test_checkpoint_keep_must_keep_one(tmp_path):
    """keep=0 kept every checkpoint while its docstring promised to delete all but the newest 0: now an error,
    raised before anything is written."""
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="keep must be an int >= 1"):
            ckpt.save(tmp_path / "c", 1, {"x": 1}, keep=bad)
        with pytest.raises(ValueError, match="keep must be an int >= 1"):
            ckpt.prune(tmp_path / "c", bad)
    assert not (tmp_path / "c").exists()
    for step in (1, 2, 3):
        ckpt.save(tmp_path / "c", step, {"x": step}, keep=2)
    assert [ckpt.step_of(p) for p in ckpt.list_checkpoints(tmp_path / "c")] == [2, 3]


def test_pipeline_run_learns_with_its_options(tmp_path):
    """--mode pipeline with every pipeline flag and bf16 autocast: the loss falls and the run directory holds the
    stages' metrics."""
    out = tmp_path / "pipe"
    assert train("--mode", "pipeline", "--steps", "30", "--stages", "2", "--microbatches", "3", "--schedule",
                 "gpipe", "--balance", "time", "--autocast", "bf16", "--lr", "1e-2", "--out", str(out), "--quiet",
                 *SHORT) == 0
    summary = check_run_dir(out, "pipeline", 30)
    assert (summary["stages"], summary["microbatches"], summary["schedule"], summary["balance"]) == (
        2, 3, "gpipe", "time")
    assert len(summary["stage_sizes"]) == 2 and sum(summary["stage_sizes"]) == 5  # the MLP's 5 layers
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["replicas"] == 1 and r["bubble_ideal"] == pytest.approx(1 / 4) for r in lines)
    first, last = lines[0]["loss"], sum(r["loss"] for r in lines[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    assert summary["test_accuracy"] > 0.5  # 10 classes: chance is 0.1


def test_pipeline_explicit_balance(tmp_path):
    """--balance 3,2: the MLP's 5 layers cut as given (balance="params" would give [1, 4])."""
    out = tmp_path / "pipe"
    assert train("--mode", "pipeline", "--steps", "2", "--balance", "3,2", "--out", str(out), "--quiet", *SHORT) == 0
    summary = check_run_dir(out, "pipeline", 2)
    assert summary["balance"] == [3, 2] and summary["stage_sizes"] == [3, 2]


def test_pipeline_transformer_as_layers(tmp_path):
    out = tmp_path / "tok"
    assert train("--data", "tokens", "--mode", "pipeline", "--steps", "3", "--hidden", "32", "--batch-size", "8",
                 "--devices", "cpu", "--workers", "2", "--microbatches", "2", "--out", str(out), "--quiet") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "transformer" and summary["steps"] == 3 and sum(summary["stage_sizes"]) == 5
    assert summary["final_loss"] is not None and summary["final_loss"] > 0


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ck") / "run"
    assert main(["train", "--steps", "4", "--out", str(out), "--quiet", *SHORT]) == 0
    return out


@pytest.mark.parametrize("damage,message", [
    (lambda b: b[: len(b) // 2], "is truncated"),
    (lambda b: b[:10], "is truncated"),
    (lambda b: b"PK\x03\x04 some zip from another program" + b[40:], "is not a pyengine checkpoint"),
    (lambda b: b[:-100] + bytes(x ^ 0xFF for x in b[-100:]), "is corrupted"),
    (lambda b: b + b"\0", "has trailing bytes"),
    # a header whose length field says 2**60 bytes: told from the file's size, nothing that large read
    (lambda b: b[:len(ckpt.MAGIC) + 4] + (2 ** 60).to_bytes(8, "little") + b[len(ckpt.MAGIC) + 12:], "is truncated"),
], ids=["half", "header", "foreign", "bitflip", "trailing", "huge-length"])
def test_damaged_checkpoint_is_a_clear_error(finished_run, tmp_path, capsys, damage, message):
    run = tmp_path / "copy"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text((finished_run / "metrics.jsonl").read_text())
    source = ckpt.latest(finished_run / "checkpoints")
    (run / "checkpoints" / source.name).write_bytes(damage(source.read_bytes()))
    assert train("--resume", str(run), "--steps", "6") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pyengine train: error: cannot resume:") and message in err[0], err
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.load(run / "checkpoints" / source.name)


@pytest.mark.parametrize("argv,message", [
    (["--mode", "sync", "--accumulate", "2"], "--accumulate is an async option"),
    (["--devices", "cuda:99"], "cuda:99"),
    (["--devices", "tpu"], "'tpu'"),
    (["--mode", "sync", "--devices", "cpu", "--workers", "1500"], "1500 workers but only 1437 training samples"),
    (["--devices", "cpu", "--workers", "8", "--batch-size", "4"], "cannot feed 8 workers"),
    (["--model", "transformer"], "--model transformer does not fit --data digits"),
    (["--out", "{file}/sub"], "cannot write to --out"),
    (["--resume", "{missing}"], "no such file or directory"),
    (["--mode", "hybrid", "--stages", "2"], "--stages: pipeline option; --mode hybrid has no stages"),
    (["--microbatches", "2", "--schedule", "gpipe"], "--schedule: pipeline option; --mode hybrid has no stages"),
    (["--mode", "async", "--microbatches", "2"], "async workers sum mini-batches before a push with --accumulate"),
    (["--devices", "cpu", "--workers", "2", "--batch-size", "7", "--microbatches", "4"],
     "--microbatches 4: --batch-size 7 leaves a worker fewer samples than micro-batches (use --batch-size >= 8)"),
    (["--mode", "sync", "--batch-size", "3", "--microbatches", "4"], "(use --batch-size >= 4)"),
    (["--mode", "pipeline", "--devices", "cpu", "--workers", "2", "--stages", "3"], "--stages 3 does not divide the 2 "
     "workers: a pipeline needs stages x replicas workers (use --workers 3 or --stages that divides 2)"),
    (["--mode", "pipeline", "--devices", "cpu", "--workers", "4", "--stages", "2", "--batch-size", "7",
      "--microbatches", "4"], "over 2 pipeline replica(s) cannot feed --microbatches 4"),
    (["--mode", "pipeline", "--devices", "cpu", "--workers", "6"], "--stages 6 is more than the 5 layers"),
    (["--mode", "pipeline", "--devices", "cpu", "--workers", "2", "--balance", "2,2"],
     "--balance 2,2: expected 2 layer counts (one per stage), each >= 1, summing to the 5 layers"),
    (["--mode", "pipeline", "--devices", "cpu", "--workers", "2", "--balance", "5,0"], "--balance 5,0: expected 2"),
    (["--mode", "pipeline", "--devices", "cpu", "--workers", "2", "--balance", "1,2,2"],
     "--balance 1,2,2: expected 2 layer counts"),
    (["--mode", "hybrid", "--balance", "2,3"], "--balance: pipeline option"),
    (["--trace", "{file}/t.json"], "cannot write to the --trace folder"),
    (["--data", "tokens", "--hidden", "30"], "--hidden 30: the transformer's d_model must be a multiple of its 4 "
     "attention heads (e.g. --hidden 28)"),
    (["--mode", "pipeline", "--data", "tokens", "--hidden", "6"], "--hidden 6: the transformer's d_model"),
    (["--lr", "1e38"], "--lr 1e+38 with --weight-decay 0.01: lr / (1 - beta1^step) = 1e+39 is beyond float32's"),
    (["--lr", "10", "--weight-decay", "3e38"], "1 - lr * weight_decay = "),
], ids=["sync+accumulate", "no-such-gpu", "bad-device", "workers>samples", "batch<workers", "model/data",
        "unwritable-out", "resume-missing", "stages-in-hybrid", "pipeline-flags-default-mode",
        "microbatches-in-async", "hybrid-batch<microbatches", "sync-batch<microbatches", "stages!|workers",
        "batch<microbatches", "stages>layers", "balance-sum", "balance-zero", "balance-count", "balance-in-hybrid",
        "unwritable-trace", "transformer-hidden", "pipeline-transformer-hidden", "lr-step-size", "lr-decay"])
def test_impossible_combination_is_one_line_exit_2(tmp_path, capsys, argv, message):
    (tmp_path / "file").write_text("x")
    argv = [a.format(file=tmp_path / "file", missing=tmp_path / "nope") for a in argv]
    out = tmp_path / "out"
    if "--out" not in argv and "--resume" not in argv:
        argv += ["--out", str(out)]
    assert train(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pyengine train: error:") and message in err[0], err
    assert not out.exists()  # no work was done


@pytest.mark.parametrize("argv", [["--bogus"], ["--mode", "fast"], ["--steps", "0"], ["--steps", "3", "--epochs", "1"],
                                  ["--schedule", "zb"], ["--balance", "flops"], ["--balance", "2,x"],
                                  ["--balance", "2,,3"], ["--microbatches", "0"], ["--loss-scale", "0"],
                                  ["--loss-scale", "often"], ["--loss-scale", "inf"], ["--loss-scale", "1e-50"],
                                  ["--seed", str(10 ** 23)], ["--seed", str(2 ** 64)], ["--seed", "-1"],
                                  ["--seed", "1.5"], ["--lr", "1e-50"], ["--lr", "1e300"], ["--lr", "0"],
                                  ["--weight-decay", "1e300"], ["--weight-decay", "1e-45"],
                                  ["--max-grad-norm", "1e39"],
                                  # tracebacks: a model whose size overflowed, a list of 10**11 devices
                                  ["--hidden", str(2 ** 20 + 1)], ["--hidden", str(10 ** 23)],
                                  ["--workers", "4097"], ["--workers", str(10 ** 11)]])
def test_argparse_rejects_unknown_flags_and_values(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        train(*argv)
    assert exc.value.code == 2 and "usage:" in capsys.readouterr().err


def test_out_holding_a_run_is_refused(finished_run, capsys):
    assert train("--out", str(finished_run), "--steps", "2") == 2
    assert "already holds a run; continue it with --resume" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", "loss.png"])
def test_a_resume_with_a_folder_in_place_of_a_run_file_is_refused(finished_run, tmp_path, capsys, name):
    """A folder where the resumed run's metrics.jsonl (or summary.json, its plot) belongs failed the resume after
    its set-up, as "training failed: IsADirectoryError" (exit 1), naming no remedy. Refused up front (exit 2),
    nothing changed; once moved away the resume goes on."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    moved = tmp_path / "moved"
    (run / name).rename(moved)
    (run / name).mkdir()
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    assert train("--resume", str(run), "--steps", "5", "--quiet") == 2
    assert f"cannot resume {run}: {run / name} is not a file (a folder in its place?)" in capsys.readouterr().err
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    (run / name).rmdir()
    moved.rename(run / name)
    assert train("--resume", str(run), "--steps", "5", "--quiet") == 0, capsys.readouterr().err


def test_a_resume_that_cannot_write_its_metrics_says_which_file_and_how_to_go_on(finished_run, tmp_path, capsys,
                                                                                  monkeypatch):
    """A resume whose rewrite of metrics.jsonl fails before its first step (a full disk) said "training failed:
    OSError: [Errno 28] No space left on device", naming no file and no resume command. Now it names the file,
    that nothing was trained, and the checkpoint to resume from; the run's files stay; the next resume trains."""
    import errno
    import shutil

    import pyengine.cli as cli

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    lines = (run / "metrics.jsonl").read_text()
    original = cli._write_lines

    def full_disk(path, content):
        if path.name == "metrics.jsonl":
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(path, content)

    monkeypatch.setattr(cli, "_write_lines", full_disk)
    assert train("--resume", str(run), "--steps", "6", "--quiet") == 1
    err = capsys.readouterr().err
    assert (f"training failed: OSError: {run / 'metrics.jsonl'} could not be written before the first step "
            "(nothing was trained): [Errno 28] No space left on device") in err, err
    newest = ckpt.latest(run / "checkpoints")
    assert f"step 4, the last complete one, is saved in {newest}: resume with" in err, err
    assert (run / "metrics.jsonl").read_text() == lines
    monkeypatch.setattr(cli, "_write_lines", original)
    assert train("--resume", str(run), "--steps", "6", "--quiet") == 0, capsys.readouterr().err
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, 7))


def test_out_at_a_runs_checkpoints_folder_is_refused(finished_run, tmp_path, capsys):
    """--out <run>/checkpoints trained a second run inside the first one's checkpoints folder, and `--resume
    <run>/checkpoints` (a documented form for the first run) then resumed the second. Refused, nothing written;
    so is a run's checkpoints/ not made yet (the run beside it saved nothing so far)."""
    folder = finished_run / "checkpoints"
    before = sorted(p.name for p in folder.iterdir())
    assert train("--out", str(folder), "--steps", "2", "--quiet", *SHORT) == 2
    assert f"--out {folder} is the checkpoints folder of the run in {finished_run}; choose another --out" in \
        capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == before
    early = tmp_path / "early"
    early.mkdir()
    (early / "metrics.jsonl").write_text("")
    assert train("--out", str(early / "checkpoints"), "--steps", "2", "--quiet", *SHORT) == 2
    assert "is the checkpoints folder of the run in" in capsys.readouterr().err
    assert not (early / "checkpoints").exists()
    mine = tmp_path / "mine" / "checkpoints"  # a folder of that name that belongs to no run: a run trains there
    assert train("--out", str(mine), "--steps", "1", "--quiet", *SHORT) == 0, capsys.readouterr().err
    assert ckpt.latest(mine / "checkpoints") is not None


def test_a_folder_that_only_shares_a_runs_file_names_is_no_run(tmp_path, capsys):
    """A folder with a config.json of its own, or a folder of its own named sync/, was refused as "already holds a
    run; continue it with --resume", and that --resume failed too. A one-mode run trains there (and resumes past
    the foreign config.json); a --mode all run, which would write over them, says so; --trace inside a new --out
    (its folder made first) made that --out look like a run's."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "config.json").write_text('{"my": "settings"}')
    (proj / "sync").mkdir()
    assert train("--mode", "all", "--steps", "2", "--quiet", "--out", str(proj), *SHORT) == 2
    assert "holds config.json and sync, which this run would write over" in capsys.readouterr().err
    assert train("--steps", "2", "--quiet", "--out", str(proj), *SHORT) == 0
    assert (proj / "config.json").read_text() == '{"my": "settings"}'
    assert train("--resume", str(proj), "--steps", "3", "--quiet") == 0
    assert ckpt.step_of(ckpt.latest(proj / "checkpoints")) == 3
    fresh = tmp_path / "fresh"
    assert train("--mode", "all", "--steps", "1", "--quiet", "--out", str(fresh), "--trace",
                 str(fresh / "hybrid" / "trace.json"), *SHORT) == 0, capsys.readouterr().err
    assert list((fresh / "hybrid").glob("trace*.json")), sorted((fresh / "hybrid").iterdir())
    assert train("--steps", "1", "--quiet", "--out", str(tmp_path / "f2"), "--trace",
                 str(tmp_path / "f2" / "checkpoints" / "trace.json"), *SHORT) == 0, capsys.readouterr().err


def test_largest_seed_trains_and_resumes(tmp_path):
    """--seed takes what torch.manual_seed does, 0 <= seed < 2**64 (argparse refuses the rest)."""
    out = tmp_path / "run"
    assert train("--seed", str(2 ** 64 - 1), "--steps", "2", "--quiet", "--out", str(out), *SHORT) == 0
    assert train("--resume", str(out), "--steps", "3", "--quiet") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seed"] == 2 ** 64 - 1 and summary["steps"] == 3


def _copy_run(source: Path, run: Path, edit=None) -> Path:
    """``source``'s metrics and newest checkpoint in ``run``; ``edit(payload)`` changes the checkpoint first."""
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text((source / "metrics.jsonl").read_text())
    payload = ckpt.load(ckpt.latest(source / "checkpoints"))
    if edit is not None:
        edit(payload)
    return ckpt.save(run / "checkpoints", payload["step"], payload)


def _unchanged(run: Path):
    """A snapshot of ``run``'s files, to compare after a refused resume (nothing may change)."""
    return sorted((str(p.relative_to(run)), p.read_bytes()) for p in run.rglob("*") if p.is_file())


def test_resume_with_fewer_steps_than_the_checkpoint_is_refused(finished_run, tmp_path, capsys):
    run = tmp_path / "copy"
    _copy_run(finished_run, run)
    before = _unchanged(run)
    assert train("--resume", str(run), "--steps", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps 2 ends before the checkpoint's step 4" in err[0], err
    assert _unchanged(run) == before


def test_resume_with_another_setting_is_refused_naming_what_may_change(finished_run, tmp_path, capsys):
    run = tmp_path / "copy"
    _copy_run(finished_run, run)
    before = _unchanged(run)
    assert train("--resume", str(run), "--steps", "6", "--batch-size", "16") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--batch-size 16 differs from the resumed run's 32" in err[0], err
    assert "--steps" in err[0] and "--devices/--workers for --mode hybrid/sync/async" in err[0], err
    assert _unchanged(run) == before


def test_a_pipeline_resume_takes_the_stages_it_trained_with(tmp_path, capsys):
    """--stages left out is saved as None (a stage per worker): giving that number on resume was refused as a
    change, and the refusal of another number named None."""
    run = tmp_path / "run"
    assert train("--mode", "pipeline", "--steps", "2", "--out", str(run), "--quiet", *SHORT) == 0
    assert json.loads((run / "summary.json").read_text())["stages"] == 2  # the premise
    assert train("--resume", str(run), "--steps", "3", "--stages", "2", "--quiet") == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    capsys.readouterr()
    assert train("--resume", str(run), "--steps", "4", "--stages", "1", "--quiet") == 2
    assert "--stages 1 differs from the resumed run's None (a stage per worker: 2)" in capsys.readouterr().err
    # a hybrid run has no stages: refused on resume as on a new run (it was taken when it equalled the workers)
    hybrid = tmp_path / "hybrid"
    assert train("--steps", "2", "--out", str(hybrid), "--quiet", *SHORT) == 0
    capsys.readouterr()
    assert train("--resume", str(hybrid), "--steps", "3", "--stages", "2", "--quiet") == 2
    assert "--stages: pipeline option; --mode hybrid has no stages" in capsys.readouterr().err
    # so are its other pipeline options (they said "differs from the resumed run's None"), and --microbatches on
    # an async run's resume
    for flag, value in (("--schedule", "gpipe"), ("--balance", "time"), ("--balance", "params")):
        assert train("--resume", str(hybrid), "--steps", "3", flag, value, "--quiet") == 2
        assert f"{flag}: pipeline option; --mode hybrid has no stages (use --mode pipeline)" in \
            capsys.readouterr().err
    pushed = tmp_path / "async"
    assert train("--mode", "async", "--steps", "2", "--out", str(pushed), "--quiet", *SHORT) == 0
    capsys.readouterr()
    assert train("--resume", str(pushed), "--steps", "3", "--microbatches", "2", "--quiet") == 2
    assert "--microbatches: an option of the hybrid, sync and pipeline steps; async workers sum mini-batches" in \
        capsys.readouterr().err


def test_more_accumulated_batches_than_the_epochs_hold_is_refused(tmp_path, capsys):
    """--epochs 1 --accumulate 1000 made one push of 1000 batches: about 22 epochs of the digits, without a word."""
    assert train("--mode", "async", "--epochs", "1", "--accumulate", "1000", "--out", str(tmp_path / "run"),
                 "--quiet", *SHORT) == 2
    err = capsys.readouterr().err
    assert "--accumulate 1000 batches a push is more than the 44 batches of --epochs 1 (--batch-size 32)" in err, err
    assert not (tmp_path / "run").exists()


def test_summary_line_formats():
    from pyengine.cli import _summarise
    summary = dict(mode="hybrid", steps=3, workers=1, samples_per_s=1234.5, final_loss=3.1e-5, test_accuracy=0.975,
                   wall_s=2.0)
    assert _summarise(summary) == ("[hybrid] 3 steps on 1 worker: 1,234 samples/s, final loss 3.1e-05, test "
                                   "accuracy 97.50% (2.0 s)")
    assert _summarise(dict(summary, steps=1)).startswith("[hybrid] 1 step on 1 worker: ")  # was "1 steps"
    summary.update(workers=2, processes=2, final_loss=0.25)
    assert "on 2 processes x 2 workers: " in _summarise(summary) and "final loss 0.25," in _summarise(summary)
    summary.update(engine_stats=dict(skipped_steps=3))  # every step skipped read as a run that trained
    assert _summarise(summary).startswith("[hybrid] 3 steps (3 skipped: non-finite gradients) on 2 processes")


def test_resume_is_quiet_only_when_asked(tmp_path, capsys):
    """--quiet is output of one invocation, not a setting of the run: not saved, not inherited by a resume."""
    out = tmp_path / "run"
    assert train("--steps", "2", "--quiet", "--out", str(out), *SHORT) == 0
    assert capsys.readouterr().out == ""
    assert "quiet" not in ckpt.load(ckpt.latest(out / "checkpoints"))["config"]
    assert train("--resume", str(out), "--steps", "3") == 0
    assert "[hybrid] 3 steps" in capsys.readouterr().out
    assert train("--resume", str(out), "--steps", "4", "--quiet") == 0
    assert capsys.readouterr().out == ""


def test_resume_on_devices_that_do_not_exist_is_one_line_exit_2(finished_run, tmp_path, capsys):
    run = tmp_path / "copy"
    _copy_run(finished_run, run, lambda payload: payload["config"].update(devices=["cuda:99", "cuda:99"]))
    before = _unchanged(run)
    assert train("--resume", str(run), "--steps", "6") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pyengine train: error: the resumed run's devices: 'cuda:99'") and \
        "continue it on others with --devices/--workers" in err[0], err
    assert _unchanged(run) == before


def test_resume_may_change_the_workers_of_a_sync_run(tmp_path):
    """A sync run's state is the host store's (weights, Adam state, step): it continues on 3 workers."""
    out = tmp_path / "run"
    assert train("--mode", "sync", "--steps", "2", "--quiet", "--out", str(out), *SHORT) == 0
    assert train("--resume", str(out), "--workers", "3", "--steps", "4", "--quiet") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 3 and summary["devices"] == ["cpu"] * 3 and summary["steps"] == 4
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_resume_device_changes_the_engine_or_the_mode_cannot_take(finished_run, tmp_path, capsys):
    """A pipeline keeps its devices (its stages are laid over them): refused before any work. A hybrid run moves to 3
    workers: weights, Adam state and step carry over (the workers' generators are seeded per step)."""
    pipe = tmp_path / "pipe"
    assert train("--mode", "pipeline", "--steps", "2", "--quiet", "--out", str(pipe), *SHORT) == 0
    before = _unchanged(pipe)
    assert train("--resume", str(pipe), "--workers", "3", "--steps", "3") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a resumed --mode pipeline run keeps the devices it trained on (cpu,cpu" in err[0], err
    assert _unchanged(pipe) == before
    run = tmp_path / "hybrid"
    _copy_run(finished_run, run)
    assert train("--resume", str(run), "--workers", "3", "--steps", "5", "--quiet") == 0
    assert json.loads((run / "summary.json").read_text())["workers"] == 3


def test_ctrl_c_during_start_up_is_one_line_exit_130(tmp_path, capsys, monkeypatch):
    """Ctrl-C before the run's SIGINT handler is installed (here: while the data loads): no traceback."""
    import pyengine.data

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pyengine.data, "load", interrupted)
    out = tmp_path / "run"
    try:
        code = train("--steps", "2", "--out", str(out), *SHORT)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main (a traceback)")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and err == ["pyengine train: interrupted before training started; nothing to save"], err
    assert not out.exists()


def test_ctrl_c_waits_for_the_data_to_load(tmp_path, capsys, monkeypatch, python_sigint):
    """Note [Ctrl-C while the data's libraries import]: a Ctrl-C landing inside scikit-learn's first import left
    numpy half imported and surfaced as a RecursionError traceback. Here a real SIGINT arrives while the data loads,
    and the load turns a KeyboardInterrupt into the error numpy's import gave: deferred, it never sees one."""
    import signal

    import pyengine.data

    real_load = pyengine.data.load

    def load(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # the interrupt is delivered here, unless deferred
        except KeyboardInterrupt:
            raise RecursionError("maximum recursion depth exceeded (a module left half imported)") from None
        return real_load(*args, **kwargs)

    monkeypatch.setattr(pyengine.data, "load", load)
    out = tmp_path / "run"
    code = train("--steps", "2", "--out", str(out), *SHORT)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and err == ["pyengine train: interrupted before training started; nothing to save"], err
    assert not out.exists()


def _hooked_env(tmp_path, at_import: str) -> dict:
    """An environment whose sitecustomize runs ``at_import`` (lines of Python, indented for a method body) when
    pyengine.engine is imported."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, signal, sys, time\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'pyengine.engine':\n" + at_import +
        "sys.meta_path.insert(0, Interrupt())\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))


def _start_interrupted(env: dict, out: Path) -> None:
    """`python -m pyengine train` with ``env``: one line, exit 130, nothing written."""
    run = subprocess.run([sys.executable, "-m", "pyengine", "train", "--steps", "2", "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 130 and run.stderr.splitlines() == [
        "pyengine: interrupted while starting; nothing was written"], (run.returncode, run.stderr)
    assert not out.exists()


def test_ctrl_c_while_python_m_pyengine_imports_the_package_waits_for_the_imports(tmp_path):
    """A real SIGINT while `python -m pyengine` imports the package, inside an import that turns a KeyboardInterrupt
    into another error (as numpy's did): deferred until the imports are done, then one line, exit 130. The process
    gets Python's own SIGINT handler first, as in a terminal."""
    env = _hooked_env(tmp_path, "            try:\n"
                                "                os.kill(os.getpid(), signal.SIGINT)\n"
                                "                time.sleep(0.2)\n"
                                "            except KeyboardInterrupt:\n"
                                "                raise RecursionError('a module left half imported') from None\n"
                                "signal.signal(signal.SIGINT, signal.default_int_handler)\n")
    _start_interrupted(env, tmp_path / "run")


def test_ctrl_c_while_python_m_pyengine_imports_the_package_is_one_line_exit_130(tmp_path):
    """Ctrl-C while `python -m pyengine` imports the package (torch with it), before main() runs: one line, exit 130.
    The interrupt is raised by an import hook (a sitecustomize) at the import of pyengine.engine; imported by
    anything else, the package lets the interrupt through."""
    env = _hooked_env(tmp_path, "            raise KeyboardInterrupt\n")
    _start_interrupted(env, tmp_path / "run")
    # imported by another program, even one whose own arguments say "-m pyengine": the interrupt goes through
    other = subprocess.run([sys.executable, "-c", "import pyengine", "-m", "pyengine"], env=env, capture_output=True,
                           text=True, timeout=120)
    assert other.returncode != 130 and "KeyboardInterrupt" in other.stderr, (other.returncode, other.stderr)


def test_summary_writes_leave_no_temporary_file_on_failure(tmp_path):
    from pyengine.cli import _write_lines

    path = tmp_path / "summary.json"
    path.write_text("old\n")
    with pytest.raises(TypeError):
        _write_lines(path, ["new\n", 1])  # fails half-way through the write
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_unwritable_out_leaves_no_trace_folder(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert train("--steps", "2", "--out", str(tmp_path / "file" / "sub"), "--trace",
                 str(tmp_path / "new" / "deeper" / "t.json"), *SHORT) == 2
    assert "cannot write to --out" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def _wait_for_steps(out: Path, steps: int, timeout_s: float) -> None:
    """Waits until the run in ``out`` has written ``steps`` metrics lines; fails the test when the time is up first
    (a slow start on a loaded machine is waited for; a run that never steps is reported as such)."""
    deadline, metrics = time.time() + timeout_s, out / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < steps:
        assert time.time() < deadline, f"the run wrote fewer than {steps} metrics lines in {timeout_s} s"
        time.sleep(0.2)


@pytest.mark.parametrize("mode", ["hybrid", "async"])  # async: the stop leaves fit from a callback, as itself
def test_ctrl_c_saves_a_checkpoint_and_says_how_to_resume(tmp_path, mode):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "pyengine", "train", "--mode", mode, "--steps", "100000", "--out",
                             str(out), "--checkpoint-every", "100000", *SHORT], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps(out, 5, 180)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert f"resume with: python -m pyengine train --resume {out}" in stderr and "Traceback" not in stderr
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["interrupted"] and stopped["steps"] >= 5
    assert ckpt.latest(out / "checkpoints").name == f"step-{stopped['steps']:08d}.pyeckpt"
    assert train("--resume", str(out), "--steps", str(stopped["steps"] + 3), "--quiet") == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == stopped["steps"] + 3


# ---- under torchrun (Note [Training under torchrun]) ----

def _torchrun(tmp_path, *argv):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "pyengine", "train", *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)


def _launched_and_single(tmp_path, common, rtol, atol):
    """``common`` run for 3 steps as 2 processes x 1 worker under torchrun, then --resume to 6 (under torchrun too),
    and in one process with 2 workers for 6 steps on the same batches: their master weights must agree (``atol``
    relative to each tensor's largest value), rank 0 alone writes the run directory. Returns the launched run's
    summary and metrics records."""
    done = _torchrun(tmp_path, *common, "--workers", "1", "--steps", "3", "--out", str(tmp_path / "launched"))
    assert done.returncode == 0, done.stderr[-3000:]
    done = _torchrun(tmp_path, "--resume", str(tmp_path / "launched"), "--steps", "6")
    assert done.returncode == 0, done.stderr[-3000:]
    assert train(*common, "--workers", "2", "--steps", "6", "--out", str(tmp_path / "single")) == 0
    launched, single = (ckpt.load(ckpt.latest(tmp_path / run / "checkpoints"))["engine"]["master"]
                        for run in ("launched", "single"))
    for name, want in single.items():
        torch.testing.assert_close(launched[name], want, rtol=rtol, atol=atol * want.abs().max().item(), msg=name)
    summary = json.loads((tmp_path / "launched" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["workers"] == 1 and summary["steps"] == 6
    records = [json.loads(line) for line in (tmp_path / "launched" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7)), "one writer: rank 0"
    assert all(r["samples"] == 33 for r in records), "the samples of the whole batch"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["launched", "single"]
    return summary, records


@pytest.mark.timeout(300)
def test_torchrun_hybrid_equals_one_process_on_the_same_batches(tmp_path):
    """Hybrid: each rank on its part of every global batch of 33, equal to one process with 2 workers."""
    _launched_and_single(tmp_path, ["--hidden", "32", "--batch-size", "33", "--devices", "cpu", "--quiet"],
                         rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(300)
def test_torchrun_pipeline_equals_the_in_process_pipeline(tmp_path):
    """--mode pipeline: one stage per process (rank s runs stage s), every rank on the whole global batch of 33 in 3
    micro-batches, equal to the in-process pipeline with 2 stage workers."""
    summary, records = _launched_and_single(
        tmp_path, ["--mode", "pipeline", "--hidden", "32", "--batch-size", "33", "--microbatches", "3", "--devices",
                   "cpu", "--quiet"], rtol=1e-5, atol=1e-5)
    assert summary["stages"] == 2 and len(summary["stage_sizes"]) == 2
    assert summary["bubble_ideal"] == pytest.approx(1 / 4)  # (S - 1) / (M + S - 1)
    assert 0.0 <= summary["bubble_fraction_mean"] < 1.0
    assert all(r["stages"] == 2 for r in records)
    # every line has every stage's busy seconds, as in process (rank 0, the one writer, had only its own busy_s)
    assert all(len(r["stage_busy_s"]) == 2 and r["stage_busy_s"][0] == r["busy_s"] and r["stage_busy_s"][1] > 0
               for r in records), [r.get("stage_busy_s") for r in records]


def test_under_torchrun_a_pipeline_stage_without_parameters_is_refused_before_any_work(monkeypatch):
    """Across processes each stage needs a trainable parameter: 4 processes of the MLP (3 of its 5 layers have
    parameters) failed on every rank after the set-up ("training failed"), 3 processes with balance="params" put a
    GELU alone in a stage; now the first is a usage error naming the limit and the second splits with a parameter in
    every stage."""
    from pyengine import cli, models

    layers = list(models.as_layers(models.MLP(hidden=32)).named_children())
    assert [sum(p.numel() for p in layer.parameters()) == 0 for _, layer in layers] == [False, True, False, True,
                                                                                        False]  # the premise: GELUs
    cfg = dict(mode="pipeline", stages=None, balance="params", devices=["cpu"], model="mlp")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(cli.UsageError, match=r"--stages 4 across processes: stage \d of \[.*\] layers gets no "
                                             r"trainable parameter.*--model mlp has 3 layers with parameters of "
                                             r"its 5; use --stages <= 3"):
        cli.check_pipeline_layers(cfg, layers)
    monkeypatch.setenv("WORLD_SIZE", "3")
    cli.check_pipeline_layers(cfg, layers)
    with pytest.raises(cli.UsageError, match=r"stage 1 of \[1, 1, 3\] layers gets no trainable parameter.* or another "
                                             r"--balance"):
        cli.check_pipeline_layers(dict(cfg, balance=[1, 1, 3]), layers)
    monkeypatch.setenv("WORLD_SIZE", "1")  # in one process a stage without parameters trains
    cli.check_pipeline_layers(dict(cfg, devices=["cpu"] * 4), layers)


@pytest.mark.parametrize("argv,message", [
    (["--mode", "sync"], "under torchrun (WORLD_SIZE=2) the command line trains --mode hybrid or pipeline"),
    (["--mode", "pipeline", "--workers", "2"], "each process runs one stage on one device; got 2 devices"),
    # the processes are the workers: it advised --workers 3, which is refused under torchrun
    (["--mode", "pipeline", "--workers", "1", "--stages", "3"], "--stages 3 does not divide the 2 processes: a "
     "pipeline under torchrun runs stages x replicas processes, one stage each (launch 3 processes, or use --stages "
     "that divides 2)"),
    (["--mode", "pipeline", "--workers", "1", "--batch-size", "32", "--microbatches", "3"],
     "does not split into --microbatches 3 equal micro-batches per replica"),
    (["--mode", "pipeline", "--workers", "1", "--microbatches", "1"], "--schedule 1f1b with stages in separate "
     "processes needs --microbatches >= the 2 stages"),
    (["--mode", "pipeline", "--workers", "1", "--balance", "time"], "--balance time: stages in separate processes "
     "are split before the first step"),
    # 8 samples over 2 processes x 3 workers: 1 each (it passed, counting 2 x 2 workers, and failed in the first step)
    (["--workers", "3", "--batch-size", "8", "--microbatches", "2"], "--microbatches 2: --batch-size 8 leaves a "
     "worker fewer samples than micro-batches (use --batch-size >= 12)"),
], ids=["sync", "pipeline-2-devices", "stages!|processes", "unequal-microbatches", "1f1b-microbatches<stages",
        "balance-time", "hybrid-microbatches>samples"])
@pytest.mark.timeout(180)
def test_under_torchrun_impossible_combination_is_one_line_exit_2(tmp_path, argv, message):
    """Both ranks of a 2-process launch, one command line: each refuses it in one line before any work."""
    ended, seconds = _two_ranks(tmp_path, [[*argv, "--devices", "cpu", "--steps", "2", "--out",
                                            str(tmp_path / "out")]] * 2, timeout=150, PYENGINE_DIST_TIMEOUT_S="120")
    for code, err in ended:
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("pyengine train: error:"), err
        assert message in lines[0], lines[0]
    assert not (tmp_path / "out").exists() and seconds < 100  # not the group's timeout (120 s)


@pytest.mark.timeout(180)
def test_under_torchrun_a_rank_that_fails_its_own_checks_is_named_by_the_others_at_once(tmp_path):
    """A check that fails on one rank only (its --batch-size here; its data or checkpoint files on another node)
    used to end that rank alone while the others waited in the group's rendezvous until its timeout."""
    argvs = [[*SHORT[:2], "--batch-size", size, "--devices", "cpu", "--workers", "1", "--steps", "2", "--out",
              str(tmp_path / "out")] for size in ("32", "1")]
    ((code0, err0), (code1, err1)), seconds = _two_ranks(tmp_path, argvs, timeout=150, PYENGINE_DIST_TIMEOUT_S="120")
    own = "--batch-size 1 gives fewer than one sample to each of the 2 processes x 1 workers"
    assert code1 == 2 and err1.strip() == f"pyengine train: error: {own}", err1
    assert code0 == 2 and err0.strip() == (f"pyengine train: error: rank 0: rank 1 failed its checks of the command "
                                           f"line: UsageError: {own}"), err0
    assert seconds < 100 and not (tmp_path / "out").exists()  # not the group's timeout (120 s)


@pytest.mark.timeout(120)
def test_under_torchrun_command_lines_alike_once_resolved_train_together(tmp_path):
    """A flag given at its default equals the flag left out (--checkpoint-every of one epoch, --steps of the same
    updates as --epochs), and a hybrid rank's --microbatches is its own (a memory setting: the same step): 16 of
    each worker's 32 / 2 samples (it was refused, the samples counted as if split over 2 x 2 workers)."""
    from pyengine import data

    per_epoch = data.load("digits").steps_per_epoch(32)
    common = [*SHORT[:4], "--devices", "cpu", "--workers", "1", "--quiet", "--out", str(tmp_path / "run")]
    argvs = [[*common, "--epochs", "1", "--checkpoint-every", str(per_epoch), "--microbatches", "16"],
             [*common, "--steps", str(per_epoch)]]
    ended, _ = _two_ranks(tmp_path, argvs)
    assert [code for code, _ in ended] == [0, 0], ended
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == per_epoch


def _two_ranks(tmp_path, argvs, script=None, timeout=90, **extra_env):
    """Ranks 0 and 1 of a 2-process run, each with its own command line (``argvs[rank]``, after ``train``), in the
    torchrun environment without torchrun (which gives every rank the same one); ``script``: run by ``python -c``
    instead of ``-m pyengine``. Returns [(returncode, stderr)] and the seconds until both ended. A run whose port was
    taken between free_port() and rank 0's bind (rank 0 said EADDRINUSE) is run again once on another port."""
    for _ in range(2):
        ended, seconds = _run_two_ranks(tmp_path, argvs, script, timeout, extra_env)
        if "EADDRINUSE" not in ended[0][1]:
            break
    return ended, seconds


def _run_two_ranks(tmp_path, argvs, script, timeout, extra_env):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(zygote.free_port()), WORLD_SIZE="2", **extra_env)
    command = ["-c", script] if script else ["-m", "pyengine"]
    logs = [(tmp_path / f"rank{rank}.stdout", tmp_path / f"rank{rank}.stderr") for rank in (0, 1)]
    start = time.monotonic()
    procs = [zygote.start([*command, "train", *argvs[rank]], dict(env, RANK=str(rank)), *logs[rank], cwd=tmp_path,
                          rank=rank) for rank in (0, 1)]  # forked from one process that imported torch and pyengine (tests/zygote.py)
    codes = [None, None]
    try:
        for rank, p in enumerate(procs):
            codes[rank] = p.wait(timeout=max(0.1, start + timeout - time.monotonic()))
            if rank == 0 and codes[0] != 0 and "EADDRINUSE" in logs[0][1].read_text():
                break  # rank 1 waits for a store that is not there: run again (the caller)
        seconds = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    # a rank killed at once may not have opened its files yet
    return [(code, err.read_text() if err.exists() else "") for code, (_, err) in zip(codes, logs)], seconds


@pytest.mark.timeout(120)
def test_a_two_rank_run_whose_port_was_taken_meanwhile_runs_again_on_another(tmp_path, monkeypatch):
    """_two_ranks(): free_port() closes its port before rank 0 binds it; a port taken in between (rank 0 says
    EADDRINUSE, rank 1 waits for a store that never comes) gets a second run on a fresh port, not a failed test."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = zygote.free_port
    monkeypatch.setattr(zygote, "free_port", lambda: ports.pop(0) if ports else real())
    differ = (["--lr", "0.01"], ["--lr", "0.02"])
    with taken:
        ended, _ = _two_ranks(tmp_path, [[*SHORT[:4], "--devices", "cpu", *differ[rank], "--out",
                                          str(tmp_path / f"out{rank}")] for rank in (0, 1)])
    assert not ports
    _refused_by_both(ended, "lr: rank 0 has 0.01, rank 1 0.02")  # the second run's ranks met


def _refused_by_both(ended, text):
    for rank, (code, err) in enumerate(ended):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err
        assert lines[0].startswith(f"pyengine train: error: rank {rank}: the 2 ranks' command lines differ (only "
                                   "--devices, --workers"), lines[0]
        assert text in lines[0], lines[0]


@pytest.mark.timeout(120)
def test_under_torchrun_command_lines_that_differ_are_one_line_exit_2_on_every_rank(tmp_path):
    """Note [Every rank's engine alike] for the command line: ranks launched with another --lr (or --steps, which
    used to end in a timeout at the step the shorter run never reached) each say so in one line before any work;
    their own devices and output may differ."""
    differ = (["--lr", "0.01", "--steps", "3"], ["--lr", "0.02", "--steps", "4"])
    ended, _ = _two_ranks(tmp_path, [[*SHORT[:4], "--devices", "cpu", "--workers", str(1 + rank), *differ[rank],
                                      "--out", str(tmp_path / f"out{rank}")] for rank in (0, 1)])
    _refused_by_both(ended, "lr: rank 0 has 0.01, rank 1 0.02")
    _refused_by_both(ended, "steps: rank 0 has 3, rank 1 4")
    assert not (tmp_path / "out0" / "checkpoints").exists()


@pytest.mark.timeout(150)
def test_under_torchrun_ranks_resuming_from_different_checkpoints_are_refused(tmp_path):
    """A rank given an older checkpoint of the run (or a stale copy of it) would train on with other weights and
    other batches, and rank 0 would save the mixture: the resumed states are compared too."""
    out = tmp_path / "run"
    assert train(*SHORT, "--steps", "4", "--checkpoint-every", "2", "--quiet", "--out", str(out)) == 0
    sources = [str(out), str(out / "checkpoints" / "step-00000002.pyeckpt")]
    ended, _ = _two_ranks(tmp_path, [["--resume", sources[rank], "--steps", "6", "--workers", "1", "--quiet"]
                                     for rank in (0, 1)])
    _refused_by_both(ended, "resumed at (step, batches, seconds): rank 0 has hybrid=(4, ")
    assert ckpt.latest(out / "checkpoints").name == "step-00000004.pyeckpt"  # nothing trained


@pytest.mark.timeout(200)
def test_under_torchrun_a_resume_gives_every_rank_its_own_devices(tmp_path):
    """Note [Each rank's devices in the checkpoint]: rank 1 trained on 2 workers, rank 0 on 1. A resume without
    --devices/--workers used to give rank 1 rank 0's one worker (the checkpoint held rank 0's devices alone); each
    rank now resumes on its own, as every later checkpoint says. A resume in one process takes rank 0's and saves
    no ranks'."""
    out = tmp_path / "run"
    ended, _ = _two_ranks(tmp_path, [[*SHORT[:4], "--devices", "cpu", "--workers", str(1 + rank), "--steps", "2",
                                      "--quiet", *(["--out", str(out)] if rank == 0 else [])] for rank in (0, 1)])
    assert [code for code, _ in ended] == [0, 0], ended
    config = ckpt.load(ckpt.latest(out / "checkpoints"))["config"]
    assert config["rank_devices"] == [["cpu"], ["cpu", "cpu"]] and config["devices"] == ["cpu"], config
    ended, _ = _two_ranks(tmp_path, [["--resume", str(out), "--steps", "4", "--quiet"]] * 2)
    assert [code for code, _ in ended] == [0, 0], ended
    config = ckpt.load(ckpt.latest(out / "checkpoints"))["config"]
    assert ckpt.step_of(ckpt.latest(out / "checkpoints")) == 4
    assert config["rank_devices"] == [["cpu"], ["cpu", "cpu"]], config
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rank_devices"] == [["cpu"], ["cpu", "cpu"]] and summary["processes"] == 2, summary
    # --workers given again on rank 1 alone still moves it (hybrid), and is what the next checkpoint holds
    ended, _ = _two_ranks(tmp_path, [["--resume", str(out), "--steps", "5", "--quiet", *extra]
                                     for extra in ([], ["--workers", "3"])])
    assert [code for code, _ in ended] == [0, 0], ended
    config = ckpt.load(ckpt.latest(out / "checkpoints"))["config"]
    assert config["rank_devices"] == [["cpu"], ["cpu"] * 3], config
    assert train("--resume", str(out), "--steps", "6", "--quiet") == 0
    config = ckpt.load(ckpt.latest(out / "checkpoints"))["config"]
    assert config["devices"] == ["cpu"] and "rank_devices" not in config, config
    assert json.loads((out / "summary.json").read_text())["workers"] == 1


_FAILING_RANK = """
import os, sys
import pyengine.data, pyengine.cli
batch = pyengine.data.Dataset.batch
def failing(self, step, *args):
    if os.environ["RANK"] == "1" and step == 3:
        raise RuntimeError("injected data failure on rank 1")
    return batch(self, step, *args)
pyengine.data.Dataset.batch = failing
sys.exit(pyengine.cli.main(sys.argv[1:]))
"""


@pytest.mark.timeout(180)
def test_under_torchrun_a_rank_whose_data_fails_is_named_and_both_say_how_to_resume(tmp_path):
    """A rank that fails outside a step (its data) records its error for the others (Note [Naming the rank that
    failed]): rank 0's error names it at once, not after the 5 s wait for ranks that are only slow (torchrun would
    stop rank 0 before it said anything); each rank names the checkpoint rank 0 wrote last and the torchrun resume."""
    out = tmp_path / "run"
    argv = [*SHORT[:4], "--devices", "cpu", "--workers", "1", "--steps", "8", "--checkpoint-every", "2", "--quiet",
            "--out", str(out)]
    ((code0, err0), (code1, err1)), seconds = _two_ranks(tmp_path, [argv, argv], script=_FAILING_RANK, timeout=150,
                                                         PYENGINE_DIST_TIMEOUT_S="120")
    assert (code0, code1) == (1, 1), (err0, err1)
    resume = f"resume with torchrun <the same launch options> -m pyengine train --resume {out}"
    saved = out / "checkpoints" / "step-00000002.pyeckpt"
    assert "training failed: RuntimeError: injected data failure on rank 1" in err1, err1
    assert f"the last checkpoint is in {saved}: {resume}" in err1, err1
    assert "rank 1 failed: RuntimeError: injected data failure on rank 1" in err0, err0
    assert f"the last checkpoint is in {saved}: {resume}" in err0, err0
    assert saved.exists() and seconds < 100  # not the group's timeout (120 s)


_SLOW_SAVE = """
import os, sys, time
import pyengine.checkpoint, pyengine.cli
save = pyengine.checkpoint.save
def slow(folder, step, *args, **kwargs):
    if step == int(os.environ["SLOW_STEP"]):
        time.sleep(20)
    return save(folder, step, *args, **kwargs)
pyengine.checkpoint.save = slow
sys.exit(pyengine.cli.main(sys.argv[1:]))
"""


@pytest.mark.timeout(360)
def test_under_torchrun_the_group_timeout_bounds_rank_0s_checkpoint_writes(tmp_path):
    """The other ranks wait in the step's stop agreement while rank 0 writes a checkpoint: a write longer than the
    group's timeout ends the run with an error that says so; PYENGINE_DIST_TIMEOUT_S gives the time it needs. The
    checkpoint a rank names is still there (rank 0 prunes to --keep only after the agreement that follows a save),
    and it also names the one rank 0 was writing."""
    def run(timeout_s, *extra):
        folder = tmp_path / f"run-{timeout_s}"
        argv = [*SHORT[:4], "--devices", "cpu", "--workers", "1", "--steps", "6", "--checkpoint-every", "2",
                "--quiet", "--out", str(folder), *extra]
        return _two_ranks(tmp_path, [argv, argv], script=_SLOW_SAVE, PYENGINE_DIST_TIMEOUT_S=timeout_s,
                          SLOW_STEP="4")[0], folder / "checkpoints"

    # the write of step 4 takes 20 s, longer than the group's timeout (15 s: every collective before it has that long)
    ((code0, err0), (code1, err1)), folder = run("15", "--keep", "1")
    step2, step4 = (folder / f"step-0000000{n}.pyeckpt" for n in (2, 4))
    assert code1 == 1 and "rank 1: the agreement after step 4 whether to stop failed" in err1, err1
    assert "rank 0 wrote the checkpoint of step 4 before it: a write longer than the group's timeout" in err1, err1
    assert (f"the last checkpoint is in {step2} (or {step4}, which rank 0 was writing when the run failed, if that "
            "write completed)") in err1, err1
    assert code0 == 1 and "this rank's write of the checkpoint of step 4 took 2" in err0, err0
    assert f"step 4, the last complete one, is saved in {step4}" in err0, err0
    assert step2.exists() and step4.exists()
    ended, folder = run("60", "--keep", "1")
    assert [code for code, _ in ended] == [0, 0], ended
    assert [p.name for p in ckpt.list_checkpoints(folder)] == ["step-00000006.pyeckpt"]
    for value in ("soon", "1e20"):
        ended, _ = run(value)
        assert all(code == 2 and f"PYENGINE_DIST_TIMEOUT_S={value!r}: expected a number of seconds > 0 and at "
                   "most 604800" in err for code, err in ended), ended


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                found.append(int(entry))
    return found


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env else None


@pytest.mark.timeout(420)
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank processes through /proc")
def test_under_torchrun_sigint_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """Note [Stopping together under torchrun]: SIGINT sent to rank 1 alone (as a scheduler may) stops both ranks
    after the same step; rank 0 writes the final checkpoint of that step and the summary, no collective times out.
    Rank 0's write is made 3 s slow here: rank 1 left at once with 130, and torchrun stopped rank 0 (SIGTERM) before
    it had written anything (Note [The ranks leave together])."""
    out = tmp_path / "run"
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '0':\n"
        "    import time\n"
        "    import pyengine.checkpoint as c\n"
        "    save = c.save\n"
        "    c.save = lambda *args, **kwargs: (time.sleep(3), save(*args, **kwargs))[1]\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(slow), str(REPO)]), OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "pyengine", "train", "--steps", "100000", "--checkpoint-every", "100000", "--out",
                             str(out), "--workers", "1", *SHORT[:4], "--devices", "cpu"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps(out, 5, 180)
        ranks = {_rank_of(pid): pid for pid in _children(proc.pid)}
        assert 1 in ranks, f"rank processes not found: {ranks}"
        os.kill(ranks[1], signal.SIGINT)
        _, stderr = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert "Timed out" not in stderr and "DistributedError" not in stderr, stderr[-3000:]
    # rank 0 alone, which writes the checkpoint, says where it is and how to resume: under torchrun
    assert stderr.count("stopped at step") == 1, stderr[-3000:]
    assert f"resume with: torchrun <the same launch options> -m pyengine train --resume {out}" in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["steps"] >= 5 and summary["processes"] == 2
    assert ckpt.latest(out / "checkpoints").name == f"step-{summary['steps']:08d}.pyeckpt"


def test_mode_all_sub_runs_resume(tmp_path, capsys):
    """A --mode all run's directories resume (the hybrid/sync/async checkpoints also carry the pipeline defaults of the
    whole run, which are not flags given to them), each writing its trace where the first run wrote it. The first
    removes the run's summary.json and compare.png, which described it at 2 steps (a word on stderr says so), and a
    resume of the whole run writes them again, of every mode's 3 steps."""
    out, trace = tmp_path / "all", tmp_path / "t.json"
    assert train("--mode", "all", "--steps", "2", "--quiet", "--out", str(out), "--trace", str(trace), *SHORT) == 0
    assert (out / "summary.json").exists() and (out / "compare.png").exists()
    assert train("--resume", str(out / "hybrid"), "--steps", "1", "--quiet") == 2  # refused: nothing removed
    assert (out / "summary.json").exists() and (out / "compare.png").exists()
    capsys.readouterr()
    for mode in ("hybrid", "sync", "async", "pipeline"):
        (tmp_path / f"t-{mode}.json").unlink()
        assert train("--resume", str(out / mode), "--steps", "3", "--quiet") == 0
        summary = json.loads((out / mode / "summary.json").read_text())
        assert summary["steps"] == 3 and summary["trace"] == str(tmp_path / f"t-{mode}.json")
        assert json.loads((tmp_path / f"t-{mode}.json").read_text())["traceEvents"]
        assert not (out / "summary.json").exists() and not (out / "compare.png").exists()
        said = capsys.readouterr().err
        assert (f"{out} is a --mode all run whose summary.json and compare.png described hybrid before this "
                f"resume: removed (a resume of the whole run, --resume {out} with the --steps its modes reached, "
                "writes them again)" in said) == (mode == "hybrid"), said
    assert not trace.exists()
    assert train("--resume", str(out), "--steps", "3", "--quiet") == 0
    top = json.loads((out / "summary.json").read_text())
    assert {m: top["runs"][m]["steps"] for m in ("hybrid", "sync", "async", "pipeline")} == dict.fromkeys(
        ("hybrid", "sync", "async", "pipeline"), 3) and (out / "compare.png").exists(), top


def test_non_finite_losses_are_reported_not_fatal(tmp_path, capsys):
    """A diverging run (lr 1e30; 1e38 is refused before any work, its step size lr / (1 - beta1) being past
    float32's range): losses become non-finite (null in metrics.jsonl, "nan" on the
    progress line) and the run still ends with its checkpoint, loss.png and, for --mode all, compare.png. A run
    whose last loss is not finite ended diverged: its final loss is none (it was the last finite one, and such a
    mode could be --mode all's best)."""
    out = tmp_path / "diverged"
    assert train("--mode", "all", "--steps", "3", "--lr", "1e30", "--log-every", "1", "--out", str(out),
                 *SHORT) == 0
    printed = capsys.readouterr().out
    assert "loss nan" in printed
    top = json.loads((out / "summary.json").read_text())
    finite = []
    for mode in ("hybrid", "sync", "async", "pipeline"):
        losses = [json.loads(line)["loss"] for line in (out / mode / "metrics.jsonl").read_text().splitlines()]
        # the premise; an async push computed on the weights before the first update may land last, finite
        assert losses[0] is not None and (losses[-1] is None or mode == "async"), (mode, losses)
        summary = json.loads((out / mode / "summary.json").read_text())
        diverged = losses[-1] is None
        assert summary["diverged"] is diverged and (summary["final_loss"] is None) is diverged, (mode, summary)
        assert (top["final_loss"][mode] is None) is diverged, mode
        finite += [] if diverged else [mode]
    assert "final loss nan (diverged)" in printed
    assert top["best"]["final_loss"] == (min(finite, key=top["final_loss"].get) if finite else None)
    assert (out / "compare.png").read_bytes().startswith(PNG) and (out / "hybrid" / "loss.png").exists()


def test_trace_naming_a_directory_is_refused_at_start(tmp_path, capsys):
    (tmp_path / "tdir").mkdir()
    assert train("--steps", "2", "--out", str(tmp_path / "run"), "--trace", str(tmp_path / "tdir"), *SHORT) == 2
    assert "is a directory" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_stale_temporary_checkpoints_are_removed_and_superseded_ones_not_resumed(tmp_path, capsys):
    run = tmp_path / "run"
    assert train("--steps", "4", "--checkpoint-every", "2", "--quiet", "--out", str(run), *SHORT) == 0
    stale = run / "checkpoints" / ".step-00000006.pyeckpt.abc123.tmp"  # a writer killed before its rename
    stale.write_bytes(b"partial")
    old = time.time() - ckpt.STALE_TMP_S - 60
    os.utime(stale, (old, old))
    live = run / "checkpoints" / ".step-00000007.pyeckpt.def456.tmp"  # another writer's, being written
    live.write_bytes(b"partial")
    assert train("--resume", str(ckpt.path_for(run / "checkpoints", 2)), "--steps", "3", "--quiet") == 0
    assert not stale.exists() and live.exists()
    [aside] = run.glob("superseded-*")
    assert train("--resume", str(ckpt.path_for(aside, 4)), "--steps", "5", "--quiet") == 2
    assert "set aside" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["hybrid", "async"])
def test_lr_schedule_cosine_with_warmup(tmp_path, mode):
    """--lr-schedule cosine --warmup-steps 2 over 6 updates: metrics.jsonl holds each update's lr, linear warmup then
    a cosine to 0 at the end (the formula written out here); a resume with more --steps re-aims the decay."""
    import math
    out, lr = tmp_path / "run", 4e-3
    assert train("--mode", mode, "--steps", "6", "--lr", str(lr), "--lr-schedule", "cosine", "--warmup-steps", "2",
                 "--quiet", "--out", str(out), *SHORT) == 0

    def expected(step, total):  # step: updates before this one
        return lr * ((step + 1) / 2 if step < 2 else 0.5 * (1 + math.cos(math.pi * (step - 2) / (total - 2))))

    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in lines] == pytest.approx([expected(s, 6) for s in range(6)], rel=1e-12)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lr_schedule"] == "cosine" and summary["warmup_steps"] == 2
    assert train("--resume", str(out), "--steps", "10", "--quiet") == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in lines[6:]] == pytest.approx([expected(s, 10) for s in range(6, 10)], rel=1e-12)


def test_a_constant_lr_run_may_end_while_warming_up_and_resume(tmp_path):
    """--warmup-steps longer than the run, with a constant lr: a first part of a longer run, resumed with more
    --steps (a refusal of it also refused resuming runs saved that way); the lr goes on rising where it stopped."""
    out, lr = tmp_path / "run", 4e-3
    assert train("--steps", "2", "--warmup-steps", "5", "--lr", str(lr), "--quiet", "--out", str(out), *SHORT) == 0
    assert train("--resume", str(out), "--steps", "3", "--quiet") == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in lines] == pytest.approx([lr * k / 5 for k in (1, 2, 3)], rel=1e-12)


def test_lr_schedule_bad_flags(tmp_path, capsys):
    out = tmp_path / "run"
    assert train("--steps", "3", "--lr-schedule", "cosine", "--warmup-steps", "4", "--out", str(out), *SHORT) == 2
    assert "--warmup-steps 4 is longer than the run's 3 updates" in capsys.readouterr().err and not out.exists()
    for bad in (["--lr-schedule", "linear"], ["--warmup-steps", "-1"]):
        with pytest.raises(SystemExit) as exc:
            train("--steps", "3", *bad, "--out", str(out), *SHORT)
        assert exc.value.code == 2 and not out.exists()
    # warmup alone: a constant lr after it
    assert train("--steps", "3", "--warmup-steps", "2", "--lr", "1e-3", "--quiet", "--out", str(out), *SHORT) == 0
    lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3], rel=1e-12)


def test_microbatches_in_hybrid_and_sync_runs_and_resumes(tmp_path):
    """--microbatches with --mode hybrid/sync: gradient accumulation (the summary says so, and a resume keeps it); in
    --mode all the flag is the pipeline run's, hybrid and sync there run without micro-batches."""
    for mode in ("hybrid", "sync"):
        out = tmp_path / mode
        assert train("--mode", mode, "--steps", "2", "--microbatches", "3", "--quiet", "--out", str(out),
                     *SHORT) == 0
        assert json.loads((out / "summary.json").read_text())["microbatches"] == 3
        assert train("--resume", str(out), "--steps", "3", "--quiet") == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["microbatches"] == 3 and summary["steps"] == 3
    out = tmp_path / "all"
    assert train("--mode", "all", "--steps", "2", "--microbatches", "2", "--quiet", "--out", str(out), *SHORT) == 0
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert runs["hybrid"]["microbatches"] == runs["sync"]["microbatches"] == 1
    assert runs["pipeline"]["microbatches"] == 2 and "microbatches" not in runs["async"]
    assert train("--resume", str(out / "hybrid"), "--steps", "3", "--quiet") == 0
    assert json.loads((out / "hybrid" / "summary.json").read_text())["microbatches"] == 1


def test_resuming_a_checkpoint_saved_before_lr_schedule_and_hybrid_microbatches(tmp_path):
    """A --mode all hybrid sub-run's checkpoint as saved before --lr-schedule existed: no lr_schedule/warmup_steps
    in its config, and the pipeline run's --microbatches (4) there, which hybrid never used: it resumes with a
    constant lr and no micro-batches."""
    out = tmp_path / "all"
    assert train("--mode", "all", "--steps", "2", "--quiet", "--out", str(out), *SHORT) == 0
    file = ckpt.latest(out / "hybrid" / "checkpoints")
    payload = ckpt.load(file)
    for key in ("lr_schedule", "warmup_steps"):
        del payload["config"][key]
    payload["config"]["microbatches"] = 4
    file.unlink()
    ckpt.save(out / "hybrid" / "checkpoints", payload["step"], payload)
    assert train("--resume", str(out / "hybrid"), "--steps", "3", "--quiet") == 0
    summary = json.loads((out / "hybrid" / "summary.json").read_text())
    assert summary["microbatches"] == 1 and summary["lr_schedule"] == "constant" and summary["steps"] == 3


@pytest.mark.parametrize("mode", ["hybrid", "async"])
def test_fp16_run_scales_the_loss_and_resumes_bit_identically(tmp_path, mode):
    """--autocast fp16 scales the loss by default: every metrics line has the step's scale, the summary the final
    one; a run resumed from its half-way checkpoint (hybrid) ends with the same weights and scale as the run straight
    through; --loss-scale none turns it off."""
    common = ["--mode", mode, "--autocast", "fp16", "--quiet", "--checkpoint-every", "4", *SHORT]
    full = tmp_path / "full"
    assert train("--steps", "8", "--out", str(full), *common) == 0
    lines = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((full / "summary.json").read_text())
    assert all(r["loss_scale"] >= 1.0 for r in lines) and summary["loss_scale"] == "auto"
    assert summary["engine_stats"]["loss_scale"] >= 1.0
    assert master(full)["loss_scaler"]["scale"] == summary["engine_stats"]["loss_scale"]
    if mode == "hybrid":
        part = tmp_path / "part"
        assert train("--steps", "8", "--out", str(part), *common) == 0
        ckpt.list_checkpoints(part / "checkpoints")[-1].unlink()
        assert train("--resume", str(part), "--steps", "8", "--quiet") == 0
        a, b = master(full), master(part)
        assert a["loss_scaler"] == b["loss_scaler"] and a["version"] == b["version"]
        for name in a["master"]:
            assert torch.equal(a["master"][name], b["master"][name]), name
    off = tmp_path / "off"
    assert train("--steps", "2", "--out", str(off), "--loss-scale", "none", *common) == 0
    assert all("loss_scale" not in json.loads(line) for line in (off / "metrics.jsonl").read_text().splitlines())
