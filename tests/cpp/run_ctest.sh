#!/usr/bin/env bash
# Configures, builds and runs the C++ unit tests (CMakeLists.txt at the top level) against the venv's libtorch.
#   tests/cpp/run_ctest.sh [extra cmake -D flags]      PYTHON (default .venv/bin/python), BUILD_DIR (build-cmake),
#                                                      JOBS (2)
# The CUDA toolkit and nvrtc paths are only needed because torch's CMake config looks for CUDA whenever torch was
# built with it, even for a CPU-only build.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
BUILD_DIR=${BUILD_DIR:-build-cmake}
JOBS=${JOBS:-2}

read -r TORCH_PREFIX SITE <<<"$("$PYTHON" -c 'import sysconfig, torch; print(torch.utils.cmake_prefix_path, sysconfig.get_paths()["purelib"])')"
flags=(-DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DPython3_EXECUTABLE="$(command -v "$PYTHON")")
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
cmake --build "$BUILD_DIR" -j "$JOBS"
ctest --test-dir "$BUILD_DIR" --output-on-failure
