#!/usr/bin/env bash
# Drafter quality on one GPU, measured as the field measures it and side by side on the same data:
#   - our drafter (SAMPLES regenerated ShareGPT prompts, EPOCHS epochs), stage 05 --tau-only at chain 3/1/4 (what
#     SGLang serves), T=0, on all 80 MT-bench questions (both turns) and a stratified sample of the held-out split;
#     chain and tree in float32 on all of MT-bench to show decoding is lossless (every turn checked against the
#     verifier's greedy choice); chain at T=1; the teacher-forced agreement per TTT step on the validation split;
#   - the A/B of the TTT positions: the same training with --ttt-positions fixed (the old rule, docs/model.md);
#   - SpecForge 0.2.0's recipe (scripts/compare_recipes.py) against ours on a smaller run (SMALL samples, the same
#     epochs): SpecForge trains one sequence a step, so equal tokens on the full run would not fit one session;
#     also ours with STEP_TOKENS_SMALL-token steps there (more optimizer steps, the issue's lever).
# Trainings whose wall time is compared run alone on the GPU, one after another; the A/B training and every
# benchmark (acceptance only, timing-free) run side by side afterwards, each stage-05 run in its own output folder
# (a folder has one writer at a time).
#
#   scripts/gpu_drafter_quality.sh VERIFIER DATA_DIR RUN_DIR
#     VERIFIER  dense SmolLM2 folder (../shared/tools/device_smollm2.md)
#     DATA_DIR  scripts/prepare_device_data.py DATA --conversations 20000 --prompts-only (sharegpt.json,
#               mt_bench.jsonl); with REGEN_CACHE=FILE (../shared/cache/smollm2_sharegpt_greedy_10k.tgz) stage 01
#               reuses the greedy replies of every prompt that SAMPLES=10000 takes from that file
# Environment: SAMPLES (10000), SMALL (2000), EPOCHS (4), LR (1e-3), STEP_TOKENS (16384), STEP_TOKENS_SMALL (4096),
# HELDOUT (80), NEW_TOKENS (128), SPECFORGE (its wheel or a folder holding the package; empty: no comparison),
# SPECFORGE_ARGS (more flags for its recipe, e.g. "--lr 1e-4 --time-limit 420"), PHASES ("data ours compare ab
# bench"), OUT (pack logs, metrics and reports into $OUT/quality.tgz). Progress: RUN_DIR/logs/quality.log.
set -euo pipefail
cd "$(dirname "$0")/.."
VERIFIER=$1; DATA=$2; RUN=$3; SMALL_RUN=$RUN-small
SAMPLES=${SAMPLES:-10000}; SMALL=${SMALL:-2000}; EPOCHS=${EPOCHS:-4}; LR=${LR:-1e-3}
STEP_TOKENS=${STEP_TOKENS:-16384}; STEP_TOKENS_SMALL=${STEP_TOKENS_SMALL:-4096}
HELDOUT=${HELDOUT:-80}; NEW_TOKENS=${NEW_TOKENS:-128}; SPECFORGE=${SPECFORGE:-}; SPECFORGE_ARGS=${SPECFORGE_ARGS:-}
PHASES=${PHASES:-"data ours compare ab bench"}
export PYTHONUNBUFFERED=1
mkdir -p "$RUN/logs"
LOG=$RUN/logs/quality.log
say() { echo "$(date +%T) $*" | tee -a "$LOG"; }
pack() {
  [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/quality.tgz" --ignore-failed-read -C "$(dirname "$RUN")" \
    $(cd "$(dirname "$RUN")" && ls -d "$(basename "$RUN")"/{logs,bench_*,quality.md,checkpoints*/metrics.jsonl,checkpoints*/training_curves.png,*/manifest.json} \
      "$(basename "$SMALL_RUN")"/{logs,compare,bench_*,specforge/*.json,specforge/*.md,checkpoints*/metrics.jsonl,*/manifest.json} 2>/dev/null) || true
}
trap pack EXIT
has() { [[ " $PHASES " == *" $1 "* ]]; }

prepare() {  # $1 run dir, $2 samples: stages 01-03, the replies from REGEN_CACHE
  if [ -n "${REGEN_CACHE:-}" ] && [ ! -f "$1/data/regenerated.jsonl" ]; then
    mkdir -p "$1/data" && tar xzf "$REGEN_CACHE" -C "$1/data"
  fi
  python3 run_pipeline.py --run-dir "$1" --model-path "$VERIFIER" --dataset "$DATA/sharegpt.json" \
    --regenerate --max-turns 1 --num-samples "$2" --eval-ratio 0.02 --max-seq-len 2048 \
    --draft-vocab-size 32000 --skip 04 --skip 05 \
    --stage-args 01 "--batch-size 1024 --max-new-tokens 256" --stage-args 02 "--batch-size 64 --num-workers 8"
}
train04() {  # $1 run dir, $2 output folder, $3 tokens a step, then extra flags; the log beside the run's logs
  local run=$1 out=$2 tokens=$3; shift 3
  say "train $out ($tokens tokens a step $*)"
  python3 04_train.py --run-dir "$run" --model-path "$VERIFIER" --output-dir "$out" --epochs "$EPOCHS" \
    --max-seq-len 2048 --max-tokens-per-batch "$tokens" --num-workers 8 --lr "$LR" --eval-interval 500 \
    --save-interval 100000 "$@" > "$run/logs/train_$(basename "$out").log" 2>&1
  say "trained $out: $(python3 -c "import json; print(json.load(open('$out/manifest.json'))['wall_time_s'])") s"
}
bench() {  # $1 run dir, $2 report name, $3 drafter folder, then stage 05 flags
  local run=$1 name=$2 drafter=$3; shift 3
  python3 05_benchmark.py --run-dir "$run" --model-path "$VERIFIER" --draft-model-path "$drafter" \
    --output-dir "$run/bench_$name" --max-new-tokens "$NEW_TOKENS" "$@" \
    > "$run/logs/bench_${name}_$(date +%s%N).log" 2>&1 || say "FAILED: bench $name $*"
  say "bench $name $* done"
}
chain=(--num-steps 3 --topk 1 --num-draft-tokens 4)
suite() {  # $1 run dir, $2 name, $3 drafter: teacher-forced agreement, then chain T=0 on MT-bench and held-out
  bench "$1" "$2" "$3" --mode eval --num-steps 7
  bench "$1" "$2" "$3" --tau-only "${chain[@]}" --temperature 0 --prompts "$DATA/mt_bench.jsonl"
  bench "$1" "$2" "$3" --tau-only "${chain[@]}" --temperature 0 --prompts "$1/data/eval_data.jsonl" \
    --num-prompts "$HELDOUT"
}

if has data; then
  say "stages 01-03: $SAMPLES samples in $RUN"; prepare "$RUN" "$SAMPLES" > "$RUN/logs/prepare.log" 2>&1
  if [ -n "$SPECFORGE" ]; then
    mkdir -p "$SMALL_RUN/logs"
    say "stages 01-03: $SMALL samples in $SMALL_RUN"; prepare "$SMALL_RUN" "$SMALL" > "$SMALL_RUN/logs/prepare.log" 2>&1
  fi
fi
has ours && train04 "$RUN" "$RUN/checkpoints" "$STEP_TOKENS"
if has compare && [ -n "$SPECFORGE" ]; then
  if [[ "$SPECFORGE" == *.whl ]]; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/specforge_site "$SPECFORGE"
    SPECFORGE=/tmp/specforge_site
  fi
  export PYTHONPATH=$SPECFORGE${PYTHONPATH:+:$PYTHONPATH}
  train04 "$SMALL_RUN" "$SMALL_RUN/checkpoints" "$STEP_TOKENS"
  train04 "$SMALL_RUN" "$SMALL_RUN/checkpoints_steps$STEP_TOKENS_SMALL" "$STEP_TOKENS_SMALL"
  say "SpecForge's recipe on $SMALL_RUN"
  python3 scripts/compare_recipes.py --run-dir "$SMALL_RUN" --model-path "$VERIFIER" --parts train \
    --recipe-args "$SPECFORGE_ARGS" > "$SMALL_RUN/logs/specforge.log" 2>&1 || say "FAILED: SpecForge's recipe"
  say "SpecForge done"
fi
if has ab; then
  train04 "$RUN" "$RUN/checkpoints_fixed" "$STEP_TOKENS" --ttt-positions fixed &
  ab_pid=$!
fi
if has bench; then
  pids=()
  suite "$RUN" ours "$RUN/checkpoints/best" & pids+=($!)
  bench "$RUN" ours_fp32_chain "$RUN/checkpoints/best" --tau-only "${chain[@]}" --temperature 0 --dtype float32 \
    --prompts "$DATA/mt_bench.jsonl" & pids+=($!)
  bench "$RUN" ours_fp32_tree "$RUN/checkpoints/best" --tau-only --num-steps 3 --topk 8 --temperature 0 \
    --dtype float32 --prompts "$DATA/mt_bench.jsonl" & pids+=($!)
  bench "$RUN" ours_t1 "$RUN/checkpoints/best" --tau-only "${chain[@]}" --temperature 1 \
    --prompts "$DATA/mt_bench.jsonl" & pids+=($!)
  if [ -d "$SMALL_RUN/specforge/best" ]; then
    (python3 scripts/compare_recipes.py --run-dir "$SMALL_RUN" --model-path "$VERIFIER" --parts bench table \
       --max-new-tokens "$NEW_TOKENS" > "$SMALL_RUN/logs/compare.log" 2>&1 || say "FAILED: compare bench") & pids+=($!)
    suite "$SMALL_RUN" "steps$STEP_TOKENS_SMALL" "$SMALL_RUN/checkpoints_steps$STEP_TOKENS_SMALL/best" & pids+=($!)
  fi
  for pid in "${pids[@]}"; do wait "$pid" || true; done
fi
if [ -n "${ab_pid:-}" ]; then
  wait "$ab_pid" && has bench && suite "$RUN" fixed "$RUN/checkpoints_fixed/best"
fi
python3 scripts/quality_table.py "$RUN" > "$RUN/quality.md"
[ -d "$SMALL_RUN" ] && python3 scripts/quality_table.py "$SMALL_RUN" >> "$RUN/quality.md"
[ -f "$SMALL_RUN/compare/compare.md" ] && cat "$SMALL_RUN/compare/compare.md" >> "$RUN/quality.md"
say "all done"; cat "$RUN/quality.md"
