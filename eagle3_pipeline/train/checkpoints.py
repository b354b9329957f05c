"""Checkpoints of stage 04: folders written atomically with their files' sizes and CRC32s, the latest/best
pointers and pruning, the newest whole checkpoint for --resume, and putting a checkpoint's weights, optimizer state
and RNG state back exactly (see docs/training.md)."""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.formats.checkpoint import CONFIG_FILE, WEIGHTS_FILE
from eagle3_pipeline.formats.disk_full import disk_full, is_disk_full
from eagle3_pipeline.formats.files import crc32_file, read_json, write_json_atomic
from eagle3_pipeline.formats.hidden_states import RECORD_FILE, read_record, record_files
from eagle3_pipeline.log import get_logger
from eagle3_pipeline.train.data import VAL_SPLIT_FILE
from eagle3_pipeline.train.metrics import METRICS_FILE

TRAINING_STATE = "training_state.pt"
TRAINER_STATE_JSON = "trainer_state.json"
LATEST, BEST = "latest", "best"
# What a checkpoint folder holds; RECORD_FILE (written last, as in stage 02's sample folders) has their sizes and
# CRC32s, which --resume compares.
CHECKPOINT_FILES = (CONFIG_FILE, WEIGHTS_FILE, TRAINING_STATE, TRAINER_STATE_JSON)
# Names only the writing of checkpoints and pointers uses: staging folders (and the drafter export's own inside
# them, "..step_N.tmp-PID.tmpPID"), the replaced folder, temporary links, copies and JSON files. What matches them
# is never a finished output.
STAGING_PATTERNS = (".step_*", ".epoch_*", "..step_*", "..epoch_*", f".{LATEST}*", f".{BEST}*")


def checkpoint_name(step: int, epoch_end: int | None = None) -> str:
    return f"epoch_{epoch_end}" if epoch_end is not None else f"step_{step:06d}"


class CheckpointManager:
    """Writes checkpoint folders atomically, keeps the latest/best pointers, prunes old step folders."""

    def __init__(self, root: str | Path, keep_last: int, is_main: bool = True,
                 validate: Callable[[Path], list[str]] | None = None):
        self.root = Path(root)
        self.keep_last = keep_last
        self.is_main = is_main
        self.validate = validate

    # writing
    def save(self, name: str, model: torch.nn.Module, training_state: dict[str, Any],
             summary: dict[str, Any]) -> Path:
        """root/name with the drafter, training_state.pt, trainer_state.json and the record of their sizes and
        CRC32s, renamed into place only when complete; then checked (check_drafter_dir) and pointed to by
        `latest`. A save that fails removes what it staged; a full disk is a DiskFull naming the bytes."""
        from eagle3_pipeline.model.checkpoint import save_drafter

        final = self.root / name
        if not self.is_main:
            return final
        staging = self.root / f".{name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        training = {k: summary.get(k) for k in ("checkpoint", "step", "epoch", "val_sim_accept_len")}
        training["ttt_positions"] = getattr(model, "ttt_positions", None)  # RoPE positions of the TTT steps
        training["ttt_steps"] = (summary.get("run_config") or {}).get("ttt_steps")  # the draft steps it learned
        try:
            save_drafter(model, staging, extra={"training": training})
            torch.save(training_state, staging / TRAINING_STATE)
            write_json_atomic(staging / TRAINER_STATE_JSON, summary)
            record_files(staging, CHECKPOINT_FILES)  # read back from the page cache: cheap beside the writing
            self._replace_dir(staging, final)
        except BaseException as err:  # (a second Ctrl-C too: nothing half-written stays behind)
            needed = checkpoint_bytes(model, training_state)
            full = isinstance(err, Exception) and is_disk_full(err, self.root, needed)
            shutil.rmtree(staging, ignore_errors=True)  # (on a full disk: the space it took, back)
            if full:
                raise disk_full(final, needed, f"checkpoint {name}", self.whole_so_far()) from None
            raise
        if self.validate is not None:
            problems = self.validate(final)
            if problems:
                raise RuntimeError(f"checkpoint {final} fails check_drafter_dir:\n  " + "\n  ".join(problems))
        self.point(LATEST, name, summary)
        return final

    def whole_so_far(self) -> str:
        latest = self.pointer_target(LATEST)
        return (f"The checkpoints saved before are whole{f' (latest: {latest})' if latest else ''}: free space or "
                f"move --output-dir to a larger disk, then rerun the same command with --resume.")

    def _replace_dir(self, staging: Path, final: Path) -> None:
        # A folder of the same name exists when a resumed run redoes a step that a crashed run saved
        # after its last `latest` update: the new one replaces it.
        if final.exists() or final.is_symlink():
            trash = self.root / f".{final.name}.old-{os.getpid()}"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final, trash)
            os.replace(staging, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, final)

    def point(self, pointer: str, name: str, summary: dict[str, Any]) -> None:
        """`pointer` -> root/name as a relative symlink (swapped atomically), or a copy of the drafter files
        where the filesystem has no symlinks; pointer.json names the target either way."""
        if not self.is_main:
            return
        link = self.root / pointer
        tmp_link = self.root / f".{pointer}.tmp-{os.getpid()}"
        try:
            if tmp_link.is_symlink() or tmp_link.exists():
                tmp_link.unlink()
            os.symlink(name, tmp_link, target_is_directory=True)
            if link.is_dir() and not link.is_symlink():
                shutil.rmtree(link)
            os.replace(tmp_link, link)
        except OSError:
            self._copy_pointer(link, self.root / name)
        write_json_atomic(self.root / f"{pointer}.json", {"checkpoint": name, **summary})

    def _copy_pointer(self, link: Path, target: Path) -> None:
        staging = self.root / f".{link.name}.copy-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            staging.mkdir(parents=True)
            for item in target.iterdir():  # the drafter alone: neither the training state nor its record
                if item.is_file() and item.name not in (TRAINING_STATE, RECORD_FILE):
                    shutil.copy2(item, staging / item.name)
            if link.is_symlink():
                link.unlink()
            self._replace_dir(staging, link)
        except Exception as err:
            shutil.rmtree(staging, ignore_errors=True)
            needed = sum(item.stat().st_size for item in target.iterdir() if item.is_file())
            if is_disk_full(err, self.root, needed):
                raise disk_full(link, needed, f"the copy of {target.name} that stands for `{link.name}` (this "
                                f"filesystem has no symlinks)", self.whole_so_far()) from None
            raise

    def prune(self) -> list[str]:
        """Delete step folders beyond the newest keep_last, never a target of latest or best."""
        if not self.is_main:
            return []
        protected = {self.pointer_target(LATEST), self.pointer_target(BEST)}
        steps = sorted((p for p in self.root.glob("step_*") if p.is_dir() and not p.is_symlink()),
                       key=lambda p: int(p.name.split("_")[1]))
        removed = []
        for path in steps[: max(len(steps) - self.keep_last, 0)]:
            if path.name not in protected:
                shutil.rmtree(path)
                removed.append(path.name)
        return removed

    # reading
    def pointer_target(self, pointer: str) -> str | None:
        path = self.root / f"{pointer}.json"
        if not path.exists():
            return None
        try:
            return read_json(path).get("checkpoint")
        except json.JSONDecodeError:
            return None

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, folder) of every finished checkpoint, oldest first."""
        found = []
        for path in list(self.root.glob("step_*")) + list(self.root.glob("epoch_*")):
            summary = path / TRAINER_STATE_JSON
            if path.is_dir() and not path.is_symlink() and summary.exists() and (path / TRAINING_STATE).exists():
                try:
                    found.append((int(read_json(summary)["step"]), path))
                except (json.JSONDecodeError, UnicodeDecodeError, KeyError, ValueError, TypeError):
                    continue
        return sorted(found, key=lambda item: (item[0], item[1].name.startswith("epoch")))

    def resume_point(self, log=None, step: int | None = None) -> Path | None:
        """The newest whole checkpoint (the `latest` pointer may lag one that was renamed into place just before
        a crash): newer damaged ones are passed over, named in a warning on `log`. With `step`, that step's
        checkpoint, or a UsageError naming what is wrong with it. A UsageError too when every checkpoint is
        damaged; None when there is none."""
        found = self.complete_checkpoints()
        if step is not None:
            return self._exact_point(step, found)
        # folders without a readable summary or training state: no step to order them by, named whatever their age
        unreadable = [path for path in self._checkpoint_folders() if path not in {folder for _, folder in found}]
        damaged = [(path, checkpoint_problems(path) or [f"{path / TRAINER_STATE_JSON}: unreadable"])
                   for path in unreadable]
        for _, folder in reversed(found):
            problems = checkpoint_problems(folder)
            if not problems:
                if damaged and log is not None:
                    log.warning("--resume: %s; resuming from the newest whole checkpoint, %s (the steps after it are "
                                "trained again)", describe_damage(damaged), folder)
                return folder
            damaged.append((folder, problems))
        if damaged:
            raise UsageError(f"--resume: no whole checkpoint in {self.root}: {describe_damage(damaged)}. Start over "
                             f"with --overwrite (or another --output-dir)")
        return None

    def _exact_point(self, step: int, found: list[tuple[int, Path]]) -> Path:
        folders = [folder for number, folder in found if number == step]
        if not folders:
            raise UsageError(f"--resume at step {step}: {self.root} has no checkpoint of that step (it has steps "
                             f"{', '.join(str(number) for number, _ in found) or 'none'})")
        problems = checkpoint_problems(folders[-1])
        if problems:
            raise UsageError(f"--resume at step {step}: {describe_damage([(folders[-1], problems)])}; choose "
                             f"another step, or resume from the newest whole checkpoint without giving one")
        return folders[-1]

    def _checkpoint_folders(self) -> list[Path]:
        return [path for pattern in ("step_*", "epoch_*") for path in self.root.glob(pattern)
                if path.is_dir() and not path.is_symlink()]

    def remove_staging_leftovers(self) -> list[str]:
        """Remove what a save that was killed (or failed without cleaning up) staged: `.step_N.tmp-PID` folders
        and the like. Only for the folder's one writer, which holds its lock; returns the names removed."""
        removed = []
        for pattern in STAGING_PATTERNS:
            for path in self.root.glob(pattern):
                _remove(path)
                removed.append(path.name)
        return removed

    def has_outputs(self) -> bool:
        names = ("step_*", "epoch_*", LATEST, BEST, f"{LATEST}.json", f"{BEST}.json", METRICS_FILE)
        return any(any(self.root.glob(pattern)) for pattern in names)

    def clear(self) -> None:
        """--overwrite: remove what a previous run of this stage wrote here (and nothing else)."""
        for pattern in ("step_*", "epoch_*", *STAGING_PATTERNS, LATEST, BEST, f"{LATEST}.json", f"{BEST}.json",
                        METRICS_FILE, VAL_SPLIT_FILE, "tensorboard"):
            for path in self.root.glob(pattern):
                _remove(path)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def checkpoint_problems(folder: Path) -> list[str]:
    """Why `folder` cannot be resumed from (empty when it is whole): a file missing, or of another size or CRC32
    than recorded when it was saved. Checkpoints saved before records existed: a file missing or empty, or one
    that does not open (flipped bytes in such a checkpoint go unnoticed)."""
    missing = [f"{folder / name}: missing" for name in CHECKPOINT_FILES if not (folder / name).is_file()]
    if missing:
        return missing
    if not (folder / RECORD_FILE).exists():
        return _unrecorded_problems(folder)
    record = read_record(folder)
    if record is None:
        return [f"{folder / RECORD_FILE}: unreadable"]
    problems = []
    for name, written in record.items():
        path = folder / name
        size = path.stat().st_size if path.is_file() else None
        if size != written.get("bytes"):
            problems.append(f"{path}: {'missing' if size is None else f'{size} bytes'}, {written.get('bytes')} "
                            f"were written")
            continue
        found = crc32_file(path)
        if found != written.get("crc32"):
            problems.append(f"{path}: its bytes changed after it was written (CRC32 {found:08x}, "
                            f"{int(written.get('crc32') or 0):08x} recorded)")
    return problems


def _unrecorded_problems(folder: Path) -> list[str]:
    """The checks a checkpoint without a record allows: no empty file, and both binary files open (a cut-short
    safetensors file fails its header's length check, a cut-short torch file its zip directory)."""
    from safetensors import safe_open

    empty = [f"{folder / name}: empty" for name in CHECKPOINT_FILES if (folder / name).stat().st_size == 0]
    if empty:
        return empty
    problems = []
    try:
        with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as handle:
            handle.keys()
    except Exception as err:  # noqa: BLE001 - whatever the reader says, the file is not whole
        problems.append(f"{folder / WEIGHTS_FILE}: does not open ({str(err)[:200]})")
    try:
        torch.load(folder / TRAINING_STATE, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001
        problems.append(f"{folder / TRAINING_STATE}: does not open ({str(err)[:200]})")
    return problems


def describe_damage(damaged: list[tuple[Path, list[str]]]) -> str:
    return "; ".join(f"checkpoint {folder.name} is damaged ({', '.join(problems)})" for folder, problems in damaged)


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in a nested state (dicts, lists, tuples): about what torch.save writes of it."""
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    return 0


def checkpoint_bytes(model: torch.nn.Module, training_state: dict[str, Any]) -> int:
    """About the bytes a checkpoint of `model` takes: the exported tensors and the training state."""
    from eagle3_pipeline.formats.checkpoint import expected_tensor_specs

    state = model.state_dict()
    exported = sum(tensor_bytes(state[name]) for name in expected_tensor_specs(model.config) if name in state)
    return exported + tensor_bytes(training_state)


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """optimizer.load_state_dict, then the saved dtypes back: torch casts every floating state tensor to its
    parameter's dtype on load, which would turn the fp32 moments and master weights of bf16 parameters into
    bf16 (a resumed run would then drift from the original)."""
    optimizer.load_state_dict(saved)
    saved_ids = [i for group in saved["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for param_id, param in zip(saved_ids, params):
        for key, value in saved["state"].get(param_id, {}).items():
            current = optimizer.state[param].get(key)
            if torch.is_tensor(value) and torch.is_tensor(current) and current.dtype != value.dtype:
                optimizer.state[param][key] = value.to(device=current.device)


def load_weights_exactly(model: torch.nn.Module, folder: Path) -> None:
    """Put a checkpoint's exported tensors back into `model`, refusing any dtype change (which would make a
    resumed run differ from the run it continues). The exported file holds every trainable tensor in the
    parameters' own dtype, and fp32 master weights (for bf16 runs) live in the optimizer state."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    own = dict(model.named_parameters()) | dict(model.named_buffers())
    missing = [name for name, p in model.named_parameters() if p.requires_grad and name not in tensors]
    if missing:
        raise ValueError(f"{folder}/model.safetensors lacks trainable tensors {missing}")
    with torch.no_grad():
        for name, value in tensors.items():
            if name not in own:
                continue
            if own[name].dtype != value.dtype:
                raise ValueError(f"{folder}/model.safetensors holds {name} as {value.dtype} but this run's drafter "
                                 f"is {own[name].dtype}; resume with the original --dtype")
            own[name].copy_(value)


def capture_rng_state() -> dict[str, Any]:
    """Every RNG the training draws on, in a form torch.load(weights_only=True) reads back."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy(), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            get_logger().warning("checkpoint has CUDA RNG states for %d GPUs, %d visible: CUDA RNG not "
                                 "restored (noise draws will differ from the original run)",
                                 len(state["cuda"]), torch.cuda.device_count())


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
