#!/usr/bin/env bash
# Issue 46: a drafter served by a real vLLM with EAGLE-3 (the flags ../shared/tools/vllm_device.md gives) beside the
# same vLLM without speculation, 05_benchmark.py --mode server on a prompt file (every prompt, every turn, token ids
# rendered as offline mode renders them) at each temperature and concurrency, and stage 05's offline --tau-only on
# the same drafter and prompts. Then the layer-id trap: the same weights with the top-level (vLLM)
# eagle_aux_hidden_state_layer_ids written in SGLang's convention (one less than the trained layers), which
# scripts/check_drafter.py must refuse, served anyway to measure what the mistake costs.
#
#   scripts/lab/device_serve_vllm.sh VERIFIER DRAFTER PROMPTS OUT_DIR [DATA_DIR]
#     VERIFIER  the verifier's Hugging Face folder (SmolLM2: the dense folder gpu_smollm2.sh converts)
#     DRAFTER   the drafter folder stage 04 exported (RUN/checkpoints/best)
#     PROMPTS   a prompt file stage 05 reads (MT-bench: ../shared/bench/mt_bench.jsonl)
#     DATA_DIR  stage 02's folder the drafter was trained on (its manifest names the layers): check_drafter.py's
#               --data-dir for both folders; without it the trap is served unchecked
# Environment: RUNS ["0:8 0:1"]: TEMPERATURE:CONCURRENCY pairs in order; TRAP_RUNS ["0:8"] (empty: no trap);
#   OFFLINE_TEMPS ["0"]; NEW_TOKENS [128]; SPEC_TOKENS [3] (chain 3-1-4); MEM [0.3]: each server's
#   --gpu-memory-utilization; VLLM_SITE [/tmp/site] (vLLM's packages, first on PYTHONPATH for the servers only);
#   MACHINE_FLAGS [the slim wheel's flags below]; RUN_LIMIT [900]: seconds for each stage-05 run.
# Writes OUT_DIR/summary.txt (one line per run), OUT_DIR/commands.txt, the servers' logs, each stage-05 report
# under OUT_DIR/<name>, and OUT_DIR/metrics_<server>.txt (each vLLM's /metrics at the end).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is not pip-installed
VERIFIER=$1; DRAFTER=$2; PROMPTS=$3; OUT_DIR=$4; DATA_DIR=${5:-}
RUNS=${RUNS-"0:8 0:1"}; TRAP_RUNS=${TRAP_RUNS-"0:8"}; OFFLINE_TEMPS=${OFFLINE_TEMPS-"0"}
NEW_TOKENS=${NEW_TOKENS:-128}; SPEC_TOKENS=${SPEC_TOKENS:-3}; MEM=${MEM:-0.3}; SITE=${VLLM_SITE:-/tmp/site}
RUN_LIMIT=${RUN_LIMIT:-900}
read -r -a MACHINE <<< "${MACHINE_FLAGS:---attention-backend TRITON_ATTN --enforce-eager}"
SPEC_PORT=30001; BASE_PORT=30002
mkdir -p "$OUT_DIR"
say() { echo "$(date +%T) $*" | tee -a "$OUT_DIR/summary.txt"; }

start_server() {  # $1 port, $2 name, $3 drafter folder or "": starts vLLM in the background, prints its pid
  local argv=(python3 -m vllm.entrypoints.openai.api_server --model "$VERIFIER" --port "$1" --seed 0
              --gpu-memory-utilization "$MEM" --max-model-len 4096 --generation-config vllm "${MACHINE[@]}")
  [ -n "$3" ] && argv+=(--speculative-config
                        "{\"method\":\"eagle3\",\"model\":\"$3\",\"num_speculative_tokens\":$SPEC_TOKENS}")
  echo "$2 (port $1): ${argv[*]}" >> "$OUT_DIR/commands.txt"
  PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0 \
    setsid "${argv[@]}" > "$OUT_DIR/server_$2.log" 2>&1 &
  echo $!
}

wait_healthy() {  # $1 port, $2 pid, $3 name: 0 once /health answers; 1 (the log's tail in the summary) if it died
  local waited=0
  while [ $waited -lt 600 ]; do
    curl -sf "http://127.0.0.1:$1/health" > /dev/null && { say "$3 server answers /health after ${waited}s"; return 0; }
    kill -0 "$2" 2>/dev/null || break
    sleep 5; waited=$((waited + 5))
  done
  say "$3 server did not start; its log's tail:"; tail -n 40 "$OUT_DIR/server_$3.log" | tee -a "$OUT_DIR/summary.txt"
  return 1
}

PIDS=()
stop_servers() { for pid in "${PIDS[@]}"; do kill -- -"$pid" 2>/dev/null; done; }
trap stop_servers EXIT

bench() {  # $1 name, $2 t:c, $3 spec port, $4 "base" to send the same prompts to the baseline server
  local t c dir=$OUT_DIR/$1 baseline=()
  IFS=: read -r t c <<< "$2"
  [ "${4:-}" = base ] && baseline=(--baseline-url "http://127.0.0.1:$BASE_PORT")
  timeout "$RUN_LIMIT" python3 05_benchmark.py --mode server --url "http://127.0.0.1:$3" ${baseline[@]+"${baseline[@]}"} \
    --server-api completions --model-path "$VERIFIER" --draft-model-path "$DRAFTER" --prompts "$PROMPTS" \
    --temperature "$t" --concurrency "$c" --max-new-tokens "$NEW_TOKENS" --num-steps "$SPEC_TOKENS" --topk 1 \
    --num-draft-tokens $((SPEC_TOKENS + 1)) --output-dir "$dir" > "$dir.log" 2>&1
  say "$1 T=$t concurrency $c (exit $?): $(grep -h SUMMARY "$dir.log" | tail -n 1)"
}

# vLLM's server imports fastapi and pydantic, which neither the slim wheel set nor the machine's image had on
# 2026-12-07: install annotated_types, pydantic, pydantic_core and typing_inspection from SGLang's wheel set
# (../shared/tools/sglang_device_wheels.sh) into the same folder (docs/results/2026-12-07-h100-vllm-serving.md).
if ! PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} python3 -c "import fastapi, pydantic, vllm" 2> "$OUT_DIR/imports.txt"; then
  say "vLLM's server cannot import in $SITE: $(tail -n 1 "$OUT_DIR/imports.txt"); see this script's header"; exit 1
fi

# The trap folder: the trained weights, vLLM's ids one less than the trained layers (SGLang's eagle_config ids).
TRAP=$OUT_DIR/trap_drafter
rm -rf "$TRAP"; mkdir -p "$TRAP"; cp "$DRAFTER"/*.json "$DRAFTER"/*.safetensors "$TRAP"/  # not the optimizer state
python3 - "$TRAP/config.json" <<'EOF'
import json, sys
path = sys.argv[1]
config = json.load(open(path))
config["eagle_aux_hidden_state_layer_ids"] = list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
json.dump(config, open(path, "w"), indent=2)
print("trap ids:", config["eagle_aux_hidden_state_layer_ids"])
EOF
check=(); [ -n "$DATA_DIR" ] && check=(--data-dir "$DATA_DIR")
for folder in "$DRAFTER" "$TRAP"; do
  report=$OUT_DIR/check_$(basename "$folder").txt
  python3 scripts/check_drafter.py "$folder" ${check[@]+"${check[@]}"} --model-path "$VERIFIER" > "$report" 2>&1
  rc=$?
  say "check_drafter.py $(basename "$folder") (exit $rc): $(grep -m1 -E 'vLLM|OK|problem' "$report")"
done

say "starting the EAGLE-3 server, then the plain one (one after the other: vLLM measures free memory at start)"
SPEC_PID=$(start_server $SPEC_PORT spec "$DRAFTER"); PIDS+=("$SPEC_PID")
wait_healthy $SPEC_PORT "$SPEC_PID" spec || exit 1
BASE_PID=$(start_server $BASE_PORT base ""); PIDS+=("$BASE_PID")
wait_healthy $BASE_PORT "$BASE_PID" base || exit 1

for t in $OFFLINE_TEMPS; do
  rules=rejection; [ "$t" != 0 ] && rules="rejection target-only"
  for rule in $rules; do
    name=offline_T$t$([ "$rule" = rejection ] || echo "_$rule")
    timeout "$RUN_LIMIT" python3 05_benchmark.py --model-path "$VERIFIER" --draft-model-path "$DRAFTER" \
      --prompts "$PROMPTS" --tau-only --decode-workers 8 --num-steps "$SPEC_TOKENS" --topk 1 \
      --num-draft-tokens $((SPEC_TOKENS + 1)) --temperature "$t" --acceptance-rule "$rule" \
      --max-new-tokens "$NEW_TOKENS" --output-dir "$OUT_DIR/$name" > "$OUT_DIR/$name.log" 2>&1
    say "offline --tau-only T=$t $rule (exit $?): $(grep -h SUMMARY "$OUT_DIR/$name.log" | tail -n 1)"
  done
done

for run in $RUNS; do bench "server_T${run%%:*}_c${run##*:}" "$run" $SPEC_PORT base; done
curl -s "http://127.0.0.1:$SPEC_PORT/metrics" > "$OUT_DIR/metrics_spec.txt"

if [ -n "$TRAP_RUNS" ]; then
  say "the trap: $TRAP served in place of the drafter"
  kill -- -"$SPEC_PID" 2>/dev/null; sleep 10
  TRAP_PID=$(start_server $SPEC_PORT trap "$TRAP"); PIDS+=("$TRAP_PID")
  if wait_healthy $SPEC_PORT "$TRAP_PID" trap; then
    for run in $TRAP_RUNS; do bench "trap_T${run%%:*}_c${run##*:}" "$run" $SPEC_PORT; done
    curl -s "http://127.0.0.1:$SPEC_PORT/metrics" > "$OUT_DIR/metrics_trap.txt"
  fi
fi
say "done"
