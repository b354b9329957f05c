"""Nothing lost, nothing misread (issue 41, items 2, 3 and 6): damaged checkpoints, damaged hidden-state files,
NaN in validation, and full disks, on real stage 02 and 04 runs of stories260K.

A full disk is a real tmpfs where this machine lets an unprivileged user mount one (unshare), and an injected
fault otherwise: torch.save replaced by a writer that stops half-way with ENOSPC, as a full disk stops it.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.formats.files import read_json
from eagle3_pipeline.formats.hidden_states import AUX_FILES, RECORD_FILE, open_hidden_states, verify_sample
from eagle3_pipeline.train.checkpoints import CheckpointManager
from conftest import REPO
from test_extract import assert_same_files, extract, stage_log, write_prepared_data
from test_train import RESUME_FLAGS, _load_module, build_run, crash_at, final_weights, log_text, train_argv

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# RESUME_FLAGS: 12 steps, checkpoints at steps 4, 6 (epoch_1), 8 and 12 (epoch_2), --keep-last 1. Crashed after
# step 10, the folder holds epoch_1 (step 6) and step_000008, which `latest` names.
CRASH_STEP = 10
LATEST, OLDER = "step_000008", "epoch_1"


@pytest.fixture(scope="module")
def stage04():
    return _load_module("stage04_train", "04_train.py")


@pytest.fixture(scope="module")
def run(stories260k, tmp_path_factory) -> Path:
    return build_run(stories260k, tmp_path_factory.mktemp("run"), seed=0)


@pytest.fixture(scope="module")
def whole(run, stories260k, stage04, tmp_path_factory) -> Path:
    """The uninterrupted run every resumed one must end equal to."""
    out = tmp_path_factory.mktemp("whole") / "out"
    assert stage04.main(train_argv(run, out, stories260k, **RESUME_FLAGS)) == 0
    return out


@pytest.fixture(scope="module")
def crashed(run, stories260k, stage04, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("crashed") / "out"
    assert stage04.main(train_argv(run, out, stories260k, **RESUME_FLAGS), hooks=[crash_at(CRASH_STEP)]) == 1
    assert read_json(out / "latest.json")["checkpoint"] == LATEST
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("step_", "epoch_"))) == [OLDER, LATEST]
    return out


def copy_of(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "out"
    shutil.copytree(folder, target, symlinks=True)
    return target


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_byte(path: Path) -> None:
    """One byte changed in the middle of the file (tensor data in both formats): the size stays, and the file
    still loads, with another value in it."""
    content = bytearray(path.read_bytes())
    content[len(content) // 2] ^= 0x40
    path.write_bytes(bytes(content))


def last_run(out: Path) -> str:
    """The log of the stage's last run in `out` (a copied folder holds the crashed run's log before it)."""
    text = log_text(out)
    return text[text.rfind("04_train starting"):]


def last_error(out: Path) -> str:
    text = log_text(out)
    return text[text.rfind(" ERROR "):]


def assert_same_weights(out: Path, reference: Path) -> None:
    expected, got = final_weights(reference), final_weights(out)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7, msg=name)


# --- item 2: a damaged latest checkpoint ---------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("damage", [truncate, flip_byte], ids=["truncated", "flipped"])
@pytest.mark.parametrize("name", ["training_state.pt", "model.safetensors"])
def test_resume_passes_over_a_damaged_latest_checkpoint(crashed, whole, run, stories260k, stage04, tmp_path, name,
                                                        damage):
    """The damaged file is named, the run resumes from the newest whole checkpoint, and ends as the uninterrupted
    run ends (the steps after that checkpoint trained again)."""
    out = copy_of(crashed, tmp_path)
    damage(out / LATEST / name)
    assert stage04.main(train_argv(run, out, stories260k, resume=True, **RESUME_FLAGS)) == 0
    text = last_run(out)
    assert f"checkpoint {LATEST} is damaged ({out / LATEST / name}:" in text
    assert f"resuming from the newest whole checkpoint, {out / OLDER}" in text
    assert f"resumed from {out / OLDER}: step 6" in text
    assert "Traceback" not in text
    assert_same_weights(out, whole)


@pytest.mark.slow
def test_checkpoints_saved_before_records_still_resume_and_a_cut_one_is_passed_over(crashed, whole, run, stories260k,
                                                                                   stage04, tmp_path):
    """Checkpoints without files.json: whole ones resume as before; a cut-short one fails to open and is passed
    over (flipped bytes in them cannot be seen: nothing recorded to compare)."""
    out = copy_of(crashed, tmp_path)
    for record in out.glob(f"*/{RECORD_FILE}"):
        record.unlink()
    saved = tmp_path / "saved"
    shutil.copytree(out, saved, symlinks=True)
    assert stage04.main(train_argv(run, out, stories260k, resume=True, **RESUME_FLAGS)) == 0
    assert f"resumed from {out / LATEST}: step 8" in log_text(out)
    assert_same_weights(out, whole)

    truncate(saved / LATEST / "training_state.pt")
    assert stage04.main(train_argv(run, saved, stories260k, resume=True, **RESUME_FLAGS)) == 0
    text = log_text(saved)
    assert f"{saved / LATEST / 'training_state.pt'}: does not open" in text
    assert f"resumed from {saved / OLDER}: step 6" in text
    assert_same_weights(saved, whole)


@pytest.mark.slow
def test_every_checkpoint_damaged_is_refused_naming_each(crashed, run, stories260k, stage04, tmp_path):
    out = copy_of(crashed, tmp_path)
    truncate(out / LATEST / "model.safetensors")
    flip_byte(out / OLDER / "training_state.pt")
    assert stage04.main(train_argv(run, out, stories260k, resume=True, **RESUME_FLAGS)) == 2
    error = last_error(out)
    assert f"no whole checkpoint in {out}" in error and "--overwrite" in error
    assert str(out / LATEST / "model.safetensors") in error and str(out / OLDER / "training_state.pt") in error
    assert (out / LATEST).is_dir() and (out / OLDER).is_dir()  # nothing removed


@pytest.mark.slow
def test_an_exact_step_that_is_damaged_is_refused_by_name(crashed, tmp_path):
    out = copy_of(crashed, tmp_path)
    flip_byte(out / LATEST / "model.safetensors")
    manager = CheckpointManager(out, keep_last=1)
    damaged = f"step 8: checkpoint {LATEST} is damaged ({out / LATEST / 'model.safetensors'}: its bytes changed"
    with pytest.raises(UsageError, match=re.escape(damaged)):
        manager.resume_point(step=8)
    with pytest.raises(UsageError, match="no checkpoint of that step"):
        manager.resume_point(step=7)
    assert manager.resume_point(step=6) == out / OLDER


# --- item 3: hidden states damaged in place, NaN in validation -----------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_a_hidden_state_file_damaged_in_place_is_found_by_its_checksum(stories260k, stage04, tmp_path, workers):
    """Same size, other bytes: stage 04 compares the CRC32 stage 02 recorded the first time it reads the sample,
    and stops naming the sample, the file and `--verify` (also when a loader worker read it)."""
    run = build_run(stories260k, tmp_path / "run", seed=5)
    data = run / "hidden_states"
    entry = open_hidden_states(data)[1][7]
    damaged = data / entry["path"] / AUX_FILES[0]
    size = damaged.stat().st_size
    flip_byte(damaged)
    assert damaged.stat().st_size == size
    out = tmp_path / "out"
    assert stage04.main(train_argv(run, out, stories260k, epochs=1, num_workers=workers)) == 1
    error = last_error(out)
    assert f"sample {entry['id']!r}" in error and f"{AUX_FILES[0]}: CRC32" in error
    assert f"--output-dir {data} --verify" in error
    assert "Traceback" not in error and "extract again" not in error


@pytest.mark.slow
def test_nan_in_validation_is_an_error_naming_the_sample_not_a_best_checkpoint(stories260k, stage04, tmp_path):
    """A validation sample whose stored states hold NaN, in a folder written before records (nothing to compare
    its checksum with): the first validation stops the run naming it and `--verify`; no best is chosen."""
    from eagle3_pipeline.train.data import split_train_val

    run = build_run(stories260k, tmp_path / "run", seed=6)
    data = run / "hidden_states"
    entries = open_hidden_states(data)[1]
    _, val_positions = split_train_val([str(e["id"]) for e in entries], 0.15, 0)
    entry = entries[val_positions[0]]
    folder = data / entry["path"]
    values = torch.load(folder / AUX_FILES[1], weights_only=True)
    values[2, 5] = float("nan")
    torch.save(values, folder / AUX_FILES[1])
    (folder / RECORD_FILE).unlink()  # as stage 02 wrote samples before it recorded checksums
    out = tmp_path / "out"
    assert stage04.main(train_argv(run, out, stories260k, epochs=1, eval_interval=2, save_interval=100)) == 1
    error = last_error(out)
    assert "validation at step 2: loss nan" in error
    assert f"Samples with NaN/inf in their stored hidden states: {entry['id']!r}" in error
    assert f"--output-dir {data} --verify" in error and "Traceback" not in error
    assert not (out / "best.json").exists() and not list(out.glob("step_*"))


# --- item 6: full disks ---------------------------------------------------------------------------------------

def enospc_after(calls: int, original):
    """Injected fault: a torch.save that, from its `calls`-th call on, writes half the bytes and then fails with
    ENOSPC, as a write to a full disk does."""
    count = {"n": 0}

    def save(obj, path, *args, **kwargs):
        count["n"] += 1
        if count["n"] < calls:
            return original(obj, path, *args, **kwargs)
        original(obj, path, *args, **kwargs)
        truncate(Path(path))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return save


@pytest.mark.slow
def test_a_checkpoint_save_on_a_full_disk_says_so_and_leaves_no_staging_folder(whole, run, stories260k, stage04,
                                                                              tmp_path, monkeypatch):
    """The third save (step 8) meets ENOSPC (injected): exit 1 with the path, the bytes needed and free; its
    staging folder is gone; the checkpoints saved before stay whole, and --resume ends as the uninterrupted run."""
    out = tmp_path / "out"
    monkeypatch.setattr(torch, "save", enospc_after(3, torch.save))
    assert stage04.main(train_argv(run, out, stories260k, **RESUME_FLAGS)) == 1
    monkeypatch.undo()
    error = last_error(out)
    assert f"no space left on the device of {out / LATEST} while writing checkpoint {LATEST}: it needs about" in error
    assert " is free there" in error and "--resume" in error and "Traceback" not in error
    assert [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != ".lock"] == []
    assert not (out / LATEST).exists() and read_json(out / "latest.json")["checkpoint"] == OLDER
    assert stage04.main(train_argv(run, out, stories260k, resume=True, **RESUME_FLAGS)) == 0
    assert_same_weights(out, whole)


@pytest.mark.slow
def test_the_next_start_removes_what_a_killed_save_left(crashed, whole, run, stories260k, stage04, tmp_path):
    """What a save killed mid-way leaves (made here by hand, as SIGKILL leaves it): the staging folder, the drafter
    export's own staging inside the folder, a half-swapped pointer. The next start removes them and says so."""
    out = copy_of(crashed, tmp_path)
    staging = out / f".step_000012.tmp-{4_000_000}"
    shutil.copytree(out / LATEST, staging)
    inner = out / f"..step_000012.tmp-{4_000_000}.tmp{4_000_000}"
    inner.mkdir()
    (inner / "model.safetensors").write_bytes(b"\0" * 1000)
    os.symlink(LATEST, out / ".latest.tmp-4000000")
    assert stage04.main(train_argv(run, out, stories260k, resume=True, **RESUME_FLAGS)) == 0
    assert "removed what earlier checkpoint saves left half-written" in log_text(out)
    assert [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != ".lock"] == []
    assert_same_weights(out, whole)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_stage02_on_a_full_disk_says_so_and_keeps_what_was_whole(stories260k, tmp_path, monkeypatch, workers):
    """ENOSPC (injected) in the fourth sample's writing, in the stage's own process or a writer process: exit 1
    naming the disk, no temporary folder left, the samples written before whole; a rerun completes the output as
    an uninterrupted run writes it."""
    data = write_prepared_data(tmp_path / "data", stories260k, [12, 20, 9, 16, 11, 14])
    flags = ("--aux-layers", "1,2,4", "--batch-size", "2", "--num-workers", str(workers))
    reference = tmp_path / "reference"
    assert extract(stories260k, data, reference, *flags) == 0
    out = tmp_path / "out"
    monkeypatch.setattr(torch, "save", enospc_after(3 * (len(AUX_FILES) + 2) + 2, torch.save))
    assert extract(stories260k, data, out, *flags) == 1
    monkeypatch.undo()
    text = stage_log(out)
    error = text[text.rfind(" ERROR "):]
    assert f"no space left on the device of {out}" in error and "while writing the hidden states of" in error
    assert "it needs about" in error and " is free there" in error and "rerun the same command" in error
    assert "Traceback" not in error
    assert not list(out.glob("shard_*/.tmp_*"))
    written = [folder for folder in out.glob("shard_*/*") if folder.is_dir()]
    assert written and all(verify_sample(folder) == [] for folder in written)
    assert extract(stories260k, data, out, *flags) == 0
    assert_same_files(out, reference)


def _can_mount_tmpfs() -> bool:
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
def test_a_real_full_disk_in_stage04(whole, run, stories260k, tmp_path):
    """A 2.6 MB tmpfs as --output-dir (mounted in a user namespace, where the machine allows it): the save of
    step 8 finds the disk full, as torch.save and safetensors report it (no errno). The stage says so, leaves no
    staging folder; with the tmpfs made larger, --resume ends as the uninterrupted run."""
    if shutil.which("unshare") is None or not _can_mount_tmpfs():
        pytest.skip("no unprivileged tmpfs here (unshare --user --mount)")
    out = tmp_path / "tmpfs"
    out.mkdir()
    copy = tmp_path / "copy"
    argv = " ".join(map(str, train_argv(run, out, stories260k, allow_low_disk=True, **RESUME_FLAGS)))
    script = (f"mount -t tmpfs -o size=2600k tmpfs {out} && cd {REPO} && "
              f"OMP_NUM_THREADS=1 {sys.executable} 04_train.py {argv} > {tmp_path / 'first.txt'} 2>&1; "
              f"echo $? > {tmp_path / 'first_rc'}; ls -a {out} > {tmp_path / 'left.txt'}; "
              f"mount -o remount,size=20m {out} && "
              f"OMP_NUM_THREADS=1 {sys.executable} 04_train.py {argv} --resume > {tmp_path / 'second.txt'} 2>&1; "
              f"echo $? > {tmp_path / 'second_rc'}; cp -rL {out}/latest {copy}")
    subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], timeout=600)
    first = (tmp_path / "first.txt").read_text()
    assert (tmp_path / "first_rc").read_text().strip() == "1", first[-3000:]
    assert "no space left on the device of" in first and "while writing checkpoint" in first, first[-3000:]
    assert "Traceback" not in first
    left = (tmp_path / "left.txt").read_text().split()
    assert [name for name in left if name.startswith(".") and name not in (".", "..", ".lock")] == []
    assert (tmp_path / "second_rc").read_text().strip() == "0", (tmp_path / "second.txt").read_text()[-3000:]
    from safetensors.torch import load_file

    expected, got = final_weights(whole), load_file(str(copy / "model.safetensors"))
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7, msg=name)
