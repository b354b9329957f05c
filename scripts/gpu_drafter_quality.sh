#!/usr/bin/env bash
# Drafter quality on one GPU, side by side on the same data: our stage 04 recipe, the same recipe with the old TTT
# positions (--ttt-positions fixed: the A/B of docs/model.md), and SpecForge 0.2.0's recipe
# (scripts/train_specforge_recipe.py), each benchmarked by stage 05 in the same runs: chain 3/1/4 (what SGLang
# serves) at T=0, --tau-only, on all of MT-bench (both turns) and on a stratified sample of the held-out split;
# chain and tree in float32 on MT-bench to show that decoding is lossless (every turn equal to the verifier's
# greedy output); chain at T=1; and the teacher-forced agreement per TTT step on stage 04's validation split.
#
#   scripts/gpu_drafter_quality.sh VERIFIER DATA_DIR RUN_DIR
#     VERIFIER  dense SmolLM2 folder (see ../shared/tools/device_smollm2.md)
#     DATA_DIR  made by scripts/prepare_device_data.py DATA --conversations 20000 --prompts-only: sharegpt.json,
#               mt_bench.jsonl, humaneval.jsonl (with REGEN_CACHE=../shared/cache/smollm2_sharegpt_greedy_10k.tgz,
#               stage 01 reuses every reply of the 10,000 prompts SAMPLES=10000 takes from that file)
# Environment: SAMPLES (10000), EPOCHS (4), LR (1e-3), STEP_TOKENS (16384), HELDOUT (80 held-out prompts),
# NEW_TOKENS (128), SPECFORGE (a folder holding the specforge package, or its wheel file; empty: leave it out),
# AB (1: also train and benchmark --ttt-positions fixed), PHASES ("data ours specforge ab bench"), OUT (pack the
# logs, metrics and reports into $OUT/quality.tgz).
# Timing: ours and SpecForge train one after the other, each alone on the GPU, so their wall times compare; the
# A/B training and all benchmarks (acceptance only, so timing-free) run side by side afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
VERIFIER=$1; DATA=$2; RUN=$3
SAMPLES=${SAMPLES:-10000}; EPOCHS=${EPOCHS:-4}; LR=${LR:-1e-3}; STEP_TOKENS=${STEP_TOKENS:-16384}
HELDOUT=${HELDOUT:-80}; NEW_TOKENS=${NEW_TOKENS:-128}; AB=${AB:-1}; SPECFORGE=${SPECFORGE:-}
PHASES=${PHASES:-"data ours specforge ab bench"}
export PYTHONUNBUFFERED=1
mkdir -p "$RUN/logs"
pack() {
  [ -n "${OUT:-}" ] && [ -d "$RUN" ] || return 0
  (cd "$RUN" && tar czf "$OUT/quality.tgz" --ignore-failed-read logs bench* quality.md \
    checkpoints*/metrics.jsonl checkpoints*/best.json specforge/*.json */manifest.json 2>/dev/null) || true
}
trap pack EXIT
has() { [[ " $PHASES " == *" $1 "* ]]; }
if [ -n "${REGEN_CACHE:-}" ] && [ ! -f "$RUN/data/regenerated.jsonl" ]; then
  mkdir -p "$RUN/data" && tar xzf "$REGEN_CACHE" -C "$RUN/data"
fi
train04() {  # $1: output folder, then extra flags
  local out=$1; shift
  python3 04_train.py --run-dir "$RUN" --model-path "$VERIFIER" --output-dir "$out" --epochs "$EPOCHS" \
    --max-seq-len 2048 --max-tokens-per-batch "$STEP_TOKENS" --num-workers 8 --lr "$LR" --eval-interval 500 \
    --save-interval 100000 "$@"
}
if has data; then
  python3 run_pipeline.py --run-dir "$RUN" --model-path "$VERIFIER" --dataset "$DATA/sharegpt.json" \
    --regenerate --max-turns 1 --num-samples "$SAMPLES" --eval-ratio 0.02 --max-seq-len 2048 \
    --draft-vocab-size 32000 --skip 04 --skip 05 \
    --stage-args 01 "--batch-size 1024 --max-new-tokens 256" --stage-args 02 "--batch-size 64 --num-workers 8"
fi
if has ours; then
  start=$SECONDS; train04 "$RUN/checkpoints" > "$RUN/logs/train_ours.log" 2>&1
  echo "ours: $((SECONDS - start)) s" | tee "$RUN/logs/wall_ours.txt"
fi
if has specforge && [ -n "$SPECFORGE" ]; then
  if [[ "$SPECFORGE" == *.whl ]]; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/specforge_site "$SPECFORGE"; SPECFORGE=/tmp/specforge_site
  fi
  start=$SECONDS
  python3 scripts/train_specforge_recipe.py --run-dir "$RUN" --specforge-path "$SPECFORGE" \
    --output-dir "$RUN/specforge" > "$RUN/logs/train_specforge.log" 2>&1
  echo "specforge: $((SECONDS - start)) s" | tee "$RUN/logs/wall_specforge.txt"
fi
bench() {  # $1 name, $2 drafter folder, then extra flags: one stage-05 run, its summary line into the log
  local name=$1 drafter=$2; shift 2
  python3 05_benchmark.py --run-dir "$RUN" --model-path "$VERIFIER" --draft-model-path "$drafter" \
    --output-dir "$RUN/bench_$name" --max-new-tokens "$NEW_TOKENS" "$@" > "$RUN/logs/bench_${name}_$(date +%s%N).log" 2>&1
}
chain=(--num-steps 3 --topk 1 --num-draft-tokens 4)
suite() {  # every acceptance run of one drafter, in sequence: $1 name, $2 folder
  bench "$1" "$2" --mode eval --num-steps 7
  bench "$1" "$2" --tau-only "${chain[@]}" --temperature 0 --prompts "$DATA/mt_bench.jsonl"
  bench "$1" "$2" --tau-only "${chain[@]}" --temperature 0 --prompts "$RUN/data/eval_data.jsonl" --num-prompts "$HELDOUT"
}
if has ab && [ "$AB" = 1 ]; then
  train04 "$RUN/checkpoints_fixed" --ttt-positions fixed > "$RUN/logs/train_fixed.log" 2>&1 &
  ab_pid=$!
fi
if has bench; then
  pids=()
  suite ours "$RUN/checkpoints/best" & pids+=($!)
  [ -d "$RUN/specforge/best" ] && { suite specforge "$RUN/specforge/best" & pids+=($!); }
  # lossless: float32 chain and tree on all of MT-bench, each turn checked against the verifier's greedy choice
  bench ours_fp32 "$RUN/checkpoints/best" --tau-only "${chain[@]}" --temperature 0 --dtype float32 \
    --prompts "$DATA/mt_bench.jsonl" & pids+=($!)
  bench ours_fp32 "$RUN/checkpoints/best" --tau-only --num-steps 3 --topk 8 --temperature 0 --dtype float32 \
    --prompts "$DATA/mt_bench.jsonl" & pids+=($!)
  bench ours "$RUN/checkpoints/best" --tau-only "${chain[@]}" --temperature 1 --prompts "$DATA/mt_bench.jsonl" \
    & pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid" || echo "a benchmark failed (see $RUN/logs)"; done
fi
if [ -n "${ab_pid:-}" ]; then
  wait "$ab_pid" && has bench && suite fixed "$RUN/checkpoints_fixed/best"
fi
python3 scripts/quality_table.py "$RUN" | tee "$RUN/quality.md"
