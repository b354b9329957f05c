#!/usr/bin/env bash
# What stage 02's storage formats cost, on one GPU: the same prepared data and vocabulary map extracted four ways
# (--aux-dtype bfloat16|float8_e4m3 x --targets final|topk), a drafter trained on each with the same flags, and
# each drafter's chain tau (stage 05 --tau-only, 3/1/4, T=0, MT-bench), and scripts/lab/bench_extraction.py in each
# format (its extraction against the verifier's forward pass alone, on the same synthetic batches). Tabulated by
# scripts/lab/storage_formats_table.py: bytes per token (written and on disk), stage 02 tokens/s and its ratio to the
# forward pass alone, stage 04 tokens/s, chain tau and the teacher-forced agreement.
# The four formats are the storage-format lanes bf16final (the base run's own extraction), fp8final, bf16topk and
# fp8topk (eagle3_pipeline/lab/lanes.py, docs/lab.md; bf16_final and the like are their old spellings), run by
# scripts/lab/run_lanes.py into RUN_ROOT/<lane> with their lane.json; every lane trains with this script's
# STEP_TOKENS. Extractions and trainings run alone on the GPU, one after another (their rates are compared); the
# benchmarks (acceptance only, no timing) run side by side at the end.
#
#   scripts/lab/gpu_storage_formats.sh VERIFIER DATA_DIR RUN_ROOT OUT
#     VERIFIER  dense SmolLM2 folder (../shared/tools/device_smollm2.md)
#     DATA_DIR  scripts/prepare_device_data.py DATA --conversations 20000 --prompts-only (sharegpt.json,
#               mt_bench.jsonl); with REGEN_CACHE=FILE (../shared/cache/smollm2_sharegpt_greedy_10k.tgz) stage 01
#               reuses the greedy replies of the prompts it takes from that file
#     RUN_ROOT  RUN_ROOT/base (stages 01-03; its stage 02 is bf16final's) and RUN_ROOT/<lane> (stages 02, 04, 05)
#     OUT       storage_formats.json, storage_formats.md and the logs
# Environment: SAMPLES (4000), EPOCHS (2), TOPK (64), STEP_TOKENS (16384), NEW_TOKENS (128), PHASES ("data extract
# rate train bench table"; a phase can be rerun alone: finished stages are skipped), RATE_MODEL (the rate phase's
# verifier flags for bench_extraction.py; default --model-path VERIFIER; "--random-shape smollm2" needs no checkpoint:
# PHASES="rate table" RATE_MODEL="--random-shape smollm2" scripts/lab/gpu_storage_formats.sh - - ROOT OUT), DRY_RUN (1:
# print the lanes' plan and stop). Expected on one H200 with the defaults and REGEN_CACHE: about 8 minutes (stage 01
# from the cache ~1 min, each extraction ~10 s, each training ~1 min, the four benchmarks side by side ~2 min);
# without REGEN_CACHE stage 01 regenerates (~3 more minutes).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is not pip-installed
VERIFIER=$1; DATA=$2; ROOT=$3; OUT=$4
SAMPLES=${SAMPLES:-4000}; EPOCHS=${EPOCHS:-2}; TOPK=${TOPK:-64}; STEP_TOKENS=${STEP_TOKENS:-16384}
NEW_TOKENS=${NEW_TOKENS:-128}; PHASES=${PHASES:-"data extract rate train bench table"}
RATE_MODEL=${RATE_MODEL:-"--model-path $VERIFIER"}
LANES="bf16final fp8final bf16topk fp8topk"  # the first is the table's reference
export PYTHONUNBUFFERED=1
lanes() {  # scripts/lab/run_lanes.py over RUN_ROOT/base, each lane in RUN_ROOT/<lane>: this script's recipe, then flags
  local recipe="--epochs $EPOCHS --max-tokens-per-batch $STEP_TOKENS --num-workers 8 --lr 1e-3"
  python3 scripts/lab/run_lanes.py --base "$ROOT/base" --lanes-dir "$ROOT" --lanes "$LANES" --model-path "$VERIFIER" \
    --max-seq-len 2048 --stage-args 02 "--batch-size 64 --num-workers 8 --target-topk $TOPK" \
    --stage-args 04 "$recipe --eval-interval 500 --save-interval 100000" \
    --format-step-tokens "$STEP_TOKENS" --benchmarks eval,mtbench --eval-steps 3 --mt-bench "$DATA/mt_bench.jsonl" \
    --new-tokens "$NEW_TOKENS" "$@"
}
if [ "${DRY_RUN:-0}" = 1 ]; then lanes --dry-run; exit; fi
mkdir -p "$ROOT/base/logs" "$OUT"
LOG=$OUT/storage_formats.log
say() { echo "$(date +%T) $*" | tee -a "$LOG"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }
pack() {  # every log and lane record under RUN_ROOT
  # shellcheck disable=SC2046
  tar czf "$OUT/logs.tgz" --ignore-failed-read -C "$ROOT" $(cd "$ROOT" && ls -d */logs */lane.json */bench_*/logs \
    2>/dev/null) || true
}
trap pack EXIT

if has data; then
  if [ -n "${REGEN_CACHE:-}" ] && [ ! -f "$ROOT/base/data/regenerated.jsonl" ]; then
    mkdir -p "$ROOT/base/data" && tar xzf "$REGEN_CACHE" -C "$ROOT/base/data"
  fi
  say "stages 01 and 03: $SAMPLES samples in $ROOT/base"
  python3 run_pipeline.py --run-dir "$ROOT/base" --model-path "$VERIFIER" --dataset "$DATA/sharegpt.json" \
    --regenerate --max-turns 1 --num-samples "$SAMPLES" --eval-ratio 0.02 --max-seq-len 2048 \
    --draft-vocab-size 32000 --skip 02 --skip 04 --skip 05 \
    --stage-args 01 "--batch-size 1024 --max-new-tokens 256" > "$ROOT/base/logs/prepare.log" 2>&1
fi
if has extract; then  # one after another: bf16final's is the base run's stage 02, the others each lane's own
  say "stage 02 in $ROOT/base (bf16final)"
  python3 run_pipeline.py --run-dir "$ROOT/base" --model-path "$VERIFIER" --max-seq-len 2048 --skip 01 --skip 03 \
    --skip 04 --skip 05 --stage-args 02 "--batch-size 64 --num-workers 8 --target-topk $TOPK" \
    > "$ROOT/base/logs/extract.log" 2>&1 || say "FAILED: stage 02 in $ROOT/base"
  say "stage 02 of the other formats"
  lanes --only data > "$OUT/lanes_extract.log" 2>&1 || say "FAILED: a lane's stage 02 (see $OUT/lanes_extract.log)"
fi
if has rate; then  # each format's extraction against the forward pass alone, alone on the GPU
  while IFS=$'\t' read -r name flags; do
    say "bench_extraction $name: $flags"; mkdir -p "$ROOT/$name/logs"
    # shellcheck disable=SC2086
    OUT=$ROOT/$name python3 scripts/lab/bench_extraction.py $RATE_MODEL --output-dir "$ROOT/$name/bench_scratch" \
      $flags > "$ROOT/$name/logs/bench_extraction.log" 2>&1 || say "FAILED: bench_extraction $name"
  done < <(lanes --flags-of 02)
fi
if has train; then  # one lane after another, each alone on the GPU
  say "stage 04 of $LANES"
  lanes --only train > "$OUT/lanes_train.log" 2>&1 || say "FAILED: a training (see $OUT/lanes_train.log)"
fi
if has bench; then
  pids=()
  for name in $LANES; do
    (lanes --lanes "$name" --only bench --bench-jobs 2 > "$OUT/lanes_bench_$name.log" 2>&1 \
       || say "FAILED: bench $name (see $OUT/lanes_bench_$name.log)") & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || true; done
  say "benchmarks done"
fi
if has table; then
  # shellcheck disable=SC2046
  python3 scripts/lab/storage_formats_table.py "$OUT" $(for name in $LANES; do echo "$ROOT/$name"; done)
  say "all done"; cat "$OUT/storage_formats.md"
fi
