#!/usr/bin/env bash
# Configures, builds and runs the C++ unit tests (CMakeLists.txt at the top level) against the venv's libtorch.
#   tests/cpp/run_ctest.sh [extra cmake -D flags]      PYTHON (default .venv/bin/python), BUILD_DIR (build-cmake),
#                                                      JOBS (2); CONFIGURE_ONLY=1 stops after cmake's configure and
#                                                      generate steps (seconds: tests/test_ops.py checks the CUDA
#                                                      configuration with it on machines without a GPU)
# The CUDA toolkit and nvrtc paths are only needed because torch's CMake config looks for CUDA whenever torch was
# built with it, even for a CPU-only build.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
BUILD_DIR=${BUILD_DIR:-build-cmake}
JOBS=${JOBS:-2}

# The compiler rule of setup.py's toolchain(): CXX (else c++) unless it links libstdc++ statically (a /opt/gcc
# wrapper without libstdc++.so was seen on a GPU machine; a second libstdc++ in the process crashes on the first error
# message that formats a number), then the first compiler on PATH that links libstdc++.so.
links_shared_libstdcxx() { [[ $("$1" -print-file-name=libstdc++.so 2>/dev/null) == /* ]]; }
cxx=${CXX:-c++}
if ! links_shared_libstdcxx "${cxx%% *}"; then
  for pair in "cc c++" "gcc g++"; do
    read -r cc_name cxx_name <<<"$pair"
    if command -v "$cc_name" >/dev/null && command -v "$cxx_name" >/dev/null \
       && links_shared_libstdcxx "$(command -v "$cxx_name")"; then
      echo "run_ctest: $cxx would link libstdc++ statically; building with $(command -v "$cxx_name") instead"
      export CC=$(command -v "$cc_name") CXX=$(command -v "$cxx_name")
      break
    fi
  done
  if ! links_shared_libstdcxx "${CXX:-c++}"; then
    echo "run_ctest: no compiler links libstdc++.so; set CXX (and CC) to one that does" >&2
    exit 1
  fi
fi

read -r TORCH_PREFIX SITE <<<"$("$PYTHON" -c 'import sysconfig, torch; print(torch.utils.cmake_prefix_path, sysconfig.get_paths()["purelib"])')"
# An absolute path (a relative one makes CMake look for another Python on PATH), not resolved: a venv's python is a
# link to the base interpreter, and resolving it would leave the venv.
PYTHON_PATH=$(command -v "$PYTHON")
[[ $PYTHON_PATH == /* ]] || PYTHON_PATH="$PWD/$PYTHON_PATH"
flags=(-DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DPython3_EXECUTABLE="$PYTHON_PATH")
if "$PYTHON" -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then
  CUDA_ROOT=${CUDA_HOME:-/usr/local/cuda}
  # No GPU to detect the arch from (torch's config would try_run a probe): Hopper, as setup.py.
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
  flags+=(-DCUDA_TOOLKIT_ROOT_DIR="$CUDA_ROOT" -DCUDAToolkit_ROOT="$CUDA_ROOT")
  nvrtc=$(ls "$SITE"/nvidia/cu*/lib/libnvrtc.so.* "$SITE"/nvidia/cuda_nvrtc/lib/libnvrtc.so.* 2>/dev/null \
          | grep -v builtins | head -n 1 || true)
  [[ -n "$nvrtc" ]] && flags+=(-DCUDA_nvrtc_LIBRARY="$nvrtc")
fi

cmake -S . -B "$BUILD_DIR" "${flags[@]}" "$@"
[[ ${CONFIGURE_ONLY:-0} == 1 ]] && exit 0
cmake --build "$BUILD_DIR" -j "$JOBS"
ctest --test-dir "$BUILD_DIR" --output-on-failure
