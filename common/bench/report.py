"""What a benchmark run reports: the metrics, and the JSON / Markdown / PNG files they are written to.

Every file is written atomically. File names carry the mode and the settings (bench_offline_k3_t0,
bench_offline_k5_topk4_n16_t1, bench_server_t0_c8, ...) so runs with other settings do not overwrite
each other. The PNG is drawn with matplotlib when it is installed, and otherwise with a small built-in
rasteriser (bars and numbers only), so a report never depends on an optional package.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import zlib
from pathlib import Path
from typing import Any, Sequence

from common.formats.files import atomic_path, write_json_atomic, write_text_atomic

REPETITION_NGRAM = 4


# --- baselines shared between runs ----------------------------------------------------------------------

class BaselineCache:
    """The no-drafting baselines of each prompt, kept in a JSONL file beside the reports.

    They depend on the verifier, the prompt and the sampling settings, never on the drafter or k, so a run
    at k=7 reuses what the run at k=3 measured on the same machine instead of decoding everything again
    (on a small verifier the two baselines are most of a benchmark's time). A line is appended as soon as
    a prompt's baselines are measured: an interrupted run keeps what it had.
    """

    def __init__(self, path: str | Path, context: dict[str, Any]):
        self.path = Path(path)
        self._context = json.dumps(context, sort_keys=True)
        self.entries: dict[str, dict] = {}
        self.hits = 0
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                    self.entries[entry["key"]] = entry
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a crash: that prompt is measured again

    def key(self, ids: Sequence[int], **settings: Any) -> str:
        text = json.dumps([self._context, list(ids), settings], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def get(self, key: str) -> dict | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.hits += 1
        return entry

    def put(self, key: str, value: dict) -> None:
        entry = {"key": key, **value}
        self.entries[key] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as handle:
            handle.write(json.dumps(entry) + "\n")


# --- metrics -----------------------------------------------------------------------------------------

def repetition_share(tokens: Sequence[int], n: int = REPETITION_NGRAM) -> float:
    """Share of tokens that lie inside an n-gram which already occurred earlier in the same output.

    Small verifiers loop under greedy decoding, and a loop is trivially predictable: a high share says
    that a high acceptance length comes from repetition rather than from the drafter.
    """
    tokens = list(tokens)
    if len(tokens) < n:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeated = [False] * len(tokens)
    for start in range(len(tokens) - n + 1):
        gram = tuple(tokens[start:start + n])
        if gram in seen:
            for i in range(start, start + n):
                repeated[i] = True
        else:
            seen.add(gram)
    return sum(repeated) / len(tokens)


def repeated_token_count(tokens: Sequence[int], n: int = REPETITION_NGRAM) -> int:
    return round(repetition_share(tokens, n) * len(tokens))


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(latencies: Sequence[float]) -> dict[str, float | None]:
    return {"mean": sum(latencies) / len(latencies) if latencies else None,
            "p50": percentile(latencies, 50), "p90": percentile(latencies, 90), "p99": percentile(latencies, 99)}


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def acceptance_by_position(accept_lengths: Sequence[int], num_positions: int) -> dict[str, list]:
    """Per draft position j (1-based): how often it was accepted.

    `accept_lengths` are tokens per verify step (accepted drafts + 1 bonus). Position j is accepted when at
    least j drafts were. Conditional rate = P(j accepted | j-1 accepted) (EAGLE's n-alpha); share =
    P(j accepted) over all verify steps.
    """
    steps = len(accept_lengths)
    accepted = [sum(1 for length in accept_lengths if length - 1 >= j) for j in range(1, num_positions + 1)]
    reached = [steps] + accepted[:-1]
    return {
        "accepted": accepted,
        "reached": reached,
        "conditional_rate": [_ratio(a, r) for a, r in zip(accepted, reached)],
        "share": [_ratio(a, steps) for a in accepted],
    }


def summarize_generations(runs: Sequence[dict[str, Any]], num_positions: int) -> dict[str, Any]:
    """Pooled metrics over per-turn runs. Each run: spec/plain/hf dicts with new_tokens and wall_s, spec with
    accept_lengths, and tokens (the speculative output) for the repetition measure."""
    accept_lengths = [length for run in runs for length in run["spec"]["accept_lengths"]]
    totals: dict[str, Any] = {}
    for method in ("spec", "plain", "hf"):
        present = [run[method] for run in runs if run.get(method)]
        tokens = sum(r["new_tokens"] for r in present)
        seconds = sum(r["wall_s"] for r in present)
        totals[method] = {"new_tokens": tokens, "wall_s": seconds,
                          "tokens_per_s": tokens / seconds if present and seconds > 0 else None}
    all_tokens = sum(len(run["spec"]["tokens"]) for run in runs)
    repeated = sum(repeated_token_count(run["spec"]["tokens"]) for run in runs)
    verify_steps = len(accept_lengths)
    summary = {
        "turns": len(runs),
        "tau": sum(accept_lengths) / verify_steps if verify_steps else None,
        "verify_steps": verify_steps,
        # What SGLang reports per request (completion_tokens / spec_verify_ct): the prefill's token counted
        # in, the verify steps only in the denominator; comparable with --mode server.
        "accept_length_sglang_style": _ratio(totals["spec"]["new_tokens"], verify_steps),
        "acceptance": acceptance_by_position(accept_lengths, num_positions),
        "tokens_per_s": {m: totals[m]["tokens_per_s"] for m in totals},
        "new_tokens": {m: totals[m]["new_tokens"] for m in totals},
        "wall_s": {m: totals[m]["wall_s"] for m in totals},
        "speedup_vs_plain": _ratio(totals["spec"]["tokens_per_s"], totals["plain"]["tokens_per_s"]),
        "speedup_vs_hf_generate": _ratio(totals["spec"]["tokens_per_s"], totals["hf"]["tokens_per_s"]),
        "repetition_4gram_share": repeated / all_tokens if all_tokens else 0.0,
    }
    checked = [run["matches_plain"] for run in runs if run.get("matches_plain") is not None]
    if checked:
        summary["greedy_match"] = {"turns_checked": len(checked), "turns_identical": sum(checked)}
    return summary


def by_category(runs: Sequence[dict[str, Any]], num_positions: int) -> dict[str, dict[str, Any]]:
    categories: dict[str, list] = {}
    for run in runs:
        if run.get("category"):
            categories.setdefault(run["category"], []).append(run)
    return {name: summarize_generations(group, num_positions) for name, group in sorted(categories.items())}


# --- file names ----------------------------------------------------------------------------------------

def _number(value: float) -> str:
    text = f"{value:g}"
    return text.replace("-", "m")


def _tag(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:40]


def results_stem(mode: str, *, num_steps: int | None = None, topk: int = 1, num_draft_tokens: int | None = None,
                 temperature: float | None = None, top_p: float = 1.0, concurrency: int | None = None,
                 prompt_set: str | None = None) -> str:
    """bench_offline_k3_t0, bench_offline_k4_topk4_n16_t0.7_p0.9_mt_bench, bench_server_t0_c8, ..."""
    parts = [f"bench_{mode}"]
    if mode == "offline":
        parts.append(f"k{num_steps}")
        if topk > 1:
            parts.append(f"topk{topk}_n{num_draft_tokens}")
    if mode == "eval" and num_steps is not None:
        parts.append(f"ttt{num_steps}")
    if temperature is not None and mode != "eval":
        parts.append(f"t{_number(temperature)}")
        if top_p < 1.0:
            parts.append(f"p{_number(top_p)}")
    if concurrency is not None and mode == "server":
        parts.append(f"c{concurrency}")
    if prompt_set:
        parts.append(_tag(prompt_set))
    return "_".join(parts)


# --- Markdown --------------------------------------------------------------------------------------------

def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(cell) for cell in row) + " |")
    return "\n".join(lines)


def settings_table(settings: dict[str, Any]) -> str:
    return markdown_table(["setting", "value"], [(key, value) for key, value in settings.items()
                                                 if not isinstance(value, (dict, list))])


def offline_markdown(results: dict[str, Any]) -> str:
    overall = results["overall"]
    acceptance = overall["acceptance"]
    parts = [f"# Speculative decoding benchmark (offline, {results['settings']['drafting']})", "",
             settings_table(results["settings"]), "", "## Overall", ""]
    tps = overall["tokens_per_s"]
    parts.append(markdown_table(
        ["tau (tokens / verify step)", "tok/s speculative", "tok/s same loop, no drafter", "tok/s HF generate",
         "speedup vs loop", "speedup vs HF generate", "4-gram repetition", "turns"],
        [(overall["tau"], tps["spec"], tps["plain"], tps["hf"], overall["speedup_vs_plain"],
          overall["speedup_vs_hf_generate"], overall["repetition_4gram_share"], overall["turns"])]))
    if "greedy_match" in overall:
        match = overall["greedy_match"]
        parts += ["", f"Greedy check: {match['turns_identical']} of {match['turns_checked']} turns identical to the "
                      "verifier's own greedy decoding."]
    parts += ["", "## Acceptance by draft position", "",
              markdown_table(["position", "conditional rate", "share of verify steps"],
                             [(j + 1, c, s) for j, (c, s) in enumerate(zip(acceptance["conditional_rate"],
                                                                           acceptance["share"]))])]
    taught = overall.get("teacher_forced")
    if taught:
        parts += ["", "Teacher-forced on these outputs (stage 04's validation, on the decoded text): top-1 agreement "
                      f"per step {', '.join(fmt(a) for a in taught['acc_per_step'])}; simulated acceptance length "
                      f"{fmt(taught['sim_accept_len'])} over {taught['tokens']} tokens."]
    if results.get("categories"):
        parts += ["", "## By category", "", markdown_table(
            ["category", "turns", "tau", "speedup vs loop", "4-gram repetition"],
            [(name, c["turns"], c["tau"], c["speedup_vs_plain"], c["repetition_4gram_share"])
             for name, c in results["categories"].items()])]
    parts += ["", "## Per prompt", "", markdown_table(
        ["prompt", "category", "turns", "new tokens", "tau", "speedup vs loop", "4-gram repetition"],
        [(p["id"], p.get("category"), p["summary"]["turns"], p["summary"]["new_tokens"]["spec"], p["summary"]["tau"],
          p["summary"]["speedup_vs_plain"], p["summary"]["repetition_4gram_share"]) for p in results["prompts"]])]
    return "\n".join(parts) + "\n"


def server_markdown(results: dict[str, Any]) -> str:
    parts = ["# Speculative decoding benchmark (server)", "", settings_table(results["settings"]), ""]
    rows = []
    for name in ("speculative", "baseline"):
        run = results.get(name)
        if not run:
            continue
        latency = run["latency_s"]
        rows.append((name, run["url"], run["requests"], run["completion_tokens"], run["output_tokens_per_s"],
                     run["accept_length"], latency["p50"], latency["p90"], latency["p99"]))
    parts.append(markdown_table(["server", "url", "requests", "output tokens", "output tok/s", "accept length",
                                 "latency p50 s", "latency p90 s", "latency p99 s"], rows))
    if results.get("speedup") is not None:
        parts += ["", f"Speedup (output tok/s) over the baseline server: {fmt(results['speedup'])}"]
    spec = results.get("speculative") or {}
    if spec.get("accept_length_source"):
        parts += ["", f"Accept length source: {spec['accept_length_source']}"]
    return "\n".join(parts) + "\n"


def eval_markdown(results: dict[str, Any]) -> str:
    metrics = results["metrics"]
    parts = ["# Drafter evaluation (teacher-forced, stage-02 hidden states)", "", settings_table(results["settings"]),
             "", markdown_table(["simulated acceptance length", "loss", "tokens"],
                                [(metrics.get("sim_accept_len"), metrics.get("loss"), metrics.get("tokens"))]),
             "", markdown_table(["TTT step", "top-1 agreement", "loss"],
                                [(j, a, l) for j, (a, l) in enumerate(zip(metrics.get("acc_per_step", []),
                                                                           metrics.get("loss_per_step", [])))])]
    return "\n".join(parts) + "\n"


# --- PNG -----------------------------------------------------------------------------------------------

def _plot_series(results: dict[str, Any]) -> list[tuple[str, list[str], list[float]]]:
    """(title, labels, values) panels: acceptance by draft position, and tau per category if any."""
    panels = []
    if results.get("mode") == "offline":
        rates = results["overall"]["acceptance"]["conditional_rate"]
        panels.append(("acceptance rate by draft position", [str(j + 1) for j in range(len(rates))],
                       [r if r is not None else 0.0 for r in rates]))
        if results.get("categories"):
            names = list(results["categories"])
            panels.append(("tau by category", names,
                           [results["categories"][n]["tau"] or 0.0 for n in names]))
    elif results.get("mode") == "eval":
        accs = results["metrics"].get("acc_per_step", [])
        panels.append(("top-1 agreement by TTT step", [str(j) for j in range(len(accs))], list(accs)))
    elif results.get("mode") == "server":
        rows = [(name, results[name]) for name in ("speculative", "baseline") if results.get(name)]
        panels.append(("output tokens/s", [n for n, _ in rows], [r["output_tokens_per_s"] or 0.0 for _, r in rows]))
    return panels


def write_png(path: str | Path, results: dict[str, Any], log=None) -> Path | None:
    panels = _plot_series(results)
    if not panels:
        return None
    path = Path(path)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if log is not None:
            log.info("matplotlib is not installed: drawing %s with the built-in bar-chart fallback", path.name)
        with atomic_path(path) as tmp:
            tmp.write_bytes(render_bar_png(panels))
        return path
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for axis, (title, labels, values) in zip(axes[0], panels):
        axis.bar(range(len(values)), values, color="#3b6ea8")
        axis.set_xticks(range(len(values)))
        axis.set_xticklabels(labels, rotation=30 if max((len(s) for s in labels), default=0) > 3 else 0)
        axis.set_title(title)
        for i, value in enumerate(values):
            axis.annotate(f"{value:.2f}", (i, value), ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return path


# A 3x5 pixel font for the digits and '.', enough to print the value on each bar.
_GLYPHS = {
    "0": ("111", "101", "101", "101", "111"), "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"), "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"), "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"), "7": ("111", "001", "001", "001", "001"),
    "8": ("111", "101", "111", "101", "111"), "9": ("111", "101", "111", "001", "111"),
    ".": ("000", "000", "000", "000", "010"),
}


class _Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        x0, x1 = max(0, min(x0, x1)), min(self.width, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.height, max(y0, y1))
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            start = (y * self.width + x0) * 3
            self.pixels[start:start + len(row)] = row

    def text(self, x: int, y: int, text: str, scale: int = 2, color=(0, 0, 0)) -> None:
        for char in text:
            glyph = _GLYPHS.get(char)
            if glyph is not None:
                for gy, line in enumerate(glyph):
                    for gx, bit in enumerate(line):
                        if bit == "1":
                            self.rect(x + gx * scale, y + gy * scale, x + (gx + 1) * scale, y + (gy + 1) * scale, color)
            x += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.pixels[y * self.width * 3:(y + 1) * self.width * 3])
                       for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + \
            chunk(b"IEND", b"")


def render_bar_png(panels: Sequence[tuple[str, Sequence[str], Sequence[float]]], panel_width: int = 420,
                   height: int = 300) -> bytes:
    """Bar charts side by side, each bar labelled with its value (the fallback without matplotlib)."""
    canvas = _Canvas(panel_width * len(panels), height)
    margin, top, bottom = 30, 30, 40
    for index, (_, labels, values) in enumerate(panels):
        left = index * panel_width + margin
        right = (index + 1) * panel_width - margin // 2
        peak = max([v for v in values if v is not None] + [1e-9])
        scale = (height - top - bottom) / peak
        canvas.rect(left, height - bottom, right, height - bottom + 2, (0, 0, 0))  # x axis
        canvas.rect(left, top - 10, left + 2, height - bottom, (0, 0, 0))  # y axis
        slot = (right - left) / max(len(values), 1)
        for i, value in enumerate(values):
            x0 = int(left + i * slot + slot * 0.15)
            x1 = int(left + (i + 1) * slot - slot * 0.15)
            y0 = int(height - bottom - (value or 0.0) * scale)
            canvas.rect(x0, y0, x1, height - bottom, (59, 110, 168))
            canvas.text(x0, max(y0 - 14, 2), f"{(value or 0.0):.2f}")
            canvas.text(x0, height - bottom + 8, str(i + 1) if not labels[i].isdigit() else labels[i])
    return canvas.png()


# --- writing all reports ---------------------------------------------------------------------------------

def write_reports(output_dir: str | Path, stem: str, results: dict[str, Any], log=None) -> dict[str, str]:
    """<stem>.json (every number and the settings), <stem>.md (summary tables), <stem>.png (plot)."""
    output_dir = Path(output_dir)
    mode = results.get("mode")
    markdown = {"offline": offline_markdown, "server": server_markdown, "eval": eval_markdown}[mode](results)
    files = {"json": str(output_dir / f"{stem}.json"), "markdown": str(output_dir / f"{stem}.md")}
    png = write_png(output_dir / f"{stem}.png", results, log)
    if png is not None:
        files["png"] = str(png)
    results = {**results, "files": files}
    write_json_atomic(files["json"], results)
    write_text_atomic(files["markdown"], markdown)
    return files
