"""scripts/lab/gpu_checks.sh on a CPU at a tiny size: stage 04's profile of the real loop and the lossless checks
(chain and tree, float32 and float64, decoded in worker processes) on a stories260K run and drafter; the
regeneration phase is bench_regenerate.py's own test (tests/test_bench_regenerate.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO
from test_benchmark import write_jsonl
from test_train import _load_module, build_run, train_argv

GPU_CHECKS = REPO / "scripts" / "lab" / "gpu_checks.sh"


def test_checks_profile_the_loop_and_find_every_turn_lossless(tmp_path, stories260k):
    run = build_run(stories260k, tmp_path / "run", seed=0)
    stage04 = _load_module("stage04_train", "04_train.py")
    assert stage04.main(train_argv(run, run / "checkpoints", stories260k, epochs=1)) == 0
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "mt_bench.jsonl", [
        {"question_id": 1, "category": "story", "turns": ["Once upon a time", "Then the dog"]},
        {"question_id": 2, "category": "people", "turns": ["Tom and Sue went"]}])
    out = tmp_path / "checks"
    env = {**os.environ, "PHASES": "profile lossless", "DECODE_WORKERS": "2", "PROFILE_STEPS": "2",
           "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(GPU_CHECKS), str(stories260k), str(data), str(run),
                           str(run / "checkpoints" / "best"), str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (out / "checks.log").read_text()
    assert "FAILED" not in log and "--profile-steps: 2 steps profiled" in log and "checks done" in log
    for name in ("train_profile", "train_profile_pad64"):  # unpadded, then batch lengths padded to 64
        assert (out / name / "profile_steps.txt").read_text().startswith("2 steps profiled")
    assert "--pad-batches-to 64" in log and log.count("--profile-steps: 2 steps profiled") == 2
    for drafting in ("chain", "tree"):
        for dtype in ("float32", "float64"):
            (path,) = (out / f"lossless_{drafting}_{dtype}").glob("bench_offline_*.json")
            report = json.loads(path.read_text())
            assert report["settings"]["compute_dtype"] == dtype and report["settings"]["decode_workers"] == 2
            assert (report["settings"]["topk"] > 1) == (drafting == "tree")
            match = report["overall"]["greedy_match"]
            assert match["turns_checked"] == 3 and match["turns_identical"] == 3
    assert log.count("3 of 3 turns identical") == 4
    # RUN's own logs and recorded flags are left to the job that makes RUN
    assert {path.name for path in (run / "logs").iterdir()}.isdisjoint({"04_train.log", "05_benchmark.log",
                                                                       "04_train.config.json"})

    # A drafter that never comes: the lossless phase gives up after WAIT_S and says so.
    again = subprocess.run(["bash", str(GPU_CHECKS), str(stories260k), str(data), str(run),
                            str(tmp_path / "missing"), str(tmp_path / "again")], cwd=REPO,
                           env={**env, "PHASES": "lossless", "WAIT_S": "0"}, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0 and "gave up waiting for" in (tmp_path / "again" / "checks.log").read_text()
