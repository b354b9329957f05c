#!/usr/bin/env python3
"""What stage 04's checksum check of stage 02's files costs: tokens/s of reading samples on one CPU core, with and
without comparing each file's CRC32 with the one stage 02 recorded (docs/training.md, reading the hidden states).

Writes `--samples` samples of `--tokens` tokens at hidden size `--hidden` (bf16 aux_0..2 + final, stage 02's own
writer) into a temporary folder, then reads them through stage 04's dataset
(eagle3_pipeline.train.data.HiddenStateDataset) twice after a warm-up read: files in the page cache, so the figures are
the host's work, not the disk's (reading from a disk costs the same with or without the check: the check reads the bytes
first, the load then finds them cached). Prints one JSON line.

  python scripts/lab/bench_state_checksums.py --hidden 4096 --tokens 1024 --samples 16
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from eagle3_pipeline.extract.writer import write_sample
from eagle3_pipeline.formats.hidden_states import sample_path
from eagle3_pipeline.formats.prepared_data import Sample
from eagle3_pipeline.train.data import HiddenStateDataset


def write_samples(folder: Path, count: int, tokens: int, hidden: int) -> list[dict]:
    entries = []
    for position in range(count):
        sample = Sample(position=position, id=f"s{position}", input_ids=torch.arange(tokens),
                        loss_mask=torch.ones(tokens, dtype=torch.uint8))
        states = [torch.randn(tokens, hidden).to(torch.bfloat16) for _ in range(4)]
        write_sample(folder, sample, states)
        entries.append({"id": sample.id, "path": sample_path(position, sample.id), "num_tokens": tokens})
    return entries


def read_rate(folder: Path, entries: list[dict], tokens: int, checked: bool) -> float:
    """Tokens/s of reading every sample once, comparing checksums or not."""
    dataset = HiddenStateDataset(folder, entries, max_seq_len=tokens)
    if not checked:
        dataset.mark_checked(range(len(entries)))
    started = time.perf_counter()
    for position in range(len(dataset)):
        dataset[position]
    return len(entries) * tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        entries = write_samples(folder, args.samples, args.tokens, args.hidden)
        read_rate(folder, entries, args.tokens, checked=False)  # warm-up: every file in the page cache
        plain = max(read_rate(folder, entries, args.tokens, checked=False) for _ in range(2))
        checked = max(read_rate(folder, entries, args.tokens, checked=True) for _ in range(2))
    megabytes_per_token = 4 * args.hidden * 2 / 1e6
    print(json.dumps({"hidden": args.hidden, "tokens_per_sample": args.tokens, "samples": args.samples,
                      "read_tokens_per_s": round(plain), "read_and_check_tokens_per_s": round(checked),
                      "check_tokens_per_s": round(1 / (1 / checked - 1 / plain)),
                      "check_MB_per_s": round(megabytes_per_token / (1 / checked - 1 / plain))}))


if __name__ == "__main__":
    main()
