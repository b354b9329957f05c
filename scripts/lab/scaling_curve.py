#!/usr/bin/env python3
"""The tau-against-data curve (issue 40): one row a point, each point a lane folder of scripts/lab/run_lanes.py (its
lane.json says where its data is) or a work folder of scripts/lab/device_data_engine.sh (or its engine.tgz
unpacked), sorted by training conversations.

    python scripts/lab/scaling_curve.py POINT_DIR [POINT_DIR ...] --out DIR [--label POINT_DIR=NAME ...]

Writes DIR/scaling_curve.md (the table, one line saying what each benchmark measured), DIR/scaling_curve.json (the
same rows as numbers) and DIR/scaling_curve.png (tau against training conversations and against training loss
tokens, log x axes, a line per benchmark). Read from each point, RUN being a work folder's run/ or the lane folder
itself (a lane's stage 01 output is where its lane.json's inputs.prepared_data lies):
  RUN/data/manifest.json         stage 01: training conversations, loss tokens, conversations the verifier made
  RUN/checkpoints/metrics.jsonl  stage 04: the last validation's walked chain tau and TTT acceptance estimate; the
                                 training TTT estimate as the mean of the train lines in the last 5 % of steps
  RUN/checkpoints/best.json      stage 04: the planned steps and epochs
  RUN/bench_NAME/                stage 05 offline reports (the newest bench_offline_*.json): mtbench (T=0),
                                 mtbench_t1 (T=1), heldout, specbench
A file a point lacks (a run cut short) shows as "-". A point folder that is missing or unreadable exits 2.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

from eagle3_pipeline.bench.report import read_reports
from eagle3_pipeline.errors import USAGE_ERROR, UsageError
from eagle3_pipeline.figures import CHAIN_DRAFTS, TTT_ESTIMATE, WALKED_CHAIN_TAU, fmt
from eagle3_pipeline.formats.files import atomic_path, read_json, write_json_atomic, write_text_atomic
from eagle3_pipeline.formats.manifest import MANIFEST
from eagle3_pipeline.lab.plan import LANE_FILE
from eagle3_pipeline.train.plots import read_metrics

# The stage-05 folders of the lanes' benchmarks (and device_data_engine.sh's eval part), and their column names.
BENCHMARKS = {"mtbench": "MT-bench T=0", "mtbench_t1": "MT-bench T=1", "heldout": "held-out", "specbench": "Spec-Bench"}
TRAIN_WINDOW = 0.05  # the share of the last steps whose train lines are averaged: one step alone is noisy
VALIDATION = "validation walked tau"
COLUMNS = ["point", "training conversations", "made by the verifier", "loss tokens", "epochs", "steps",
           f"validation {WALKED_CHAIN_TAU} / TTT estimate", "training TTT estimate (last 5 %)",
           "train − validation gap (%)", *BENCHMARKS.values()]
OUTPUTS = ("scaling_curve.md", "scaling_curve.json", "scaling_curve.png")


def thousands(value: Any) -> str:
    """101435 -> "101,435"; "-" when missing."""
    return f"{value:,}" if isinstance(value, int) else fmt(value)


def compact(value: float) -> str:
    """101435 -> "101k", 20306575 -> "20.3M": a plot's tick and point labels."""
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            scaled = value / size
            return f"{scaled:.3g}{unit}" if scaled < 100 else f"{scaled:.0f}{unit}"
    return f"{value:g}"


def _load(path: Path, warnings: list[str]) -> Any:
    """A JSON file's content; None (with a warning when the file is there) when it cannot be read."""
    if not path.exists():
        return None
    try:
        return read_json(path)
    except (OSError, ValueError) as err:
        warnings.append(f"{path}: unreadable ({type(err).__name__}), shown as -")
        return None


def _number(value: Any) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value else None


def data_figures(manifest: dict | None) -> dict[str, Any]:
    """Stage 01's counts: training conversations, loss tokens, and how many conversations the verifier made."""
    if not isinstance(manifest, dict):
        return {}
    counts = manifest.get("counts") or {}
    sources = manifest.get("sources") or []
    made = (manifest.get("synthesis") or {}).get("made")
    if made is None and sources:  # no synthesis record: the made ones are the "synthesize" source, if any
        made = sum(s.get("records") or 0 for s in sources if s.get("dataset") == "synthesize")
    return {"training_conversations": counts.get("conversations"), "eval_conversations":
            counts.get("eval_conversations"), "samples": counts.get("samples"), "tokens": counts.get("tokens"),
            "loss_tokens": counts.get("loss_tokens"), "made_by_verifier": made,
            "max_turns": (manifest.get("flags") or {}).get("max_turns"),
            "verifier": Path(str((manifest.get("verifier") or {}).get("path") or "")).name or None}


def training_figures(metrics_path: Path, best: dict | None, warnings: list[str]) -> dict[str, Any]:
    """Stage 04's figures: the last validation's, the training TTT estimate over the last 5 % of steps, the
    gap between the two TTT estimates, steps and epochs."""
    row: dict[str, Any] = {}
    best = best if isinstance(best, dict) else {}
    row["total_steps"] = best.get("total_steps")
    row["epochs"] = (best.get("run_config") or {}).get("epochs")
    try:
        kinds = read_metrics(metrics_path) if metrics_path.exists() else {"train": [], "eval": []}
    except OSError as err:
        warnings.append(f"{metrics_path}: unreadable ({type(err).__name__}), shown as -")
        kinds = {"train": [], "eval": []}
    if kinds["eval"]:
        last = kinds["eval"][-1]
        row["val_walked_tau"], row["val_ttt"] = _number(last.get("sim_chain_tau")), _number(last.get("sim_accept_len"))
    train = [r for r in kinds["train"] if _number(r.get("sim_accept_len")) is not None]
    if train:
        end = train[-1]["step"]
        last_steps = max(1, math.ceil(TRAIN_WINDOW * end))  # whole steps, so the last line is always in
        window = [r["sim_accept_len"] for r in train if r["step"] > end - last_steps]
        row["train_ttt"], row["train_ttt_lines"] = sum(window) / len(window), len(window)
    lines = kinds["train"] + kinds["eval"]
    if lines:
        row["steps"] = max(r["step"] for r in lines)  # done so far: below total_steps for a run cut short
        if row["epochs"] is None:
            row["epochs"] = max((r.get("epoch") or 0 for r in lines), default=None) or None
    if row.get("train_ttt") is not None and row.get("val_ttt"):
        row["gap_percent"] = 100.0 * (row["train_ttt"] - row["val_ttt"]) / row["val_ttt"]
    return row


def describe_bench(report: dict) -> str:
    """What a report measured: "chain 3-1-4, T=0, 128 new tokens a turn, 80 of 80 prompts (160 turns) of
    mt_bench.jsonl, on cpu in float32" (the verifier's numbers differ by machine and precision: compare like with
    like)."""
    settings, overall = report.get("settings") or {}, report.get("overall") or {}
    chosen = report.get("prompt_selection") or {}
    count = chosen.get("chosen", settings.get("prompt_count"))
    prompts = f"{count} of {chosen['available']}" if chosen.get("available") is not None else f"{count}"
    parts = [f"chain {settings.get('num_steps')}-{settings.get('topk')}-{settings.get('num_draft_tokens')}",
             f"T={settings.get('temperature'):g}" if _number(settings.get("temperature")) is not None else None,
             f"{settings.get('max_new_tokens')} new tokens a turn",
             f"{prompts} prompts ({overall.get('turns', '?')} turns) of {Path(str(settings.get('prompts'))).name}",
             f"on {settings['device']} in {settings['compute_dtype']}"
             if settings.get("device") and settings.get("compute_dtype") else None]
    return ", ".join(p for p in parts if p)


def bench_figures(run: Path) -> dict[str, Any]:
    """Per benchmark folder, the newest offline report's tau and settings; None where it has none."""
    found = {}
    for name in BENCHMARKS:
        reports = read_reports(run / f"bench_{name}", prefix="bench_offline")
        if not reports:
            found[name] = None
            continue
        path, report = reports[-1]
        found[name] = {"tau": _number((report.get("overall") or {}).get("tau")), "about": describe_bench(report),
                       "report": str(path)}
    return found


def point_files(folder: Path, warnings: list[str]) -> tuple[Path, Path, Path]:
    """(stage 01's manifest, stage 04's output folder, the folder holding bench_*) of a lane folder, through its
    lane.json, or of a work folder, under run/."""
    if (folder / LANE_FILE).exists():
        record = _load(folder / LANE_FILE, warnings) or {}
        prepared = (record.get("inputs") or {}).get("prepared_data")
        data = folder / prepared if prepared else folder / "data" / "tokenized_data.jsonl"
        return data.parent / MANIFEST, folder / (record.get("drafter") or "checkpoints"), folder
    run = folder / "run"
    return run / "data" / MANIFEST, run / "checkpoints", run


def read_point(folder: Path, label: str) -> dict[str, Any]:
    """One row of the curve, JSON-able: every figure None where the point lacks its file; warnings aside."""
    warnings: list[str] = []
    data_manifest, checkpoints, bench_root = point_files(folder, warnings)
    row: dict[str, Any] = {"point": label, "folder": str(folder)}
    row.update(data_figures(_load(data_manifest, warnings)))
    row.update(training_figures(checkpoints / "metrics.jsonl", _load(checkpoints / "best.json", warnings), warnings))
    row["benchmarks"] = bench_figures(bench_root)
    for key in ("training_conversations", "made_by_verifier", "loss_tokens", "epochs", "steps", "total_steps",
                "val_walked_tau", "val_ttt", "train_ttt", "gap_percent"):
        row.setdefault(key, None)
    row["warnings"] = warnings
    return row


def sort_rows(rows: list[dict]) -> list[dict]:
    """By training conversations; points without a manifest last."""
    return sorted(rows, key=lambda r: (r["training_conversations"] is None, r["training_conversations"] or 0,
                                       r["point"]))


def bench_descriptions(rows: list[dict]) -> dict[str, list[str]]:
    """Each benchmark's settings as its reports recorded them (more than one where the points differ)."""
    found: dict[str, list[str]] = {name: [] for name in BENCHMARKS}
    for row in rows:
        for name, bench in row["benchmarks"].items():
            if bench and bench["about"] not in found[name]:
                found[name].append(bench["about"])
    return found


def _steps(row: dict) -> str:
    done, total = row["steps"], row["total_steps"]
    if isinstance(done, int) and isinstance(total, int) and done < total:
        return f"{done:,} of {total:,}"  # a run cut short
    return thousands(total if total is not None else done)


def table_row(row: dict) -> list[str]:
    gap = row["gap_percent"]
    benches = [fmt((row["benchmarks"].get(name) or {}).get("tau")) for name in BENCHMARKS]
    return [row["point"], thousands(row["training_conversations"]), thousands(row["made_by_verifier"]),
            thousands(row["loss_tokens"]), thousands(row["epochs"]), _steps(row),
            f"{fmt(row['val_walked_tau'])} / {fmt(row['val_ttt'])}", fmt(row["train_ttt"]),
            "-" if gap is None else f"{gap:+.1f}", *benches]


def markdown(curve: dict) -> str:
    """The page, from the JSON's content alone (so the JSON reproduces it)."""
    about = "; ".join(f"{BENCHMARKS[name]}: {' or '.join(found) if found else 'no report'}"
                      for name, found in curve["benchmarks"].items())
    lines = ["# Tau against training data", "",
             f"Benchmarks (stage 05 offline, tau = tokens per verify step): {about}.", "",
             f"Validation: stage 04's last validation, {WALKED_CHAIN_TAU} ({CHAIN_DRAFTS} drafts) / {TTT_ESTIMATE}; "
             f"training: the mean {TTT_ESTIMATE} of the train lines in the last {TRAIN_WINDOW * 100:g} % of steps; "
             "gap: (training - validation) / validation TTT estimate. \"-\": the point lacks that file.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(table_row(row)) + " |" for row in curve["points"]]
    return "\n".join(lines) + "\n"


def log_ticks(low: float, high: float) -> list[float]:
    """Round ticks for a log axis from low to high: the powers of ten, with 2 and 5 times them when the axis
    spans too few decades to show two powers of ten."""
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    inside = [m * 10.0 ** e for e in range(first, last + 1) for m in (1, 2, 5) if low <= m * 10.0 ** e <= high]
    decades = [t for t in inside if f"{t:e}".startswith("1.")]
    return decades if len(decades) >= 2 else inside


def _series(rows: list[dict]) -> list[tuple[str, Any]]:
    """(legend name, value of a row) for the validation tau and each benchmark."""
    series = [(f"validation, {WALKED_CHAIN_TAU}", lambda r: r["val_walked_tau"])]
    for name, column in BENCHMARKS.items():
        series.append((column, lambda r, name=name: (r["benchmarks"].get(name) or {}).get("tau")))
    return series


def build_figure(rows: list[dict], title: str):
    """Two panels: tau against training conversations and against training loss tokens, log x axes; a line per
    benchmark with values, each point labelled with its conversations."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    colors = ["#4c9a52", "#c8553d", "#3b6ea8", "#8a5fb0", "#d49a2a"]
    markers = ["s", "o", "^", "D", "v"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for axis, (key, xlabel) in zip(axes, (("training_conversations", "training conversations (log scale)"),
                                          ("loss_tokens", "training loss tokens (log scale)"))):
        placed = [r for r in rows if _number(r[key]) and r[key] > 0]
        for (name, value), color, marker in zip(_series(rows), colors, markers):
            points = [(r[key], value(r)) for r in placed if _number(value(r)) is not None]
            if points:
                axis.plot(*zip(*points), marker=marker, color=color, label=name, linewidth=1.5, markersize=6)
        for r in placed:  # once a point, above its highest value
            values = [v for v in (value(r) for _, value in _series(rows)) if _number(v) is not None]
            if values:
                axis.annotate(f"{compact(r['training_conversations'])} conv.", (r[key], max(values)),
                              textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8, color="#444")
        axis.set_xscale("log")
        xs = sorted({r[key] for r in placed})
        if xs:
            low, high = xs[0] / 1.6, xs[-1] * 1.6  # room for the end points' labels
            axis.set_xlim(low, high)
            ticks = log_ticks(low, high)
            axis.set_xticks(ticks, [compact(x) for x in ticks])
            axis.xaxis.set_minor_locator(NullLocator())
        else:
            axis.text(0.5, 0.5, "no point has this figure", transform=axis.transAxes, ha="center", color="#888")
        axis.margins(y=0.18)
        axis.set_xlabel(xlabel)
        axis.set_ylabel("tau (tokens per verify step)")
        axis.set_title(f"tau against {xlabel.split(' (')[0]}", fontsize=10)
        axis.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def figure_title(curve: dict) -> str:
    rows = curve["points"]
    verifiers = sorted({r.get("verifier") for r in rows if r.get("verifier")})
    parts = [f"verifier {', '.join(verifiers)}" if verifiers else None,
             f"{len(rows)} point" + ("s" if len(rows) != 1 else ""),
             f"stage 04 validation ({WALKED_CHAIN_TAU}) and stage 05 offline tau"]
    return "Tau against training data: " + ", ".join(p for p in parts if p)


def write_png(curve: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = build_figure(curve["points"], figure_title(curve))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def point_folders(folders: list[str], labels: list[str]) -> list[tuple[Path, str]]:
    """(folder, label) a point; UsageError for a folder missing or unreadable, or a bad --label."""
    points = []
    for folder in folders:
        path = Path(folder)
        if not path.is_dir():
            raise UsageError(f"{folder}: no such folder (a lane folder of run_lanes.py, or a work folder of "
                             f"device_data_engine.sh)")
        if not os.access(path, os.R_OK | os.X_OK):
            raise UsageError(f"{folder}: not readable")
        if not (path / LANE_FILE).exists() and not (path / "run").is_dir():  # a likely slip: WORK_DIR/run given
            raise UsageError(f"{folder}: neither a lane folder (no {LANE_FILE}) nor a work folder (no run/ in it): "
                             f"give LANES_DIR/NAME, or the work folder that holds run/")
        points.append(path)
    named = {}
    for item in labels:
        folder, sep, name = item.rpartition("=")
        if not sep or not folder or not name:
            raise UsageError(f"--label {item}: expected POINT_DIR=NAME")
        matches = [p for p in points if p.resolve() == Path(folder).resolve()]
        if not matches:
            raise UsageError(f"--label {item}: {folder} is not one of the points given")
        named[matches[0].resolve()] = name
    return [(p, named.get(p.resolve(), p.resolve().name)) for p in points]


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(prog="scaling_curve.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    made.add_argument("points", nargs="+", metavar="POINT_DIR",
                      help="A point's lane folder (holding lane.json) or work folder (holding run/), in any "
                           "order.")
    made.add_argument("--out", required=True, help="Where scaling_curve.md, .json and .png go (made if absent).")
    made.add_argument("--label", action="append", default=[], metavar="POINT_DIR=NAME",
                      help="A point's name in the table (default its folder's name); repeatable.")
    return made


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        points = point_folders(args.points, args.label)
    except UsageError as err:
        print(f"scaling_curve.py: {err}", file=sys.stderr)
        return USAGE_ERROR
    rows = sort_rows([read_point(folder, label) for folder, label in points])
    curve = {"benchmarks": bench_descriptions(rows), "points": rows}
    out = Path(args.out)
    page = markdown(curve)
    write_text_atomic(out / OUTPUTS[0], page)
    write_json_atomic(out / OUTPUTS[1], curve)
    for row in rows:
        for warning in row["warnings"]:
            print(f"scaling_curve.py: {row['point']}: {warning}", file=sys.stderr)
    try:
        write_png(curve, out / OUTPUTS[2])
    except ImportError:  # the numbers stand without the picture
        print("scaling_curve.py: matplotlib is not installed: no scaling_curve.png", file=sys.stderr)
    print(page)
    print("wrote " + ", ".join(str(out / name) for name in OUTPUTS if (out / name).exists()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
