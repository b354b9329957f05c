"""Rerunning one stage needs only what changes: stage 05 takes the flags its last run and the stages before it
recorded in the run directory (eagle3_pipeline/cli/recorded.py); run_pipeline.py --status and a --run-dir that is no
run directory answer with exit 2 and a message."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from conftest import REPO


def _stage05():
    spec = importlib.util.spec_from_file_location("stage05_rerun", REPO / "05_benchmark.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_pipeline(*args: str):
    return subprocess.run([sys.executable, str(REPO / "run_pipeline.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=str(REPO))


def _upstream_run(run, stories260k):
    """A run directory whose stages 01 and 04 recorded their flags in real manifests (04 the nearest)."""
    from eagle3_pipeline.formats.manifest import Manifest

    Manifest(run / "data", "01_prepare_data", {"model_path": "/elsewhere/old-verifier", "trust_remote_code": False,
                                               "chat_template": str(run / "template.jinja")}).complete()
    Manifest(run / "checkpoints", "04_train", {"model_path": str(stories260k), "trust_remote_code": True,
                                               "epochs": 3}).complete()


def test_stage_05_takes_the_verifier_from_the_upstream_manifests(tmp_path, stories260k):
    stage05 = _stage05()
    run = tmp_path / "run"
    _upstream_run(run, stories260k)
    args = stage05.parse(["--run-dir", str(run), "--num-steps", "5"])
    # The nearest manifest (04's) names the verifier; 01's is the only one with a chat template.
    assert args.model_path == str(stories260k) and args.trust_remote_code is True
    assert args.chat_template == str(run / "template.jinja")
    assert args.num_steps == 5 and args.draft_model_path == str(run / "checkpoints" / "best")
    assert any(note.startswith(f'--model-path "{stories260k}" taken from {run / "checkpoints" / "manifest.json"}')
               for note in stage05.TAKEN)
    # A flag on the command line wins over every record.
    args = stage05.parse(["--run-dir", str(run), "--model-path", "/given/verifier"])
    assert args.model_path == "/given/verifier" and not any("--model-path" in n for n in stage05.TAKEN)


def test_a_rerun_of_stage_05_keeps_the_last_runs_settings_but_not_its_decoding_or_switches(tmp_path, stories260k):
    stage05 = _stage05()
    run = tmp_path / "run"
    _upstream_run(run, stories260k)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n")
    # A first run that stops at once (no drafter yet), after the stage recorded its configuration.
    first = ["--run-dir", str(run), "--prompts", str(prompts), "--num-prompts", "1", "--max-new-tokens", "17",
             "--dtype", "float32", "--temperature", "0.7", "--num-steps", "2", "--tau-only", "--allow-overlap"]
    assert stage05.main(first) != 0
    assert json.loads((run / "bench" / "05_benchmark.config.json").read_text())["max_new_tokens"] == 17

    args = stage05.parse(["--run-dir", str(run), "--max-new-tokens", "9"])
    own = run / "bench" / "05_benchmark.config.json"
    assert (args.prompts, args.num_prompts, args.dtype) == (str(prompts), 1, "float32")  # the last run's
    assert args.max_new_tokens == 9  # given
    assert (args.temperature, args.num_steps) == (0.0, 3)  # the decoding settings: the defaults, not the record
    assert not args.tau_only and not args.allow_overlap  # switches are never taken
    assert args.model_path == str(stories260k)  # the stage's own record names the verifier too
    assert f'--dtype "float32" taken from {own}' in stage05.TAKEN

    # A run of another --mode takes only the verifier (from the manifests), none of the offline run's settings.
    args = stage05.parse(["--run-dir", str(run), "--mode", "eval"])
    assert args.num_prompts is None and args.prompts is None and args.dtype == "bfloat16"
    assert args.model_path == str(stories260k) and all(n.endswith("manifest.json") for n in stage05.TAKEN)

    # The log of the rerun says what it took, and from where (it stops for want of a drafter).
    assert stage05.main(["--run-dir", str(run)]) != 0
    log = (run / "logs" / "05_benchmark.log").read_text()
    assert f'not given: --prompts "{prompts}" taken from {own}' in log


def test_run_pipeline_only_05_passes_on_what_the_run_recorded(tmp_path, stories260k):
    run = tmp_path / "run"
    _upstream_run(run, stories260k)
    done = run_pipeline("--run-dir", str(run), "--only", "05", "--stage-args", "05", "--num-steps 4")
    log = (run / "logs" / "05_benchmark.log").read_text()
    assert f'not given: --model-path "{stories260k}" taken from' in log, done.stdout[-2000:]
    assert done.returncode == 2 and "checkpoints/best" in log  # then it asks for the drafter


def test_status_of_a_folder_that_holds_no_run_says_so(tmp_path):
    missing = run_pipeline("--run-dir", str(tmp_path / "nothing"), "--status")
    assert missing.returncode == 2 and "no run directory at" in missing.stderr and "Traceback" not in missing.stderr
    (tmp_path / "empty").mkdir()
    empty = run_pipeline("--run-dir", str(tmp_path / "empty"), "--status")
    assert empty.returncode == 2 and "holds no run" in empty.stderr
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for extra in (["--status"], ["--model-path", "m", "--dataset", "d"]):
        result = run_pipeline("--run-dir", str(a_file), *extra)
        assert result.returncode == 2 and "is a file, not a folder" in result.stderr
        assert "Traceback" not in result.stderr


def test_status_of_stage_04_reads_its_metrics_in_words(tmp_path):
    from eagle3_pipeline.cli.run_status import training_progress

    metrics = tmp_path / "metrics.jsonl"
    long_list = [round(0.1 * j, 6) for j in range(40)]  # a line far longer than a status line
    metrics.write_text(
        json.dumps({"kind": "train", "step": 10, "epoch": 0, "loss": 2.5, "acc_per_step": long_list,
                    "sim_accept_len": 1.84}) + "\n"
        + json.dumps({"kind": "eval", "step": 10, "epoch": 0, "loss": 2.75, "sim_accept_len": 1.5,
                      "sim_chain_tau": 1.25}) + "\n"
        + json.dumps({"kind": "train", "step": 20, "epoch": 1, "loss": 2.25, "acc_per_step": long_list,
                      "sim_accept_len": 2.0}) + "\n" + '{"kind": "train", "st')  # a line being written
    line = training_progress(metrics)
    # Validation first, its walked chain tau (the figure to compare with stage 05's tau) before the estimate.
    assert line == ("validation step 10 (epoch 0): walked chain tau 1.25, TTT acceptance estimate 1.50, loss 2.7500; "
                    "train step 20 (epoch 1): loss 2.2500, TTT acceptance estimate 2.00")
