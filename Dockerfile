# tokenmill on an NVIDIA GPU. Build: docker build -t tokenmill .
# Run:   docker run --gpus 1 -p 127.0.0.1:8000:8000 -v /srv/models:/models:ro \
#          -e TOKENMILL_MODEL=/models/Qwen2.5-1.5B-Instruct tokenmill
# Models are mounted at run time (never baked in). Settings: configs/gpu.yaml, then TOKENMILL_* variables.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# -- build: a virtual environment with the CUDA build of torch and tokenmill ------------------------------
FROM ${CUDA_IMAGE} AS build
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Versions come from the pinned base image's Ubuntu release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first and pinned (TORCH_SPEC), from the CUDA wheel index, so nothing below pulls another build.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir . \
    && python -c "import server, engine"

# -- runtime: the CUDA runtime, Python and the venv; no compilers, no sources -----------------------------
FROM ${CUDA_IMAGE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /app --shell /usr/sbin/nologin tokenmill \
    && mkdir -p /models /cache \
    && chown 10001:10001 /cache
COPY --from=build /opt/venv /opt/venv
COPY configs /app/configs
# Inside the container the server listens on all interfaces; outside, publish the port where you choose
# (docker-compose.yml publishes it on the host's loopback by default). No secret here: "TOKEN" is in our name.
# hadolint ignore=DL3064
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TOKENMILL_HOST=0.0.0.0 \
    TOKENMILL_PORT=8000 \
    TOKENMILL_CONFIG=/app/configs/gpu.yaml \
    TOKENMILL_MODEL_CACHE=/cache/tokenmill \
    HF_HOME=/cache/huggingface \
    HF_HUB_OFFLINE=1 \
    XDG_CACHE_HOME=/cache/xdg
WORKDIR /app
USER 10001:10001
EXPOSE 8000
# Loading a large model takes minutes: failures during start-period do not count.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('TOKENMILL_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["tokenmill", "serve"]
