"""Environment for a stage subprocess with a test-only fault (tests/fault_site/sitecustomize.py injects it)."""
from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CRASH_ENV = "EAGLE3_TEST_CRASH_AFTER_SAMPLES"
SIGNAL_ENV = "EAGLE3_TEST_SIGNAL_AFTER_STEP"


def fault_env(*, crash_after_samples: int | None = None, signal_after_step: tuple[int, int] | None = None) -> dict:
    """PYTHONPATH with the fault site first (then the repository, so it can import the library), plus the fault's
    variable: stage 02 SIGKILLed after N samples written, or rank R SIGTERMed after stage 04's step S."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS / "fault_site"), str(TESTS.parent),
                                                       os.environ.get("PYTHONPATH")]))}
    if crash_after_samples is not None:
        env[CRASH_ENV] = str(crash_after_samples)
    if signal_after_step is not None:
        env[SIGNAL_ENV] = "{}:{}".format(*signal_after_step)
    return env
