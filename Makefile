# `make test` and `make train` set everything up on a fresh machine (a .venv in this folder) and run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEPS := $(VENV)/.deps-installed
export MAX_JOBS ?= 2

.PHONY: all build test pytest ctest train bench gpu-check clean

all: build

$(DEPS): requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

# Incremental: compiles only the sources that changed (setup.py keeps every build's objects in build/temp.*, so the
# first one, pip's, is not compiled twice).
build: $(DEPS)
	$(PY) setup.py -q build_ext --inplace

pytest: build  # the 25 slowest tests listed at the end: where the suite's time goes
	$(PY) -m pytest tests -q --durations=25

ctest: $(DEPS)
	PYTHON=$(PY) tests/cpp/run_ctest.sh

test: pytest ctest

train: build
	$(PY) -m pyengine train

bench: build
	$(PY) bench/bench_fused_adamw.py --quick

gpu-check:
	bench/gpu_check.sh

clean:
	rm -rf build build-cmake pyengine/*.so *.egg-info
