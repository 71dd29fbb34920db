#!/usr/bin/env bash
# Side by side, one after the other, same model, same client (vLLM's `vllm bench serve`, random 128 in /
# 128 out, ignore_eos): tokenmill, vLLM's CPU build, llama.cpp's server.
#   bench/peers/compare.sh HF_MODEL_DIR [GGUF_FILE] ["1 16 32"]
# Env: OUT (results folder, default /tmp/peers-compare), TM_ARGS (extra `tokenmill serve` flags), TM_MODEL
#      (what tokenmill serves, default HF_MODEL_DIR: e.g. the GGUF file, whose blocks it keeps),
#      SKIP_TM / SKIP_VLLM / SKIP_LLAMA=1, PEERS (the peers folder with vllm/setup.sh and
#      llama.cpp/: ../shared/peers beside the repository), LLAMA_SERVER (a llama-server binary, e.g. one
#      built for this CPU: the peers' prebuilt one needs AVX-512), LLAMA_PORT (its port, 8200). Run it on a quiet machine (check
#      `uptime` first); ~15 min. `python -m bench report --add-compare OUT ...` turns OUT into the
#      benchmarks page's rows (docs/BENCHMARKS.md).
set -u
# The arguments are paths as the caller wrote them: resolve them before moving to the repository root.
MODEL=$(cd "$1" && pwd) GGUF=${2:+$(cd "$(dirname "$2")" && pwd)/$(basename "$2")} CS=${3:-"1 16 32"}
OUT=${OUT:-/tmp/peers-compare}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.." || exit 1  # the repository root: tokenmill runs from its .venv
P=${PEERS:-$PWD/../shared/peers}
LLAMA_SERVER=${LLAMA_SERVER:-$P/llama.cpp/llama-server}
LLAMA_PORT=${LLAMA_PORT:-8200}
export VLLM_DIR=${VLLM_DIR:-$HOME/.cache/peers/vllm}
bash "$P/vllm/setup.sh" >"$OUT/vllm-setup.log" 2>&1 || { echo "vLLM setup failed: $OUT/vllm-setup.log"; exit 1; }
# shellcheck source=/dev/null
source "$VLLM_DIR/env.sh"
bench() {  # name url concurrency
  local n=$(( $3 * 4 )); [ "$3" -eq 1 ] && n=8
  "$VLLM_DIR/bin/vllm" bench serve --backend vllm --base-url "$2" --endpoint /v1/completions \
    --model "$(curl -s "$2/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')" \
    --tokenizer "$MODEL" --dataset-name random --random-input-len 128 --random-output-len 128 \
    --num-prompts "$n" --max-concurrency "$3" --ignore-eos --seed 7 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --save-result --result-dir "$OUT" --result-filename "$1-c$3.json" >"$OUT/$1-c$3.log" 2>&1
  python3 - "$OUT/$1-c$3.json" "$1" "$3" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print(f"{sys.argv[2]:10s} c{sys.argv[3]:<3s} no result (see its log)"); raise SystemExit
print(f"{sys.argv[2]:10s} c{sys.argv[3]:<3s} out {d['output_throughput']:7.1f} tok/s  TTFT p50 {d['median_ttft_ms']:7.0f} p99 {d['p99_ttft_ms']:7.0f} ms"
      f"  TPOT p50 {d['median_tpot_ms']:6.1f} p99 {d['p99_tpot_ms']:6.1f} ms  done {d['completed']}/{d['num_prompts']}")
PY
}
wait_ok() { for _ in $(seq 1 300); do curl -sf "$1/health" >/dev/null 2>&1 && return 0; sleep 1; done; return 1; }
if [ -z "${SKIP_TM:-}" ]; then
  # shellcheck disable=SC2086  # TM_ARGS is a list of flags
  .venv/bin/tokenmill serve --model "${TM_MODEL:-$MODEL}" --host 127.0.0.1 --port 8321 ${TM_ARGS:-} >"$OUT/tokenmill.log" 2>&1 & pid=$!
  wait_ok http://127.0.0.1:8321 && for c in $CS; do bench tokenmill http://127.0.0.1:8321 "$c"; done
  kill -TERM $pid; wait $pid 2>/dev/null || true  # stopped by us: not a failure
fi
if [ -z "${SKIP_VLLM:-}" ]; then
  "$VLLM_DIR/serve.sh" "$MODEL" 8100 >"$OUT/vllm-serve.log" 2>&1 && for c in $CS; do bench vllm-cpu http://127.0.0.1:8100 "$c"; done
  "$VLLM_DIR/stop.sh" 8100 >/dev/null 2>&1
fi
if [ -n "$GGUF" ] && [ -z "${SKIP_LLAMA:-}" ]; then
  "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$LLAMA_PORT" -t 2 -np 32 -c 16384 -cb --no-webui \
    >"$OUT/llama-server.log" 2>&1 & pid=$!
  wait_ok "http://127.0.0.1:$LLAMA_PORT" && for c in $CS; do bench llama.cpp "http://127.0.0.1:$LLAMA_PORT" "$c"; done
  kill -TERM $pid; wait $pid 2>/dev/null || true  # stopped by us: not a failure
fi
