"""Manifests: what each stage records beside its output, and the checks a stage makes of the one before.

Every stage writes `manifest.json` beside its output. The next stage reads it before doing anything
heavy and refuses a mismatch (another tokenizer, vocabulary, hidden size or layer set, or an unfinished
upstream run) with an error naming both sides and the fix.
"""
from __future__ import annotations

import json
import os
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.formats.files import read_json, sha256_file, write_json_atomic

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
STATUS_RUNNING = "running"
STATUS_COMPLETE = "complete"
STATUS_FAILED = "failed"
_PACKAGES = ("torch", "transformers", "safetensors", "tokenizers", "datasets", "numpy", "sglang")
# The environment variables that change what a stage computes or where it reads and logs (docs/conventions.md
# lists what each does); every manifest records their values, unset ones as null. tests/test_flags.py fails on an
# EAGLE3_ variable read anywhere in the library that is neither here nor one a stage sets for its own children.
BEHAVIOUR_SWITCHES = ("EAGLE3_CACHE", "EAGLE3_COMPILE", "EAGLE3_CUDNN_ATTENTION", "EAGLE3_DECODE_ATTENTION",
                      "EAGLE3_DECODE_COMPILE", "EAGLE3_FUSE_ELEMENTWISE", "EAGLE3_PROGRESS_INTERVAL",
                      "EAGLE3_TOKENIZE_WORKERS", "EAGLE3_TTT_ATTENTION")


def resolved_config(args) -> dict:
    """A stage's flags as it resolved them, sorted by name: its manifest's "flags" and its config JSON."""
    return {key: value for key, value in sorted(vars(args).items())}


def behaviour_switches() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in BEHAVIOUR_SWITCHES}


def package_versions() -> dict[str, str]:
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


# --- manifests -------------------------------------------------------------------------------------

class Manifest:
    """The manifest of one stage's output folder, written at start (running) and at end (complete)."""

    def __init__(self, output_dir: str | os.PathLike, stage: str, flags: dict[str, Any]):
        self.path = Path(output_dir) / MANIFEST
        self.started = time.time()
        self.data: dict[str, Any] = {
            "manifest_version": MANIFEST_VERSION,
            "stage": stage,
            "folder": str(Path(output_dir).resolve()),  # where it was written: see relocated()
            "status": STATUS_RUNNING,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "flags": flags,
            "inputs": {},
            "verifier": {},
            "counts": {},
            "versions": package_versions(),
            "environment": behaviour_switches(),
        }

    def add_input(self, name: str, path: str | os.PathLike, upstream_manifest: Path | None = None) -> None:
        entry: dict[str, Any] = {"path": str(Path(path).resolve())}
        if upstream_manifest is not None and upstream_manifest.exists():
            entry["manifest_sha256"] = sha256_file(upstream_manifest)
        self.data["inputs"][name] = entry

    def write(self) -> None:
        self.data["wall_time_s"] = round(time.time() - self.started, 3)
        write_json_atomic(self.path, self.data)

    def complete(self) -> None:
        self.data["status"] = STATUS_COMPLETE
        self.data["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.write()

    def fail(self, details: dict[str, Any]) -> None:
        """The run stopped with an error: record why and how to resume, for whoever reads the folder next."""
        self.data["status"] = STATUS_FAILED
        self.data["failure"] = details
        self.data["failed_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.write()


def relocated(recorded: str | os.PathLike, manifest_file: Path, manifest: dict[str, Any]) -> Path:
    """Where a path that a manifest recorded lies now, after its run folder was moved or copied elsewhere.

    Manifests record absolute paths, which point at the old place once `rsync -a run/ host:/data/run2/`
    has copied the run. The manifest's own folder was recorded too ("folder", or the absolute --output-dir
    of older manifests): its old and new paths end in the same names, and what precedes them is the old
    and the new root of the moved tree. The path at the same place in the new tree wins unless only the
    recorded one exists (the old place may hold another run by now; a partial copy may lack the file
    while the manifest beside it came along).
    """
    path = Path(recorded)
    old_folder = manifest.get("folder") or (manifest.get("flags") or {}).get("output_dir")
    if not old_folder or not Path(old_folder).is_absolute():
        return path
    old, new = Path(old_folder).parts, Path(manifest_file).resolve().parent.parts
    shared = 0  # trailing names in common, never the whole of either path
    while shared < min(len(old), len(new)) - 1 and old[-1 - shared] == new[-1 - shared]:
        shared += 1
    old_root, new_root = Path(*old[:len(old) - shared]), Path(*new[:len(new) - shared])
    if not path.is_relative_to(old_root):
        return path
    moved = new_root / path.relative_to(old_root)
    return path if path.exists() and not moved.exists() else moved


def load_manifest(folder: str | os.PathLike, expected_stage: str, flag: str,
                  require_complete: bool = True) -> dict[str, Any]:
    """Read the upstream stage's manifest, or stop with an error that says which stage to run."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.exists():
        raise UsageError(f"{flag} {folder}: no {MANIFEST} there; run {expected_stage}.py first "
                         f"(or point {flag} at the folder it wrote)")
    try:
        data = read_json(path)
    except json.JSONDecodeError as err:
        raise UsageError(f"{path} is not valid JSON ({err}); rerun {expected_stage}.py")
    if data.get("stage") != expected_stage:
        raise UsageError(f"{path} was written by {data.get('stage')!r}, but {flag} expects the output of "
                         f"{expected_stage}")
    if require_complete and data.get("status") != STATUS_COMPLETE:
        raise UsageError(f"{path}: {expected_stage} did not finish (status {data.get('status')!r}); "
                         f"rerun {expected_stage}.py, which resumes where it stopped")
    return data


def check_same(what: str, upstream_value: Any, upstream_name: str, current_value: Any,
               current_name: str, fix: str) -> None:
    """Refuse a mismatch between what the upstream artifact was made with and what is used now."""
    if upstream_value is not None and current_value is not None and upstream_value != current_value:
        raise UsageError(f"{what} mismatch: {upstream_name} has {upstream_value!r} but {current_name} has "
                         f"{current_value!r}. {fix}")


def check_verifier_matches(upstream: dict[str, Any], upstream_name: str, current: dict[str, Any],
                           current_name: str) -> None:
    """The upstream artifact must come from the same tokenizer, vocabulary and hidden size."""
    theirs = upstream.get("verifier", {})
    if theirs.get("path") and theirs.get("path") != current.get("path"):  # name both models, not only hashes
        upstream_name = f"{upstream_name} (verifier {theirs['path']})"
    fix = ("Use the same --model-path as the upstream stage, or rerun the upstream stage for this "
           "verifier.")
    for key in ("tokenizer_sha256", "vocab_size", "hidden_size"):
        check_same(key, theirs.get(key), upstream_name, current.get(key), current_name, fix)
