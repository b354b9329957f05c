"""run_pipeline.py: flags routed by the schema, checked before any stage runs, finished stages skipped."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO


def run_pipeline(*args: str):
    return subprocess.run([sys.executable, str(REPO / "run_pipeline.py"), *args], capture_output=True, text=True,
                          timeout=600, cwd=str(REPO))


@pytest.fixture()
def texts(tmp_path):
    path = tmp_path / "stories.jsonl"
    lines = [{"text": f"Once upon a time there was a little {animal} who liked to {verb} in the park."}
             for animal in ("cat", "dog", "bird", "fish", "frog") for verb in ("run", "play", "sing", "jump")]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_runs_stages_in_order_then_skips_them(tmp_path, texts, stories260k):
    run = tmp_path / "run"
    common = ["--run-dir", str(run), "--model-path", str(stories260k), "--dataset", str(texts),
              "--draft-vocab-size", "100", "--skip", "02", "--skip", "04", "--skip", "05"]
    first = run_pipeline(*common)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for stage, folder in (("01_prepare_data", "data"), ("03_build_vocab_mapping", "vocab")):
        manifest = json.loads((run / folder / "manifest.json").read_text())
        assert manifest["status"] == "complete"
        assert (run / "logs" / f"{stage}.log").exists()
    # --draft-vocab-size went to stage 03 only; --dataset to stage 01 only.
    assert json.loads((run / "vocab" / "manifest.json").read_text())["draft_vocab_size"] == 100
    second = run_pipeline(*common)
    assert second.returncode == 0
    assert second.stdout.count("complete with these flags, skipped") == 2
    changed = run_pipeline(*common[:-6], "--draft-vocab-size", "120", "--overwrite", "--skip", "02", "--skip", "04",
                           "--skip", "05")
    assert changed.returncode == 0, changed.stdout[-3000:]
    assert "01_prepare_data: complete with these flags, skipped" in changed.stdout
    assert json.loads((run / "vocab" / "manifest.json").read_text())["draft_vocab_size"] == 120
    status = run_pipeline("--run-dir", str(run), "--status")
    assert "03_build_vocab_mapping" in status.stdout and "complete" in status.stdout
    assert "04_train" in status.stdout and "not started" in status.stdout
    # A copy of the run elsewhere (rsync to another machine) keeps its finished stages.
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(run, moved)
    again = run_pipeline("--run-dir", str(moved), *common[2:-6], "--draft-vocab-size", "120", "--skip", "02",
                         "--skip", "04", "--skip", "05")
    assert again.returncode == 0 and again.stdout.count("complete with these flags, skipped") == 2, again.stdout


def test_a_bad_flag_for_a_late_stage_stops_before_the_first(tmp_path, texts, stories260k):
    run = tmp_path / "run"
    result = run_pipeline("--run-dir", str(run), "--model-path", str(stories260k), "--dataset", str(texts),
                          "--stage-args", "04", "--epoch 3")
    assert result.returncode == 2
    assert "04_train" in result.stderr and "did you mean --epochs" in result.stderr
    assert not (run / "data").exists()


def test_stage_args_take_a_lone_flag(tmp_path, texts, stories260k):
    """--stage-args 03 "--overwrite" (one flag, no space) reaches stage 03; argparse alone refused it."""
    run = tmp_path / "run"
    common = ["--run-dir", str(run), "--model-path", str(stories260k), "--dataset", str(texts), "--skip", "02",
              "--skip", "04", "--skip", "05"]
    assert run_pipeline(*common).returncode == 0
    again = run_pipeline(*common, "--only", "03", "--stage-args", "03", "--overwrite")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "03_build_vocab_mapping.py --run-dir" in again.stdout and "--overwrite" in again.stdout


def test_a_failing_stage_shows_its_own_log_lines_never_an_earlier_runs(tmp_path, stories260k):
    """A stage's log keeps earlier runs' lines; a failure shows only what this run wrote."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "03_build_vocab_mapping.log").write_text("EARLIER RUN: vocabulary map written\n" * 5)
    result = run_pipeline("--run-dir", str(run), "--model-path", str(stories260k), "--only", "03")
    assert result.returncode == 2
    shown = result.stdout.split("03_build_vocab_mapping failed")[1]
    assert "no such file; run 01_prepare_data.py first" in shown and "EARLIER RUN" not in shown, shown


@pytest.mark.parametrize("script", ["04_train.py", "05_benchmark.py", "run_pipeline.py"])
def test_a_missing_package_is_one_line_naming_it_and_the_setup(script, tmp_path):
    """The scripts run by a Python without the packages (-S: no site-packages, as a system Python without the
    setup's .venv): one line on stderr, no traceback. (04's --help needs no package: a run does.)"""
    args = ["--run-dir", str(tmp_path), "--model-path", "m"]
    result = subprocess.run([sys.executable, "-S", str(REPO / script), *args], capture_output=True, text=True,
                            timeout=60, cwd=str(REPO))
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"{script}: the Python package ") and "is missing from" in line
    assert "bash scripts/setup_env.sh" in line and ".venv/bin/python" in line


def test_unknown_flag_to_the_runner_is_named(tmp_path):
    result = run_pipeline("--run-dir", str(tmp_path), "--verifer-path", "x")
    assert result.returncode == 2 and "--verifer-path" in result.stderr and "did you mean" in result.stderr


def test_a_failing_stage_stops_the_pipeline_with_its_log_tail(tmp_path, stories260k):
    run = tmp_path / "run"
    result = run_pipeline("--run-dir", str(run), "--model-path", str(stories260k), "--dataset",
                          str(tmp_path / "missing.jsonl"))
    assert result.returncode == 2
    assert "01_prepare_data failed (exit 2)" in result.stdout and "missing.jsonl" in result.stdout
    assert not (run / "vocab").exists()


def test_ctrl_c_reaches_stage_04_once_and_it_stops_with_a_checkpoint(tmp_path, texts, stories260k):
    """A Ctrl-C (SIGINT to the runner's whole process group, as a terminal or `timeout -s INT` sends it) while
    stage 04 trains: the runner forwards it to the stage once; the stage finishes its step, saves a checkpoint
    and exits 130; the runner stops there; rerunning with --resume for stage 04 finishes the training."""
    import os
    import signal
    import time

    run = tmp_path / "run"
    common = ["--run-dir", str(run), "--model-path", str(stories260k), "--dataset", str(texts),
              "--draft-vocab-size", "100", "--skip", "05", "--epochs", "30", "--stage-args", "04",
              "--log-interval 1 --save-interval 100000 --eval-interval 100000 --num-workers 0 --min-steps 0"]
    runner = subprocess.Popen([sys.executable, str(REPO / "run_pipeline.py"), *common], cwd=str(REPO),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = run / "checkpoints" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and metrics.read_text().count('"train"') >= 2):  # stage 04 is training
        assert runner.poll() is None and time.time() < deadline, runner.stdout.read()[-3000:]
        time.sleep(0.2)
    os.killpg(runner.pid, signal.SIGINT)
    output, _ = runner.communicate(timeout=300)
    assert runner.returncode != 0 and "04_train: exit code 130" in output, output[-3000:]
    latest = json.loads((run / "checkpoints" / "latest.json").read_text())
    assert latest["step"] < latest["total_steps"]  # (here an epoch is a step or two: often an epoch_N)
    log = (run / "logs" / "04_train.log").read_text()
    assert log.count("SIGINT received") == 1  # once: a second signal would have stopped it without a checkpoint
    assert f"stopped after step {latest['step']} of {latest['total_steps']}, saved as {latest['checkpoint']}" in log

    resumed = run_pipeline(*common[:-1], common[-1] + " --resume", "--from-stage", "04")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    final = json.loads((run / "checkpoints" / "latest.json").read_text())
    assert final["step"] == final["total_steps"] == latest["total_steps"]


def test_progress_in_a_log_reports_the_end_once(tmp_path):
    """Under nohup (no terminal) progress goes to the log; an update that has just reported the last
    count is not repeated by the closing report, and a count reached between reports still is."""
    from eagle3_pipeline.progress import Progress
    from eagle3_pipeline.cli.stage import setup_logging

    setup_logging("progress_test", tmp_path)
    with Progress(total=4, desc="work", interval=0.0) as progress:
        progress.update(4)
    with Progress(total=4, desc="other", interval=3600.0) as progress:
        progress.update(4)
    lines = (tmp_path / "progress_test.log").read_text().splitlines()
    assert sum("work: 4/4 (100.0%)" in line for line in lines) == 1
    assert sum("other: 4/4 (100.0%)" in line for line in lines) == 1


def test_progress_in_a_log_is_never_silent_longer_than_its_interval(tmp_path):
    """A long item (a regeneration round, a big batch) still gets a line every interval, saying so."""
    import time

    from eagle3_pipeline.progress import Progress
    from eagle3_pipeline.cli.stage import setup_logging

    setup_logging("heartbeat_test", tmp_path)
    with Progress(total=3, desc="regenerate", unit="conv", interval=0.4) as progress:
        progress.update(1)
        time.sleep(1.5)  # one item that takes long: no update for ~4 intervals
        progress.update(2)
    lines = (tmp_path / "heartbeat_test.log").read_text().splitlines()
    waiting = [line for line in lines if "regenerate: 1/3" in line and "working, no item finished for" in line]
    assert len(waiting) >= 2, lines
    assert sum("regenerate: 3/3 (100.0%)" in line for line in lines) == 1
    time.sleep(0.6)  # closed: no more lines
    assert (tmp_path / "heartbeat_test.log").read_text().splitlines() == lines


def test_nproc_per_node_runs_stages_02_and_04_under_torchrun(tmp_path, texts, stories260k):
    """--nproc-per-node 2: stages 02 and 04 run as two ranks (CPU processes here) under torchrun, the others
    as one process, and the run finishes like a single-process one."""
    run = tmp_path / "run"
    result = run_pipeline("--run-dir", str(run), "--model-path", str(stories260k), "--dataset", str(texts),
                          "--draft-vocab-size", "100", "--skip", "05", "--epochs", "1", "--nproc-per-node", "2",
                          "--stage-args", "04", "--num-workers 0")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    commands = {line.split("=== ")[1].split(":")[0]: line for line in result.stdout.splitlines()
                if "=== " in line and ": /" in line}
    assert set(commands) == {"01_prepare_data", "02_extract_hidden_states", "03_build_vocab_mapping", "04_train"}
    for stage, line in commands.items():
        assert ("torch.distributed.run --standalone --nproc_per_node 2" in line) == (stage[:2] in ("02", "04"))
    assert "2 ranks; rank 0 extracts" in (run / "logs" / "02_extract_hidden_states.log").read_text()
    assert "grad-accum 1 x 2 rank(s)" in (run / "logs" / "04_train.log").read_text()
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] > 0
    assert run_pipeline("--run-dir", str(run), "--nproc-per-node", "0").returncode == 2


def test_online_run_skips_stage_02_and_reruns_skip_everything(tmp_path, texts, stories260k):
    """--online goes to stage 04 alone; stage 02 is not run (no hidden_states folder), --status says why, and
    the same command again skips every finished stage."""
    run = tmp_path / "run"
    common = ["--run-dir", str(run), "--model-path", str(stories260k), "--dataset", str(texts),
              "--draft-vocab-size", "100", "--skip", "05", "--epochs", "1", "--online",
              "--stage-args", "04", "--num-workers 0"]
    first = run_pipeline(*common)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "02_extract_hidden_states: not needed, skipped (stage 04 computes the verifier's states itself" \
        in first.stdout
    assert not (run / "hidden_states").exists()
    manifest = json.loads((run / "checkpoints" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["states"]["source"] == "online"
    assert "not needed (stage 04 computes the states: --online)" in run_pipeline("--run-dir", str(run),
                                                                                "--status").stdout
    second = run_pipeline(*common)
    assert second.returncode == 0 and second.stdout.count("complete with these flags, skipped") == 3, \
        second.stdout[-3000:]


def test_a_rerun_with_nothing_changed_skips_every_stage(tmp_path, stories260k):
    """Stages 01-05 on a CPU with the defaults the machine decides (stage 04's --pad-batches-to) and the values stage
    05 takes from the run directory; the same command again skips all five. Every flag a stage recorded with
    another value than its plain parse gives (a default resolved at run time) comes out of the stage's own parse,
    which the staleness check uses, as recorded."""
    from eagle3_pipeline.cli.parser import parse_stage_args
    from eagle3_pipeline.cli.pipeline import STAGES, in_run_terms, output_manifest, stage_parser
    from conftest import STORIES_TEMPLATE

    template = tmp_path / "stories.jinja"
    template.write_text(STORIES_TEMPLATE)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Tell me a story about the {thing} ({i})."},
        {"from": "gpt", "value": "Once upon a time there was a little girl."}]}) + "\n"
        for i, thing in enumerate(["ball", "dog", "tree", "car", "cake", "boat"] * 6)))
    run = tmp_path / "run"
    common = ["--run-dir", str(run), "--model-path", str(stories260k), "--dataset", str(chats), "--chat-template",
              str(template), "--eval-ratio", "0.15", "--draft-vocab-size", "256", "--epochs", "1", "--max-new-tokens",
              "16", "--num-prompts", "2", "--tau-only", "--num-workers", "0"]
    first = run_pipeline(*common)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = run_pipeline(*common)
    assert second.returncode == 0, second.stdout[-3000:]
    assert second.stdout.count("complete with these flags, skipped") == 5, second.stdout[-3000:]
    resolved_at_run_time = []
    for stage in STAGES:
        recorded = output_manifest(run, stage)["flags"]
        argv = ["--run-dir", str(run), *[a for a in common[2:]]]
        plain, own = parse_stage_args(stage, "", _stage_argv(stage, argv)), stage_parser(stage)(_stage_argv(stage, argv))
        for dest, value in vars(own).items():
            if in_run_terms(recorded.get(dest), recorded.get("run_dir")) != in_run_terms(getattr(plain, dest), str(run)):
                resolved_at_run_time.append((stage, dest))
                assert in_run_terms(value, str(run)) == in_run_terms(recorded.get(dest), recorded.get("run_dir")), \
                    (stage, dest, value, recorded.get(dest))
    assert ("04_train", "pad_batches_to") in resolved_at_run_time


def _stage_argv(stage: str, argv: list[str]) -> list[str]:
    """The part of a runner's command line that reaches `stage` (as run_pipeline.py routes it)."""
    from eagle3_pipeline.cli.pipeline import split_shared_flags, stage_argv

    shared = split_shared_flags(argv[2:], pytest.fail, [])
    return stage_argv(stage, argv[1], shared, {})
