"""The drafter's training lineage: is a benchmark prompt one of the prompts the drafter was trained on?"""
from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.formats.files import read_json
from eagle3_pipeline.formats.manifest import MANIFEST, relocated

HASHES_FILE = "train_prompt_hashes.txt"
DATA_STAGE = "01_prepare_data"


def _manifest_of(path: Path) -> Path:
    return path / MANIFEST if path.is_dir() else path.parent / MANIFEST


def _find_strings(obj, suffix: str):
    if isinstance(obj, str) and obj.endswith(suffix):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _find_strings(value, suffix)
    elif isinstance(obj, list):
        for value in obj:
            yield from _find_strings(value, suffix)


def training_lineage(draft_dir: str | Path) -> tuple[Path | None, list[str]]:
    """Follow manifests from a drafter checkpoint to the training prompts' hash file of stage 01.

    checkpoint dir -> its stage-04 manifest (the folder or its parent) -> inputs -> the stage-02 manifest
    -> inputs.prepared_data -> the stage-01 manifest, which names train_prompt_hashes.txt; a run directory
    moved or copied elsewhere is followed at its new place. Returns (hash file or None, the manifests visited).
    """
    start = Path(draft_dir).resolve()
    queue = [start / MANIFEST, start.parent / MANIFEST]
    seen: list[str] = []
    while queue:
        path = queue.pop(0)
        if str(path) in seen or not path.is_file():
            continue
        seen.append(str(path))
        try:
            manifest = read_json(path)
        except (OSError, ValueError):
            continue
        if manifest.get("stage") == DATA_STAGE:
            named = [Path(s) for s in _find_strings(manifest, HASHES_FILE)]
            named = [p if p.is_absolute() else path.parent / p for p in named]
            for candidate in named + [path.parent / HASHES_FILE]:
                if candidate.is_file():
                    return candidate, seen
            continue
        for entry in (manifest.get("inputs") or {}).values():
            if isinstance(entry, dict) and entry.get("path"):
                queue.append(_manifest_of(relocated(entry["path"], path, manifest)))
    return None, seen


def check_overlap(prompts, draft_dir: str | None, allow_overlap: bool, log) -> dict:
    """Refuse benchmark prompts whose turns were training prompts of the drafter (unless allowed)."""
    from eagle3_pipeline.data.records import benchmark_prompt_hashes

    if not draft_dir or not Path(draft_dir).exists():
        log.warning("overlap check SKIPPED: no drafter folder to trace the training data from (give "
                    "--draft-model-path, or --run-dir of the training run); %d prompts unchecked", len(prompts))
        return {"checked": False, "reason": "no drafter folder"}
    hash_file, visited = training_lineage(draft_dir)
    if hash_file is None:
        log.warning("overlap check SKIPPED: could not trace %s back to stage 01's %s (manifests visited: %s); "
                    "make sure the benchmark prompts were not used for training", draft_dir, HASHES_FILE,
                    ", ".join(visited) or "none")
        return {"checked": False, "reason": "training lineage not found", "manifests_visited": visited}
    trained = {line.strip() for line in hash_file.read_text().splitlines() if line.strip()}
    overlapping = [p.id for p in prompts if any(benchmark_prompt_hashes(turn) & trained for turn in p.turns)]
    result = {"checked": True, "hash_file": str(hash_file), "training_prompts": len(trained),
              "prompts_checked": len(prompts), "overlapping": len(overlapping),
              "overlapping_ids": overlapping[:50]}
    if overlapping and not allow_overlap:
        raise UsageError(f"{len(overlapping)} of {len(prompts)} benchmark prompts were training prompts of the "
                         f"drafter ({hash_file}): ids {', '.join(overlapping[:10])}"
                         f"{' ...' if len(overlapping) > 10 else ''}. Measuring on training data overstates "
                         f"acceptance; use held-out prompts, or pass --allow-overlap to measure anyway")
    if overlapping:
        log.warning("%d of %d prompts overlap the drafter's training data (--allow-overlap given)",
                    len(overlapping), len(prompts))
    else:
        log.info("overlap check: %d prompts checked against %d training prompt hashes (%s): none overlap",
                 len(prompts), len(trained), hash_file)
    return result
