#!/usr/bin/env python3
"""One Markdown table of every stage-05 report of every lane (scripts/lab/run_lanes.py's, as gpu_drafter_quality.sh and
cpu_recipe_levers.sh run them), found through each lane's lane.json: the lane's name and its benchmarks' folders.

A row per lane and benchmark (LANE_BENCHMARK): prompt set, prompts used, drafting setting, temperature, dtype, tau,
acceptance by position, speedup (where timed), greedy turns identical and mean share before divergence (T=0),
repetition, tau per output window (runs past 128 new tokens); then the teacher-forced agreement per TTT step
(--mode eval).
Ours against SpecForge's recipe is compare_recipes.py's table, which gpu_drafter_quality.sh appends.

  python3 scripts/lab/quality_table.py DIR...   (a lane's folder, a folder of lanes, or a base run with lanes/)
"""
from __future__ import annotations

import sys
from pathlib import Path

from eagle3_pipeline.figures import fmt as report_fmt
from eagle3_pipeline.bench.report import read_reports, window_name
from eagle3_pipeline.formats.files import read_json
from eagle3_pipeline.lab.plan import LANE_FILE


def fmt(value, digits: int = 2) -> str:
    """Two decimals unless told otherwise: a table of figures read side by side."""
    return report_fmt(value, digits)


def prompts_used(report: dict) -> str:
    """"all 80" or "60 of 200, sampled", with the number of turns."""
    chosen = report.get("prompt_selection") or {}
    turns = report["overall"].get("turns")
    if chosen.get("requested") is None or chosen.get("chosen") == chosen.get("available"):
        return f"all {chosen.get('chosen', '?')} ({turns} turns)"
    return f"{chosen['chosen']} of {chosen['available']}, sampled ({turns} turns)"


def speedup(overall: dict) -> str:
    """Over the same loop without drafting, where the run timed it (not with --tau-only)."""
    value = overall.get("speedup_vs_plain")
    return f"{value:.2f}x" if value else "-"


def offline_row(name: str, report: dict) -> list[str]:
    settings, overall = report["settings"], report["overall"]
    match = overall.get("greedy_match") or {}
    identical = f"{match['turns_identical']}/{match['turns_checked']}" if match else "-"
    if match.get("turns_parted_at_a_tie"):  # the verifier's own argmax flips there: docs/benchmarking.md
        identical += f" (+{match['turns_parted_at_a_tie']} at a tie)"
    shares = (overall.get("acceptance") or {}).get("share") or []  # P(draft i accepted): tau = 1 + their sum
    return [name, Path(str(settings.get("prompts"))).stem, prompts_used(report), settings.get("drafting", "-"),
            fmt(settings.get("temperature"), 1), str(settings.get("compute_dtype") or settings.get("dtype")),
            fmt(overall.get("tau")), " ".join(fmt(r) for r in shares), speedup(overall), identical,
            fmt(match.get("mean_share_before_divergence"), 3) if match else "-",
            fmt(overall.get("repetition_4gram_share")), along_the_reply(overall)]


def along_the_reply(overall: dict) -> str:
    """Tau and 4-gram repetition per output window, e.g. "0-127 2.03 (0.28) · 128-255 2.61 (0.45)" ("-" for a
    run within its first window)."""
    windows = overall.get("tau_by_window") or []
    if len(windows) < 2:
        return "-"
    return " · ".join(f"{window_name(w)} {fmt(w['tau'])} ({fmt(w['repetition_4gram_share'])})" for w in windows)


def lane_files(folder: Path) -> list[Path]:
    """The lane.json of a lane's folder, of the lanes in a folder, or of a base run's lanes/."""
    if (folder / LANE_FILE).is_file():
        return [folder / LANE_FILE]
    return sorted(folder.glob(f"*/{LANE_FILE}")) + sorted(folder.glob(f"lanes/*/{LANE_FILE}"))


def reports(folders: list[Path]):
    """(row name, report path, results) for every report of every benchmark each lane.json names."""
    for lane_file in [file for folder in folders for file in lane_files(folder)]:
        record = read_json(lane_file)
        for step in record.get("steps", []):
            if step.get("benchmark"):  # a relative folder is the lane's own
                for path, results in read_reports(lane_file.parent / step["output_dir"]):
                    yield f"{record['lane']['name']}_{step['benchmark']}", path, results


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    offline, evals = [], []
    for name, path, report in reports([Path(folder) for folder in argv]):
        if path.stem.startswith("bench_eval"):
            metrics = report["metrics"]
            evals.append([name, " ".join(fmt(a) for a in metrics["acc_per_step"]), fmt(metrics.get("sim_accept_len")),
                          fmt(metrics.get("sim_chain_tau"))])
        elif path.stem.startswith("bench_offline"):
            offline.append(offline_row(name, report))
    header = ["drafter", "set", "prompts used", "drafting", "T", "dtype", "tau", "accepted share by position",
              "speedup", "greedy identical", "share before divergence", "4-gram repetition",
              "tau along the reply (output tokens: tau (4-gram repetition))"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in offline:
        print("| " + " | ".join(row) + " |")
    if evals:
        print("\n| drafter | teacher-forced top-1 per TTT step (validation split) | TTT acceptance estimate | "
              "walked chain tau (3 drafts) |\n|---|---|---|---|")
        for row in evals:
            print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
