"""What every stage does around its own work: logging, the resolved configuration, locks, exit codes.

Stages run over SSH under nohup, so output goes both to stdout and to RUN_DIR/logs/NN_name.log (the resolved
configuration and what only a later reader needs go to the log alone); the library logs through eagle3_pipeline/log.py
and reports progress through eagle3_pipeline/progress.py.
Exit codes: 0 success, 2 bad flag or input (raised as UsageError before any heavy work), 1 failure.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

from eagle3_pipeline.distributed import rank_info
from eagle3_pipeline.errors import FAILURE, USAGE_ERROR, StageFailure, UsageError, missing_package_message
from eagle3_pipeline.formats.files import atomic_path, write_json_atomic
from eagle3_pipeline.formats.manifest import resolved_config
from eagle3_pipeline.log import FILE_ONLY, get_logger
from eagle3_pipeline.cli.parser import log_dir_for
from eagle3_pipeline.cli.lock import OutputLock, OverwriteLock, ReaderLock, check_run_directory_free, folder_read

CONFIG_FILE_SUFFIX = ".config.json"


def log_file_for(stage: str, log_dir: Path) -> Path:
    return log_dir / f"{stage}.log"


def _for_the_console(record: logging.LogRecord) -> bool:
    return not getattr(record, "file_only", False)


def setup_logging(stage: str, log_dir: Path) -> logging.Logger:
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


# A stage's declaration of what it reads of other stages' outputs: flag dests of RUN_INPUTS, given its flags.
Reads = Callable[[argparse.Namespace], Sequence[str]]


def take_locks(stage: str, args: argparse.Namespace, output_dir: Path, reads: Reads | None) -> list:
    """The locks the stage holds while it runs (eagle3_pipeline/cli/lock.py), taken by the main process (under torchrun
    rank 0 holds them for every rank): none in a run directory the runner holds but its own stages; its output
    folder's, and with --overwrite no reader there; a reader's on each input folder."""
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
