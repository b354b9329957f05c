#!/usr/bin/env bash
# Drafter quality on one GPU, measured as the field measures it and side by side on the same data (issue 17), with
# the tau cost of FP8 aux layers + top-k targets (issue 21) on the same run:
#   1. data     stages 01-03 on SAMPLES regenerated ShareGPT prompts (RUN) and on SMALL of them (RUN-small), and
#               for each data lane (sampled) in RUN-<lane>; the same prepared data extracted again for
#               each storage-format lane (RUN-<lane>). Extractions run alone.
#   2. compare  the timed part, alone on the GPU: our stage 04 on RUN-small, then SpecForge 0.2.0's recipe
#               (scripts/compare_recipes.py) on the same samples and epochs. SpecForge trains one sequence a step,
#               so equal tokens on the full run would not fit one session.
#   3. lanes    side by side, each lane a training on RUN followed by its benchmarks (acceptance only, no timing);
#               LANES picks them (unset: "default epochs2 ttt7"). At 4,096-token steps and TTT 7 a lane
#               trains about 10 minutes beside one to three others on an H200; six side by side share the GPU
#               at about 75K tokens/s in all (3 steps/s each), so plan three or four lanes a session.
#               Recipe lanes train on RUN; a name joins changes with "_" (ttt7_epochs2: both):
#                 default    STEP_TOKENS-token steps, --ttt-positions shifted (today's recipe)
#                 fixed      the same with --ttt-positions fixed (the old rule: the A/B of the TTT positions)
#                 steps      LEVER_STEP_TOKENS-token steps (more optimizer steps: the recipe lever)
#                 epochs     twice EPOCHS (epochsX: X times)
#                 lrX        X times LR (on SmolLM2 lr10 lowered chain tau 21 %, while on stories260K, a 9x
#                            narrower drafter, it raised it 23 %: results/2026-12-01-smollm2-h200-lr-formats.md)
#                 init       --init-from-verifier-layer (the drafter's layer starts as the verifier's last)
#                 tttN       --ttt-steps N instead of stage 04's 3 (ttt7: the EAGLE-3 recipe's depth, the default
#                            before 2026-12-02; a step costs about N/3 of a TTT-3 step. On SmolLM2 TTT 3 gave chain
#                            tau +5 % over TTT 7, and +15 % with twice the epochs: results/2026-12-02-smollm2-h200-ttt.md)
#                 lk         --loss lk (-log of the acceptance probability, arXiv 2602.23881), also
#                            benchmarked at T=1, where the paper reports its gains
#               Data and storage-format lanes (their name first; recipe changes may follow: data_epochs2):
#                 sampled    replies regenerated at T=0.8 (RUN-sampled; REGEN_CACHE does not fit, so stage 01
#                            regenerates them all), also benchmarked at T=1
#                 mixed      the greedy reply and one sampled at T=0.8 a prompt (--replies-per-prompt 2 --greedy-first-reply,
#                            RUN-mixed; REGEN_CACHE does not fit): on stories260K T=0 -2 %, T=1 +14.5 %
#                            (results/2026-12-03-stories260k-mixed-replies.md)
#                 data       DATA_SAMPLES prompts for DATA_EPOCHS epochs (RUN-data; REGEN_CACHE's replies for
#                            the prompts it holds, the rest regenerated; on stories260K 3x the prompts raised
#                            chain tau 24 %): at the defaults about as many optimizer steps as the default lane,
#                            over 1.7x the distinct replies
#                 long       replies regenerated up to LONG_TOKENS new tokens instead of 256 (RUN-long; REGEN_CACHE
#                            does not fit, so stage 01 regenerates them all): the drafter then trains on the later
#                            parts of replies, which a benchmark at the field's 2,048 tokens a turn decodes (on
#                            SmolLM2 those parts are mostly loops: for verifiers whose replies end)
#                 turns2     SAMPLES conversations with their second user turns (--max-turns 2, both replies regenerated:
#                            REGEN_CACHE holds first turns only) from DATA_DIR/sharegpt_turns2.json (prepare_device_data.py
#                            --turns 2 --prompts-only, which keeps a placeholder reply between the turns; a file made
#                            before it did answers both turns with one reply, as 2026-12-02's run trained), RUN's
#                            held-out prompts excluded: MT-bench's second turns are its weakest
#                 all        every prompt there is: DATA_SAMPLES conversations with their first DATA_TURNS user turns
#                            (DATA_DIR/sharegpt_turns<DATA_TURNS>.json, prepare_device_data.py --turns DATA_TURNS
#                            --prompts-only; sharegpt.json at 1) and DATA_EXTRA beside them, for DATA_EPOCHS epochs
#                            (RUN-all), RUN's held-out prompts excluded: the data and turns2 levers together
#                 bf16final  FORMAT_STEP_TOKENS-token steps on RUN: the storage-format lanes' baseline
#                 fp8topk, fp8final, bf16topk
#                            FORMAT_STEP_TOKENS-token steps on RUN-<lane>: the same prepared data extracted
#                            with FP8 aux and/or top-k targets (in the data phase, each extraction alone)
#                 auxA-B-C   STEP_TOKENS-token steps on RUN-<lane>: the same prepared data extracted with
#                            --aux-layers A,B,C instead of the default 2,L//2,L-3 (aux2-15-29 on SmolLM2: the high
#                            layer moved from the input of layer 27 to that of the last one, 29); the drafter's
#                            config names them, so stage 05 and the servers capture the same layers
#               and the small run's two drafters benchmarked (compare_recipes.py --parts bench table).
#               Every lane: stage 05 --tau-only at chain 3/1/4 (what SGLang serves), T=0, on all 80 MT-bench
#               questions (both turns) and HELDOUT stratified held-out prompts, and the teacher-forced agreement
#               (--mode eval); every lane but the storage-format ones also chain at T=1 on MT-bench. The
#               default lane also (unless EXTRAS=0): chain and tree in float32 and in float64 on all of
#               MT-bench (every turn checked against the verifier's greedy choice in the same precision: lossless).
#   4. table    scripts/quality_table.py -> RUN/quality.md
# Each stage-05 run writes its own output folder (a folder has one writer at a time). With MPS=1 the CUDA MPS daemon
# is started first (when it starts and works), so the side-by-side processes run their kernels concurrently.
#
#   scripts/gpu_drafter_quality.sh VERIFIER DATA_DIR RUN_DIR
#     VERIFIER  dense SmolLM2 folder (../shared/tools/device_smollm2.md)
#     DATA_DIR  scripts/prepare_device_data.py DATA --conversations 20000 --prompts-only (sharegpt.json,
#               mt_bench.jsonl); with REGEN_CACHE=FILE (../shared/cache/smollm2_sharegpt_greedy_10k.tgz) stage 01
#               reuses the greedy replies of every prompt that SAMPLES=10000 takes from that file
# Environment (defaults in brackets):
#   SAMPLES [10000]          prompts of RUN
#   SMALL [800]              prompts of RUN-small, the SpecForge comparison
#   SMALL_EVAL_RATIO [0.1]   RUN-small's held-out share (its held-out set in the comparison: 80 prompts at 800;
#                            RUN's is 0.02)
#   SMALL_STEP_TOKENS [2048] our tokens a step in the comparison (at least the 2,048-token --max-seq-len: stage
#                            04 refuses a step shorter than the longest sample): 664 steps in 76 s at 800
#                            prompts on 2026-12-02, each a fraction of the time of SpecForge's 2,980
#                            one-sequence steps
#   SMALL_CANDIDATE_FLAGS [] stage-04 flags of a candidate recipe for the comparison, e.g. "--lr 3e-3": then a
#                            second drafter of ours trains on RUN-small (alone, after the first) and goes through
#                            the same benchmarks against SpecForge's (RUN-small/compare_candidate)
#   DATA_SAMPLES [17000]     prompts of the data lane (about every first turn of the device data)
#   DATA_EPOCHS [2]          epochs of the data lane (and of the all lane)
#   DATA_TURNS [2]           user turns a conversation of the all lane keeps
#   DATA_EXTRA []            more chat files in DATA_DIR for the data lane, beside sharegpt.json, e.g. gsm8k_train.jsonl
#                            (../shared/data/, 7,473 prompts: raise DATA_SAMPLES with it); RUN's held-out prompts are
#                            excluded from the data lane's data (stage 01 --exclude-prompts)
#   EPOCHS [4], LR [1e-3], STEP_TOKENS [4096]   the recipe of every lane
#   TRAIN_FLAGS []           more stage-04 flags for every training, the lanes' common recipe (e.g. "--ttt-steps 3":
#                            each lane is then one change from it)
#   LEVER_STEP_TOKENS [2048] the steps lane's tokens a step
#   FORMAT_STEP_TOKENS [16384]  the storage-format lanes' (as the bf16 and fp8topk drafters of 2026-12-01)
#   LANES, TOPK [64], HELDOUT [60] (held-out prompts decoded), NEW_TOKENS [128]
#   FIELD_TOKENS [NEW_TOKENS]  new tokens a turn of each lane's MT-bench run at T=0 instead of NEW_TOKENS, e.g. 2048 as
#                            SpecForge's benchmarks decode (its report's tau along the reply still gives the
#                            0-127 window, the NEW_TOKENS=128 figure: docs/benchmarking.md, "Reply length"); on
#                            SmolLM2 most replies then loop to the budget (scripts/reply_lengths.py), so read it
#                            with the windows' repetition
#   LONG_TOKENS [1024]       the long lane's longest reply
#   WORKERS [3]              data workers of each side-by-side training
#   DECODE_WORKERS [3]       processes of each stage-05 decoding run (05 --decode-workers; the float32 checks
#                            too): one process decoded about 0.3 MT-bench turns/s on 2026-12-02, so its 160 turns
#                            took over 8 minutes. A lane's benchmarks then run up to 10 processes at once (the
#                            default lane's lossless checks 12 more, the comparison's 14): keep the sum under
#                            CUDA MPS's limit of 48 client processes a GPU
#   SPECFORGE []             its wheel or a folder holding the package; empty: no comparison
#   SPECFORGE_ARGS []        more flags for its recipe, e.g. "--lr 1e-4 --ttt-steps 7 --time-limit 720": SpecForge's own
#                            learning rate and TTT depth (without them it takes our run's, 1e-3 and 3); at 800
#                            prompts it needs about 600 s alone on an H200 (5 steps/s on 2026-12-02)
#   SPECFORGE_BESIDE [0]     1: SpecForge trains beside the lanes (after our small run, which trains alone), so
#                            its wall time is not its own: its steps/s in specforge.log say by how much
#   PHASES ["data compare lanes table"]; "pack" alone packs what exists
#   MPS, EXTRAS [1], OUT     OUT: pack logs, manifests, metrics and reports into $OUT/quality.tgz, and the replies
#                            the data and sampled lanes regenerated into $OUT/regenerated_<lane>.tgz (a REGEN_CACHE:
#                            the data lane's holds REGEN_CACHE's replies too)
# Progress: RUN_DIR/logs/quality.log.
# Disk: SmolLM2's hidden states take 4,608 bytes a token (bf16 aux, final targets): RUN 17 GB, the mixed lane's
# about 34 GB, the all lane's 47 GB at DATA_SAMPLES=25000 and DATA_TURNS=2. The H200 machine's 64 GB holds RUN and
# one of those two (on 2026-12-03 the all lane's stage 02 refused to start with RUN and 47.1 GB free).
# Measured on one H200 with REGEN_CACHE (2026-12-01, SMALL 1500, STEP_TOKENS 16384, four lanes): data 2.2 min,
# compare 7.8 min (SpecForge stopped by its 400 s limit at 54 % of its steps), lanes 15.3 min (the 4096-token
# training 10 min of it); results in docs/results/2026-12-01-smollm2-h200.md. Second run (EXTRAS=0, no SpecForge,
# six lanes, one stopped early): data 2.3 min (three extractions), lanes 19.3 min (the 4096-token trainings 10.7
# min); results in docs/results/2026-12-01-smollm2-h200-lr-formats.md. Third (2026-12-02, EXTRAS=0, LANES="default ttt3
# ttt3_epochs2 data_ttt3", TTT 7 the default then): data 6.3 min (5,411 prompts of the data lane regenerated), lanes
# 17.5 min (ttt3_epochs2 trained 9.9 min); results in docs/results/2026-12-02-smollm2-h200-ttt.md. Fourth (2026-12-02,
# LANES="", SAMPLES=1000, the comparison alone): data 2 min, ours 1.5 min, SpecForge 8.4 min (stopped by a 480 s
# limit at 80 %), its benchmarks over 7 min (the MT-bench runs, 0.3 turns/s each, did not finish in the session):
# docs/results/2026-12-02-h200-regen-specforge.md. Fifth (2026-12-02, LANES="default steps mlp", SMALL=500,
# SPECFORGE_BESIDE=1): data 1.9 min, our small run 40 s alone, then SpecForge (395 s, 4.3 steps/s) beside the three
# lanes (4-epoch trainings 157 s, the 2,048-token one 391 s) and all the benchmarks: 11.3 min from the end of our
# small run to the last benchmark: docs/results/2026-12-02-h200-specforge-mlp-steps-pad.md. Sixth (2026-12-02,
# LANES="default epochs3 data", DATA_EXTRA=gsm8k_train.jsonl DATA_SAMPLES=17500 DATA_EPOCHS=4, SMALL=500,
# SMALL_CANDIDATE_FLAGS="--min-steps 2000", SPECFORGE_BESIDE=1): data 6.5 min (the data lane's stage 01 194 s), our
# two small runs 48 s and 81 s alone, then SpecForge (445 s) beside the lanes (epochs3 trained 733 s): 24.7 min in
# all: docs/results/2026-12-02-h200-min-steps-epochs-data.md. Seventh (2026-12-03, through gpu_session_one_gpu.sh, LANES="all"
# alone after the disk stopped "default mixed all", DATA_SAMPLES=25000 DATA_TURNS=2 DATA_EPOCHS=3 with GSM8K): the all
# lane's stages 01-02 331 s and 52 s, its training 304 s alone, its benchmarks 2.5 min:
# docs/results/2026-12-03-h200-all-lane.md. Eighth (2026-12-03, through gpu_session_one_gpu.sh, LANES="default lk init
# aux2-15-29 aux8-22-29" DECODE_WORKERS=2): data 2.7 min (two aux extractions 31-38 s each), five trainings side by
# side 268-274 s, their 20 benchmarks 8 min at once; then init_epochs2 alone 285 s and 2.3 min of benchmarks:
# docs/results/2026-12-03-h200-lk-init-aux.md.
set -euo pipefail
cd "$(dirname "$0")/.."
VERIFIER=$1; DATA=$2; RUN=$3; SMALL_RUN=$RUN-small
SAMPLES=${SAMPLES:-10000}; SMALL=${SMALL:-800}; EPOCHS=${EPOCHS:-4}; LR=${LR:-1e-3}; DATA_SAMPLES=${DATA_SAMPLES:-17000}; DATA_EPOCHS=${DATA_EPOCHS:-2}; DATA_EXTRA=${DATA_EXTRA:-}; DATA_TURNS=${DATA_TURNS:-2}; SMALL_STEP_TOKENS=${SMALL_STEP_TOKENS:-2048}
SMALL_EVAL_RATIO=${SMALL_EVAL_RATIO:-0.1}; SMALL_CANDIDATE_FLAGS=${SMALL_CANDIDATE_FLAGS:-}
TRAIN_FLAGS=${TRAIN_FLAGS:-}
STEP_TOKENS=${STEP_TOKENS:-4096}; LEVER_STEP_TOKENS=${LEVER_STEP_TOKENS:-2048}; TOPK=${TOPK:-64}
FORMAT_STEP_TOKENS=${FORMAT_STEP_TOKENS:-16384}; LANES=${LANES-"default epochs2 ttt7"}; EXTRAS=${EXTRAS:-1}
HELDOUT=${HELDOUT:-60}; NEW_TOKENS=${NEW_TOKENS:-128}; FIELD_TOKENS=${FIELD_TOKENS:-$NEW_TOKENS}; LONG_TOKENS=${LONG_TOKENS:-1024}; WORKERS=${WORKERS:-3}; DECODE_WORKERS=${DECODE_WORKERS:-3}
SPECFORGE=${SPECFORGE:-}; SPECFORGE_ARGS=${SPECFORGE_ARGS:-}; PHASES=${PHASES:-"data compare lanes table"}
export PYTHONUNBUFFERED=1
mkdir -p "$RUN/logs"
LOG=$RUN/logs/quality.log
say() { echo "$(date +%T) $*" | tee -a "$LOG"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }

pack() {  # the small files of every run: logs, manifests, metrics, curves, reports (no hidden states, no weights)
  [ -n "${OUT:-}" ] || return 0
  local parent; parent=$(dirname "$RUN")
  (cd "$parent" && find "$(basename "$RUN")" "$(basename "$RUN")"-* -maxdepth 4 \
     -type f \( -path '*/logs/*' -o -path '*/bench_*' -o -path '*/compare/*' -o -path '*/compare_*/*' -o -name quality.md \
     -o -name manifest.json -o -name metrics.jsonl -o -name '*.png' -o -name 'specforge_results.json' \) \
     -not -path '*/hidden_states/*/*' 2>/dev/null | tar czf "$OUT/quality.tgz" -C "$parent" -T - ) || true
  local lane
  for lane in data sampled mixed long turns2 all; do  # the replies regenerated here: a REGEN_CACHE that saves the next machine the time
    [ -f "$RUN-$lane/data/regenerated.jsonl" ] && (cd "$RUN-$lane/data" && \
      tar czf "$OUT/regenerated_$lane.tgz" regenerated.jsonl regenerated.settings.json) || true
  done
}
trap pack EXIT
if [ "$PHASES" = pack ]; then exit 0; fi

if [ "${MPS:-0}" = 1 ] && command -v nvidia-cuda-mps-control > /dev/null; then
  nvidia-cuda-mps-control -d || true
  if timeout 120 python3 -c "import torch; torch.ones(1, device='cuda').sum().item()"; then
    say "CUDA MPS on"
  else
    echo quit | nvidia-cuda-mps-control || true; say "CUDA MPS failed to serve a process: off"
  fi
fi

prepare() {  # $1 run dir, $2 samples[, $3 turns, $4 more stage-01 flags]: stages 01-03, the replies from
             # REGEN_CACHE when its settings fit; EVAL_RATIO [0.02] the held-out share
  if [ -n "${REGEN_CACHE:-}" ] && [ ! -f "$1/data/regenerated.jsonl" ]; then
    mkdir -p "$1/data" && tar xzf "$REGEN_CACHE" -C "$1/data"
  fi
  pipeline() {
    python3 run_pipeline.py --run-dir "$1" --model-path "$VERIFIER" --dataset "${DATASET:-$DATA/sharegpt.json}" \
      --regenerate --max-turns "${3:-1}" --num-samples "$2" --eval-ratio "${EVAL_RATIO:-0.02}" --max-seq-len 2048 \
      --draft-vocab-size 32000 --skip 04 --skip 05 --stage-args 01 "--batch-size 1024 --max-new-tokens 256 ${4:-}" \
      --stage-args 02 "--batch-size 64 --num-workers 8"
  }
  pipeline "$@" && return 0
  # Stage 01 refuses a cache made with other settings (another verifier path or tokenizer, another temperature):
  # regenerate instead.
  grep -q "holds responses generated with other settings" "$1/logs/01_prepare_data.log" 2>/dev/null || return 1
  say "REGEN_CACHE does not fit $1 (see $1/logs/01_prepare_data.log): regenerating the replies"
  rm -f "$1/data/regenerated.jsonl" "$1/data/regenerated.settings.json"
  pipeline "$@"
}
train04() {  # $1 run dir, $2 output folder, $3 tokens a step, $4 data workers, then extra flags
  local run=$1 out=$2 tokens=$3 workers=$4; shift 4
  say "train $out ($tokens tokens a step $TRAIN_FLAGS $*)"
  # shellcheck disable=SC2086
  python3 04_train.py --run-dir "$run" --model-path "$VERIFIER" --output-dir "$out" --epochs "$EPOCHS" \
    --max-seq-len 2048 --max-tokens-per-batch "$tokens" --num-workers "$workers" --lr "$LR" --eval-interval 500 \
    --save-interval 100000 $TRAIN_FLAGS "$@" > "$run/logs/train_$(basename "$out").log" 2>&1 \
    || { say "FAILED: train $out"; return 1; }
  say "trained $out: $(python3 -c "import json; print(json.load(open('$out/manifest.json'))['wall_time_s'])") s"
}
bench() {  # $1 run dir, $2 report folder name, $3 drafter folder, then stage 05 flags
  local run=$1 name=$2 drafter=$3; shift 3
  python3 05_benchmark.py --run-dir "$run" --model-path "$VERIFIER" --draft-model-path "$drafter" \
    --output-dir "$RUN/bench_$name" --max-new-tokens "$NEW_TOKENS" "$@" \
    > "$RUN/logs/bench_$name.log" 2>&1 || say "FAILED: bench $name $*"
  say "bench $name done"
}
tau=(--tau-only --decode-workers "$DECODE_WORKERS")  # acceptance only, so decoding may be spread over processes
chain=("${tau[@]}" --num-steps 3 --topk 1 --num-draft-tokens 4)
tree=("${tau[@]}" --num-steps 3 --topk 8)
suite() {  # $1 run dir, $2 lane, $3 drafter: teacher-forced agreement, chain T=0 on MT-bench and held-out, at once
  local pids=()
  bench "$1" "$2_eval" "$3" --mode eval --num-steps 7 & pids+=($!)
  bench "$1" "$2_mtbench" "$3" "${chain[@]}" --temperature 0 --prompts "$DATA/mt_bench.jsonl" \
    --max-new-tokens "$FIELD_TOKENS" & pids+=($!)
  bench "$1" "$2_heldout" "$3" "${chain[@]}" --temperature 0 --prompts "$RUN/data/eval_data.jsonl" \
    --num-prompts "$HELDOUT" & pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid" || true; done
}
lane() {  # $1 lane, $2 run dir, $3 tokens a step, then extra stage-04 flags: train, then benchmark
  local name=$1 run=$2 tokens=$3; shift 3
  train04 "$run" "$run/checkpoints_$name" "$tokens" "$WORKERS" "$@" || return 0
  suite "$run" "$name" "$run/checkpoints_$name/best" &
  [ "$name" = default ] && [ "$EXTRAS" = 1 ] && default_extras "$run/checkpoints_$name/best"
  case ${name%%_*} in *final|*topk) ;; *) bench "$run" "${name}_t1" "$run/checkpoints_$name/best" "${chain[@]}" \
    --temperature 1 --prompts "$DATA/mt_bench.jsonl" ;; esac
  wait
}
data_flags() {  # $1 lane: its turns, samples and stage-01 flags, for a lane trained on data of its own
  case $1 in
    sampled) echo "1 $SAMPLES --temperature 0.8" ;;   # replies sampled as sampled serving will meet them
    mixed) echo "1 $SAMPLES --replies-per-prompt 2 --temperature 0.8 --greedy-first-reply" ;;
    long) echo "1 $SAMPLES --max-new-tokens $LONG_TOKENS" ;;
    # RUN's held-out prompts stay out of its training, whatever the shuffle of more data does
    turns2) echo "2 $SAMPLES --exclude-prompts $RUN/data/eval_data.jsonl" ;;
    data) echo "1 $DATA_SAMPLES --exclude-prompts $RUN/data/eval_data.jsonl$(extra_datasets)" ;;
    all) echo "$DATA_TURNS $DATA_SAMPLES --exclude-prompts $RUN/data/eval_data.jsonl$(extra_datasets)" ;;
  esac
}
extra_datasets() {  # DATA_EXTRA as stage-01 flags
  local file
  for file in $DATA_EXTRA; do printf ' --dataset %s' "$DATA/$file"; done
}
lane_dataset() {  # $1 data lane: the ShareGPT file it reads
  case $1 in
    turns2) echo "$DATA/sharegpt_turns2.json" ;;
    all) if [ "$DATA_TURNS" = 1 ]; then echo "$DATA/sharegpt.json"; else echo "$DATA/sharegpt_turns$DATA_TURNS.json"; fi ;;
    *) echo "$DATA/sharegpt.json" ;;
  esac
}
format_flags() {  # $1 lane: its stage-02 flags, empty for a lane that trains on RUN's own hidden states
  case $1 in
    fp8topk) echo "--aux-dtype float8_e4m3 --targets topk --target-topk $TOPK" ;;
    fp8final) echo "--aux-dtype float8_e4m3" ;;
    bf16topk) echo "--targets topk --target-topk $TOPK" ;;
    aux*-*-*) echo "--aux-layers $(tr - , <<< "${1#aux}")" ;;
  esac
}
PY=python3; MODEL=$VERIFIER  # for recipe_lanes.sh
source scripts/recipe_lanes.sh  # recipe_flags: a recipe lane's stage-04 flags from its name (steps: start_lane)
start_lane() {  # $1 lane: train it on its data (the name's first part, for a data or storage-format lane), then
                # benchmark it
  local base=${1%%_*} recipe=$1 run=$RUN tokens=$STEP_TOKENS flags more=""
  case $base in
    bf16final|fp8topk|fp8final|bf16topk|sampled|mixed|long|data|turns2|all|aux*-*-*)
      recipe=${1#"$base"}; recipe=${recipe#_}; recipe=${recipe:-default} ;;
  esac
  case $base in
    bf16final) tokens=$FORMAT_STEP_TOKENS ;;
    fp8topk|fp8final|bf16topk) run=$RUN-$base; tokens=$FORMAT_STEP_TOKENS ;;
    sampled|mixed|long|turns2|aux*-*-*) run=$RUN-$base ;;
    data|all) run=$RUN-$base; more="--epochs $DATA_EPOCHS" ;;
  esac
  flags=$(recipe_flags "$recipe") || { say "FAILED: no lane called $1"; return 0; }
  # a refused or failed stage 02 leaves the folder behind (2026-12-03: the all lane's did not fit the disk)
  extracted "$run" || { say "FAILED: lane $1 has no finished stage 02 in $run (see $run/logs)"; return 0; }
  [[ "_${recipe}_" == *_steps_* ]] && tokens=$LEVER_STEP_TOKENS
  # shellcheck disable=SC2086
  lane "$1" "$run" "$tokens" $more $flags
}
extracted() {  # $1 run dir: its stage 02 finished
  python3 -c "import json, sys; sys.exit(json.load(open(sys.argv[1])).get('status') != 'complete')" \
    "$1/hidden_states/manifest.json" 2> /dev/null
}
bases() {  # the first part of every lane's name, once each: the data and storage formats the lanes need
  local name
  for name in $LANES; do echo "${name%%_*}"; done | sort -u
}
default_extras() {  # $1 drafter: lossless checks in float32 and float64, chain and tree
  local pids=()
  bench "$RUN" default_fp32_chain "$1" "${chain[@]}" --temperature 0 --dtype float32 \
    --prompts "$DATA/mt_bench.jsonl" & pids+=($!)
  bench "$RUN" default_fp32_tree "$1" "${tree[@]}" --temperature 0 --dtype float32 \
    --prompts "$DATA/mt_bench.jsonl" & pids+=($!)
  # float64: a float32 near tie (2.1e-5 apart on 2026-12-01) can flip either way; in float64 none should
  bench "$RUN" default_fp64_chain "$1" "${chain[@]}" --temperature 0 --dtype float64 \
    --prompts "$DATA/mt_bench.jsonl" & pids+=($!)
  bench "$RUN" default_fp64_tree "$1" "${tree[@]}" --temperature 0 --dtype float64 \
    --prompts "$DATA/mt_bench.jsonl" & pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid" || true; done
}

if has data; then
  if [ -n "$LANES" ]; then  # the comparison alone (LANES="") needs only RUN-small
    say "stages 01-03: $SAMPLES samples in $RUN"; prepare "$RUN" "$SAMPLES" > "$RUN/logs/prepare.log" 2>&1
  fi
  for name in $(bases); do
    read -r turns samples more <<< "$(data_flags "$name")"; [ -n "$turns" ] || continue
    mkdir -p "$RUN-$name/logs"; say "stages 01-03 in $RUN-$name: $samples samples, --max-turns $turns $more"
    # shellcheck disable=SC2086
    DATASET=$(lane_dataset "$name") prepare "$RUN-$name" "$samples" "$turns" "$more" > "$RUN-$name/logs/prepare.log" 2>&1 \
      || say "FAILED: data $name"
  done
  for name in $(bases); do
    flags=$(format_flags "$name"); [ -n "$flags" ] || continue
    mkdir -p "$RUN-$name/logs"; rm -rf "$RUN-$name/data" "$RUN-$name/vocab"
    cp -r "$RUN/data" "$RUN-$name/data"; cp -r "$RUN/vocab" "$RUN-$name/vocab"
    say "stage 02 in $RUN-$name: $flags"
    # shellcheck disable=SC2086
    python3 02_extract_hidden_states.py --run-dir "$RUN-$name" --model-path "$VERIFIER" --max-seq-len 2048 \
      --batch-size 64 --num-workers 8 $flags > "$RUN-$name/logs/extract.log" 2>&1 || say "FAILED: stage 02 $RUN-$name"
  done
  if [ -n "$SPECFORGE" ]; then
    mkdir -p "$SMALL_RUN/logs"
    say "stages 01-03: $SMALL samples in $SMALL_RUN"; EVAL_RATIO=$SMALL_EVAL_RATIO prepare "$SMALL_RUN" "$SMALL" \
      > "$SMALL_RUN/logs/prepare.log" 2>&1
  fi
  say "data done"
fi
if [ -n "$SPECFORGE" ]; then
  if [[ "$SPECFORGE" == *.whl ]]; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/specforge_site "$SPECFORGE"
    SPECFORGE=/tmp/specforge_site
  fi
  export PYTHONPATH=$SPECFORGE${PYTHONPATH:+:$PYTHONPATH}
fi
specforge_train() {  # SpecForge's recipe on RUN-small's samples and epochs
  say "SpecForge's recipe on $SMALL_RUN"
  python3 scripts/compare_recipes.py --run-dir "$SMALL_RUN" --model-path "$VERIFIER" --parts train \
    --recipe-args "$SPECFORGE_ARGS" > "$SMALL_RUN/logs/specforge.log" 2>&1 || say "FAILED: SpecForge's recipe"
  say "SpecForge done"
}
compare_bench() {  # both small drafters through the same stage-05 runs, and their table (and the candidate's)
  [ -d "$SMALL_RUN/specforge/best" ] || return 0
  local ours=checkpoints pids=()
  [ -n "$SMALL_CANDIDATE_FLAGS" ] && ours="checkpoints checkpoints_candidate"
  for ours in $ours; do
    python3 scripts/compare_recipes.py --run-dir "$SMALL_RUN" --model-path "$VERIFIER" --parts bench table \
      --ours "$SMALL_RUN/$ours" --output-dir "$SMALL_RUN/compare${ours#checkpoints}" --mt-bench "$DATA/mt_bench.jsonl" \
      --max-new-tokens "$NEW_TOKENS" --jobs 6 --decode-workers "$DECODE_WORKERS" \
      > "$SMALL_RUN/logs/compare${ours#checkpoints}.log" 2>&1 || say "FAILED: compare bench ($ours)" & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || true; done
}
beside=""  # with SPECFORGE_BESIDE=1, SpecForge trains (then both drafters are benchmarked) beside the lanes
if has compare && [ -n "$SPECFORGE" ]; then
  train04 "$SMALL_RUN" "$SMALL_RUN/checkpoints" "$SMALL_STEP_TOKENS" 8 || true
  # shellcheck disable=SC2086
  [ -n "$SMALL_CANDIDATE_FLAGS" ] && { train04 "$SMALL_RUN" "$SMALL_RUN/checkpoints_candidate" "$SMALL_STEP_TOKENS" 8 \
    $SMALL_CANDIDATE_FLAGS || true; }
  if [ "${SPECFORGE_BESIDE:-0}" = 1 ] && has lanes; then
    (specforge_train; compare_bench) & beside=$!
  else
    specforge_train
  fi
fi
if has lanes; then
  pids=()
  for name in $LANES; do start_lane "$name" & pids+=($!); done
  if [ -n "$beside" ]; then pids+=("$beside"); else compare_bench & pids+=($!); fi
  for pid in "${pids[@]}"; do wait "$pid" || true; done
  say "lanes done"
fi
if has table; then
  python3 scripts/quality_table.py "$RUN" > "$RUN/quality.md"
  for compared in "$SMALL_RUN"/compare/compare.md "$SMALL_RUN"/compare_candidate/compare.md; do
    [ -f "$compared" ] && { echo; echo "$compared:"; cat "$compared"; } >> "$RUN/quality.md"
  done
  say "all done"; cat "$RUN/quality.md"
fi
