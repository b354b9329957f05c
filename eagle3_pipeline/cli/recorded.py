"""Flags a rerun takes from its run directory, so that rerunning one stage needs only what changes.

`05_benchmark.py --run-dir R --num-steps 7` (or `run_pipeline.py --run-dir R --only 05 --stage-args 05
"--num-steps 7"`) benchmarks the same verifier, prompts and settings as the last run, at k=7:

- a flag not given on the command line takes the value the stage's last run used (its own
  `NN_name.config.json` in its output folder), when that run was of the same kind (stage 05: the same --mode);
- the verifier (--model-path, --trust-remote-code, --chat-template), when the stage's own record lacks it,
  comes from the manifests of the stages before it, the nearest first (04, then 03, 02, 01);
- a flag given on the command line always wins.

Never taken: --run-dir and --output-dir (where the record lies), the input paths --run-dir derives (a moved
run keeps working; they are taken only without --run-dir), on/off switches other than --trust-remote-code (a
recorded --overwrite or --tau-only could not be switched off again), and the flags a stage names as its own
choice each time (stage 05: the decoding settings that name its report files). The stage logs each value it
took and from which file.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from eagle3_pipeline.cli.flags import FLAGS, STAGE_FLAGS
from eagle3_pipeline.formats.run_layout import RUN_LAYOUT
from eagle3_pipeline.cli.parser import build_parser
from eagle3_pipeline.cli.stage import CONFIG_FILE_SUFFIX
from eagle3_pipeline.formats.files import read_json
from eagle3_pipeline.formats.manifest import MANIFEST

VERIFIER_DESTS = ("model_path", "trust_remote_code", "chat_template")
_NEVER = {"run_dir", "output_dir"}
_DERIVED_PATHS = {"prepared_data", "data_dir", "vocab_mapping_dir", "draft_model_path"}
_SWITCHES_TAKEN = {"trust_remote_code"}


def given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The dests of the flags present in argv (any spelling, `--flag value` or `--flag=value`)."""
    given = set()
    for token in argv:
        action = parser._option_string_actions.get(token.split("=", 1)[0]) if token.startswith("-") else None
        if action is not None:
            given.add(action.dest)
    return given


def _takeable(stage: str, args: argparse.Namespace, never: Sequence[str]) -> list[str]:
    dests = []
    for name in STAGE_FLAGS[stage]:
        flag = FLAGS[name]
        if flag.dest in _NEVER or flag.dest in never or (flag.dest in _DERIVED_PATHS and getattr(args, flag.dest)) \
                or (flag.action == "store_true" and flag.dest not in _SWITCHES_TAKEN):
            continue
        dests.append(flag.dest)
    return dests


def _read(path: Path, key: str | None) -> dict:
    try:
        data = read_json(path)
    except (OSError, json.JSONDecodeError):
        return {}
    data = data.get(key) if key else data
    return data if isinstance(data, dict) else {}


def recorded_sources(stage: str, args: argparse.Namespace) -> list[tuple[Path, dict, bool]]:
    """(file, its recorded flags, whether it is the stage's own record): the stage's last configuration, then
    the manifests of the stages before it in the run directory, nearest first; missing or unreadable files are
    left out."""
    sources = [(Path(args.output_dir) / f"{stage}{CONFIG_FILE_SUFFIX}", None, True)]
    if getattr(args, "run_dir", None):
        stages = list(RUN_LAYOUT)
        for upstream in reversed(stages[:stages.index(stage)]):
            sources.append((Path(args.run_dir) / RUN_LAYOUT[upstream] / MANIFEST, "flags", False))
    return [(path, flags, own) for path, key, own in sources if (flags := _read(path, key))]


def take_recorded_flags(stage: str, args: argparse.Namespace, argv: Sequence[str],
                        never: Sequence[str] = (), same: Sequence[str] = ()) -> list[str]:
    """Fill the flags argv leaves out (except `never`, by dest) from what the run directory recorded; returns
    one line per value taken. The stage's own record counts only when it agrees with this run on `same` (stage
    05: the --mode; an eval run takes nothing but the verifier from an offline run's record)."""
    given = given_on_command_line(build_parser(stage, ""), argv)
    sources = [(path, flags, own) for path, flags, own in recorded_sources(stage, args)
               if not own or all(flags.get(dest) == getattr(args, dest) for dest in same)]
    notes = []
    for dest in _takeable(stage, args, never):
        if dest in given:
            continue
        for path, flags, own in sources:
            value = flags.get(dest)
            if (not own and dest not in VERIFIER_DESTS) or value is None or value == []:
                continue
            if value != getattr(args, dest):
                setattr(args, dest, value)
                notes.append(f"--{dest.replace('_', '-')} {json.dumps(value)} taken from {path}")
            break
    return notes
