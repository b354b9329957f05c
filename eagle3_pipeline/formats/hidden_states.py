"""Stage 02's on-disk contract (the hidden-states folder): names, layout, index, disk estimate, and the reader
stages 04 and 05 use. The layout is described in docs/extraction.md."""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from eagle3_pipeline.errors import StageFailure, UsageError
from eagle3_pipeline.formats.files import crc32_file, read_json, write_json_atomic, write_text_atomic
from eagle3_pipeline.formats.layer_ids import LAYER_CONVENTION
from eagle3_pipeline.formats.manifest import load_manifest
from eagle3_pipeline.formats.storage import (AUX_SCALE_FILE, TOPK_IDS_FILE, TOPK_LOGPROBS_FILE, StorageFormat,
                                             format_of_manifest)

if TYPE_CHECKING:
    from eagle3_pipeline.formats.prepared_data import Sample

STAGE = "02_extract_hidden_states"
FORMAT_VERSION = 1
SHARD_SIZE = 1000
INDEX_FILE = "index.jsonl"
AUX_FILES = ("aux_0.pt", "aux_1.pt", "aux_2.pt")
FINAL_FILE = "final.pt"
META_FILE = "meta.pt"
SAMPLE_FILES = AUX_FILES + (FINAL_FILE, META_FILE)
# (the layer-id rule itself lives in eagle3_pipeline.verifier.capture.capture_layer_ids)
FINAL_CONVENTION = "last hidden state after the final norm (lm_head(final) == logits)"
TMP_PREFIX = ".tmp_"
# Each sample folder records its files' sizes and CRC32s, written with them (so both backends record them);
# index.jsonl repeats them, a rerun re-checks the sizes and `--verify` the checksums.
RECORD_FILE = "files.json"
DAMAGED_MARK = "DAMAGED"  # left in a sample folder by `--verify`: the next run redoes that sample

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def shard_name(position: int) -> str:
    return f"shard_{position // SHARD_SIZE:05d}"


def sample_dir_name(sample_id: str) -> str:
    """A file-system-safe folder name for a sample id (ids with other characters get a hash suffix)."""
    safe = _UNSAFE.sub("_", sample_id)[:80]
    if safe == sample_id and safe and not safe.startswith("."):
        return safe
    digest = hashlib.sha1(sample_id.encode()).hexdigest()[:10]
    return f"{safe.lstrip('.') or 'sample'}-{digest}"


def sample_path(position: int, sample_id: str) -> str:
    """The folder of the sample at `position` with `sample_id`, relative to the output folder."""
    return f"{shard_name(position)}/{sample_dir_name(sample_id)}"


def record_files(folder: Path, names: Sequence[str] = SAMPLE_FILES) -> dict[str, dict[str, int]]:
    """Write RECORD_FILE into a freshly written sample folder: each file's byte size and CRC32."""
    record = {name: {"bytes": (folder / name).stat().st_size, "crc32": crc32_file(folder / name)}
              for name in names}
    write_json_atomic(folder / RECORD_FILE, record)
    return record


def read_record(folder: Path) -> dict[str, dict[str, int]] | None:
    """The sizes and checksums recorded when the sample was written; None for samples written before
    records existed, or a record that cannot be read."""
    try:
        record = read_json(folder / RECORD_FILE)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _expected_files(sizes: dict[str, int], folder: Path) -> Sequence[str]:
    """The files a sample folder must hold: those its record lists (the record is written last, so it names the
    files of the sample's storage format), else the bf16 + final files of samples written before records."""
    record = read_record(folder) if RECORD_FILE in sizes else None
    if record:
        return [name for name in record if name.endswith(".pt")] or SAMPLE_FILES
    return SAMPLE_FILES


def sample_problem(folder: Path) -> str | None:
    """Why the sample in `folder` is not whole (a file missing, empty, unreadable, or of another size than
    recorded), or None. Cheap: sizes only, no file is read but the record."""
    try:
        with os.scandir(folder) as entries:
            sizes = {entry.name: entry.stat().st_size for entry in entries}
    except OSError as err:
        return f"unreadable folder ({err.strerror or err})"
    if DAMAGED_MARK in sizes:
        try:
            return "found damaged by --verify: " + (folder / DAMAGED_MARK).read_text().strip()
        except OSError:
            return "found damaged by --verify"
    names = _expected_files(sizes, folder)
    missing = [name for name in names if name not in sizes]
    if missing:
        return f"{', '.join(missing)} missing"
    empty = [name for name in names if sizes[name] == 0]
    if empty:  # files are not fsynced one by one: after a power loss a renamed folder can hold empty files
        return f"{', '.join(empty)} empty"
    if RECORD_FILE not in sizes:
        return None  # written before records existed: non-empty is all that can be checked
    record = read_record(folder)
    if record is None:
        return f"{RECORD_FILE} unreadable"
    for name in names:
        expected = (record.get(name) or {}).get("bytes")
        if expected != sizes[name]:
            return f"{name} is {sizes[name]} bytes, {expected} were written"
    return None


def is_complete_sample(folder: Path) -> bool:
    return sample_problem(folder) is None


def verify_sample(folder: Path) -> list[str]:
    """Every problem of one sample, checksums included (reads every byte): ['aux_1.pt: CRC32 ...', ...]."""
    problem = sample_problem(folder)
    if problem is not None:
        return [problem]
    record = read_record(folder)
    if record is None:  # written before records existed: the size check above is all there is
        return []
    problems = []
    for name in record:
        try:
            found = crc32_file(folder / name)
        except OSError as err:
            problems.append(f"{name} unreadable ({err.strerror or err})")
            continue
        if found != record[name].get("crc32"):
            problems.append(f"{name}: CRC32 {found:08x}, {int(record[name].get('crc32') or 0):08x} was written")
    return problems


_RECORDS: dict[tuple[str, int, int], dict] = {}  # (folder, inode, mtime) -> record: a refresh reads only new ones


def cached_record(folder: Path) -> dict | None:
    try:
        stat = os.stat(folder / RECORD_FILE)
    except OSError:
        return None
    key = (str(folder), stat.st_ino, stat.st_mtime_ns)
    if key not in _RECORDS:
        record = read_record(folder)
        if record is None:
            return None
        _RECORDS[key] = record
    return _RECORDS[key]


def write_index(output_dir: Path, samples: Sequence[Sample], complete: Iterable[int]) -> list[dict]:
    entries = []
    for i in sorted(complete):
        entry = {"id": samples[i].id, "path": samples[i].rel_path, "num_tokens": samples[i].num_tokens,
                 "loss_tokens": int(samples[i].loss_mask.sum())}
        record = cached_record(Path(output_dir) / samples[i].rel_path)
        if record is not None:
            entry["files"] = record
        entries.append(entry)
    write_text_atomic(output_dir / INDEX_FILE, "".join(json.dumps(e) + "\n" for e in entries))
    return entries


def describe_states(info, verifier_weights: dict | None, aux_layers: Sequence[int], dtype: str, compute_dtype: str,
                    storage: StorageFormat) -> dict:
    """What the hidden states are, in the manifest's words: the verifier (identity and weights' fingerprint), the
    layers and conventions, the dtypes and the storage format. Stage 02's manifest holds it, and stage 04 --online
    records it for the states it computes (the checks of a drafter against its data read it either way)."""
    return {"verifier": info.identity(), "verifier_weights": verifier_weights, "aux_layers": list(aux_layers),
            "layer_convention": LAYER_CONVENTION, "final": FINAL_CONVENTION, "num_layers": info.num_layers,
            "hidden_size": info.hidden_size, "dtype": dtype, "compute_dtype": compute_dtype,
            "storage": storage.describe()}


# --- disk space ---------------------------------------------------------------------------------------------

# Per sample besides the tensors: five torch.save headers (~1.5 KB each), the unused tail of each file's last
# 4 KB block (2 KB on average), and one directory block.
_PER_FILE_OVERHEAD = 1536 + 2048
_PER_SAMPLE_OVERHEAD = len(SAMPLE_FILES) * _PER_FILE_OVERHEAD + 4096
META_BYTES_PER_TOKEN = 8 + 1


def estimate_disk_bytes(num_tokens: int, num_samples: int, hidden_size: int, bytes_per_value: int,
                        fmt: StorageFormat | None = None) -> int:
    """Bytes the output will take: tokens x the format's bytes per token (bf16 + final: 4 tensors x hidden x
    bytes per value), plus metadata and overheads."""
    if fmt is None:
        per_token = len(AUX_FILES + (FINAL_FILE,)) * hidden_size * bytes_per_value
        files = len(SAMPLE_FILES)
    else:
        per_token, files = fmt.bytes_per_token(hidden_size), len(fmt.files())
    per_sample = files * _PER_FILE_OVERHEAD + 4096
    return num_tokens * (per_token + META_BYTES_PER_TOKEN) + num_samples * per_sample


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1024 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PB"


# --- reading (stages 04 and 05) -----------------------------------------------------------------------------

def open_hidden_states(data_dir: str | os.PathLike, require_complete: bool = True) -> tuple[dict, list[dict]]:
    """(manifest, index entries) of a stage-02 output; refuses an unfinished or foreign folder.

    Each entry is {"id", "path", "num_tokens", "loss_tokens"}; `path` is relative to data_dir.
    manifest["aux_layers"], ["hidden_size"], ["dtype"], ["storage"] and ["verifier"] describe the tensors.
    A storage format this code does not know is refused (eagle3_pipeline.formats.storage.format_of_manifest).
    """
    manifest = load_manifest(data_dir, STAGE, "--data-dir", require_complete=require_complete)
    format_of_manifest(manifest, f"--data-dir {data_dir}")
    index = Path(data_dir) / manifest.get("index", INDEX_FILE)
    if not index.exists():
        raise UsageError(f"--data-dir {data_dir}: no {index.name}; rerun {STAGE}.py")
    with open(index) as handle:
        entries = [json.loads(line) for line in handle if line.strip()]
    return manifest, entries


def rerun_command(data_dir: str | os.PathLike) -> str:
    """The stage-02 command that made `data_dir`, from its manifest's flags: a rerun redoes damaged samples."""
    try:
        flags = read_json(Path(data_dir) / "manifest.json").get("flags") or {}
    except (OSError, ValueError):
        flags = {}
    words = [f"python {STAGE}.py", f"--output-dir {data_dir}"]
    defaults = {"aux_dtype": "bfloat16", "targets": "final", "target_topk": 64}  # the storage format, when not these
    for name in ("model_path", "prepared_data", "aux_layers", "dtype", "max_seq_len", "backend", *defaults):
        value = flags.get(name)
        if value not in (None, "", defaults.get(name)):
            value = ",".join(map(str, value)) if isinstance(value, list) else value
            words.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(words)


def repair_command(data_dir: str | os.PathLike) -> str:
    """The commands that find and redo damaged samples of `data_dir`."""
    return (f"`python {STAGE}.py --output-dir {data_dir} --verify` (checks every file and marks the damaged "
            f"samples), then `{rerun_command(data_dir)}` (redoes them)")


def load_sample(data_dir: str | os.PathLike, entry: dict, mmap: bool = False) -> dict[str, torch.Tensor]:
    """One sample: aux [S, 3H] (aux_0 | aux_1 | aux_2 along the last dim), final [S, H], input_ids int64 [S],
    loss_mask uint8 [S]. Tensors keep the stored dtype (manifest["storage"]): FP8 aux come with aux_scale
    float32 [S, 3] (eagle3_pipeline.formats.storage.dequantize_batch decodes them on the device), and top-k targets
    are topk_ids [S, K] and topk_logprobs [S, K] instead of final. A file that cannot be read stops with a
    StageFailure naming the sample, the file and the repair command."""
    folder = Path(data_dir) / entry["path"]

    def read(name: str):
        try:
            return torch.load(folder / name, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as err:  # noqa: BLE001 - missing, cut short, or not a torch file: all a damaged sample
            raise StageFailure(f"sample {entry.get('id')!r}: cannot read {folder / name} "
                               f"({type(err).__name__}: {str(err)[:200]}). Repair it with "
                               f"{repair_command(data_dir)}") from None

    aux = torch.cat([read(name) for name in AUX_FILES], dim=-1)
    meta = read(META_FILE)
    sample = {"aux": aux, "input_ids": meta["input_ids"], "loss_mask": meta["loss_mask"]}
    # The format shows in the files (a run directory holds one format: stage 02 refuses to mix them).
    if aux.dtype == torch.float8_e4m3fn:
        sample["aux_scale"] = read(AUX_SCALE_FILE)
    if (folder / TOPK_IDS_FILE).exists():
        sample["topk_ids"], sample["topk_logprobs"] = read(TOPK_IDS_FILE), read(TOPK_LOGPROBS_FILE)
    else:
        sample["final"] = read(FINAL_FILE)
    return sample
