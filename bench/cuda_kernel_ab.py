"""A/B timing of versions of the CUDA update kernel (csrc/cuda/kernels.cu), each against a device copy in its run.

A version is ``label=SOURCE[+chunk=N][+threads=N]``: SOURCE is a csrc-like folder (``csrc``, the working tree) or
``rev:<git revision>``; ``chunk`` / ``threads`` compile it with another block shape (``PYENGINE_CUDA_CHUNK``,
``PYENGINE_CUDA_THREADS``, launch.h). Every version is built with plain nvcc into bench/cuda_kernel_ab.cu, must
give the first version's bits (param, exp_avg, exp_avg_sq after two steps, for every configuration, including an
odd-sized one that takes the scalar tail), and is then timed round by round (the order rotates every round), each
launch followed by a device copy on the same stream. Reported: medians, GB/s by the issue's single-pass bytes
(4N(G+6) with fp32 gradients, 2NG + 24N with bf16), the kernel's fraction of the copy's GB/s in the same run, and
the speed-up over the first version (median of same-round ratios).

    python bench/cuda_kernel_ab.py                      # the build's block shape against smaller chunks and 512 threads
    python bench/cuda_kernel_ab.py base=rev:HEAD new=csrc --n 33554432 --g 4 --rounds 9
    python bench/cuda_kernel_ab.py a=csrc b=csrc+chunk=4096 --out ab.md

Why: ptxas (nvcc 13.0, sm_90) gives update_kernel<AdamW> 40 registers a thread, so 6 blocks of 256 threads fit on
an SM: 792 resident blocks on an H100's 132 SMs. With 16384-element chunks (the build until 2026-11-25), N = 32M was
2048 blocks, 2.6 waves with the last 59 % full; 2048-element chunks (the build since) make it 20.7 waves. Measured by
this harness on an H100 (bench/RESULTS.md): 2048 beat 16384 by 1.4-4.2 % at N = 32M and 256M and 2x at N = 1M.
PYENGINE_AB_NO_CHECK=1 skips the bit check (diagnostic variants that compute something else on purpose).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_kernel_ab import ROOT, materialise  # noqa: E402

SOURCES = ("cuda/kernels.cu", "cuda/launch.h", "update_scalars.h")
DEFAULT_VERSIONS = ["base=csrc", "c16k=csrc+chunk=16384", "c4k=csrc+chunk=4096", "c1k=csrc+chunk=1024",
                    "t512=csrc+threads=512"]
CHECK_N = 1000003  # odd: every version's scalar tail and the last partial chunk go through the bit check
_SHAPE = {"chunk": "PYENGINE_CUDA_CHUNK", "threads": "PYENGINE_CUDA_THREADS"}
_LINE = re.compile(r"^config (\d+) (\d+) (fp32|bf16) ([0-9.]+) ([0-9.]+) hash (0x[0-9a-f]{16})$")


def parse_version(text: str) -> tuple[str, str, dict]:
    """``label=SOURCE[+chunk=N][+threads=N]`` -> (label, source spec, {macro: value})."""
    label, sep, rest = text.partition("=")
    if not sep or not label.isidentifier():
        raise SystemExit(f"a version is label=SOURCE[+chunk=N][+threads=N] with an identifier label, got {text!r}")
    source, *options = rest.split("+")
    defines = {}
    for option in options:
        key, sep, value = option.partition("=")
        if key not in _SHAPE or not sep or not value.isdigit() or int(value) <= 0:
            raise SystemExit(f"version {label!r}: option {option!r} is not chunk=N or threads=N with N > 0")
        defines[_SHAPE[key]] = int(value)
    if not source:
        raise SystemExit(f"version {label!r} names no source (csrc, a folder, or rev:<git revision>)")
    return label, source, defines


def find_nvcc() -> str:
    """nvcc of CUDA_HOME, else /usr/local/cuda's, else the one on PATH."""
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("nvcc not found: set CUDA_HOME")
    return nvcc


def build_one(nvcc: str, label: str, folder: str, defines: dict, arch: str, workdir: str) -> str:
    exe = os.path.join(workdir, f"cuda_kernel_ab_{label}")
    flags = [f"-D{k}={v}" for k, v in defines.items()]
    cmd = [nvcc, "-O3", "-std=c++20", "--fmad=false", f"-arch={arch}", *flags, f"-I{os.path.join(folder, 'cuda')}",
           os.path.join(ROOT, "bench", "cuda_kernel_ab.cu"), os.path.join(folder, "cuda", "kernels.cu"), "-o", exe]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"building version {label!r} failed:\n{' '.join(cmd)}\n{done.stderr[-4000:]}")
    return exe


def build(versions: list, arch: str, workdir: str) -> dict:
    """{label: executable}, built in parallel."""
    nvcc = find_nvcc()
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {label: pool.submit(build_one, nvcc, label, materialise(source, workdir, SOURCES), defines, arch,
                                      workdir)
                   for label, source, defines in versions}
        return {label: f.result() for label, f in futures.items()}


def check_shape(label: str, defines: dict, text: str) -> None:
    """The block shape a version's run reports must be the one asked for (a revision older than the macros in
    launch.h would ignore them)."""
    m = re.search(r"^device (.*) chunk (\d+) threads (\d+)$", text, re.M)
    if m is None:
        raise SystemExit(f"version {label!r} printed no device line:\n{text[:2000]}")
    got = {"PYENGINE_CUDA_CHUNK": int(m[2]), "PYENGINE_CUDA_THREADS": int(m[3])}
    for macro, want in defines.items():
        if got[macro] != want:
            raise SystemExit(f"version {label!r} asked for {macro}={want} but runs with {got[macro]} (its launch.h "
                             f"predates the {macro} macro?)")


def parse_output(text: str) -> dict:
    """{(N, G, dtype): (kernel_ms, copy_ms, hash)} from one run's standard output."""
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            out[(int(m[1]), int(m[2]), m[3])] = (float(m[4]), float(m[5]), m[6])
    return out


def single_pass_bytes(n: int, g: int, dtype: str) -> int:
    """The bytes the fused update must move at least: 4N(G+6) with fp32 gradients, 2NG + 24N with bf16."""
    return 4 * n * (g + 6) if dtype == "fp32" else 2 * n * g + 24 * n


def check_bits(runs: dict) -> list[str]:
    """Mismatches of any run's hash against the first version's first run, per configuration (an empty list: all
    equal). ``runs``: {label: [parsed run, ...]}, labels in version order."""
    labels = list(runs)
    problems = []
    for config, (_, _, want) in runs[labels[0]][0].items():
        for label in labels:
            for r, run in enumerate(runs[label]):
                got = run.get(config, (None, None, "missing"))[2]
                if got != want:
                    problems.append(f"{label} round {r} {config}: hash {got}, {labels[0]} gave {want}")
    return problems


def summarise(runs: dict, copy_bytes: int) -> list[dict]:
    """One row per configuration and version: medians over rounds, and same-round ratios to the first version."""
    labels = list(runs)
    rows = []
    for config in runs[labels[0]][0]:
        n, g, dtype = config
        nbytes = single_pass_bytes(n, g, dtype)
        base = [run[config][0] for run in runs[labels[0]]]
        for label in labels:
            kernel = [run[config][0] for run in runs[label]]
            copy = [run[config][1] for run in runs[label]]
            rows.append({
                "n": n, "g": g, "dtype": dtype, "version": label,
                "kernel_ms": statistics.median(kernel),
                "gbps": nbytes / statistics.median(kernel) / 1e6,
                "copy_gbps": 2 * copy_bytes / statistics.median(copy) / 1e6,
                "of_copy": statistics.median((nbytes / k) / (2 * copy_bytes / c) for k, c in zip(kernel, copy)),
                "speedup": statistics.median(b / k for b, k in zip(base, kernel)),
            })
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| N | G | grads | version | kernel ms | GB/s | copy GB/s | of copy | vs first (paired) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['g']} | {r['dtype']} | {r['version']} | {r['kernel_ms']:.4f} | "
                     f"{r['gbps']:.1f} | {r['copy_gbps']:.1f} | {r['of_copy']:.3f} | {r['speedup']:.3f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="*", default=DEFAULT_VERSIONS,
                    help="label=SOURCE[+chunk=N][+threads=N]; SOURCE: csrc, a csrc-like folder or rev:<revision>; "
                         "the first is the reference")
    ap.add_argument("--n", type=int, nargs="+", default=[32 << 20, 256 << 20])
    ap.add_argument("--g", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=15, help="timed launches per configuration in each run (median)")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the device copy timed beside each launch")
    ap.add_argument("--arch", default="sm_90", help="nvcc -arch (sm_90: H100, H200)")
    ap.add_argument("--out", help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    versions = [parse_version(v) for v in args.versions]
    if len({label for label, _, _ in versions}) != len(versions):
        raise SystemExit(f"version labels must be distinct, got {args.versions}")
    if min(args.n) < 1 or min(args.g) < 1 or args.rounds < 1 or args.reps < 1 or args.copy_mib < 1:
        raise SystemExit("--n, --g, --rounds, --reps and --copy-mib must be positive")
    configs = [f"{CHECK_N}:3:{d}" for d in args.dtypes]
    configs += [f"{n}:{g}:{d}" for n in args.n for d in args.dtypes for g in args.g]
    with tempfile.TemporaryDirectory(prefix="cuda_kernel_ab_") as workdir:
        exes = build(versions, args.arch, workdir)
        defines = {label: d for label, _, d in versions}
        labels = list(exes)
        runs = {label: [] for label in labels}
        for r in range(args.rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                done = subprocess.run([exes[label], str(args.reps), str(args.copy_mib), *configs],
                                      capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"version {label!r} failed (rc={done.returncode}): {done.stderr.strip()}", file=sys.stderr)
                    return 1
                if r == 0:
                    check_shape(label, defines[label], done.stdout)
                    print(f"{label}: {done.stdout.splitlines()[0]}")  # the device and the version's block shape
                runs[label].append(parse_output(done.stdout))
    problems = check_bits(runs)
    if problems and os.environ.get("PYENGINE_AB_NO_CHECK") != "1":
        print("versions disagree on the result's bits (PYENGINE_AB_NO_CHECK=1 to time them anyway):", file=sys.stderr)
        print("\n".join(problems[:20]), file=sys.stderr)
        return 1
    text = table(summarise(runs, args.copy_mib << 20))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
