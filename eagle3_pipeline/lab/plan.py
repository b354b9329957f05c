"""A lane's plan over a base run: its folder, where its inputs come from, each step as the flags of the script that
runs it; and lane.json, the record of all of it.

A lane's folder, LANES_DIR/NAME, is a run directory: checkpoints/, bench_<benchmark>/, logs/, lane.json. The stages
before the lane's first stage are the base run's, read through explicit path flags; the stages it reruns before
stage 04 go to the folder of its data part (LANES_DIR/sampled for sampled and sampled_epochs2 alike), so lanes on
the same data prepare it once.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.formats.run_layout import PREPARED_DATA_FILE, RUN_LAYOUT
from eagle3_pipeline.lab.argv import merged
from eagle3_pipeline.lab.benchmarks import BenchSettings, benchmark_flags
from eagle3_pipeline.lab.lanes import BENCH, EXTRACT, PREPARE, SPECFORGE, TRAIN, VOCAB, Base, Lane

LANE_FILE = "lane.json"
DRAFTER = "checkpoints"
# The stages a stage reads: it reruns when one of them does (stage 03 reads only stage 01's data).
READS = {EXTRACT: (PREPARE,), VOCAB: (PREPARE,)}
LOG_NAMES = {SPECFORGE: "specforge_recipe"}  # a script's log file name, where it is not the stage's


@dataclass(frozen=True)
class Step:
    name: str  # "01_prepare_data", "04_train", "bench_heldout"
    part: str  # "data", "train" or "bench": what --only picks
    script: str  # named as eagle3_pipeline.cli.pipeline names stages: "04_train", or SPECFORGE
    argv: list[str]
    output_dir: str  # its manifest.json says whether it finished, and with which flags
    log: str  # the log file the script writes (its tail is shown when it fails)
    benchmark: str = ""  # a bench step's name in eagle3_pipeline.lab.benchmarks.BENCHMARKS


@dataclass(frozen=True)
class LanePlan:
    lane: Lane
    base_run: str
    folder: str  # the lane's own run directory
    data_folder: str  # where its stages before 04 run (its data part's folder), or the base run
    inputs: dict[str, str]  # prepared_data, vocab, hidden_states (none online): what its training reads
    drafter: str  # its stage-04 output folder
    steps: list[Step]


def reruns(lane: Lane) -> list[str]:
    """The stages before 04 the lane runs again, in the pipeline's order: its first stage and those that read it
    (never stage 02 for a lane trained --online)."""
    stages: list[str] = []
    for stage in (PREPARE, VOCAB) if lane.online else (PREPARE, EXTRACT, VOCAB):
        if stage == lane.first_stage or any(read in stages for read in READS.get(stage, ())):
            stages.append(stage)
    return stages


def input_paths(lane: Lane, base_run: Path, data_folder: Path) -> dict[str, str]:
    again = reruns(lane)
    data_run = data_folder if PREPARE in again else base_run  # stage 01's data, and the vocabulary made from it
    inputs = {"prepared_data": str(data_run / RUN_LAYOUT[PREPARE] / PREPARED_DATA_FILE),
              "vocab": str(data_run / RUN_LAYOUT[VOCAB])}
    if not lane.online:
        states_run = data_folder if EXTRACT in again else base_run
        inputs["hidden_states"] = str(states_run / RUN_LAYOUT[EXTRACT])
    return inputs


def log_file(script: str, run_dir: Path | None, output_dir: Path) -> str:
    """Where a script logs: RUN_DIR/logs with --run-dir, else OUTPUT_DIR/logs
    (eagle3_pipeline.cli.parser.log_dir_for)."""
    name = LOG_NAMES.get(script, script)
    return str((run_dir or output_dir) / "logs" / f"{name}.log")


def data_steps(lane: Lane, base: Base, data_folder: Path, inputs: dict[str, str]) -> list[Step]:
    steps = []
    for stage in reruns(lane):
        paths = ["--run-dir", str(data_folder)]
        if stage != PREPARE and PREPARE not in reruns(lane):  # stage 02 of a storage format: the base's data
            paths += ["--prepared-data", inputs["prepared_data"]]
        argv = paths + merged(base.flags.get(stage, []), lane.changes.get(stage, []))
        output = data_folder / RUN_LAYOUT[stage]
        steps.append(Step(stage, "data", stage, argv, str(output), log_file(stage, data_folder, output)))
    return steps


def train_step(lane: Lane, base: Base, folder: Path, lanes_dir: Path, data_folder: Path,
               inputs: dict[str, str]) -> Step:
    drafter = folder / DRAFTER
    if lane.trainer == SPECFORGE:  # it reads RUN_DIR/hidden_states and vocab, and takes the settings of default's run
        paths = ["--run-dir", str(data_folder), "--output-dir", str(drafter),
                 "--checkpoints-dir", str(lanes_dir / "default" / DRAFTER)]
        run_dir = data_folder
    else:
        states = [] if lane.online else ["--data-dir", inputs["hidden_states"]]
        paths = ["--run-dir", str(folder), "--prepared-data", inputs["prepared_data"], *states,
                 "--vocab-mapping-dir", inputs["vocab"], "--output-dir", str(drafter)]
        run_dir = folder
    argv = paths + merged(base.flags.get(lane.trainer, []), lane.changes.get(lane.trainer, []))
    return Step(lane.trainer, "train", lane.trainer, argv, str(drafter), log_file(lane.trainer, run_dir, drafter))


def bench_steps(lane: Lane, base: Base, folder: Path, inputs: dict[str, str], settings: BenchSettings) -> list[Step]:
    """One stage-05 run per benchmark, each in its own folder and log (they may run side by side)."""
    steps = []
    for name in lane.benchmarks:
        if name.startswith("heldout") and lane.trains_on_base_heldout and not settings.heldout_prompts:
            raise UsageError(f"lane {lane.name} may train on the base run's held-out prompts, which {name} decodes "
                             f"by default: give --heldout-prompts a file the base's stage 01 excludes "
                             f"(--exclude-prompts)")
        output = folder / f"bench_{name}"
        paths = ["--draft-model-path", str(folder / DRAFTER / "best"), "--output-dir", str(output)]
        if name == "eval":  # teacher-forced on the states the lane trained on
            paths += ["--data-dir", inputs["hidden_states"]]
        argv = merged(merged(base.flags.get(BENCH, []), benchmark_flags(name, settings, base.run)), paths)
        steps.append(Step(f"bench_{name}", "bench", BENCH, argv, str(output), log_file(BENCH, None, output), name))
    return steps


def plan_lane(lane: Lane, base: Base, lanes_dir: Path, settings: BenchSettings) -> LanePlan:
    folder = lanes_dir / lane.name
    data_folder = lanes_dir / lane.data if lane.data else base.run
    inputs = input_paths(lane, base.run, data_folder)
    steps = [*data_steps(lane, base, data_folder, inputs),
             train_step(lane, base, folder, lanes_dir, data_folder, inputs),
             *bench_steps(lane, base, folder, inputs, settings)]
    return LanePlan(lane, str(base.run), str(folder), str(data_folder), inputs, str(folder / DRAFTER), steps)


def in_order(plans: list[LanePlan]) -> list[LanePlan]:
    """The lanes as given, except that one needing another lane of the list (specforge: default) comes after it."""
    names = {plan.lane.name for plan in plans}
    return sorted(plans, key=lambda plan: any(name in names for name in plan.lane.after))


def lane_record(plan: LanePlan, status: str, states: dict[str, str]) -> dict:
    """lane.json: the lane, the base run, its folders and inputs, each step's flags and state, and the status.
    The paths a reader follows (data_folder, inputs, drafter, each step's output and log) are relative to the lane's
    folder, so a copied or unpacked tree still reads; base_run and folder say where it ran, the argv how."""
    record = asdict(plan)
    record["inputs"] = {key: os.path.relpath(path, plan.folder) for key, path in plan.inputs.items()}
    record["drafter"] = os.path.relpath(plan.drafter, plan.folder)
    record["data_folder"] = os.path.relpath(plan.data_folder, plan.folder)
    for step in record["steps"]:
        step["state"] = states.get(step["name"], "not run")
        step["output_dir"] = os.path.relpath(step["output_dir"], plan.folder)
        step["log"] = os.path.relpath(step["log"], plan.folder)
    return {"status": status, "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **record}
