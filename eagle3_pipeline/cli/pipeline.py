"""Running the stages in order over one run directory: which flags reach which stage, which finished stages are
still current (and skipped), and each stage as a child process that Ctrl-C and `timeout` stop cleanly."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from eagle3_pipeline.errors import USAGE_ERROR
from eagle3_pipeline.cli.flags import FLAGS, STAGE_FLAGS, all_option_strings
from eagle3_pipeline.formats.run_layout import RUN_LAYOUT
from eagle3_pipeline.cli.parser import closest_flag
from eagle3_pipeline.formats.files import read_json
from eagle3_pipeline.formats.manifest import MANIFEST, STATUS_COMPLETE

REPO = Path(__file__).resolve().parents[2]
STAGES = list(STAGE_FLAGS)  # "01_prepare_data", ...
# Flags that say how to run, not what to make: they don't decide whether a finished stage is stale. SGLang's
# engine settings round the states differently at most: not worth a second extraction.
_NOT_STALE_KEYS = {"overwrite", "resume", "num_workers", "allow_low_disk", "run_dir", "device", "profile_steps",
                   "decode_workers", "attention_backend", "sampling_backend", "sglang_arg", "allow_untested_sglang"}
TAIL_LINES = 30


def stage_named(text: str) -> str:
    for stage in STAGES:
        if text in (stage, stage[:2], stage.lstrip("0")[:1], stage[3:]) or stage.startswith(text.zfill(2)):
            return stage
    raise argparse.ArgumentTypeError(f"unknown stage {text!r}; stages are {', '.join(STAGES)}")


def stage_command(stage: str, argv: list[str], args: argparse.Namespace, nproc: int) -> list[str]:
    """The stage's script under this Python, or under torchrun when it runs data-parallel on nproc > 1."""
    script = str(REPO / f"{stage}.py")
    parallel = stage == "04_train" or (stage == "02_extract_hidden_states" and args.backend == "hf")
    if nproc > 1 and parallel:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                script, *argv]
    return [sys.executable, script, *argv]


def unknown_flag_message(name: str, runner_flags: Sequence[str]) -> str:
    """The closest of every stage's flags and the runner's own."""
    close = closest_flag(name, [*all_option_strings(), *runner_flags])
    return f"unknown flag {name}" + (f"; did you mean {close}?" if close else "; see --help and each stage's --help")


def split_shared_flags(tokens: list[str], error: Callable[[str], None],
                       runner_flags: Sequence[str]) -> dict[str, list[str]]:
    """Route each stage flag given to the runner to the stages whose schema has it (`error` exits with usage)."""
    spellings = all_option_strings()
    per_stage: dict[str, list[str]] = {stage: [] for stage in STAGES}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, _, inline = token.partition("=")
        canonical = spellings.get(name)
        if canonical is None:
            error(unknown_flag_message(name, runner_flags) if token.startswith("-")
                  else f"unexpected argument {token!r}")
        flag = FLAGS[canonical]
        takes_value = flag.action != "store_true"
        value = [] if not takes_value else ([inline] if inline else tokens[i + 1:i + 2])
        if takes_value and not value:
            error(f"{name} needs a value")
        i += 1 + (1 if takes_value and not inline else 0)
        for stage in STAGES:
            if canonical in STAGE_FLAGS[stage]:
                per_stage[stage] += [canonical, *value]
    return per_stage


def stage_argv(stage: str, run_dir: str, shared: dict[str, list[str]], extra: dict[str, list[str]]) -> list[str]:
    return ["--run-dir", run_dir, *shared[stage], *extra.get(stage, [])]


def stage_parser(stage: str) -> Callable[[list[str]], argparse.Namespace]:
    """The stage script's own `parse`: its flags with every default it resolves before recording them (the machine's
    device, values taken from the run directory), so that a finished stage is compared with what it would record."""
    import importlib.util

    name = f"_stage_{stage}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / f"{stage}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name].parse


def check_all_flags(argvs: dict[str, list[str]]) -> dict[str, argparse.Namespace]:
    """Parse every stage's flags now (through the stage's own parse), so a typo for stage 04 fails before stage 01
    runs for hours."""
    resolved = {}
    for stage, argv in argvs.items():
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                resolved[stage] = stage_parser(stage)(argv)
        except SystemExit:  # the stage's own error line, which names the stage's script, comes first
            sys.stderr.write(f"run_pipeline.py: {err.getvalue()}")
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


def log_size(path: Path) -> int:
    """Bytes in a stage's log now: where the lines of the run about to start begin."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def tail(path: Path, lines: int = TAIL_LINES, since: int = 0) -> str:
    """The last lines the log got from byte `since` on (an earlier run's lines are never shown as this run's)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(since)
            text = handle.read().decode(errors="replace")
    except OSError:
        text = ""
    if not text.strip():
        return "(the stage wrote nothing to its log this time: its own output above says why)"
    return "\n".join(text.splitlines()[-lines:])


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
