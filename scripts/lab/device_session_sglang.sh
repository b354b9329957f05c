#!/usr/bin/env bash
# Issue 43's GPU session on one GPU with SGLang 0.5.17 installed (../shared/tools/sglang_device.md), in the order
# that keeps the timed part alone:
#   1. train    scripts/gpu_smollm2.sh STAGES=train: the default recipe's SmolLM2 drafter (stages 01-04)
#   2. check    once stage 01 is complete, beside the training: scripts/lab/device_check_sglang.sh on SmolLM2's real
#               weights and on a random DeepSeek-V3 (MEM=0.25: SGLang's share of the GPU beside the training)
#   3. serve    once both are done: scripts/lab/device_serve_drafter.sh, the drafter served by SGLang (EAGLE3 chain 3-1-4)
#               and by the same SGLang without speculation, 05_benchmark.py --mode server on MT-bench beside stage
#               05's offline tau
#
#   scripts/lab/device_session_sglang.sh VERIFIER DATA_DIR WORK_DIR
#     VERIFIER  SmolLM2's .gguf (converted once to WORK_DIR's smollm2-dense beside it) or its dense folder
#     DATA_DIR  made by scripts/prepare_device_data.py, plus REGEN_CACHE's smollm2_sharegpt_greedy_10k.tgz if there
#     WORK_DIR  run in WORK_DIR/run, check in WORK_DIR/check, serving in WORK_DIR/serve; progress in WORK_DIR/session.log
# Environment passes through to the three scripts (RUNS, NEW_TOKENS, CUDA_GRAPH, ...); CHECK=0 leaves out step 2. With "pack" it only packs
# what exists so far (logs, reports, no weights) into $OUT/session.tgz: run it in every polling call.
set -uo pipefail
cd "$(dirname "$0")/../.."
VERIFIER=$1; DATA=$2; WORK=$3
if [ "${4:-}" = pack ]; then
  tar czf "$OUT/session.tgz" --ignore-failed-read -C "$WORK" session.log train.log check.log serve \
    check/out run/logs run/checkpoints/metrics.jsonl run/checkpoints/best.json run/data/manifest.json 2>/dev/null
  exit 0
fi
mkdir -p "$WORK"
say() { echo "$(date +%T) $*" | tee -a "$WORK/session.log"; }
DENSE=$VERIFIER; [[ "$VERIFIER" == *.gguf ]] && DENSE=$(dirname "$VERIFIER")/smollm2-dense
CACHE=$DATA/smollm2_sharegpt_greedy_10k.tgz

say "train: gpu_smollm2.sh STAGES=train"
( [ -f "$CACHE" ] && export REGEN_CACHE=$CACHE; unset OUT
  STAGES=train scripts/gpu_smollm2.sh "$VERIFIER" "$DATA" "$WORK/run" > "$WORK/train.log" 2>&1
  echo "train exit $?" >> "$WORK/session.log" ) &
TRAIN=$!

( [ "${CHECK:-1}" = 0 ] && exit 0
  waited=0
  until grep -qs '"complete"' "$WORK/run/data/manifest.json" || [ $waited -ge 1200 ]; do sleep 10; waited=$((waited + 10)); done
  echo "$(date +%T) check: device_check_sglang.sh on $DENSE and dsv3 (stage 01 done after ${waited}s)" >> "$WORK/session.log"
  mkdir -p "$WORK/check/out"
  MEM=${CHECK_MEM:-0.25} OUT=$WORK/check/out WORK=$WORK/check scripts/lab/device_check_sglang.sh "$DENSE" "$DENSE" dsv3 \
    > "$WORK/check.log" 2>&1
  echo "$(date +%T) check exit $?: $(grep -E ': exit' "$WORK/check.log" | tr '\n' ' ')" >> "$WORK/session.log" ) &
CHECK=$!

wait $TRAIN; wait $CHECK
if [ ! -f "$WORK/run/checkpoints/best/config.json" ]; then say "no drafter in $WORK/run/checkpoints/best: not serving"; exit 1; fi
say "serve: device_serve_drafter.sh"
scripts/lab/device_serve_drafter.sh "$DENSE" "$WORK/run/checkpoints/best" "$DATA/mt_bench.jsonl" "$WORK/serve" \
  > "$WORK/serve.log" 2>&1
say "serve exit $?"
