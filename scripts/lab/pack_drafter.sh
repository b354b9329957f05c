#!/usr/bin/env bash
# A run's trained drafter, packed to carry to a later machine: $OUT/drafter.tgz.part-* pieces of 15 MiB (the device
# tool returns files of at most 16 MiB). Holds checkpoints/best's files (best links to the best step's folder: its
# files, not its optimizer state, training_state.pt, ~280 MB), best.json, the training metrics and config, every
# stage's manifest (stage 05's overlap check and check_drafter.py follow them), stage 01's training prompt hashes,
# the logs and, for a lane's folder, its lane.json. Unpack with `cat drafter.tgz.part-* | tar xz -C RUN_DIR`.
#   OUT=DIR scripts/lab/pack_drafter.sh RUN_DIR
set -uo pipefail
RUN=$(realpath "$1") OUT=$(realpath "$OUT")  # absolute before the cds below
cd "$(dirname "$0")/../.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the project's convention for its scripts; no Python here
cd "$RUN" || exit 2
tar czhf - --ignore-failed-read --exclude=training_state.pt checkpoints/best checkpoints/best.json \
  checkpoints/metrics.jsonl checkpoints/04_train.config.json ./*/manifest.json data/train_prompt_hashes.txt logs \
  lane.json 2>/dev/null | split -b 15M - "$OUT/drafter.tgz.part-"
