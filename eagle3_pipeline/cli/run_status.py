"""`run_pipeline.py --status`: each stage's state in a run directory, with live progress and the latest figures
(stage 04's validation, stage 05's newest report) read from the artifacts."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from eagle3_pipeline.bench.report import headline, read_reports
from eagle3_pipeline.errors import USAGE_ERROR
from eagle3_pipeline.formats.run_layout import RUN_LAYOUT
from eagle3_pipeline.cli.pipeline import STAGES, output_manifest
from eagle3_pipeline.figures import figures_text


def print_status(run_dir: Path) -> int:
    """Each stage's state; exit code 2 when the folder does not exist or holds no run."""
    if not run_dir.is_dir():
        sys.stderr.write(f"run_pipeline: no run directory at {run_dir} (nothing has run there yet; "
                         f"check the path)\n")
        return USAGE_ERROR
    if not any(output_manifest(run_dir, stage) for stage in STAGES) and not (run_dir / "logs").is_dir():
        sys.stderr.write(f"run_pipeline: {run_dir} holds no run (no stage manifest, no logs/ folder); "
                         f"check the path\n")
        return USAGE_ERROR
    print(f"run directory {run_dir}")
    online = ((output_manifest(run_dir, "04_train") or {}).get("states") or {}).get("source") == "online"
    for stage in STAGES:
        manifest = output_manifest(run_dir, stage)
        state = "not started" if manifest is None else manifest.get("status", "?")
        if manifest is None and online and stage == "02_extract_hidden_states":
            state = "not needed (stage 04 computes the states: --online)"
        line = f"  {stage:<26} {state:<12}"
        if manifest:
            counts = manifest.get("counts", {})
            line += " " + ", ".join(f"{k} {v}" for k, v in list(counts.items())[:4])
            if "wall_time_s" in manifest:
                line += f"; {manifest['wall_time_s']:.0f} s"
            if stage == "02_extract_hidden_states":  # its storage format (older runs: aux in --dtype, final)
                storage = manifest.get("storage") or {}
                topk = f"top-{storage['target_topk']}" if storage.get("targets") == "topk" else "final"
                line += f"; aux {storage.get('aux_dtype', manifest.get('dtype'))}, targets {topk}"
        progress = stage_progress(run_dir, stage)
        if progress:
            line += f"; {progress}"
        print(line)
    print(f"logs: {run_dir / 'logs'}")
    return 0


def stage_progress(run_dir: Path, stage: str) -> str:
    """What the artifacts say beyond the manifest: progress while a stage runs, and the latest figures."""
    folder = run_dir / RUN_LAYOUT[stage]
    if stage == "02_extract_hidden_states":
        index = folder / "index.jsonl"
        data = output_manifest(run_dir, "01_prepare_data") or {}
        total = data.get("counts", {}).get("samples")
        written = sum(1 for _ in index.open()) if index.exists() else 0
        return f"{written}/{total} samples indexed" if total else ""
    if stage == "04_train":
        return training_progress(folder / "metrics.jsonl")
    if stage == "05_benchmark":
        return latest_benchmark(folder)
    return ""


def latest_benchmark(folder: Path) -> str:
    """The newest report in the run's benchmark folder: its name, tau and speedup."""
    found = read_reports(folder)  # oldest first
    if not found:
        return ""
    path, results = found[-1]
    return f"latest report {path.stem}: {headline(results, digits=2)}"


def training_progress(metrics: Path) -> str:
    """The last training and validation lines of metrics.jsonl, in words (whole numbers, never cut mid-JSON)."""
    last = {}
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line being written right now
            continue
        last[record.get("kind")] = record
    parts = []
    validation = last.get("eval")
    if validation:  # first: its walked chain tau is the figure to compare with stage 05's tau
        figures = figures_text(validation, digits=2)
        parts.append(f"validation step {validation.get('step')} (epoch {validation.get('epoch')}): "
                     + (f"{figures}, " if figures else "") + f"loss {validation.get('loss', 0):.4f}")
    training = last.get("train")
    if training:
        figures = figures_text(training, digits=2)
        parts.append(f"train step {training.get('step')} (epoch {training.get('epoch')}): loss "
                     f"{training.get('loss', 0):.4f}" + (f", {figures}" if figures else ""))
    return "; ".join(parts)
