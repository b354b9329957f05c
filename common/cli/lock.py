"""One writer per output folder: an exclusive lock every stage and run_pipeline.py take on the folder they write.

The lock is an flock on FOLDER/.lock, which the kernel releases when its holder exits however it exits; the
file also records who holds it (pid, host, start time, command), so a refused run can say who is writing.
A record left by a process that is gone is taken over with a warning. A record from another host whose
lock is free cannot be checked from here, so it is refused with the file to delete once that run is over.
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

from common.cli.errors import UsageError

LOCK_FILE = ".lock"


def _holder_record() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(sys.argv)[:500]}


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


class OutputLock:
    """`with OutputLock(folder, what):` - the folder is ours until the block ends; a second holder is refused
    (UsageError, exit 2) at once with who holds it."""

    def __init__(self, folder: str | os.PathLike, what: str = "another run"):
        self.path = Path(folder) / LOCK_FILE
        self.what = what
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
        handle.write(json.dumps(_holder_record()) + "\n")
        handle.flush()
        self.handle = handle
        return self

    def _take_over(self, handle, left: dict) -> None:
        """A record without a lock: its writer stopped without releasing (killed, or the machine went down)."""
        if left.get("host") not in (None, socket.gethostname()):
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
