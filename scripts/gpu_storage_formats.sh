#!/usr/bin/env bash
# What stage 02's storage formats cost, on one GPU: the same prepared data and vocabulary map extracted four ways
# (--aux-dtype bfloat16|float8_e4m3 x --targets final|topk), a drafter trained on each with the same flags, and
# each drafter's chain tau (stage 05 --tau-only, 3/1/4, T=0, MT-bench), and scripts/bench_extraction.py in each
# format (its extraction against the verifier's forward pass alone, on the same synthetic batches). Tabulated by
# scripts/storage_formats_table.py: bytes per token (written and on disk), stage 02 tokens/s and its ratio to the
# forward pass alone, stage 04 tokens/s, chain tau and the teacher-forced agreement.
# Extractions and trainings run alone on the GPU, one after another (their rates are compared); the benchmarks
# (acceptance only, no timing) run side by side at the end.
#
#   scripts/gpu_storage_formats.sh VERIFIER DATA_DIR RUN_ROOT OUT
#     VERIFIER  dense SmolLM2 folder (../shared/tools/device_smollm2.md)
#     DATA_DIR  scripts/prepare_device_data.py DATA --conversations 20000 --prompts-only (sharegpt.json,
#               mt_bench.jsonl); with REGEN_CACHE=FILE (../shared/cache/smollm2_sharegpt_greedy_10k.tgz) stage 01
#               reuses the greedy replies of the prompts it takes from that file
#     RUN_ROOT  RUN_ROOT/base (stages 01, 03) and RUN_ROOT/<variant> (stages 02, 04, 05)
#     OUT       storage_formats.json, storage_formats.md and the logs
# Environment: SAMPLES (4000), EPOCHS (2), TOPK (64), STEP_TOKENS (16384), NEW_TOKENS (128), PHASES ("data extract
# rate train bench table"; a phase can be rerun alone: finished stages are skipped), RATE_MODEL (the rate phase's
# verifier flags for bench_extraction.py; default --model-path VERIFIER; "--random-shape smollm2" needs no checkpoint:
# PHASES="rate table" RATE_MODEL="--random-shape smollm2" scripts/gpu_storage_formats.sh - - ROOT OUT). Expected on one H200 with the
# defaults and REGEN_CACHE: about 8 minutes (stage 01 from the cache ~1 min, each extraction ~10 s, each training
# ~1 min, the four benchmarks side by side ~2 min); without REGEN_CACHE stage 01 regenerates (~3 more minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
VERIFIER=$1; DATA=$2; ROOT=$3; OUT=$4
SAMPLES=${SAMPLES:-4000}; EPOCHS=${EPOCHS:-2}; TOPK=${TOPK:-64}; STEP_TOKENS=${STEP_TOKENS:-16384}
NEW_TOKENS=${NEW_TOKENS:-128}; PHASES=${PHASES:-"data extract rate train bench table"}
RATE_MODEL=${RATE_MODEL:-"--model-path $VERIFIER"}
VARIANTS=(bf16_final fp8_final bf16_topk fp8_topk)
export PYTHONUNBUFFERED=1
mkdir -p "$ROOT/base/logs" "$OUT"
LOG=$OUT/storage_formats.log
say() { echo "$(date +%T) $*" | tee -a "$LOG"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }
pack() { tar czf "$OUT/logs.tgz" --ignore-failed-read -C "$ROOT" $(cd "$ROOT" && ls -d */logs 2>/dev/null) || true; }
trap pack EXIT
flags_of() {  # the stage-02 flags of a variant
  case $1 in
    bf16_final) echo "" ;;
    fp8_final) echo "--aux-dtype float8_e4m3" ;;
    bf16_topk) echo "--targets topk --target-topk $TOPK" ;;
    fp8_topk) echo "--aux-dtype float8_e4m3 --targets topk --target-topk $TOPK" ;;
  esac
}

if has data; then
  if [ -n "${REGEN_CACHE:-}" ] && [ ! -f "$ROOT/base/data/regenerated.jsonl" ]; then
    mkdir -p "$ROOT/base/data" && tar xzf "$REGEN_CACHE" -C "$ROOT/base/data"
  fi
  say "stages 01 and 03: $SAMPLES samples in $ROOT/base"
  python3 run_pipeline.py --run-dir "$ROOT/base" --model-path "$VERIFIER" --dataset "$DATA/sharegpt.json" \
    --regenerate --max-turns 1 --num-samples "$SAMPLES" --eval-ratio 0.02 --max-seq-len 2048 \
    --draft-vocab-size 32000 --skip 02 --skip 04 --skip 05 \
    --stage-args 01 "--batch-size 1024 --max-new-tokens 256" > "$ROOT/base/logs/prepare.log" 2>&1
  for v in "${VARIANTS[@]}"; do  # the same prepared data and vocabulary map for every variant
    mkdir -p "$ROOT/$v/logs"
    rm -rf "$ROOT/$v/data" "$ROOT/$v/vocab"
    cp -r "$ROOT/base/data" "$ROOT/$v/data"
    cp -r "$ROOT/base/vocab" "$ROOT/$v/vocab"
  done
fi
if has extract; then
  for v in "${VARIANTS[@]}"; do
    say "stage 02 $v: $(flags_of "$v")"
    # shellcheck disable=SC2046
    python3 02_extract_hidden_states.py --run-dir "$ROOT/$v" --model-path "$VERIFIER" --max-seq-len 2048 \
      --batch-size 64 --num-workers 8 $(flags_of "$v") > "$ROOT/$v/logs/extract.log" 2>&1 \
      || say "FAILED: stage 02 $v"
  done
fi
if has rate; then  # each format's extraction against the forward pass alone, alone on the GPU
  for v in "${VARIANTS[@]}"; do
    say "bench_extraction $v"; mkdir -p "$ROOT/$v/logs"
    # shellcheck disable=SC2046,SC2086
    OUT=$ROOT/$v python3 scripts/bench_extraction.py $RATE_MODEL --output-dir "$ROOT/$v/bench_scratch" \
      $(flags_of "$v") > "$ROOT/$v/logs/bench_extraction.log" 2>&1 || say "FAILED: bench_extraction $v"
  done
fi
if has train; then
  for v in "${VARIANTS[@]}"; do
    say "stage 04 $v"
    python3 04_train.py --run-dir "$ROOT/$v" --model-path "$VERIFIER" --epochs "$EPOCHS" --max-seq-len 2048 \
      --max-tokens-per-batch "$STEP_TOKENS" --num-workers 8 --lr 1e-3 --eval-interval 500 --save-interval 100000 \
      > "$ROOT/$v/logs/train.log" 2>&1 || say "FAILED: stage 04 $v"
  done
fi
if has bench; then
  pids=()
  for v in "${VARIANTS[@]}"; do
    (python3 05_benchmark.py --run-dir "$ROOT/$v" --model-path "$VERIFIER" \
       --draft-model-path "$ROOT/$v/checkpoints/best" --output-dir "$ROOT/$v/bench_chain" --tau-only \
       --num-steps 3 --topk 1 --num-draft-tokens 4 --temperature 0 --prompts "$DATA/mt_bench.jsonl" \
       --max-new-tokens "$NEW_TOKENS" > "$ROOT/$v/logs/bench_chain.log" 2>&1 || say "FAILED: bench $v") & pids+=($!)
    (python3 05_benchmark.py --run-dir "$ROOT/$v" --model-path "$VERIFIER" \
       --draft-model-path "$ROOT/$v/checkpoints/best" --output-dir "$ROOT/$v/bench_eval" --mode eval \
       --num-steps 3 > "$ROOT/$v/logs/bench_eval.log" 2>&1 || say "FAILED: eval $v") & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || true; done
  say "benchmarks done"
fi
if has table; then
  python3 scripts/storage_formats_table.py "$ROOT" "$OUT" "${VARIANTS[@]}"
  say "all done"; cat "$OUT/storage_formats.md"
fi
