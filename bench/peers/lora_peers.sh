#!/usr/bin/env bash
# LoRA side by side (issue 24): tokenmill and vLLM's CPU build serving the same base model and the same
# random rank-R PEFT adapters (all seven projections), one server at a time, with the same client
# (`vllm bench serve`, random 128 in / 128 out, ignore_eos). For each system and concurrency: the base
# model alone, then requests spread at random over the N adapters (`--lora-modules`), so each adapter
# row is against the same server's base row.
#   bench/peers/lora_peers.sh [HF_MODEL_DIR] ["1 16 32"]
# Env: ADAPTERS (4), RANK (16), OUT (/tmp/lora-peers), DTYPE (bfloat16: what vLLM's CPU build serves),
#      SKIP_TM / SKIP_VLLM=1, PEERS (the peers folder: ../shared/peers beside the repository). Run it on a quiet machine (`uptime` first); ~25 min.
set -u
cd "$(dirname "$0")/../.." || exit 1  # the repository root: .venv, the bench package
ROOT=$PWD
MODEL=${1:-$(.venv/bin/python -c 'from bench.lib.workloads import resolve_model, DEFAULT_MODEL; print(resolve_model(DEFAULT_MODEL))')}
MODEL=$(cd "$MODEL" && pwd)
CS=${2:-"1 16 32"}
N=${ADAPTERS:-4} RANK=${RANK:-16} DTYPE=${DTYPE:-bfloat16}
OUT=${OUT:-/tmp/lora-peers}; mkdir -p "$OUT/adapters"
export VLLM_DIR=${VLLM_DIR:-$HOME/.cache/peers/vllm}
PEERS=${PEERS:-$ROOT/../shared/peers}
bash "$PEERS/vllm/setup.sh" >"$OUT/vllm-setup.log" 2>&1 || { echo "vLLM setup failed: $OUT/vllm-setup.log"; exit 1; }
# shellcheck source=/dev/null
source "$VLLM_DIR/env.sh"

# The adapters, written once (bench/lib/adapters.py: PEFT's file names and keys).
names=()
for i in $(seq 0 $((N - 1))); do names+=("a$i"); done
.venv/bin/python - "$MODEL" "$OUT/adapters" "$N" "$RANK" <<'PY'
import sys
from pathlib import Path
from transformers import AutoConfig
from bench.lib.adapters import write_adapter
from engine.lora.shapes import BaseShapes
model, out, n, rank = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
shapes = BaseShapes.from_hf_config(AutoConfig.from_pretrained(model))
for i in range(n):
    write_adapter(out / f"a{i}", shapes, rank, seed=i)
PY
modules=()
for a in "${names[@]}"; do modules+=("$a=$OUT/adapters/$a"); done

bench() {  # system url concurrency kind(base|lora)
  local n=$(( $3 * 4 )); [ "$3" -eq 1 ] && n=8
  local base_id; base_id=$(curl -s "$2/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
  local lora=(); [ "$4" = lora ] && lora=(--lora-modules "${names[@]}")
  "$VLLM_DIR/bin/vllm" bench serve --backend vllm --base-url "$2" --endpoint /v1/completions \
    --model "$base_id" --tokenizer "$MODEL" --dataset-name random --random-input-len 128 --random-output-len 128 \
    --num-prompts "$n" --max-concurrency "$3" --ignore-eos --seed 7 "${lora[@]}" \
    --percentile-metrics ttft,tpot,e2el --metric-percentiles 50,99 \
    --save-result --result-dir "$OUT" --result-filename "$1-$4-c$3.json" >"$OUT/$1-$4-c$3.log" 2>&1
  python3 - "$OUT/$1-$4-c$3.json" "$1" "$4" "$3" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print(f"{sys.argv[2]:10s} {sys.argv[3]:4s} c{sys.argv[4]:<3s} no result (see its log)"); raise SystemExit
print(f"{sys.argv[2]:10s} {sys.argv[3]:4s} c{sys.argv[4]:<3s} out {d['output_throughput']:7.1f} tok/s  "
      f"TTFT p50 {d['median_ttft_ms']:7.0f} ms  TPOT p50 {d['median_tpot_ms']:6.1f} p99 {d['p99_tpot_ms']:6.1f} ms  "
      f"done {d['completed']}/{d['num_prompts']}")
PY
}
wait_ok() { for _ in $(seq 1 300); do curl -sf "$1/health" >/dev/null 2>&1 && return 0; sleep 1; done; return 1; }
echo "model $MODEL, $N adapters of rank $RANK, $DTYPE, concurrency $CS; results in $OUT"
if [ -z "${SKIP_TM:-}" ]; then
  .venv/bin/tokenmill serve --model "$MODEL" --dtype "$DTYPE" --host 127.0.0.1 --port 8321 --enable-lora \
    --max-loras "$N" --max-lora-rank "$RANK" --lora-modules "${modules[@]}" >"$OUT/tokenmill.log" 2>&1 & pid=$!
  if wait_ok http://127.0.0.1:8321; then
    for c in $CS; do bench tokenmill http://127.0.0.1:8321 "$c" base; bench tokenmill http://127.0.0.1:8321 "$c" lora; done
  else echo "tokenmill did not start: $OUT/tokenmill.log"; fi
  kill -TERM $pid; wait $pid 2>/dev/null
fi
if [ -z "${SKIP_VLLM:-}" ]; then
  if "$VLLM_DIR/serve.sh" "$MODEL" 8100 --enable-lora --max-loras "$N" --max-lora-rank "$RANK" \
      --lora-modules "${modules[@]}" >"$OUT/vllm-serve.log" 2>&1; then
    for c in $CS; do bench vllm-cpu http://127.0.0.1:8100 "$c" base; bench vllm-cpu http://127.0.0.1:8100 "$c" lora; done
  else echo "vLLM did not start: $OUT/vllm-serve.log and $VLLM_DIR/serve-8100.log"; fi
  "$VLLM_DIR/stop.sh" 8100 >/dev/null 2>&1
fi
