"""Stopping a training run cleanly on SIGINT/SIGTERM after the step in progress."""
from __future__ import annotations

import signal
import threading
from typing import Any

from eagle3_pipeline.log import get_logger


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
