#!/usr/bin/env python3
"""Run lanes - experiments, each a declared change from a base run - over a base run directory, each into its own
folder.

    python scripts/lab/run_lanes.py --base runs/q --lanes default,ttt7,lr3_steps2 --model-path VERIFIER \\
        --stage-args 04 "--epochs 4 --lr 1e-3 --max-tokens-per-batch 4096" --benchmarks eval,heldout [--dry-run]

A lane's name says what it changes (the parts below; docs/lab.md). Stage flags are given as to run_pipeline.py: a
stage flag goes to every stage that takes it, --stage-args NN "..." to one stage (--stage-args specforge "..." to
SpecForge's recipe). Together they are the base run's recipe, which each lane changes. Each lane goes to
LANES_DIR/NAME (default BASE/lanes/NAME) with a lane.json: the lane, its base run, each step's flags and state.
Steps complete with the same flags are skipped, so the same command resumes after a failure. Lanes run one after
another (a shell runs several of these commands side by side); --only picks their data, train or bench steps.
--dry-run prints the plan; --data-folders and --flags-of answer a shell's questions about it.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from eagle3_pipeline.errors import USAGE_ERROR, UsageError
from eagle3_pipeline.cli.parser import StageArgumentParser
from eagle3_pipeline.cli.pipeline import STAGES, split_shared_flags, stage_command, stage_named
from eagle3_pipeline.lab.argv import check_known
from eagle3_pipeline.lab.benchmarks import BENCHMARKS, BenchSettings, check_names
from eagle3_pipeline.lab.lanes import PREPARE, SPECFORGE, Base, Knobs, describe_parts, lane_named
from eagle3_pipeline.lab.plan import LanePlan, in_order, plan_lane, reruns
from eagle3_pipeline.lab.run import PARTS, parse_step, run_lane


def runner_parser() -> StageArgumentParser:
    parser = StageArgumentParser("run_lanes", prog="run_lanes.py", description=__doc__,
                                 epilog=describe_parts(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="The base run directory (stages 01-03 done; 01 and 03 when "
                        "its stage 04 flags say --online).")
    parser.add_argument("--lanes", required=True, help="Lane names, separated by commas or spaces.")
    parser.add_argument("--lanes-dir", help="Where each lane's folder goes (default BASE/lanes).")
    parser.add_argument("--stage-args", nargs=2, action="append", default=[], metavar=("STAGE", "FLAGS"),
                        help='Base flags for one stage only (01-05, or specforge), e.g. --stage-args 04 "--lr 1e-3".')
    parser.add_argument("--benchmarks", default="eval,heldout",
                        help=f"Stage-05 runs each lane gets, if it takes them: {', '.join(BENCHMARKS)}.")
    parser.add_argument("--mt-bench", help="MT-bench's questions (mt_bench.jsonl) for the mtbench benchmarks.")
    parser.add_argument("--heldout-prompts",
                        help="Prompts of the heldout benchmarks (default BASE/data/eval_data.jsonl).")
    parser.add_argument("--spec-bench", help="Spec-Bench's questions (spec_bench.jsonl) for the specbench benchmark.")
    settings = BenchSettings()
    for flag, value, what in (("--heldout", settings.heldout, "held-out prompts decoded"),
                              ("--new-tokens", None, "new tokens a turn of each decoding run (default stage 05's)"),
                              ("--field-tokens", None, "new tokens a turn of mtbench at T=0 (default --new-tokens)"),
                              ("--eval-steps", settings.eval_steps, "TTT steps the eval benchmark scores"),
                              ("--spec-bench-prompts", settings.spec_bench_prompts,
                               "Spec-Bench prompts the specbench benchmark decodes, spread over its categories")):
        parser.add_argument(flag, type=int, default=value, help=what[0].upper() + what[1:] + ".")
    knobs = Knobs()
    for flag, value, what in (("--lever-step-tokens", knobs.lever_step_tokens, "tokens a step of the steps part"),
                              ("--format-step-tokens", knobs.format_step_tokens, "storage-format lanes' tokens a step"),
                              ("--data-samples", knobs.data_samples, "prompts of the data and all lanes"),
                              ("--data-epochs", knobs.data_epochs, "epochs of the data and all lanes"),
                              ("--data-turns", knobs.data_turns, "user turns of the all lane's conversations"),
                              ("--long-tokens", knobs.long_tokens, "longest reply of the long lane")):
        parser.add_argument(flag, type=int, default=value, help=f"{what.capitalize()} (default {value}).")
    parser.add_argument("--data-extra", action="append", default=[], metavar="FILE",
                        help="More chat files for the data, all and made lanes, beside stage 01's --dataset "
                             "(repeatable).")
    parser.add_argument("--only", action="append", choices=PARTS, default=[],
                        help="Run only these steps of each lane (repeatable): data, train or bench.")
    parser.add_argument("--bench-jobs", type=int, default=1, help="A lane's benchmarks run this many at a time.")
    parser.add_argument("--dry-run", action="store_true", help="Print each lane's plan and exit.")
    parser.add_argument("--data-folders", action="store_true",
                        help="Print the folder of every lane that reruns stage 01 (where a shell puts a "
                             "regeneration cache) and exit.")
    parser.add_argument("--flags-of", metavar="STAGE", help="Print each lane's name, a tab, and the flags it changes "
                        "for STAGE (e.g. 02), one lane a line, and exit.")
    return parser


def stage_key(text: str) -> str:
    """A --stage-args name: a pipeline stage (04, 04_train, train) or specforge."""
    return SPECFORGE if text == "specforge" else stage_named(text)


def base_of(args: argparse.Namespace, rest: list[str], parser: StageArgumentParser) -> Base:
    shared = split_shared_flags(rest, parser.error, [s for action in parser._actions for s in action.option_strings])
    flags = {stage: list(shared[stage]) for stage in STAGES}
    flags[SPECFORGE] = []
    for name, text in args.stage_args:
        try:
            flags[stage_key(name)] += shlex.split(text)
        except argparse.ArgumentTypeError as err:
            parser.error(f"--stage-args {name}: {err}; or specforge")
    for stage, argv in flags.items():
        check_known(stage, argv)
    knobs = Knobs(args.lever_step_tokens, args.format_step_tokens, args.data_samples, args.data_epochs,
                  args.data_turns, tuple(args.data_extra), args.long_tokens)
    return Base(Path(args.base).resolve(), flags, knobs)


def plans_of(args: argparse.Namespace, base: Base) -> list[LanePlan]:
    suite = [name for name in args.benchmarks.replace(",", " ").split() if name]
    check_names(suite)
    settings = BenchSettings(mt_bench=args.mt_bench and str(Path(args.mt_bench).resolve()),
                             heldout_prompts=args.heldout_prompts and str(Path(args.heldout_prompts).resolve()),
                             heldout=args.heldout, new_tokens=args.new_tokens, field_tokens=args.field_tokens,
                             eval_steps=args.eval_steps,
                             spec_bench=args.spec_bench and str(Path(args.spec_bench).resolve()),
                             spec_bench_prompts=args.spec_bench_prompts)
    lanes_dir = Path(args.lanes_dir).resolve() if args.lanes_dir else base.run / "lanes"
    lanes = {}
    for name in args.lanes.replace(",", " ").split():
        lane = lane_named(name, base, suite)
        lanes.setdefault(lane.name, lane)  # fp8_topk and fp8topk are one lane
    plans = in_order([plan_lane(lane, base, lanes_dir, settings) for lane in lanes.values()])
    for plan in plans:
        for step in plan.steps:
            check_known(step.script, step.argv)
    return plans


def describe(plan: LanePlan) -> str:
    """A lane's plan as the commands it runs."""
    lane = plan.lane
    lines = [f"lane {lane.name}: reruns from {lane.first_stage}, over {plan.base_run}; folder {plan.folder}"]
    lines += [f"  changes {stage}: {shlex.join(flags)}" for stage, flags in lane.changes.items()]
    for step in plan.steps:
        command = stage_command(step.script, step.argv, argparse.Namespace(backend="hf"), 1)
        lines.append(f"  {step.name} [{step.part}]: {shlex.join(command)}")
    return "\n".join(lines)


def answer(args: argparse.Namespace, plans: list[LanePlan]) -> None:
    """--dry-run, --data-folders, --flags-of: what the plan is, without running it."""
    if args.data_folders:
        folders = {plan.data_folder: None for plan in plans if PREPARE in reruns(plan.lane)}
        print("\n".join(folders))
    elif args.flags_of:
        stage = stage_key(args.flags_of)
        print("\n".join(f"{plan.lane.name}\t{shlex.join(plan.lane.changes.get(stage, []))}" for plan in plans))
    else:
        print("\n\n".join(describe(plan) for plan in plans))


def main(argv: list[str] | None = None) -> int:
    parser = runner_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        plans = plans_of(args, base_of(args, rest, parser))
        if args.dry_run or args.data_folders or args.flags_of:
            answer(args, plans)
            return 0
        parsed = {plan.lane.name: {step.name: parse_step(plan, step) for step in plan.steps} for plan in plans}
    except (UsageError, argparse.ArgumentTypeError) as err:
        print(f"run_lanes.py: {err}", file=sys.stderr)
        return USAGE_ERROR
    lanes_dir = Path(plans[0].folder).parent if plans else Path(args.base)
    lanes_dir.mkdir(parents=True, exist_ok=True)
    with open(lanes_dir / "run_lanes.log", "a") as lanes_log:
        def log(message: str) -> None:
            line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}"
            print(line, flush=True)
            lanes_log.write(line + "\n")
            lanes_log.flush()

        codes = {}
        for plan in plans:
            try:
                codes[plan.lane.name] = run_lane(plan, parsed[plan.lane.name], tuple(args.only or PARTS),
                                                 args.bench_jobs, log)
            except UsageError as err:  # its folder is in use by another run_lanes.py
                log(f"lane {plan.lane.name}: {err}")
                codes[plan.lane.name] = USAGE_ERROR
        log("lanes: " + ", ".join(f"{name} {'done' if code == 0 else f'FAILED (exit {code})'}"
                                  for name, code in codes.items()))
    return next((code for code in codes.values() if code), 0)


if __name__ == "__main__":
    sys.exit(main())
