"""Locks between stages (eagle3_pipeline/cli/lock.py): `--overwrite` of a folder another stage reads is refused, and so
is a stage run by hand in a run directory that run_pipeline.py holds. Real stages on stories260K in real processes:
a training paused with SIGSTOP holds its reader lock as a long training would; one killed with SIGKILL leaves a
stale record that the next overwrite removes."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, run_script

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# Stage 04 for far longer than a test lasts; it is paused or killed before it ends.
LONG_TRAINING = ["--epochs", "1000", "--log-interval", "1", "--save-interval", "1000000", "--eval-interval",
                 "1000000", "--num-workers", "0", "--min-steps", "0"]


def run_pipeline(*args: str):
    return subprocess.run([sys.executable, str(REPO / "run_pipeline.py"), *args], capture_output=True, text=True,
                          timeout=600, cwd=str(REPO), env={**os.environ, **ONE_THREAD})


@pytest.fixture(scope="module")
def prepared_run(stories260k, tmp_path_factory) -> tuple[Path, list[str]]:
    """Stages 01, 02 and 03 run by the runner; returns the run directory and the runner's flags."""
    folder = tmp_path_factory.mktemp("locks")
    texts = folder / "stories.jsonl"
    texts.write_text("".join(json.dumps({"text": f"Once upon a time a little {animal} liked to {verb} all day."})
                             + "\n" for animal in ("cat", "dog", "bird", "frog") for verb in ("run", "sing", "jump")))
    run = folder / "run"
    flags = ["--model-path", str(stories260k), "--dataset", str(texts), "--draft-vocab-size", "100"]
    done = run_pipeline("--run-dir", str(run), *flags, "--skip", "04", "--skip", "05")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run, flags


@pytest.fixture()
def run(prepared_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(prepared_run[0], copy)
    return copy


def contents(folder: Path) -> dict[str, str]:
    """Every file of a stage's output (its lock records and logs aside) and a hash of its bytes."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file() and not path.name.startswith(".")
            and ".readers" not in path.parts and "logs" not in path.parts}


def wait_until_training(process: subprocess.Popen, checkpoints: Path) -> None:
    metrics = checkpoints / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and '"train"' in metrics.read_text()):
        assert process.poll() is None and time.time() < deadline, "stage 04 stopped before it trained"
        time.sleep(0.2)


def holder_named(output: str, pid: int) -> bool:
    """The message names the pid, the host and the start time."""
    return re.search(rf"pid {pid} on host {re.escape(socket.gethostname())}, started \d{{4}}-\d\d-\d\dT", output) \
        is not None


def children_of(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:  # it has exited
        return []


def test_overwrite_is_refused_while_stage_04_reads_and_goes_ahead_once_the_reader_is_killed(run, stories260k,
                                                                                          tmp_path):
    verifier = ["--run-dir", str(run), "--model-path", str(stories260k)]
    extract = [*verifier, "--device", "cpu", "--num-workers", "0"]
    trainer = subprocess.Popen([sys.executable, str(REPO / "04_train.py"), *verifier, *LONG_TRAINING],
                               cwd=str(REPO), env={**os.environ, **ONE_THREAD},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_training(trainer, run / "checkpoints")
        os.kill(trainer.pid, signal.SIGSTOP)  # a long training: it holds its locks and does nothing
        states, vocab = contents(run / "hidden_states"), contents(run / "vocab")

        refused = run_script("02_extract_hidden_states.py", *extract, "--overwrite", env=ONE_THREAD)
        output = refused.stdout + refused.stderr
        assert refused.returncode == 2, output[-3000:]
        assert holder_named(output, trainer.pid) and "04_train" in output, output[-3000:]
        assert contents(run / "hidden_states") == states  # nothing deleted

        refused = run_script("03_build_vocab_mapping.py", *verifier, "--draft-vocab-size", "100", "--overwrite")
        output = refused.stdout + refused.stderr
        assert refused.returncode == 2 and holder_named(output, trainer.pid), output[-3000:]
        assert contents(run / "vocab") == vocab

        # A writer that does not overwrite is not the reader's business: stage 02 finds its output complete.
        again = run_script("02_extract_hidden_states.py", *extract, env=ONE_THREAD)
        assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
        # Readers never block each other: a second training on the same states runs to its end.
        second = run_script("04_train.py", *verifier, "--output-dir", str(tmp_path / "second"), "--epochs", "1",
                            "--num-workers", "0", "--min-steps", "0", env=ONE_THREAD)
        assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    finally:
        trainer.kill()  # SIGKILL: its reader records stay behind, its flocks go with it
        trainer.wait()

    proceeds = run_script("02_extract_hidden_states.py", *extract, "--overwrite", env=ONE_THREAD)
    output = proceeds.stdout + proceeds.stderr
    assert proceeds.returncode == 0, output[-3000:]
    assert "removing the record of a reader that stopped without releasing it" in output
    assert f"pid {trainer.pid}" in output
    assert json.loads((run / "hidden_states" / "manifest.json").read_text())["status"] == "complete"
    assert list((run / "hidden_states" / ".readers").glob("*.json")) == []


def test_a_stage_run_by_hand_in_a_run_directory_the_runner_holds_is_refused(run, prepared_run, stories260k):
    runner = subprocess.Popen([sys.executable, str(REPO / "run_pipeline.py"), "--run-dir", str(run),
                               *prepared_run[1], "--skip", "05", "--stage-args", "04", " ".join(LONG_TRAINING)],
                              cwd=str(REPO), env={**os.environ, **ONE_THREAD}, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_training(runner, run / "checkpoints")  # the runner's own stage 04 runs in the held directory
        vocab = contents(run / "vocab")
        by_hand = run_script("03_build_vocab_mapping.py", "--run-dir", str(run), "--model-path", str(stories260k),
                             "--draft-vocab-size", "100", "--overwrite")
        output = by_hand.stdout + by_hand.stderr
        assert by_hand.returncode == 2, output[-3000:]
        assert "run_pipeline.py" in output and holder_named(output, runner.pid), output[-3000:]
        # Inside the run directory through --output-dir alone, too.
        by_hand = run_script("03_build_vocab_mapping.py", "--prepared-data", str(run / "data"), "--output-dir",
                             str(run / "vocab"), "--model-path", str(stories260k), "--draft-vocab-size", "100")
        output = by_hand.stdout + by_hand.stderr
        assert by_hand.returncode == 2 and holder_named(output, runner.pid), output[-3000:]
        assert contents(run / "vocab") == vocab
    finally:
        for child in children_of(runner.pid):
            os.kill(child, signal.SIGKILL)
        runner.kill()
        runner.wait()

    # The runner is gone (killed: its lock record stays): the same stage runs.
    after = run_script("03_build_vocab_mapping.py", "--run-dir", str(run), "--model-path", str(stories260k),
                       "--draft-vocab-size", "100", "--overwrite")
    assert after.returncode == 0, (after.stdout + after.stderr)[-3000:]
