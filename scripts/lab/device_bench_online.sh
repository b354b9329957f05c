#!/usr/bin/env bash
# Stage 04 --online against offline stage 04 on one GPU, side by side on the same prepared data and batches
# (scripts/lab/bench_scaling.py --online): SmolLM2-135M-Instruct's real weights and a random Llama-3.1-8B shape,
# both at stage 04's defaults (TTT 3, micro-batches of 8192 tokens, bf16).
#
#   scripts/lab/device_bench_online.sh SMOLLM2_DIR [PART ...]
#     SMOLLM2_DIR  a dense Hugging Face folder of SmolLM2-135M-Instruct (eagle3_pipeline.verifier.loading.densify_gguf
#                  writes one from the GGUF of ../shared/tools/device_smollm2.md)
#     PART         any of smollm2, smollm2_whole, llama8b, states (default: smollm2 llama8b), each a few minutes
#                  on an H200: SmolLM2 at stage 04's --min-steps (2048 samples: micro-batches of one sequence, as
#                  the first run), SmolLM2 and the 8B shape with whole 8192-token micro-batches (--min-steps 0);
#                  states times SmolLM2's states alone (scripts/lab/bench_online_states.py: forward, one micro-batch,
#                  a pass)
# Writes $OUT/online_PART.json (bench_scaling's result) and $OUT/online_PART.err (its log); the last lines
# printed are the tokens/s ratio and both peak memories.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is not pip-installed
SMOLLM2=$1; shift
PARTS=${*:-smollm2 llama8b}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/bench_online}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for part in $PARTS; do
  case $part in
    smollm2) source=(--model-path "$SMOLLM2"); samples=2048 ;;
    smollm2_whole) source=(--model-path "$SMOLLM2" --min-steps 0); samples=2048 ;;
    llama8b) source=(--random-llama 8b --min-steps 0); samples=384 ;;
    states) python3 scripts/lab/bench_online_states.py --model-path "$SMOLLM2" --device cuda > "$OUT/online_states.json" \
              2> "$OUT/online_states.err"; tail -n 3 "$OUT/online_states.json"; continue ;;
    *) echo "unknown part $part (smollm2, smollm2_whole, llama8b, states)" >&2; exit 2 ;;
  esac
  OUT= python3 scripts/lab/bench_scaling.py "${source[@]}" --gpus 1 --online --ttt-steps 3 --num-samples $samples \
    --max-tokens-per-batch 8192 --work-dir "$WORK/$part" > "$OUT/online_$part.jsonl" 2> "$OUT/online_$part.err"
  tail -n 1 "$OUT/online_$part.jsonl" > "$OUT/online_$part.json"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], json.dumps(r['stage04']['online_against_offline']), [(x['source'], x['tokens_per_s']) for x in r['stage04']['runs']], 'stage02', r['stage02']['runs'][0]['tokens_per_s'])" "$OUT/online_$part.json" "$part"
  rm -rf "${WORK:?}/$part"  # the disk: the next part's hidden states need it
done
