#!/usr/bin/env bash
# Speculation side by side (issue 25): tokenmill and llama.cpp's server, each without speculation, with
# n-gram prompt lookup, and with the method that learns from earlier requests (tokenmill: suffix
# decoding; llama.cpp: ngram-mod, its pool of n-grams shared by every slot), on the default model's
# GGUF, the same client (`python -m bench spec-http`: the chat prompts of bench/lib/spec_prompts.py,
# greedy, one workload). One server at a time, a fresh one for each concurrency point, each first sent
# WARM other prompts of the workload (untimed: the earlier traffic a learning method drafts from; a
# fresh server per point, so no point drafts from the answers of the same prompts at another point).
#   bench/peers/spec_peers.sh [WORKLOAD] ["1 4"]
# Env: PROMPTS (20), WARM (20), MAX_TOKENS (256), K (4: drafted tokens per step for n-gram lookup),
#      KS (16: for the learning methods), OUT (/tmp/spec-peers), SKIP_TM / SKIP_LLAMA=1, ARMS (a
#      space-separated subset of: tokenmill-off tokenmill-ngram tokenmill-suffix llama.cpp-off
#      llama.cpp-ngram llama.cpp-ngram-mod), PEERS (the peers folder: ../shared/peers beside the
#      repository), LLAMA_SERVER (a llama-server binary: one built for this CPU; default the peers'
#      own). Run it on a quiet machine (`uptime` first).
set -u
cd "$(dirname "$0")/../.." || exit 1  # the repository root: .venv, the bench package
WORKLOAD=${1:-code-edit} CS=${2:-"1 4"}
PROMPTS=${PROMPTS:-20} WARM=${WARM:-20} MAX_TOKENS=${MAX_TOKENS:-256} K=${K:-4} KS=${KS:-16}
OUT=${OUT:-/tmp/spec-peers}; mkdir -p "$OUT"
GGUF=$(.venv/bin/python -c 'from bench.lib.workloads import default_gguf; print(default_gguf())')
PEERS=${PEERS:-$PWD/../shared/peers}
LLAMA=${LLAMA_SERVER:-${LLAMA:-$PEERS/llama.cpp/llama-server}}
NGRAM="{\"method\": \"ngram\", \"num_speculative_tokens\": $K, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}"
SUFFIX="{\"method\": \"suffix\", \"num_speculative_tokens\": $KS}"
ALL="tokenmill-off tokenmill-ngram tokenmill-suffix llama.cpp-off llama.cpp-ngram llama.cpp-ngram-mod"
[ -n "${SKIP_TM:-}" ] && ALL=${ALL//tokenmill-off tokenmill-ngram tokenmill-suffix/}
[ -n "${SKIP_LLAMA:-}" ] && ALL=${ALL//llama.cpp-off llama.cpp-ngram llama.cpp-ngram-mod/}
ARMS=${ARMS:-$ALL}
wait_ok() { for _ in $(seq 1 300); do curl -sf "$1/health" >/dev/null 2>&1 && return 0; sleep 1; done; return 1; }
client() {  # label url concurrency
  .venv/bin/python -m bench spec-http --base-url "$2" --workload "$WORKLOAD" --prompts "$PROMPTS" \
    --warm-prompts "$WARM" --max-tokens "$MAX_TOKENS" --concurrency "$3" --label "$1" \
    --json "$OUT/$1-$WORKLOAD-c$3.json"
}
serve() {  # label concurrency command...
  local label=$1 c=$2 url; shift 2
  case $label in tokenmill*) url=http://127.0.0.1:8331 ;; *) url=http://127.0.0.1:8332 ;; esac
  if curl -sf "$url/health" >/dev/null 2>&1; then echo "$label: $url is served already (stop that server)"; return; fi
  "$@" >"$OUT/$label-c$c.log" 2>&1 & local pid=$!  # tm and llama exec: $! is the server
  if wait_ok "$url"; then client "$label" "$url" "$c"; else echo "$label did not start: $OUT/$label-c$c.log"; fi
  kill -TERM $pid; wait $pid 2>/dev/null
}
tm() { exec .venv/bin/tokenmill serve --model "$GGUF" --host 127.0.0.1 --port 8331 "$@"; }
llama() { exec "$LLAMA" -m "$GGUF" --host 127.0.0.1 --port 8332 -t 2 -np 4 -c 8192 --no-webui "$@"; }
echo "$WORKLOAD, $PROMPTS prompts after $WARM warm-up prompts, max_tokens $MAX_TOKENS, concurrency $CS, k=$K (learning methods: $KS); $GGUF"
for c in $CS; do
  for arm in $ARMS; do
    case $arm in
      tokenmill-off) serve "$arm" "$c" tm ;;
      tokenmill-ngram) serve "$arm" "$c" tm --speculative-config "$NGRAM" ;;
      tokenmill-suffix) serve "$arm" "$c" tm --speculative-config "$SUFFIX" ;;
      llama.cpp-off) serve "$arm" "$c" llama ;;
      llama.cpp-ngram) serve "$arm" "$c" llama --spec-type ngram-simple --spec-draft-n-max "$K" ;;
      llama.cpp-ngram-mod) serve "$arm" "$c" llama --spec-type ngram-mod --spec-ngram-mod-n-min 2 --spec-ngram-mod-n-max "$KS" ;;
      *) echo "unknown arm $arm" ;;
    esac
  done
done
