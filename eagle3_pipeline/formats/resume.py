"""The one rule for rerunning a stage on a folder that already holds output: reuse it, resume it, or refuse.

Every stage reads the manifest an earlier run left (`earlier_manifest`), compares the settings that decide the
output's content (`setting_differences`) and refuses a mismatch with the same kind of message
(`refuse_other_settings`), so a rerun never mixes two runs' output in one folder.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.formats.files import read_json
from eagle3_pipeline.formats.manifest import MANIFEST


def earlier_manifest(output_dir: Path, stage: str, overwrite: bool, other_fix: str = "") -> dict[str, Any] | None:
    """The manifest an earlier run of `stage` left in `output_dir`, or None when there is none.

    An unreadable manifest is refused unless --overwrite (then it counts as none). A folder written by another
    stage is refused even with --overwrite: that output is never replaced.
    """
    path = Path(output_dir) / MANIFEST
    if not path.exists():
        return None
    try:
        existing = read_json(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        if overwrite:
            return None
        raise UsageError(f"{path} is not valid JSON ({err}); pass --overwrite to start this stage again"
                         + (f", {other_fix}" if other_fix else ""))
    if existing.get("stage") != stage:
        raise UsageError(f"--output-dir {output_dir} holds the output of {existing.get('stage')!r}, not {stage}; "
                         "choose another --output-dir (or --run-dir)")
    return existing


def setting_differences(previous: Mapping[str, Any], current: Mapping[str, Any],
                        keys: Iterable[str] | None = None) -> list[str]:
    """One line `key: was X, now Y` per setting that differs; nested dicts are compared key by key."""
    names = list(keys) if keys is not None else sorted(set(previous) | set(current))
    lines = []
    for key in names:
        old, new = previous.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            lines += [f"{key}.{sub}: was {old.get(sub)!r}, now {new.get(sub)!r}"
                      for sub in sorted(set(old) | set(new)) if old.get(sub) != new.get(sub)]
        elif old != new:
            lines.append(f"{key}: was {old!r}, now {new!r}")
    return lines


def refuse_other_settings(what: str, differences: list[str], fix: str) -> None:
    """Stop with the differing settings listed, when there are any."""
    if differences:
        raise UsageError(f"{what} made with other settings:\n  " + "\n  ".join(differences) + f"\n{fix}")
