"""The JSON and Markdown reports of a benchmark run, their file names, the earlier report a rerun of the same
settings keeps, and the folder's index of every run (README.md, newest first; the PNG: eagle3_pipeline.bench.plots).

File naming and the PNG fallback: docs/benchmarking.md ("Output files").
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any, Sequence

from eagle3_pipeline.bench.columns import INDEX_MEANINGS, columns_section
from eagle3_pipeline.bench.plots import write_png
from eagle3_pipeline.bench.settings import chosen_settings
from eagle3_pipeline.figures import TTT_ESTIMATE, WALKED_CHAIN_TAU, figures_text, fmt
from eagle3_pipeline.formats.files import read_json, write_json_atomic, write_text_atomic

INDEX_FILE = "README.md"
EARLIER_DIR = "earlier"  # where a rerun of the same settings moves the report it would overwrite
REPORT_SUFFIXES = (".json", ".md", ".png")
# Below these, a speedup is mostly timing noise (a short prompt's wall time varies by tens of percent on a busy
# machine): it is shown, marked as noisy.
STEADY_TURNS, STEADY_TOKENS = 5, 1000


# --- file names ----------------------------------------------------------------------------------------

def _number(value: float) -> str:
    text = f"{value:g}"
    return text.replace("-", "m")


def _tag(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:40]


def results_stem(mode: str, *, num_steps: int | None = None, topk: int = 1, num_draft_tokens: int | None = None,
                 temperature: float | None = None, top_p: float = 1.0, concurrency: int | None = None,
                 prompt_set: str | None = None, tau_only: bool = False, acceptance_rule: str | None = None) -> str:
    """bench_offline_k3_t0, bench_offline_k4_topk4_n16_t0.7_p0.9_mt_bench, bench_offline_k3_t0_tau (--tau-only),
    bench_server_t0_c8, ..."""
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
        if acceptance_rule == "target-only" and temperature > 0 and mode == "offline":
            parts.append("target_only")
    if concurrency is not None and mode == "server":
        parts.append(f"c{concurrency}")
    if tau_only and mode == "offline":
        parts.append("tau")  # a tau-only report never overwrites the full one of the same settings
    if prompt_set:
        parts.append(_tag(prompt_set))
    return "_".join(parts)


# --- Markdown --------------------------------------------------------------------------------------------

def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(cell) for cell in row) + " |")
    return "\n".join(lines)


def settings_table(settings: dict[str, Any]) -> str:
    """The flags that decided what was measured; every other setting the run recorded is in the JSON."""
    rows = [(flag, "-" if value is None else str(value)) for flag, value in chosen_settings(settings)]  # as typed
    return (markdown_table(["flag", "value"], rows) + "\n\nThe JSON's `settings` holds every other setting the "
            "run recorded (what it worked out beside these flags).")


def prompt_selection_markdown(selection: dict[str, Any] | None) -> list[str]:
    """The '## Prompts' section: how --num-prompts chose the prompts, the per-category counts and the ids."""
    if not selection:
        return []
    return ["", "## Prompts", "",
            f"{selection['chosen']} of {selection['available']} prompts: {selection['method']}"
            + (f" (seed {selection['seed']})." if selection["chosen"] < selection["available"] else "."), "",
            markdown_table(["category", "prompts"], list(selection["per_category"].items())), "",
            "Prompt ids (in run order): " + ", ".join(selection["ids"])]


def noisy_timing(turns: int | None, new_tokens: int | None) -> str | None:
    """Why a speedup over so few turns/tokens is noise, or None when there are enough of both."""
    if (turns or 0) >= STEADY_TURNS and (new_tokens or 0) >= STEADY_TOKENS:
        return None
    return (f"noisy: {turns} turns, {new_tokens} new tokens (a figure to quote needs at least {STEADY_TURNS} turns "
            f"and {STEADY_TOKENS} tokens)")


def compute_dtype_line(settings: dict[str, Any]) -> list[str]:
    """What the models actually computed in, which on a CPU is float32 whatever --dtype says."""
    used = str(settings.get("compute_dtype") or "").replace("torch.", "")
    if not used:
        return []
    asked = settings.get("dtype")
    note = ""
    if asked and asked != used:
        note = f" (--dtype {asked} applies on a GPU; on a CPU the stage computes in float32)"
    return [f"Computed in **{used}** on {settings.get('device')}{note}.", ""]


def overlap_markdown(overlap: dict[str, Any] | None) -> list[str]:
    """A warning in the report itself when the prompts were not checked against the drafter's training prompts (the
    log's warning is gone once the report travels), or when some were and --allow-overlap measured them anyway."""
    if not overlap:
        return []
    if not overlap.get("checked"):
        return ["", f"**Not checked against the drafter's training prompts** ({overlap.get('reason')}): if these "
                    "prompts were trained on, tau is overstated."]
    if overlap.get("overlapping"):
        return ["", f"**{overlap['overlapping']} of {overlap['prompts_checked']} prompts were training prompts of "
                    "the drafter** (--allow-overlap): tau is overstated on them."]
    return []


def greedy_match_markdown(match: dict[str, Any]) -> list[str]:
    """The greedy check and the divergence report of a temperature-0 run."""
    reference = {"plain_decode": "the verifier's own greedy decoding (the loop without drafting)",
                 "teacher_forced_argmax": "the verifier's argmax after each prefix of the output (one "
                                          "teacher-forced forward; --tau-only)"}
    parts = ["", f"Greedy check: {match['turns_identical']} of {match['turns_checked']} turns identical to "
                 + " and ".join(reference.get(r, r) for r in match["reference"])
                 + f"; {match.get('turns_parted_at_a_tie', 0)} more parted at a tie; mean share of tokens before the "
                 f"first divergence {fmt(match['mean_share_before_divergence'])}."]
    if match["diverged"]:
        parts += ["", "Diverged turns:", "",
                  markdown_table(["prompt", "turn", "first divergence", "share before", "logit margin", "tie"],
                                 [(d["prompt_id"], d["turn"], d["first_divergence"], d["share_before_divergence"],
                                   d["logit_margin"], "yes" if d.get("tie") else "no") for d in match["diverged"]])]
    return parts


def window_name(window: dict[str, Any]) -> str:
    """'0-127', '1024+': the output positions of a tau_by_window entry."""
    return f"{window['from']}-{window['to'] - 1}" if window["to"] else f"{window['from']}+"


def tau_by_window_markdown(windows: list[dict[str, Any]]) -> list[str]:
    if len(windows) < 2:  # one window: the overall tau says it all
        return []
    return ["", "## Tau along the reply", "",
            "Verify steps grouped by where they begin in their turn's output: the first window is what a run with "
            "--max-new-tokens 128 measures (docs/benchmarking.md, \"Reply length\").", "",
            markdown_table(["output tokens", "tau", "verify steps", "4-gram repetition"],
                           [(window_name(w), w["tau"], w["verify_steps"], w["repetition_4gram_share"])
                            for w in windows])]


def acceptance_markdown(acceptance: dict[str, list]) -> list[str]:
    """The acceptance-by-draft-position table (metrics.acceptance_by_position)."""
    return [markdown_table(["position", "conditional rate", "share of verify steps"],
                           [(j + 1, c, s) for j, (c, s) in enumerate(zip(acceptance["conditional_rate"],
                                                                         acceptance["share"]))])]


def offline_markdown(results: dict[str, Any]) -> str:
    overall = results["overall"]
    acceptance = overall["acceptance"]
    timed = "speedup_vs_plain" in overall  # absent in a --tau-only run: no baselines, no speedups
    parts = [f"# Speculative decoding benchmark (offline, {results['settings']['drafting']})", "",
             *compute_dtype_line(results["settings"]), settings_table(results["settings"]),
             *overlap_markdown(results.get("overlap_check")), "", "## Overall", ""]
    tps = overall["tokens_per_s"]
    if timed:
        parts.append(markdown_table(
            ["tau", "tok/s speculative", "tok/s same loop, no drafter", "tok/s HF generate",
             "speedup vs loop", "speedup vs HF generate", "4-gram repetition", "turns"],
            [(overall["tau"], tps["spec"], tps["plain"], tps["hf"], overall["speedup_vs_plain"],
              overall["speedup_vs_hf_generate"], overall["repetition_4gram_share"], overall["turns"])]))
        noisy = noisy_timing(overall["turns"], overall.get("new_tokens", {}).get("spec"))
        if noisy:
            parts += ["", f"Speedups {noisy}."]
    else:
        parts.append(markdown_table(
            ["tau", "tok/s speculative", "4-gram repetition", "turns"],
            [(overall["tau"], tps["spec"], overall["repetition_4gram_share"], overall["turns"])]))
        parts += ["", "Tau only (--tau-only): the timing baselines were not run, so there are no speedups."]
    if "greedy_match" in overall:
        parts += greedy_match_markdown(overall["greedy_match"])
    parts += tau_by_window_markdown(overall.get("tau_by_window") or [])
    parts += ["", "## Acceptance by draft position", "", *acceptance_markdown(acceptance)]
    taught = overall.get("teacher_forced")
    if taught:
        parts += ["", "Teacher-forced on these outputs (stage 04's validation, on the decoded text): top-1 agreement "
                      f"per step {', '.join(fmt(a) for a in taught['acc_per_step'])}; {figures_text(taught)} "
                      f"over {taught['tokens']} tokens."]
    speedup = ["speedup vs loop"] if timed else []
    if results.get("categories"):
        parts += ["", "## By category", "", markdown_table(
            ["category", "turns", "tau"] + speedup + ["4-gram repetition"],
            [(name, c["turns"], c["tau"]) + ((_marked_speedup(c),) if timed else ()) +
             (c["repetition_4gram_share"],) for name, c in results["categories"].items()])]
    parts += prompt_selection_markdown(results.get("prompt_selection"))
    parts += ["", "## Per prompt", ""]
    if timed:
        parts += ["Speedups per prompt are left to the JSON: one prompt's timing is noise; the aggregates above "
                  "pool every turn.", ""]
    parts += [markdown_table(
        ["prompt", "category", "turns", "new tokens", "tau", "4-gram repetition"],
        [(p["id"], p.get("category"), p["summary"]["turns"], p["summary"]["new_tokens"]["spec"], p["summary"]["tau"],
          p["summary"]["repetition_4gram_share"]) for p in results["prompts"]])]
    return with_columns("\n".join(parts) + "\n")


def with_columns(markdown: str) -> str:
    """A report followed by what each of its columns means (eagle3_pipeline.bench.columns)."""
    return markdown + columns_section(markdown)


def _marked_speedup(summary: dict[str, Any]) -> str:
    """A pooled speedup, with "(noisy)" when it rests on too few turns or tokens."""
    text = fmt(summary.get("speedup_vs_plain"))
    noisy = noisy_timing(summary.get("turns"), (summary.get("new_tokens") or {}).get("spec"))
    return f"{text} (noisy)" if noisy and summary.get("speedup_vs_plain") is not None else text


def server_markdown(results: dict[str, Any]) -> str:
    parts = ["# Speculative decoding benchmark (server)", "", settings_table(results["settings"]),
             *overlap_markdown(results.get("overlap_check")), ""]
    rows = []
    for name in ("speculative", "baseline"):
        run = results.get(name)
        if not run:
            continue
        latency = run["latency_s"]
        rows.append((name, run["url"], run["requests"], run["completion_tokens"], run["output_tokens_per_s"],
                     run["accept_length"], latency["p50"], latency["p90"], latency["p99"]))
    parts.append(markdown_table(["server", "url", "requests", "completion tokens", "output tok/s", "accept length",
                                 "latency p50 s", "latency p90 s", "latency p99 s"], rows))
    if results.get("speedup") is not None:
        parts += ["", f"Speedup (output tok/s) over the baseline server: {fmt(results['speedup'])}"]
    spec = results.get("speculative") or {}
    if spec.get("accept_length_source"):
        parts += ["", f"Accept length source: {spec['accept_length_source']}"]
    if spec.get("vllm_acceptance"):
        parts += vllm_acceptance_markdown(spec["vllm_acceptance"])
    elif spec.get("sglang_acceptance"):
        parts += sglang_acceptance_markdown(spec["sglang_acceptance"])
    parts += prompt_selection_markdown(results.get("prompt_selection"))
    return with_columns("\n".join(parts) + "\n")


def sglang_acceptance_markdown(sglang: dict[str, Any]) -> list[str]:
    """The speculative server's own acceptance fields (server.sglang_acceptance): figures, histogram, positions."""
    parts = ["", "## SGLang's acceptance fields", ""]
    requests = sglang["requests"]
    if not any(requests.values()):  # no reply carried any of the fields
        return parts + ["None in the replies' meta_info (not SGLang, no speculative decoding, or a release "
                        "without them; docs/benchmarking.md, \"Server mode\")."]
    parts.append(markdown_table(["figure", "value", "requests with it"], [  # from each reply's meta_info
        ("accept length: sum completion_tokens / sum spec_verify_ct", sglang["completion_tokens_per_verify_ct"],
         requests["spec_verify_ct"]),
        ("mean of spec_accept_length", sglang["mean_spec_accept_length"], requests["spec_accept_length"]),
        ("spec_accept_rate (accepted / proposed drafts, bonus not counted), weighted by verify steps",
         sglang["spec_accept_rate"], requests["spec_accept_rate"]),
        ("tokens per verify step from the histogram (prefill token not counted: offline mode's tau)",
         sglang["histogram_tau"], requests["histogram"])]))
    if sglang["absent"]:
        parts += ["", "Not in any reply: " + ", ".join(sglang["absent"]) + "."]
    histogram = sglang["histogram"]
    if histogram:
        total = sum(histogram)
        parts += ["", "### Acceptance histogram (summed over requests)", "",
                  markdown_table(["accepted drafts in a verify step", "verify steps", "share with this many"],
                                 [(k, steps, steps / total) for k, steps in enumerate(histogram)]),
                  "", "### Acceptance by draft position (from the histogram)", "",
                  *acceptance_markdown(sglang["acceptance"])]
    return parts


def vllm_acceptance_markdown(vllm: dict[str, Any]) -> list[str]:
    """vLLM's own speculative-decoding counters over the run (vllm_metrics.vllm_acceptance)."""
    parts = ["", "## vLLM's acceptance counters (GET /metrics, this run's difference)", "",
             markdown_table(["figure", "value"], [
                 ("verify steps with drafts (num_drafts)", vllm["drafts"]),
                 ("drafted tokens", vllm["draft_tokens"]), ("accepted tokens", vllm["accepted_tokens"]),
                 ("mean acceptance length: 1 + accepted / drafts (offline mode's tau)",
                  vllm["mean_acceptance_length"]),
                 ("accepted / drafted tokens", vllm["draft_acceptance_rate"])])]
    if vllm["acceptance_rate_by_position"]:
        parts += ["", markdown_table(["draft position", "share of verify steps accepting it"],
                                     list(enumerate(vllm["acceptance_rate_by_position"], start=1)))]
    return parts


def eval_markdown(results: dict[str, Any]) -> str:
    metrics = results["metrics"]
    parts = ["# Drafter evaluation (teacher-forced, stage-02 hidden states)", "",
             *compute_dtype_line(results["settings"]), settings_table(results["settings"]),
             "", markdown_table([WALKED_CHAIN_TAU, TTT_ESTIMATE, "loss", "tokens"],
                                [(metrics.get("sim_chain_tau"), metrics.get("sim_accept_len"), metrics.get("loss"),
                                  metrics.get("tokens"))]),
             "", markdown_table(["TTT step", "top-1 agreement", "loss at this step"],
                                [(j, a, l) for j, (a, l) in enumerate(zip(metrics.get("acc_per_step", []),
                                                                           metrics.get("loss_per_step", [])))])]
    return with_columns("\n".join(parts) + "\n")


# --- writing all reports ---------------------------------------------------------------------------------

def write_reports(output_dir: str | Path, stem: str, results: dict[str, Any], log=None) -> dict[str, str]:
    """<stem>.json (every number and the settings), <stem>.md (summary tables), <stem>.png (plot). A report
    already under these names (a rerun of the same settings) is kept in earlier/ first."""
    output_dir = Path(output_dir)
    mode = results.get("mode")
    markdown = {"offline": offline_markdown, "server": server_markdown, "eval": eval_markdown}[mode](results)
    kept = keep_earlier(output_dir, stem)
    if kept is not None and log is not None:
        log.info("a report of the same settings was there: the earlier one is kept as %s, this run's is %s",
                 kept, output_dir / f"{stem}.md")
    files = {"json": str(output_dir / f"{stem}.json"), "markdown": str(output_dir / f"{stem}.md")}
    png = write_png(output_dir / f"{stem}.png", results, log)
    if png is not None:
        files["png"] = str(png)
    results = {**results, "files": files}
    write_json_atomic(files["json"], results)
    write_text_atomic(files["markdown"], markdown)
    files["index"] = str(write_index(output_dir))
    return files


def keep_earlier(output_dir: Path, stem: str) -> Path | None:
    """Move the report named `stem` to earlier/<stem>_<its creation time>.* (its JSON's `files` updated); the
    path of its Markdown there, or None when there was none."""
    earlier = output_dir / f"{stem}.json"
    if not earlier.exists():
        return None
    try:
        results = read_json(earlier)
    except (OSError, ValueError):
        results = {}  # moved all the same, as it is
    created = results.get("created_at") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(earlier.stat().st_mtime))
    folder = output_dir / EARLIER_DIR
    folder.mkdir(exist_ok=True)
    name = base = f"{stem}_{re.sub('[^0-9TZ]', '', created)}"  # bench_offline_k3_t0_20261201T120000Z
    number = 2
    while (folder / f"{name}.json").exists():  # two runs in the same second
        name, number = f"{base}_{number}", number + 1
    moved = {}
    for suffix in REPORT_SUFFIXES:
        if (output_dir / f"{stem}{suffix}").exists():
            moved[suffix] = folder / f"{name}{suffix}"
            os.replace(output_dir / f"{stem}{suffix}", moved[suffix])
    if results:
        write_json_atomic(moved[".json"], {**results, "files": {
            key: str(moved[suffix]) for key, suffix in (("json", ".json"), ("markdown", ".md"), ("png", ".png"))
            if suffix in moved}})
    return moved.get(".md", moved[".json"])


def run_counts(results: dict[str, Any]) -> dict[str, Any]:
    """What the manifest counts of a run: prompts and turns (or requests, or samples) and tokens."""
    settings, mode = results.get("settings", {}), results.get("mode")
    if mode == "offline":
        overall = results["overall"]
        return {"prompts": settings.get("prompt_count"), "turns": overall.get("turns"),
                "new_tokens": (overall.get("new_tokens") or {}).get("spec"),
                "verify_steps": overall.get("verify_steps")}
    if mode == "server":
        spec = results.get("speculative") or {}
        return {"prompts": settings.get("prompt_count"), "requests": spec.get("requests"),
                "new_tokens": spec.get("completion_tokens")}
    return {"samples": settings.get("samples"), "tokens": (results.get("metrics") or {}).get("tokens")}


# --- the folder's index ------------------------------------------------------------------------------------

def index_row(path: Path, results: dict[str, Any]) -> tuple:
    """One run in the index: when, mode, report, drafter, prompts, setting, tau, speedup, dtype."""
    settings = results.get("settings", {})
    mode = results.get("mode")
    prompts = settings.get("prompts")
    prompt_text = f"{Path(str(prompts)).name if prompts else '-'} ({settings.get('prompt_count', '?')})"
    setting, tau, speedup = "-", None, "-"
    if mode == "offline":
        overall = results.get("overall", {})
        setting = f"k={settings.get('num_steps')}" + (f", topk={settings['topk']}" if (settings.get("topk") or 1) > 1
                                                     else "") + f", T={settings.get('temperature')}"
        tau = overall.get("tau")
        speedup = _marked_speedup(overall) if "speedup_vs_plain" in overall else "tau only"
    elif mode == "server":
        setting = f"T={settings.get('temperature')}, concurrency {settings.get('concurrency')}"
        tau = (results.get("speculative") or {}).get("accept_length")
        speedup = fmt(results.get("speedup"))
    elif mode == "eval":
        setting, prompt_text = f"TTT {settings.get('ttt_steps')}", f"validation split ({settings.get('samples')})"
        tau = (results.get("metrics") or {}).get("sim_chain_tau")  # the walked chain tau: it compares with tau
    dtype = str(settings.get("compute_dtype") or settings.get("dtype") or "-").replace("torch.", "")
    return (results.get("created_at", "-"), mode, f"[{path.stem}]({path.stem}.md)",
            settings.get("draft_checkpoint") or "-", prompt_text, setting, tau, speedup, dtype)


def headline(results: dict[str, Any], digits: int = 3) -> str:
    """A report's main figures in a few words (stage 05's last line, --status): 'tau 1.210, speedup 0.680x vs
    the loop without the drafter (noisy)'."""
    mode = results.get("mode")
    if mode == "eval":
        return figures_text(results.get("metrics") or {}, digits) + " (teacher-forced: no speedup)"
    if mode == "server":
        text = f"accept length {fmt((results.get('speculative') or {}).get('accept_length'), digits)}"
        if results.get("speedup") is None:
            return text + " (no --baseline-url: no speedup)"
        return text + f", speedup {fmt(results['speedup'], digits)}x vs the baseline server"
    overall = results.get("overall") or {}
    text = f"tau {fmt(overall.get('tau'), digits)}"
    if "speedup_vs_plain" not in overall:
        return text + " (--tau-only: no speedup)"
    noisy = noisy_timing(overall.get("turns"), (overall.get("new_tokens") or {}).get("spec"))
    return (text + f", speedup {fmt(overall['speedup_vs_plain'], digits)}x vs the loop without the drafter"
            + (" (noisy)" if noisy else ""))


def read_reports(folder: str | Path, prefix: str = "bench_") -> list[tuple[Path, dict[str, Any]]]:
    """Every report (PREFIX*.json) in a benchmark folder with its results, oldest first; none when it is absent."""
    found = []
    for path in Path(folder).glob(f"{prefix}*.json") if Path(folder).is_dir() else []:
        try:
            found.append((path, read_json(path)))
        except (OSError, ValueError):
            continue  # a report being replaced right now
    return sorted(found, key=lambda item: (item[1].get("created_at", ""), item[0].stat().st_mtime))


def latest_report(folder: str | Path, prefix: str = "bench_") -> dict[str, Any] | None:
    """The newest report whose name starts with `prefix` (e.g. bench_eval_), or None."""
    found = read_reports(folder, prefix)
    return found[-1][1] if found else None


def write_index(output_dir: str | Path) -> Path:
    """README.md in the benchmark folder: every report there (bench_*.json), newest first."""
    output_dir = Path(output_dir)
    rows = [(results.get("created_at", ""), path.stat().st_mtime, index_row(path, results))
            for path, results in read_reports(output_dir)]
    rows.sort(key=lambda row: row[:2], reverse=True)
    kept = (f" A rerun of the same settings moved the report it replaced to {EARLIER_DIR}/, its name ending in "
            f"the time it was made." if (output_dir / EARLIER_DIR).is_dir() else "")
    table = "\n".join([
        "# Benchmark runs in this folder", "",
        "Newest first; each report has its .json (every number), .md (tables) and .png (plots)." + kept, "",
        markdown_table(["when (UTC)", "mode", "report", "drafter", "prompts (count)", "setting", "tau",
                        "speedup", "dtype"], [row for _, _, row in rows])]) + "\n"
    index = output_dir / INDEX_FILE
    write_text_atomic(index, table + columns_section(table, INDEX_MEANINGS))
    return index
