"""A full disk, said so: the one error for a write that ran out of space, naming the path, the bytes the write needed
and those free, for the stages that write large files (stage 02's samples, stage 04's checkpoints).

The libraries lose the errno on the way: torch.save reports "unexpected pos 576 vs 534", safetensors "No space left
on device (os error 28)". So a failed write also counts as a full disk when the disk has less free than it needed.
"""
from __future__ import annotations

import errno
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from eagle3_pipeline.errors import StageFailure
from eagle3_pipeline.formats.hidden_states import human_bytes

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_TEXTS = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


class DiskFull(StageFailure):
    """A write that ran out of disk space: exit code 1 with the message, no traceback."""


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the file system that holds `path` (or its nearest existing parent); None when unknown."""
    path = Path(path)
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def is_disk_full(error: BaseException, path: str | Path | None = None, needed: int = 0) -> bool:
    """Whether `error` (or an error it came from) is a full disk or quota: by its errno, by the words the libraries
    put in its message, or, given `path` and `needed`, by the disk now having less free than the write needed."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in FULL_ERRNOS:
            return True
        if any(text in str(error) for text in FULL_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    if path is None or needed <= 0:
        return False
    free = free_bytes(path)
    return free is not None and free < needed


def disk_full(path: str | Path, needed: int, what: str, fix: str) -> DiskFull:
    """The error for writing `what` to `path`, which needed about `needed` bytes; `fix` says what is whole and how on."""
    free = free_bytes(path)
    return DiskFull(f"no space left on the device of {path} while writing {what}: it needs about "
                    f"{human_bytes(needed)}, {human_bytes(free) if free is not None else 'an unknown amount'} is free "
                    f"there. {fix}")


@contextmanager
def full_disk_reported(path: str | Path, needed: int | Callable[[], int], what: str, fix: str) -> Iterator[None]:
    """A full disk met inside the block (by its errno or message) becomes disk_full's error, naming the file that
    failed where the error names one; every other error passes unchanged. `needed` may be a function: it is
    called only then."""
    try:
        yield
    except StageFailure:
        raise
    except Exception as err:
        if not is_disk_full(err):
            raise
        bytes_needed = needed() if callable(needed) else needed
        raise disk_full(getattr(err, "filename", None) or path, bytes_needed, what, fix) from None
