#!/usr/bin/env bash
# Stage 02's SGLang backend against its hf backend on a real SGLang (scripts/check_sglang_capture.py: the same
# random-token samples through both, every stored file compared by cosine), on small random verifiers written by
# scripts/lab/make_random_verifier.py: a Llama (SGLang's LlamaModel) and a DeepSeek-V3 (MLA and MoE, Kimi-K2.5's text
# model, through SGLang's DeepseekV2Model), or on any Hugging Face folder given as a part. The dsv3 part is judged
# with --reference float32 (each bf16 run against a float32 hf run: an MoE's bf16 noise flips expert choices, see
# the check's docstring); the others by cosine > 0.999 between the two backends.
#
#   scripts/lab/device_check_sglang.sh TOKENIZER_DIR [PART ...]
#     TOKENIZER_DIR  a folder whose tokenizer files the random verifiers copy (e.g. SmolLM2-135M-Instruct's)
#     PART           llama, dsv3 (random verifiers; default: both) or the path of a model folder
# Environment: OUT, WORK, MEM (below). SGLang's site folder (../shared/tools/sglang_device.md: /tmp/site, with
# the transformers SGLang 0.5.17 needs)
# comes first on PYTHONPATH, for every process of the check. The engine flags avoid the kernels the slim wheels
# leave out. Writes $OUT/sglang_NAME.json (the check's summary) and $OUT/sglang_NAME.log (its output, tail).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is not pip-installed
TOKENIZER=$1; shift
PARTS=${*:-llama dsv3}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/check_sglang}; mkdir -p "$WORK"
SITE=${SGLANG_SITE:-/tmp/site}
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONUNBUFFERED=1
ENGINE=(--attention-backend triton --sampling-backend pytorch --sglang-arg grammar_backend=none
        --sglang-arg mm_feature_transport=cpu)
# MEM: stage 02's --gpu-memory-utilization (SGLang's static share), for a check beside other GPU work, e.g. 0.25
[ -n "${MEM:-}" ] && ENGINE+=(--gpu-memory-utilization "$MEM")
python3 -c "import importlib.metadata as m; print('sglang', m.version('sglang'), 'transformers', m.version('transformers'))"
for part in $PARTS; do
  REFERENCE=()
  case $part in
    llama|dsv3) name=$part; model=$WORK/$part
       [ "$part" = dsv3 ] && REFERENCE=(--reference float32)
       arch=$([ "$part" = dsv3 ] && echo deepseek_v3 || echo llama)
       [ -d "$model" ] || python3 scripts/lab/make_random_verifier.py --arch "$arch" --tokenizer-from "$TOKENIZER" \
         --out "$model" ;;
    *) [ -d "$part" ] || { echo "unknown part $part (llama, dsv3 or a model folder)" >&2; exit 2; }
       name=$(basename "$part"); model=$part ;;
  esac
  OUT= python3 scripts/check_sglang_capture.py --model-path "$model" --tp-size 1 --num-samples 32 \
    --work-dir "$WORK/$name" "${ENGINE[@]}" ${REFERENCE[@]+"${REFERENCE[@]}"} > "$WORK/$name.log" 2>&1
  echo "$name: exit $?"
  tail -c 60000 "$WORK/$name.log" > "$OUT/sglang_$name.log"
  grep '^{' "$WORK/$name.log" | tail -n 1 > "$OUT/sglang_$name.json"
  grep -E '^worst file' "$WORK/$name.log" || tail -n 5 "$WORK/$name.log"
done
