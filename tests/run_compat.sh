#!/usr/bin/env bash
# The test suite under another torch release (default 2.11.0, the GPU machines' torch), on this machine's CPU.
#
#   tests/run_compat.sh [TORCH_VERSION] [pytest args...]     PYTHON: the base interpreter (default python3)
#
# Makes .venv-torch<VERSION> (once) with that torch and the test tools, copies the working tree's tracked files (as
# they are now, uncommitted changes included) to build-compat-<VERSION>/ so that the main build is not touched,
# installs there with the GPU machines' build command (pip install -e . --no-build-isolation; CPU-only, which is
# what can run here), and runs pytest there. Takes ~10 minutes on 2 cores the first time (torch is downloaded);
# not part of `make test`. Under 2.11 it found the cross-process pipeline's BatchNorm bug
# (Note [Shape inference leaves the buffers alone]).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-2.11.0}
[[ $# -gt 0 ]] && shift
if [[ ! $VERSION =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]]; then
  echo "run_compat: '$VERSION' is not a torch version like 2.11.0" >&2
  exit 2
fi
VENV=$PWD/.venv-torch$VERSION
TREE=$PWD/build-compat-$VERSION

if [[ ! -x $VENV/bin/python ]]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q "torch==$VERSION" -r requirements-dev.txt wheel
"$VENV/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$VERSION', torch.__version__"

# The files git would commit (tracked and new, not ignored; a deleted one is skipped with a warning); the old copy's
# build/ is kept, so the extension rebuilds incrementally.
mkdir -p "$TREE"
find "$TREE" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf - | tar -xf - -C "$TREE"
(cd "$TREE" && PYENGINE_CPU_ONLY=1 "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e .)
cd "$TREE"
"$VENV/bin/python" -c "import torch, pyengine; print('torch', torch.__version__, '| pyengine from', pyengine.__file__)"
exec "$VENV/bin/python" -m pytest tests -q -rfE -p no:cacheprovider "$@"
