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
import contextlib
import difflib
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common.formats.manifest import MANIFEST, STATUS_COMPLETE  # noqa: E402
from common.formats.files import read_json  # noqa: E402
from common.cli.flags import (FLAGS, RUN_LAYOUT, STAGE_FLAGS, StageArgumentParser, _all_option_strings,
    parse_stage_args)  # noqa: E402
from common.cli.errors import USAGE_ERROR, UsageError  # noqa: E402
from common.cli.lock import OutputLock  # noqa: E402

REPO = Path(__file__).resolve().parent
STAGES = list(STAGE_FLAGS)  # "01_prepare_data", ...
# Flags that say how to run, not what to make: they don't decide whether a finished stage is stale.
_NOT_STALE_KEYS = {"overwrite", "resume", "num_workers", "allow_low_disk", "run_dir", "device"}
TAIL_LINES = 30


def stage_named(text: str) -> str:
    for stage in STAGES:
        if text in (stage, stage[:2], stage.lstrip("0")[:1], stage[3:]) or stage.startswith(text.zfill(2)):
            return stage
    raise argparse.ArgumentTypeError(f"unknown stage {text!r}; stages are {', '.join(STAGES)}")


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


def stage_command(stage: str, argv: list[str], args: argparse.Namespace, nproc: int) -> list[str]:
    """The stage's script under this Python, or under torchrun when it runs data-parallel on nproc > 1."""
    script = str(REPO / f"{stage}.py")
    parallel = stage == "04_train" or (stage == "02_extract_hidden_states" and args.backend == "hf")
    if nproc > 1 and parallel:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                script, *argv]
    return [sys.executable, script, *argv]


def unknown_flag_message(name: str) -> str:
    """Suggestions from every stage's flags and the runner's own."""
    runner_flags = [s for action in runner_parser()._actions for s in action.option_strings]
    close = difflib.get_close_matches(name, sorted(_all_option_strings()) + runner_flags, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else "; see --help and each stage's --help"
    return f"unknown flag {name}{hint}"


def split_shared_flags(tokens: list[str]) -> dict[str, list[str]]:
    """Route each stage flag given to the runner to the stages whose schema has it."""
    spellings = _all_option_strings()
    per_stage: dict[str, list[str]] = {stage: [] for stage in STAGES}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, _, inline = token.partition("=")
        canonical = spellings.get(name)
        if canonical is None:
            runner_parser().error(unknown_flag_message(name) if token.startswith("-")
                                  else f"unexpected argument {token!r}")
        flag = FLAGS[canonical]
        takes_value = flag.action != "store_true"
        value = [] if not takes_value else ([inline] if inline else tokens[i + 1:i + 2])
        if takes_value and not value:
            runner_parser().error(f"{name} needs a value")
        i += 1 + (1 if takes_value and not inline else 0)
        for stage in STAGES:
            if canonical in STAGE_FLAGS[stage]:
                per_stage[stage] += [canonical, *value]
    return per_stage


def stage_argv(stage: str, run_dir: str, shared: dict[str, list[str]], extra: dict[str, list[str]]) -> list[str]:
    return ["--run-dir", run_dir, *shared[stage], *extra.get(stage, [])]


def check_all_flags(argvs: dict[str, list[str]]) -> dict[str, argparse.Namespace]:
    """Parse every stage's flags now, so a typo for stage 04 fails before stage 01 runs for hours."""
    resolved = {}
    for stage, argv in argvs.items():
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                resolved[stage] = parse_stage_args(stage, "", argv)
        except SystemExit:
            sys.stderr.write(f"run_pipeline: flags for {stage} are wrong:\n{err.getvalue()}")
            sys.exit(USAGE_ERROR)
    return resolved


def output_manifest(run_dir: Path, stage: str) -> dict | None:
    path = run_dir / RUN_LAYOUT[stage] / MANIFEST
    try:
        return read_json(path)
    except (OSError, json.JSONDecodeError):
        return None


def in_run_terms(value, run_dir) -> str:
    """A flag's value as JSON, with a path inside the run directory written relative to it: a run copied or
    moved elsewhere (rsync to the training machine) keeps its finished stages."""
    text = json.dumps(value, default=str)
    if isinstance(value, str) and run_dir:
        root = str(run_dir).rstrip("/")
        if value == root or value.startswith(root + "/"):
            text = json.dumps("RUN_DIR" + value[len(root):])
    return text


def is_current(manifest: dict | None, args: argparse.Namespace) -> bool:
    """Complete, and made with the flags we would pass now."""
    if not manifest or manifest.get("status") != STATUS_COMPLETE:
        return False
    recorded = manifest.get("flags", {})
    wanted = {k: v for k, v in vars(args).items() if k not in _NOT_STALE_KEYS}
    return all(in_run_terms(recorded.get(k), recorded.get("run_dir")) == in_run_terms(v, args.run_dir)
               for k, v in wanted.items())


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_one(stage: str, command: list[str], log) -> int:
    log(f"=== {stage}: {shlex.join(command)}")
    started = time.time()
    returncode = run_forwarding_signals(command)
    log(f"=== {stage}: exit code {returncode} after {time.time() - started:.0f} s")
    return returncode


def run_forwarding_signals(command: list[str]) -> int:
    """Run a stage and wait for it; SIGINT and SIGTERM sent to this runner reach the stage exactly once.

    The stage runs in a session of its own, so a Ctrl-C or a `timeout` aimed at the runner's process group
    does not reach it (nor its DataLoader workers) directly; the runner forwards the signal instead, and keeps
    waiting. Stage 04 then finishes its step and saves a checkpoint; a second signal stops it at once.
    """
    child = subprocess.Popen(command, cwd=str(REPO), start_new_session=True)

    def forward(signum, frame):
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def print_status(run_dir: Path) -> int:
    """Each stage's state; exit code 2 when the folder does not exist or holds no run."""
    if not run_dir.is_dir():
        sys.stderr.write(f"run_pipeline: no run directory at {run_dir} (nothing has run there yet; "
                         f"check the path)\n")
        return USAGE_ERROR
    if not any(output_manifest(run_dir, stage) for stage in STAGES) and not (run_dir / "logs").is_dir():
        sys.stderr.write(f"run_pipeline: {run_dir} holds no run (no stage manifest, no logs/ folder); "
                         f"check the path\n")
        return USAGE_ERROR
    print(f"run directory {run_dir}")
    for stage in STAGES:
        manifest = output_manifest(run_dir, stage)
        state = "not started" if manifest is None else manifest.get("status", "?")
        line = f"  {stage:<26} {state:<12}"
        if manifest:
            counts = manifest.get("counts", {})
            line += " " + ", ".join(f"{k} {v}" for k, v in list(counts.items())[:4])
            if "wall_time_s" in manifest:
                line += f"; {manifest['wall_time_s']:.0f} s"
            if stage == "02_extract_hidden_states":  # its storage format (older runs: aux in --dtype, final)
                storage = manifest.get("storage") or {}
                topk = f"top-{storage['target_topk']}" if storage.get("targets") == "topk" else "final"
                line += f"; aux {storage.get('aux_dtype', manifest.get('dtype'))}, targets {topk}"
        progress = stage_progress(run_dir, stage)
        if progress:
            line += f"; {progress}"
        print(line)
    print(f"logs: {run_dir / 'logs'}")
    return 0


def stage_progress(run_dir: Path, stage: str) -> str:
    """A live progress figure read from the artifacts, for stages that are running."""
    folder = run_dir / RUN_LAYOUT[stage]
    if stage == "02_extract_hidden_states":
        index = folder / "index.jsonl"
        data = output_manifest(run_dir, "01_prepare_data") or {}
        total = data.get("counts", {}).get("samples")
        written = sum(1 for _ in index.open()) if index.exists() else 0
        return f"{written}/{total} samples indexed" if total else ""
    if stage == "04_train":
        return training_progress(folder / "metrics.jsonl")
    return ""


def training_progress(metrics: Path) -> str:
    """The last training and validation lines of metrics.jsonl, in words (whole numbers, never cut mid-JSON)."""
    last = {}
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line being written right now
            continue
        last[record.get("kind")] = record
    parts = []
    for kind, name in (("train", "train"), ("eval", "validation")):
        record = last.get(kind)
        if record:
            text = f"{name} step {record.get('step')} (epoch {record.get('epoch')}): loss {record.get('loss', 0):.4f}"
            if isinstance(record.get("sim_accept_len"), (int, float)):
                text += f", simulated tau {record['sim_accept_len']:.2f}"
            parts.append(text)
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = runner_parser()
    args, rest = parser.parse_known_args(argv)
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
    shared = split_shared_flags(rest)
    extra = {stage_named(name): shlex.split(flags) for name, flags in args.stage_args}
    selected = [s for s in STAGES if s not in args.skip]
    if args.only:
        selected = [args.only]
    elif args.from_stage:
        selected = [s for s in selected if s >= args.from_stage]
    argvs = {stage: stage_argv(stage, str(run_dir), shared, extra) for stage in selected}
    resolved = check_all_flags(argvs)
    try:  # one pipeline per run directory (each stage also locks its own folder)
        atexit.register(OutputLock(run_dir, "another run_pipeline.py").acquire().release)
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
    for stage in selected:
        manifest = output_manifest(run_dir, stage)
        if stage not in forced and is_current(manifest, resolved[stage]):
            log(f"=== {stage}: complete with these flags, skipped")
            continue
        argv_now = list(argvs[stage])
        if stage == "04_train" and manifest and manifest.get("status") != STATUS_COMPLETE \
                and "--resume" not in argv_now and "--overwrite" not in argv_now:
            argv_now.append("--resume")  # an interrupted training run continues where it stopped
        code = run_one(stage, stage_command(stage, argv_now, resolved[stage], args.nproc_per_node), log)
        if code != 0:
            log(f"{stage} failed (exit {code}); last lines of {run_dir / 'logs' / (stage + '.log')}:\n"
                f"{tail(run_dir / 'logs' / (stage + '.log'))}\n"
                f"Fix the cause and rerun the same command: finished stages are skipped.")
            return code
    log("pipeline finished")
    return print_status(run_dir)


if __name__ == "__main__":
    sys.exit(main())
