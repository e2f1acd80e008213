"""The benchmark scripts run (on CPU here; the GPU suite runs them on CUDA), and the arithmetic of their summaries."""
import contextlib
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import bench_fused_adamw  # noqa: E402
import bench_transfer  # noqa: E402
import cuda_kernel_ab  # noqa: E402


def test_copy_timeline_arithmetic():
    # backward's kernels span 0-300 us; copies 80-150, 200-250 (inside it) and 320-400 (after it)
    timeline = bench_transfer.copy_timeline([(0, 100), (50, 300)], [(80, 150), (200, 250), (320, 400)])
    assert timeline == pytest.approx({"kernels": 2, "copies": 3, "backward_ms": 0.3, "copy_busy_ms": 0.2,
                                      "first_copy_after_ms": 0.08, "copy_idle_in_backward_ms": 0.1,
                                      "copies_after_backward_ms": 0.1, "step_ms": 0.4})
    assert bench_transfer._union([(0, 10), (5, 20), (30, 40), (32, 35)]) == 30
    assert bench_transfer.copy_timeline([], [(0, 1)]) == {"kernels": 0, "copies": 1}


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("g", [1, 3])
def test_bench_fused_adamw_checks_every_path_before_timing_it(dtype, g, monkeypatch):
    """Every path of the kernel benchmark is compared with the stock path's first step (DeepSpeed's CPU Adam where
    it is importable) before it is timed, and a path that computes another update is refused."""
    paths = ["ours", "stock", "stack"] + (["deepspeed"] if bench_fused_adamw.deepspeed_adam() is not None else [])
    ws = bench_fused_adamw.Workspace(1001, g, dtype, "cpu")
    ws.check(paths)
    right = ws.stack
    monkeypatch.setattr(ws, "stack", lambda: (right(), ws.stock_param.data.mul_(1.001)))  # a path gone wrong
    with pytest.raises(AssertionError, match="stack vs stock"):
        ws.check(paths)


@pytest.mark.parametrize("g", [1, 3])
def test_bench_fused_adamw_clip_checks_every_path(g, monkeypatch):
    """--clip: ours (the norm pass, then the update) and stock (clip_grad_norm_, then fused AdamW) must agree, the
    norm pass must give the float64 norm of the mean, and the plain loops ours' bits, before anything is timed; a
    stock path that forgets to clip, or a wrong norm, is refused. G = 1: stock clips a gradient of its own in place,
    ours' stays as drawn."""
    paths = ["ours", "plain", "stock", "norm", "norm_plain"]
    ws = bench_fused_adamw.Workspace(1001, g, "fp32", "cpu", clip=True)
    drawn = [t.clone() for t in ws.grads]
    assert bench_fused_adamw.ops.mean_grad_norm(ws.grads).norm > 10 * bench_fused_adamw.CLIP_NORM  # the clip is active
    ws.check(paths)
    ws.check(paths)  # twice: the second check starts from the state the first left
    assert all(torch.equal(a, b) for a, b in zip(drawn, ws.grads))
    assert bench_fused_adamw.update_bytes(1001, g, "fp32", clip=True) == 4 * 1001 * (2 * g + 6)
    assert bench_fused_adamw.update_bytes(1001, g, "bf16", clip=True) == 4 * 1001 * g + 24 * 1001
    monkeypatch.setattr(ws, "_stock_step", lambda: ws.stock_opt.step())  # a stock path that forgot to clip
    with pytest.raises(AssertionError, match="ours vs stock"):
        ws.check(paths)
    monkeypatch.undo()
    monkeypatch.setattr(ws, "norm", lambda: bench_fused_adamw.ops.mean_grad_norm(ws.grads).norm * 1.001)
    with pytest.raises(AssertionError, match="norm vs float64"):
        ws.check(paths)


@pytest.mark.timeout(300)
def test_bench_transfer_runs_on_cpu(tmp_path):
    out = tmp_path / "transfer.md"
    assert bench_transfer.main(["--device", "cpu", "--params-m", "1", "--rounds", "1", "--out", str(out),
                                "--trace-dir", str(tmp_path), "--batch", "8", "16", "--grad-dtype", "float32",
                                "bfloat16", "--host-threads", "1"]) == 0  # the bfloat16 slots: checked inside
    # (--host-threads applies to GPU workers only: on CPU the one row with the default thread count)
    text = out.read_text()
    assert "bandwidth_ratio" in text and "hybrid_over_single" in text and "update_ms" in text
    assert f"\n| {torch.get_num_threads()} | 4 | " in text, text  # host_threads, workers
    for dtype in ("float32", "bfloat16"):
        assert f"\n| {dtype} | 8 | " in text and f"\n| {dtype} | 16 | " in text, text
    assert "step_over_floor" in text and "bwd_step_over_max" in text, text
    assert "bucketed_over_max" in text and "eager_speedup" in text, text
    assert "shadow_source_ms" in text and "update_cost" in text and "| True |" in text, text  # replica_is_shadow
    assert "step_ms_shadow" in text and "step_speedup" in text, text
    assert bench_transfer.paired([2.0, 4.0, 9.0], [1.0, 1.0, 3.0]) == 3.0  # median of the per-round ratios
    for name in ("streamed_trace_float32.json", "streamed_trace_bfloat16.json", "hybrid_trace.json",
                 "hybrid_phases.json"):  # a trace of each gradient dtype's first batch
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


@pytest.mark.timeout(300)
def test_bench_arena_runs_on_cpu(tmp_path):
    out = tmp_path / "arena.md"
    text = _run_bench("bench_arena.py", "--n", "1", "--g", "2", "--rounds", "1", "--threads", "1", "--out", str(out))
    assert "| torch | " in text and "| arena | " in text and out.read_text() == text.rstrip("\n") + "\n"


@pytest.mark.timeout(120)
def test_bench_buffer_share_runs_on_cpu():
    text = _run_bench("bench_buffer_share.py", "--layers", "3", "--width", "8", "--rounds", "1", "--repeats", "1")
    assert "9 buffers (" in text and "per buffer median" in text and "packed is" in text, text


def test_bench_fit_end_runs_on_cpu():
    text = _run_bench("bench_fit_end.py", "--rounds", "2")
    for kind in ("hybrid", "pipeline"):
        assert f"{kind}, world 2, 2 rounds: end of fit " in text and "a fit call adds" in text, text


def test_bench_async_pull_runs_on_cpu():
    """Both kinds of version: a revision (a temporary worktree, removed after) and a path."""
    text = _run_bench("bench_async_pull.py", "old=rev:HEAD", f"new={os.path.dirname(BENCH)}", "--width", "16",
                      "--layers", "2", "--pushes", "5", "--skip", "1", "--rounds", "1")
    rows = [line.split() for line in text.splitlines() if "pull" in line and "push round" in line]
    assert [row[0] for row in rows] == ["old", "new"] and all(float(row[2]) > 0 for row in rows), text
    assert all(row[-3:] == ["torch.bfloat16,", "576", "parameters"] for row in rows), text  # 2 x (16 x 16 + 16)


def _run_torchrun(script, *args):
    import subprocess

    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           os.path.join(BENCH, script), *args], capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(240)
def test_bench_dist_step_runs_under_torchrun():
    """Both engines step, the packed one's flags are one float64, and they end with the same weights (the script
    exits 1 when they differ); outside torchrun it says how to launch it."""
    import subprocess

    text = _run_torchrun("bench_dist_step.py", "--steps", "24")
    rows = [line for line in text.splitlines() if line.startswith("| 2 ranks | packed (1 float64) ")]
    assert len(rows) == 1 and "per rank (2 float64)" in rows[0] and rows[0].endswith("| weights equal |"), text
    alone = subprocess.run([sys.executable, os.path.join(BENCH, "bench_dist_step.py")], capture_output=True,
                           text=True, timeout=60)
    assert alone.returncode == 2 and "launch under torchrun" in alone.stderr


@pytest.mark.timeout(240)
def test_bench_comm_rounds_interleave_the_sizes_under_torchrun():
    """--rounds: every size timed in each of R rounds (the sizes far apart, as in test_comm's run: the fit refuses
    timings that fall with the size)."""
    text = _run_torchrun("bench_comm.py", "--sizes", "4e3,32e6", "--rounds", "3", "--repeats", "2")
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| 2 (fit) |")]
    assert [row[2].strip() for row in rows] == ["4,000", "32,000,000"] and all(float(row[3]) > 0 for row in rows), \
        text


def test_bench_call_overhead_runs_on_cpu():
    text = _run_bench("bench_call_overhead.py", "--calls", "5", "--rounds", "1")
    rows = [line for line in text.splitlines() if line.startswith("| mean_grad_adamw")]
    assert len(rows) == 2 and all(float(row.split("|")[2]) > 0 for row in rows), text
    split = [line.split("|") for line in text.splitlines() if line.startswith("| medians of rounds")]
    assert len(split) == 1 and all(float(split[0][i]) > 0 for i in (2, 3, 5)), text  # raw op, wrapper, add_
    assert f"pyengine from {os.path.join(os.path.dirname(BENCH), 'pyengine')};" in text, text


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


@pytest.mark.timeout(300)
def test_cpu_kernel_ab_times_both_update_loops():
    """bench/cpu_kernel_ab.py builds the working tree's loops twice, plain and @prefetch (update_prefetch), checks
    their bits against each other and times both, on a small case (fp32 and fp16 gradients, one build)."""
    import shutil
    import subprocess
    import sys

    if shutil.which("g++") is None:
        pytest.skip("no g++")
    run = subprocess.run([sys.executable, os.path.join(BENCH, "cpu_kernel_ab.py"), "plain=csrc",
                          "pf=csrc@prefetch", "--n", "100003", "--g", "1", "5", "--rounds", "1", "--isa", "default",
                          "--dtype", "fp32", "fp16"], capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "MISMATCH" not in run.stdout, run.stdout
    for dtype in ("fp32", "fp16"):
        for g in (1, 5):
            block = run.stdout.split(f"G={g} {dtype}")[1].split("N=")[0]
            assert "plain " in block and "pf " in block and "speed vs plain" in block, run.stdout


def test_cuda_kernel_ab_versions_and_bad_specs():
    assert cuda_kernel_ab.parse_version("base=csrc") == ("base", "csrc", {})
    assert cuda_kernel_ab.parse_version("c4k=rev:HEAD~1+chunk=4096+threads=512") == (
        "c4k", "rev:HEAD~1", {"PYENGINE_CUDA_CHUNK": 4096, "PYENGINE_CUDA_THREADS": 512})
    for bad in ("csrc", "1a=csrc", "a=", "a=csrc+chunk", "a=csrc+chunk=0", "a=csrc+chunk=x", "a=csrc+blocks=4"):
        with pytest.raises(SystemExit):
            cuda_kernel_ab.parse_version(bad)
    with pytest.raises(SystemExit, match="distinct"):
        cuda_kernel_ab.main(["a=csrc", "a=csrc+chunk=4096"])
    with pytest.raises(SystemExit, match="asked for PYENGINE_CUDA_CHUNK=4096 but runs with 16384"):
        cuda_kernel_ab.check_shape("a", {"PYENGINE_CUDA_CHUNK": 4096}, "device X chunk 16384 threads 256\n")


def test_cuda_kernel_ab_arithmetic():
    """Synthetic runs: medians, GB/s by the single-pass bytes, the copy yardstick and same-round ratios."""
    assert cuda_kernel_ab.single_pass_bytes(10, 4, "fp32") == 400
    assert cuda_kernel_ab.single_pass_bytes(10, 4, "bf16") == 320
    out = "device X chunk 16384 threads 256\nconfig 1000 4 fp32 0.50000 0.25000 hash 0x00000000000000aa\nnoise\n"
    assert cuda_kernel_ab.parse_output(out) == {(1000, 4, "fp32"): (0.5, 0.25, "0x00000000000000aa")}
    cfg = (1000, 4, "fp32")
    runs = {"a": [{cfg: (0.5, 0.25, "h")}, {cfg: (0.4, 0.20, "h")}, {cfg: (0.6, 0.25, "h")}],
            "b": [{cfg: (0.25, 0.25, "h")}, {cfg: (0.4, 0.25, "h")}, {cfg: (0.3, 0.25, "h")}]}
    assert cuda_kernel_ab.check_bits(runs) == []
    rows = {r["version"]: r for r in cuda_kernel_ab.summarise(runs, copy_bytes=10**6)}
    assert rows["a"]["kernel_ms"] == 0.5 and rows["b"]["kernel_ms"] == 0.3
    assert rows["a"]["gbps"] == pytest.approx(40000 / 0.5 / 1e6)
    assert rows["a"]["copy_gbps"] == pytest.approx(2e6 / 0.25 / 1e6)
    # of copy per round: (40000/k) / (2e6/c) = 0.02 c / k -> a: 0.01, 0.01, 0.008333; b: 0.02, 0.0125, 0.016667
    assert rows["a"]["of_copy"] == pytest.approx(0.01) and rows["b"]["of_copy"] == pytest.approx(0.016667, rel=1e-4)
    assert rows["a"]["speedup"] == 1.0 and rows["b"]["speedup"] == pytest.approx(2.0)  # rounds: 2, 1, 2
    runs["b"][1] = {cfg: (0.4, 0.25, "other")}
    assert cuda_kernel_ab.check_bits(runs) == ["b round 1 (1000, 4, 'fp32'): hash other, a gave h"]
    assert "| 1000 | 4 | fp32 | b | 0.3000 |" in cuda_kernel_ab.table(cuda_kernel_ab.summarise(runs, 10**6))


@pytest.mark.timeout(300)
def test_cuda_kernel_ab_builds_and_runs(tmp_path):
    """Two block shapes build with nvcc; on a GPU they give the same bits on odd sizes (an update's bits do not
    depend on the block shape) and the driver's table comes out; without one the program says so and fails."""
    import subprocess

    try:
        cuda_kernel_ab.find_nvcc()
    except SystemExit:
        pytest.skip("no nvcc")
    versions = [cuda_kernel_ab.parse_version(v) for v in ("a=csrc", "b=csrc+chunk=2048+threads=128")]
    exes = cuda_kernel_ab.build(versions, "sm_90", str(tmp_path))
    configs = ["1000003:3:fp32", "4097:2:bf16", "7:1:fp32"]
    done = {label: subprocess.run([exe, "2", "8", *configs], capture_output=True, text=True, timeout=120)
            for label, exe in exes.items()}
    import torch

    if not torch.cuda.is_available():
        assert all(d.returncode == 1 and "no CUDA device" in d.stderr for d in done.values()), done
        return
    assert all(d.returncode == 0 for d in done.values()), {k: d.stderr for k, d in done.items()}
    cuda_kernel_ab.check_shape("b", versions[1][2], done["b"].stdout)
    runs = {label: [cuda_kernel_ab.parse_output(d.stdout)] for label, d in done.items()}
    assert len(runs["a"][0]) == 3 and cuda_kernel_ab.check_bits(runs) == []
    out = tmp_path / "ab.md"
    assert cuda_kernel_ab.main(["a=csrc", "b=csrc+chunk=4096", "--n", "65537", "--g", "1", "2", "--rounds", "2",
                                "--reps", "2", "--copy-mib", "8", "--out", str(out)]) == 0
    assert out.read_text().count("| 65537 |") == 2 * 2 * 2  # G x dtypes x versions


@pytest.mark.parametrize("script", sorted(f for f in os.listdir(BENCH) if f.startswith("bench_") and f.endswith(".py")))
def test_bench_scripts_import_pyengine_from_the_checkout(script, tmp_path):
    """A GPU machine may build in place (setup.py build_ext --inplace) without installing: every bench script finds
    the checkout's pyengine itself. Run without site (-S: no editable install's hook), torch from its folder."""
    import subprocess

    import torch

    site = os.path.dirname(os.path.dirname(torch.__file__))
    code = f"import runpy; runpy.run_path({os.path.join(BENCH, script)!r}, run_name='imported')"
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": site})
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("named, order", [
    ("env build transfer bench cudatests arena", "env build import transfer bench cudatests arena"),
    ("arena tests env", "env build import arena tests"),
    ("cudatests tests", "build import tests"),  # tests runs the CUDA twins first: not twice
    ("", "env build import tests ctest sanitizer bench kernel_ab nvtx transfer pipeline arena"),
])
def test_gpu_check_runs_env_and_the_build_first_then_the_stages_in_the_order_named(named, order, tmp_path):
    """A GPU machine held for a short time runs first what its command names first; every stage after the build
    has the extension. DRY_RUN=1 prints the order (assuming a build is needed) and runs nothing."""
    import subprocess

    script = os.path.join(BENCH, "gpu_check.sh")
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path)}
    done = subprocess.run(["bash", script, *named.split()], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"stages in order: {order}"
    bad = subprocess.run(["bash", script, "env", "benchmark"], capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "unknown stage 'benchmark'" in bad.stderr, bad.stderr


def test_gpu_check_stopped_by_a_signal_stops_its_stage_and_leaves_the_summary_and_logs(tmp_path):
    """A GPU machine's hold may end during a stage: the script then stops the running stage (its processes too),
    records it, and leaves summary.md and logs.tgz under $OUT with every stage so far (they were left only at the
    very end, and the running stage's processes went on). A fake interpreter stands in for a GPU machine's: it
    answers the import check and sleeps in the benchmark, writing its pid first."""
    import signal
    import subprocess
    import tarfile
    import time

    fake = tmp_path / "python"
    pidfile = tmp_path / "stage.pid"
    fake.write_text(f"""#!/bin/bash
if [[ $1 != bench/bench_fused_adamw.py ]]; then echo 2.0-fake; exit 0; fi
echo $$ > {pidfile}
exec sleep 120
""")
    fake.chmod(0o755)
    out = tmp_path / "out"
    script = os.path.join(BENCH, "gpu_check.sh")
    env = {**os.environ, "OUT": str(out), "PYTHON": str(fake)}
    run = subprocess.Popen(["bash", script, "env", "bench"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists() or not pidfile.read_text().strip():
            assert time.monotonic() < deadline and run.poll() is None, "the bench stage never started"
            time.sleep(0.1)
        stage = int(pidfile.read_text())
        assert (out / "summary.md").exists()  # written after the env stage already
        run.send_signal(signal.SIGTERM)
        output, _ = run.communicate(timeout=30)
    finally:
        run.kill()
        if pidfile.exists() and pidfile.read_text().strip():  # a failed run leaves no sleeper behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
    assert run.returncode == 143, output
    summary = (out / "summary.md").read_text()
    assert "| env |" in summary and "| bench | FAILED (stopped by a signal) |" in summary, summary
    with tarfile.open(out / "logs.tgz") as logs:
        assert {"./env.log", "./bench.log"} <= set(logs.getnames()), logs.getnames()
    deadline = time.monotonic() + 10
    while True:
        try:
            with open(f"/proc/{stage}/status") as status_file:
                status = status_file.read()
        except FileNotFoundError:  # reaped between two looks
            break
        if "zombie" in status.lower():
            break
        assert time.monotonic() < deadline, "the stage's process outlived the script"
        time.sleep(0.1)
