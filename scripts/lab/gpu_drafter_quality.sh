#!/usr/bin/env bash
# Drafter quality on one GPU, measured as the field measures it and side by side on the same data (issue 17), with
# the tau cost of FP8 aux layers + top-k targets (issue 21) on the same run:
#   1. data     stages 01-03 on SAMPLES regenerated ShareGPT prompts (RUN) and on SMALL of them (RUN-small), and
#               for each data lane (sampled) in RUN/lanes/<lane>; the same prepared data extracted again for
#               each storage-format lane (RUN/lanes/<lane>). Extractions run alone.
#   2. compare  the timed part, alone on the GPU: our stage 04 on RUN-small, then SpecForge 0.2.0's recipe
#               (scripts/lab/compare_recipes.py) on the same samples and epochs. SpecForge trains one sequence a step,
#               so equal tokens on the full run would not fit one session.
#   3. lanes    side by side, each lane a training on RUN followed by its benchmarks (acceptance only, no timing);
#               LANES picks them (unset: "default epochs2 ttt7"). scripts/lab/run_lanes.py runs each into
#               RUN/lanes/<lane> with its lane.json, skipping what is complete; what a name means is declared
#               once, in eagle3_pipeline/lab/lanes.py (docs/lab.md), read against this script's recipe and knobs. At
#               4,096-token steps and TTT 7 a lane trains about 10 minutes beside one to three others on an H200;
#               six side by side share the GPU
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
#                 sampled    replies regenerated at T=0.8 (REGEN_CACHE does not fit, so stage 01
#                            regenerates them all), also benchmarked at T=1
#                 mixed      the greedy reply and one sampled at T=0.8 a prompt (--replies-per-prompt 2 --greedy-first-reply,
#                            REGEN_CACHE does not fit): on stories260K T=0 -2 %, T=1 +14.5 %
#                            (results/2026-12-03-stories260k-mixed-replies.md)
#                 data       DATA_SAMPLES prompts for DATA_EPOCHS epochs (REGEN_CACHE's replies for
#                            the prompts it holds, the rest regenerated; on stories260K 3x the prompts raised
#                            chain tau 24 %): at the defaults about as many optimizer steps as the default lane,
#                            over 1.7x the distinct replies
#                 long       replies regenerated up to LONG_TOKENS new tokens instead of 256 (REGEN_CACHE
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
#                            RUN's held-out prompts excluded: the data and turns2 levers together
#                 bf16final  FORMAT_STEP_TOKENS-token steps on RUN: the storage-format lanes' baseline
#                 fp8topk, fp8final, bf16topk
#                            FORMAT_STEP_TOKENS-token steps on the same prepared data extracted
#                            with FP8 aux and/or top-k targets (in the data phase, each extraction alone)
#                 auxA-B-C   STEP_TOKENS-token steps on the same prepared data extracted with
#                            --aux-layers A,B,C instead of the default 2,L//2,L-3 (aux2-15-29 on SmolLM2: the high
#                            layer moved from the input of layer 27 to that of the last one, 29); the drafter's
#                            config names them, so stage 05 and the servers capture the same layers
#               and the small run's two drafters benchmarked (compare_recipes.py --parts bench table).
#               Every lane: stage 05 --tau-only at chain 3/1/4 (what SGLang serves), T=0, on all 80 MT-bench
#               questions (both turns) and HELDOUT stratified held-out prompts, and the teacher-forced agreement
#               (--mode eval); every lane but the storage-format ones also chain at T=1 on MT-bench. The
#               default lane also (unless EXTRAS=0): chain and tree in float32 and in float64 on all of
#               MT-bench (every turn checked against the verifier's greedy choice in the same precision: lossless).
#   4. table    scripts/lab/quality_table.py -> RUN/quality.md (a row per lane and benchmark, through each lane.json)
# Each stage-05 run writes its own output folder (a folder has one writer at a time). With MPS=1 the CUDA MPS daemon
# is started first (when it starts and works), so the side-by-side processes run their kernels concurrently.
#
#   scripts/lab/gpu_drafter_quality.sh VERIFIER DATA_DIR RUN_DIR
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
#                            SmolLM2 most replies then loop to the budget (scripts/lab/reply_lengths.py), so read it
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
#   DRY_RUN [0]              1: print the plan of LANES (every stage command with its flags) and stop
#   MPS, EXTRAS [1], OUT     OUT: pack logs, manifests, metrics and reports into $OUT/quality.tgz, and the replies
#                            the data and sampled lanes regenerated into $OUT/regenerated_<lane>.tgz (a REGEN_CACHE:
#                            the data lane's holds REGEN_CACHE's replies too)
# Progress: RUN_DIR/logs/quality.log; each lane's run_lanes.py output in RUN_DIR/logs/lane_<lane>.log, the data
# phase's in RUN_DIR/logs/lanes_data.log.
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
cd "$(dirname "$0")/../.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is not pip-installed
VERIFIER=$1; DATA=$2; RUN=$3; SMALL_RUN=$RUN-small
SAMPLES=${SAMPLES:-10000}; SMALL=${SMALL:-800}; EPOCHS=${EPOCHS:-4}; LR=${LR:-1e-3}; DATA_SAMPLES=${DATA_SAMPLES:-17000}; DATA_EPOCHS=${DATA_EPOCHS:-2}; DATA_EXTRA=${DATA_EXTRA:-}; DATA_TURNS=${DATA_TURNS:-2}; SMALL_STEP_TOKENS=${SMALL_STEP_TOKENS:-2048}
SMALL_EVAL_RATIO=${SMALL_EVAL_RATIO:-0.1}; SMALL_CANDIDATE_FLAGS=${SMALL_CANDIDATE_FLAGS:-}
TRAIN_FLAGS=${TRAIN_FLAGS:-}
STEP_TOKENS=${STEP_TOKENS:-4096}; LEVER_STEP_TOKENS=${LEVER_STEP_TOKENS:-2048}; TOPK=${TOPK:-64}
FORMAT_STEP_TOKENS=${FORMAT_STEP_TOKENS:-16384}; LANES=${LANES-"default epochs2 ttt7"}; EXTRAS=${EXTRAS:-1}
HELDOUT=${HELDOUT:-60}; NEW_TOKENS=${NEW_TOKENS:-128}; FIELD_TOKENS=${FIELD_TOKENS:-$NEW_TOKENS}; LONG_TOKENS=${LONG_TOKENS:-1024}; WORKERS=${WORKERS:-3}; DECODE_WORKERS=${DECODE_WORKERS:-3}
SPECFORGE=${SPECFORGE:-}; SPECFORGE_ARGS=${SPECFORGE_ARGS:-}; PHASES=${PHASES:-"data compare lanes table"}
BENCHMARKS=eval,mtbench,heldout,mtbench_t1
if [ "$EXTRAS" = 1 ]; then BENCHMARKS+=,fp32_chain,fp32_tree,fp64_chain,fp64_tree; fi  # the default lane's only
lanes() {  # scripts/lab/run_lanes.py over RUN: the flags RUN was prepared with, the lanes' recipe, knobs and benchmarks
  local recipe="--epochs $EPOCHS --max-tokens-per-batch $STEP_TOKENS --num-workers $WORKERS --lr $LR"
  # shellcheck disable=SC2046  # DATA_EXTRA: several files
  python3 scripts/lab/run_lanes.py --base "$RUN" --model-path "$VERIFIER" --dataset "$DATA/sharegpt.json" --regenerate \
    --max-turns 1 --num-samples "$SAMPLES" --eval-ratio 0.02 --max-seq-len 2048 --draft-vocab-size 32000 \
    --stage-args 01 "--batch-size 1024 --max-new-tokens 256" \
    --stage-args 02 "--batch-size 64 --num-workers 8 --target-topk $TOPK" \
    --stage-args 04 "$recipe --eval-interval 500 --save-interval 100000 $TRAIN_FLAGS" \
    --stage-args 05 "--decode-workers $DECODE_WORKERS --max-new-tokens $NEW_TOKENS" \
    --benchmarks "$BENCHMARKS" --mt-bench "$DATA/mt_bench.jsonl" --heldout "$HELDOUT" --new-tokens "$NEW_TOKENS" \
    --field-tokens "$FIELD_TOKENS" --lever-step-tokens "$LEVER_STEP_TOKENS" --format-step-tokens "$FORMAT_STEP_TOKENS" \
    --data-samples "$DATA_SAMPLES" --data-epochs "$DATA_EPOCHS" --data-turns "$DATA_TURNS" --long-tokens "$LONG_TOKENS" \
    $(for file in $DATA_EXTRA; do printf -- '--data-extra %s ' "$file"; done) "$@"
}
if [ "${DRY_RUN:-0}" = 1 ]; then lanes --lanes "$LANES" --dry-run; exit; fi
export PYTHONUNBUFFERED=1
mkdir -p "$RUN/logs"
LOG=$RUN/logs/quality.log
say() { echo "$(date +%T) $*" | tee -a "$LOG"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }

pack() {  # the small files of every run: logs, manifests, metrics, curves, reports, lane records (no hidden states,
          # no weights)
  [ -n "${OUT:-}" ] || return 0
  local parent; parent=$(dirname "$RUN")
  (cd "$parent" && find "$(basename "$RUN")" "$(basename "$RUN")"-* -maxdepth 5 \
     -type f \( -path '*/logs/*' -o -path '*/bench_*' -o -path '*/compare/*' -o -path '*/compare_*/*' -o -name quality.md \
     -o -name manifest.json -o -name metrics.jsonl -o -name '*.png' -o -name 'specforge_results.json' -o -name lane.json \) \
     -not -path '*/hidden_states/*/*' 2>/dev/null | tar czf "$OUT/quality.tgz" -C "$parent" -T - ) || true
  local replies
  for replies in "$RUN"/lanes/*/data/regenerated.jsonl; do  # the replies regenerated here: a REGEN_CACHE that saves
    [ -f "$replies" ] || continue                            # the next machine the time
    (cd "$(dirname "$replies")" && tar czf "$OUT/regenerated_$(basename "$(dirname "$(dirname "$replies")")").tgz" \
      regenerated.jsonl regenerated.settings.json) || true
  done
}
trap pack EXIT
if [ "$PHASES" = pack ]; then exit 0; fi
if [ -n "$LANES" ] && { has data || has lanes; }; then  # a misspelt lane stops here, before any GPU time
  lanes --lanes "$LANES" --dry-run > /dev/null || { say "LANES=\"$LANES\": fix the names above"; exit 2; }
fi

if [ "${MPS:-0}" = 1 ] && command -v nvidia-cuda-mps-control > /dev/null; then
  nvidia-cuda-mps-control -d || true
  if timeout 120 python3 -c "import torch; torch.ones(1, device='cuda').sum().item()"; then
    say "CUDA MPS on"
  else
    echo quit | nvidia-cuda-mps-control || true; say "CUDA MPS failed to serve a process: off"
  fi
fi

prepare() {  # $1 run dir, $2 samples: stages 01-03, the replies from REGEN_CACHE when its settings fit; EVAL_RATIO
             # [0.02] the held-out share
  if [ -n "${REGEN_CACHE:-}" ] && [ ! -f "$1/data/regenerated.jsonl" ]; then
    mkdir -p "$1/data" && tar xzf "$REGEN_CACHE" -C "$1/data"
  fi
  pipeline() {
    python3 run_pipeline.py --run-dir "$1" --model-path "$VERIFIER" --dataset "$DATA/sharegpt.json" \
      --regenerate --max-turns 1 --num-samples "$2" --eval-ratio "${EVAL_RATIO:-0.02}" --max-seq-len 2048 \
      --draft-vocab-size 32000 --skip 04 --skip 05 --stage-args 01 "--batch-size 1024 --max-new-tokens 256" \
      --stage-args 02 "--batch-size 64 --num-workers 8"
  }
  pipeline "$@" && return 0
  # Stage 01 refuses a cache made with other settings (another verifier path or tokenizer, another temperature):
  # regenerate instead.
  refused "$1" || return 1
  pipeline "$@"
}
refused() {  # $1 run dir: when its stage 01 refused REGEN_CACHE's replies (made with other settings), remove them
  grep -q "holds responses generated with other settings" "$1/logs/01_prepare_data.log" 2>/dev/null || return 1
  say "REGEN_CACHE does not fit $1 (see $1/logs/01_prepare_data.log): regenerating the replies"
  rm -f "$1/data/regenerated.jsonl" "$1/data/regenerated.settings.json"
}
lanes_data() {  # stages 01-03 of the data lanes, stage 02 of the storage-format lanes, one after another; REGEN_CACHE
                # goes to each folder where a lane reruns stage 01, and is dropped where stage 01 refuses it
  local folder again=0 log=$RUN/logs/lanes_data.log
  if [ -n "${REGEN_CACHE:-}" ]; then
    for folder in $(lanes --lanes "$LANES" --data-folders); do
      [ -f "$folder/data/regenerated.jsonl" ] || { mkdir -p "$folder/data" && tar xzf "$REGEN_CACHE" -C "$folder/data"; }
    done
  fi
  say "lanes' data and storage formats: $LANES"
  lanes --lanes "$LANES" --only data >> "$log" 2>&1 && return 0
  for folder in $(lanes --lanes "$LANES" --data-folders); do refused "$folder" && again=1; done
  [ "$again" = 1 ] && lanes --lanes "$LANES" --only data >> "$log" 2>&1 && return 0
  say "FAILED: a lane's data (see $log); lanes without theirs stop at their training"
}
train04() {  # $1 run dir, $2 output folder, $3 tokens a step, $4 data workers, then extra flags: the comparison's
  local run=$1 out=$2 tokens=$3 workers=$4; shift 4
  say "train $out ($tokens tokens a step $TRAIN_FLAGS $*)"
  # shellcheck disable=SC2086
  python3 04_train.py --run-dir "$run" --model-path "$VERIFIER" --output-dir "$out" --epochs "$EPOCHS" \
    --max-seq-len 2048 --max-tokens-per-batch "$tokens" --num-workers "$workers" --lr "$LR" --eval-interval 500 \
    --save-interval 100000 $TRAIN_FLAGS "$@" > "$run/logs/train_$(basename "$out").log" 2>&1 \
    || { say "FAILED: train $out"; return 1; }
  say "trained $out: $(python3 -c "import json; print(json.load(open('$out/manifest.json'))['wall_time_s'])") s"
}
lane() {  # $1 lane: its training, then its benchmarks side by side (the default lane's lossless checks among them)
  if lanes --lanes "$1" --only train --only bench --bench-jobs 8 > "$RUN/logs/lane_$1.log" 2>&1; then
    say "lane $1 done"
  else
    say "FAILED: lane $1 (see $RUN/logs/lane_$1.log): $(tail -n 1 "$RUN/logs/lane_$1.log")"
  fi
}

if has data; then
  if [ -n "$LANES" ]; then  # the comparison alone (LANES="") needs only RUN-small
    say "stages 01-03: $SAMPLES samples in $RUN"; prepare "$RUN" "$SAMPLES" > "$RUN/logs/prepare.log" 2>&1
    lanes_data
  fi
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
  python3 scripts/lab/compare_recipes.py --run-dir "$SMALL_RUN" --model-path "$VERIFIER" --parts train \
    --recipe-args "$SPECFORGE_ARGS" > "$SMALL_RUN/logs/specforge.log" 2>&1 || say "FAILED: SpecForge's recipe"
  say "SpecForge done"
}
compare_bench() {  # both small drafters through the same stage-05 runs, and their table (and the candidate's)
  [ -d "$SMALL_RUN/specforge/best" ] || return 0
  local ours=checkpoints pids=()
  [ -n "$SMALL_CANDIDATE_FLAGS" ] && ours="checkpoints checkpoints_candidate"
  for ours in $ours; do
    python3 scripts/lab/compare_recipes.py --run-dir "$SMALL_RUN" --model-path "$VERIFIER" --parts bench table \
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
  for name in $LANES; do lane "$name" & pids+=($!); done
  if [ -n "$beside" ]; then pids+=("$beside"); else compare_bench & pids+=($!); fi
  for pid in "${pids[@]}"; do wait "$pid" || true; done
  say "lanes done"
fi
if has table; then
  python3 scripts/lab/quality_table.py "$RUN" > "$RUN/quality.md"
  for compared in "$SMALL_RUN"/compare/compare.md "$SMALL_RUN"/compare_candidate/compare.md; do
    [ -f "$compared" ] && { echo; echo "$compared:"; cat "$compared"; } >> "$RUN/quality.md"
  done
  say "all done"; cat "$RUN/quality.md"
fi
