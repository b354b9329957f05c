"""What every stage does around its own work: logging, the resolved configuration, progress, exit codes.

Stages run over SSH under nohup, so output goes both to stdout and to RUN_DIR/logs/NN_name.log (the resolved
configuration and what only a later reader needs go to the log alone); progress is a tqdm bar on a terminal and a
plain line every `interval` seconds in the log (on the console too when it is a file).
Exit codes: 0 success, 2 bad flag or input (raised as UsageError before any heavy work), 1 failure.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

from common.formats.files import atomic_path, write_json_atomic
from common.cli.errors import FAILURE, USAGE_ERROR, StageFailure, UsageError, missing_package_message
from common.cli.parser import log_dir_for
from common.cli.lock import OutputLock, OverwriteLock, ReaderLock, check_run_directory_free, folder_read

LOGGER_NAME = "eagle3"
CONFIG_FILE_SUFFIX = ".config.json"
# `extra=FILE_ONLY` on a log call: the line goes to the stage's log file, not to the console.
FILE_ONLY = {"file_only": True}


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def log_file_for(stage: str, log_dir: Path) -> Path:
    return log_dir / f"{stage}.log"


def _for_the_console(record: logging.LogRecord) -> bool:
    return not getattr(record, "file_only", False)


def setup_logging(stage: str, log_dir: Path) -> logging.Logger:
    from common.cli.distributed import rank_info

    logger = get_logger()
    # Under torchrun every rank runs the stage: rank 0 reports, the others only warn and fail (tagged).
    rank = rank_info()
    logger.setLevel(logging.INFO if rank.is_main else logging.WARNING)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    tag = f"[rank {rank.rank}] " if rank.distributed else ""
    fmt = logging.Formatter(f"%(asctime)s %(levelname)s {tag}%(message)s", "%Y-%m-%d %H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    console.addFilter(_for_the_console)
    logger.addHandler(console)
    log_dir.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(log_file_for(stage, log_dir))
    to_file.setFormatter(fmt)
    logger.addHandler(to_file)
    return logger


def quiet_other_progress_bars() -> None:
    """Other libraries' progress bars (transformers' "Loading weights", ...) redraw with carriage returns, which
    a file or a pipe (nohup, the runner's output) keeps as one garbled line: there they are turned off.
    huggingface_hub (for transformers and datasets) and tqdm read these when first imported, so this runs before
    the work imports them (a stage that imports torch at the top has tqdm already: the hub's switch still holds)."""
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def resolved_config(args: argparse.Namespace) -> dict:
    return {key: value for key, value in sorted(vars(args).items())}


# A stage's declaration of what it reads of other stages' outputs: flag dests of RUN_INPUTS, given its flags.
Reads = Callable[[argparse.Namespace], Sequence[str]]


def take_locks(stage: str, args: argparse.Namespace, output_dir: Path, reads: Reads | None) -> list:
    """The locks the stage holds while it runs (common/cli/lock.py), taken by the main process (under torchrun
    rank 0 holds them for every rank): none in a run directory the runner holds but its own stages; its output
    folder's, and with --overwrite no reader there; a reader's on each input folder."""
    from common.cli.distributed import rank_info

    if not rank_info().is_main:
        return []
    for run_dir in {Path(args.run_dir) if getattr(args, "run_dir", None) else None, output_dir.parent} - {None}:
        check_run_directory_free(run_dir, stage)
    locks = [OutputLock(output_dir, f"another {stage} run").acquire()]
    try:
        if getattr(args, "overwrite", False):
            locks.append(OverwriteLock(output_dir, stage).acquire())
        for dest in (reads(args) if reads else ()):
            folder = folder_read(dest, getattr(args, dest, None))
            if folder is not None:
                locks.append(ReaderLock(folder, stage).acquire())
    except BaseException:
        release_all(locks)
        raise
    return locks


def release_all(locks: list) -> None:
    for lock in reversed(locks):
        lock.release()


def read_earlier(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def restore_earlier(path: Path, content: bytes | None) -> None:
    """Put back the configuration of the run that made the output (a first, refused run keeps its own)."""
    if content is None:
        return
    try:
        with atomic_path(path) as tmp:
            tmp.write_bytes(content)
    except OSError:
        pass  # the refusal itself is what the user needs to see


def run_stage(stage: str, parse: Callable[[list[str] | None], argparse.Namespace],
              work: Callable[[argparse.Namespace, logging.Logger], None],
              argv: list[str] | None = None, reads: Reads | None = None) -> int:
    """Parse flags, set up logs, log and save the configuration, run `work`, map errors to exit codes. `reads`:
    what the stage reads of other stages' outputs (held against their --overwrite while it runs)."""
    args = parse(argv)  # exits 2 on a bad flag
    quiet_other_progress_bars()
    try:
        logger = setup_logging(stage, log_dir_for(args))
    except OSError as err:
        sys.stderr.write(f"{stage}: cannot write the log folder {log_dir_for(args)} ({err}); "
                         f"choose a writable --run-dir / --output-dir\n")
        return USAGE_ERROR
    config = resolved_config(args)
    # 30-odd lines a person rarely reads: the log file and the config file keep them, the console says where.
    logger.info("%s resolved configuration:\n%s", stage, json.dumps(config, indent=2, default=str), extra=FILE_ONLY)
    config_places = [log_file_for(stage, log_dir_for(args))]
    started = time.time()
    locks = []
    try:
        output_dir = Path(args.output_dir)
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UsageError(f"--output-dir {output_dir} is not writable ({err}); choose another folder")
        locks = take_locks(stage, args, output_dir, reads)  # before anything in the folder changes
        config_file = output_dir / f"{stage}{CONFIG_FILE_SUFFIX}"
        earlier_config = read_earlier(config_file)
        try:
            if not getattr(args, "verify", False):  # a check (stage 02 --verify) leaves the output's configuration
                write_json_atomic(config_file, config)
                config_places.insert(0, config_file)
        except OSError as err:
            raise UsageError(f"--output-dir {output_dir} is not writable ({err}); choose another folder")
        logger.info("%s starting; its resolved configuration is in %s", stage, " and ".join(map(str, config_places)))
        try:
            work(args, logger)
        except UsageError:  # a refused run leaves the configuration of the run that made the output
            restore_earlier(config_file, earlier_config)
            raise
    except UsageError as err:
        logger.error("%s: %s", stage, err)
        return USAGE_ERROR
    except StageFailure as err:
        logger.error("%s failed: %s", stage, err)
        return FAILURE
    except KeyboardInterrupt:
        logger.error("%s interrupted; rerun the same command to resume", stage)
        return 130
    except ModuleNotFoundError as err:  # a package imported on the way (our own modules keep their traceback)
        message = missing_package_message(err)
        if message is None:
            logger.error("%s failed:\n%s", stage, traceback.format_exc())
        else:
            logger.error("%s", message)
        return FAILURE
    except Exception:  # noqa: BLE001 - every other failure is reported with its traceback
        logger.error("%s failed:\n%s", stage, traceback.format_exc())
        return FAILURE
    finally:
        release_all(locks)
    logger.info("%s finished in %.1f s", stage, time.time() - started)
    return 0


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
