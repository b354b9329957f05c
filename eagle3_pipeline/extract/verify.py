"""`02_extract_hidden_states.py --verify`: check every stored file of a stage-02 output against the size and CRC32
recorded when it was written, without loading the verifier, and mark the damaged samples so a rerun redoes them."""
from __future__ import annotations

import json
from pathlib import Path

from eagle3_pipeline.errors import StageFailure, UsageError
from eagle3_pipeline.progress import Progress
from eagle3_pipeline.formats.files import read_json, write_json_atomic, write_text_atomic
from eagle3_pipeline.formats.hidden_states import (DAMAGED_MARK, INDEX_FILE, STAGE, read_record, rerun_command,
    verify_sample)
from eagle3_pipeline.formats.manifest import MANIFEST

STATUS_DAMAGED = "damaged"  # a manifest status stages 04 and 05 refuse, like an unfinished run
MAX_LISTED = 20


def index_entries(output_dir: Path) -> list[dict]:
    path = output_dir / INDEX_FILE
    try:
        with open(path) as handle:
            return [json.loads(line) for line in handle if line.strip()]
    except (OSError, ValueError) as err:
        raise UsageError(f"--output-dir {output_dir}: cannot read {path} ({err}); rerun {STAGE}.py (with "
                         f"--rebuild-manifest if its manifest is damaged too) to write it again")


def mark_damaged(output_dir: Path, damaged: dict[str, list[str]], entries: list[dict]) -> None:
    """Mark each damaged folder, drop it from the index and flag the manifest: 04 and 05 refuse the folder
    until a rerun of stage 02 has redone those samples."""
    for path, problems in damaged.items():
        write_text_atomic(output_dir / path / DAMAGED_MARK, "; ".join(problems) + "\n")
    kept = [entry for entry in entries if entry["path"] not in damaged]
    write_text_atomic(output_dir / INDEX_FILE, "".join(json.dumps(entry) + "\n" for entry in kept))
    manifest_path = output_dir / MANIFEST
    try:
        manifest = read_json(manifest_path)
    except (OSError, ValueError):
        return  # nothing to flag; the rerun (with --rebuild-manifest) writes a new one
    manifest["status"] = STATUS_DAMAGED
    manifest["damaged_samples"] = len(damaged)
    write_json_atomic(manifest_path, manifest)


def verify_output(output_dir: Path, log) -> None:
    """Read every file of every indexed sample; StageFailure (exit 1) naming the damaged ones, if any."""
    entries = index_entries(output_dir)
    damaged: dict[str, list[str]] = {}
    names: dict[str, str] = {}
    unrecorded = 0
    with Progress(total=len(entries), desc="verify", unit="samples") as progress:
        for entry in entries:
            folder = output_dir / entry["path"]
            problems = verify_sample(folder)
            if problems:
                damaged[entry["path"]], names[entry["path"]] = problems, entry["id"]
            elif read_record(folder) is None:
                unrecorded += 1
            progress.update(1)
    if unrecorded:
        log.warning("%d samples were written before sizes and checksums were recorded: only checked for missing "
                    "and empty files", unrecorded)
    if not damaged:
        log.info("%s: all %d samples are whole (every file's size and CRC32 as written)", output_dir, len(entries))
        return
    mark_damaged(output_dir, damaged, entries)
    lines = [f"{names[path]!r} ({path}): {'; '.join(problems)}" for path, problems in list(damaged.items())[:MAX_LISTED]]
    if len(damaged) > MAX_LISTED:
        lines.append(f"... and {len(damaged) - MAX_LISTED} more")
    raise StageFailure(f"{len(damaged)} of {len(entries)} samples in {output_dir} are damaged:\n  " + "\n  ".join(lines)
                       + f"\nThey are marked and left out of the index; redo them with `{rerun_command(output_dir)}`")
