#!/usr/bin/env bash
# Greedy and sampled replies together on the CPU proxy (stories260K): does a greedy reply with a sampled one beside it
# keep T=0's tau and gain T=1's? (Sampled replies alone traded T=0 for T=1: -16 % / +19 %,
# docs/results/2026-12-02-stories260k-sampled-replies.md.) Four drafters, the same prompts, split and held-out set,
# each a run of scripts/lab/cpu_recipe_levers.sh (two at a time):
#   ROOT/greedy   the recipe (LANES="default epochs2": also twice the epochs, as many optimizer steps as mixed takes)
#   ROOT/sampled  PREPARE_FLAGS="--temperature 0.8": one sampled reply a prompt
#   ROOT/mixed    PREPARE_FLAGS="--replies-per-prompt 2 --temperature 0.8 --greedy-first-reply": the greedy reply and a
#                 sampled one, each a training sample (twice the samples); the held-out replies stay greedy
# Each decodes its held-out prompts (the same 60 of the same 100 in every run) with chain 3-1-4 at T=0 and T=1
# (stage 05 --tau-only, float32); the table -> ROOT/mixed.md.
#
#   scripts/lab/cpu_mixed_replies.sh [ROOT]      (default runs/mixed_replies; about 25 minutes on two cores)
# Environment: PYTHON (.venv/bin/python), PROMPTS (2000, passed to cpu_recipe_levers.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is not pip-installed
ROOT=${1:-runs/mixed_replies}
export PYTHON=${PYTHON:-.venv/bin/python} OMP_NUM_THREADS=1
run() {  # $1 run name, $2 lanes, $3 stage-01 flags
  [ -f "$ROOT/$1/levers.md" ] || LANES=$2 PREPARE_FLAGS=$3 bash scripts/lab/cpu_recipe_levers.sh "$ROOT/$1" \
    > "$ROOT/$1.log" 2>&1
}
mkdir -p "$ROOT"
run greedy "default epochs2" "" & run sampled default "--temperature 0.8" & wait
run mixed default "--replies-per-prompt 2 --temperature 0.8 --greedy-first-reply"

"$PYTHON" - "$ROOT" <<'EOF' | tee "$ROOT/mixed.md"
import json, sys
from pathlib import Path

root = Path(sys.argv[1])
print("| drafter trained on | training samples | epochs | chain tau T=0 | chain tau T=1 |\n|---|---|---|---|---|")
for run, lane, what, epochs in (("greedy", "default", "greedy replies", 4), ("greedy", "epochs2", "greedy replies", 8),
                                ("sampled", "default", "replies sampled at T=0.8", 4),
                                ("mixed", "default", "the greedy reply and a sampled one a prompt", 4)):
    samples = json.loads((root / run / "data" / "manifest.json").read_text())["counts"]["samples"]
    folder = root / run / "lanes" / lane  # its lane.json says where each benchmark wrote
    benches = {step["benchmark"]: folder / step["output_dir"]
               for step in json.loads((folder / "lane.json").read_text())["steps"] if step.get("benchmark")}
    taus = [json.loads(next(benches[name].glob("bench_*.json")).read_text())["overall"]["tau"]
            for name in ("heldout", "heldout_t1")]
    print(f"| {what} | {samples} | {epochs} | {taus[0]:.2f} | {taus[1]:.2f} |")
EOF
