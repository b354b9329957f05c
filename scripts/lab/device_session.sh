#!/usr/bin/env bash
# A GPU session on one GPU that trains the default recipe's SmolLM2 drafter and serves it with a real server
# (SGLang 0.5.17: ../shared/tools/sglang_device.md, issue 43; vLLM 0.26.0: ../shared/tools/vllm_device.md, issue 46),
# in the order that keeps the timed part alone:
#   1. train    scripts/gpu_smollm2.sh STAGES=train: the default recipe's SmolLM2 drafter (stages 01-04); skipped
#               when WORK_DIR/run/checkpoints/best already holds a drafter (one carried back from an earlier session)
#   2. check    SGLang only, once stage 01 is complete, beside the training: scripts/lab/device_check_sglang.sh on
#               SmolLM2's real weights and on a random DeepSeek-V3 (MEM=0.25: SGLang's share of the GPU beside it)
#   3. serve    scripts/lab/device_serve_drafter.sh (SGLang, EAGLE3 chain 3-1-4) or scripts/lab/device_serve_vllm.sh
#               (vLLM, EAGLE-3 with 3 speculative tokens, and the layer-id trap): the drafter and the same server
#               without speculation, 05_benchmark.py --mode server on MT-bench beside stage 05's offline tau
#
#   scripts/lab/device_session.sh VERIFIER DATA_DIR WORK_DIR [pack|drafter]
#     VERIFIER  SmolLM2's .gguf (converted once to WORK_DIR's smollm2-dense beside it) or its dense folder
#     DATA_DIR  made by scripts/prepare_device_data.py, plus REGEN_CACHE's smollm2_sharegpt_greedy_10k.tgz if there
#     WORK_DIR  run in WORK_DIR/run, check in WORK_DIR/check, serving in WORK_DIR/serve; progress in WORK_DIR/session.log
# Environment: SERVER [sglang] or vllm; the rest passes through to the scripts (RUNS, NEW_TOKENS, CUDA_GRAPH, ...);
# CHECK=0 leaves out step 2. With "pack" it only packs what exists so far (logs, reports, no weights) into
# $OUT/session.tgz: run it in every polling call. With "drafter" it packs the trained drafter and its manifests
# (scripts/lab/pack_drafter.sh) into $OUT/drafter.tgz.part-* pieces of 15 MiB, to carry to a later session:
# `cat drafter.tgz.part-* | tar xz -C WORK_DIR/run`.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is not pip-installed
VERIFIER=$1; DATA=$2; WORK=$3
if [ "${4:-}" = pack ]; then
  tar czf "$OUT/session.tgz" --ignore-failed-read --exclude='*.safetensors' --exclude='*.pt' -C "$WORK" session.log train.log \
    check.log serve.log serve check/out run/logs run/checkpoints/metrics.jsonl run/checkpoints/best.json \
    run/data/manifest.json 2>/dev/null
  exit 0
fi
if [ "${4:-}" = drafter ]; then
  exec scripts/lab/pack_drafter.sh "$WORK/run"
fi
mkdir -p "$WORK"
say() { echo "$(date +%T) $*" | tee -a "$WORK/session.log"; }
DENSE=$VERIFIER; [[ "$VERIFIER" == *.gguf ]] && DENSE=$(dirname "$VERIFIER")/smollm2-dense
CACHE=$DATA/smollm2_sharegpt_greedy_10k.tgz

SERVER=${SERVER:-sglang}
case $SERVER in sglang|vllm) ;; *) echo "SERVER=$SERVER: give sglang or vllm" >&2; exit 2;; esac
[ "$SERVER" = vllm ] && CHECK=0  # the capture check runs SGLang
HAVE_DRAFTER=0; [ -f "$WORK/run/checkpoints/best/config.json" ] && HAVE_DRAFTER=1

say "train: gpu_smollm2.sh STAGES=train$([ $HAVE_DRAFTER = 1 ] && echo ' (skipped: a drafter is there already)')"
( if [ $HAVE_DRAFTER = 1 ]; then  # no training; the servers still need the dense verifier
    scripts/dense_verifier.sh "$VERIFIER" > /dev/null
    exit $?
  fi
  [ -f "$CACHE" ] && export REGEN_CACHE=$CACHE; unset OUT
  STAGES=train scripts/gpu_smollm2.sh "$VERIFIER" "$DATA" "$WORK/run" > "$WORK/train.log" 2>&1
  echo "train exit $?" >> "$WORK/session.log" ) &
TRAIN=$!

( [ "${CHECK:-1}" = 0 ] && exit 0
  waited=0
  until grep -qs '"complete"' "$WORK/run/data/manifest.json" || [ $waited -ge 1200 ]; do sleep 10; waited=$((waited + 10)); done
  echo "$(date +%T) check: device_check_sglang.sh on $DENSE and dsv3 (stage 01 done after ${waited}s)" >> "$WORK/session.log"
  mkdir -p "$WORK/check/out"
  MEM=${CHECK_MEM:-0.25} OUT=$WORK/check/out WORK=$WORK/check scripts/lab/device_check_sglang.sh "$DENSE" "$DENSE" dsv3 \
    > "$WORK/check.log" 2>&1
  echo "$(date +%T) check exit $?: $(grep -E ': exit' "$WORK/check.log" | tr '\n' ' ')" >> "$WORK/session.log" ) &
CHECK=$!

wait $TRAIN; wait $CHECK
if [ ! -f "$WORK/run/checkpoints/best/config.json" ]; then say "no drafter in $WORK/run/checkpoints/best: not serving"; exit 1; fi
if [ "$SERVER" = vllm ]; then
  say "serve: device_serve_vllm.sh"
  scripts/lab/device_serve_vllm.sh "$DENSE" "$WORK/run/checkpoints/best" "$DATA/mt_bench.jsonl" "$WORK/serve" \
    "$WORK/run/hidden_states" > "$WORK/serve.log" 2>&1
else
  say "serve: device_serve_drafter.sh"
  scripts/lab/device_serve_drafter.sh "$DENSE" "$WORK/run/checkpoints/best" "$DATA/mt_bench.jsonl" "$WORK/serve" \
    > "$WORK/serve.log" 2>&1
fi
say "serve exit $?"
