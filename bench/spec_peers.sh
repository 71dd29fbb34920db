#!/usr/bin/env bash
# Speculation side by side (issue 25): tokenmill and llama.cpp's server, each without and with n-gram
# speculation, on the default model's GGUF, the same client (`python -m bench spec-http`: the chat
# prompts of bench/spec_prompts.py, greedy, one workload), one server at a time.
#   bench/spec_peers.sh [WORKLOAD] ["1 4"]
# Env: PROMPTS (20), MAX_TOKENS (256), K (4: drafted tokens per step for both), OUT (/tmp/spec-peers),
#      SKIP_TM / SKIP_LLAMA=1. Run it on a quiet machine (`uptime` first).
set -u
cd "$(dirname "$0")/.." || exit 1
WORKLOAD=${1:-code-edit} CS=${2:-"1 4"}
PROMPTS=${PROMPTS:-20} MAX_TOKENS=${MAX_TOKENS:-256} K=${K:-4}
OUT=${OUT:-/tmp/spec-peers}; mkdir -p "$OUT"
GGUF=$(.venv/bin/python -c 'from bench.workloads import default_gguf; print(default_gguf())')
LLAMA=${LLAMA:-$PWD/../shared/peers/llama.cpp/llama-server}
SPEC="{\"method\": \"ngram\", \"num_speculative_tokens\": $K, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}"
wait_ok() { for _ in $(seq 1 300); do curl -sf "$1/health" >/dev/null 2>&1 && return 0; sleep 1; done; return 1; }
client() {  # label url
  # shellcheck disable=SC2086
  .venv/bin/python -m bench spec-http --base-url "$2" --workload "$WORKLOAD" --prompts "$PROMPTS" \
    --max-tokens "$MAX_TOKENS" --concurrency $CS --label "$1" --json "$OUT/$1-$WORKLOAD.json"
}
serve_tm() {  # label [extra flags...]
  local label=$1; shift
  .venv/bin/tokenmill serve --model "$GGUF" --host 127.0.0.1 --port 8331 "$@" >"$OUT/$label.log" 2>&1 & local pid=$!
  if wait_ok http://127.0.0.1:8331; then client "$label" http://127.0.0.1:8331; else echo "$label did not start: $OUT/$label.log"; fi
  kill -TERM $pid; wait $pid 2>/dev/null
}
serve_llama() {  # label [extra flags...]
  local label=$1; shift
  "$LLAMA" -m "$GGUF" --host 127.0.0.1 --port 8332 -t 2 -np 4 -c 8192 --no-webui "$@" >"$OUT/$label.log" 2>&1 & local pid=$!
  if wait_ok http://127.0.0.1:8332; then client "$label" http://127.0.0.1:8332; else echo "$label did not start: $OUT/$label.log"; fi
  kill -TERM $pid; wait $pid 2>/dev/null
}
echo "$WORKLOAD, $PROMPTS prompts, max_tokens $MAX_TOKENS, concurrency $CS, k=$K; $GGUF"
if [ -z "${SKIP_TM:-}" ]; then
  serve_tm tokenmill-off
  serve_tm tokenmill-ngram --speculative-config "$SPEC"
fi
if [ -z "${SKIP_LLAMA:-}" ]; then
  serve_llama llama.cpp-off
  serve_llama llama.cpp-ngram --spec-type ngram-simple --spec-draft-n-max "$K"
fi
