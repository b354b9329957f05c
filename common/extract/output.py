"""Stage 02's output folder: what is already there (resume), what it owns (--overwrite), its lock, and the
rules for reusing an earlier run's samples."""
from __future__ import annotations

import fcntl
import os
import re
import shutil
from pathlib import Path
from typing import Any, Sequence

from common.cli.errors import UsageError
from common.formats.hidden_states import INDEX_FILE, TMP_PREFIX, is_complete_sample
from common.formats.manifest import MANIFEST
from common.formats.prepared_data import Sample

LOCK_FILE = ".lock"


def scan_output(output_dir: Path, samples: Sequence[Sample], clean: bool = True) -> set[int]:
    """Indices of samples already complete on disk; with `clean`, remove temp folders and incomplete samples."""
    complete: set[int] = set()
    by_shard: dict[str, dict[str, int]] = {}
    for index, sample in enumerate(samples):
        shard, name = sample.rel_path.split("/")
        by_shard.setdefault(shard, {})[name] = index
    for shard, names in by_shard.items():
        shard_dir = output_dir / shard
        if not shard_dir.is_dir():
            continue
        with os.scandir(shard_dir) as entries:
            for entry in entries:
                if entry.name.startswith(TMP_PREFIX):
                    if clean:
                        shutil.rmtree(entry.path, ignore_errors=True)
                    continue
                index = names.get(entry.name)
                if index is None or not entry.is_dir():
                    continue
                if is_complete_sample(Path(entry.path)):
                    complete.add(index)
                elif clean:
                    shutil.rmtree(entry.path, ignore_errors=True)
    return complete


def owned_entries(output_dir: Path) -> list[Path]:
    """What an earlier extraction wrote here (removed by --overwrite; nothing else in the folder is touched)."""
    if not output_dir.is_dir():
        return []
    owned = [p for p in output_dir.iterdir()
             if (p.is_dir() and re.fullmatch(r"shard_\d{5}", p.name)) or p.name in (INDEX_FILE, MANIFEST)]
    return sorted(owned)


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def remove_owned(output_dir: Path) -> int:
    entries = owned_entries(output_dir)
    for path in entries:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return len(entries)


class OutputLock:
    """An exclusive lock on the output folder, so two runs never write into the same samples."""

    def __init__(self, output_dir: Path):
        self.path = output_dir / LOCK_FILE
        self.handle = None

    def __enter__(self) -> "OutputLock":
        self.handle = open(self.path, "a+")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.seek(0)
            holder = self.handle.read().strip() or "unknown"
            self.handle.close()
            raise UsageError(f"{self.path.parent}: another extraction (pid {holder}) is writing here; wait for "
                             f"it or use another --output-dir")
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(str(os.getpid()))
        self.handle.flush()
        return self

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            self.handle.close()


def check_writable(output_dir: Path) -> None:
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".write_test_{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"--output-dir {output_dir} is not writable ({err}); choose a folder you can write")


# Per sample besides the tensors: five torch.save headers (~1.5 KB each), the unused tail of each file's last

# --- resume / reuse rules ---------------------------------------------------------------------------------

def resume_key(manifest: dict[str, Any]) -> dict[str, Any]:
    """What must be equal for existing samples to be reused: everything that changes their content."""
    verifier = dict(manifest.get("verifier") or {})
    verifier.pop("path", None)
    return {
        "format_version": manifest.get("format_version"),
        "aux_layers": manifest.get("aux_layers"),
        "dtype": manifest.get("dtype"),
        "compute_dtype": manifest.get("compute_dtype"),
        "max_seq_len": (manifest.get("flags") or {}).get("max_seq_len"),
        "verifier": verifier,
        "verifier_path": manifest.get("verifier_resolved_path"),
        "prepared_data_sha256": ((manifest.get("inputs") or {}).get("prepared_data") or {}).get("sha256"),
    }

