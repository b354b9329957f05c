"""Running lane plans: each step's flags checked through its script's own parse before anything runs, finished steps
skipped by run_pipeline.py's rule (complete, and made with these flags), the steps as run_pipeline.py runs a stage
(a child process in a session of its own), lane.json kept up to date."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from eagle3_pipeline.errors import USAGE_ERROR, UsageError
from eagle3_pipeline.cli.lock import OutputLock
from eagle3_pipeline.cli.pipeline import REPO, is_current, log_size, run_one, stage_command, stage_parser, tail
from eagle3_pipeline.formats.files import read_json, write_json_atomic
from eagle3_pipeline.formats.manifest import MANIFEST, STATUS_COMPLETE
from eagle3_pipeline.lab.lanes import SPECFORGE, TRAIN
from eagle3_pipeline.lab.plan import DRAFTER, LANE_FILE, LanePlan, Step, lane_record

Log = Callable[[str], None]
PARTS = ("data", "train", "bench")


def parse_step(plan: LanePlan, step: Step) -> argparse.Namespace:
    """The step's flags through its script's own parse (the defaults it resolves, as it records them); a wrong
    flag stops before the first lane starts."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return stage_parser(step.script)(list(step.argv))
    except SystemExit:
        raise UsageError(f"lane {plan.lane.name}: the flags of {step.name} are wrong:\n{err.getvalue()}")


def manifest_of(step: Step) -> dict | None:
    try:
        return read_json(Path(step.output_dir) / MANIFEST)
    except (OSError, json.JSONDecodeError):
        return None


def first_states(plan: LanePlan, parsed: dict[str, argparse.Namespace]) -> dict[str, str]:
    """Each step's state before this run: complete (with these flags) or to do."""
    return {step.name: "complete" if is_current(manifest_of(step), parsed[step.name]) else "to do"
            for step in plan.steps}


def missing_input(plan: LanePlan, step: Step) -> str | None:
    """What a step reads that is not finished, in words (None when all is there): a lane whose data failed stops
    here with the folder to look in, not deep in the stage."""
    needs: list[tuple[str, Path]] = []
    if step.part == "train" and not plan.lane.online:
        needs.append(("hidden states (stage 02)", Path(plan.inputs["hidden_states"])))
    if step.part == "train":
        needs.append(("vocabulary map (stage 03)", Path(plan.inputs["vocab"])))
    if step.script == SPECFORGE:  # it trains with the default lane's settings and split
        needs.append(("default lane's drafter (train the default lane first)",
                      Path(plan.folder).parent / "default" / DRAFTER))
    for what, folder in needs:
        try:
            finished = read_json(folder / MANIFEST).get("status") == STATUS_COMPLETE
        except (OSError, json.JSONDecodeError):
            finished = False
        if not finished:
            return (f"lane {plan.lane.name}: {step.name} needs the {what} in {folder}, which is not finished (see "
                    f"its logs/)")
    if step.part == "bench" and not (Path(plan.drafter) / "best").is_dir():
        return f"lane {plan.lane.name}: {step.name} needs the lane's drafter {plan.drafter}/best: train it first"
    return None


def command_of(step: Step, args: argparse.Namespace, manifest: dict | None) -> list[str]:
    argv = list(step.argv)
    if step.script == TRAIN and manifest and manifest.get("status") != STATUS_COMPLETE \
            and "--resume" not in argv and "--overwrite" not in argv:
        argv.append("--resume")  # an interrupted training continues where it stopped, as under run_pipeline.py
    return stage_command(step.script, argv, args, 1)


def run_side_by_side(runs: list[tuple[str, list[str]]], jobs: int, log: Log) -> dict[str, int]:
    """Commands, at most `jobs` at a time, each in a session of its own; SIGINT and SIGTERM sent to this process
    reach every running one once (run_pipeline.py's rule, for several children). One at a time is run_one itself."""
    if jobs <= 1:
        return {name: run_one(name, command, log) for name, command in runs}
    running: dict[str, subprocess.Popen] = {}
    guard = threading.Lock()

    def forward(signum, frame):
        with guard:  # only the workers take it, and briefly: the main thread, where this runs, never holds it
            children = list(running.values())
        for child in children:
            child.send_signal(signum)

    def one(name: str, command: list[str]) -> int:
        log(f"=== {name}: {shlex.join(command)}")
        started = time.time()
        with guard:
            running[name] = subprocess.Popen(command, cwd=str(REPO), start_new_session=True)
        code = running[name].wait()
        with guard:
            running.pop(name)
        log(f"=== {name}: exit code {code} after {time.time() - started:.0f} s")
        return code

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with ThreadPoolExecutor(jobs) as pool:
            codes = list(pool.map(lambda run: one(*run), runs))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return {name: code for (name, _), code in zip(runs, codes)}


def write_record(plan: LanePlan, states: dict[str, str], status: str | None = None) -> None:
    """lane.json with each step's state; its status complete, failed or incomplete (steps left out), or as given."""
    if status is None:
        failed = any(state.startswith("failed") for state in states.values())
        done = all(state == "complete" for state in states.values())
        status = "complete" if done else "failed" if failed else "incomplete"
    write_json_atomic(Path(plan.folder) / LANE_FILE, lane_record(plan, status, states))


def run_lane(plan: LanePlan, parsed: dict[str, argparse.Namespace], parts: tuple[str, ...], bench_jobs: int,
             log: Log) -> int:
    """The lane's steps of `parts` not yet complete with these flags: data and training in order (stopping at a
    failure), then the benchmarks, `bench_jobs` at a time. Returns 0 or the exit code of a step that failed."""
    name = plan.lane.name
    states = first_states(plan, parsed)
    todo = [step for step in plan.steps if step.part in parts and states[step.name] != "complete"]
    if not todo:
        which = "" if set(parts) == set(PARTS) else f" (its {', '.join(parts)} steps)"
        log(f"lane {name}{which}: complete with these flags, skipped")
        write_record(plan, states)
        return 0
    with OutputLock(Path(plan.folder), f"another run_lanes.py on lane {name}"):
        log(f"lane {name}: running {', '.join(step.name for step in todo)}")
        write_record(plan, states, "running")
        for step in plan.steps:
            if step.part in parts and step not in todo:
                log(f"=== {name}/{step.name}: complete with these flags, skipped")
        code = 0
        for step in [step for step in todo if step.part != "bench"]:
            code = run_batch(plan, parsed, [step], states, 1, log)
            if code:
                break
        if code == 0:
            code = run_batch(plan, parsed, [step for step in todo if step.part == "bench"], states, bench_jobs, log)
        write_record(plan, states)
    return code


def run_batch(plan: LanePlan, parsed: dict[str, argparse.Namespace], steps: list[Step], states: dict[str, str],
              jobs: int, log: Log) -> int:
    """Steps side by side, `jobs` at a time, once what they read is there; each one's state goes to `states`."""
    for step in steps:
        missing = missing_input(plan, step)
        if missing:
            log(missing)
            states[step.name] = "failed (input missing)"
            return USAGE_ERROR
    before = {step.name: log_size(Path(step.log)) for step in steps}
    runs = [(f"{plan.lane.name}/{step.name}", command_of(step, parsed[step.name], manifest_of(step))) for step in steps]
    codes = run_side_by_side(runs, jobs, log)
    worst = 0
    for step, (label, _) in zip(steps, runs):
        states[step.name] = "complete" if codes[label] == 0 else f"failed (exit {codes[label]})"
        if codes[label] != 0:
            log(f"{label} failed (exit {codes[label]}); last lines of {step.log}:\n"
                f"{tail(Path(step.log), since=before[step.name])}")
            worst = worst or codes[label]
    return worst
