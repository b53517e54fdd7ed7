# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Each creates .venv from the lock file (uv, bootstrapped from PyPI into .tools/) first.
SHELL := /bin/bash
PY    := .venv/bin/python
UV    := .tools/bin/uv
UV_VERSION := 0.13.9
DATA  := data/sample
RUNS  := runs

.PHONY: setup lint test test-fast test-xla demo demo-local bench generate cluster-build cluster-up cluster-down clean

$(UV):
	python3 -m venv .tools
	.tools/bin/pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

# the interpreter both environments are built on: the distribution's CPython where there is one
# (Debian's is built with PGO and LTO; a trainer's start, torchrun and two ranks, took 15-20% less
# CPU on it than on a pyenv build without them, 2026-12-01: most of the suite's CPU is Python
# starting and importing torch), else the first python3 on PATH. Only with its whole standard
# library (Debian's libpython3.11-stdlib, here marked by sqlite3): python3.11-minimal alone also
# installs /usr/bin/python3.11
VENV_PYTHON ?= $(if $(wildcard /usr/lib/python3.11/sqlite3/__init__.py),/usr/bin/python3.11,python3)

# --compile-bytecode: the images' pip installs write .pyc files too; without them (and with
# PYTHONDONTWRITEBYTECODE set, as on the development machines) every process compiles what it
# imports again: the Kubernetes client's 4.4 MB core_v1_api.py alone took 3 s of CPU and a
# transient 88 MiB (kept as heap: +63 MiB RSS) at every operator start
.venv/.synced: $(UV) pyproject.toml uv.lock
	$(UV) sync --frozen --all-extras --compile-bytecode --python $(VENV_PYTHON)
	touch $@

setup: .venv/.synced

# the torch-xla tier: its own environment (torch-xla pins another torch), from xla/uv.lock
.venv-xla/.synced: $(UV) xla/pyproject.toml xla/uv.lock pyproject.toml
	UV_PROJECT_ENVIRONMENT=$(CURDIR)/.venv-xla $(UV) sync --frozen --project xla --compile-bytecode \
	  --python $(VENV_PYTHON)
	touch $@

lint: setup
	.venv/bin/ruff check .
	.venv/bin/mypy api/hlat_api trainer/hlat_trainer operator/hlat_operator
	.venv/bin/lint-imports
	.venv/bin/hadolint Dockerfile.trainer Dockerfile.operator

# the control plane's binaries are built (once, cached outside the repo) before pytest starts;
# then two pytest workers, each with a local cluster of its own, take whole test files, the two
# soaks first (tests/conftest.py), and the torch-xla tier runs beside those (its 5 minutes were
# the suite's serial tail; the soaks' bounds allow for a third load; its output follows
# theirs, and either failing fails the target); the tests that compare nodes' speeds (marked
# solo) run last, alone: every rig node shares the host's two cores, and a second cluster's
# load is noise no real node has
test: lint .venv-xla/.synced
	$(PY) -m hlat_testbed.build
	@xla_log=$$(mktemp); $(XLA_TESTS) > $$xla_log 2>&1 & xla=$$!; \
	  .venv/bin/pytest --ignore=tests/xla -n 2 --dist loadfile --no-loadscope-reorder \
	    -m "not solo"; cluster=$$?; \
	  wait $$xla; tier=$$?; cat $$xla_log; rm -f $$xla_log; \
	  echo "cluster tests: exit $$cluster; torch-xla tier: exit $$tier"; \
	  test $$cluster = 0 && test $$tier = 0
	.venv/bin/pytest --ignore=tests/xla -m solo

test-fast: setup
	.venv/bin/pytest --ignore=tests/xla -m "not slow and not cluster"

# tests/xla on real torch-xla, PJRT's CPU device (tests/xla/conftest.py sets PJRT_DEVICE=CPU)
XLA_TESTS := .venv-xla/bin/pytest -c xla/pytest.ini --rootdir=. tests/xla
test-xla: .venv-xla/.synced
	$(XLA_TESTS)

$(DATA)/tokenizer.json: | setup
	.venv/bin/hlat-data sample --out $(DATA)

# the main job: a PretrainJob on the local Kubernetes cluster, a worker killed and recovered
demo: setup
	$(PY) -m hlat_testbed.demo

# the same tiny model trained in one local process
demo-local: setup $(DATA)/tokenizer.json
	.venv/bin/hlat-train --config examples/pretrainjob-tiny.yaml --set nodes=1 \
	  --set data.path=$(DATA) --set data.tokenizer=$(DATA)/tokenizer.json \
	  --set checkpoint.dir=$(RUNS)/checkpoints
	@echo "checkpoints: $(RUNS)/checkpoints/tiny/ (run again to resume from the latest)"

# the operator image preloads jemalloc (Dockerfile.operator); the operator-at-scale bench too
bench: setup $(DATA)/tokenizer.json
	@ls /usr/lib/*/libjemalloc.so.2 > /dev/null 2>&1 || \
	  (apt-get update -qq && apt-get install -y -qq libjemalloc2)
	$(PY) bench/run_all.py --data $(DATA)

# the local Kubernetes control plane (built once per version into ~/.cache/hlat, needs root)
cluster-build: setup
	$(PY) -m hlat_testbed.build

cluster-up: setup
	.venv/bin/hlat-cluster up --nodes 3

cluster-down: setup
	.venv/bin/hlat-cluster down

# regenerate the files derived from the code (tests fail when they are stale)
generate: setup
	$(PY) -m hlat_api.reference > docs/api.md
	$(PY) -m hlat_operator.crd --write
	$(PY) -m hlat_operator.dashboards --write

clean:
	rm -rf $(RUNS) $(DATA)
