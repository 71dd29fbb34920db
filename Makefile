# tokenmill: `make run` serves the embedded demo model on 127.0.0.1:8000; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
# CPU machines: the CPU build of torch (pip finds it on this machine kind's disk). GPU hosts use the
# Docker image, or override: make run TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
ARGS ?=

STAMP := $(VENV)/.tokenmill-installed

.PHONY: install run test lint bench-offline clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	# torch first and pinned, so nothing below can pull a multi-GB CUDA build.
	$(VENV)/bin/python -m pip install -q $(TORCH_SPEC)
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tokenmill serve --host $(HOST) --port $(PORT) $(if $(MODEL),--model $(MODEL)) $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check engine server bench tests

bench-offline: $(STAMP)
	$(VENV)/bin/python -m bench offline $(ARGS)

clean:
	rm -rf $(VENV) models .pytest_cache
