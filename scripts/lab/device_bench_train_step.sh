#!/usr/bin/env bash
# Stage 04's training step against SpecForge 0.2.0's, side by side on one GPU machine.
#
#   scripts/lab/device_bench_train_step.sh PEER_DIR [PART ...]
#     PEER_DIR  holds specforge-0.2.0-py3-none-any.whl and peer_specforge_train_bench.py (the peer benchmark,
#               ../shared/tools/peer_specforge_train_bench.py), e.g. a carried folder
#     PART      any of (default: ours peer), each under about 6 minutes, so that a session's 10-minute
#               commands can take them one or two at a time on the same machine:
#       ours     scripts/lab/bench_train_step.py at SmolLM2, Llama-3.1-8B and Kimi shapes, S = 2048 and 8192, with
#                bf16 parameters and stochastic rounding (--optimizer sr): bf16 GEMMs, then --fp8
#                -> $OUT/ours.jsonl, $OUT/ours_fp8.jsonl
#       best     each of the issue's five points in its faster mode (bf16 GEMMs at SmolLM2 and Llama-8B S=2048,
#                --fp8 at Llama-8B S=8192 and both Kimi lengths) -> $OUT/ours_best.jsonl
#       fused    the same with --fuse-elementwise (a candidate), bf16 everywhere and --fp8 at the two large
#                shapes -> $OUT/ours_fused.jsonl, $OUT/ours_fused_fp8.jsonl
#       profile  kernel tables (by op and by input shape) of SmolLM2 S=2048 and Llama-8B S=8192 (bf16), and
#                Llama-8B S=8192 with --fp8 -> $OUT/profile_*_{bf16,fp8}.txt
#       peer     SpecForge's own trainer step with flex_attention (its default) -> $OUT/peer.jsonl
#                (PEER_BUDGET_S bounds its sweep, default 420 s)
# TTT 7, draft vocabulary 32000, batch 1 throughout. scripts/lab/compare_train_step.py $OUT prints the table.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is not pip-installed
PEER=$1; shift
PARTS=${*:-ours peer}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BENCH="python3 scripts/lab/bench_train_step.py --device cuda --optimizer sr"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for part in $PARTS; do
  case $part in
    ours)
      $BENCH --shapes smollm2,llama8b,kimi --seq-lens 2048,8192 | grep '^{' | tee "$OUT/ours.jsonl" | cut -c1-160
      $BENCH --shapes smollm2,llama8b,kimi --seq-lens 2048,8192 --fp8 | grep '^{' | tee "$OUT/ours_fp8.jsonl" \
        | cut -c1-160 ;;
    best)
      { $BENCH --shapes smollm2,llama8b --seq-lens 2048
        $BENCH --shapes llama8b --seq-lens 8192 --fp8
        $BENCH --shapes kimi --seq-lens 2048,8192 --fp8; } | grep '^{' | tee "$OUT/ours_best.jsonl" | cut -c1-160 ;;
    fused)
      $BENCH --shapes smollm2,llama8b,kimi --seq-lens 2048,8192 --fuse-elementwise | grep '^{' \
        | tee "$OUT/ours_fused.jsonl" | cut -c1-160
      $BENCH --shapes llama8b,kimi --seq-lens 2048,8192 --fuse-elementwise --fp8 | grep '^{' \
        | tee "$OUT/ours_fused_fp8.jsonl" | cut -c1-160 ;;
    profile)
      for run in "smollm2 2048 bf16" "llama8b 8192 bf16" "llama8b 8192 fp8"; do
        set -- $run
        mkdir -p "$OUT/$3"
        OUT=$OUT/$3 $BENCH --shapes "$1" --seq-lens "$2" --steps 3 $([ "$3" = fp8 ] && echo --fp8) --profile \
          > /dev/null
        mv "$OUT/$3/profile_$1_$2.txt" "$OUT/profile_$1_$2_$3.txt"
        rm -rf "${OUT:?}/$3"
      done ;;
    peer)
      python3 -m pip install -q --no-index --no-deps --target /tmp/peer_site "$PEER"/specforge-0.2.0-py3-none-any.whl
      PYTHONPATH=/tmp/peer_site timeout "${PEER_BUDGET_S:-420}" python3 "$PEER"/peer_specforge_train_bench.py \
        --sweep --sweep-backends flex_attention --time-budget-s "${PEER_BUDGET_S:-420}" > "$OUT/peer.jsonl" \
        2> "$OUT/peer_stderr.txt"
      tail -n 12 "$OUT/peer.jsonl" | cut -c1-160 ;;
    *) echo "unknown part $part (ours, best, fused, profile, peer)" >&2; exit 2 ;;
  esac
done
