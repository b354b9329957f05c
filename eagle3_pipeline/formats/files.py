"""Files written whole or not at all (temp file, then rename), JSON reading, and content hashes."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

_UMASK = os.umask(0)
os.umask(_UMASK)


# --- atomic writes ---------------------------------------------------------------------------------

def readable_like_any_file(path: str | os.PathLike) -> None:
    """Give a file the mode a plain open() would (0644 under the usual umask): mkstemp and safetensors' save_file
    make files only their owner can read, which a group sharing a run directory then cannot."""
    os.chmod(path, 0o666 & ~_UMASK)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it into place only if the block succeeds."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        readable_like_any_file(tmp)  # after the writer: mkstemp and safetensors' save_file make 0600
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as handle:
        return json.load(handle)


# --- hashes ----------------------------------------------------------------------------------------

def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def crc32_file(path: str | os.PathLike, chunk: int = 8 << 20) -> int:
    """zlib's CRC32 of a file's bytes (about 2 GB/s on one core: cheap beside writing them)."""
    crc = 0
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc
