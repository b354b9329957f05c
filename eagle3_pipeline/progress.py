"""Progress of long work: a tqdm bar on a terminal and a plain line every `interval` seconds in the log (on the
console too when it is a file), with rate and ETA."""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.log import FILE_ONLY, get_logger

# Seconds between progress lines in a log; EAGLE3_PROGRESS_INTERVAL sets it (a test sees lines quickly).
PROGRESS_INTERVAL_ENV = "EAGLE3_PROGRESS_INTERVAL"
DEFAULT_PROGRESS_INTERVAL = 30.0


def progress_interval() -> float:
    value = os.environ.get(PROGRESS_INTERVAL_ENV, "")
    try:
        return float(value) if value else DEFAULT_PROGRESS_INTERVAL
    except ValueError:
        raise UsageError(f"{PROGRESS_INTERVAL_ENV}={value!r}: expected seconds between progress lines, e.g. 30")


class Progress:
    """A log line with rate and ETA every `interval` seconds, also while no item finishes (a heartbeat thread), so
    the log is never silent for longer than that. On a terminal a tqdm bar shows the progress and these lines go to
    the log file only: a bar's carriage returns never reach a file.

    Progresses nest (a regeneration inside a split's round): only the innermost open one writes lines, so the log
    gets one line per interval. The rate is measured from the first update on once there are two (the time before
    it, loading a model or compiling, is not the work's pace); `set_total` lowers a total that turned out smaller
    (work found unneeded), and `detail` adds text computed at each line."""

    _open: list["Progress"] = []  # innermost last
    _open_lock = threading.Lock()

    def __init__(self, total: int | None, desc: str, unit: str = "it", interval: float | None = None,
                 initial: int = 0, detail: Callable[[], str] | None = None):
        from tqdm import tqdm  # imported here: quiet_other_progress_bars() must run before tqdm is first imported

        interval = progress_interval() if interval is None else interval
        self.interactive = sys.stderr.isatty()  # where the bar is drawn
        self.bar = tqdm(total=total, desc=desc, unit=unit, initial=initial, dynamic_ncols=True,
                        disable=not self.interactive, unit_scale=True)
        self.format_interval = tqdm.format_interval
        self.total, self.desc, self.unit, self.interval = total, desc, unit, interval
        self.detail = detail
        self.count = initial
        self.initial = initial
        self.start = time.time()
        self.last_report = self.start
        self._last_count_at = self.start
        self._first_update: tuple[float, int] | None = None  # (time, count) once the first update is counted
        self.reported: tuple[int, int | None] | None = None  # (count, total) the last line said
        self.postfix = ""
        self._lock = threading.Lock()
        self._closed = threading.Event()
        with Progress._open_lock:
            Progress._open.append(self)
        if interval > 0:  # a long batch (a regeneration round) must not leave the log silent
            threading.Thread(target=self._heartbeat, name=f"progress {desc}", daemon=True).start()

    def _speaks(self) -> bool:
        """Whether this progress writes lines now: the innermost open one does, for every one around it."""
        with Progress._open_lock:
            return not Progress._open or Progress._open[-1] is self

    def _heartbeat(self) -> None:
        """Report every `interval` seconds without an update too: the line then says how long it has been."""
        while not self._closed.wait(self.interval / 4):
            with self._lock:
                if time.time() - self.last_report >= self.interval and self._speaks():
                    self.last_report = time.time()
                    self._report(still=True)

    def update(self, n: int = 1, postfix: str = "") -> None:
        with self._lock:
            self.count += n
            now = time.time()
            self._last_count_at = now
            if self._first_update is None and n:
                self._first_update = (now, self.count)
        self.bar.update(n)
        if postfix:
            self.postfix = postfix
            self.bar.set_postfix_str(postfix, refresh=False)
        with self._lock:
            now = time.time()
            if now - self.last_report >= self.interval and self._speaks():
                self.last_report = now
                self._report()

    def set_total(self, total: int) -> None:
        """A new total, e.g. lower once part of the work turned out unneeded (a batch whose replies all stopped)."""
        with self._lock:
            self.total = total
            self.bar.total = total

    def rate(self) -> float:
        """Items a second: from the first update on once a later one came, else from the start."""
        now = time.time()
        if self._first_update is not None and self.count > self._first_update[1] and now > self._first_update[0]:
            return (self.count - self._first_update[1]) / (now - self._first_update[0])
        elapsed = now - self.start
        return (self.count - self.initial) / elapsed if elapsed > 0 else 0.0

    def _report(self, still: bool = False) -> None:
        quiet = time.time() - self._last_count_at if still else 0.0
        self.reported = (self.count, self.total)
        elapsed = time.time() - self.start
        rate = self.rate()
        line = f"{self.desc}: {self.count}"
        if self.total:
            line += f"/{self.total} ({100.0 * self.count / self.total:.1f}%)"
            if rate > 0:
                line += f", ETA {self.format_interval(max(0, self.total - self.count) / rate)}"
        line += f", {rate:.1f} {self.unit}/s, elapsed {self.format_interval(elapsed)}"
        if self.detail is not None:
            line += f", {self.detail()}"
        if self.postfix:
            line += f", {self.postfix}"
        if quiet >= self.interval:
            line += f"; working, no item finished for {self.format_interval(quiet)}"
        get_logger().info(line, extra=FILE_ONLY if self.interactive else None)

    def close(self) -> None:
        self._closed.set()
        self.bar.close()
        with self._lock:
            if self.reported != (self.count, self.total):  # the last update may have just said it
                self._report()
        with Progress._open_lock:
            if self in Progress._open:
                Progress._open.remove(self)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
