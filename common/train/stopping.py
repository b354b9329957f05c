"""Stopping a training run cleanly on SIGINT/SIGTERM after the step in progress, and the test hook that
sends such a signal."""
from __future__ import annotations

import os
import signal
import threading
from typing import TYPE_CHECKING, Any, Callable

from common.cli.stage import get_logger

if TYPE_CHECKING:
    from common.train.trainer import Trainer


class StopRequests:
    """SIGINT or SIGTERM during training (Ctrl-C, `kill`, a scheduler's preemption, `timeout -s INT`): the step
    in progress finishes, a checkpoint of it is saved and the run stops, to continue from exactly there with
    --resume. A second signal stops at once, from the last checkpoint. (Signal handlers can only be set from
    the main thread; elsewhere the default behaviour stays.)"""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        get_logger().warning("%s received: stopping after this step, with a checkpoint (again to stop at once)",
                             signal.Signals(signum).name)


SIGNAL_ENV = "EAGLE3_TEST_SIGNAL_AFTER_STEP"


def signal_hooks_for_tests(rank: int) -> list[Callable[["Trainer"], None]]:
    """EAGLE3_TEST_SIGNAL_AFTER_STEP=STEP:RANK (tests only): that rank sends itself SIGTERM after that optimizer
    step, as a scheduler signalling one process of a distributed job would."""
    wanted = os.environ.get(SIGNAL_ENV)
    if not wanted:
        return []
    step, signalled_rank = (int(part) for part in wanted.split(":"))
    if rank != signalled_rank:
        return []

    def hook(trainer: "Trainer") -> None:
        if trainer.state.step == step:
            signal.raise_signal(signal.SIGTERM)
    return [hook]
