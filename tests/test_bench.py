"""The benchmark scripts run (on CPU here; the GPU suite runs them on CUDA), and the arithmetic of their summaries."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import bench_transfer  # noqa: E402


def test_copy_timeline_arithmetic():
    # backward's kernels span 0-300 us; copies 80-150, 200-250 (inside it) and 320-400 (after it)
    timeline = bench_transfer.copy_timeline([(0, 100), (50, 300)], [(80, 150), (200, 250), (320, 400)])
    assert timeline == pytest.approx({"kernels": 2, "copies": 3, "backward_ms": 0.3, "copy_busy_ms": 0.2,
                                      "first_copy_after_ms": 0.08, "copy_idle_in_backward_ms": 0.1,
                                      "copies_after_backward_ms": 0.1, "step_ms": 0.4})
    assert bench_transfer._union([(0, 10), (5, 20), (30, 40), (32, 35)]) == 30
    assert bench_transfer.copy_timeline([], [(0, 1)]) == {"kernels": 0, "copies": 1}


@pytest.mark.timeout(300)
def test_bench_transfer_runs_on_cpu(tmp_path):
    out = tmp_path / "transfer.md"
    assert bench_transfer.main(["--device", "cpu", "--params-m", "1", "--rounds", "1", "--out", str(out),
                                "--trace-dir", str(tmp_path)]) == 0
    text = out.read_text()
    assert "bandwidth_ratio" in text and "hybrid_over_single" in text and "update_ms" in text
    for name in ("streamed_trace.json", "hybrid_trace.json", "hybrid_phases.json"):
        assert json.loads((tmp_path / name).read_text())["traceEvents"], name


BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _run_bench(script, *args):
    """Runs bench/<script> with a tiny configuration; returns its standard output (a failure shows stderr)."""
    import subprocess

    done = subprocess.run([sys.executable, os.path.join(BENCH, script), *args], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(300)
def test_bench_pipeline_runs_on_cpu():
    out = _run_bench("bench_pipeline.py", "--layers", "4", "--width", "32", "--batch", "16", "--steps", "1",
                     "--warmup", "0", "--stages", "2", "--microbatches", "2", "--schedules", "1f1b")
    assert "| 2 | 2 | 1f1b |" in out


@pytest.mark.timeout(300)
def test_bench_pipeline_across_processes_runs_on_cpu():
    out = _run_bench("bench_pipeline.py", "--processes", "--layers", "4", "--width", "32", "--batch", "16", "--steps",
                     "1", "--warmup", "0", "--stages", "2", "--microbatches", "2", "--schedules", "gpipe")
    assert "stages in separate processes" in out and "| 2 | 2 | gpipe |" in out


@pytest.mark.timeout(300)
def test_bench_engine_runs_on_cpu():
    out = _run_bench("bench_engine.py", "--quick", "--models", "mlp", "--workers", "1,2", "--modes", "hybrid,async",
                     "--batch", "16", "--rounds", "1")
    assert "| mlp | 1 |" in out and "| mlp | 2 |" in out


@pytest.mark.timeout(120)
def test_cpu_read_rate_runs(tmp_path):
    """bench/cpu_read_rate.cpp (the read-rate ceiling of RESULTS.md) compiles, runs on small buffers, refuses bad
    arguments. Portable flags here: the recorded runs add -mavx512f."""
    import re
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = str(tmp_path / "cpu_read_rate")
    subprocess.run([cxx, "-O2", "-std=c++20", os.path.join(BENCH, "cpu_read_rate.cpp"), "-o", exe], check=True)
    out = subprocess.run([exe, "huge", "2"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "buffers of 2 MiB, 2 MiB (THP) pages" in out
    rates = re.findall(r"read rate\s+([0-9.]+) GB/s", out)
    assert len(rates) == 8 and all(float(r) > 0 for r in rates), out
    for bad in (["foo"], ["4k", "0"], ["4k", "1", "x"]):
        done = subprocess.run([exe, *bad], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "usage:" in done.stderr, bad
