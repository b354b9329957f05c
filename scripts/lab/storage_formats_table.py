#!/usr/bin/env python3
"""The table of scripts/lab/gpu_storage_formats.sh: per stage-02 storage format, the bytes per token (computed from
the format, written by stage 02, and on disk from the sample records), stage 02 and stage 04 tokens/s, stage 02's
extraction against the forward pass alone (scripts/lab/bench_extraction.py's LANE/bench_extraction.json, where it ran),
the chain tau of stage 05 --tau-only, the teacher-forced agreement, and the top-k targets' missing mass.

Each storage format is a lane (bf16final, fp8final, bf16topk, fp8topk: eagle3_pipeline/lab/lanes.py); its lane.json
names it and says where its hidden states, drafter and benchmarks are. A folder without one (a rate-only run) gives a
row named "-" whose format column comes from bench_extraction.json. Ratios are to the first lane given.

  python3 scripts/lab/storage_formats_table.py OUT LANE_DIR...   (writes OUT/storage_formats.{json,md})
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from eagle3_pipeline.bench.report import latest_report
from eagle3_pipeline.formats.storage import format_of_manifest
from eagle3_pipeline.lab.plan import LANE_FILE


def read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def lines(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def one_report(folder: Path, prefix: str) -> dict:
    return latest_report(folder, prefix) or {}


def lane_paths(folder: Path) -> dict:
    """The lane's name and where its inputs and outputs are, from its lane.json (relative to its folder)."""
    record = read(folder / LANE_FILE)
    if not record:
        return {"name": "-", "hidden_states": None, "drafter": None, "benchmarks": {}}
    states = record["inputs"].get("hidden_states")  # none for a lane trained --online
    return {"name": record["lane"]["name"], "hidden_states": folder / states if states else None,
            "drafter": folder / record["drafter"],
            "benchmarks": {step["benchmark"]: folder / step["output_dir"] for step in record["steps"]
                           if step.get("benchmark")}}


def variant_row(folder: Path) -> dict:
    lane = lane_paths(folder)
    row: dict = {"variant": lane["name"]}
    states = lane["hidden_states"]
    manifest = read(states / "manifest.json") if states else {}
    if manifest:
        fmt = format_of_manifest(manifest, lane["name"])
        last = manifest.get("last_run") or {}
        tokens = (manifest.get("counts") or {}).get("tokens") or 0
        on_disk = sum(sum(f["bytes"] for f in (entry.get("files") or {}).values())
                      for entry in lines(states / "index.jsonl"))
        row.update({"format": fmt.key(), "bytes_per_token_computed": fmt.bytes_per_token(manifest["hidden_size"]),
                    "bytes_per_token_written": round(last["bytes_written"] / last["tokens_written"], 1)
                    if last.get("tokens_written") else None,
                    "bytes_per_token_on_disk": round(on_disk / tokens, 1) if tokens and on_disk else None,
                    "stage02_tokens_per_s": last.get("tokens_per_s")})
    bench = read(folder / "bench_extraction.json")
    if bench:  # a rate-only run has no stage-02 manifest: the format and its bytes come from the benchmark
        row["extraction_vs_forward"] = bench.get("extraction_vs_forward")
        row.setdefault("format", bench.get("storage"))
        row.setdefault("bytes_per_token_computed", bench.get("bytes_per_token"))
    if lane["drafter"] is None:
        return row
    metrics = lines(lane["drafter"] / "metrics.jsonl")
    train = [r["tokens_per_s"] for r in metrics if r.get("kind") == "train" and r.get("tokens_per_s")]
    evals = [r for r in metrics if r.get("kind") == "eval"]
    if train:  # the first window holds the warm-up (compilation, first loads)
        steady = train[1:] or train
        row["stage04_tokens_per_s"] = round(sum(steady) / len(steady), 1)
    if evals:
        row["val_sim_accept_len"] = round(evals[-1]["sim_accept_len"], 4)
        row["target_missing_mass"] = evals[-1].get("target_missing_mass")
    benchmarks = lane["benchmarks"]
    chain = one_report(benchmarks["mtbench"], "bench_offline") if "mtbench" in benchmarks else None
    if chain:
        row["chain_tau"] = round(chain["overall"]["tau"], 4)
    teacher = one_report(benchmarks["eval"], "bench_eval") if "eval" in benchmarks else None
    if teacher:
        row["eval_acc_per_step"] = teacher["metrics"]["acc_per_step"]
    return row


COLUMNS = [("variant", "variant"), ("format", "format"), ("bytes_per_token_computed", "bytes/token (format)"),
           ("bytes_per_token_on_disk", "bytes/token (on disk)"), ("stage02_tokens_per_s", "stage 02 tok/s"),
           ("extraction_vs_forward", "stage 02 / forward alone"), ("stage04_tokens_per_s", "stage 04 tok/s"), ("chain_tau", "chain tau 3/1/4"),
           ("val_sim_accept_len", "val TTT acceptance estimate"), ("eval_acc_per_step", "teacher-forced top-1 per step"),
           ("target_missing_mass", "top-k missing mass")]


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return " ".join(f"{v:.3f}" for v in value)
    return f"{value:.3f}" if isinstance(value, float) and value < 100 else str(value)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    rows = [variant_row(Path(folder)) for folder in argv[1:]]
    base = rows[0] if rows[0].get("bytes_per_token_computed") else None
    for row in rows:  # relative to the first lane (bf16final, the default format)
        if base and row.get("bytes_per_token_computed"):
            row["bytes_vs_first"] = round(row["bytes_per_token_computed"] / base["bytes_per_token_computed"], 3)
        if base and row.get("chain_tau") and base.get("chain_tau"):
            row["chain_tau_vs_first"] = round(row["chain_tau"] / base["chain_tau"], 4)
    out.mkdir(parents=True, exist_ok=True)
    (out / "storage_formats.json").write_text(json.dumps(rows, indent=2) + "\n")
    columns = COLUMNS + [("bytes_vs_first", "bytes vs first"), ("chain_tau_vs_first", "tau vs first")]
    table = ["| " + " | ".join(title for _, title in columns) + " |", "|" + "---|" * len(columns)]
    table += ["| " + " | ".join(cell(row.get(key)) for key, _ in columns) + " |" for row in rows]
    (out / "storage_formats.md").write_text("\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
