#!/usr/bin/env bash
# Second turns on the CPU proxy (stories260K): a drafter trained on first turns only against one trained on the
# first two turns of the same ShareGPT conversations, both decoded on the same held-out prompts, turn by turn.
#   1. two runs of scripts/lab/cpu_recipe_levers.sh (LANES=default): ROOT/first (--max-turns 1, the recipe) and
#      ROOT/turns2 (PREPARE_FLAGS="--max-turns 2"); rerunning skips what exists
#   2. two held-out sets that neither run trained on (by first prompt): ROOT/cross/two_turn.jsonl (turns2's held-out
#      conversations, most with two turns) and ROOT/cross/first_turn.jsonl (first's)
#   3. stage 05 --tau-only, chain 3-1-4, float32, 128 new tokens: both drafters on both sets at T=0, and on the
#      two-turn set at T=1 (--allow-overlap: a generic second prompt such as "Continue please" is also some
#      training conversation's first prompt, which stage 05's overlap check counts)
#   4. the table: stage 05's tau overall and per turn -> ROOT/cross/turns.md
#
#   scripts/lab/cpu_second_turns.sh [ROOT]      (default runs/second_turns; about 25 minutes on two cores)
# Environment: PYTHON (.venv/bin/python), PROMPTS (2000, passed to cpu_recipe_levers.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages where it is not pip-installed
ROOT=${1:-runs/second_turns}
PY=${PYTHON:-.venv/bin/python}
export PYTHON=$PY LANES=default OMP_NUM_THREADS=1
[ -f "$ROOT/first/levers.md" ] || bash scripts/lab/cpu_recipe_levers.sh "$ROOT/first"
# The turns2 run's own held-out bench may stop at the overlap check (see 3.); its drafter is what this needs.
[ -f "$ROOT/turns2/levers.md" ] || PREPARE_FLAGS="--max-turns 2" bash scripts/lab/cpu_recipe_levers.sh "$ROOT/turns2"
mkdir -p "$ROOT/cross"

"$PY" - "$ROOT" <<'EOF'
import json, sys
from pathlib import Path
from eagle3_pipeline.data.records import prompt_hash

root = Path(sys.argv[1])
trained = set()
for run in ("first", "turns2"):
    trained |= set((root / run / "data" / "train_prompt_hashes.txt").read_text().split())
def first_prompt(line):
    return next(m["content"] for m in json.loads(line)["messages"] if m["role"] == "user")
for run, name in (("turns2", "two_turn"), ("first", "first_turn")):
    lines = (root / run / "data" / "eval_data.jsonl").read_text().splitlines(keepends=True)
    kept = [line for line in lines if prompt_hash(first_prompt(line)) not in trained]
    (root / "cross" / f"{name}.jsonl").write_text("".join(kept))
    print(f"{name}: {len(kept)} of {len(lines)} held-out conversations trained on by neither run")
EOF

bench() {  # $1 set, $2 run, $3 temperature
  "$PY" 05_benchmark.py --model-path tests/assets/stories260K --draft-model-path "$ROOT/$2/lanes/default/checkpoints/best" \
    --device cpu --dtype float32 --tau-only --num-steps 3 --topk 1 --num-draft-tokens 4 --temperature "$3" \
    --prompts "$ROOT/cross/$1.jsonl" --chat-template tests/assets/stories260K_chat.jinja --max-new-tokens 128 \
    --allow-overlap --output-dir "$ROOT/cross/$1_$2_t$3" > "$ROOT/cross/$1_$2_t$3.log" 2>&1
}
for run in first turns2; do
  bench two_turn "$run" 0 & bench two_turn "$run" 1 & wait
  bench first_turn "$run" 0
done

"$PY" - "$ROOT" <<'EOF' | tee "$ROOT/cross/turns.md"
import json, sys
from pathlib import Path
from eagle3_pipeline.bench.metrics import summarize_generations

root = Path(sys.argv[1]) / "cross"
print("| held-out set | drafter trained on | T | tau | turn 1 | turn 2 |\n|---|---|---|---|---|---|")
for folder in sorted(p for p in root.iterdir() if p.is_dir()):
    report = json.loads(next(folder.glob("bench_*.json")).read_text())
    turns = [turn for prompt in report["prompts"] for turn in prompt["turns"]]
    # stage 05's own tau over each turn's runs (accepted tokens per verification step)
    per_turn = [summarize_generations([t for t in turns if t["turn"] == k], 3)["tau"] for k in (0, 1)]
    name, run, temperature = folder.name.rsplit("_", 2)
    print(f"| {name} | {'first turns' if run == 'first' else 'two turns'} | {temperature[1:]} | "
          f"{report['overall']['tau']:.2f} | " + " | ".join("-" if t is None else f"{t:.2f}" for t in per_turn) + " |")
EOF
