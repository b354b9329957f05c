#!/usr/bin/env bash
# Stage 02 throughput on a GPU machine (see scripts/lab/bench_extraction.py), for SmolLM2-135M-Instruct and a
# randomly initialised Llama-3.1-8B-shaped verifier. Usage: scripts/lab/device_bench_extraction.sh GGUF_PATH
# (SmolLM2's GGUF, e.g. reassembled as ../shared/tools/device_smollm2.md says). Results: $OUT/{smol,llama8b}.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is not pip-installed
GGUF=$1
DENSE=${DENSE:-$(dirname "$GGUF")/smollm2-dense}
WORK=${WORK:-$(dirname "$GGUF")/bench_work}
export PYTHONUNBUFFERED=1
[ -f "$DENSE/config.json" ] || DENSE=$(scripts/dense_verifier.sh "$GGUF")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/smol" "$OUT/llama8b" "$WORK"
OUT=$OUT/smol python3 scripts/lab/bench_extraction.py --model-path "$DENSE" --num-workers 8 --output-dir "$WORK/smol"
OUT=$OUT/llama8b python3 scripts/lab/bench_extraction.py --random-llama8b --num-workers 8 --output-dir "$WORK/l8"
