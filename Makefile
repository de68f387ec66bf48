# Two commands do all set-up on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned, so that nothing resolves a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 $(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
