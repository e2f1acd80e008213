"""Builds pyengine._C: the CPU ops always, the CUDA ops when torch has CUDA and nvcc is found.

No environment variables are needed by hand. Toggles: PYENGINE_CPU_ONLY=1 (skip CUDA), TORCH_CUDA_ARCH_LIST (default
9.0 when no GPU is visible), CUDA_HOME (default /usr/local/cuda).
"""
import glob
import os
import platform
import shutil
import subprocess
import sys
import sysconfig

if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"  # set before cpp_extension reads it; /usr/local/bin/nvcc is a wrapper

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
ROOT = os.path.dirname(os.path.abspath(__file__))
# The folder of the objects, whoever builds: `pip install -e .` would compile everything in a fresh temporary folder,
# and `make build` (build_ext --inplace, this folder) would then compile it all again.
BUILD_TEMP = os.path.join(ROOT, "build", f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")


def links_shared_libstdcxx(cxx):
    """Whether this C++ compiler finds libstdc++.so, i.e. links the process's shared libstdc++ into _C."""
    try:
        found = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return os.path.isabs(found.stdout.strip())


def toolchain():
    """(CC, CXX) to build with: CXX, else the interpreter's build compiler, as setuptools would, unless that one links
    libstdc++ statically (seen: a /opt/gcc toolchain without libstdc++.so). A second, uninitialised libstdc++ inside
    _C crashes on the first error message that formats a number; the compiler on PATH is taken instead."""
    cxx = (os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++").split()[0]
    if links_shared_libstdcxx(cxx):
        return None
    for cc_name, cxx_name in (("cc", "c++"), ("gcc", "g++")):
        cc, other = shutil.which(cc_name), shutil.which(cxx_name)
        if cc and other and links_shared_libstdcxx(other):
            print(f"pyengine: {cxx} would link libstdc++ statically into _C; building with {other} instead")
            return cc, other
    raise SystemExit(f"pyengine: {cxx} links libstdc++ statically and no compiler on PATH links libstdc++.so; "
                     "set CXX (and CC) to one that does")


TOOLCHAIN = toolchain()
if TOOLCHAIN:
    os.environ["CC"], os.environ["CXX"] = TOOLCHAIN  # read by cpp_extension's ninja rules and nvcc's -ccbin


def check_linked(path):
    """Fails the build, rather than the first error at run time, when _C carries its own libstdc++."""
    if not shutil.which("readelf"):
        return
    dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
    if "libstdc++.so" not in dynamic:
        raise SystemExit(f"pyengine: {path} does not link libstdc++.so (a static libstdc++ crashes at the first "
                         "error message); set CXX to a compiler that links it dynamically")


def cuda_wanted():
    if os.environ.get("PYENGINE_CPU_ONLY") == "1" or torch.version.cuda is None:
        return False
    home = cpp_extension.CUDA_HOME
    return home is not None and os.path.exists(os.path.join(home, "bin", "nvcc"))


def up_to_date(obj, flags):
    """Whether obj was compiled with these flags from sources none of which changed since (its -MMD depfile)."""
    try:
        with open(obj + ".flags") as f:
            if f.read() != repr(flags):
                return False
        with open(os.path.splitext(obj)[0] + ".d") as f:
            deps = f.read().replace("\\\n", " ").split(":", 1)[1].split()
        built = os.path.getmtime(obj)
        return all(os.path.getmtime(dep) <= built for dep in deps)
    except (OSError, IndexError):
        return False


class BuildExt(cpp_extension.BuildExtension):
    """Compiles KERNEL_SOURCE once per ISA with its own flags (cpp_extension has no per-file flags), each only when
    it or a header it includes changed (distutils' compile() always compiles), all in BUILD_TEMP."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = BUILD_TEMP

    def build_extensions(self):
        if TOOLCHAIN:  # every source is C++: compile and link with the chosen CXX, whatever sysconfig says
            for attr in ("compiler", "compiler_so", "compiler_cxx", "compiler_so_cxx", "linker_so", "linker_so_cxx",
                         "linker_exe", "linker_exe_cxx"):
                command = getattr(self.compiler, attr, None)
                if command:
                    setattr(self.compiler, attr, [TOOLCHAIN[1]] + list(command[1:]))
        for ext in self.extensions:
            for isa, flags in ISA_FLAGS.items():
                output_dir = os.path.join(self.build_temp, "isa", isa)
                postargs = CXX_FLAGS + ["-fPIC", "-ffp-contract=off", "-fno-trapping-math",
                                        "-Wno-maybe-uninitialized", "-MMD"] + flags
                obj = self.compiler.object_filenames([KERNEL_SOURCE], output_dir=output_dir)[0]
                stamp = (self.compiler.compiler_so, postargs)
                if not up_to_date(obj, stamp):
                    self.compiler.compile([KERNEL_SOURCE], output_dir=output_dir, macros=[("PYENGINE_ISA", isa)],
                                          extra_postargs=postargs)
                    with open(obj + ".flags", "w") as f:
                        f.write(repr(stamp))
                ext.extra_objects.append(obj)
        super().build_extensions()
        for ext in self.extensions:
            check_linked(self.get_ext_fullpath(ext.name))


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
