"""Tokenizing a round's records in worker processes, with exactly the per-record results of the serial path.

Stage 01 tokenizes each round between two regenerations, so the GPU waits on it: at 2 ms a conversation a
100K-conversation run spent 100-200 s in one core. A persistent pool of spawned workers (never forked: the parent
holds CUDA and compile threads) each receive the ChatTokenizer once; records go out in slices and come back in
order as plain data, together with the tokenizer's counters, which the parent adds to its own.
"""
from __future__ import annotations

import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Union

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.log import get_logger
from eagle3_pipeline.data.chat_tokenizer import ChatTokenizer, Sample
from eagle3_pipeline.data.records import BadRecordError, Record

WORKERS_ENV = "EAGLE3_TOKENIZE_WORKERS"
MAX_DEFAULT_WORKERS = 8      # more buys little: the parent's deduplication and writing then dominate
POOL_MIN_RECORDS = 2000      # fewer records are tokenized in the parent (a pool's start and transfers would not pay)
MAX_SLICE_RECORDS = 256      # records per task
SLICES_PER_WORKER = 4        # smaller slices where a round allows, so no worker idles while one finishes a big one

# One record's result: its samples, or (reason, detail) of the BadRecordError it raised. Plain data, since a
# custom exception does not cross a process boundary intact (BadRecordError unpickles with its message as reason).
Result = Union[list[Sample], tuple[str, str]]


def tokenize_workers() -> tuple[int, bool]:
    """Worker processes from EAGLE3_TOKENIZE_WORKERS (0 or 1: serial), and whether it was set explicitly; unset:
    min(8, cores - 1), leaving a core to the parent."""
    value = os.environ.get(WORKERS_ENV, "").strip()
    if not value:
        return min(MAX_DEFAULT_WORKERS, (os.cpu_count() or 1) - 1), False
    try:
        workers = int(value)
        if workers < 0:
            raise ValueError(value)
    except ValueError:
        raise UsageError(f"{WORKERS_ENV}={value!r}: expected a number of tokenizing processes, e.g. 8 (0 or 1: "
                         "tokenize in the stage's own process)") from None
    return workers, True


def tokenize_one(chat: ChatTokenizer, record: Record) -> Result:
    try:
        return chat.record(record)
    except BadRecordError as err:
        return err.reason, err.detail


# --- in a worker process ------------------------------------------------------------------------------

_chat: ChatTokenizer | None = None  # the worker's copy, set once by the pool's initializer


def _start_worker(chat: ChatTokenizer) -> None:
    global _chat
    # One tokenizer thread per worker: the workers are the parallelism, Rayon's threads would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _chat = chat


def _tokenize_slice(records: list[Record]) -> tuple[list[Result], int, int]:
    """The slice's results in order, and what it added to split_turn_samples and dropped_turns."""
    split, dropped = _chat.split_turn_samples, _chat.dropped_turns
    results = [tokenize_one(_chat, record) for record in records]
    return results, _chat.split_turn_samples - split, _chat.dropped_turns - dropped


# --- in the stage's process ---------------------------------------------------------------------------

class ParallelTokenizer:
    """Tokenizes a list of records (ChatTokenizer.record each), in worker processes where that pays."""

    def __init__(self, chat: ChatTokenizer):
        self.chat = chat
        self.workers, explicit = tokenize_workers()
        # Set explicitly, the variable asks for the pool on any round of two records per worker (tests use this).
        self.min_records = 2 * self.workers if explicit else POOL_MIN_RECORDS
        self._pool: ProcessPoolExecutor | None = None

    def pays(self, records: int) -> bool:
        return self.workers > 1 and records >= max(2, self.min_records)

    def __call__(self, records: list[Record]) -> list[Result]:
        if not self.pays(len(records)):
            return [tokenize_one(self.chat, record) for record in records]
        size = max(1, min(MAX_SLICE_RECORDS, math.ceil(len(records) / (SLICES_PER_WORKER * self.workers))))
        slices = [records[start:start + size] for start in range(0, len(records), size)]
        results: list[Result] = []
        for part, split, dropped in self._started().map(_tokenize_slice, slices):  # map keeps the input order
            results += part
            self.chat.split_turn_samples += split
            self.chat.dropped_turns += dropped
        return results

    def _started(self) -> ProcessPoolExecutor:
        if self._pool is None:
            get_logger().info("tokenizing in %d worker processes (%s)", self.workers, WORKERS_ENV)
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start_worker, initargs=(self.chat,))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
