# Two commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# DeepSpeed/torch JIT builds and caches stay inside the repo (ignored), so CI reuses them.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export TRITON_CACHE_DIR := $(CURDIR)/.cache/triton
export MPLCONFIGDIR := $(CURDIR)/.cache/matplotlib
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# The tests and the demo run more CPU ranks than there are cores: idle OpenMP threads sleep instead
# of spinning on cores other ranks wait for (2.6 times less CPU for two digits runs beside a busy
# core). The simulated lab's nodes get the same (sim/plan.py: node_session_env).
export OMP_WAIT_POLICY := PASSIVE

.PHONY: venv bytecode lint ops test test-cpu unit cluster demo clean

venv: $(STAMP)

# Python keeps each module's compiled bytecode beside its source, unless PYTHONDONTWRITEBYTECODE is set (as on some
# CI images) or the process may not write there (the simulated lab's node accounts): then every rank, every entry_cn.sh
# helper and every command compiles dscluster's sources again, 0.3-0.4 CPU-s a training process. Compiled here once,
# they are only read; a source edited later is compiled in memory until the next run of this target.
bytecode: venv
	@$(PY) -m compileall -q -j 0 src analysis >/dev/null

$(STAMP): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "dscluster needs Python 3.11+"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# ruff: pyflakes, import order, bugbear, line length; mypy over the packages listed in pyproject.toml
lint: venv
	$(VENV)/bin/ruff check src tests analysis setup examples bench
	$(VENV)/bin/mypy

# make test (what CI runs) runs every test; make unit is the developer's quick loop: the unit tests
# without those marked slow (real training processes, real kills: CONTRIBUTING.md lists them).
# Three pytest-xdist workers on two cores, each taking whole files (a file's lab and fixtures are built
# once): while one waits (a process-group timeout, a shaped link, a lab coming up) two keep the cores busy
# (idle, in the checkout: 736 s against 816 s with two). tests/conftest.py starts the longest files first
# (--no-loadscope-reorder: pytest-xdist would otherwise hand out the files with the most tests first).
# The 30 slowest tests are listed at the end.
XDIST := -n 3 --dist loadfile --no-loadscope-reorder
# lint keeps one core busy for about a minute: DeepSpeed's CPUAdam op (ZeRO's offload_optimizer=cpu, one
# test uses it) compiles on the other, instead of inside the suite (71-216 s on 2 cores, once per fresh clone).
test: venv bytecode
	$(MAKE) --no-print-directory -j2 lint ops
	$(PY) -m pytest -q $(XDIST) --durations=30

# DeepSpeed's CPU ops that training may JIT-compile, built once into TORCH_EXTENSIONS_DIR
ops: venv
	$(PY) -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)'

# CPU seconds per test, the simulated labs' processes included (root; tests/_cpuaccount.py says how)
test-cpu: venv bytecode
	rm -f .cache/test-cpu.jsonl
	DSCLUSTER_TEST_CPU=$(CURDIR)/.cache/test-cpu.jsonl PYTHONPATH=tests $(PY) -m pytest -q $(XDIST) -p _cpuaccount
	$(PY) tests/_cpuaccount.py .cache/test-cpu.jsonl

unit: venv bytecode
	$(PY) -m pytest -q $(XDIST) tests/unit -m 'not slow'

cluster: venv bytecode
	$(PY) -m pytest -q tests/cluster

demo: venv bytecode
	$(PY) -m dscluster.demo

clean:
	rm -rf $(VENV) .cache
