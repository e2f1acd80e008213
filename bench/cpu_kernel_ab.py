"""Single-thread A/B timing of versions of the CPU update loop (csrc/cpu/kernel_isa.cpp), interleaved in one process.

Each version is a csrc-like folder (``cpu/kernel_isa.cpp``, ``cpu/kernel.h``, ``update_scalars.h``) or a git
revision of this repository. Every version is compiled with setup.py's flags for one ISA (avx512 by default) under its
own label, linked into bench/cpu_kernel_ab.cpp, checked to give the first version's bits, then timed round by round
(A, B, ..., copy; the order rotates every round) with medians and same-round ratios. No torch needed: plain g++.

    python bench/cpu_kernel_ab.py                                   # HEAD vs the working tree, N=32M, G=4 and 8
    python bench/cpu_kernel_ab.py base=rev:HEAD~1 new=csrc --g 1 4 8 --rounds 21
    python bench/cpu_kernel_ab.py a=/tmp/variant_a b=/tmp/variant_b --dtype bf16
    python bench/cpu_kernel_ab.py plain=csrc prefetch=csrc@prefetch --g 1 4 8   # the table's two update loops

A version spec ending in ``@prefetch`` times its table's software-prefetching update (``update_prefetch``, Note
[Prefetching the streams] in csrc/cpu/kernel_isa.cpp) instead of ``update``. The harness reads the tables through
the kernel.h of the first such version (else the first version's): the tables' layouts only grew at the end.

PYENGINE_AB_NO_CHECK=1 skips the bit check, for diagnostic variants that compute something else on purpose (a loop
with one phase left out, to time the other).
"""
from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("cpu/kernel_isa.cpp", "cpu/kernel.h", "update_scalars.h")


def setup_flags() -> tuple[list, dict]:
    """CXX_FLAGS and ISA_FLAGS as setup.py defines them (read, not imported: importing setup.py runs setup())."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in ("CXX_FLAGS", "ISA_FLAGS") and name not in found:
                found[name] = ast.literal_eval(node.value)
    return [f for f in found["CXX_FLAGS"] if f != "-fopenmp"], found["ISA_FLAGS"]


def materialise(spec: str, workdir: str, sources=SOURCES) -> str:
    """A folder holding ``sources`` (paths under csrc/) for one version spec: ``rev:<git revision>`` or a csrc-like
    folder."""
    if not spec.startswith("rev:"):
        folder = spec if os.path.isabs(spec) else os.path.join(ROOT, spec)
        missing = [s for s in sources if not os.path.isfile(os.path.join(folder, s))]
        if missing:
            raise SystemExit(f"version folder {folder!r} lacks {missing}")
        return folder
    rev = spec[4:]
    folder = os.path.join(workdir, "rev_" + "".join(c if c.isalnum() else "_" for c in rev))
    for s in sources:
        os.makedirs(os.path.dirname(os.path.join(folder, s)), exist_ok=True)
        text = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:csrc/{s}"], check=True, capture_output=True).stdout
        with open(os.path.join(folder, s), "wb") as f:
            f.write(text)
    return folder


def build(versions: dict, entries: dict, isa: str, workdir: str) -> str:
    cxx_flags, isa_flags = setup_flags()
    if isa not in isa_flags:
        raise SystemExit(f"--isa must be one of {sorted(isa_flags)}, got {isa!r}")
    objects = []
    for label, folder in versions.items():
        obj = os.path.join(workdir, f"{label}.o")
        subprocess.run(["g++", *cxx_flags, "-ffp-contract=off", "-fno-trapping-math", "-Wno-maybe-uninitialized",
                        *isa_flags[isa], f"-DPYENGINE_ISA={label}", "-c", os.path.join(folder, SOURCES[0]),
                        "-o", obj], check=True)
        objects.append(obj)
    exe = os.path.join(workdir, "cpu_kernel_ab")
    listing = " ".join(f"X({label}, {entries[label]})" for label in versions)
    first = next((versions[label] for label in versions if entries[label] == "update_prefetch"),
                 next(iter(versions.values())))
    subprocess.run(["g++", "-O2", "-std=c++20", f"-DPYENGINE_AB_VARIANTS={listing}", f"-I{first}",
                    os.path.join(ROOT, "bench", "cpu_kernel_ab.cpp"), *objects, "-o", exe], check=True)
    return exe


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="*", default=["base=rev:HEAD", "new=csrc"],
                    help="label=rev:<git revision> or label=<csrc-like folder>, either with @prefetch to time "
                         "update_prefetch; the first is the reference")
    ap.add_argument("--n", type=int, default=32 << 20)
    ap.add_argument("--g", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], nargs="+", default=["fp32"],
                    help="gradient dtypes, each timed with the same build")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--chunk", type=int, default=16 * 1024, help="elements per update() call (kChunk)")
    ap.add_argument("--isa", default="avx512")
    ap.add_argument("--huge-pages", action="store_true", help="also run every version on buffers madvise(MADV_HUGEPAGE)d")
    args = ap.parse_args(argv)
    pairs = [v.split("=", 1) for v in args.versions]
    if any(len(p) != 2 or not p[0].isidentifier() for p in pairs) or len({p[0] for p in pairs}) != len(pairs):
        raise SystemExit(f"versions must be distinct label=spec pairs with identifier labels, got {args.versions}")
    with tempfile.TemporaryDirectory(prefix="cpu_kernel_ab_") as workdir:
        entries = {label: "update_prefetch" if spec.endswith("@prefetch") else "update" for label, spec in pairs}
        versions = {label: materialise(spec.removesuffix("@prefetch"), workdir) for label, spec in pairs}
        exe = build(versions, entries, args.isa, workdir)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for dtype in args.dtype:
            for g in args.g:
                rc = subprocess.run([exe, str(args.n), str(g), dtype, str(args.rounds), str(args.chunk)]
                                    + (["huge"] if args.huge_pages else []),
                                    env=env).returncode
                if rc != 0:
                    return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
