#!/usr/bin/env bash
# Stage 04's training step against SpecForge 0.2.0's, side by side on one GPU machine.
#
#   scripts/device_bench_train_step.sh PEER_DIR [ours|peer|all]
#     PEER_DIR  holds specforge-0.2.0-py3-none-any.whl and peer_specforge_train_bench.py (the peer benchmark,
#               ../shared/tools/peer_specforge_train_bench.py), e.g. a carried folder
#     ours|peer run one half (to fit two 10-minute commands of one machine session); all (default) both
#
# Runs, at SmolLM2, Llama-3.1-8B and Kimi shapes, S = 2048 and 8192, TTT 7, draft vocabulary 32000, batch 1:
#   ours   scripts/bench_train_step.py with bf16 parameters and stochastic rounding (--optimizer sr), once
#          with bf16 GEMMs and once with stage 04's --fp8 (FP8 GEMMs);
#   peer   SpecForge's own trainer step with flex_attention (its default).
# Results: $OUT/ours.jsonl, $OUT/ours_fp8.jsonl, $OUT/peer.jsonl. PEER_BUDGET_S bounds the peer's sweep
# (default 420 s). scripts/compare_train_step.py prints the side-by-side table from them.
# FUSE=1 adds a run with the TTT step's elementwise ops fused (--fuse-elementwise, a candidate) at every point,
# to $OUT/ours_fused.jsonl (and ours_fused_fp8.jsonl).
# PROFILE=1 adds kernel tables (by op and by input shape) of SmolLM2 S=2048 (bf16) and Llama-8B S=8192 (bf16
# and --fp8) to $OUT/profile_*.txt, about a minute more.
set -uo pipefail
cd "$(dirname "$0")/.."
PEER=$1
PART=${2:-all}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$PART" != peer ]; then
  python3 scripts/bench_train_step.py --device cuda --shapes smollm2,llama8b,kimi --seq-lens 2048,8192 \
    --optimizer sr | grep '^{' | tee "$OUT/ours.jsonl" | cut -c1-200
  python3 scripts/bench_train_step.py --device cuda --shapes smollm2,llama8b,kimi --seq-lens 2048,8192 \
    --optimizer sr --fp8 | grep '^{' | tee "$OUT/ours_fp8.jsonl" | cut -c1-200
  if [ "${FUSE:-0}" = 1 ]; then
    python3 scripts/bench_train_step.py --device cuda --shapes smollm2,llama8b,kimi --seq-lens 2048,8192 \
      --optimizer sr --fuse-elementwise | grep '^{' | tee "$OUT/ours_fused.jsonl" | cut -c1-200
    python3 scripts/bench_train_step.py --device cuda --shapes llama8b,kimi --seq-lens 2048,8192 \
      --optimizer sr --fuse-elementwise --fp8 | grep '^{' | tee "$OUT/ours_fused_fp8.jsonl" | cut -c1-200
  fi
  if [ "${PROFILE:-0}" = 1 ]; then
    mkdir -p "$OUT/bf16" "$OUT/fp8"
    OUT=$OUT/bf16 python3 scripts/bench_train_step.py --device cuda --shapes smollm2 --seq-lens 2048 --optimizer sr \
      --steps 3 --profile > /dev/null
    OUT=$OUT/bf16 python3 scripts/bench_train_step.py --device cuda --shapes llama8b --seq-lens 8192 --optimizer sr \
      --steps 3 --profile > /dev/null
    OUT=$OUT/fp8 python3 scripts/bench_train_step.py --device cuda --shapes llama8b --seq-lens 8192 --optimizer sr \
      --steps 3 --fp8 --profile > /dev/null
    for f in "$OUT"/bf16/profile_*.txt "$OUT"/fp8/profile_*.txt; do mv "$f" "${f%.txt}_$(basename "$(dirname "$f")").txt"; done
  fi
fi
if [ "$PART" != ours ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/peer_site "$PEER"/specforge-0.2.0-py3-none-any.whl
  PYTHONPATH=/tmp/peer_site timeout "${PEER_BUDGET_S:-420}" python3 "$PEER"/peer_specforge_train_bench.py --sweep \
    --sweep-backends flex_attention --time-budget-s "${PEER_BUDGET_S:-420}" > "$OUT/peer.jsonl" 2> "$OUT/peer_stderr.txt"
  tail -n 12 "$OUT/peer.jsonl" | cut -c1-200
fi
