#!/usr/bin/env bash
# Serving, the number a user gets: a drafter served by a real SGLang with EAGLE3 (the command
# scripts/sglang_launch_command.py prints, plus this machine's backend flags) beside the same SGLang without
# speculation, then 05_benchmark.py --mode server on a prompt file (every prompt, every turn) at each temperature and
# concurrency, and stage 05's offline --tau-only on the same drafter and prompts, to compare SGLang's accept length
# with (above T=0 by both acceptance rules: offline's rejection sampling and SGLang's default target-only). The
# offline runs go first, while the servers start; the timed server runs go one at a time, alone.
#
#   scripts/lab/device_serve_drafter.sh VERIFIER DRAFTER PROMPTS OUT_DIR
#     VERIFIER  the verifier's Hugging Face folder (SmolLM2: the dense folder gpu_smollm2.sh converts)
#     DRAFTER   the drafter folder stage 04 exported (RUN/checkpoints/best)
#     PROMPTS   a prompt file stage 05 reads (MT-bench: ../shared/bench/mt_bench.jsonl)
# Environment: RUNS ["0:1 0:8 1:8 1:1"]: TEMPERATURE:CONCURRENCY pairs in order; OFFLINE_TEMPS ["0 1"]; NEW_TOKENS
#   [128]; CHAIN ["3 1 4"]: num-steps, topk, draft tokens; MEM [0.35]: each server's --mem-fraction-static;
#   CUDA_GRAPH [1] (0, or a server that does not start with graphs: --disable-cuda-graph); SGLANG_SITE [/tmp/site]
#   (../shared/tools/sglang_device.md: SGLang's own packages, put first on PYTHONPATH for the servers only);
#   MACHINE_FLAGS [the slim wheels' flags below]; RUN_LIMIT [900]: seconds for each stage-05 run.
# Writes OUT_DIR/summary.txt (one SUMMARY line per run), OUT_DIR/commands.txt (both server commands), the servers'
# logs and each stage-05 report under OUT_DIR/server_T<t>_c<c> and OUT_DIR/offline_T<t>.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is not pip-installed
VERIFIER=$1; DRAFTER=$2; PROMPTS=$3; OUT_DIR=$4
RUNS=${RUNS:-"0:1 0:8 1:8 1:1"}; OFFLINE_TEMPS=${OFFLINE_TEMPS:-"0 1"}; NEW_TOKENS=${NEW_TOKENS:-128}
read -r STEPS TOPK DRAFT_TOKENS <<< "${CHAIN:-3 1 4}"
MEM=${MEM:-0.35}; CUDA_GRAPH=${CUDA_GRAPH:-1}; SITE=${SGLANG_SITE:-/tmp/site}; RUN_LIMIT=${RUN_LIMIT:-900}
read -r -a MACHINE <<< "${MACHINE_FLAGS:---attention-backend triton --sampling-backend pytorch}"
# Server arguments the slim wheels need (no grammar backend, no multimodal transport), and the memory share that
# lets both servers sit on one GPU.
EXTRA=(--sglang-arg grammar_backend=none --sglang-arg mm_feature_transport=cpu --sglang-arg "mem_fraction_static=$MEM")
SPEC_PORT=30001; BASE_PORT=30002
mkdir -p "$OUT_DIR"
say() { echo "$(date +%T) $*" | tee -a "$OUT_DIR/summary.txt"; }

server_argv() {  # $1 port, $2 "spec" or "base", $3 1 to disable CUDA graphs: the server's argv, one per line
  local graph=(); [ "$3" = 1 ] && graph=(--sglang-arg disable_cuda_graph=true)
  python3 scripts/sglang_launch_command.py "$DRAFTER" --model-path "$VERIFIER" --tp-size 1 --port "$1" \
    --num-steps "$STEPS" --topk "$TOPK" --num-draft-tokens "$DRAFT_TOKENS" "${MACHINE[@]}" "${EXTRA[@]}" \
    ${graph[@]+"${graph[@]}"} --json | python3 -c "
import json, sys
argv = json.load(sys.stdin)['argv']
argv[0] = sys.executable  # the printed 'python'
if '$2' == 'base':  # the same server without speculation: drop every --speculative-* flag and its value
    kept, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word.startswith('--speculative-'):
            skip = True
        else:
            kept.append(word)
    argv = kept
print('\n'.join(argv))"
}

start_server() {  # $1 port, $2 spec|base, $3 no-graph: starts it in the background, prints its pid
  local argv
  mapfile -t argv < <(server_argv "$1" "$2" "$3")
  echo "$2 (port $1): ${argv[*]}" >> "$OUT_DIR/commands.txt"
  PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} \
    setsid "${argv[@]}" > "$OUT_DIR/server_$2.log" 2>&1 &
  echo $!
}

wait_healthy() {  # $1 port, $2 pid: 0 once /health answers, 1 when the server died or 600 s passed
  local waited=0
  while [ $waited -lt 600 ]; do
    curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 5; waited=$((waited + 5))
  done
  return 1
}

stop_servers() { for pid in ${SPEC_PID:-} ${BASE_PID:-}; do kill -- -"$pid" 2>/dev/null; done; }
trap stop_servers EXIT

no_graph=$([ "$CUDA_GRAPH" = 1 ] && echo 0 || echo 1)
say "starting both servers (CUDA graphs: $([ "$no_graph" = 0 ] && echo on || echo off))"
SPEC_PID=$(start_server $SPEC_PORT spec "$no_graph"); BASE_PID=$(start_server $BASE_PORT base "$no_graph")

# Stage 05 offline on the same drafter and prompts while the servers start (the project's own packages, not SGLang's).
# Above T=0 also by SGLang's default acceptance rule (--acceptance-rule target-only), the one the server applies.
for t in $OFFLINE_TEMPS; do
  rules=rejection; [ "$t" != 0 ] && [ "$TOPK" = 1 ] && rules="rejection target-only"
  for rule in $rules; do
    name=offline_T$t$([ "$rule" = rejection ] || echo "_$rule")
    timeout "$RUN_LIMIT" python3 05_benchmark.py --model-path "$VERIFIER" --draft-model-path "$DRAFTER" \
      --prompts "$PROMPTS" --tau-only --decode-workers 8 --num-steps "$STEPS" --topk "$TOPK" \
      --num-draft-tokens "$DRAFT_TOKENS" --temperature "$t" --acceptance-rule "$rule" --max-new-tokens "$NEW_TOKENS" \
      --output-dir "$OUT_DIR/$name" > "$OUT_DIR/$name.log" 2>&1
    say "offline --tau-only T=$t $rule (exit $?): $(grep -h SUMMARY "$OUT_DIR/$name.log" | tail -n 1)"
  done
done

for port_pid_name in "$SPEC_PORT:$SPEC_PID:spec" "$BASE_PORT:$BASE_PID:base"; do
  IFS=: read -r port pid name <<< "$port_pid_name"
  if ! wait_healthy "$port" "$pid"; then
    say "$name server did not start; its log's tail:"; tail -n 30 "$OUT_DIR/server_$name.log" | tee -a "$OUT_DIR/summary.txt"
    if [ "$no_graph" = 1 ]; then exit 1; fi
    say "restarting both servers with --disable-cuda-graph"
    stop_servers; sleep 5; no_graph=1
    SPEC_PID=$(start_server $SPEC_PORT spec 1); BASE_PID=$(start_server $BASE_PORT base 1)
    wait_healthy $SPEC_PORT "$SPEC_PID" && wait_healthy $BASE_PORT "$BASE_PID" || { say "servers did not start"; exit 1; }
    break
  fi
done
say "both servers answer /health (CUDA graphs: $([ "$no_graph" = 0 ] && echo on || echo off))"

for run in $RUNS; do
  IFS=: read -r t c <<< "$run"
  dir=$OUT_DIR/server_T${t}_c$c
  timeout "$RUN_LIMIT" python3 05_benchmark.py --mode server --url "http://127.0.0.1:$SPEC_PORT" \
    --baseline-url "http://127.0.0.1:$BASE_PORT" --server-api generate --model-path "$VERIFIER" \
    --draft-model-path "$DRAFTER" --prompts "$PROMPTS" --temperature "$t" --concurrency "$c" \
    --max-new-tokens "$NEW_TOKENS" --num-steps "$STEPS" --topk "$TOPK" --num-draft-tokens "$DRAFT_TOKENS" \
    --output-dir "$dir" > "$dir.log" 2>&1
  say "server T=$t concurrency $c (exit $?): $(grep -h SUMMARY "$dir.log" | tail -n 1)"
done
say "done"
