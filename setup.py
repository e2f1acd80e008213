"""Builds pyengine._C: the CPU ops always, the CUDA ops when torch has CUDA and nvcc is found.

No environment variables are needed by hand. Toggles: PYENGINE_CPU_ONLY=1 (skip CUDA), TORCH_CUDA_ARCH_LIST (default
9.0 when no GPU is visible), CUDA_HOME (default /usr/local/cuda).
"""
import glob
import os
import platform
import shutil
import sysconfig

if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"  # set before cpp_extension reads it; /usr/local/bin/nvcc is a wrapper

# Compile and link with the C++ toolchain on PATH (CC/CXX when set), as torch's own JIT builds do. setuptools would take
# the interpreter's build compiler from sysconfig instead, and one such toolchain (seen: /opt/gcc) links libstdc++
# statically into _C: a second, uninitialised libstdc++ in the process then crashes on the first formatted error.
for var, tool, linker in (("CC", "cc", "LDSHARED"), ("CXX", "c++", "LDCXXSHARED")):
    old, new = sysconfig.get_config_var(var) or "", os.environ.get(var) or shutil.which(tool)
    link = sysconfig.get_config_var(linker) or ""
    if new and var not in os.environ:
        os.environ[var] = new
    if new and old and linker not in os.environ and link.startswith(old):
        os.environ[linker] = new + link[len(old):]

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

# -fopenmp: at::parallel_for is a header template over `#pragma omp parallel`; without the flag it runs serially.
CXX_FLAGS = ["-O3", "-g0", "-std=c++20", "-fno-math-errno", "-fopenmp"]
# The fused loops, compiled once per ISA and chosen at run time (csrc/cpu/kernel.h). -ffp-contract=off keeps every
# variant bit-identical. Never -march=native: the binary must run on any x86-64.
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
               "-mprefer-vector-width=512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "default": [],
}
if platform.machine() not in ("x86_64", "AMD64"):
    ISA_FLAGS = {"default": []}
KERNEL_SOURCE = "csrc/cpu/kernel_isa.cpp"


def cuda_wanted():
    if os.environ.get("PYENGINE_CPU_ONLY") == "1" or torch.version.cuda is None:
        return False
    home = cpp_extension.CUDA_HOME
    return home is not None and os.path.exists(os.path.join(home, "bin", "nvcc"))


class BuildExt(cpp_extension.BuildExtension):
    """Compiles KERNEL_SOURCE once per ISA with its own flags (cpp_extension has no per-file flags)."""

    def build_extensions(self):
        for ext in self.extensions:
            for isa, flags in ISA_FLAGS.items():
                ext.extra_objects += self.compiler.compile(
                    [KERNEL_SOURCE], output_dir=os.path.join(self.build_temp, "isa", isa),
                    macros=[("PYENGINE_ISA", isa)],
                    extra_postargs=CXX_FLAGS + ["-fPIC", "-ffp-contract=off", "-fno-trapping-math",
                                                   "-Wno-maybe-uninitialized"] + flags)
        super().build_extensions()


def extension():
    with_cuda = cuda_wanted()
    sources = [s for s in glob.glob("csrc/**/*.cpp", recursive=True) if s != KERNEL_SOURCE]
    macros = [("PYENGINE_CPU_ISA_VARIANTS", None)] if len(ISA_FLAGS) > 1 else []
    if not with_cuda:
        print("pyengine: building without CUDA (torch.version.cuda=%s, CUDA_HOME=%s)"
              % (torch.version.cuda, cpp_extension.CUDA_HOME))
        sources = [s for s in sources if not s.startswith("csrc/cuda/")]
        return cpp_extension.CppExtension("pyengine._C", sources, define_macros=macros,
                                          extra_compile_args={"cxx": CXX_FLAGS}, extra_link_args=["-fopenmp"])
    if not torch.cuda.is_available():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # nothing to detect the arch from: Hopper
    include_dirs = []
    nvidia = os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cu13", "include")
    if not os.path.exists(os.path.join(cpp_extension.CUDA_HOME, "include", "cusparse.h")) and os.path.isdir(nvidia):
        include_dirs.append(nvidia)  # ATen/cuda headers include cusparse.h & co., shipped with torch's wheels
    sources += glob.glob("csrc/cuda/*.cu")
    return cpp_extension.CUDAExtension(
        "pyengine._C", sources, include_dirs=include_dirs,
        define_macros=macros + [("PYENGINE_WITH_CUDA", None)],
        extra_compile_args={"cxx": CXX_FLAGS, "nvcc": ["-O3", "-std=c++20", "-lineinfo", "--fmad=false"]},
        extra_link_args=["-fopenmp"])


setup(
    name="pyengine",
    version="0.1.0",
    description="Training engine: pinned host master weights, overlapped gradient transfer, fused mean-gradient AdamW",
    packages=["pyengine"],
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExt},
    python_requires=">=3.10",
    install_requires=["torch"],
)
