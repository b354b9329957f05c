"""The parser each stage builds from the flag table (eagle3_pipeline/cli/flags.py): an error that comes first and names
the bad flag and the closest valid one, --help that says what each flag does in this stage and its default, and the
run directory's paths filled in."""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from eagle3_pipeline.errors import USAGE_ERROR, UsageError
from eagle3_pipeline.cli.flags import FLAGS, RUN_INPUTS, STAGE_FLAGS, Flag, all_option_strings
from eagle3_pipeline.formats.run_layout import PREPARED_DATA_FILE, RUN_LAYOUT


class StageArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose error is the first line it prints: the bad flag and the closest valid one, then exit
    2 (the usage block, 15 lines for a stage, is left to --help)."""

    def __init__(self, stage: str, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)
        self.stage = stage

    def error(self, message: str):  # noqa: D401 - argparse's hook
        sys.stderr.write(f"{self.prog}: error: {one_name_per_flag(message)}\n"
                         f"({self.prog} --help lists its flags)\n")
        sys.exit(USAGE_ERROR)

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        known, extras = self.parse_known_args(argv, namespace)
        if extras:
            self.error(self.explain_unknown(without_their_values(extras, argv)))
        return known

    def explain_unknown(self, extras: list[str]) -> str:
        here = {s for action in self._actions for s in action.option_strings}
        everywhere = all_option_strings()
        lines = []
        for token in extras:
            if not token.startswith("-"):
                lines.append(f"unexpected argument {token!r} (every input is given by a --flag)")
                continue
            bare = token.split("=", 1)[0]
            canonical = everywhere.get(bare)
            if canonical is not None:
                stages = [s for s, names in STAGE_FLAGS.items() if canonical in names]
                lines.append(f"{bare} is not a flag of {self.stage} (it belongs to {', '.join(stages)})")
                continue
            close = closest_flag(bare, here)
            lines.append(f"unknown flag {bare}" + (f"; did you mean {close}?" if close else "; see --help"))
        return "\n  ".join(lines)


def one_name_per_flag(message: str) -> str:
    """argparse names a flag by all its spellings ("argument --lr/--learning-rate: ..."): keep the first."""
    return re.sub(r"^argument (-[^/:\s]+)(/-[^/:\s]+)+:", r"argument \1:", message)


def _looks_like_a_value(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return not token.startswith("-")


def without_their_values(extras: list[str], argv: Sequence[str]) -> list[str]:
    """The unknown tokens, less the value that follows an unknown flag in argv: in `--epoch 2` the 2 is the
    misspelled flag's value, not a second mistake."""
    left = list(extras)
    for token, following in zip(argv, argv[1:]):
        if token.startswith("-") and "=" not in token and token in left and following in left \
                and following != token and _looks_like_a_value(following):
            left.remove(following)
    return left


def closest_flag(name: str, spellings: Iterable[str]) -> str | None:
    """The spelling in `spellings` closest to a misspelled `name` (None when none is close)."""
    close = difflib.get_close_matches(name, sorted(spellings), n=1, cutoff=0.6)
    return close[0] if close else None


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help as written: the stage's docstring keeps its lines, and each flag's default from the table is shown
    after its help (a default resolved at run time is said by the help text itself)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or action.default == [] \
                or action.default == argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


def build_parser(stage: str, description: str, extra: Sequence[Flag] = ()) -> StageArgumentParser:
    """The parser for one stage: its flags from the shared table (plus stage-only `extra` flags)."""
    parser = StageArgumentParser(
        stage, prog=f"{stage}.py", description=description,
        formatter_class=_HelpFormatter,
        epilog="Exit codes: 0 success, 2 bad flag or input (nothing heavy was started), 1 failure during work.",
    )
    add_flags(parser, [FLAGS[name] for name in STAGE_FLAGS[stage]] + list(extra), stage)
    return parser


def add_flags(parser: argparse.ArgumentParser, flags: Sequence[Flag], stage: str | None = None) -> None:
    """Add flags to a parser as `stage` takes them, with that stage's help (a benchmark script reuses a stage's
    flags this way)."""
    for flag in flags:
        kwargs: dict[str, Any] = {"dest": flag.dest, "help": flag.help_for(stage), "default": flag.default}
        if flag.action:
            kwargs["action"] = flag.action
        if flag.action != "store_true":
            kwargs["type"] = flag.type
            if flag.metavar:
                kwargs["metavar"] = flag.metavar
        if flag.choices:
            kwargs["choices"] = flag.choices
        parser.add_argument(flag.name, *flag.aliases, **kwargs)


def resolve_run_paths(stage: str, args: argparse.Namespace) -> argparse.Namespace:
    """Fill unset path flags from --run-dir, so a whole pipeline needs no other path flag."""
    run_dir = Path(args.run_dir) if getattr(args, "run_dir", None) else None
    if getattr(args, "output_dir", None) is None and run_dir is not None:
        args.output_dir = str(run_dir / RUN_LAYOUT[stage])
    for dest, (producer, inner) in RUN_INPUTS.items():
        if hasattr(args, dest) and getattr(args, dest) is None and run_dir is not None:
            path = run_dir / RUN_LAYOUT[producer]
            setattr(args, dest, str(path / inner) if inner else str(path))
    if getattr(args, "prepared_data", None) and Path(args.prepared_data).is_dir():
        args.prepared_data = str(Path(args.prepared_data) / PREPARED_DATA_FILE)
    if getattr(args, "output_dir", None) is None:
        raise UsageError(f"{stage}: give --run-dir DIR (or --output-dir DIR) to say where the output goes")
    return args


def log_dir_for(args: argparse.Namespace) -> Path:
    if getattr(args, "run_dir", None):
        return Path(args.run_dir) / "logs"
    return Path(args.output_dir) / "logs"


def parse_stage_args(stage: str, description: str, argv: Sequence[str] | None = None,
                     extra: Sequence[Flag] = ()) -> argparse.Namespace:
    parser = build_parser(stage, description, extra)
    args = parser.parse_args(argv)
    if getattr(args, "dtype", None) == "float64" and (stage != "05_benchmark" or args.mode != "offline"):
        parser.error("--dtype float64 is only for 05_benchmark --mode offline (a lossless check); give bfloat16, "
                     "float16 or float32")
    try:
        return resolve_run_paths(stage, args)
    except UsageError as err:
        parser.error(str(err))
