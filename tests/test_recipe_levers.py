"""scripts/lab/cpu_recipe_levers.sh end to end at a tiny size: the real stages on stories260K and PyPI ShareGPT prompts,
two lanes whose names are their changes (run by scripts/lab/run_lanes.py into RUN/lanes/NAME), every benchmark, the
table; a rerun skips finished lanes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO


def _run(run_dir, lanes: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PROMPTS": "60", "EPOCHS": "1", "LANES": lanes, "HELDOUT": "2", "NEW_TOKENS": "8",
           "PYTHON": sys.executable}
    return subprocess.run(["bash", str(REPO / "scripts/lab/cpu_recipe_levers.sh"), str(run_dir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


def test_lanes_train_what_their_names_say_and_every_benchmark_lands_in_the_table(tmp_path):
    run = tmp_path / "levers"
    done = _run(run, "default lr3_steps2_ttt7_bs2 epochs2x")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    flags = {name: json.loads((run / "lanes" / name / "checkpoints" / "manifest.json").read_text())["flags"]
             for name in ("default", "lr3_steps2_ttt7_bs2")}
    records = {name: json.loads((run / "lanes" / name / "lane.json").read_text()) for name in flags}
    assert all(record["status"] == "complete" for record in records.values())
    assert records["lr3_steps2_ttt7_bs2"]["lane"]["changes"]["04_train"] == [
        "--lr", "0.003", "--max-tokens-per-batch", "2048", "--ttt-steps", "7", "--batch-size", "2"]
    assert (flags["default"]["lr"], flags["default"]["max_tokens_per_batch"]) == (1e-3, 4096)
    assert (flags["lr3_steps2_ttt7_bs2"]["lr"], flags["lr3_steps2_ttt7_bs2"]["max_tokens_per_batch"]) == (3e-3, 2048)
    # stage 04's default, then the lane's
    assert (flags["default"]["ttt_steps"], flags["lr3_steps2_ttt7_bs2"]["ttt_steps"]) == (3, 7)
    assert flags["lr3_steps2_ttt7_bs2"]["epochs"] == flags["default"]["epochs"] == 1
    assert (flags["default"]["batch_size"], flags["lr3_steps2_ttt7_bs2"]["batch_size"]) == (None, 2)
    assert "no lane called epochs2x: 'epochs2x' is not a part" in (run / "logs" / "levers.log").read_text()
    assert not (run / "lanes" / "epochs2x").exists()
    table = (run / "levers.md").read_text()
    for name in ("default", "lr3_steps2_ttt7_bs2"):
        assert f"| {name}_heldout | " in table and f"| {name}_heldout_t1 | " in table and f"| {name}_eval | " in table
    assert "walked chain tau (3 drafts)" in table and "2 of " in table

    trained = (run / "lanes" / "default" / "checkpoints" / "manifest.json").stat().st_mtime_ns
    again = _run(run, "default")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert (run / "lanes" / "default" / "checkpoints" / "manifest.json").stat().st_mtime_ns == trained  # not again
    assert "lane default done" in again.stdout
    assert "lane default: complete with these flags, skipped" in (run / "logs" / "lane_default.log").read_text()
