"""Exit codes and the error for bad input: a stage stops with code 2 before any heavy work."""

USAGE_ERROR = 2  # a bad flag or bad input
FAILURE = 1  # a failure during the work itself


class UsageError(Exception):
    """A bad flag or bad input: the stage exits with code 2 before doing any heavy work."""


class StageFailure(Exception):
    """A failure during the work whose message says what went wrong and how to repair it: exit code 1, logged
    without a traceback."""
