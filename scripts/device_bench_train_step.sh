#!/usr/bin/env bash
# Stage 04's training step against SpecForge 0.2.0's, side by side on one GPU machine, in one command.
#
#   scripts/device_bench_train_step.sh PEER_DIR
#     PEER_DIR  holds specforge-0.2.0-py3-none-any.whl and peer_specforge_train_bench.py (the peer benchmark,
#               ../shared/tools/peer_specforge_train_bench.py), e.g. a carried folder
#
# Runs, at SmolLM2, Llama-3.1-8B and Kimi shapes, S = 2048 and 8192, TTT 7, draft vocabulary 32000, batch 1:
#   ours   scripts/bench_train_step.py with the stage's optimizer in bf16 with stochastic rounding (--optimizer sr),
#          then again at S = 8192 with the cuDNN attention kernel (--ttt-attention cudnn_cuda) and a profile;
#   peer   SpecForge's own trainer step with flex_attention (its default).
# Results: $OUT/ours.jsonl, $OUT/ours_cudnn.jsonl, $OUT/peer.jsonl, $OUT/profile_*.txt. PEER_BUDGET_S bounds
# the peer's sweep (default 400 s).
set -uo pipefail
cd "$(dirname "$0")/.."
PEER=$1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 scripts/bench_train_step.py --device cuda --shapes smollm2,llama8b,kimi --seq-lens 2048,8192 \
  --optimizer sr | grep '^{' | tee "$OUT/ours.jsonl" | cut -c1-300
OUT=$OUT python3 scripts/bench_train_step.py --device cuda --shapes llama8b,kimi --seq-lens 8192 --optimizer sr \
  --ttt-attention cudnn_cuda --profile | grep '^{' | tee "$OUT/ours_cudnn.jsonl" | cut -c1-300
python3 -m pip install -q --no-index --no-deps --target /tmp/peer_site "$PEER"/specforge-0.2.0-py3-none-any.whl
PYTHONPATH=/tmp/peer_site timeout "${PEER_BUDGET_S:-400}" python3 "$PEER"/peer_specforge_train_bench.py --sweep \
  --sweep-backends flex_attention --time-budget-s "${PEER_BUDGET_S:-400}" > "$OUT/peer.jsonl" 2> "$OUT/peer_stderr.txt"
tail -n 12 "$OUT/peer.jsonl" | cut -c1-300
