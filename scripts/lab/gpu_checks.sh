#!/usr/bin/env bash
# The GPU measurements of issues 17 and 18 that train nothing of their own, in one command, beside
# scripts/lab/gpu_drafter_quality.sh on a second GPU or after it on the same one:
#   1. regen     scripts/lab/bench_regenerate.py --profile: stage 01's engines (generate, static, loop) on the same
#                2,000 ShareGPT prompts, the float32 equality check, the Llama-8B-shaped verifier, and where a
#                warm batch's time goes (issue 18)
#   2. profile   stage 04 --profile-steps on RUN's hidden states (2,048-token steps, TTT 3, one epoch at most):
#                the real loop's wall time a step (with and without the profiler) against the device's busy
#                time, and the top operations; once for each of PROFILE_PADS, the batch-length multiple
#                (--pad-batches-to: 1 is the loop before 2026-12-02, 64 the default since, whose batch shapes repeat)
#   3. lossless  stage 05 --tau-only on all of MT-bench with DRAFTER: chain 3-1-4 and tree 3-8 at T=0, in
#                float32 and in float64, every turn checked against the verifier's greedy choice in the same
#                precision (issue 17, item 3)
# Phases 2 and 3 wait (up to WAIT_S) for RUN's hidden states and for DRAFTER, so this can start beside the job
# that makes them.
#
#   scripts/lab/gpu_checks.sh VERIFIER DATA_DIR RUN_DIR DRAFTER OUT_DIR
#     VERIFIER  dense SmolLM2 folder; DATA_DIR holds sharegpt.json and mt_bench.jsonl
#               (scripts/prepare_device_data.py); RUN_DIR a run with stage 02's hidden states (e.g.
#               gpu_drafter_quality.sh's RUN-small); DRAFTER a drafter checkpoint folder
# Environment: PHASES ["regen profile lossless"], DECODE_WORKERS [4], PROFILE_STEPS [20], PROFILE_PADS ["1 64"],
#   WAIT_S [1200],
#   PYTHON [python3] the interpreter with the project's requirements,
#   REGEN_ARGS [""] more flags for bench_regenerate.py (e.g. "--llama-prompts 0" to leave the 8B shape out).
# Progress: OUT_DIR/checks.log; each step's own log beside it.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is not pip-installed
VERIFIER=$1; DATA=$2; RUN=$3; DRAFTER=$4; OUT=$5
PHASES=${PHASES:-"regen profile lossless"}; DECODE_WORKERS=${DECODE_WORKERS:-4}; PROFILE_STEPS=${PROFILE_STEPS:-20}
WAIT_S=${WAIT_S:-1200}; REGEN_ARGS=${REGEN_ARGS:-}; PY=${PYTHON:-python3}; PROFILE_PADS=${PROFILE_PADS:-"1 64"}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG=$OUT/checks.log
say() { echo "$(date +%T) $*" | tee -a "$LOG"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }
wait_for() {  # $1 file another job makes: wait for it, or give up after WAIT_S seconds
  local waited=0
  until [ -e "$1" ]; do
    [ "$waited" -ge "$WAIT_S" ] && { say "gave up waiting for $1"; return 1; }
    sleep 10; waited=$((waited + 10))
  done
}

if has regen; then
  say "regeneration engines"
  # shellcheck disable=SC2086
  "$PY" scripts/lab/bench_regenerate.py --model-path "$VERIFIER" --data "$DATA/sharegpt.json" --out "$OUT/regen" \
    --profile --continuous-prompts 0 $REGEN_ARGS > "$OUT/regen.log" 2>&1 || say "FAILED: regen (see regen.log)"
fi
if has profile && wait_for "$RUN/hidden_states/manifest.json"; then
  for pad in $PROFILE_PADS; do
    name=train_profile$([ "$pad" = 1 ] || echo "_pad$pad")
    say "stage 04 profile on $RUN, --pad-batches-to $pad"
    # RUN's folders named one by one, not --run-dir: RUN's logs and recorded flags belong to the job making it
    "$PY" 04_train.py --pad-batches-to "$pad" --data-dir "$RUN/hidden_states" --vocab-mapping-dir "$RUN/vocab" \
      --model-path "$VERIFIER" --output-dir "$OUT/$name" --epochs 1 \
      --max-seq-len 2048 --max-tokens-per-batch 2048 --lr 1e-3 --num-workers 8 --profile-steps "$PROFILE_STEPS" \
      --eval-interval 100000 --save-interval 100000 --overwrite > "$OUT/$name.log" 2>&1 \
      || say "FAILED: stage 04 profile (see $name.log)"
    grep -h "profile-steps\|04_train finished" "$OUT/$name.log" | tee -a "$LOG" || true
  done
fi
if has lossless && wait_for "$DRAFTER/config.json"; then
  pids=()
  for dtype in float32 float64; do
    for drafting in "chain --num-steps 3 --topk 1 --num-draft-tokens 4" "tree --num-steps 3 --topk 8"; do
      name=${drafting%% *}_$dtype
      say "lossless check: $name"
      # shellcheck disable=SC2086
      "$PY" 05_benchmark.py --model-path "$VERIFIER" --draft-model-path "$DRAFTER" \
        --output-dir "$OUT/lossless_$name" --prompts "$DATA/mt_bench.jsonl" --tau-only --temperature 0 \
        --max-new-tokens 128 --dtype "$dtype" --decode-workers "$DECODE_WORKERS" ${drafting#* } \
        > "$OUT/lossless_$name.log" 2>&1 &
      pids+=($!)
    done
  done
  for pid in "${pids[@]}"; do wait "$pid" || say "FAILED: a lossless check (see its log)"; done
  grep -h "greedy check (" "$OUT"/lossless_*.log | tee -a "$LOG" || true
fi
say "checks done"
