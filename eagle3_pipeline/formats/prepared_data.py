"""Stage 01's output contract (tokenized_data.jsonl): the Sample record and the one reader stages 02 and 03 use."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.formats.manifest import MANIFEST, check_verifier_matches, load_manifest
from eagle3_pipeline.formats.hidden_states import sample_path

STAGE = "01_prepare_data"
FIX = "rerun 01_prepare_data.py (or point --prepared-data at its output)"


@dataclass
class Sample:
    """One tokenized conversation of the prepared data, at `position` (0-based line order) in its file."""
    position: int
    id: str
    input_ids: torch.Tensor  # int64 [S]
    loss_mask: torch.Tensor  # uint8 [S]
    truncated: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def rel_path(self) -> str:
        """Its folder inside a stage-02 output (eagle3_pipeline.formats.hidden_states)."""
        return sample_path(self.position, self.id)


def iter_prepared_data(path: str | os.PathLike, vocab_size: int, max_seq_len: int | None = None,
                       counts: dict[str, int] | None = None) -> Iterator[Sample]:
    """The samples of stage 01's JSONL, one line at a time; a bad line stops the stage naming the file, line and fix.

    Every line is checked whole (keys, unique id, equal lengths, token ids in 0..vocab_size-1, a 0/1 mask).
    `max_seq_len` cuts longer samples (marked truncated); None keeps them whole. `counts`, when given, is
    filled with the file's counts as written (samples, tokens, loss_tokens), which stage 01's manifest must match.
    """
    path = Path(path)
    if counts is None:
        counts = {}
    counts.update(samples=0, tokens=0, loss_tokens=0)
    first_line_of: dict[str, int] = {}
    with open(path) as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UsageError(f"{where}: not valid JSON ({err}); {FIX}")
            if not isinstance(record, dict) or not {"id", "input_ids", "loss_mask"} <= record.keys():
                raise UsageError(f"{where}: needs the keys id, input_ids, loss_mask; {FIX}")
            sample_id, ids, mask = record["id"], record["input_ids"], record["loss_mask"]
            if isinstance(sample_id, int) and not isinstance(sample_id, bool):
                sample_id = str(sample_id)
            if not isinstance(sample_id, str) or not sample_id:
                raise UsageError(f"{where}: id must be a non-empty string; {FIX}")
            if sample_id in first_line_of:
                raise UsageError(f"{where}: id {sample_id!r} repeats line {first_line_of[sample_id]}; ids must be "
                                 f"unique; {FIX}")
            first_line_of[sample_id] = line_no
            if not isinstance(ids, list) or not isinstance(mask, list) or not ids or len(ids) != len(mask):
                raise UsageError(f"{where}: input_ids and loss_mask must be non-empty lists of the same length "
                                 f"(got {len(ids) if isinstance(ids, list) else type(ids).__name__} and "
                                 f"{len(mask) if isinstance(mask, list) else type(mask).__name__}); {FIX}")
            try:
                ids_t = torch.tensor(ids, dtype=torch.int64)
                mask_t = torch.tensor(mask, dtype=torch.int64)
            except (TypeError, ValueError, RuntimeError) as err:
                raise UsageError(f"{where}: input_ids and loss_mask must hold integers ({err}); {FIX}")
            if ids_t.ndim != 1 or int(ids_t.min()) < 0 or int(ids_t.max()) >= vocab_size:
                raise UsageError(f"{where}: token ids must lie in 0..{vocab_size - 1} (the verifier's vocabulary); "
                                 f"got {int(ids_t.min())}..{int(ids_t.max())}. Was the data tokenized for another "
                                 f"model? {FIX}")
            if mask_t.ndim != 1 or not bool(((mask_t == 0) | (mask_t == 1)).all()):
                raise UsageError(f"{where}: loss_mask must hold only 0 and 1; {FIX}")
            counts["samples"] += 1
            counts["tokens"] += int(ids_t.numel())
            counts["loss_tokens"] += int(mask_t.sum())
            cut = ids_t.numel() if max_seq_len is None else max_seq_len
            yield Sample(position=counts["samples"] - 1, id=sample_id, input_ids=ids_t[:cut].clone(),
                         loss_mask=mask_t[:cut].to(torch.uint8), truncated=ids_t.numel() > cut)
    if not counts["samples"]:
        raise UsageError(f"{path}: no samples; {FIX}")


def read_prepared_data(path: str | os.PathLike, vocab_size: int,
                       max_seq_len: int | None) -> tuple[list[Sample], dict[str, int]]:
    """All samples (cut to max_seq_len) and the file's counts as written (samples, tokens, loss_tokens)."""
    counts: dict[str, int] = {}
    samples = list(iter_prepared_data(path, vocab_size, max_seq_len, counts))
    return samples, counts


def check_prepared_data(prepared_data: str | Path, model_path: str, max_seq_len: int, info,
                        log) -> tuple[list[Sample], dict]:
    """(samples cut to --max-seq-len, stage 01's manifest) of --prepared-data: it exists, is finished, comes from
    the verifier at --model-path (`info`), and parses and matches its counts. Stage 02 and stage 04 --online read it
    so."""
    data_file = Path(prepared_data)
    if not data_file.is_file():
        raise UsageError(f"--prepared-data {data_file}: no such file; run {STAGE}.py first (or point "
                         f"--prepared-data at its tokenized_data.jsonl)")
    upstream = load_manifest(data_file.parent, STAGE, "--prepared-data")
    check_verifier_matches(upstream, str(data_file.parent / MANIFEST), info.identity(),
                           f"--model-path {model_path}")
    samples, found = read_prepared_data(data_file, info.vocab_size, max_seq_len)
    expected = upstream.get("counts") or {}
    for key in ("samples", "tokens", "loss_tokens"):
        if key in expected and int(expected[key]) != found[key]:
            raise UsageError(f"{data_file}: {found[key]} {key} but its manifest {data_file.parent / MANIFEST} says "
                             f"{expected[key]}; the file changed after {STAGE} wrote it. Rerun {STAGE}.py")
    truncated = sum(s.truncated for s in samples)
    if truncated:
        log.warning("%d of %d samples are longer than --max-seq-len %d and are truncated", truncated,
                    len(samples), max_seq_len)
    return samples, upstream
