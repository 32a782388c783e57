# Two commands on a fresh clone:   make run   (set up + launch rosechat)
#                                  make test  (set up + run the whole suite)
PYTHON ?= python3
VENV   ?= .venv
# CPU build, pinned: an unpinned torch pulls the newest CUDA build (gigabytes).
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: setup run test bench lint
setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH)"
	$(VENV)/bin/pip install -q -e ".[test]"
	@touch $@

run: $(STAMP)
	$(VENV)/bin/rosechat $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/rosechat bench $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
