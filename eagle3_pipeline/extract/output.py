"""Stage 02's output folder: what is already there (resume, with damaged samples found and redone), what it owns
(--overwrite), and the rules for reusing an earlier run's samples."""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Sequence

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.formats.hidden_states import INDEX_FILE, TMP_PREFIX, sample_problem
from eagle3_pipeline.formats.storage import format_of_manifest
from eagle3_pipeline.formats.manifest import MANIFEST
from eagle3_pipeline.formats.prepared_data import Sample

MAX_LISTED = 20  # damaged samples named one by one in the log; the rest are counted


def scan_output(output_dir: Path, samples: Sequence[Sample], clean: bool = True) -> set[int]:
    """Indices of samples already whole on disk; with `clean`, remove temp folders and the samples that are not
    whole (missing, empty, short or unreadable files), naming each in the log: the run redoes them."""
    complete: set[int] = set()
    damaged: list[str] = []
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
                problem = sample_problem(Path(entry.path))
                if problem is None:
                    complete.add(index)
                elif clean:
                    damaged.append(f"{samples[index].id!r} ({shard}/{entry.name}): {problem}")
                    shutil.rmtree(entry.path, ignore_errors=True)
    if damaged:
        report_damaged(output_dir, damaged)
    return complete


def report_damaged(output_dir: Path, damaged: list[str]) -> None:
    listed = "\n  ".join(damaged[:MAX_LISTED])
    more = f"\n  ... and {len(damaged) - MAX_LISTED} more" if len(damaged) > MAX_LISTED else ""
    logging.getLogger("eagle3").warning("%s: %d samples were not whole and are redone:\n  %s%s", output_dir,
                                        len(damaged), listed, more)


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
        "storage": format_of_manifest(manifest, "the manifest").key(),  # FP8 aux, top-k targets: other bytes
        "verifier_path": manifest.get("verifier_resolved_path"),
        "verifier_weights": (manifest.get("verifier_weights") or {}).get("tensors"),
        "prepared_data_sha256": ((manifest.get("inputs") or {}).get("prepared_data") or {}).get("sha256"),
    }

