"""Who may change an output folder: one writer at a time, no --overwrite under a reader, no stage run by hand in a
run directory that run_pipeline.py holds.

Writers (OutputLock): an exclusive flock on FOLDER/.lock, which the kernel releases when its holder exits however
it exits; the file also records who holds it (pid, host, start time, command), so a refused run can say who is
writing. A record left by a process that is gone is taken over with a warning. A record from another host whose
lock is free cannot be checked from here, so it is refused with the file to delete once that run is over.

Readers (ReaderLock): a stage that reads another stage's output holds a shared flock on FOLDER/.readers/gate while
it runs, and leaves its record beside it (FOLDER/.readers/HOST-PID.json). A run that overwrites the folder holds the
gate exclusively for as long as it runs (OverwriteLock): it is refused while any reader is there, and a reader that
comes while it overwrites is refused. Readers share the gate; a writer that only adds to the folder (a resumed run)
never takes it. The kernel releases a killed reader's flock: its record is then stale, removed by the next
overwrite (a record from another host, as for writers, is refused with the file to delete).

The runner: run_pipeline.py's lock on the run directory is recorded as the runner's, and the stages it starts get
its pid (RUNNER_PID_ENV); any other stage in that run directory is refused (check_run_directory_free).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.cli.flags import RUN_INPUTS
from eagle3_pipeline.formats.manifest import MANIFEST

LOCK_FILE = ".lock"
READERS_DIR = ".readers"
GATE_FILE = "gate"
RUNNER = "run_pipeline.py"
RUNNER_PID_ENV = "EAGLE3_RUNNER_PID"  # set by the runner for the stages it starts


def _holder_record(kind: str | None = None) -> dict:
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": " ".join(sys.argv)[:500]}
    return {**record, "kind": kind} if kind else record


def _read_record(handle) -> dict | None:
    handle.seek(0)
    text = handle.read().strip()
    if not text:
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError:  # an older lock file holding only a pid
        record = {"pid": text}
    return record if isinstance(record, dict) else {"pid": text}


def _describe(record: dict | None) -> str:
    if not record:
        return "an unknown process"
    return (f"pid {record.get('pid', '?')} on host {record.get('host', '?')}, started "
            f"{record.get('started_at', '?')}" + (f" ({record['command']})" if record.get("command") else ""))


def _process_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, TypeError, ProcessLookupError):
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def _on_other_host(record: dict) -> bool:
    return record.get("host") not in (None, socket.gethostname())


def _held_by_someone(handle) -> bool:
    """Whether another open file holds an flock on this file (probed with a shared lock, let go at once)."""
    try:
        fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(handle, fcntl.LOCK_UN)
    return False


class OutputLock:
    """`with OutputLock(folder, what):` - the folder is ours until the block ends; a second holder is refused
    (UsageError, exit 2) at once with who holds it. `kind` marks the record (the runner's is RUNNER)."""

    def __init__(self, folder: str | os.PathLike, what: str = "another run", kind: str | None = None):
        self.path = Path(folder) / LOCK_FILE
        self.what = what
        self.kind = kind
        self.handle = None

    def acquire(self) -> "OutputLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read_record(handle))
            handle.close()
            raise UsageError(f"{self.path.parent} is in use: {self.what} ({holder}) is writing there. Wait for it "
                             f"to finish, stop it, or choose another output folder")
        left = _read_record(handle)
        if left is not None:
            self._take_over(handle, left)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(_holder_record(self.kind)) + "\n")
        handle.flush()
        self.handle = handle
        return self

    def _take_over(self, handle, left: dict) -> None:
        """A record without a lock: its writer stopped without releasing (killed, or the machine went down)."""
        if _on_other_host(left):
            handle.close()
            raise UsageError(f"{self.path} says {_describe(left)} is writing {self.path.parent}, and that host "
                             f"cannot be checked from here. If that run is over, delete {self.path} and rerun")
        state = "still running but no longer holding it" if _process_alive(left.get("pid")) else "no longer running"
        logging.getLogger("eagle3").warning("%s: taking over the lock left by %s (%s)", self.path.parent,
                                            _describe(left), state)

    def release(self) -> None:
        if self.handle is None:
            return
        self.handle.seek(0)
        self.handle.truncate()  # an empty record: released cleanly
        self.handle.flush()
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()
        self.handle = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def hold_run_directory(run_dir: str | os.PathLike) -> OutputLock:
    """run_pipeline.py's lock on its run directory; the stages it starts inherit its pid and may run there."""
    lock = OutputLock(run_dir, f"another {RUNNER}", kind=RUNNER).acquire()
    os.environ[RUNNER_PID_ENV] = str(os.getpid())
    return lock


def check_run_directory_free(run_dir: str | os.PathLike, stage: str) -> None:
    """Refuse a stage run by hand in a run directory run_pipeline.py holds: the runner would meet what it changed."""
    path = Path(run_dir) / LOCK_FILE
    try:
        handle = open(path)
    except OSError:
        return  # no runner ever held it
    with handle:
        holder = _read_record(handle) or {}
        if holder.get("kind") != RUNNER or not _held_by_someone(handle):
            return  # a stage's own output lock (that stage's business), or a runner that is over
    if not _on_other_host(holder) and str(holder.get("pid")) == os.environ.get(RUNNER_PID_ENV):
        return  # one of the runner's own stages (it runs them on its own host)
    raise UsageError(f"{run_dir} is held by {RUNNER} ({_describe(holder)}): {stage} run by hand there would change "
                     f"what the runner works on. Wait for the runner to finish or stop it, or give this stage "
                     f"another --run-dir / --output-dir")


def folder_read(dest: str, value) -> Path | None:
    """The output folder of another stage that the path of flag `dest` lies in, when it is one (it holds a
    manifest): the flag's folder itself, or the folder holding the file or checkpoint it names (RUN_INPUTS)."""
    _, inner = RUN_INPUTS[dest]
    if not value:
        return None
    folder = Path(value).parent if inner else Path(value)
    return folder if (folder / MANIFEST).is_file() else None


def _reader_records(folder: Path) -> list[tuple[Path, dict]]:
    records = []
    for path in sorted((folder / READERS_DIR).glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            record = {}
        records.append((path, record if isinstance(record, dict) else {}))
    return records


def _describe_reader(record: dict) -> str:
    return f"{record.get('stage', 'a stage')} ({_describe(record)})"


class ReaderLock:
    """`ReaderLock(folder, stage).acquire()`: this stage reads `folder` until release(); an --overwrite of it is
    refused meanwhile. Refused (UsageError) while an --overwrite of the folder runs."""

    def __init__(self, folder: str | os.PathLike, stage: str):
        self.folder = Path(folder)
        self.stage = stage
        self.handle = None
        self.record_path = self.folder / READERS_DIR / f"{socket.gethostname()}-{os.getpid()}.json"

    def acquire(self) -> "ReaderLock":
        try:
            (self.folder / READERS_DIR).mkdir(exist_ok=True)
            handle = open(self.folder / READERS_DIR / GATE_FILE, "a+")
        except OSError:  # a folder we cannot write: no run of ours can overwrite it either
            return self
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            writer = _writer_of(self.folder)
            raise UsageError(f"{self.folder} is being overwritten by {writer}; {self.stage} reads it. Wait for that "
                             f"run to finish, then rerun")
        record = {**_holder_record(), "stage": self.stage}
        self.record_path.write_text(json.dumps(record) + "\n")
        self.handle = handle
        return self

    def release(self) -> None:
        if self.handle is None:
            return
        self.record_path.unlink(missing_ok=True)
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()
        self.handle = None


def _writer_of(folder: Path) -> str:
    try:
        with open(folder / LOCK_FILE) as handle:
            return _describe(_read_record(handle))
    except OSError:
        return "an unknown process"


class OverwriteLock:
    """`OverwriteLock(folder).acquire()`: no stage reads `folder` until release() (taken by a run that replaces
    what is there). Refused (UsageError) naming each reader while any reads it."""

    def __init__(self, folder: str | os.PathLike, stage: str):
        self.folder = Path(folder)
        self.stage = stage
        self.handle = None

    def acquire(self) -> "OverwriteLock":
        (self.folder / READERS_DIR).mkdir(parents=True, exist_ok=True)
        handle = open(self.folder / READERS_DIR / GATE_FILE, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            readers = [_describe_reader(record) for _, record in _reader_records(self.folder)
                       if _on_other_host(record) or _process_alive(record.get("pid"))]
            named = "; ".join(readers) or "a stage that is just starting"
            raise UsageError(f"{self.folder} is being read by {named}: {self.stage} --overwrite would delete what "
                             f"it reads. Wait for it to finish or stop it, then rerun; or choose another output "
                             f"folder")
        self.handle = handle
        self._remove_stale_records()
        return self

    def _remove_stale_records(self) -> None:
        """Records whose reader holds no lock: it was killed. One from another host cannot be checked from here."""
        for path, record in _reader_records(self.folder):
            if _on_other_host(record):
                self.release()
                raise UsageError(f"{path} says {_describe_reader(record)} reads {self.folder}, and that host "
                                 f"cannot be checked from here. If that run is over, delete {path} and rerun")
            logging.getLogger("eagle3").warning("%s: removing the record of a reader that stopped without "
                                                "releasing it: %s", self.folder, _describe_reader(record))
            path.unlink(missing_ok=True)

    def release(self) -> None:
        if self.handle is None:
            return
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()
        self.handle = None
