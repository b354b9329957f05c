"""The draft vocabulary: the N most frequent loss-masked target tokens, and the maps SGLang reads.

`d2t[i] = target_id(i) - i` (an offset, as SGLang and vLLM add it to the draft id), `t2d` is a bool
mask over the verifier vocabulary. Kept ids are sorted ascending; ties in frequency break by token id.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.formats.files import atomic_path, read_json
from eagle3_pipeline.formats.manifest import MANIFEST, relocated

MAPPING_FILE = "vocab_mapping.safetensors"
REPORT_FILE = "vocab_report.json"


def count_target_tokens(records: Iterable[dict], vocab_size: int, source: str = "data") -> np.ndarray:
    """How often each verifier token id appears under the loss mask."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for record in records:
        ids = np.asarray(record["input_ids"], dtype=np.int64)
        mask = np.asarray(record["loss_mask"], dtype=bool)
        targets = ids[mask]
        if targets.size and (targets.max() >= vocab_size or targets.min() < 0):
            raise UsageError(f"{source}: token id {int(targets.max())} outside the verifier vocabulary of "
                             f"{vocab_size}; the data was tokenized with another tokenizer")
        counts += np.bincount(targets, minlength=vocab_size)
    return counts


@dataclass
class VocabMapping:
    d2t: torch.Tensor  # int64 [draft_vocab]
    t2d: torch.Tensor  # bool [vocab]

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target ids of the draft vocabulary, ascending."""
        return torch.arange(len(self.d2t)) + self.d2t


def select_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> VocabMapping:
    """Keep the most frequent ids (ties by lower id); the identity map when the vocabulary is not larger."""
    vocab_size = len(counts)
    if draft_vocab_size >= vocab_size:
        kept = np.arange(vocab_size)
    else:
        # Sort by count descending, then id ascending; lexsort's last key is the primary one.
        order = np.lexsort((np.arange(vocab_size), -counts))
        kept = np.sort(order[:draft_vocab_size])
    kept_t = torch.from_numpy(kept.astype(np.int64))
    d2t = kept_t - torch.arange(len(kept_t), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept_t] = True
    return VocabMapping(d2t=d2t, t2d=t2d)


def mapping_report(counts: np.ndarray, mapping: VocabMapping, tokenizer=None) -> dict:
    kept = mapping.draft_ids.numpy()
    total = int(counts.sum())
    covered = int(counts[kept].sum())
    kept_counts = counts[kept]
    least = int(kept[np.lexsort((-kept, kept_counts))[0]])  # lowest count, then highest id
    report = {
        "vocab_size": len(counts),
        "draft_vocab_size": len(kept),
        "target_tokens": total,
        "unique_target_tokens": int((counts > 0).sum()),
        "coverage": covered / total if total else 0.0,
        "kept_tokens_never_seen": int((kept_counts == 0).sum()),
        "least_frequent_kept": {"id": least, "count": int(counts[least])},
    }
    if tokenizer is not None:
        report["least_frequent_kept"]["text"] = tokenizer.decode([least])
    return report


def save_mapping(mapping: VocabMapping, directory: str | Path) -> Path:
    from safetensors.torch import save_file

    path = Path(directory) / MAPPING_FILE
    with atomic_path(path) as tmp:
        save_file({"d2t": mapping.d2t.contiguous(), "t2d": mapping.t2d.contiguous()}, str(tmp))
    return path


def load_mapping(directory: str | Path) -> VocabMapping:
    """Stage 03's map in `directory`; a missing or damaged file is a usage error with the command that rebuilds it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory) / MAPPING_FILE
    if not path.exists():
        raise UsageError(f"{path}: no vocabulary map; run 03_build_vocab_mapping.py first")
    try:
        tensors = load_file(str(path))
        return VocabMapping(d2t=tensors["d2t"], t2d=tensors["t2d"])
    except (SafetensorError, OSError, KeyError) as err:
        raise UsageError(f"{path}: not a whole vocabulary map ({type(err).__name__}: {err}); the file is damaged. "
                         f"Rebuild it: {rebuild_command(Path(directory))}")


def rebuild_command(directory: Path) -> str:
    """The stage-03 command that writes this folder's map again, from what its manifest recorded."""
    try:
        manifest = read_json(directory / MANIFEST)
        data = relocated(manifest["inputs"]["prepared_data"]["path"], directory / MANIFEST, manifest)
        size = manifest["draft_vocab_size_requested"]
    except (OSError, ValueError, KeyError, TypeError):  # no readable record: the flags to fill in
        data, size = "RUN_DIR/data/tokenized_data.jsonl", "N"
    return (f"python 03_build_vocab_mapping.py --prepared-data {data} --draft-vocab-size {size} "
            f"--output-dir {directory} --overwrite")
