#!/usr/bin/env bash
# The GPU measurements of issues 17 and 18 on ONE GPU in about 28 minutes (all five parts), ordered so that no timed
# part shares the GPU with anything else:
#   1. data      gpu_drafter_quality.sh's data phase: RUN-small (SMALL prompts, the SpecForge comparison's data,
#                when PARTS has compare) and the data LANES need
#   2. profile   gpu_checks.sh: stage 04 --profile-steps on RUN-small's hidden states        (timed, alone)
#   3. regen     gpu_checks.sh: bench_regenerate.py, engines ENGINES, no 8B shape            (timed, alone)
#   3b. attention  bench_decode_attention.py --compile at SmolLM2's and Llama-8B's heads (ATTENTION_KERNELS=1): the
#                decoding attention the regeneration loop could run; then the loop engine alone with each
#                EAGLE3_DECODE_ATTENTION way of ATTENTION_WAYS (triton, the default on a GPU; matmul) at the first
#                batch size of LOOP_BATCHES, and the fastest way at the others (bench_regenerate.py --static-only,
#                same prompts as regen, into WORK_DIR/checks/regen_<way>_<batch>); the fastest way is exported for
#                the parts after it: PARTS="attention regen" checks it against generate, float32 included (timed, alone)
#   4. compare   gpu_drafter_quality.sh: our stage 04, then SpecForge's recipe, then both drafters benchmarked;
#                our training runs alone (timed); once SpecForge's starts, gpu_checks.sh's lossless checks
#                (float32 and float64, chain and tree, all of MT-bench) run beside it, so SpecForge's wall time
#                here is not its own (its steps/s in specforge.log show by how much)
#   5. lanes     LANES alone, without the comparison (instead of compare, once it is settled)
#
#   scripts/lab/gpu_session_one_gpu.sh VERIFIER DATA_DIR WORK_DIR [snapshot]
#     VERIFIER, DATA_DIR  as gpu_drafter_quality.sh's (DATA_DIR also holds REGEN_CACHE's smollm2_sharegpt_greedy_10k.tgz
#                         and SpecForge's wheel, specforge-0.2.0-py3-none-any.whl)
#     WORK_DIR            runs go to WORK_DIR/q-small, the checks to WORK_DIR/checks
# Environment: PARTS ["data profile regen attention compare"]: the parts above to run, in this order;
#   LANES [""]: recipe lanes (gpu_drafter_quality.sh's) to train and benchmark in the compare part, with SpecForge
#   beside them instead of the lossless checks (its wall time then shared with the lanes' trainings; LANES'
#   own settings, e.g. DATA_SAMPLES, DATA_EXTRA, DATA_EPOCHS, pass through the environment);
#   SMALL [500] (SpecForge then trains about 7 minutes beside the lossless checks),
#   ENGINES [generate,loop], LLAMA_PROMPTS [0] (prompts for the regen part's random Llama-3.1-8B-shaped verifier),
#   ATTENTION_WAYS ["triton matmul"], LOOP_BATCHES ["1280 1024"], ATTENTION_KERNELS [0], SPECFORGE_ARGS ["--lr 1e-4 --ttt-steps 7 --time-limit 660"], PYTHON [python3];
#   OUT: pack everything small into $OUT/quality.tgz and $OUT/checks.tgz at the end.
# Progress: WORK_DIR/session.log. With "snapshot" it only packs what exists so far (no weights, no hidden states)
# into $OUT/snapshot.tgz, and the replies each data lane has regenerated so far into $OUT/regenerated_<lane>.tgz (a
# REGEN_CACHE for the next machine): run it in every polling call, since a lent machine can be taken back
# mid-session with everything on it (it was on 2026-12-02, 17 minutes in, and again 8 minutes in).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is not pip-installed
VERIFIER=$1; DATA=$2; WORK=$3
PARTS=${PARTS:-"data profile regen attention compare"}; LANES=${LANES:-}
SMALL=${SMALL:-500}; ENGINES=${ENGINES:-generate,loop}; PY=${PYTHON:-python3}
ATTENTION_WAYS=${ATTENTION_WAYS:-"triton matmul"}; LOOP_BATCHES=${LOOP_BATCHES:-"1280 1024"}
ATTENTION_KERNELS=${ATTENTION_KERNELS:-0}; LLAMA_PROMPTS=${LLAMA_PROMPTS:-0}
SPECFORGE_ARGS=${SPECFORGE_ARGS:-"--lr 1e-4 --ttt-steps 7 --time-limit 660"}
RUN=$WORK/q; CHECKS=$WORK/checks
if [ "${4:-}" = snapshot ]; then
  for replies in "$RUN"/lanes/*/data/regenerated.jsonl; do  # what a data lane regenerated so far: a REGEN_CACHE for
    [ -f "$replies" ] || continue                            # the next machine
    lane=$(basename "$(dirname "$(dirname "$replies")")")
    tar czf "$OUT/regenerated_$lane.tgz" -C "$(dirname "$replies")" regenerated.jsonl regenerated.settings.json
  done
  tar czf "$OUT/snapshot.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='hidden_states' \
    --exclude='*.jsonl.gz' --exclude='*/data/*.jsonl' -C "$WORK" . && exit 0
  exit 1
fi
FINAL_OUT=${OUT:-}; unset OUT  # the scripts below pack into OUT on every exit: only this one, at the end
mkdir -p "$WORK" "$RUN/logs"
say() { echo "$(date +%T) $*" | tee -a "$WORK/session.log"; }
quality() {  # $1 phases of gpu_drafter_quality.sh: the comparison on RUN-small, and LANES on RUN; $2 SpecForge's
             # wheel (empty: no comparison, and no RUN-small)
  MPS=1 EXTRAS=0 LANES=$LANES SPECFORGE_BESIDE=1 SMALL=$SMALL REGEN_CACHE=$DATA/smollm2_sharegpt_greedy_10k.tgz \
    SPECFORGE=${2-$DATA/specforge-0.2.0-py3-none-any.whl} SPECFORGE_ARGS=$SPECFORGE_ARGS PHASES=$1 \
    bash scripts/lab/gpu_drafter_quality.sh "$VERIFIER" "$DATA" "$RUN"
}
checks() {  # $1 phases of gpu_checks.sh
  PYTHON=$PY PHASES=$1 DECODE_WORKERS=3 REGEN_ARGS="--llama-prompts $LLAMA_PROMPTS --engines $ENGINES --fp32-check-prompts 32" \
    bash scripts/lab/gpu_checks.sh "$VERIFIER" "$DATA" "$RUN-small" "$RUN-small/checkpoints/best" "$CHECKS"
}

part_data() {  # RUN-small only for the compare part
  say "data"; if [[ " $PARTS " == *" compare "* ]]; then quality data; else quality data ""; fi
}
part_lanes() { say "lanes alone: $LANES"; quality "lanes table" ""; }  # LANES without the SpecForge comparison
part_profile() { say "stage 04 profile"; checks profile; }
part_regen() { say "regeneration engines"; checks regen; }
part_attention() {  # the decoding attention's ways: the kernels alone (ATTENTION_KERNELS=1), then the loop engine
                   # with each way of ATTENTION_WAYS at the first of LOOP_BATCHES; the fastest way is exported as
                   # EAGLE3_DECODE_ATTENTION for the later parts (regen) and alone runs the other batch sizes
  say "decoding attention"
  if [ "$ATTENTION_KERNELS" = 1 ]; then
    { timeout 300 "$PY" scripts/lab/bench_decode_attention.py --compile --ways matmul,triton \
        --shapes 1024x384,194x1280 --triton-sweep
      timeout 300 "$PY" scripts/lab/bench_decode_attention.py --compile --ways matmul,triton,flex --heads 32 \
        --kv-heads 8 --head-dim 128 --layers 32 --shapes 128x1280 --triton-sweep; } > "$CHECKS/decode_attention.md" \
      2> "$CHECKS/decode_attention.log"
  fi
  local way batch first=${LOOP_BATCHES%% *} best rates
  for way in $ATTENTION_WAYS; do loop_run "$way" "$first"; done
  read -r best rates < <(fastest_way "$first") || return 0
  export EAGLE3_DECODE_ATTENTION=$best
  say "loop engine at batch $first, conversations/s: $rates; fastest: $best (exported for the later parts)"
  for batch in ${LOOP_BATCHES#"$first"}; do loop_run "$best" "$batch"; done
}
fastest_way() {  # $1 batch size: "WAY RATES", the way of ATTENTION_WAYS whose loop run at it was fastest
  "$PY" - "$CHECKS" "$1" $ATTENTION_WAYS <<'EOF'
import json, sys
from pathlib import Path

checks, batch, ways = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
rates = {}
for way in ways:
    try:
        report = json.loads((checks / f"regen_{way}_{batch}" / "bench_regenerate.json").read_text())
        rates[way] = report["verifier"]["loop"]["conversations_per_s"]
    except (OSError, KeyError, ValueError):  # a run that failed or was stopped
        continue
if not rates:
    sys.exit(1)
print(max(rates, key=rates.get), ", ".join(f"{way} {rate}" for way, rate in rates.items()))
EOF
}
loop_run() {  # $1 way, $2 batch size: the loop engine alone (bench_regenerate.py --static-only, regen's prompts)
  say "loop engine, $1 attention, batch $2"
  EAGLE3_DECODE_ATTENTION=$1 timeout 420 "$PY" scripts/lab/bench_regenerate.py --model-path "$VERIFIER" \
    --data "$DATA/sharegpt.json" --out "$CHECKS/regen_$1_$2" --static-only --engines loop \
    --batch-size "$2" > "$CHECKS/regen_$1_$2.log" 2>&1
}
part_compare() {
  if [ -n "$LANES" ]; then  # SpecForge beside the lanes; their benchmarks after
    say "comparison beside lanes: $LANES"; quality "compare lanes table"; return
  fi
  say "comparison"; quality "compare lanes" & local compare=$!
  until grep -q "SpecForge's recipe on" "$RUN/logs/quality.log" 2> /dev/null || ! kill -0 "$compare" 2> /dev/null; do
    sleep 5
  done
  say "lossless checks"; checks lossless
  wait "$compare"
}
mkdir -p "$CHECKS"
for part in $PARTS; do
  declare -F "part_$part" > /dev/null || { say "no part called $part (PARTS: data profile regen attention compare lanes)"; exit 2; }
done
for part in $PARTS; do "part_$part"; done
say "session done"
if [ -n "$FINAL_OUT" ]; then
  OUT=$FINAL_OUT PHASES=pack bash scripts/lab/gpu_drafter_quality.sh "$VERIFIER" "$DATA" "$RUN"
  tar czf "$FINAL_OUT/checks.tgz" --exclude='*.safetensors' --exclude='*.pt' -C "$WORK" checks session.log
fi
