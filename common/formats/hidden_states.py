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

from common.cli.errors import UsageError
from common.formats.files import write_text_atomic
from common.formats.manifest import load_manifest

if TYPE_CHECKING:
    from common.formats.prepared_data import Sample

STAGE = "02_extract_hidden_states"
FORMAT_VERSION = 1
SHARD_SIZE = 1000
INDEX_FILE = "index.jsonl"
AUX_FILES = ("aux_0.pt", "aux_1.pt", "aux_2.pt")
FINAL_FILE = "final.pt"
META_FILE = "meta.pt"
SAMPLE_FILES = AUX_FILES + (FINAL_FILE, META_FILE)
# (the layer-id rule itself lives in common.verifier.capture.capture_layer_ids)
LAYER_CONVENTION = "hf_output_hidden_states_index (input of decoder layer)"
FINAL_CONVENTION = "last hidden state after the final norm (lm_head(final) == logits)"
TMP_PREFIX = ".tmp_"

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


def is_complete_sample(folder: Path) -> bool:
    """All five files present and non-empty (files are not fsynced: after a power loss a renamed folder could
    hold empty files, which makes the sample incomplete and redone)."""
    try:
        with os.scandir(folder) as entries:
            sizes = {entry.name: entry.stat().st_size for entry in entries}
    except OSError:
        return False
    return all(sizes.get(name, 0) > 0 for name in SAMPLE_FILES)


def write_index(output_dir: Path, samples: Sequence[Sample], complete: Iterable[int]) -> list[dict]:
    entries = [{"id": samples[i].id, "path": samples[i].rel_path, "num_tokens": samples[i].num_tokens,
                "loss_tokens": int(samples[i].loss_mask.sum())} for i in sorted(complete)]
    write_text_atomic(output_dir / INDEX_FILE, "".join(json.dumps(e) + "\n" for e in entries))
    return entries


# --- disk space ---------------------------------------------------------------------------------------------

# Per sample besides the tensors: five torch.save headers (~1.5 KB each), the unused tail of each file's last
# 4 KB block (2 KB on average), and one directory block.
_PER_FILE_OVERHEAD = 1536 + 2048
_PER_SAMPLE_OVERHEAD = len(SAMPLE_FILES) * _PER_FILE_OVERHEAD + 4096
META_BYTES_PER_TOKEN = 8 + 1


def estimate_disk_bytes(num_tokens: int, num_samples: int, hidden_size: int, bytes_per_value: int) -> int:
    """Bytes the output will take: tokens x 4 tensors x hidden x bytes per value, plus metadata and overheads."""
    per_token = len(AUX_FILES + (FINAL_FILE,)) * hidden_size * bytes_per_value + META_BYTES_PER_TOKEN
    return num_tokens * per_token + num_samples * _PER_SAMPLE_OVERHEAD


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
    manifest["aux_layers"], ["hidden_size"], ["dtype"] and ["verifier"] describe the tensors.
    """
    manifest = load_manifest(data_dir, STAGE, "--data-dir", require_complete=require_complete)
    index = Path(data_dir) / manifest.get("index", INDEX_FILE)
    if not index.exists():
        raise UsageError(f"--data-dir {data_dir}: no {index.name}; rerun {STAGE}.py")
    with open(index) as handle:
        entries = [json.loads(line) for line in handle if line.strip()]
    return manifest, entries


def load_sample(data_dir: str | os.PathLike, entry: dict, mmap: bool = False) -> dict[str, torch.Tensor]:
    """One sample: aux [S, 3H] (aux_0 | aux_1 | aux_2 along the last dim), final [S, H], input_ids int64 [S],
    loss_mask uint8 [S]. Tensors keep the stored dtype (manifest["dtype"])."""
    folder = Path(data_dir) / entry["path"]

    def read(name: str):
        return torch.load(folder / name, map_location="cpu", weights_only=True, mmap=mmap)

    aux = torch.cat([read(name) for name in AUX_FILES], dim=-1)
    meta = read(META_FILE)
    return {"aux": aux, "final": read(FINAL_FILE), "input_ids": meta["input_ids"], "loss_mask": meta["loss_mask"]}
