#!/usr/bin/env python3
"""Run the five stages in order over one run directory, resuming after a failure.

    python run_pipeline.py --run-dir runs/kimi --model-path /models/Kimi-K2.5 --dataset chats.jsonl \\
        --epochs 3 --stage-args 02 "--batch-size 8" --stage-args 04 "--batch-size 1"
    nohup python run_pipeline.py --run-dir runs/kimi ... > runs/kimi.out 2>&1 &   tail -f runs/kimi/logs/*.log
    python run_pipeline.py --run-dir runs/kimi --status

Any stage flag given here goes to every stage that takes it (the flag schema says which); `--stage-args
NN "..."` adds flags for one stage only. Every stage's flags are checked before the first stage starts.
Stages whose output is complete and was made with the same flags are skipped, so rerunning the same
command after a failure resumes at the stage that failed (and the stages resume inside themselves).
`--from-stage N` reruns from stage N on; `--only N` runs stage N alone. `--nproc-per-node 8` runs stage 04,
and stage 02 on its hf backend, under torchrun with 8 processes (one per GPU); the other stages run once.
"""
from __future__ import annotations

import argparse
import atexit
import os
import shlex
import sys
import time
from pathlib import Path

from eagle3_pipeline.errors import report_missing_packages  # noqa: E402

report_missing_packages()  # a missing package: one line naming it and the setup command

from eagle3_pipeline.errors import USAGE_ERROR, UsageError  # noqa: E402
from eagle3_pipeline.cli.parser import StageArgumentParser  # noqa: E402
from eagle3_pipeline.cli.lock import hold_run_directory  # noqa: E402
from eagle3_pipeline.cli.pipeline import (STAGES, check_all_flags, is_current, log_size, output_manifest,  # noqa: E402
    run_one, split_shared_flags, stage_argv, stage_command, stage_named, tail)
from eagle3_pipeline.cli.run_status import print_status  # noqa: E402
from eagle3_pipeline.formats.manifest import STATUS_COMPLETE  # noqa: E402


def runner_parser() -> StageArgumentParser:
    parser = StageArgumentParser("run_pipeline", prog="run_pipeline.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, help="The run directory every stage works in.")
    parser.add_argument("--status", action="store_true", help="Print each stage's state and exit.")
    parser.add_argument("--from-stage", type=stage_named, help="Rerun from this stage on (e.g. 04).")
    parser.add_argument("--only", type=stage_named, help="Run this stage alone (e.g. 02).")
    parser.add_argument("--skip", type=stage_named, action="append", default=[],
                        help="Leave this stage out (repeatable), e.g. --skip 05.")
    parser.add_argument("--stage-args", nargs=2, action="append", default=[], metavar=("STAGE", "FLAGS"),
                        help='Flags for one stage only, e.g. --stage-args 04 "--batch-size 2".')
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, metavar="N",
                        help="Processes (GPUs) of this machine for the data-parallel stages: 04, and 02 with "
                             "--backend hf, run under torchrun --standalone (default 1: a plain process).")
    return parser


def shielded_stage_args(argv: list[str]) -> list[str]:
    """argv with each --stage-args value kept as a value: argparse takes a lone "--tau-only" (a dash, no space) for an
    option and stops with "expected 2 arguments"; a leading space makes it a value (shlex drops the space)."""
    out = list(argv)
    for i, token in enumerate(out[:-2]):
        if token == "--stage-args" and out[i + 2].startswith("-") and " " not in out[i + 2]:
            out[i + 2] = " " + out[i + 2]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = runner_parser()
    args, rest = parser.parse_known_args(shielded_stage_args(sys.argv[1:] if argv is None else argv))
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node {args.nproc_per_node}: give 1 or more processes")
    # torchrun passes a SIGINT/SIGTERM on to its ranks but kills them 30 s later by default: too soon for stage
    # 04 to finish its step and save a large drafter's checkpoint. Read by torchruns that have --shutdown-timeout
    # (torch 2.13 here); older ones keep their 30 s.
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")
    run_dir = Path(args.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        sys.stderr.write(f"run_pipeline: --run-dir {run_dir} is a file, not a folder; give the run's folder "
                         f"(a new one is created)\n")
        return USAGE_ERROR
    if args.status:
        return print_status(run_dir)
    shared = split_shared_flags(rest, parser.error,
                                [s for action in parser._actions for s in action.option_strings])
    extra = {stage_named(name): shlex.split(flags) for name, flags in args.stage_args}
    selected = [s for s in STAGES if s not in args.skip]
    if args.only:
        selected = [args.only]
    elif args.from_stage:
        selected = [s for s in selected if s >= args.from_stage]
    argvs = {stage: stage_argv(stage, str(run_dir), shared, extra) for stage in selected}
    resolved = check_all_flags(argvs)
    try:  # one pipeline per run directory, and no stage but its own there (each stage also locks its own folder)
        atexit.register(hold_run_directory(run_dir).release)
    except UsageError as err:
        print(f"run_pipeline.py: {err}", file=sys.stderr)
        return USAGE_ERROR

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    pipeline_log = (run_dir / "logs" / "pipeline.log").open("a")

    def log(message: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}"
        print(line, flush=True)
        pipeline_log.write(line + "\n")
        pipeline_log.flush()

    forced = {args.only, args.from_stage} - {None}
    online = "04_train" in resolved and resolved["04_train"].online
    for stage in selected:
        if stage == "02_extract_hidden_states" and online and stage != args.only:
            log(f"=== {stage}: not needed, skipped (stage 04 computes the verifier's states itself: --online)")
            continue
        manifest = output_manifest(run_dir, stage)
        if stage not in forced and is_current(manifest, resolved[stage]):
            log(f"=== {stage}: complete with these flags, skipped")
            continue
        argv_now = list(argvs[stage])
        if stage == "04_train" and manifest and manifest.get("status") != STATUS_COMPLETE \
                and "--resume" not in argv_now and "--overwrite" not in argv_now:
            argv_now.append("--resume")  # an interrupted training run continues where it stopped
        stage_log = run_dir / "logs" / f"{stage}.log"
        logged_before = log_size(stage_log)
        code = run_one(stage, stage_command(stage, argv_now, resolved[stage], args.nproc_per_node), log)
        if code != 0:
            log(f"{stage} failed (exit {code}); last lines of {stage_log}:\n{tail(stage_log, since=logged_before)}\n"
                f"Fix the cause and rerun the same command: finished stages are skipped.")
            return code
    log("pipeline finished")
    return print_status(run_dir)


if __name__ == "__main__":
    sys.exit(main())
