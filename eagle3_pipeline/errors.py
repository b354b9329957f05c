"""Exit codes, the error for bad input (a stage stops with code 2 before any heavy work), the check for required
flags, and the one line that a missing package gets. The ground floor of eagle3_pipeline/: standard library only, so
stage scripts import this before anything else and every layer may raise its errors."""
import sys
from pathlib import Path

USAGE_ERROR = 2  # a bad flag or bad input
FAILURE = 1  # a failure during the work itself


class UsageError(Exception):
    """A bad flag or bad input: the stage exits with code 2 before doing any heavy work."""


class StageFailure(Exception):
    """A failure during the work whose message says what went wrong and how to repair it: exit code 1, logged
    without a traceback."""


def require(args, *dests: str) -> None:
    """Stop with a usage error naming each required flag (an argparse dest) that is still unset in `args`."""
    missing = [d for d in dests if getattr(args, d, None) in (None, [], "")]
    if missing:
        names = ", ".join("--" + d.replace("_", "-") for d in missing)
        raise UsageError(f"missing required flag(s): {names} (or give --run-dir for the path flags)")


SETUP = "run `bash scripts/setup_env.sh`, then the stages with `.venv/bin/python` (or after `source .venv/bin/activate`)"


def missing_package_message(error: ModuleNotFoundError) -> str | None:
    """The one line for a third-party package this Python lacks (None for anything else, such as our own modules)."""
    name = (error.name or "").split(".")[0]
    if not name or name == "eagle3_pipeline":
        return None
    return f"{Path(sys.argv[0]).name}: the Python package {name!r} is missing from {sys.executable}: {SETUP}"


def report_missing_packages() -> None:
    """From now on, a package missing at import ends the program with missing_package_message's line instead of a
    traceback (stage scripts and run_pipeline.py call this before their other imports)."""
    previous = sys.excepthook

    def hook(kind, error, trace):
        message = missing_package_message(error) if issubclass(kind, ModuleNotFoundError) else None
        if message is None:
            previous(kind, error, trace)
        else:
            sys.stderr.write(message + "\n")

    sys.excepthook = hook
